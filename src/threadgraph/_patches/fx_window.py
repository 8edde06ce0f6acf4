"""A cache miss during another thread's FX trace waits for it, then uses the cache (hazard global-fx-patcher).

An FX trace (``torch.fx.Tracer.trace``: ``symbolic_trace``, and ``make_fx``, which AOTAutograd
runs inside every compile) replaces ``nn.Module.__call__`` and ``__getattr__`` on the class, for
every thread, until it ends. Dynamo pins ``nn.Module.__call__`` in the guards of code that calls
it through a subclass's own ``__call__`` (transformers' decoder layers do), so a compiled call made
in another thread during the trace misses its cache, queues on the compile lock the tracing
compile holds, and compiles the same code again: identical workers each compile their step again
while a peer's compile traces. Dynamo reports it as BACKEND_MATCH (2.11) or as "runtime guards
failed even though they passed during recompilation-reason analysis", since the patch is gone by
then. A compile started during a trace would trace the patched ``__call__`` into its graph and
remove the trace's patches (``_maybe_revert_all_patches``).

``trace_window`` wraps FX's ``_new_patcher`` (the context in which those patches live) and counts,
per thread, the windows open. On a cache miss, the compile-frame patch calls
``instead_of_compiling``: while another thread's window is open the frame waits, its device slots
given up, and when cached code fits once the trace is over (an entry of this backend, not
invalidated, whose guards pass), that call runs uncompiled this once (its nested frames from the
cache) instead of compiling the same code again. It compiles, as without the patch, inside a
capture (the uncompiled frame's kernels would stay in the captured graph for good) and for
``fullgraph=True`` (a call with no compiled frame fails). Calls that hit their cache never wait.
A whole-step capture (``windows_held_off``) waits for traces open elsewhere and holds new ones
off until it ends, so the captured step finds its compiled code.
A thread inside a trace of its own, or inside a compile (holding Dynamo's compile lock, which the
trace may need), does not wait; a window a wait timed out on is not waited for again; a trace's
fake ops pass the eager fence without waiting (``_fence``). Limits: the call run uncompiled sees
``torch.compiler.is_compiling()`` False; a trace that does real fenced device work (a real
tensor's RNG op inside ``symbolic_trace``, an op without a fake kernel run for real) while a
capture waits for it waits for that capture: both go on after ``THREADGRAPH_GATE_TIMEOUT``, the
trace's op failing with ``GateTimeout``; eager module calls of other threads during a trace still
go through FX's wrapper; two traces at once in two threads break each other upstream (one
``CURRENT_PATCHER``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable, ContextManager, Iterator

from threadgraph._patches import frame_cache as _frame_cache
from threadgraph._device.gate import DEFAULT_TIMEOUT_S, in_exclusive_section, released
from threadgraph._device.tls import current_worker, doing

log = logging.getLogger("threadgraph")

_changed = threading.Condition()
_open: dict[int, tuple[str, int, int]] = {}  # thread ident -> (thread name, windows open in it, window serial)
_waiting: dict[int, str] = {}  # thread ident -> name, of the threads waiting for others' windows
_given_up: set[int] = set()  # serials of open windows a wait timed out on: no one waits for them again
_holding: dict[int, str] = {}  # thread ident -> name, of the threads capturing a whole step: no new window opens meanwhile
MAX_WAITS = 3  # captures in a row a trace waits for before it opens its window anyway
_serials = itertools.count(1)


def _forget_after_fork() -> None:
    # The child has only the forking thread: the others' windows will never close there.
    global _changed
    _changed = threading.Condition()
    _open.clear()
    _waiting.clear()
    _given_up.clear()
    _holding.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


@contextlib.contextmanager
def _window(patcher: ContextManager[Any]) -> Iterator[Any]:
    ident = threading.get_ident()
    # A thread holding a device exclusively never waits (the capture may need that device); one
    # whose wait timed out, or that waited for MAX_WAITS captures in a row, goes on.
    waits = MAX_WAITS if in_exclusive_section() else 0
    while True:
        with _changed:  # the check and the registration at once: no capture starts between them
            if ident in _open or waits >= MAX_WAITS or not _captures_elsewhere(ident):
                name, depth, serial = _open.get(ident, (threading.current_thread().name, 0, 0))
                _open[ident] = (name, depth + 1, serial or next(_serials))
                break
        waits = waits + 1 if _wait_for_captures(ident) else MAX_WAITS
    try:
        with patcher as inner:
            yield inner
    finally:
        with _changed:
            name, depth, serial = _open.get(ident, (None, 1, 0))  # absent after a fork inside the trace
            if depth > 1:
                _open[ident] = (name, depth - 1, serial)
            else:
                _open.pop(ident, None)
                _given_up.discard(serial)
                _changed.notify_all()


def _captures_elsewhere(me: int) -> list[str]:
    return sorted(name for ident, name in _holding.items() if ident != me)


def _wait_for_captures(me: int) -> bool:
    """In a thread about to open a window, its device slot given up: wait for other threads'
    whole-step captures to end (a window open meanwhile would make the captured step miss its
    cache); whether they did before the timeout."""
    with _changed:
        names = ", ".join(_captures_elsewhere(me))
    state = current_worker()
    with released(), doing(state, f"waiting for the whole-step capture in {names}"):
        with _changed:
            ended = _changed.wait_for(lambda: not _captures_elsewhere(me), timeout=DEFAULT_TIMEOUT_S)
    if not ended:
        log.warning("threadgraph: waited %g s for the whole-step capture in %s to end; tracing anyway (that capture "
                    "may fail to find its compiled code)", DEFAULT_TIMEOUT_S, names)
    return ended


@contextlib.contextmanager
def windows_held_off() -> Iterator[None]:
    """Around a whole-step capture: wait until no other thread is inside an FX trace, then let none
    start one until the capture ends, so the captured step finds its compiled code (a miss there
    would compile inside the capture, which 2.14+ refuses). Inside a trace or a compile of its own a
    thread holds nothing off; a compile inside the capture lifts the hold for its duration."""
    if tracing_here() or _frame_cache.holds_compile_lock():
        yield
        return
    me = threading.get_ident()
    _hold(me)
    try:
        yield
    finally:
        with _changed:
            _holding.pop(me, None)
            _changed.notify_all()


def _hold(me: int) -> None:
    """Wait for other threads' open windows to close, then hold new ones off (at once, under the lock)."""
    while True:
        wait_for_other_traces()
        with _changed:
            if not _others(me):
                _holding[me] = threading.current_thread().name
                return


@contextlib.contextmanager
def hold_lifted() -> Iterator[None]:
    """Around a compile: a capture compiling (its code missed for another reason) lets traces
    elsewhere go on, as they may hold the compile lock it needs; the hold comes back once the
    windows opened meanwhile have closed."""
    me = threading.get_ident()
    with _changed:
        lifted = _holding.pop(me, None) is not None
        if lifted:
            _changed.notify_all()
    try:
        yield
    finally:
        if lifted:
            _hold(me)


def trace_window(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> ContextManager[Any]:
    """``torch.fx._symbolic_trace._new_patcher``: the same patcher, its lifetime a window."""
    return _window(wrapped(*args, **kwargs))


def _others(me: int) -> dict[int, str]:
    """Serial -> thread name of the windows open in other threads that a wait would wait for."""
    return {serial: name for ident, (name, _, serial) in _open.items() if ident != me and serial not in _given_up}


def wait_for_other_traces() -> bool:
    """Wait until no other thread is inside an FX trace (at once when none is: one dict check);
    whether one was. Inside a trace of its own, or inside a compile (holding Dynamo's compile lock,
    which a trace elsewhere may be waiting for), a thread goes on at once."""
    if not _open or tracing_here() or _frame_cache.holds_compile_lock():
        return False
    me = threading.get_ident()
    with _changed:
        tracing = _others(me)
    if not tracing:
        return False
    state = current_worker()
    started = time.perf_counter()
    names = ", ".join(sorted(set(tracing.values())))
    with released(), doing(state, f"waiting for {names}'s FX trace"):
        with _changed:
            _waiting[me] = threading.current_thread().name
            try:
                ended = _changed.wait_for(lambda: not _others(me), timeout=DEFAULT_TIMEOUT_S)
                if not ended:
                    _given_up.update(_others(me))
            finally:
                del _waiting[me]
    if state is not None:
        state.turn_wait_seconds += time.perf_counter() - started
    if not ended:
        log.warning("threadgraph: waited %g s for an FX trace in %s to end; going on without waiting for it again "
                    "(this call may compile its code again)", DEFAULT_TIMEOUT_S, names)
    return True


def instead_of_compiling(callback: Any, frame: Any) -> Any:
    """On a cache miss (the compile-frame patch, before Dynamo compiles ``frame``): wait while other
    threads trace, then what the callback returns instead of compiling (the frame run uncompiled
    once), or None to compile."""
    code = getattr(frame, "f_code", None)
    listed = _frame_cache.entries(code) if _open else None
    before = None if listed is None else _frame_cache.compiled_codes(listed)
    if not wait_for_other_traces():
        return None
    uncompiled = _frame_cache.run_uncompiled_once()
    listed = _frame_cache.entries(code)
    if uncompiled is None or listed is None:
        return None
    now = _frame_cache.compiled_codes(listed)
    if before is not None and any(c is not None and all(c is not n for n in now) for c in before):
        # An entry Dynamo handed this call is gone (torch._dynamo.reset() meanwhile): compiling
        # would read freed entries, so the frame runs uncompiled.
        return uncompiled
    if in_exclusive_section() or _frame_cache.one_graph(callback):
        # A capture would keep the uncompiled frame's kernels for good; a fullgraph=True call
        # fails when none of its frames ran compiled. Both compile, as without the patch.
        return None
    return uncompiled if _frame_cache.cached_code_fits(listed, frame, _frame_cache.backend_of(callback)) else None


def tracing_here() -> bool:
    """Whether the calling thread is inside an FX trace of its own."""
    return bool(_open) and threading.get_ident() in _open


def waiting() -> list[str]:
    """Names of the threads waiting for another thread's trace to end (diagnostics and tests)."""
    with _changed:
        return sorted(_waiting.values())


def open_windows() -> dict[str, int]:
    """Thread name -> FX trace windows open in it (diagnostics and tests)."""
    with _changed:
        return {name: depth for name, depth, _ in _open.values()}


def holding() -> list[str]:
    """Names of the threads holding new FX traces off for a whole-step capture (diagnostics and tests)."""
    with _changed:
        return sorted(_holding.values())
