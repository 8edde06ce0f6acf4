"""A drafter replica: one data-parallel copy of the drafter and everything that trains it.

It owns the drafter, its flat gradient buffer, AdamW and the learning-rate schedule, and two
device-only calls per step: ``forward_backward(batch)`` fills the gradients (and the step's
metrics), ``update()`` clips, steps AdamW and the schedule, and writes the step's row of
``history``. Between the two the caller averages ``grads`` over the replicas
(routing.GradientAverager); the execution policy decides whether each call is eager, CUDAGraph
Trees or one captured CUDA graph. ``train_step`` is those three in order, the one step that the
drafter worker thread and the benchmark's sequential loop both call.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..run.checkpoint import Checkpointer
from ..config import TrainConfig
from .grads import FlatGrads, make_optimizer
from .model import DFlashDrafter
from ..policy import ExecutionPolicy
from ..schedule import Schedule
from .step import METRIC_NAMES, make_forward_backward, make_step_fn, make_update
from ..target import TargetModel


class DrafterReplica:
    def __init__(self, config: TrainConfig, policy: ExecutionPolicy, schedule: Schedule, target: TargetModel,
                 checkpointer: Optional[Checkpointer] = None) -> None:
        # The drafter borrows the frozen embedding and LM head of ``target``, on its device.
        device = target.device
        # Identical initial weights in every replica and process, whatever other threads do.
        drafter = DFlashDrafter.from_target_config(
            target.config, target.embed_tokens, target.lm_head, config.num_draft_layers, config.num_feature_layers,
            generator=torch.Generator().manual_seed(config.seed),
        )
        self.total_steps = schedule.total_steps
        self.step = checkpointer.start_step if checkpointer is not None else 0  # optimizer steps done
        self.drafter = drafter.to(device)
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.grads = FlatGrads(params, extras=len(METRIC_NAMES))
        self.optimizer = make_optimizer(params, lr=config.lr, weight_decay=config.weight_decay,
                                        capturable=policy.captures)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule.lr_factor)
        if checkpointer is not None:
            checkpointer.restore(self.drafter, self.optimizer, self.scheduler)
        step_fn = policy.compile(
            make_step_fn(self.drafter, block_size=config.block_size, gamma=config.gamma_value,
                         mask_token_id=target.mask_token_id, autocast_dtype=policy.autocast_dtype)
        )
        self._forward_backward = policy.graph(make_forward_backward(step_fn, self.grads))
        # [loss, weight_sum, acc, acc_k1, grad_norm] per step, read by the training log now and then.
        self.history = torch.zeros(schedule.total_steps, len(METRIC_NAMES) + 1, device=device)
        self._update = policy.graph(make_update(self.grads, self.optimizer, self.history, max_norm=config.grad_clip,
                                                first_step=self.step))

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps

    def forward_backward(self, batch: dict[str, torch.Tensor]) -> None:
        self._forward_backward(batch["ids"], batch["loss_mask"], batch["features"], batch["anchors"], batch["keep"])

    def train_step(self, batch: dict[str, torch.Tensor], *, average: Optional[Callable[[FlatGrads], Any]] = None,
                   mark: Optional[Callable[[str], Any]] = None) -> None:
        """One optimizer step on ``batch``: forward-backward, ``average(grads)`` if given (the mean
        over the replicas, in place), then the update. ``mark(phase)`` is called after
        "forward_backward", "average" (only with ``average``) and "optimizer"."""
        self.forward_backward(batch)
        if mark is not None:
            mark("forward_backward")
        if average is not None:
            average(self.grads)
            if mark is not None:
                mark("average")
        self.update()
        if mark is not None:
            mark("optimizer")

    def update(self) -> None:
        self._update()
        self.scheduler.step()
        self.step += 1
