"""Deterministic hand-off from target workers to drafter workers, and gradient averaging.

Global batch b (per process) goes from target worker b % T to drafter worker b % D, and every
inbox receives its batches in index order. Producers run ahead freely and only take turns at
the put, so the work is parallel but the data each drafter sees does not depend on thread
timing: a run, and a resumed run, see the same batches in the same order.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch
import torch.distributed as dist

import threadgraph

from .channel import Channel, ChannelClosed


class OrderedInbox:
    """A drafter's bounded inbox that accepts batch indices in order (b = d, d+D, d+2D, ...)."""

    def __init__(self, first_index: int, stride: int, capacity: int) -> None:
        self.channel = Channel(capacity)
        self._next = first_index
        self._stride = stride
        self._turn = threading.Condition()
        self._error: Optional[BaseException] = None

    def put(self, index: int, item: Any) -> None:
        with threadgraph.released(), self._turn:
            while self._next != index and self._error is None:
                self._turn.wait()
            if self._error is not None:
                raise ChannelClosed(f"inbox closed: {self._error!r}") from self._error
            self.channel.put(item)  # blocks while full: backpressure on this producer
            self._next += self._stride
            self._turn.notify_all()

    def get(self, device: torch.device) -> Any:
        with threadgraph.released():
            return self.channel.get(device=device)

    def fail(self, error: BaseException) -> None:
        # The channel first: a producer blocked in channel.put holds _turn until it is woken.
        self.channel.fail(error)
        with self._turn:
            self._error = error
            self._turn.notify_all()


class GradientAverager:
    """All-reduce of gradients over the drafter replicas of this process and, with
    torch.distributed, over processes (only replica 0 talks to the process group).

    All replicas on one device share its default stream, and stream order follows the barrier
    order, so no extra events are needed; copies across devices are ordered by PyTorch against
    the current streams of both devices.
    """

    def __init__(self, replicas: int) -> None:
        self.replicas = replicas
        self._barrier = threading.Barrier(replicas)
        self._flats: list[Optional[torch.Tensor]] = [None] * replicas
        self._total: Optional[torch.Tensor] = None

    def abort(self, _error: BaseException | None = None) -> None:
        self._barrier.abort()

    def _wait(self) -> None:
        with threadgraph.released():
            self._barrier.wait()

    def average(self, replica: int, params: list[torch.Tensor], extras: torch.Tensor) -> torch.Tensor:
        """Replace each ``p.grad`` by the mean over all replicas; returns the mean of ``extras``."""
        flat = torch.cat([p.grad.reshape(-1).float() for p in params] + [extras.reshape(-1).float()])
        self._flats[replica] = flat
        self._wait()
        if replica == 0:
            total = flat.clone()
            for other in self._flats[1:]:
                total += other.to(total.device, non_blocking=True)
            world = 1
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(total)
                world = dist.get_world_size()
            self._total = total.div_(self.replicas * world)
        self._wait()
        mean = self._total if replica == 0 else self._total.to(flat.device, non_blocking=True)
        offset = 0
        for p in params:
            n = p.grad.numel()
            p.grad.copy_(mean[offset:offset + n].view_as(p.grad))
            offset += n
        # A third wait keeps replica 0 from overwriting _total while others still copy from it.
        result = mean[offset:].clone()
        self._wait()
        return result
