"""The global shim: named patches of CUDAGraph Trees, applied with ``install()``.

Each patch names the upstream symbol it wraps, the hazard it addresses (a name from the catalogue
in ``_hazards.py``, rendered as docs/hazards.md), the releases it applies to, which releases were
read and run and what changed between them, and when it can go. Patches are looked up where
torch looks the name up at call time.

This table is the one place of those release facts; each wrapper lives beside the mechanism it
serves (``_tls``, ``_generation``, ``_gate_wrappers``, ``_fx_flag``, ``_fx_window``,
``_first_call``, ``_fence``), and the feature detection it relies on in ``_compat``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Iterable, Iterator, Optional

import torch

from threadgraph._patches import capture_guard as _capture_guard
from threadgraph._patches import capture_lock as _capture_lock

from threadgraph import _compat

from threadgraph._patches import compile_flag as _compile_flag

from threadgraph._device import fence as _fence

from threadgraph._patches import first_call as _first_call

from threadgraph._patches import fx_flag as _fx_flag

from threadgraph._patches import fx_window as _fx_window

from threadgraph._patches import gate_wrappers as _gate_wrappers

from threadgraph._patches import generation as _generation

from threadgraph._patches import verify as _verify

from threadgraph._device import tls as _tls
from threadgraph._errors import ThreadgraphWarning
from threadgraph._device.gate import check_settings
from threadgraph._patches.registry import Patch, Registry, patch_names

log = logging.getLogger("threadgraph")


_TREES = "torch._inductor.cudagraph_trees"
_MANAGER = f"{_TREES}:CUDAGraphTreeManager"
_READ = "2.13.0, 2.14.1, 2.15.0"
_RUN = ("CPU tests on 2.13.0, 2.14.1, 2.15.0 (2 cores, no GPU); GPU tests on 2.11.0 and, where it applies, 2.14.1 "
        "(NVIDIA H200)")
_RUN_NEW = "CPU tests on 2.13.0 (2 cores, no GPU); GPU conformance suite on 2.11.0 and 2.14.1 (NVIDIA H200)"
_RUN_CPU_SIM = "CPU tests on 2.13.0, 2.14.1, 2.15.0 with 2.12's get_obj simulated; GPU tests on 2.11.0 (NVIDIA H200)"
_UNTIL_GEN = "upstream keeps generation state per thread/worker (not as of 2.15.0)"
_UNTIL_CAPTURE = "upstream orders capture against all device work (not as of 2.15.0)"
_UNTIL_FX = "every supported torch keeps the FX tracing flag per thread (2.14+ does)"
_NONE = "none known"
_FX_UPSTREAM = "pytorch/pytorch#126024 (the error in threads), pytorch/pytorch#168999 (flag per thread, in 2.14)"
_GEN_SAME = ("identical in 2.13.0, 2.14.1 and 2.15.0. 2.14 added a generation snapshot (`curr_generation`) that "
             "`run` takes with `self.get_curr_generation()` and passes to `try_end_curr_execution`, "
             "`can_start_new_generation` and `in_new_torch_compile_invocation`, plus a generation-boundary "
             "check for cloned user-visible outputs (`has_live_user_visible_output_cloning`); every read "
             "still goes through `get_curr_generation` / `user_invoked_mark_step` (`install()` checks this "
             "by source), so the patches keep generations per worker on all three")
_GATE_SAME = ("2.14 turned asserts into raised AssertionErrors; the method is still on the capture path "
              "and takes no device argument of its own")

PATCHES = [
    Patch("lazy_tls", f"{_TREES}:get_obj", "tls-assert", "2.1 - 2.12 (feature-detected)",
          "torch>=2.13 everywhere (upstream initialises TLS lazily)",
          "pytorch/pytorch#123177, pytorch/pytorch#184357 (the fix, first in 2.13)",
          _tls.lazy_tls, applies=_compat.get_obj_asserts, read=_READ, run=_RUN_CPU_SIM,
          changes="not applied on 2.13+ (`_initialize_tls` present); 2.15 changed only a type annotation"),
    Patch("worker_mark_step", f"{_TREES}:mark_step_begin", "global-generation", "2.1 - 2.15.0", _UNTIL_GEN, _NONE,
          _generation.worker_mark_step, read=_READ, run=_RUN,
          changes="identical in 2.13.0, 2.14.1, 2.15.0: decrements the class attribute `MarkStepBox.mark_step_counter`"),
    Patch("worker_generation", f"{_MANAGER}.get_curr_generation", "global-generation", "2.1 - 2.15.0", _UNTIL_GEN,
          _NONE, _generation.worker_curr_generation, read=_READ, run=_RUN, changes=_GEN_SAME,
          assumes=(f"{_MANAGER}.in_new_torch_compile_invocation", f"{_MANAGER}.can_start_new_generation",
                   "torch._dynamo.mutation_guard:GenerationTracker")),
    Patch("worker_user_mark_step", f"{_MANAGER}.user_invoked_mark_step", "global-generation", "2.1 - 2.15.0",
          _UNTIL_GEN, _NONE, _generation.worker_user_mark_step, read=_READ, run=_RUN, changes=_GEN_SAME),
    Patch("worker_generation_bump", "torch._dynamo.eval_frame:install_generation_tagging_init", "global-generation",
          "2.1 - 2.15.0", _UNTIL_GEN, _NONE, None, replace=_generation.worker_generation_bump, read=_READ, run=_RUN,
          changes="eval_frame calls it through its module global on every entry into a compiled frame in all three; "
                  "2.15 renamed its once-only marker and made `GenerationTracker` one dataclass instance (still "
                  "process-wide). `RunOnlyContext` (`torch._dynamo.run`) bumps the counter directly, unpatched",
          assumes=("torch._dynamo.mutation_guard:GenerationTracker",)),
    Patch("worker_run_only_generation", "torch._dynamo.eval_frame:RunOnlyContext.__init__", "global-generation",
          "2.1 - 2.15.0 (feature-detected)", _UNTIL_GEN, _NONE, _generation.worker_run_only_generation,
          applies=_compat.dynamo_contexts_have_enter_hooks, read="2.13.0, 2.14.1", run=_RUN_NEW,
          changes="`RunOnlyContext.__init__` passes an `on_enter` that bumps `GenerationTracker.generation`, "
                  "run from the context's `enter_exit_hooks` on every call, in 2.13.0 and 2.14.1 (and 2.11.0, run)"),
    Patch("worker_mark_step_reset", f"{_TREES}:reset_cudagraph_trees", "global-generation", "2.1 - 2.15.0",
          _UNTIL_GEN, _NONE, _generation.worker_mark_step_reset, read="2.13.0, 2.14.1", run=_RUN_NEW,
          changes="zeroes `MarkStepBox.mark_step_counter` after shutting the calling thread's managers down, and "
                  "returns first where the thread has no tree state (2.11+); callers import it at call time"),
    Patch("worker_cudagraphify", "torch._inductor.compile_fx:cudagraphify", "shared-cudagraphify-state",
          "2.1 - 2.15.0", "upstream keys cudagraphify state by a TLS object that travels into backward",
          "pytorch/pytorch#184357 (per host thread, which backward defeats), pytorch/pytorch#186192",
          _tls.per_worker_cudagraphify, read=_READ, run=_RUN,
          changes="2.14 added keyword arguments (`kernel_free_cudagraph`, `user_visible_output_idxs`), 2.15 more "
                  "(re-record limits, initial pool size); all keep one `threading.local` per graph and every "
                  "caller imports the function from compile_fx at call time (2.15's default `CUDAGraphPolicy` too), "
                  "so the per-worker wrapper, which passes every argument through, still applies"),
    Patch("gate_manager_init", f"{_MANAGER}.__init__", "device-wide-capture", "2.1 - 2.15.0", _UNTIL_CAPTURE, _NONE,
          _gate_wrappers.exclusive(None, capture_lock_first=True), read=_READ, run=_RUN,
          changes="2.15 added a keyword `initial_mempool_allocation_gb` and primes the private pool with a device "
                  "allocation (more reason to hold the gate); `device_index` is still the first argument"),
    Patch("capture_lock_gives_up_slots", f"{_TREES}:graph_capture_lock", "capture-lock-order",
          "2.13 - 2.15.0 (feature-detected)", "upstream's capture lock and the device gate are one lock (not as of 2.15.0)",
          _NONE, None, replace=_capture_lock.CaptureLock, applies=_compat.has_graph_capture_lock,
          read="2.13.0, 2.14.1", run="CPU tests on 2.13.0, 2.14.1 (the lock and the gate in threads); GPU tests on "
          "2.14.1 (NVIDIA H200: 3 and 8 training workers, mixed, capture failure, new shapes, fence cells)",
          changes="a module-level `threading.Lock` taken with `with` around the manager's set-up (`__init__`), "
                  "`run_eager` and `record_function` in 2.13.0 and 2.14.1; looked up as a module global at each use"),
    Patch("gate_warmup", f"{_MANAGER}.run_eager", "device-wide-capture", "2.1 - 2.15.0", _UNTIL_CAPTURE, _NONE,
          _gate_wrappers.exclusive("warmups"), read=_READ, run=_RUN,
          changes="2.14 records the function being warmed up (`active_warmup_function`); 2.15 as 2.14"),
    Patch("gate_pool_checkpoint", f"{_MANAGER}.apply_checkpoint_execution_state_in_allocator", "device-wide-capture",
          "2.1 - 2.15.0", _UNTIL_CAPTURE, _NONE, _gate_wrappers.exclusive(None), read=_READ, run=_RUN, changes=_GATE_SAME),
    Patch("gate_record", f"{_MANAGER}.record_function", "device-wide-capture", "2.1 - 2.15.0", _UNTIL_CAPTURE, _NONE,
          _gate_wrappers.exclusive("captures"), read=_READ, run=_RUN,
          changes=_GATE_SAME + "; 2.15 passes liveness state and demoted input indices to the new node"),
    Patch("fx_trace_marks_thread", "torch.fx._symbolic_trace:Tracer.trace", "global-fx-tracing-flag",
          "2.1 - 2.13 (feature-detected)", _UNTIL_FX, _FX_UPSTREAM, _fx_flag.fx_trace_marks_thread,
          applies=lambda: _compat.fx_tracing_flag_is_global() and _compat.dynamo_fx_tracing_check() is not None,
          read=_READ, run=_RUN,
          changes="2.14 keeps the flag in a `threading.local` (`_is_fx_tracing_tls`): not applied on 2.14.1, 2.15.0"),
    Patch("fx_symbolic_tracing_per_thread", "torch.fx._symbolic_trace:is_fx_symbolic_tracing", "global-fx-tracing-flag",
          "2.1 - 2.13 (feature-detected)", _UNTIL_FX, _FX_UPSTREAM, None, replace=_fx_flag.fx_symbolic_tracing_in_this_thread,
          applies=lambda: _compat.fx_tracing_flag_is_global()
          and _compat.dynamo_fx_tracing_check() == "is_fx_symbolic_tracing",
          read=_READ, run=_RUN, changes="2.14 reads the per-thread flag: not applied on 2.14.1, 2.15.0"),
    Patch("fx_tracing_per_thread", "torch.fx._symbolic_trace:is_fx_tracing", "global-fx-tracing-flag",
          "releases with the global flag and without is_fx_symbolic_tracing", _UNTIL_FX, _FX_UPSTREAM,
          _fx_flag.fx_tracing_in_this_thread,
          applies=lambda: _compat.fx_tracing_flag_is_global() and _compat.dynamo_fx_tracing_check() == "is_fx_tracing",
          read=_READ, run="CPU tests on 2.13.0, 2.14.1, 2.15.0 (not applied on any of them)",
          changes="2.13.0 - 2.15.0 all have `is_fx_symbolic_tracing`, so this one is not applied there"),
    # Outside the compile lock, not inside it: a thread that restored its slot while still
    # holding the lock would wait for captures that wait for slots held by threads queued on
    # the lock (the second one-GPU DFlash stall on an H200).
    Patch("gate_release_in_compile", "torch._dynamo.convert_frame:CatchErrorsWrapper.__call__", "global-compile-lock",
          "releases with CatchErrorsWrapper (feature-detected)", "never (the lock is process-wide)",
          "pytorch/pytorch#105943 (the compile region's one lock)", _gate_wrappers.compile_frame,
          applies=lambda: _compat.dynamo_frame_callback() is not None, read=_READ,
          run=_RUN + "; measured with 8 DFlash workers on one GPU",
          changes="2.14 passes `apply_to_code` when it skips a frame; 2.15 as 2.14; `compile_lock` is still one "
                  "process-wide RLock"),
    Patch("compile_flag_per_thread", "torch.compiler:_compile_session_context", "global-compile-session-flag",
          "2.13 - 2.15.0 (feature-detected)", "upstream keeps the compile session per thread", _NONE, None,
          applies=_compat.compile_session_flag_is_global, read=_READ,
          run="CPU tests on 2.13.0, 2.14.1 (2 cores, no GPU), and on 2.14.1 on an NVIDIA H200; there the DFlash "
              "trainer from empty caches lost its target workers' hidden states without it and ran in all 3 modes with it",
          changes="2.13.0 - 2.15.0: `compile_inner` enters `torch.compiler._compile_session_context()` unless "
                  "exporting; `is_compiling` returns the module global `_is_compiling_flag`",
          more_targets=lambda: ["torch.compiler:is_compiling.__code__"], replace=_compile_flag.replacement),
    Patch("fx_trace_window", "torch.fx._symbolic_trace:_new_patcher", "global-fx-patcher", "2.1 - 2.15.0",
          "upstream keeps FX's patches per thread, or Dynamo stops guarding on nn.Module.__call__", _NONE,
          _fx_window.trace_window, applies=_compat.fx_patcher_is_global, read=_READ + ", 2.11.0",
          run="CPU tests on 2.11.0, 2.13.0, 2.14.1, 2.15.0 (2 cores, no GPU); its wait for the trace, without the "
              "uncompiled call, in the DFlash trainer on an H200 (2.11.0); not yet in the GPU test suite",
          changes="`Tracer.trace` enters `_new_patcher()` through its module global and patches "
                  "`nn.Module.__call__` / `__getattr__` inside it in 2.11.0 - 2.15.0",
          assumes=("torch._dynamo.convert_frame:compile_lock", "torch._dynamo.types:FrameExecStrategy",
                   "torch._dynamo.types:ConvertFrameReturn", "torch.fx._symbolic_trace:Tracer.trace")),
    Patch("first_call_in_turn", "torch._dynamo.eval_frame:OptimizeContext.__call__", "concurrent-first-compile",
          "2.1 - 2.15.0", "upstream looks the cache up again once it holds the compile lock", _NONE,
          _first_call.first_call_in_turn, read=_READ, run=_RUN,
          changes="`torch.compile` returns `OptimizeContext.__call__(fn)` in 2.13.0, 2.14.1 and 2.15.0; a module "
                  "becomes an `OptimizedModule` whose `forward` is built by the same call on `Module.__call__`",
          assumes=("torch._dynamo.eval_frame:innermost_fn",)),
    Patch("inductor_backend_per_settings", "torch:_TorchCompileInductorWrapper", "concurrent-first-compile",
          "2.1 - 2.15.0", "upstream matches backends by their settings everywhere", "pytorch/pytorch#168373",
          None, replace=_first_call.one_backend_per_settings, read=_READ, run=_RUN,
          changes="`torch.compile` builds `_TorchCompileInductorWrapper(mode, options, dynamic[, name])` from its "
                  "module global in 2.13.0 - 2.15.0 and compares two by `__eq__` (config, dynamic, name); 2.11's "
                  "BACKEND_MATCH guard compares identities"),
    Patch("gate_release_in_backward", "torch.autograd:backward", "autograd-device-thread", "2.1 - 2.15.0",
          "never (inherent to autograd's device threads)", _NONE, _gate_wrappers.release_slots, read=_READ, run=_RUN,
          changes="identical in 2.13.0, 2.14.1, 2.15.0"),
    Patch("gate_release_in_grad", "torch.autograd:grad", "autograd-device-thread", "2.1 - 2.15.0",
          "never (inherent to autograd's device threads)", _NONE, _gate_wrappers.release_slots, read=_READ, run=_RUN,
          changes="identical in 2.13.0, 2.14.1, 2.15.0"),
]

_FENCE_UNTIL = "upstream keeps capture mode out of other threads' generator use and syncs (not as of 2.15.0)"
_RUN_FENCE = ("CPU tests on 2.13.0, 2.14.1, 2.15.0 against a simulated capture; GPU tests, the fence matrix of "
              "tests/library/test_gpu_fence.py among them, on 2.11.0 (NVIDIA H200)")
_FENCE_SAME = ("the entry points are public API, unchanged in 2.13.0 - 2.15.0. 2.14 added a PyObject fast path to "
               "OpOverload.__call__ (`_pyobj_dispatcher`, which bypasses `_op`); torch enables it for "
               "torch.library custom ops only, so the ATen RNG overloads still call `_op`")
_CAPTURE_SAME = ("2.14 split CUDAGraph.capture_end into capture_end_pre and the instantiation; capture_end still "
                 "calls both, and capture_begin is unchanged")


_RNG_FUNCTION_TARGET = "torch:rand"
_RNG_OP_TARGET = "torch:ops.aten.rand.default._op"


def _rng_function_targets() -> list[str]:
    return [t for t in _fence.rng_function_targets() if t != _RNG_FUNCTION_TARGET]


def _rng_op_targets() -> list[str]:
    return [t for t in _fence.aten_rng_targets() if t != _RNG_OP_TARGET]


PATCHES += [
    Patch("fence_rng", _RNG_FUNCTION_TARGET, "device-wide-capture", "2.1 - 2.15.0", _FENCE_UNTIL, _NONE, None,
          more_targets=_rng_function_targets, replace=_fence.fenced_function, read=_READ, run=_RUN_FENCE,
          changes=_FENCE_SAME),
    # The overloads' ``_op``, through a replacement that hashes as the original: overloads hash as
    # their ``_op``, and Inductor's lowering and decomposition tables are keyed by overloads.
    Patch("fence_rng_ops", _RNG_OP_TARGET, "device-wide-capture", "2.1 - 2.15.0", _FENCE_UNTIL,
          _NONE, None, more_targets=_rng_op_targets, replace=_fence.fenced_op, read=_READ, run=_RUN_FENCE,
          changes=_FENCE_SAME + "; `OpOverload.__hash__` is `hash(self._op)` in 2.13.0 and "
                  "`hash(self._cpp_dispatch_handle)` in 2.14.1 and 2.15.0 (read), which the patch leaves as it is",
          assumes=("torch._ops:OpOverload.__hash__", "torch._ops:OpOverload.__call__")),
    Patch("fence_synchronize", "torch.cuda:synchronize", "device-wide-capture", "2.1 - 2.15.0", _FENCE_UNTIL, _NONE, None,
          replace=_fence.fenced_synchronize,
          read=_READ, run=_RUN_FENCE, changes="unchanged in 2.13.0 - 2.15.0"),
    Patch("capture_begin_exclusive", "torch.cuda.graphs:CUDAGraph.capture_begin", "device-wide-capture", "2.1 - 2.15.0",
          _UNTIL_CAPTURE, _NONE, _fence.capture_begin_exclusive, read=_READ, run=_RUN_FENCE, changes=_CAPTURE_SAME),
    Patch("capture_end_exclusive", "torch.cuda.graphs:CUDAGraph.capture_end", "device-wide-capture", "2.1 - 2.15.0",
          _UNTIL_CAPTURE, _NONE, _fence.capture_end_exclusive, read=_READ, run=_RUN_FENCE, changes=_CAPTURE_SAME),
]

_ACCELERATOR_GRAPH = "torch.accelerator:Graph"
_RUN_GUARD = "CPU tests on 2.13.0, 2.14.1, 2.15.0 (2 cores, no GPU) with stand-ins for the capture"
_ACCELERATOR_SAME = "`torch.accelerator.Graph` captures through its own methods in 2.13.0 and 2.15.0, not CUDAGraph's"

PATCHES += [
    Patch("capture_failure_gives_gate_back", "torch.cuda.graphs:graph.__enter__", "device-wide-capture", "2.1 - 2.15.0",
          _UNTIL_CAPTURE, _NONE, _capture_guard.enter_gives_gate_back, read="2.13.0, 2.15.0", run=_RUN_GUARD,
          changes="2.15 ends a capture whose set-up failed after `capture_begin` with `capture_end_pre()` alone"),
    Patch("accelerator_capture_begin_exclusive", f"{_ACCELERATOR_GRAPH}.capture_begin", "device-wide-capture",
          "2.13 - 2.15.0 (feature-detected)", _UNTIL_CAPTURE, _NONE, _fence.capture_begin_exclusive,
          applies=lambda: _compat.accelerator_graph() is not None, read="2.13.0, 2.15.0", run=_RUN_GUARD,
          changes=_ACCELERATOR_SAME),
    Patch("accelerator_capture_end_exclusive", f"{_ACCELERATOR_GRAPH}.capture_end", "device-wide-capture",
          "2.13 - 2.15.0 (feature-detected)", _UNTIL_CAPTURE, _NONE, _fence.capture_end_exclusive,
          applies=lambda: _compat.accelerator_graph() is not None, read="2.13.0, 2.15.0", run=_RUN_GUARD,
          changes=_ACCELERATOR_SAME),
]

FENCE_PATCHES = frozenset({"fence_rng", "fence_rng_ops", "fence_synchronize", "capture_begin_exclusive", "capture_end_exclusive"})

_registry = Registry(PATCHES)


GENERATION_PATCHES = frozenset({"worker_mark_step", "worker_generation", "worker_user_mark_step", "worker_generation_bump",
                                "worker_run_only_generation", "worker_mark_step_reset"})


_EXCLUDE_ENV = "THREADGRAPH_EXCLUDE_PATCHES"


def _excluded_by_env() -> frozenset:
    names = frozenset(name.strip() for name in os.environ.get(_EXCLUDE_ENV, "").split(",") if name.strip())
    _registry.check_known(names, f" in the environment variable {_EXCLUDE_ENV}={os.environ.get(_EXCLUDE_ENV)!r} "
                                 "(a comma list of patch names: fix or unset it)")
    return names


def install(exclude: Iterable[str] = frozenset()) -> list[str]:
    """Apply threadgraph's patches (idempotent). Returns the names applied by this call.

    ``exclude`` names patches to leave out (one name or a collection of them; see ``patches()``);
    meant for experiments and for demonstrating what each patch fixes, not for production.
    ``THREADGRAPH_EXCLUDE_PATCHES`` (a comma list) adds to it, so a benchmark's subprocesses can be
    run with a patch left out. Every symbol to be patched is checked first: on a torch that lacks
    one, nothing is patched and UnsupportedTorchError names every missing symbol.
    """
    check_settings()
    exclude = patch_names(exclude, "exclude") | _excluded_by_env()
    if any(row["applies"] and not row["active"] and row["name"] not in exclude for row in _registry.describe()):
        _verify.check(PATCHES, exclude)  # before anything is patched; nothing to check when nothing is new
    applied = _registry.install(exclude, also_missing=_compat.missing_required())
    if FENCE_PATCHES & set(applied):
        _compat.refresh_dynamo_rules()
    if "worker_cudagraphify" in applied and _trees_exist_in_this_thread():
        message = ("threadgraph: install() ran after this thread had already recorded CUDA graphs; graphs "
                   "compiled before install() stay bound to this thread's tree manager. Call install() "
                   "before the first torch.compile(mode='reduce-overhead') call")
        log.warning(message)
        warnings.warn(message, ThreadgraphWarning, stacklevel=2)
    if "worker_generation" in applied:
        _warn_on_unpatched_generation_reads()
    return applied


def _warn_on_unpatched_generation_reads() -> None:
    # The generation patches replace the manager's two readers of the global counters; a torch
    # whose manager reads them anywhere else would mix workers' generations there.
    readers = _compat.unpatched_generation_reads()
    if readers:
        message = (f"threadgraph: this torch's CUDAGraphTreeManager reads the global generation counters in "
                   f"{', '.join(readers)}, outside {', '.join(_compat.GENERATION_READERS)}; there workers can "
                   "still end each other's generations (hazard global-generation). Please report it")
        log.warning(message)
        warnings.warn(message, ThreadgraphWarning, stacklevel=3)


def _trees_exist_in_this_thread() -> bool:
    if not torch._C._is_key_in_tls("tree_manager_containers"):
        return False
    containers = torch._C._get_obj_in_tls("tree_manager_containers")
    return any(getattr(c, "tree_manager", None) is not None for c in containers.values())


def uninstall(names: Optional[Iterable[str]] = None) -> list[str]:
    """Restore the exact original objects (of the patches in ``names`` only, if given: one name or a
    collection of them). Returns the names removed."""
    if names is not None:
        names = patch_names(names, "uninstall")
        _registry.check_known(names)
    removed = _registry.uninstall(names)
    if FENCE_PATCHES & set(removed):
        _compat.refresh_dynamo_rules()
    return removed


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
