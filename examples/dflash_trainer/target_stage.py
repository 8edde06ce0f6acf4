"""A target stage: the frozen target on one device (shared with the other components there), and
its step for a batch (the features the drafter reads, and the batch's anchors), compiled or
captured as the execution policy says.

``step`` is the whole of one batch's target work; the target worker thread and the benchmark's
sequential loop both call it, so the two cannot drift apart.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .data.records import ShardBatches
from .policy import ExecutionPolicy
from .drafter.loss import anchors_from_scores
from .drafter.step import make_target_step
from .target import TargetModel


class TargetStage:
    def __init__(self, target: TargetModel, policy: ExecutionPolicy, *, num_anchors: int) -> None:
        self.device = target.device
        self.target = target
        self._step = policy.graph(policy.compile(make_target_step(self.target.features, num_anchors)))

    def step(self, batches: ShardBatches,
             mark: Optional[Callable[[str], Any]] = None) -> tuple[int, dict[str, torch.Tensor]]:
        """(b, the hand-off item of b) for the next batch b of ``batches``: its host data and anchor
        draws, then ``forward`` on the device. ``mark(phase)`` is called after "prepare" and "forward"."""
        b, *host = batches.next()
        inputs = self.to_device(*host)
        if mark is not None:
            mark("prepare")
        item = self.forward(*inputs)
        if mark is not None:
            mark("forward")
        return b, item

    def to_device(self, *host: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t.to(self.device, non_blocking=True) for t in host)

    def forward(self, ids: torch.Tensor, loss_mask: torch.Tensor, scores: torch.Tensor) -> dict[str, torch.Tensor]:
        """The hand-off item of one batch: ids, loss_mask, features, anchors and keep, on the device.
        ``scores`` are the batch's anchor draws (data.ShardBatches)."""
        features, anchors, keep = self._step(ids, loss_mask, scores)
        # Graph outputs are overwritten by the next replay: the drafter gets copies.
        return {"ids": ids, "loss_mask": loss_mask, "features": features.clone(), "anchors": anchors.clone(),
                "keep": keep.clone()}


def example_item(target: TargetModel, host: tuple[torch.Tensor, ...], num_anchors: int) -> dict[str, torch.Tensor]:
    """A hand-off item of the same keys, shapes, dtypes and layout as ``TargetStage.forward``'s,
    without running the target: a batch's host data ``host`` (ids, loss mask and anchor draws, as
    ``ShardBatches.next`` gives them; anchors derived as the target step does) with zero features.
    A drafter compiles its step on it while the targets compile theirs, instead of after their
    first batch arrives."""
    ids, loss_mask, scores = (t.to(target.device) for t in host)
    anchors, keep = anchors_from_scores(loss_mask, num_anchors, scores)
    features = torch.zeros(*ids.shape, target.feature_width, dtype=target.dtype, device=target.device)
    return {"ids": ids, "loss_mask": loss_mask, "features": features, "anchors": anchors.contiguous(),
            "keep": keep.contiguous()}
