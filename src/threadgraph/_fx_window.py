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
``wait_for_other_traces``: while another thread's window is open the frame waits, its device slots
given up, and when cached code fits once the trace is over, that call runs uncompiled this once
(its nested frames from the cache) instead of compiling the same code again. Calls that hit their
cache never wait. A thread inside a trace of its own does not wait, and a trace's fake ops pass the
eager fence without waiting (``_fence``), so a capturing thread that waits for a trace never waits
for a thread that waits for its capture. Limits: eager module calls of
other threads during a trace still go through FX's wrapper; two traces at once in two threads
break each other upstream (one ``CURRENT_PATCHER``); a miss inside a whole-step capture records
that call's frame uncompiled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, ContextManager, Iterator

from ._gate import DEFAULT_TIMEOUT_S, released
from ._tls import current_worker, doing

log = logging.getLogger("threadgraph")

_changed = threading.Condition()
_open: dict[int, tuple[str, int]] = {}  # thread ident -> (thread name, windows open in it)
_waiting: dict[int, str] = {}  # thread ident -> name, of the threads waiting for others' windows


def _forget_after_fork() -> None:
    # The child has only the forking thread: the others' windows will never close there.
    global _changed
    _changed = threading.Condition()
    _open.clear()
    _waiting.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_after_fork)


@contextlib.contextmanager
def _window(patcher: ContextManager[Any]) -> Iterator[Any]:
    ident = threading.get_ident()
    with _changed:
        name, depth = _open.get(ident, (threading.current_thread().name, 0))
        _open[ident] = (name, depth + 1)
    try:
        with patcher as inner:
            yield inner
    finally:
        with _changed:
            name, depth = _open.get(ident, (None, 1))  # absent after a fork inside the trace
            if depth > 1:
                _open[ident] = (name, depth - 1)
            else:
                _open.pop(ident, None)
                _changed.notify_all()


def trace_window(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> ContextManager[Any]:
    """``torch.fx._symbolic_trace._new_patcher``: the same patcher, its lifetime a window."""
    return _window(wrapped(*args, **kwargs))


def _others(me: int) -> list[str]:
    return [name for ident, (name, _) in _open.items() if ident != me]


def wait_for_other_traces() -> bool:
    """Wait until no other thread is inside an FX trace (at once when none is: one dict check);
    whether one was."""
    # Inside its own trace a thread goes on: a trace elsewhere may wait for what this one holds.
    if not _open or tracing_here():
        return False
    me = threading.get_ident()
    with _changed:
        tracing = _others(me)
    if not tracing:
        return False
    state = current_worker()
    started = time.perf_counter()
    with released(), doing(state, f"waiting for {tracing[0]}'s FX trace"):
        with _changed:
            _waiting[me] = threading.current_thread().name
            try:
                ended = _changed.wait_for(lambda: not _others(me), timeout=DEFAULT_TIMEOUT_S)
            finally:
                del _waiting[me]
    if state is not None:
        state.turn_wait_seconds += time.perf_counter() - started
    if not ended:
        log.warning("threadgraph: waited %g s for an FX trace in %s to end; going on (this call may compile "
                    "its code again)", DEFAULT_TIMEOUT_S, ", ".join(tracing))
    return True


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
        return {name: depth for name, depth in _open.values()}
