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

from . import _frame_cache
from ._gate import DEFAULT_TIMEOUT_S, in_exclusive_section, released
from ._tls import current_worker, doing

log = logging.getLogger("threadgraph")

_changed = threading.Condition()
_open: dict[int, tuple[str, int, int]] = {}  # thread ident -> (thread name, windows open in it, window serial)
_waiting: dict[int, str] = {}  # thread ident -> name, of the threads waiting for others' windows
_given_up: set[int] = set()  # serials of open windows a wait timed out on: no one waits for them again
_serials = itertools.count(1)


def _forget_after_fork() -> None:
    # The child has only the forking thread: the others' windows will never close there.
    global _changed
    _changed = threading.Condition()
    _open.clear()
    _waiting.clear()
    _given_up.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


@contextlib.contextmanager
def _window(patcher: ContextManager[Any]) -> Iterator[Any]:
    ident = threading.get_ident()
    with _changed:
        name, depth, serial = _open.get(ident, (threading.current_thread().name, 0, 0))
        _open[ident] = (name, depth + 1, serial or next(_serials))
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
