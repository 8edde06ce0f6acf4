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
from .drafter.grads import FlatGrads
from .run.control import RunControl


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


class Handoff:
    """The hand-off of one process: global batch b goes to drafter b % D, through that drafter's
    OrderedInbox; a resumed run starts at the first batch of step ``first_step``."""

    def __init__(self, drafters: int, *, first_step: int, capacity: int) -> None:
        self.inboxes = [OrderedInbox(first_index=first_step * drafters + d, stride=drafters, capacity=capacity)
                        for d in range(drafters)]

    def put(self, index: int, item: Any) -> None:
        self.inboxes[index % len(self.inboxes)].put(index, item)

    def get(self, drafter: int, device: torch.device) -> Any:
        return self.inboxes[drafter].get(device)

    def fail(self, error: BaseException) -> None:
        """Wake every worker blocked on the hand-off."""
        for inbox in self.inboxes:
            inbox.fail(error)


class GradientAverager:
    """All-reduce of the flat gradient buffers (``grads.FlatGrads``) of the drafter replicas of
    this process and, with torch.distributed, over processes (only replica 0 talks to the
    process group). Two barrier waits per step: all buffers written, then the mean in every buffer.

    Between the waits replica 0 alone does the work: a running mean into its own buffer, one
    ``lerp_`` pass per other replica (m += (b - m) / k: the division folded in), then a copy of it
    into every other buffer. For 3 replicas on one device that moves 10 buffers' worth of memory
    where summing into a new tensor, dividing and copying back into all 3 moved 16; a buffer is the
    drafter's whole gradient (about 2 GB at the 8B shape), so the bytes are the cost. (A replica on
    another device still comes over as a temporary copy first.) An infinite gradient makes the mean
    NaN rather than infinite: non-finite either way, which the trainer stops on.

    All of it is enqueued before the second wait, on the streams replica 0's thread sees as current:
    the default streams, which the replicas (worker threads that never set a stream) also run on, so
    every replica's later work comes after it in stream order; PyTorch orders a copy across devices
    against both devices' current streams. A replica stepping on a stream of its own would break this.
    """

    def __init__(self, replicas: int, *, control: Optional[RunControl] = None, watchdog: Any = None) -> None:
        self.replicas = replicas
        self._barrier = threading.Barrier(replicas)
        self._buffers: list[Optional[torch.Tensor]] = [None] * replicas
        # Across processes a second all-reduce, of one element, carries the votes: 1 from each
        # process that was asked to stop (SIGINT/SIGTERM) before this average. Its sum is the same
        # on every rank, so all ranks stop after the same step (``RunControl.should_stop``).
        self._control = control if control is not None else RunControl()
        self._watchdog = watchdog
        self._averages = 0

    def abort(self, _error: BaseException | None = None) -> None:
        self._barrier.abort()

    def _wait(self) -> None:
        with threadgraph.released():
            self._barrier.wait()

    def average(self, replica: int, grads: FlatGrads) -> None:
        """Replace ``grads.buffer`` (gradients and extras) by its mean over all replicas."""
        self._buffers[replica] = grads.buffer
        self._wait()
        if replica == 0:
            self._reduce(grads.buffer)
        self._wait()

    def _reduce(self, own: torch.Tensor) -> None:
        """Replica 0's part: the mean into ``own``, then into every other replica's buffer."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        for k, other in enumerate(self._buffers[1:], start=2):
            own.lerp_(other.to(own.device, non_blocking=True), 1.0 / k)  # the mean of the first k
        if world > 1:
            vote = torch.full((1,), self._control.vote(), dtype=own.dtype, device=own.device)
            self._averages += 1
            if self._watchdog is not None:
                self._watchdog.entering(self._averages)
            dist.all_reduce(own)  # in place: no copy of the buffer into a wider one and back
            dist.all_reduce(vote)
            if self._watchdog is not None:
                self._watchdog.left()
            self._control.agree(vote)
            own.div_(world)
        for other in self._buffers[1:]:
            other.copy_(own, non_blocking=True)
