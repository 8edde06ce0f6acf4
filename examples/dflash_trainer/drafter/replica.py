"""A drafter replica: one data-parallel copy of the drafter and everything that trains it.

It owns the drafter, its flat gradient buffer, AdamW and the learning-rate schedule (unless it
shares another replica's weights and steps, below), and two
device-only calls per step: ``forward_backward(batch)`` fills the gradients (and the step's
metrics), ``update()`` clips, steps AdamW and the schedule, and writes the step's row of
``history``. Between the two the caller averages ``grads`` over the replicas
(routing.GradientAverager); the execution policy decides whether each call is eager, CUDAGraph
Trees or one captured CUDA graph. ``train_step`` is those three in order, the drafter worker thread's
step; the benchmark's sequential loop (benchmarks/dflash_sequential.py) calls the two itself, with the
round's mean between them.

Replicas of one process on one device may share one copy of the weights (``SharedDrafterWeights``):
each keeps its own parameters (so its own gradients) as views of the same storage, and only one of
them, built with ``steps_optimizer``, steps AdamW on the mean; the others' ``update`` only counts
the step, and their ``history`` stays zeros (the stepping replica's holds the shared steps).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from ..run.checkpoint import Checkpointer
from ..run.metrics import HISTORY_ROWS
from ..config import TrainConfig
from .grads import FlatGrads, GradAccumulator, make_optimizer
from .model import DFlashDrafter
from ..policy import ExecutionPolicy
from ..run.schedule import Schedule
from .step import METRIC_NAMES, make_forward_backward, make_step_fn, make_update
from ..target import TargetModel
from ..export.init_from import PublishedDrafter, load_into


class SharedDrafterWeights:
    """One copy of the drafter's trainable weights a device, for the replicas of one process: the
    first replica placed on a device keeps its own; every later one's trainable parameters become
    views of that storage, before they would be copied to the device. An in-place optimizer step
    on any of them is then seen by all."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, list[torch.Tensor]] = {}
        self._stepped: set[torch.device] = set()
        self._lock = threading.Lock()

    def place(self, drafter: torch.nn.Module, device: torch.device, *, steps: bool) -> None:
        """Move ``drafter`` to ``device``, its trainable weights shared with the device's first;
        ``steps``: its replica steps them (one a device, or two AdamW steps would land on one copy)."""
        device = torch.device(device)
        params = [p for p in drafter.parameters() if p.requires_grad]
        with self._lock:
            if steps and device in self._stepped:
                raise ValueError(f"SharedDrafterWeights: a second replica that steps the weights on {device}; "
                                 "one replica a device steps them, the others share its steps")
            first = self._by_device.get(device)
            if first is not None and [p.shape for p in params] != [p.shape for p in first]:
                raise ValueError(f"SharedDrafterWeights: a drafter of other parameter shapes than the first on {device}")
            if steps:
                self._stepped.add(device)
            if first is not None:
                for mine, theirs in zip(params, first):
                    mine.data = theirs.data
            drafter.to(device)  # moves each parameter's data, keeping the Parameter objects
            if first is None:
                self._by_device[device] = params


class DrafterReplica:
    def __init__(self, config: TrainConfig, policy: ExecutionPolicy, schedule: Schedule, target: TargetModel,
                 checkpointer: Optional[Checkpointer] = None, *, weights: Optional[SharedDrafterWeights] = None,
                 steps_optimizer: bool = True, init: Optional[PublishedDrafter] = None) -> None:
        # The drafter borrows the frozen embedding and LM head of ``target``, on its device.
        device = target.device
        # Identical initial weights in every replica and process, whatever other threads do.
        drafter = DFlashDrafter.from_target_config(
            target.config, target.embed_tokens, target.lm_head, config.num_draft_layers, config.num_feature_layers,
            generator=torch.Generator().manual_seed(config.seed),
        )
        if init is not None:  # --init-from: a published drafter's weights instead of the random ones
            load_into(drafter, init)
        self.total_steps = schedule.total_steps
        self.step = checkpointer.start_step if checkpointer is not None else 0  # optimizer steps done
        if weights is not None:
            weights.place(drafter, device, steps=steps_optimizer)
        else:
            drafter.to(device)
        self.drafter = drafter
        self.compiles = policy.compiles
        params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.grads = FlatGrads(params, extras=len(METRIC_NAMES))
        # A replica that does not step the shared weights has no AdamW state to hold.
        self.optimizer: Optional[torch.optim.Optimizer] = None
        self.scheduler: Optional[torch.optim.lr_scheduler.LambdaLR] = None
        if steps_optimizer:
            self.optimizer = make_optimizer(params, lr=config.lr, weight_decay=config.weight_decay,
                                            capturable=policy.captures)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, schedule.lr_factor)
        if checkpointer is not None:
            checkpointer.restore(self.drafter, self.optimizer, self.scheduler)
        step_fn = policy.compile(
            make_step_fn(self.drafter, block_size=config.block_size, gamma=config.gamma_value,
                         mask_token_id=target.mask_token_id, autocast_dtype=policy.autocast_dtype,
                         loss_chunk_tokens=config.loss_chunk_tokens)
        )
        self.grad_accum = config.grad_accum  # micro-batches a step (GradAccumulator)
        self._accumulator = GradAccumulator(self.grads, config.grad_accum)
        self._forward_backward = policy.graph(make_forward_backward(step_fn, self.grads))
        # [loss, weight_sum, acc, acc_k1, grad_norm] of the latest steps (a ring), read by the training log.
        self.history = torch.zeros(min(schedule.total_steps, HISTORY_ROWS), len(METRIC_NAMES) + 1, device=device)
        self._update = None
        if self.optimizer is not None:
            self._update = policy.graph(make_update(self.grads, self.optimizer, self.history,
                                                    max_norm=config.grad_clip, first_step=self.step))

    @property
    def finished(self) -> bool:
        return self.step >= self.total_steps

    def forward_backward(self, batch: dict[str, torch.Tensor], micro: int = 0) -> None:
        """Gradients of micro-batch ``micro`` of the step; after the last of ``grad_accum`` of them
        ``grads`` holds the step's (the one micro-batch, without accumulation)."""
        self._forward_backward(batch["ids"], batch["loss_mask"], batch["features"], batch["anchors"], batch["keep"])
        self._accumulator.add(micro)

    def warm_up(self, item: dict[str, torch.Tensor]) -> None:
        """Forward-backward once on an example hand-off item, so that a compiled step (``compiles``)
        compiles and warms up before real batches arrive (with CUDAGraph Trees the first real
        call then records its graph). What it leaves in the gradients is zeroed by the next
        forward-backward, and the accumulator restarts at the next micro-batch 0; the weights and
        the optimizer are untouched."""
        self._forward_backward(item["ids"], item["loss_mask"], item["features"], item["anchors"], item["keep"])

    def train_step(self, batch: dict[str, torch.Tensor], *, average: Optional[Callable[[FlatGrads], Any]] = None,
                   updated: Optional[Callable[[], Any]] = None, mark: Optional[Callable[[str], Any]] = None,
                   micro: int = 0) -> None:
        """One optimizer step on ``batch``: forward-backward, ``average(grads)`` if given (the mean
        over the replicas, in place), the update, then ``updated()`` if given (returns once the
        shared weights are stepped). ``mark(phase)`` is called after "forward_backward",
        "average" (only with ``average``) and "optimizer". With ``--grad-accum N`` the step's first
        N - 1 micro-batches went through ``forward_backward(batch, micro)`` first, and ``batch`` is
        the last (``micro`` N - 1)."""
        self.forward_backward(batch, micro)
        if mark is not None:
            mark("forward_backward")
        if average is not None:
            average(self.grads)
            if mark is not None:
                mark("average")
        self.update()
        if updated is not None:
            updated()
        if mark is not None:
            mark("optimizer")

    def update(self) -> None:
        """Clip and step AdamW and the schedule (with ``steps_optimizer``), and count the step."""
        if self._update is not None:
            self._update()
            self.scheduler.step()
        self.step += 1
