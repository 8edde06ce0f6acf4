"""The global shim: named patches of CUDAGraph Trees, applied with ``install()``.

Each patch names the upstream symbol it wraps, the hazard it fixes (numbers refer to
torch-threading-hazards.md, mirrored in the README), the releases it was checked on, and when
it can go. Patches are looked up where torch looks the name up at call time.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Iterable, Iterator, Optional

import torch

from . import _compat, _fence
from ._errors import ThreadgraphWarning
from ._gate import gate_for, released
from ._registry import Patch, Registry
from ._tls import current_worker, ensure_cudagraph_tls, worker_for_current_thread

log = logging.getLogger("threadgraph")


def _lazy_tls(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    local, attr_name = args[0], args[1]
    if not hasattr(local, attr_name) and not torch._C._is_key_in_tls(attr_name):
        ensure_cudagraph_tls()
    return wrapped(*args, **kwargs)


def _worker_mark_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    state = worker_for_current_thread()
    if state is None:
        return wrapped(*args, **kwargs)
    # Counts down, like upstream, to stay distinct from the generation counter.
    state.mark_step_counter -= 1
    return None


def _worker_curr_generation(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    state = current_worker()
    return wrapped(*args, **kwargs) if state is None else state.current_generation()


def _worker_user_mark_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    state = current_worker()
    return wrapped(*args, **kwargs) if state is None else state.mark_step_counter != 0


def _worker_generation_bump(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    result = wrapped(*args, **kwargs)
    state = worker_for_current_thread()
    if state is not None:
        state.generation += 1
    return result


class _NoWorker:
    """Key of the shared cudagraphify state used by threads without a worker (upstream behaviour)."""


_NO_WORKER = _NoWorker()


def _per_worker_cudagraphify(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    # Upstream binds the recorded function, and with it one tree manager, to the first
    # caller (<=2.12) or to the executing thread (2.13+, so every worker's backward shares
    # autograd's device thread). Key it by the worker instead, which travels into backward.
    per_worker: "weakref.WeakKeyDictionary[Any, Callable]" = weakref.WeakKeyDictionary()
    lock = threading.Lock()

    def run(new_inputs: Any) -> Any:
        # Python threads get a worker of their own on first use (even when the generation
        # patches are left out); autograd's threads see their caller's through the stash.
        key = worker_for_current_thread() or _NO_WORKER
        fn = per_worker.get(key)
        if fn is None:
            with lock:
                fn = per_worker.get(key)
                if fn is None:
                    fn = per_worker[key] = wrapped(*args, **kwargs)
        return fn(new_inputs)

    return run


def _device_of(instance: Any, args: tuple, kwargs: dict) -> str:
    index = getattr(instance, "device_index", None)
    if index is None:  # __init__: the device index is the first argument
        index = args[0] if args else kwargs["device_index"]
    return f"cuda:{index}"


def _exclusive(counter: str | None) -> Callable:
    def wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        device = _device_of(instance, args, kwargs)
        with gate_for(device).exclusive():
            state = current_worker()
            if counter and state is not None:
                setattr(state, counter, getattr(state, counter) + 1)
            try:
                return wrapped(*args, **kwargs)
            except RuntimeError as exc:
                clear = _fence.explain_broken_capture(exc, device)
                if clear is None:
                    raise
                raise clear from exc

    return wrapper


def _release_slots(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    with released():
        return wrapped(*args, **kwargs)


_fx_tracing = threading.local()


def _fx_trace_marks_thread(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    _fx_tracing.depth = getattr(_fx_tracing, "depth", 0) + 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        _fx_tracing.depth -= 1


# Upstream's rules, on this thread's own tracing instead of any thread's.
def _fx_tracing_in_this_thread(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> bool:
    return getattr(_fx_tracing, "depth", 0) > 0


def _fx_symbolic_tracing_in_this_thread(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> bool:
    return getattr(_fx_tracing, "depth", 0) > 0 and not torch.compiler.is_compiling()


_TREES = "torch._inductor.cudagraph_trees"
_MANAGER = f"{_TREES}:CUDAGraphTreeManager"
_GEN = "1: generation counters are process-global"
_CAPTURE = "2: capture is device-wide; other threads' CUDA work breaks it"
_UNTIL_GEN = "upstream keeps generation state per thread/worker (not as of 2.15)"
_UNTIL_CAPTURE = "upstream orders capture against all device work (not as of 2.15)"
_FX = "11: FX's tracing flag is process-global; a compile in one thread makes compiled calls in others raise"
_UNTIL_FX = "upstream keeps the FX tracing flag per thread (not as of 2.13)"
_FX_SEEN = ("seen on an H200, torch 2.11: 'Detected that you are using FX to symbolically trace a "
            "dynamo-optimized function' in a worker while another compiled")

PATCHES = [
    Patch("lazy_tls", f"{_TREES}:get_obj", "0: get_obj asserts in threads without TLS (#123177)",
          "2.1 - 2.12", "torch>=2.13 everywhere (upstream initialises TLS lazily)", "pytorch/pytorch#123177, PR #184357",
          _lazy_tls, applies=_compat.get_obj_asserts),
    Patch("worker_mark_step", f"{_TREES}:mark_step_begin", _GEN, "2.1 - 2.15", _UNTIL_GEN, "pytorch/pytorch#123177",
          _worker_mark_step),
    Patch("worker_generation", f"{_MANAGER}.get_curr_generation", _GEN, "2.1 - 2.15", _UNTIL_GEN, "pytorch/pytorch#123177",
          _worker_curr_generation),
    Patch("worker_user_mark_step", f"{_MANAGER}.user_invoked_mark_step", _GEN, "2.1 - 2.15", _UNTIL_GEN,
          "pytorch/pytorch#123177", _worker_user_mark_step),
    Patch("worker_generation_bump", "torch._dynamo.eval_frame:install_generation_tagging_init", _GEN, "2.1 - 2.15",
          _UNTIL_GEN, "pytorch/pytorch#123177", _worker_generation_bump),
    Patch("worker_cudagraphify", "torch._inductor.compile_fx:cudagraphify",
          "10: one compiled graph's cudagraph state is bound to one thread's tree manager", "2.1 - 2.15",
          "upstream keys cudagraphify state by a TLS object that travels into backward", "pytorch/pytorch#123177",
          _per_worker_cudagraphify),
    Patch("gate_manager_init", f"{_MANAGER}.__init__", _CAPTURE, "2.1 - 2.15", _UNTIL_CAPTURE, "pytorch/pytorch#123177",
          _exclusive(None)),
    Patch("gate_warmup", f"{_MANAGER}.run_eager", _CAPTURE, "2.1 - 2.15", _UNTIL_CAPTURE, "pytorch/pytorch#123177",
          _exclusive("warmups")),
    Patch("gate_pool_checkpoint", f"{_MANAGER}.apply_checkpoint_execution_state_in_allocator", _CAPTURE, "2.1 - 2.15",
          _UNTIL_CAPTURE, "pytorch/pytorch#123177", _exclusive(None)),
    Patch("gate_record", f"{_MANAGER}.record_function", _CAPTURE, "2.1 - 2.15", _UNTIL_CAPTURE, "pytorch/pytorch#123177",
          _exclusive("captures")),
    Patch("fx_trace_marks_thread", "torch.fx._symbolic_trace:Tracer.trace", _FX, "2.1 - 2.15", _UNTIL_FX, _FX_SEEN,
          _fx_trace_marks_thread, applies=lambda: _compat.dynamo_fx_tracing_check() is not None),
    Patch("fx_symbolic_tracing_per_thread", "torch.fx._symbolic_trace:is_fx_symbolic_tracing", _FX, "2.1 - 2.15",
          _UNTIL_FX, _FX_SEEN, _fx_symbolic_tracing_in_this_thread,
          applies=lambda: _compat.dynamo_fx_tracing_check() == "is_fx_symbolic_tracing"),
    Patch("fx_tracing_per_thread", "torch.fx._symbolic_trace:is_fx_tracing", _FX, "releases without "
          "is_fx_symbolic_tracing", _UNTIL_FX, _FX_SEEN, _fx_tracing_in_this_thread,
          applies=lambda: _compat.dynamo_fx_tracing_check() == "is_fx_tracing"),
    # Outside the compile lock, not inside it: a thread that restored its slot while still
    # holding the lock would wait for captures that wait for slots held by threads queued on
    # the lock (the second one-GPU DFlash stall on an H200).
    Patch("gate_release_in_compile", "torch._dynamo.convert_frame:CatchErrorsWrapper.__call__",
          "3: Dynamo compiles under one process-wide lock; a worker queued on it must not hold its slot",
          "releases with CatchErrorsWrapper (feature-detected; 2.13 on CPU, 2.11 on an H200)", "never (the lock is process-wide)",
          "seen on an H200, torch 2.11: 8 DFlash workers on one GPU, captures stalled behind queued compiles",
          _release_slots, applies=lambda: _compat.dynamo_frame_callback() is not None),
    Patch("gate_release_in_backward", "torch.autograd:backward",
          "3: backward (and captures in it) run on autograd's shared device thread", "2.1 - 2.15",
          "never (inherent to autograd's device threads)", "-", _release_slots),
    Patch("gate_release_in_grad", "torch.autograd:grad",
          "3: backward (and captures in it) run on autograd's shared device thread", "2.1 - 2.15",
          "never (inherent to autograd's device threads)", "-", _release_slots),
]

_FENCE_UNTIL = "upstream keeps capture mode out of other threads' generator use and syncs (not as of 2.15)"
_FENCE_SEEN = ("seen on an H200, torch 2.11: pytorch#123177's repro (32 plain threads, torch.rand inputs) raised "
               "'Offset increment outside graph capture encountered unexpectedly' in 1 and 7 of 32 threads")


def _rng_targets() -> list[str]:
    return (_fence.rng_function_targets() + _fence.aten_rng_targets())[1:]  # the first is the patch's target


PATCHES += [
    Patch("fence_rng", "torch:rand", _CAPTURE, "2.1 - 2.15", _FENCE_UNTIL, _FENCE_SEEN, None,
          more_targets=_rng_targets, replace=_fence.fenced_function),
    Patch("fence_synchronize", "torch.cuda:synchronize", _CAPTURE, "2.1 - 2.15", _FENCE_UNTIL, _FENCE_SEEN, None,
          replace=lambda original: _fence.fenced_function(original, _fence.synchronize_device)),
    Patch("capture_begin_exclusive", "torch.cuda.graphs:CUDAGraph.capture_begin", _CAPTURE, "2.1 - 2.15", _UNTIL_CAPTURE,
          "any capture, also one made by hand with torch.cuda.graph, takes the device's gate", _fence.capture_begin_exclusive),
    Patch("capture_end_exclusive", "torch.cuda.graphs:CUDAGraph.capture_end", _CAPTURE, "2.1 - 2.15", _UNTIL_CAPTURE,
          "releases what capture_begin_exclusive took", _fence.capture_end_exclusive),
]

FENCE_PATCHES = frozenset({"fence_rng", "fence_synchronize", "capture_begin_exclusive", "capture_end_exclusive"})

_registry = Registry(PATCHES)


GENERATION_PATCHES = frozenset({"worker_mark_step", "worker_generation", "worker_user_mark_step", "worker_generation_bump"})


def install(exclude: frozenset = frozenset()) -> list[str]:
    """Apply threadgraph's patches (idempotent). Returns the names applied by this call.

    ``exclude`` names patches to leave out (see ``patches()``); meant for experiments and for
    demonstrating what each patch fixes, not for production. ``THREADGRAPH_EXCLUDE_PATCHES``
    (a comma list) adds to it, so a benchmark's subprocesses can be run with a patch left out.
    """
    _compat.check_supported()
    from_env = {name.strip() for name in os.environ.get("THREADGRAPH_EXCLUDE_PATCHES", "").split(",") if name.strip()}
    applied = _registry.install(frozenset(exclude) | from_env)
    if "worker_cudagraphify" in applied and _trees_exist_in_this_thread():
        message = ("threadgraph: install() ran after this thread had already recorded CUDA graphs; graphs "
                   "compiled before install() stay bound to this thread's tree manager. Call install() "
                   "before the first torch.compile(mode='reduce-overhead') call")
        log.warning(message)
        warnings.warn(message, ThreadgraphWarning, stacklevel=2)
    return applied


def _trees_exist_in_this_thread() -> bool:
    if not torch._C._is_key_in_tls("tree_manager_containers"):
        return False
    containers = torch._C._get_obj_in_tls("tree_manager_containers")
    return any(getattr(c, "tree_manager", None) is not None for c in containers.values())


def uninstall(names: Optional[Iterable[str]] = None) -> list[str]:
    """Restore the exact original objects (of the patches in ``names`` only, if given). Returns the names removed."""
    if names is None:
        return _registry.uninstall()
    names = frozenset(names)
    known = {p["name"] for p in _registry.describe()}
    if names - known:
        raise ValueError(f"threadgraph: no patch named {sorted(names - known)}; known: {sorted(known)}")
    return _registry.uninstall(names)


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """``install()`` for the duration of a block; uninstalls only what this block installed."""
    applied = install()
    try:
        yield
    finally:
        if applied:
            uninstall(applied)


def installed() -> bool:
    """Whether threadgraph's patches are in place (any active; ``patches()`` says which)."""
    return any(p["active"] for p in _registry.describe())


def patches() -> list[dict[str, Any]]:
    """Every patch with its target, hazard, releases, removal condition and whether it is active."""
    return _registry.describe()
