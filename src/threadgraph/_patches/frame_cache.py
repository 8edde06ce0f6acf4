"""Dynamo's frame callback and per-code cache, as the patch ``fx_trace_window`` reads them.

The one module that knows their shapes by release: a code's cache entries as they are now,
whether one of them fits a frame, what a callback returns to run a frame uncompiled once, whether
a callback compiles for ``fullgraph=True``, and whether the calling thread holds Dynamo's compile
lock. Where a release lacks a piece, each answer is the one that leaves Dynamo
to compile, as it would without the patch.
"""

from __future__ import annotations

import importlib
import logging
from types import CodeType
from typing import Any, Optional

import torch

log = logging.getLogger("threadgraph")


def backend_of(callback: Any) -> Any:
    """The backend Dynamo keys a callback's cache entries by: the end of its
    ``_torchdynamo_orig_backend`` chain, as Dynamo's C lookup follows it."""
    while hasattr(callback, "_torchdynamo_orig_backend"):
        callback = callback._torchdynamo_orig_backend
    return callback


def one_graph(callback: Any) -> bool:
    """Whether the callback (``CatchErrorsWrapper``) compiles for ``fullgraph=True`` or export,
    whose call fails when none of its frames ran compiled; True when this release does not say."""
    convert = getattr(callback, "_torchdynamo_orig_backend", None)
    convert = getattr(convert, "_inner_convert", convert)  # ConvertFrame wraps a ConvertFrameAssert
    flag = getattr(convert, "_one_graph", None)
    return True if flag is None else bool(flag)


def _usable(entry: Any, backend: Any) -> bool:
    # As Dynamo's own lookup: an invalidated entry (its guards replaced by a stand-in that passes)
    # and an entry of another backend never run.
    guards = getattr(entry, "guard_manager", None)
    if guards is None or hasattr(guards, "invalidation_reason") or getattr(entry, "code", None) is None:
        return False
    entry_backend = getattr(entry, "backend", backend)
    return entry_backend is backend


def entries(code: Optional[CodeType]) -> Optional[list]:
    """Dynamo's cache entries for ``code`` as they are now, newest first (None where this release
    cannot list them). Read afresh: an entry handed to the frame callback may be freed meanwhile
    by ``torch._dynamo.reset()``, and not every release links an entry to the next."""
    listed = getattr(torch._C._dynamo.eval_frame, "_debug_get_cache_entry_list", None)
    return None if listed is None or code is None else list(listed(code))


def compiled_codes(listed: list) -> list:
    """The compiled code objects of cache entries: held, they tell a later look whether these
    entries are still there (their ids cannot be reused while held)."""
    return [getattr(entry, "code", None) for entry in listed]


def cached_code_fits(listed: list, frame: Any, backend: Any) -> bool:
    """Whether one of the frame's cache entries (``entries``, read now) would run for ``backend`` and
    passes its guards on the frame's locals."""
    f_locals = getattr(frame, "f_locals", None)
    for entry in listed if f_locals is not None else ():
        check = getattr(getattr(entry, "guard_manager", None), "check", None)
        if check is None:
            return False
        try:
            if _usable(entry, backend) and check(f_locals):
                return True
        except Exception:  # a guard that cannot run here: the caller compiles, as without this check
            log.debug("threadgraph: a cached entry's guards did not run on %r", frame, exc_info=True)
            return False
    return False


def run_uncompiled_once() -> Any:
    """What a Dynamo frame callback returns to run this call of the frame as written, without
    compiling, and its nested frames from Dynamo's cache only, keeping nothing for later calls
    (None where ``torch._dynamo.types`` lacks the strategy types)."""
    types = importlib.import_module("torch._dynamo.types")
    names = ("ConvertFrameReturn", "FrameExecStrategy", "FrameAction")
    if not all(hasattr(types, name) for name in names) or not hasattr(types.FrameAction, "RUN_ONLY"):
        return None
    strategy = types.FrameExecStrategy(types.FrameAction.DEFAULT, types.FrameAction.RUN_ONLY)
    return types.ConvertFrameReturn(frame_exec_strategy=strategy, apply_to_code=False)


def holds_compile_lock() -> bool:
    """Whether the calling thread holds Dynamo's process-wide ``compile_lock`` (it is compiling:
    a backend that calls compiled code, say)."""
    lock = getattr(importlib.import_module("torch._dynamo.convert_frame"), "compile_lock", None)
    is_owned = getattr(lock, "_is_owned", None)
    return bool(is_owned()) if callable(is_owned) else False
