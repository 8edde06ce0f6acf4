"""The FX tracing flag per thread (hazard global-fx-tracing-flag): before 2.14, ``torch.fx`` keeps
"is tracing" in one module global, so one thread's symbolic trace makes Dynamo in every other
thread refuse to compile. The wrappers of patches ``fx_trace_marks_thread``,
``fx_symbolic_tracing_per_thread`` and ``fx_tracing_per_thread`` (``_patches.PATCHES``) count
traces per thread and answer upstream's two questions from this thread's own count.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from threadgraph._per_thread import ThreadCount


_fx_tracing = ThreadCount()  # FX traces the calling thread is inside


def fx_trace_marks_thread(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    _fx_tracing.value += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _fx_tracing.value -= 1


# Upstream's rules, on this thread's own tracing instead of any thread's.
def fx_tracing_in_this_thread(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> bool:
    return _fx_tracing.value > 0


def fx_symbolic_tracing_in_this_thread(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> bool:
    return _fx_tracing.value > 0 and not torch.compiler.is_compiling()
