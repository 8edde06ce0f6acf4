"""A drafter replica's gradients as views of one flat buffer, with room for the step's metrics.

With one buffer the work around each backward is a few ops, whatever the number of parameters:
zeroing, averaging over replicas (``routing.GradientAverager``) and clipping. In a threaded
pipeline every eager op is a GIL hand-off between busy threads, so the op count is what matters.

Every backward (eager, CUDAGraph Trees, or a captured whole step) adds into an existing ``p.grad``
in place, so a captured graph writes into these same views at every replay.
"""

from __future__ import annotations

import torch


class FlatGrads:
    def __init__(self, params: list[torch.Tensor], extras: int) -> None:
        kinds = {(p.dtype, p.device) for p in params}
        if len(kinds) != 1:
            raise ValueError(f"FlatGrads: the trainable parameters must share one dtype and device, got {sorted(map(str, kinds))}")
        dtype, device = kinds.pop()
        self.params = params
        self.numel = sum(p.numel() for p in params)
        self.buffer = torch.zeros(self.numel + extras, dtype=dtype, device=device)
        self.grads = self.buffer[:self.numel]
        self.extras = self.buffer[self.numel:]
        self._views = []
        offset = 0
        for p in params:
            p.grad = self.buffer[offset:offset + p.numel()].view_as(p)
            self._views.append(p.grad)
            offset += p.numel()

    def zero_(self) -> None:
        """Zero gradients and extras before a backward; fails if anything replaced a ``p.grad``."""
        for index, (p, view) in enumerate(zip(self.params, self._views)):
            if p.grad is not view:
                raise RuntimeError(
                    f"FlatGrads: parameter {index} has a gradient that is not its view of the flat buffer "
                    "(something set p.grad or called optimizer.zero_grad(set_to_none=True)); averaging would "
                    "miss it. Zero gradients with FlatGrads.zero_() only")
        self.buffer.zero_()

    def clip_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients to a total 2-norm of at most ``max_norm`` (as clip_grad_norm_
        does); returns the norm before clipping, on the device (no host sync)."""
        norm = torch.linalg.vector_norm(self.grads)
        self.grads.mul_((max_norm / (norm + 1e-6)).clamp_(max=1.0))
        return norm


def make_optimizer(params: list[torch.Tensor], *, lr: float, weight_decay: float,
                   capturable: bool = False) -> torch.optim.Optimizer:
    """AdamW; fused on CUDA (one kernel launch for all parameters instead of a dozen foreach ops).
    ``capturable``: for a step captured in a CUDA graph, with the learning rate a device tensor
    that the schedule fills (a float would be frozen into the graph)."""
    if capturable:
        lr = torch.tensor(lr, dtype=torch.float32, device=params[0].device)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=weight_decay,
                             fused=params[0].is_cuda, capturable=capturable)


class GradAccumulator:
    """``--grad-accum N``: N micro-batches make one step, with the gradient of an N-times larger batch.

    Each micro-batch's loss is its ``sum(w * CE) / sum(w)``, so its gradient is ``G_i / W_i``; the
    larger batch's is ``sum(G_i) / sum(W_i)``. After micro-batch i this adds ``grads * W_i`` to a
    buffer of its own (the step's metrics too, the loss weighted alike), and after the last it writes
    the quotient back into ``grads``, ready for the average over replicas and the update. Device ops
    only: ``W_i`` is the weight sum the step left in ``grads.extras`` (drafter.step.METRIC_NAMES)."""

    def __init__(self, grads: FlatGrads, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"GradAccumulator needs at least 1 micro-batch a step, got {steps}")
        self.grads, self.steps = grads, steps
        self.total = torch.zeros_like(grads.buffer) if steps > 1 else None

    def add(self, micro: int) -> None:
        """Fold micro-batch ``micro`` (0 .. steps - 1) in; after the last, ``grads`` holds the step's."""
        if self.total is None:
            return
        g, total = self.grads, self.total
        loss, weight = g.extras[0:1], g.extras[1:2]
        if micro == 0:
            total.zero_()
        total[:g.numel].add_(g.grads * weight)
        total[g.numel:].add_(torch.cat([loss * weight, weight, g.extras[2:]]))
        if micro == self.steps - 1:
            weight_sum = total[g.numel + 1:g.numel + 2].clamp(min=1e-6)
            g.grads.copy_(total[:g.numel] / weight_sum)
            g.extras.copy_(torch.cat([total[g.numel:g.numel + 1] / weight_sum, total[g.numel + 1:g.numel + 2],
                                      total[g.numel + 2:] / self.steps]))
