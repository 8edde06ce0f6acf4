"""The FX tracing flag per thread (hazard global-fx-tracing-flag): before 2.14, ``torch.fx`` keeps
"is tracing" in one module global, so one thread's symbolic trace makes Dynamo in every other
thread refuse to compile. The wrappers of patches ``fx_trace_marks_thread``,
``fx_symbolic_tracing_per_thread`` and ``fx_tracing_per_thread`` (``_patches.PATCHES``) count
traces per thread and answer upstream's two questions from this thread's own count.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from threadgraph._per_thread import ThreadCount


_fx_tracing = ThreadCount()  # FX traces the calling thread is inside


# FX traces open in all threads together: while none is, no thread needs its own count read. A module
# global, not an attribute: is_fx_symbolic_tracing reads it on every call of a compiled function.
_open_traces = 0
_open_lock = threading.Lock()


def _add_open(step: int) -> None:
    global _open_traces
    with _open_lock:
        _open_traces += step


def fx_trace_marks_thread(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    _add_open(1)
    _fx_tracing.value += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _fx_tracing.value -= 1
        _add_open(-1)


# Upstream's rules, on this thread's own tracing instead of any thread's.
def fx_tracing_in_this_thread(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> bool:
    return _fx_tracing.value > 0


def fx_symbolic_tracing_in_this_thread(original: Callable[[], bool]) -> Callable[[], bool]:
    """``Patch.replace`` of ``is_fx_symbolic_tracing``, which Dynamo asks on every call of a compiled
    function: a plain function (a wrapt proxy costs about 1 us a call there) that reads this
    thread's count only while some thread traces."""

    def is_fx_symbolic_tracing() -> bool:
        return _open_traces > 0 and _fx_tracing.value > 0 and not torch.compiler.is_compiling()

    is_fx_symbolic_tracing.__threadgraph_original__ = original  # type: ignore[attr-defined]
    is_fx_symbolic_tracing.__wrapped__ = original  # type: ignore[attr-defined]
    return is_fx_symbolic_tracing
