"""A bounded, closable channel from target workers (producers) to drafter workers
(consumers), with a CUDA hand-off that never synchronizes the host.

Invariant of the hand-off: ``put(item)`` records a CUDA event on the producer's
current stream of the item's device, after all the work that wrote the item was
enqueued. ``get(device=...)`` makes the consumer's current streams wait on that
event before anything reads the tensors (copy included), so the consumer sees the
finished values although no one called ``synchronize``. The source tensors are
``record_stream``-ed on the consumer's stream, so the caching allocator does not
hand their memory to the producer again before the consumer's copy has run.

When the consumer's current stream of the item's device is the producer's (the same device
and both on its default stream, as in the trainer), ``get`` hands the item over as it is: stream
order already runs the consumer's reads after the producer's writes, and the caching allocator
reuses the memory in that same order. No wait, no ``record_stream``: in a threaded pipeline each
of those ops is a GIL hand-off.

Ownership: after ``put`` the producer must not write to the item's tensors again
(the consumer may still be reading them asynchronously); allocate new ones. On the
source device itself ``get`` hands over the very same tensors (no copy).

Lifecycle: ``close()`` is a graceful end (puts fail, gets drain what is queued and
then fail); ``fail(exc)`` is an abort (queued items are dropped and every blocked
or later put/get raises at once), so one failing worker never leaves others
blocked forever.

Not built on threadgraph's GroupQueue (``WorkerGroup.queue()``): a stopped GroupQueue keeps its
queued batches, and so their device memory, and wakes its waiters with a bare GroupStopped,
whereas ``fail`` drops the batches at once and hands the failing worker's error on
(``ChannelFailed.error``), and a GroupQueue exists only once its group does, while the hand-off
is built first, to be passed to the workers the group is made of.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

import torch

__all__ = ["Channel", "ChannelClosed", "ChannelFailed"]


class ChannelClosed(Exception):
    """The channel was closed: no more puts, and no more items to get."""


class ChannelFailed(ChannelClosed):
    """The channel was failed by a worker; ``error`` (also ``__cause__``) is why."""

    def __init__(self, message: str, error: BaseException):
        super().__init__(message)
        self.error = error


class _Envelope:
    __slots__ = ("item", "event", "stream", "device", "has_cpu_tensors")

    def __init__(self, item: Any, event: "torch.cuda.Event | None", stream: "torch.cuda.Stream | None",
                 device: torch.device | None, has_cpu_tensors: bool = False):
        self.item = item
        self.has_cpu_tensors = has_cpu_tensors
        self.event = event
        self.stream = stream  # the producer's stream, on which the event was recorded
        self.device = device  # the CUDA device of the item's tensors, None if on CPU


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    return obj


def _devices(item: Any) -> tuple[torch.device | None, bool]:
    """(the CUDA device of the item's tensors or None, whether it also holds CPU tensors)."""
    devices: set[torch.device] = set()
    _map_tensors(item, lambda t: devices.add(t.device))
    cuda = {d for d in devices if d.type == "cuda"}
    if len(cuda) > 1:
        raise ValueError(
            f"Channel.put: one item holds CUDA tensors on {sorted(map(str, cuda))}; the "
            "hand-off records one event on one device, so put one item per device")
    return next(iter(cuda), None), len(devices) > len(cuda)


class Channel:
    """Bounded FIFO of batches between threads.

    ``put`` blocks while ``capacity`` items are queued (backpressure on the
    producer); ``get`` blocks while none are. Timeouts raise :class:`TimeoutError`.
    """

    def __init__(self, capacity: int, name: str = "channel"):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"Channel {name!r}: capacity must be an int >= 1, got {capacity!r}")
        self.capacity = capacity
        self.name = name
        self._items: collections.deque[_Envelope] = collections.deque()
        lock = threading.Lock()
        self._not_full = threading.Condition(lock)
        self._not_empty = threading.Condition(lock)
        self._closed = False
        self._error: BaseException | None = None
        # How many threads wait inside put/get; read by tests and for diagnostics.
        self.waiting_putters = 0
        self.waiting_getters = 0

    # ------------------------------------------------------------------ state

    @property
    def closed(self) -> bool:
        return self._closed

    def __len__(self) -> int:
        with self._not_empty:
            return len(self._items)

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise ChannelFailed(
                f"Channel {self.name!r} was failed by a worker: {self._error!r}; stop this "
                "worker too (the original error is attached as .error)", self._error
            ) from self._error

    def close(self, exc: BaseException | None = None) -> None:
        """Graceful close, or with ``exc`` the same as :meth:`fail`. Idempotent; a
        failure is never downgraded to a graceful close."""
        with self._not_empty:
            self._closed = True
            if exc is not None and self._error is None:
                self._error = exc
                self._items.clear()  # an abort: drop queued batches (frees GPU memory)
            self._not_full.notify_all()
            self._not_empty.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Abort: every blocked or later ``put``/``get`` raises :class:`ChannelFailed`."""
        if not isinstance(exc, BaseException):
            raise TypeError(f"Channel.fail needs an exception, got {type(exc).__name__}")
        self.close(exc)

    # --------------------------------------------------------------- put / get

    def put(self, item: Any, timeout: float | None = None) -> None:
        """Enqueue ``item`` (a dict/list/tuple of tensors, or any object).

        CUDA tensors get an event recorded now on the current stream of their
        device, so call this after the work that produced them was enqueued."""
        device, has_cpu_tensors = _devices(item)
        event = stream = None
        if device is not None:
            event, stream = torch.cuda.Event(), torch.cuda.current_stream(device)
            event.record(stream)
        envelope = _Envelope(item, event, stream, device, has_cpu_tensors)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_full:
            self.waiting_putters += 1
            try:
                while True:
                    self._raise_if_failed()
                    if self._closed:
                        raise ChannelClosed(
                            f"Channel {self.name!r}: put() after close(); the consumers are "
                            "gone or finishing, so stop producing")
                    if len(self._items) < self.capacity:
                        break
                    remaining = _remaining(deadline)
                    if remaining == 0:
                        raise TimeoutError(
                            f"Channel {self.name!r}: put() waited {timeout}s with the "
                            f"channel full ({self.capacity} items); the consumers are "
                            "stalled or too slow")
                    self._not_full.wait(remaining)
            finally:
                self.waiting_putters -= 1
            self._items.append(envelope)
            self._not_empty.notify()

    def get(self, timeout: float | None = None,
            device: torch.device | str | None = None) -> Any:
        """Dequeue the oldest item; with ``device``, its tensors moved there.

        Raises :class:`ChannelClosed` once the channel is closed and drained, and
        :class:`ChannelFailed` at once after :meth:`fail`."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_empty:
            self.waiting_getters += 1
            try:
                while True:
                    self._raise_if_failed()
                    if self._items:
                        break
                    if self._closed:
                        raise ChannelClosed(f"Channel {self.name!r} is closed and drained")
                    remaining = _remaining(deadline)
                    if remaining == 0:
                        raise TimeoutError(
                            f"Channel {self.name!r}: get() waited {timeout}s with the "
                            "channel empty; the producers are stalled or too slow")
                    self._not_empty.wait(remaining)
            finally:
                self.waiting_getters -= 1
            envelope = self._items.popleft()
            self._not_full.notify()
        # Outside the lock: stream waits and copies may take a moment to enqueue.
        return _receive(envelope, None if device is None else torch.device(device))


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _receive(envelope: _Envelope, device: torch.device | None) -> Any:
    src = envelope.device
    if src is None:  # CPU item: nothing to wait for
        return envelope.item if device is None else _map_tensors(envelope.item,
                                                                lambda t: t.to(device))
    # The copy (or the consumer's direct use when device is None) runs on this thread's
    # current stream of the source device: a cross-device copy_ is enqueued there, and
    # it orders itself with the destination's current stream.
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    src_stream = torch.cuda.current_stream(src)
    same_place = device is None or (device == src and not envelope.has_cpu_tensors)
    if same_place and src_stream == envelope.stream:
        return envelope.item  # one stream: its order is the synchronisation (module docstring)
    src_stream.wait_event(envelope.event)
    if device is not None and device.type == "cuda":
        torch.cuda.current_stream(device).wait_event(envelope.event)

    def move(t: torch.Tensor) -> torch.Tensor:
        if t.is_cuda:
            t.record_stream(src_stream)
        if device is None:
            return t
        if device.type == "cpu":
            # A non_blocking device-to-host copy returns before the data lands; the
            # consumer wants CPU values, so this copy is the synchronizing one.
            return t.to(device)
        return t.to(device, non_blocking=True)

    return _map_tensors(envelope.item, move)
