"""``torch.compiler.is_compiling()`` per thread (hazard global-compile-session-flag).

Since 2.13 Dynamo holds ``torch.compiler._is_compiling_flag``, one module global, True for the
whole of every compile (``_compile_session_context``), so code that AOTAutograd or a backend runs
outside Dynamo's trace sees ``is_compiling()`` True. Every other thread sees it True too: eager
code there takes its traced branch while any thread compiles. transformers' output collector
(``CompileableContextVar``) then moves from a ContextVar to a process global, and threads running
``output_hidden_states`` forwards at once take each other's hidden states.

The patch ``compile_flag_per_thread`` (``_patches.PATCHES``) replaces ``_compile_session_context``
with a session counted per thread (``SESSIONS``) and gives ``is_compiling`` the code of
``is_compiling_in_this_thread`` below. The function object stays the same: Dynamo recognises it
by identity and folds it to True while tracing, never calling it, so only eager calls run the
new code; the body keeps upstream's file name, so Dynamo's skip rules never trace it either. That
code runs with ``torch.compiler``'s globals and reads the session counter through the name
``_compile_session_context`` there, the patched object.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Iterator

import torch

from threadgraph._per_thread import ThreadCount


class PerThreadCompileSession:
    """Stands in for ``torch.compiler._compile_session_context``: ``with SESSIONS():`` marks the
    calling thread as compiling, not the process."""

    def __init__(self) -> None:
        self.depth = ThreadCount()  # compile sessions the calling thread is inside

    @contextlib.contextmanager
    def __call__(self) -> Iterator[None]:
        self.depth.value += 1
        try:
            yield
        finally:
            self.depth.value -= 1


SESSIONS = PerThreadCompileSession()


# The body that torch.compiler.is_compiling runs once patched. Its global names resolve in
# torch.compiler's namespace, not this module's: ``torch`` and ``_is_compiling_flag`` (still set
# process-wide by non-strict export) are upstream's, ``_compile_session_context`` is SESSIONS.
def is_compiling_in_this_thread() -> bool:
    if torch.jit.is_scripting():
        return False
    else:
        return _is_compiling_flag or _compile_session_context.depth.value > 0  # noqa: F821


def body_for(original: types.CodeType) -> types.CodeType:
    """The per-thread body under the original's file, line and name: Dynamo's skip rules (by file)
    still keep it out of traces, and ``inspect`` and TorchScript read upstream's source, which
    answers as this body does under scripting (False)."""
    return is_compiling_in_this_thread.__code__.replace(
        co_filename=original.co_filename, co_firstlineno=original.co_firstlineno, co_name=original.co_name,
        **({"co_qualname": original.co_qualname} if hasattr(original, "co_qualname") else {}))


def replacement(original: Any) -> Any:
    """``Patch.replace`` for both targets: the session object for ``_compile_session_context``,
    the per-thread body for ``is_compiling.__code__``."""
    if isinstance(original, types.CodeType):
        return body_for(original)
    SESSIONS.__threadgraph_original__ = original  # marks it threadgraph's for any registry
    return SESSIONS
