"""A target stage: the frozen target on one device (shared with the other components there), and
its step for a batch (the features the drafter reads, and the batch's anchors), compiled or
captured as the execution policy says."""

from __future__ import annotations

import torch

from .policy import ExecutionPolicy
from .drafter.step import make_target_step
from .target import TargetModel


class TargetStage:
    def __init__(self, target: TargetModel, policy: ExecutionPolicy, *, num_anchors: int) -> None:
        self.device = target.device
        self.target = target
        self._step = policy.graph(policy.compile(make_target_step(self.target.features, num_anchors)))

    def to_device(self, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(self.device, non_blocking=True) for t in host)

    def forward(self, ids: torch.Tensor, loss_mask: torch.Tensor, scores: torch.Tensor) -> dict[str, torch.Tensor]:
        """The hand-off item of one batch: ids, loss_mask, features, anchors and keep, on the device.
        ``scores`` are the batch's anchor draws (data.ShardBatches)."""
        features, anchors, keep = self._step(ids, loss_mask, scores)
        # Graph outputs are overwritten by the next replay: the drafter gets copies.
        return {"ids": ids, "loss_mask": loss_mask, "features": features.clone(), "anchors": anchors.clone(),
                "keep": keep.clone()}
