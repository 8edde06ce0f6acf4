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
