"""The two kinds of worker thread: targets produce features, drafters train on them."""

from __future__ import annotations

import logging
import math

import torch

import threadgraph

from .grads import FlatGrads, make_optimizer
from .loss import anchor_scores
from .metrics import PhaseTimes
from .model import DFlashDrafter
from .run import Run
from .step import METRIC_NAMES, make_forward_backward, make_step_fn, make_target_step, make_update

log = logging.getLogger("dflash")


class TargetWorker(threadgraph.CompiledWorkerThread):
    """Runs the frozen target on its shard of the data and hands (ids, loss_mask, features,
    anchors, keep) for global batch b to drafter b % D."""

    def __init__(self, run: Run, index: int, device: str) -> None:
        super().__init__(device, name=f"target-{index}", warmup_steps=3)
        self.run_ctx, self.index = run, index
        self.phases = PhaseTimes()

    def setup(self) -> None:
        run = self.run_ctx
        self.target = run.load_target(self.device)  # WorkerGroup runs setups one at a time
        self.target_step = run.graph(run.compile(make_target_step(self.target.features, run.config.num_anchors)))
        self.stream = run.sample_stream(shard=self.index, num_shards=run.config.targets)
        # Skip what earlier steps consumed: our k-th batch is global batch k*T + index.
        first = run.start_step * run.config.drafters
        self.k = max(0, math.ceil((first - self.index) / run.config.targets))
        for _ in range(self.k):
            self.stream.next_batch()
        self.anchor_rng = torch.Generator()

    def step(self) -> None:
        run, cfg = self.run_ctx, self.run_ctx.config
        b = self.k * cfg.targets + self.index
        if b >= run.total_steps * cfg.drafters:
            self.stop()
            return
        self.phases.begin()
        ids, loss_mask = self.stream.next_batch()
        # Anchors depend on the batch index only, never on which thread consumes the batch.
        self.anchor_rng.manual_seed(run.anchor_seed(b))
        scores = anchor_scores(loss_mask, self.anchor_rng)
        ids, loss_mask, scores = (t.to(self.device, non_blocking=True) for t in (ids, loss_mask, scores))
        self.phases.mark("prepare")
        features, anchors, keep = self.target_step(ids, loss_mask, scores)
        self.phases.mark("forward")
        # Graph outputs are overwritten by the next replay: the drafter gets copies.
        item = {"ids": ids, "loss_mask": loss_mask, "features": features.clone(), "anchors": anchors.clone(),
                "keep": keep.clone()}
        run.inboxes[b % cfg.drafters].put(b, item)
        self.phases.mark("hand_off")
        self.k += 1


class DrafterWorker(threadgraph.CompiledWorkerThread):
    """One data-parallel replica of the drafter. Replica 0 also evaluates, logs and checkpoints."""

    def __init__(self, run: Run, index: int, device: str) -> None:
        super().__init__(device, name=f"drafter-{index}", warmup_steps=3)
        self.run_ctx, self.index = run, index
        self.phases = PhaseTimes()
        self.history = None

    def setup(self) -> None:
        run, cfg = self.run_ctx, self.run_ctx.config
        embed, lm_head = run.load_frozen_heads(self.device)  # WorkerGroup runs setups one at a time
        # Identical initial weights in every replica and process, whatever other threads do.
        drafter = DFlashDrafter.from_target_config(
            run.target_config, embed, lm_head, cfg.num_draft_layers, cfg.num_feature_layers,
            generator=torch.Generator().manual_seed(cfg.seed),
        )
        if self.index == 0 and self.run_ctx.rank == 0 and cfg.eval_every:
            run.eval_target = run.load_target(self.device)
        self.drafter = drafter.to(self.device)
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        self.grads = FlatGrads(self.params, extras=len(METRIC_NAMES))
        self.optimizer = make_optimizer(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay, capturable=run.captures)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, run.lr_lambda)
        run.restore(self.drafter, self.optimizer, self.scheduler)
        step_fn = run.compile(
            make_step_fn(self.drafter, block_size=cfg.block_size, gamma=cfg.gamma_value,
                         mask_token_id=run.mask_token_id, autocast_dtype=run.autocast_dtype)
        )
        self.forward_backward = run.graph(make_forward_backward(step_fn, self.grads))
        # [loss, weight_sum, acc, acc_k1, grad_norm] per step, read by the leader now and then.
        self.history = torch.zeros(run.total_steps, len(METRIC_NAMES) + 1, device=self.device)
        self.update = run.graph(make_update(self.grads, self.optimizer, self.history, max_norm=cfg.grad_clip,
                                            first_step=run.start_step))
        self.step_index = run.start_step
        if self.index == 0:
            run.leader_setup(self)

    def step(self) -> None:
        run = self.run_ctx
        s = self.step_index
        if s >= run.total_steps:
            self.stop()
            return
        self.phases.begin()
        batch = run.inboxes[self.index].get(self.device)
        self.phases.mark("wait_batch")
        self.forward_backward(batch["ids"], batch["loss_mask"], batch["features"], batch["anchors"], batch["keep"])
        self.phases.mark("forward_backward")
        run.averager.average(self.index, self.grads)
        self.phases.mark("average")
        self.update()
        self.scheduler.step()
        self.phases.mark("optimizer")
        self.step_index = s + 1
        if self.index == 0:
            run.leader_after_step(self, s + 1)
            self.phases.mark("leader")  # logging, eval and checkpoints: rare but long
