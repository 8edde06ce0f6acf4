"""torch 2.13+'s ``graph_capture_lock`` beside the device gate (hazard capture-lock-order).

Upstream holds one process-wide lock around a tree manager's set-up, each warm-up and each
recording, and threadgraph's wrappers take the device exclusively inside it. A worker that meets
the lock while holding its gate slot waits for the holder, and the holder waits for that slot to
leave: neither moves. The replacement gives up the calling thread's slots while it holds or waits
for the lock, and is re-entrant, so the manager set-up can take it before the gate: the lock always
comes first, then the gate.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, ContextManager

from threadgraph import _compat
from threadgraph._errors import GateTimeout, ThreadgraphError
from threadgraph._device.gate import DEFAULT_TIMEOUT_S, released


class CaptureLock:
    """A re-entrant stand-in for upstream's capture lock (the same lock underneath) that holds
    none of its thread's gate slots while it waits or is held."""

    def __init__(self, original: Any) -> None:
        self.__threadgraph_original__ = original
        self._lock = original
        self._owner: int | None = None
        self._owner_name = ""
        self._depth = 0
        self._slots: ContextManager | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        if self._owner == me:
            self._depth += 1
            return True
        slots = released()
        slots.__enter__()
        try:
            taken = self._take(blocking, timeout)
        except BaseException as exc:
            slots.__exit__(type(exc), exc, exc.__traceback__)
            raise
        if not taken:
            slots.__exit__(None, None, None)
            return False
        self._owner, self._owner_name, self._depth, self._slots = me, threading.current_thread().name, 1, slots
        return True

    def _take(self, blocking: bool, timeout: float) -> bool:
        if not blocking or timeout >= 0:
            return self._lock.acquire(blocking, timeout)
        limit = DEFAULT_TIMEOUT_S
        started = time.monotonic()
        while not self._lock.acquire(timeout=min(limit, 10.0)):
            waited = time.monotonic() - started
            if waited >= limit:
                name = threading.current_thread().name
                raise GateTimeout(
                    f"threadgraph: thread {name} waited {waited:.0f} s for torch's CUDA graph capture lock, "
                    f"held by {self._owner_name or 'a thread outside threadgraph'}; a warm-up or recording "
                    "there does not end. Raise THREADGRAPH_GATE_TIMEOUT if it is only slow",
                    thread_name=name, device="every device")
        return True

    def release(self) -> None:
        if self._owner != threading.get_ident():
            raise ThreadgraphError(f"threadgraph: thread {threading.current_thread().name} releases torch's "
                               "CUDA graph capture lock without holding it")
        self._depth -= 1
        if self._depth:
            return
        slots, self._slots, self._owner, self._owner_name = self._slots, None, None, ""
        self._lock.release()
        slots.__exit__(None, None, None)  # the slots come back outside the lock

    def locked(self) -> bool:
        return self._lock.locked()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def taken_first() -> ContextManager:
    """The installed CaptureLock, for a wrapper to take before the gate; else nothing (no lock,
    or upstream's own, which the wrapped call takes itself and which is not re-entrant)."""
    lock = getattr(_compat.cudagraph_trees(), "graph_capture_lock", None)
    return lock if isinstance(lock, CaptureLock) else contextlib.nullcontext()
