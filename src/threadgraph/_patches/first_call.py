"""Concurrent first calls of one compiled function compile it once (hazard concurrent-first-compile).

Dynamo looks a frame up in its code object's cache before it takes the process-wide compile lock,
and does not look again once it holds it. Threads that call the same compiled code for the first
time together all miss, queue on the lock, and each compiles the same frame again: the same
guards and the same graphs, N times the wait (Dynamo logs "Unexpected recompilation: runtime
guards failed even though they passed during recompilation-reason analysis"). Workers that run
one architecture on models of their own are that case: with nn.Modules inlined (the default since
torch 2.5), parameters are graph inputs and no guard pins a module object, so one compilation
serves every worker once it is in the cache.

``first_call_in_turn`` wraps ``OptimizeContext.__call__``, which builds what ``torch.compile``
returns (a compiled module goes through it too, for its ``forward``). Calls of one compiled code take
turns until the code has settled: the first caller compiles; the others wait, their device slots
given up (``released()``), and then find the cache filled. A first call can change what the guards
see (a model that sets an attribute on its first forward recompiles on its second call), so the code
has settled only when a thread's second or later call of it compiled no frame.

The turn is taken in an enter hook that the patch adds to the compiling context's own
``enter_exit_hooks``, which Dynamo runs at each call before it sets its frame callback; once the code
has settled the hook leaves the list, and a call costs what it costs without threadgraph. A context
that compiles several functions has one hook for all of them, which finds the function called in
``compile_wrapper``'s frame. Where a release's contexts have no such hooks, the compiled function is
wrapped instead, and a settled call costs that wrapper's frame. Each worker still warms up and
records its own CUDA graphs in its own pool (the per-worker cudagraphify state, hazard
shared-cudagraphify-state).

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
import sys
import threading
import time
import weakref
from typing import Any, Callable, Hashable, Optional

import torch

from threadgraph import _compat, _torch_calls
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
    """This thread's frame compiles, its calls of each unsettled key, and the turns it holds through
    contexts' enter hooks, innermost last (class defaults: see _per_thread)."""

    compiles = 0
    calls = None
    held = None


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


def _held() -> list:
    held = _local.held
    if held is None:
        held = _local.held = []
    return held


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


SKIP_REASONS = "torch._dynamo.eval_frame:get_skip_reasons"


def more_targets() -> list[str]:
    """``get_skip_reasons`` too, where a failing ``fullgraph=True`` call skips its exit hooks."""
    return [SKIP_REASONS] if _compat.fullgraph_error_skips_exit_hooks() else []


def first_call_in_turn(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``OptimizeContext.__call__``: calls of the compiled function it returns take turns on their
    code's first calls, through the context's enter hooks where it can, else through a wrapper.
    Also ``get_skip_reasons`` (``more_targets``): see ``_turn_given_back_on_fullgraph_error``."""
    if getattr(wrapped, "__name__", None) == "get_skip_reasons":
        return _turn_given_back_on_fullgraph_error(wrapped, args, kwargs)
    compiled = wrapped(*args, **kwargs)
    fn = args[0] if args else kwargs.get("fn")
    if isinstance(compiled, torch.nn.Module) or not callable(compiled):
        return compiled  # an OptimizedModule: its forward came through here already
    key = turn_key(fn)
    if key is None:
        return compiled
    if isinstance(getattr(instance, "enter_exit_hooks", None), list):
        _arm(instance, key, _describe(fn))
        return compiled
    return in_turn(compiled, key, _describe(fn))


def _enter_turn(key: Hashable, name: str) -> Optional[Callable[[bool], None]]:
    """Take ``key``'s turn for one call, waiting for another thread's first call of it; returns what
    ends the call (its argument: whether the call returned), or None where it takes no turn."""
    turn = _turns.setdefault(key, _Turn())
    if turn.holder_ident == threading.get_ident():  # a recursive first call
        return None
    # Uncontended, the turn is taken without giving the slots up: a capture elsewhere must not
    # slip in between a worker's slot and its own call.
    got = turn.lock.acquire(blocking=False)
    if not got:
        state = current_worker()
        started = time.perf_counter()
        try:
            with released(), doing(state, f"waiting for {turn.holder or 'another thread'} to compile {name}"):
                got = turn.lock.acquire(timeout=DEFAULT_TIMEOUT_S)
        except BaseException:  # taking the slots back failed (GateTimeout): the turn goes back too
            if got:
                turn.lock.release()
            raise
        if state is not None:
            state.turn_wait_seconds += time.perf_counter() - started
    if not got:
        log.warning("threadgraph: waited %.0f s for %s to finish its first call of %s; compiling it here as well",
                    DEFAULT_TIMEOUT_S, turn.holder, name)
        return None
    if key in _done:  # settled while this thread waited
        turn.lock.release()
        return None
    turn.holder, turn.holder_ident = threading.current_thread().name, threading.get_ident()
    calls, before = _calls(), _compiles()

    def end(returned: bool) -> None:
        try:
            if returned:  # only calls that returned: a failed one settles nothing
                calls[key] = calls.get(key, 0) + 1
                if calls[key] >= 2 and _compiles() == before:
                    _done.add(key)
                    del calls[key]
        finally:
            turn.holder = turn.holder_ident = None
            turn.lock.release()

    return end


def _no_exit() -> None:
    return None


def _called_function() -> Any:
    """The function the running ``compile_wrapper`` calls (its free variable ``fn``), found among
    the frames of the hook's callers; None where no such frame is near."""
    frame = sys._getframe(1)  # up from here: the hook, compile_wrapper's list comprehension (<= 3.11)
    for _ in range(6):
        if frame is None:
            return None
        if frame.f_code.co_name == "compile_wrapper":
            return frame.f_locals.get("fn")
        frame = frame.f_back
    return None


class _TurnHook:
    """An enter hook of one Dynamo context: each call of a function the context compiles takes the
    turn of that function's key until the key settles; once every key of the context settled, the
    hook takes itself out of the context's hooks. A context that compiles several functions runs
    the hook for each of them: the hook then finds the function called in the caller's frame."""

    def __init__(self, context: Any, key: Hashable, name: str) -> None:
        self.context = weakref.ref(context)  # _armed's value: a strong one would keep its key alive
        self.keys = {key: name}

    def settled(self) -> bool:
        return all(key in _done for key in self.keys)

    def _key_of_this_call(self) -> Optional[Hashable]:
        if len(self.keys) == 1:
            return next(iter(self.keys))
        key = turn_key(_called_function())
        if key not in self.keys:
            _warn_once("threadgraph: cannot tell which function of a torch.compile context that compiles "
                       "several is called; their first calls take no turns (concurrent first calls may "
                       "compile once each)")
            return None
        return key

    def __call__(self) -> Callable[[], None]:
        key = self._key_of_this_call()
        if key is None or key in _done:
            if self.settled():
                _disarm(self)
            return _no_exit
        if _torch_calls.is_dynamo_compiling() or tracing_here():  # inside a trace a call takes no turn
            return _no_exit
        end = _enter_turn(key, self.keys[key])
        if end is None:
            return _no_exit
        entry = (self.context(), end)
        held = _held()
        held.append(entry)
        handled_before = sys.exc_info()[1:]

        def exit_turn() -> None:
            # Dynamo runs exit hooks in a finally clause: an exception other than the one already
            # being handled when the call began (or that one raised again, with a longer
            # traceback) is the call's own.
            if entry in held:  # else _turn_given_back_on_fullgraph_error ended it
                held.remove(entry)
                now = sys.exc_info()[1:]
                end(now[0] is handled_before[0] and now[1] is handled_before[1])
                if self.settled():
                    _disarm(self)

        return exit_turn


_warned: set = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        log.warning(message)


_hooks_lock = threading.Lock()
_armed: "weakref.WeakKeyDictionary[Any, _TurnHook]" = weakref.WeakKeyDictionary()  # context -> its hook


def _place(context: Any, hook: _TurnHook, present: bool) -> None:
    """Put ``hook`` in ``context``'s enter hooks or take it out (callers hold ``_hooks_lock``). A new
    list each time, not an edit: a call running the old list in another thread keeps it whole."""
    hooks = context.enter_exit_hooks
    if present and hook not in hooks:
        context.enter_exit_hooks = [*hooks, hook]
    elif not present and hook in hooks:
        context.enter_exit_hooks = [h for h in hooks if h is not hook]


def _arm(context: Any, key: Hashable, name: str) -> None:
    """Give ``context`` the turn hook for ``key`` (one hook a context, for all its functions)."""
    with _hooks_lock:
        hook = _armed.get(context)
        if hook is None:
            hook = _armed[context] = _TurnHook(context, key, name)
        hook.keys.setdefault(key, name)
        if not hook.settled():
            _place(context, hook, True)


def _disarm(hook: _TurnHook) -> None:
    context = hook.context()
    with _hooks_lock:
        # Settled again under the lock: forget() may have made its keys take turns meanwhile.
        if context is not None and hook.settled():
            _place(context, hook, False)


def disarm_all() -> None:
    """Take every turn hook out of its context (``uninstall``: torch's contexts as they were)."""
    with _hooks_lock:
        for context, hook in list(_armed.items()):
            _place(context, hook, False)
        _armed.clear()


def _turn_given_back_on_fullgraph_error(wrapped: Callable, args: tuple, kwargs: dict) -> Any:
    """``eval_frame.get_skip_reasons``, which a ``fullgraph=True`` call asks only as it fails with
    "found no compiled frames", from where its context's exit hooks no longer run: the turn that
    call holds through its hook is given back here, as a failed call."""
    held = _local.held
    if held:
        context, end = held[-1]
        # Only the outermost fullgraph call fails so, after its inner calls have left: its turn, if it
        # holds one, is the innermost held.
        if getattr(context, "fullgraph", False) and not getattr(context, "export", False):
            held.pop()
            end(False)
    return wrapped(*args, **kwargs)


class _Forgotten:
    """How many times ``forget()`` cleared the turns: a wrapper that found its code settled remembers
    the count it saw then, and looks in ``_done`` again once the count moved."""

    count = 0


def in_turn(compiled: Callable, key: Hashable, name: str) -> Callable:
    """``compiled`` wrapped so that its calls take ``key``'s turn until the key settles."""
    is_tracing = _torch_calls.is_dynamo_compiling
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
        end = _enter_turn(key, name)
        if end is None:
            return compiled(*args, **kwargs)
        returned = False
        try:
            result = compiled(*args, **kwargs)
            returned = True
            return result
        finally:
            end(returned)

    compiled_in_turn._threadgraph_turn_key = key  # type: ignore[attr-defined]
    # Dynamo's innermost_fn follows _torchdynamo_orig_callable only where _torchdynamo_wrapper_id
    # is the wrapper's own id (2.13+); functools.wraps copied compiled's, which would stop it here
    # and make torch._dynamo.run / disable wrap this wrapper as if it were the user's function.
    compiled_in_turn._torchdynamo_orig_callable = compiled  # type: ignore[attr-defined]
    compiled_in_turn._torchdynamo_wrapper_id = id(compiled_in_turn)  # type: ignore[attr-defined]
    return compiled_in_turn


def forget() -> None:
    """Clear every turn (tests; after ``torch._dynamo.reset()`` the caches are empty again): settled
    codes take turns again, and contexts whose hook left get it back."""
    with _hooks_lock:
        _turns.clear()
        _done.clear()
        _Forgotten.count += 1
        _local.__dict__.clear()
        for context, hook in list(_armed.items()):
            _place(context, hook, True)
        _warned.clear()
