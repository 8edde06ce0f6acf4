"""Concurrent first calls of one compiled function compile it once (hazard concurrent-first-compile).

Dynamo looks a frame up in its code object's cache before it takes the process-wide compile lock,
and does not look again once it holds it. Threads that call the same compiled code for the first
time together all miss, queue on the lock, and each compiles the same frame again: the same
guards and the same graphs, N times the wait (Dynamo logs "Unexpected recompilation: runtime
guards failed even though they passed during recompilation-reason analysis"). Workers that run
one architecture on models of their own are that case: with nn.Modules inlined (the default since
torch 2.5), parameters are graph inputs and no guard pins a module object, so one compilation
serves every worker once it is in the cache.

``first_call_in_turn`` wraps what ``torch.compile`` returns (``OptimizeContext.__call__``; a
compiled module goes through it too, for its ``forward``). Calls of one compiled code take turns
until the code has settled: the first caller compiles; the others wait, their device slots given
up (``released()``), and then find the cache filled. A first call can change what the guards see
(a model that sets an attribute on its first forward recompiles on its second call), so the code
has settled only when a thread's second or later call of it compiled no frame; from then on a
call costs one set lookup. Each worker still warms up and records its own CUDA graphs in its own
pool (the per-worker cudagraphify state, hazard shared-cudagraphify-state).

The key of a turn is the code object of the compiled function, and for a bound method also the
type of its instance (every ``torch.compile(module)`` compiles ``Module.__call__``). Limits: a
call that waits for another thread inside the compiled function (at a graph break) before the code
settled holds the turn; a turn waited for longer than ``THREADGRAPH_GATE_TIMEOUT`` is given up with
a warning and the call compiles on its own. Recompilations once the code settled (new shapes) are
not ordered, and backward graphs, which AOTAutograd compiles on the first backward, neither.
Frame compiles are counted by the patch gate_release_in_compile (``note_compile``); without it a
code settles at any thread's second call.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import threading
import time
from typing import Any, Callable, Hashable, Optional

import torch

from threadgraph import _compat
from threadgraph._patches.fx_window import tracing_here
from threadgraph._device.gate import DEFAULT_TIMEOUT_S, released
from threadgraph._device.tls import current_worker, doing

log = logging.getLogger("threadgraph")


@dataclasses.dataclass
class _Turn:
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    holder: Optional[str] = None  # the thread making the first call
    holder_ident: Optional[int] = None


_turns: dict[Hashable, _Turn] = {}
_done: set[Hashable] = set()  # settled keys: their calls pass straight through


class _ThreadState(threading.local):
    """This thread's frame compiles, and its calls of each unsettled key (class defaults: see _per_thread)."""

    compiles = 0
    calls = None


_local = _ThreadState()


def note_compile() -> None:
    """Count one Dynamo frame compile of the calling thread (called by the compile-frame patch)."""
    _local.compiles += 1


def _compiles() -> int:
    return _local.compiles


def _calls() -> dict:
    calls = _local.calls
    if calls is None:
        calls = _local.calls = {}
    return calls


def turn_key(fn: Any) -> Optional[Hashable]:
    """What identifies compiled code across workers: its code object, plus the instance's type
    for a bound method. None for callables without Python code (no turn)."""
    if inspect.ismethod(fn):
        code = getattr(fn.__func__, "__code__", None)
        return None if code is None else (code, type(fn.__self__))
    code = getattr(fn, "__code__", None)
    return None if code is None else (code,)


def _describe(fn: Any) -> str:
    if inspect.ismethod(fn):
        return f"{type(fn.__self__).__name__}.{fn.__func__.__name__}"
    return getattr(fn, "__qualname__", None) or repr(fn)


def first_call_in_turn(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``OptimizeContext.__call__``: the compiled function it returns takes turns on its first call."""
    compiled = wrapped(*args, **kwargs)
    fn = args[0] if args else kwargs.get("fn")
    if isinstance(compiled, torch.nn.Module) or not callable(compiled):
        return compiled  # an OptimizedModule: its forward came through here already
    key = turn_key(fn)
    if key is None:
        return compiled
    return in_turn(compiled, key, _describe(fn))


class _Forgotten:
    """How many times ``forget()`` cleared the turns: a wrapper that found its code settled remembers
    the count it saw then, and looks in ``_done`` again once the count moved."""

    count = 0


def in_turn(compiled: Callable, key: Hashable, name: str) -> Callable:
    is_tracing = _compat.is_dynamo_compiling
    settled_at = [-1]  # _Forgotten.count when this wrapper last found its key settled

    @functools.wraps(compiled)
    def compiled_in_turn(*args: Any, **kwargs: Any) -> Any:
        # A settled code is remembered here: hashing its key (a code object) costs more than this.
        # A compiled caller does not trace this body: Dynamo inlines _torchdynamo_inline, which
        # functools.wraps copied from compiled; where it does trace it, is_tracing() folds to True.
        if settled_at[0] == _Forgotten.count or is_tracing():
            return compiled(*args, **kwargs)
        if key in _done:
            settled_at[0] = _Forgotten.count
            return compiled(*args, **kwargs)
        if tracing_here():  # inside its own FX trace a thread takes no turn: inlined or refused upstream
            return compiled(*args, **kwargs)
        return _take_turn(key, name, compiled, args, kwargs)

    compiled_in_turn._threadgraph_turn_key = key  # type: ignore[attr-defined]
    # Dynamo's innermost_fn follows _torchdynamo_orig_callable only where _torchdynamo_wrapper_id
    # is the wrapper's own id (2.13+); functools.wraps copied compiled's, which would stop it here
    # and make torch._dynamo.run / disable wrap this wrapper as if it were the user's function.
    compiled_in_turn._torchdynamo_orig_callable = compiled  # type: ignore[attr-defined]
    compiled_in_turn._torchdynamo_wrapper_id = id(compiled_in_turn)  # type: ignore[attr-defined]
    return compiled_in_turn


def _take_turn(key: Hashable, name: str, compiled: Callable, args: tuple, kwargs: dict) -> Any:
    turn = _turns.setdefault(key, _Turn())
    if turn.holder_ident == threading.get_ident():  # a recursive first call
        return compiled(*args, **kwargs)
    # Uncontended, the turn is taken without giving the slots up: a capture elsewhere must not
    # slip in between a worker's slot and its own call.
    got = turn.lock.acquire(blocking=False)
    if not got:
        state = current_worker()
        started = time.perf_counter()
        with released(), doing(state, f"waiting for {turn.holder or 'another thread'} to compile {name}"):
            got = turn.lock.acquire(timeout=DEFAULT_TIMEOUT_S)
        if state is not None:
            state.turn_wait_seconds += time.perf_counter() - started
    if not got:
        log.warning("threadgraph: waited %.0f s for %s to finish its first call of %s; compiling it here as well",
                    DEFAULT_TIMEOUT_S, turn.holder, name)
        return compiled(*args, **kwargs)
    if key in _done:  # settled while this thread waited
        turn.lock.release()
        return compiled(*args, **kwargs)
    turn.holder, turn.holder_ident = threading.current_thread().name, threading.get_ident()
    calls, before = _calls(), _compiles()
    try:
        result = compiled(*args, **kwargs)
        calls[key] = calls.get(key, 0) + 1  # only calls that returned: a failed one settles nothing
        if calls[key] >= 2 and _compiles() == before:
            _done.add(key)
            del calls[key]
        return result
    finally:
        turn.holder = turn.holder_ident = None
        turn.lock.release()


def forget() -> None:
    """Clear every turn (tests; after ``torch._dynamo.reset()`` the caches are empty again)."""
    _turns.clear()
    _done.clear()
    _Forgotten.count += 1
    _local.__dict__.clear()


_backends_lock = threading.Lock()
_backends: dict[type, list] = {}  # per wrapper class, one instance per distinct setting


def one_backend_per_settings(original: type) -> type:
    """``torch._TorchCompileInductorWrapper``, made to hand out one instance per settings.

    ``torch.compile(fn, mode=...)`` builds a new Inductor backend object on every call, and some
    releases (2.11) guard cached code on the backend's identity (BACKEND_MATCH, pytorch#168373):
    code one worker compiled is then never reused by another worker's own ``torch.compile``,
    turns or not. Equal settings (the wrapper's own ``__eq__``: mode, options, dynamic) now give
    back the first object built with them, already initialised, so the guard matches.
    """

    class InductorBackendPerSettings(original):  # type: ignore[misc, valid-type]
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            probe = original.__new__(cls)
            original.__init__(probe, *args, **kwargs)
            with _backends_lock:
                known = _backends.setdefault(cls, [])
                for backend in known:
                    if backend == probe:
                        return backend
                known.append(probe)
            return probe

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass  # __new__ initialised it; running __init__ again would empty a shared config

    InductorBackendPerSettings.__name__ = InductorBackendPerSettings.__qualname__ = original.__name__
    InductorBackendPerSettings.__module__ = original.__module__
    return InductorBackendPerSettings
