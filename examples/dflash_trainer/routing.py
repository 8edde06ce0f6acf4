"""Deterministic hand-off from target workers to drafter workers, and gradient averaging.

Global batch b (per process) goes from target worker b % T to drafter worker b % D, and every
inbox receives its batches in index order. Producers run ahead freely and only take turns at
the put, so the work is parallel but the data each drafter sees does not depend on thread
timing: a run, and a resumed run, see the same batches in the same order.
"""

from __future__ import annotations

import threading
from typing import Any, Optional, Sequence

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


def mean_into(own: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
    """The mean of ``own`` and ``others``, into ``own``: one ``lerp_`` pass per other (the mean of the
    first k is m + (b - m) / k, the division folded in); a buffer on another device comes over as a
    temporary copy first."""
    for k, other in enumerate(others, start=2):
        own.lerp_(other.to(own.device, non_blocking=True), 1.0 / k)


class GradientAverager:
    """All-reduce of the flat gradient buffers (``grads.FlatGrads``) of the drafter replicas of
    this process and, with torch.distributed, over processes (only replica 0 talks to the
    process group).

    ``owners`` are the replicas that step the optimizer (default: all). Replicas on one device
    may share one copy of the weights (``drafter.replica.SharedDrafterWeights``); then only the first of
    them steps it, and the others (followers) need neither the mean nor an update of their own.
    A step is ``average`` then, after the owners' updates, ``updated``:

    1. every replica's gradients are written (a barrier wait);
    2. replica 0 makes the mean in its own buffer: one ``lerp_`` pass per other replica
       (m += (b - m) / k: the division folded in), then copies it into the other owners' buffers;
       where such owners exist, a second wait lets them update only after the copy;
    3. ``updated``: with followers, a last wait, so that none reads the weights for its next step
       before its owner has stepped them, nor zeroes its buffer (its next forward-backward) before
       replica 0 has read it.

    A buffer is the drafter's whole gradient (about 2 GB at the 8B shape), so the bytes moved are
    the cost: for 3 replicas sharing one device's weights, 6 buffers' worth a step and one
    optimizer step, where averaging into all 3 and stepping each moved 10 and stepped 3 times.
    (A replica on another device comes over as a temporary copy first.) An infinite gradient
    makes the mean NaN rather than infinite: non-finite either way, which the trainer stops on.

    All of it is enqueued before the next wait, on the streams each thread sees as current: the
    default streams, which the replicas (worker threads that never set a stream) also run on, so
    every replica's later work comes after it in stream order; PyTorch orders a copy across devices
    against both devices' current streams. A replica stepping on a stream of its own would break this.
    """

    def __init__(self, replicas: int, *, owners: Optional[Sequence[int]] = None,
                 control: Optional[RunControl] = None, watchdog: Any = None) -> None:
        self.replicas = replicas
        self.owners = sorted(set(range(replicas) if owners is None else owners))
        if not self.owners or self.owners[0] != 0 or self.owners[-1] >= replicas:
            raise ValueError(f"GradientAverager: owners must include replica 0 and name replicas 0 - {replicas - 1}, "
                             f"got {list(owners or [])}")
        self._copy_to = self.owners[1:]  # the other owners, which update from the mean
        self._followers = replicas > len(self.owners)
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
        """Put the mean over all replicas of ``grads.buffer`` (gradients and extras) into the
        buffers of the owners; a follower's buffer is only read."""
        self._buffers[replica] = grads.buffer
        self._wait()
        if replica == 0:
            self._reduce(grads.buffer)
        if self._copy_to:
            self._wait()

    def updated(self) -> None:
        """Return once every owner has stepped (enqueued) its update; at once without followers."""
        if self._followers:
            self._wait()

    def _reduce(self, own: torch.Tensor) -> None:
        """Replica 0's part: the mean into ``own``, then into the other owners' buffers."""
        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        mean_into(own, self._buffers[1:])
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
        for k in self._copy_to:
            self._buffers[k].copy_(own, non_blocking=True)
