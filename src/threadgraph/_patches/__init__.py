"""The global shim: named patches of CUDAGraph Trees, applied with ``install()``.

Each patch names the upstream symbol it replaces, where torch looks that name up at call time, the
hazard it addresses (an entry of docs/hazards.md) and, where it depends on the torch at hand, the
feature detection that decides whether it applies. docs/patches.md holds each patch's record: the
releases it applies to, what was read and run, and when it can go.

Each wrapper lives beside the mechanism it serves (``_device``, ``generation``, ``gate_wrappers``,
``fx_flag``, ``fx_window``, ``first_call``, ``backend_settings``, ``capture_lock``,
``compile_flag``); the feature detection it relies on is in ``_compat``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from typing import Any, Iterable, Iterator, Optional

import torch

from threadgraph import _compat, _torch_calls
from threadgraph._device import fence as _fence
from threadgraph._device import tls as _tls
from threadgraph._device.gate import check_timeout_setting
from threadgraph._errors import SettingError, ThreadgraphWarning, UsageError
from threadgraph._patches import backend_settings as _backend_settings
from threadgraph._patches import capture_guard as _capture_guard
from threadgraph._patches import capture_lock as _capture_lock
from threadgraph._patches import compile_flag as _compile_flag
from threadgraph._patches import first_call as _first_call
from threadgraph._patches import fx_flag as _fx_flag
from threadgraph._patches import fx_window as _fx_window
from threadgraph._patches import gate_wrappers as _gate_wrappers
from threadgraph._patches import generation as _generation
from threadgraph._patches import verify as _verify
from threadgraph._patches.registry import Patch, Registry, patch_names

log = logging.getLogger("threadgraph")


_TREES = "torch._inductor.cudagraph_trees"
_MANAGER = f"{_TREES}:CUDAGraphTreeManager"
PATCHES = [
    Patch("lazy_tls", f"{_TREES}:get_obj", "tls-assert", _tls.lazy_tls, applies=_compat.get_obj_asserts),
    Patch("worker_mark_step", f"{_TREES}:mark_step_begin", "global-generation", _generation.worker_mark_step),
    Patch("worker_generation", f"{_MANAGER}.get_curr_generation", "global-generation",
          _generation.worker_curr_generation,
          assumes=(f"{_MANAGER}.in_new_torch_compile_invocation", f"{_MANAGER}.can_start_new_generation",
                   "torch._dynamo.mutation_guard:GenerationTracker")),
    Patch("worker_user_mark_step", f"{_MANAGER}.user_invoked_mark_step", "global-generation",
          _generation.worker_user_mark_step),
    Patch("worker_generation_bump", "torch._dynamo.eval_frame:install_generation_tagging_init",
          "global-generation", None, replace=_generation.worker_generation_bump,
          assumes=("torch._dynamo.mutation_guard:GenerationTracker",)),
    Patch("worker_run_only_generation", "torch._dynamo.eval_frame:RunOnlyContext.__init__", "global-generation",
          _generation.worker_run_only_generation, applies=_compat.dynamo_contexts_have_enter_hooks),
    Patch("worker_mark_step_reset", f"{_TREES}:reset_cudagraph_trees", "global-generation",
          _generation.worker_mark_step_reset),
    Patch("worker_cudagraphify", "torch._inductor.compile_fx:cudagraphify", "shared-cudagraphify-state",
          _tls.per_worker_cudagraphify),
    Patch("gate_manager_init", f"{_MANAGER}.__init__", "device-wide-capture",
          _gate_wrappers.exclusive(None, capture_lock_first=True)),
    Patch("capture_lock_gives_up_slots", f"{_TREES}:graph_capture_lock", "capture-lock-order", None,
          replace=_capture_lock.CaptureLock, applies=_compat.has_graph_capture_lock),
    Patch("gate_warmup", f"{_MANAGER}.run_eager", "device-wide-capture", _gate_wrappers.exclusive("warmups")),
    Patch("gate_pool_checkpoint", f"{_MANAGER}.apply_checkpoint_execution_state_in_allocator",
          "device-wide-capture", _gate_wrappers.exclusive(None)),
    Patch("gate_record", f"{_MANAGER}.record_function", "device-wide-capture",
          _gate_wrappers.exclusive("captures")),
    Patch("fx_trace_marks_thread", "torch.fx._symbolic_trace:Tracer.trace", "global-fx-tracing-flag",
          _fx_flag.fx_trace_marks_thread,
          applies=lambda: _compat.fx_tracing_flag_is_global() and _compat.dynamo_fx_tracing_check() is not None),
    Patch("fx_symbolic_tracing_per_thread", "torch.fx._symbolic_trace:is_fx_symbolic_tracing",
          "global-fx-tracing-flag", None, replace=_fx_flag.fx_symbolic_tracing_in_this_thread,
          applies=lambda: _compat.fx_tracing_flag_is_global()
          and _compat.dynamo_fx_tracing_check() == "is_fx_symbolic_tracing"),
    Patch("fx_tracing_per_thread", "torch.fx._symbolic_trace:is_fx_tracing", "global-fx-tracing-flag",
          _fx_flag.fx_tracing_in_this_thread,
          applies=lambda: _compat.fx_tracing_flag_is_global() and _compat.dynamo_fx_tracing_check() == "is_fx_tracing"),
    # Outside the compile lock, not inside it: a thread that restored its slot while still
    # holding the lock would wait for captures that wait for slots held by threads queued on
    # the lock.
    Patch("gate_release_in_compile", "torch._dynamo.convert_frame:CatchErrorsWrapper.__call__",
          "global-compile-lock", _gate_wrappers.compile_frame,
          applies=lambda: _compat.dynamo_frame_callback() is not None),
    Patch("compile_flag_per_thread", "torch.compiler:_compile_session_context", "global-compile-session-flag",
          None, applies=_compat.compile_session_flag_is_global,
          more_targets=lambda: ["torch.compiler:is_compiling.__code__"], replace=_compile_flag.replacement),
    Patch("fx_trace_window", "torch.fx._symbolic_trace:_new_patcher", "global-fx-patcher",
          _fx_window.trace_window, applies=_compat.fx_patcher_is_global,
          assumes=("torch._dynamo.convert_frame:compile_lock", "torch._dynamo.types:FrameExecStrategy",
                   "torch._dynamo.types:ConvertFrameReturn", "torch.fx._symbolic_trace:Tracer.trace")),
    Patch("first_call_in_turn", "torch._dynamo.eval_frame:OptimizeContext.__call__", "concurrent-first-compile",
          _first_call.first_call_in_turn, more_targets=_first_call.more_targets, undo=_first_call.disarm_all,
          assumes=("torch._dynamo.eval_frame:innermost_fn", "torch._dynamo.eval_frame:_TorchDynamoContext.__call__")),
    Patch("inductor_backend_per_settings", "torch:_TorchCompileInductorWrapper", "concurrent-first-compile",
          None, replace=_backend_settings.one_backend_per_settings),
    Patch("gate_release_in_backward", "torch.autograd:backward", "autograd-device-thread",
          _gate_wrappers.release_slots),
    Patch("gate_release_in_grad", "torch.autograd:grad", "autograd-device-thread", _gate_wrappers.release_slots),
]

_RNG_FUNCTION_TARGET = "torch:rand"
_RNG_OP_TARGET = "torch:ops.aten.rand.default._op"


def _rng_function_targets() -> list[str]:
    return [t for t in _fence.rng_function_targets() if t != _RNG_FUNCTION_TARGET]


def _rng_op_targets() -> list[str]:
    return [t for t in _fence.aten_rng_targets() if t != _RNG_OP_TARGET]


PATCHES += [
    Patch("fence_rng", _RNG_FUNCTION_TARGET, "device-wide-capture", None, more_targets=_rng_function_targets,
          replace=_fence.fenced_function),
    # The overloads' ``_op``, through a replacement that hashes as the original: overloads hash as
    # their ``_op``, and Inductor's lowering and decomposition tables are keyed by overloads.
    Patch("fence_rng_ops", _RNG_OP_TARGET, "device-wide-capture", None, more_targets=_rng_op_targets,
          replace=_fence.fenced_op, assumes=("torch._ops:OpOverload.__hash__", "torch._ops:OpOverload.__call__")),
    Patch("fence_synchronize", "torch.cuda:synchronize", "device-wide-capture", None,
          replace=_fence.fenced_synchronize),
    Patch("capture_begin_exclusive", "torch.cuda.graphs:CUDAGraph.capture_begin", "device-wide-capture",
          _fence.capture_begin_exclusive),
    Patch("capture_end_exclusive", "torch.cuda.graphs:CUDAGraph.capture_end", "device-wide-capture",
          _fence.capture_end_exclusive),
]

_ACCELERATOR_GRAPH = "torch.accelerator:Graph"

PATCHES += [
    Patch("capture_failure_gives_gate_back", "torch.cuda.graphs:graph.__enter__", "device-wide-capture",
          _capture_guard.enter_gives_gate_back),
    Patch("accelerator_capture_begin_exclusive", f"{_ACCELERATOR_GRAPH}.capture_begin", "device-wide-capture",
          _fence.capture_begin_exclusive, applies=lambda: _compat.accelerator_graph() is not None),
    Patch("accelerator_capture_end_exclusive", f"{_ACCELERATOR_GRAPH}.capture_end", "device-wide-capture",
          _fence.capture_end_exclusive, applies=lambda: _compat.accelerator_graph() is not None),
]

FENCE_PATCHES = frozenset({"fence_rng", "fence_rng_ops", "fence_synchronize", "capture_begin_exclusive", "capture_end_exclusive"})

_registry = Registry(PATCHES)


GENERATION_PATCHES = frozenset({"worker_mark_step", "worker_generation", "worker_user_mark_step", "worker_generation_bump",
                                "worker_run_only_generation", "worker_mark_step_reset"})


_EXCLUDE_ENV = "THREADGRAPH_EXCLUDE_PATCHES"


def _excluded_by_env() -> frozenset:
    names = frozenset(name.strip() for name in os.environ.get(_EXCLUDE_ENV, "").split(",") if name.strip())
    try:
        _registry.check_known(names, f" in the environment variable {_EXCLUDE_ENV}={os.environ.get(_EXCLUDE_ENV)!r} "
                                     "(a comma list of patch names: fix or unset it)")
    except UsageError as exc:
        raise SettingError(*exc.args) from None
    return names


def check_settings() -> None:
    """Check every environment variable threadgraph reads: ``THREADGRAPH_GATE_TIMEOUT``,
    ``THREADGRAPH_STRICT`` and ``THREADGRAPH_EXCLUDE_PATCHES``.

    Importing threadgraph never fails on a bad value; :func:`install` (so a worker's construction)
    and ``threadgraph doctor`` call this first, and the first use of a device's gate checks the
    timeout, so nothing runs with a default in place of the value asked for. Call it at a
    program's start to fail early.

    Raises:
        SettingError: A variable holds a bad value; the message names it and the fix.
    """
    check_timeout_setting()
    _verify.strict()
    _excluded_by_env()


def install(exclude: Iterable[str] = frozenset()) -> list[str]:
    """Apply threadgraph's patches to torch (idempotent), for every thread of the process.

    Call it once in the main thread before anything is compiled; a worker's construction calls it
    too. Every symbol to be patched is checked first: on a torch that lacks one, nothing is patched.

    Args:
        exclude: Patches to leave out: one name or a collection of them (see :func:`patches`);
            meant for experiments and for demonstrating what each patch fixes, not for
            production. ``THREADGRAPH_EXCLUDE_PATCHES`` (a comma list) adds to it.

    Returns:
        The names of the patches this call applied (empty when all were in place).

    Raises:
        UnsupportedTorchError: This torch lacks a symbol a patch replaces (names every one), or
            ``THREADGRAPH_STRICT=1`` and this torch differs from the verified releases' records.
        UsageError: ``exclude`` names no patch (also a ValueError), or holds something other
            than names (also a TypeError).
        SettingError: A ``THREADGRAPH_*`` variable holds a bad value (:func:`check_settings`).
    """
    check_settings()
    exclude = patch_names(exclude, "exclude") | _excluded_by_env()
    if any(row["applies"] and not row["active"] and row["name"] not in exclude for row in _registry.describe()):
        _verify.check(PATCHES, exclude)  # before anything is patched; nothing to check when nothing is new
    applied = _registry.install(exclude, also_missing=_compat.missing_required())
    if FENCE_PATCHES & set(applied):
        _torch_calls.refresh_dynamo_rules()
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
                   f"still end each other's generations (hazard global-generation). Please report it at {_compat.ISSUES_URL}")
        log.warning(message)
        warnings.warn(message, ThreadgraphWarning, stacklevel=3)


def _trees_exist_in_this_thread() -> bool:
    if not torch._C._is_key_in_tls("tree_manager_containers"):
        return False
    containers = torch._C._get_obj_in_tls("tree_manager_containers")
    return any(getattr(c, "tree_manager", None) is not None for c in containers.values())


def uninstall(names: Optional[Iterable[str]] = None) -> list[str]:
    """Restore the exact original objects that :func:`install` replaced.

    Args:
        names: Only these patches (one name or a collection of them); None removes all of them
            and forgets what ``install(exclude=...)`` left out.

    Returns:
        The names of the patches removed.

    Raises:
        UsageError: ``names`` names no patch (also a ValueError), or holds something other than
            names (also a TypeError).
    """
    if names is not None:
        names = patch_names(names, "uninstall")
        _registry.check_known(names)
    removed = _registry.uninstall(names)
    if FENCE_PATCHES & set(removed):
        _torch_calls.refresh_dynamo_rules()
    return removed


@contextlib.contextmanager
def patched() -> Iterator[None]:
    """A context manager: :func:`install` for the duration of a block; on exit it uninstalls only
    the patches the block installed.

    Example:
        ``with threadgraph.patched(): run_threads()``
    """
    applied = install()
    try:
        yield
    finally:
        if applied:
            uninstall(applied)


def installed() -> bool:
    """Whether threadgraph's patches are in place (any of them active; :func:`patches` says which)."""
    return any(p["active"] for p in _registry.describe())


def patches() -> list[dict[str, Any]]:
    """Every patch threadgraph has, as a list of dicts, one per patch, in the order applied.

    Each dict holds ``name``; ``target`` and ``targets`` (``"module:Owner.attribute"`` strings,
    the symbols it replaces); ``hazard`` (why: an entry of docs/hazards.md); ``applies``
    (whether :func:`install` applies it on this torch); ``missing`` (targets this torch lacks) and
    ``active`` (whether it is in place now). docs/patches.md describes each patch.
    """
    return _registry.describe()
