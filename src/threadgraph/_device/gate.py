"""The per-device capture protocol: shared slots for ordinary CUDA work, exclusive for capture.

Invariant: while any thread holds a device's gate exclusively (tree-manager init, eager
warmup in the graph pool, recording), no worker thread runs its own CUDA work on that
device. CUDA capture is device-wide in effect (the Philox generator, device synchronisation,
the allocator's pool state: hazard device-wide-capture), so work from other threads breaks it.

- A worker holds a *shared* slot on its device while its own thread does CUDA work
  (``CompiledWorkerThread`` holds one around ``setup()`` and each ``step()``).
- Capture paths take the gate *exclusively*: they wait until no shared slot is held.
  Waiting writers block new shared slots, so captures are not starved.
- A thread that holds shared slots and wants exclusive gives its slots up first (an upgrade),
  and gets them back without waiting when its exclusive section ends.
- A worker gives all its slots up while it waits in ``torch.autograd.backward``/``grad`` and
  in any ``released()`` block (blocking queue waits). Its backward, and any capture inside it,
  runs on autograd's device thread, which holds no slots.

Why this cannot deadlock: an exclusive waiter waits only for shared holders. A shared holder
only ever waits for (a) the GPU, (b) an exclusive holder (by upgrading, after dropping its own
slots), or (c) something else while in ``released()``/backward/a Dynamo compile, where it holds
nothing. (Dynamo compiles under one process-wide lock: a worker that kept its slots while queued
on it would stall every capture on the device behind the compiles.) So no shared holder waits
for anything that waits for it. An exclusive holder does not wait on other
workers (capture needs no other thread), except on the autograd device thread, which is in
backward on behalf of a worker that holds nothing. Waits are bounded by ``timeout``; on expiry
``GateTimeout`` names the holders instead of hanging.

Work of threads that are not workers is ordered by the eager fence (``fence.py``): each fenced
op (eager RNG, device synchronisation, ``empty_cache``) runs inside :func:`fenced`, a shared slot
held for that op alone. :func:`fenced` never waits while its thread holds anything (a thread
with slots on other devices gives them up first, one that holds a gate exclusively runs the op
directly), so it adds no edge to the wait graph above.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import threading
import time
import traceback
from typing import Iterator

from threadgraph._errors import GateTimeout, SettingError, ThreadgraphError
from threadgraph._per_thread import ThreadCount

log = logging.getLogger("threadgraph")
TIMEOUT_ENV = "THREADGRAPH_GATE_TIMEOUT"


def timeout_from_env(default: float = 600.0) -> float:
    """Seconds from ``THREADGRAPH_GATE_TIMEOUT`` (``default`` when unset).

    A bad value is a SettingError, never a fall back to the default: the variable is set on
    purpose, and a silent 600 s instead of the 10 s asked for leaves a stuck job hanging for ten
    minutes (or, instead of an hour asked for, kills a long capture), found only when it matters.
    """
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return default
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (math.isfinite(seconds) and seconds > 0):
        raise SettingError(
            f"threadgraph: {TIMEOUT_ENV}={raw!r} is not a timeout; it takes a number of seconds greater than 0 "
            f"(for example 600 or 0.5, no unit). Fix it, or unset it for the default of {default:.0f} s"
        )
    return seconds


try:
    DEFAULT_TIMEOUT_S = timeout_from_env()
    _setting_problem = None
except SettingError as _problem:
    # Importing still works, so a command line can say it in one line; every entry point that
    # would wait (install(), a worker, a gate) raises it first (check_timeout_setting), so this default
    # never serves in its place.
    DEFAULT_TIMEOUT_S, _setting_problem = 600.0, _problem


def check_timeout_setting() -> None:
    """Raise the SettingError of a bad ``THREADGRAPH_GATE_TIMEOUT`` (read at import).

    Importing threadgraph never fails on a bad value; the first use of a device's gate checks it
    first, and ``threadgraph.check_settings()`` (which :func:`install` calls) checks it with the
    other variables, so nothing waits with a default in place of the value asked for.
    """
    if _setting_problem is not None:
        raise SettingError(*_setting_problem.args)


class DeviceGate:
    def __init__(self, device: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        self.device = device
        self.timeout = timeout
        self._cond = threading.Condition(threading.Lock())
        self._shared: dict[int, int] = {}  # thread ident -> slot depth
        self._names: dict[int, str] = {}
        self._owner: int | None = None
        self._owner_depth = 0
        self._owner_saved_shared = 0
        self._exclusive_waiting = 0
        self.last_exclusive: str | None = None  # who last held the device exclusively (for error messages)

    # -- shared -------------------------------------------------------------------------
    def acquire_shared(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._shared.get(me) or self._owner == me:
                self._shared[me] = self._shared.get(me, 0) + 1
                return
            self._wait(lambda: self._owner is None and self._exclusive_waiting == 0, "a shared slot")
            self._shared[me] = 1
            self._names[me] = threading.current_thread().name

    def release_shared(self) -> None:
        me = threading.get_ident()
        with self._cond:
            depth = self._shared.get(me, 0)
            if depth <= 0:
                raise ThreadgraphError(f"threadgraph: thread {threading.current_thread().name} releases a shared slot of {self.device} it does not hold")
            if depth == 1:
                del self._shared[me]
                self._cond.notify_all()
            else:
                self._shared[me] = depth - 1

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        self.acquire_shared()
        try:
            yield
        except BaseException:
            # An inner restore (after released() or an upgrade) may have failed, leaving no slot
            # to give back; the error in flight says why, so do not mask it with a second one.
            with self._cond:
                held = self._shared.get(threading.get_ident(), 0) > 0
            if held:  # only this thread changes its own entry, so the answer still holds
                self.release_shared()
            raise
        self.release_shared()

    def drop_shared(self) -> int:
        """Give up all of this thread's slots at once; returns the depth to give back later."""
        me = threading.get_ident()
        with self._cond:
            depth = self._shared.pop(me, 0)
            if depth:
                self._cond.notify_all()
            return depth

    def restore_shared(self, depth: int) -> None:
        if depth:
            self.acquire_shared()
            with self._cond:
                self._shared[threading.get_ident()] += depth - 1

    # -- exclusive ----------------------------------------------------------------------
    def acquire_exclusive(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._owner_depth += 1
                _exclusive_depth.value += 1
                return
            saved = self._shared.pop(me, 0)  # upgrade: never wait while holding a slot
            if saved:
                self._cond.notify_all()
            self._exclusive_waiting += 1
            try:
                self._wait(lambda: self._owner is None and not self._shared, "exclusive use")
            except BaseException:
                if saved:
                    self._shared[me] = saved
                raise
            finally:
                self._exclusive_waiting -= 1
            self._owner, self._owner_depth, self._owner_saved_shared = me, 1, saved
            self._names[me] = self.last_exclusive = threading.current_thread().name
        _exclusive_depth.value += 1

    def release_exclusive(self) -> None:
        me = threading.get_ident()
        with self._cond:
            if self._owner != me:
                raise ThreadgraphError(f"threadgraph: thread {threading.current_thread().name} releases {self.device} exclusively without owning it")
            self._owner_depth -= 1
            _exclusive_depth.value -= 1
            if self._owner_depth == 0:
                self._owner = None
                if self._owner_saved_shared:
                    self._shared[me] = self._owner_saved_shared
                self._owner_saved_shared = 0
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        self.acquire_exclusive()
        try:
            yield
        finally:
            self.release_exclusive()

    def holds_shared(self) -> bool:
        """Whether the calling thread holds a shared slot (only this thread changes its entry)."""
        return threading.get_ident() in self._shared

    # -- introspection ------------------------------------------------------------------
    def holders(self) -> dict[str, object]:
        with self._cond:
            return {
                "exclusive": self._names.get(self._owner) if self._owner is not None else None,
                "shared": sorted(self._names.get(t, str(t)) for t in self._shared),
                "exclusive_waiting": self._exclusive_waiting,
            }

    def _wait(self, ready, what: str) -> None:
        deadline = time.monotonic() + self.timeout
        while not ready():
            left = deadline - time.monotonic()
            if left <= 0:
                holders = {
                    "exclusive": self._names.get(self._owner) if self._owner is not None else None,
                    "shared": sorted(self._names.get(t, str(t)) for t in self._shared),
                }
                name = threading.current_thread().name
                _log_stacks(f"threadgraph: {name} timed out waiting for {what} of {self.device}; holders {holders}")
                raise GateTimeout(
                    f"threadgraph: thread {name} waited {self.timeout:.0f} s for {what} of {self.device}; "
                    f"held by {holders}. A worker probably blocks (a queue wait, a join) while holding "
                    "its slot: wrap such waits in threadgraph.released(), or raise THREADGRAPH_GATE_TIMEOUT",
                    thread_name=name,
                    device=self.device,
                )
            self._cond.wait(left)


def _log_stacks(headline: str) -> None:
    """Log every thread's stack: a gate timeout is a stuck wait somewhere, and this says where."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = [headline]
    for ident, frame in sys._current_frames().items():
        parts.append(f"--- thread {names.get(ident, ident)} ---\n" + "".join(traceback.format_stack(frame)))
    log.error("\n".join(parts))


_gates: dict[str, DeviceGate] = {}
_gates_lock = threading.Lock()
_exclusive_depth = ThreadCount()  # how many exclusive sections the calling thread is inside


def gate_for(device: str) -> DeviceGate:
    gate = _gates.get(device)  # a dict read is atomic; creation takes the lock
    if gate is not None:
        return gate
    check_timeout_setting()  # before the first gate of a device, which waits with the timeout
    with _gates_lock:
        gate = _gates.get(device)
        if gate is None:
            gate = _gates[device] = DeviceGate(device)
        return gate


def in_exclusive_section() -> bool:
    """Whether the calling thread holds some device's gate exclusively (it is warming up or capturing)."""
    return _exclusive_depth.value > 0


@contextlib.contextmanager
def fenced(device: str) -> Iterator[None]:
    """Run one op outside every exclusive section of ``device``, waiting while its thread holds nothing.

    - inside an exclusive section of any device: run at once (the op belongs to that warmup or
      capture; waiting for another device's capture could close a cycle of captures);
    - holding a shared slot of ``device``: run at once (the slot already excludes captures);
    - holding slots of other devices only: give them all up, wait for ``device``, get them back;
    - holding nothing: wait for a shared slot of ``device``.
    """
    if in_exclusive_section():
        yield
        return
    gate = gate_for(device)
    if gate.holds_shared():
        yield
        return
    with _gates_lock:
        others = [g for g in _gates.values() if g is not gate]
    holds_other = any(g.holds_shared() for g in others)
    with (released() if holds_other else contextlib.nullcontext()), gate.shared():
        yield


@contextlib.contextmanager
def released() -> Iterator[None]:
    """A context manager: give up the calling thread's device-gate slots on every device for the
    duration of a block, and take them back after it.

    Use it around waits that may depend on another worker (queues, events, joins), so a capture
    elsewhere on the device can proceed meanwhile. A group's queues do it themselves.
    """
    with _gates_lock:
        gates = list(_gates.values())
    held = [(gate, gate.drop_shared()) for gate in gates]
    try:
        yield
    finally:
        for gate, depth in held:
            gate.restore_shared(depth)
