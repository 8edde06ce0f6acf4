"""What install() checks before it patches: the running torch against the verified releases.

For every patch that would apply, each target's and each assumed symbol's fingerprint
(``fingerprint``) is compared with the reference release's; every feature detection's outcome and
every assumption check's (below) too. The reference is the running release where it is recorded
(a verified release: a difference means something in this process changed torch, another
library's patch say), else the newest recorded release older than it (upstream moved since).

Each difference is reported once per process, as a ``ThreadgraphWarning`` naming the patch, the
torch symbol and what differs. ``THREADGRAPH_STRICT=1`` makes any difference an error raised before
anything is patched. ``python -m threadgraph doctor`` prints the outcome patch by patch.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import os
import platform
import threading
import warnings
from typing import Any, Callable, Iterable, Optional

import torch

from threadgraph import _compat
from threadgraph._errors import SettingError, ThreadgraphWarning, UnsupportedTorchError
from threadgraph._patches import fingerprint

log = logging.getLogger("threadgraph")

STRICT_ENV = "THREADGRAPH_STRICT"
_TREES = "torch._inductor.cudagraph_trees"
_FX = ("fx_trace_marks_thread", "fx_symbolic_tracing_per_thread", "fx_tracing_per_thread")


def _manager_device_parameter() -> Optional[str]:
    init = _compat.require(_TREES, "CUDAGraphTreeManager").__init__
    parameters = [name for name in inspect.signature(init).parameters if name != "self"]
    return parameters[0] if parameters else None


def _tree_tls_keys() -> bool:
    try:
        source = inspect.getsource(_compat.cudagraph_trees())
    except (OSError, TypeError):
        return False
    return all(key in source for key in ("tree_manager_containers", "tree_manager_locks"))


def _overloads_have_op() -> bool:
    return hasattr(torch.ops.aten.rand.default, "_op")


def _frame_cache_readable() -> bool:
    from threadgraph._patches import frame_cache

    eval_frame = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    return hasattr(eval_frame, "_debug_get_cache_entry_list") and frame_cache.run_uncompiled_once() is not None


# name -> (what it answers, the patches that rely on the answer). Feature detections choose whether a
# patch applies; assumption checks answer what a wrapper takes for granted without choosing anything.
CHECKS: dict[str, tuple[Callable[[], Any], tuple[str, ...]]] = {
    "get_obj_asserts": (_compat.get_obj_asserts, ("lazy_tls",)),
    "has_graph_capture_lock": (_compat.has_graph_capture_lock, ("capture_lock_gives_up_slots",)),
    "fx_tracing_flag_is_global": (_compat.fx_tracing_flag_is_global, _FX),
    "dynamo_fx_tracing_check": (_compat.dynamo_fx_tracing_check, _FX),
    "fx_patcher_is_global": (_compat.fx_patcher_is_global, ("fx_trace_window",)),
    "compile_session_flag_is_global": (_compat.compile_session_flag_is_global, ("compile_flag_per_thread",)),
    "dynamo_contexts_have_enter_hooks": (_compat.dynamo_contexts_have_enter_hooks,
                                         ("worker_run_only_generation", "first_call_in_turn")),
    "fullgraph_error_skips_exit_hooks": (_compat.fullgraph_error_skips_exit_hooks, ("first_call_in_turn",)),
    "dynamo_frame_callback": (_compat.dynamo_frame_callback, ("gate_release_in_compile",)),
    "has_global_compile_lock": (_compat.has_global_compile_lock, ("gate_release_in_compile", "fx_trace_window")),
    "generation_counters_are_global": (_compat.generation_counters_are_global, ("worker_generation",)),
    "unpatched_generation_reads": (_compat.unpatched_generation_reads, ("worker_generation",)),
    "dynamo_checks_wrapper_ids": (_compat.dynamo_checks_wrapper_ids, ("first_call_in_turn",)),
    "overloads_hash_their_op": (_compat.overloads_hash_their_op, ("fence_rng_ops",)),
    "has_accelerator_graph": (lambda: _compat.accelerator_graph() is not None,
                              ("accelerator_capture_begin_exclusive", "accelerator_capture_end_exclusive")),
    "manager_init_device_parameter": (_manager_device_parameter, ("gate_manager_init",)),
    "tree_manager_tls_keys": (_tree_tls_keys, ("lazy_tls", "worker_cudagraphify")),
    "overloads_have_op": (_overloads_have_op, ("fence_rng_ops",)),
    "frame_cache_readable": (_frame_cache_readable, ("fx_trace_window", "gate_release_in_compile")),
}

# Why a feature-detected patch is not needed where its condition does not hold (doctor says it).
NOT_NEEDED = {
    "lazy_tls": "CUDAGraph Trees initialises its thread-local state lazily (`_initialize_tls`)",
    "capture_lock_gives_up_slots": "no module-level `graph_capture_lock` in CUDAGraph Trees",
    "fx_trace_marks_thread": "FX keeps its tracing flag per thread",
    "fx_symbolic_tracing_per_thread": "FX keeps its tracing flag per thread, or Dynamo asks `is_fx_tracing`",
    "fx_tracing_per_thread": "FX keeps its tracing flag per thread, or Dynamo asks `is_fx_symbolic_tracing`",
    "compile_flag_per_thread": "`is_compiling()` does not read a process-wide compile-session flag",
    "worker_run_only_generation": "Dynamo's contexts have no enter hooks (`enter_exit_hooks`)",
    "gate_release_in_compile": "Dynamo's frame callback is not a `CatchErrorsWrapper`",
    "fx_trace_window": "FX keeps its active patcher per thread",
    "accelerator_capture_begin_exclusive": "this torch has no `torch.accelerator.Graph`",
    "accelerator_capture_end_exclusive": "this torch has no `torch.accelerator.Graph`",
}


@dataclasses.dataclass(frozen=True)
class Difference:
    patch: str
    symbol: str
    what: str

    def message(self, reference: Optional[str], verified: bool) -> str:
        if reference is None:
            return (f"threadgraph: {self.symbol}: {self.what}, so nothing threadgraph patches can be checked; "
                    "reinstall threadgraph (its package data is incomplete)")
        why = (f"torch {reference} is a verified release, so something in this process changed it (another "
               "library's patch?)" if verified else
               f"this torch is not a verified release: upstream changed it since {reference}, the newest verified "
               "release before it")
        return (f"threadgraph: patch {self.patch}: {self.symbol}: {self.what}; {why}. The patch may not fit it: run "
                f"`python -m threadgraph doctor` and the test suite; {STRICT_ENV}=1 makes this an error")


def strict() -> bool:
    """Whether ``THREADGRAPH_STRICT`` asks for differences to be errors (``1``; ``0`` or unset: warnings)."""
    value = os.environ.get(STRICT_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise SettingError(f"threadgraph: {STRICT_ENV}={value!r} is not 0 or 1; set it to 1 (differences from the "
                           "verified releases are errors) or 0, or unset it")
    return value == "1"


def reference(version: Optional[str] = None) -> tuple[Optional[str], bool]:
    """The recorded release to compare the running torch with, and whether the running one is it."""
    releases = fingerprint.load()["releases"]
    if not releases:
        return None, False
    running = _compat.release(version)
    exact = ".".join(map(str, running))
    if exact in releases:
        return exact, True
    ordered = sorted(releases, key=fingerprint.release_key)
    older = [v for v in ordered if fingerprint.release_key(v) < running]
    return (older[-1] if older else ordered[0]), False


def record_live(patches: Iterable[Any]) -> dict:
    """The running torch's record: fingerprints of every target and assumed symbol, and each check's outcome."""
    with _parsing:
        return _record_live(list(patches))


def _record_live(patches: list) -> dict:
    symbols: dict[str, Optional[str]] = {}
    for patch in patches:
        for target in [*patch.targets(), *patch.assumes]:
            try:
                symbols[target] = fingerprint.live(target)
            except (ImportError, AttributeError):
                continue
    return {"recorded_from": f"installed torch {torch.__version__}, Python {platform.python_version()}",
            "symbols": symbols, "checks": {name: _json(_run(check)) for name, (check, _) in CHECKS.items()}}


def record_source(patches: Iterable[Any], tree: "fingerprint.SourceTree") -> dict:
    """A torch source tree's record (no import: fingerprints only, no check outcomes)."""
    symbols = {target: tree.fingerprint(target)
               for patch in patches for target in [*patch.targets(), *patch.assumes]}
    return {"recorded_from": "source tree (fingerprints only)", "symbols": symbols}


def _run(check: Callable[[], Any]) -> Any:
    """A check's outcome; one that fails on this torch answers its error, which then differs from the record."""
    try:
        return check()
    except Exception as exc:  # noqa: BLE001 (reported: the outcome differs from every record)
        return f"error: {type(exc).__name__}: {exc}"


def _json(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


_fingerprints: dict[str, tuple[Any, Any, Optional[str]]] = {}  # target -> (object, its code, fingerprint)


def _live_fingerprint(target: str) -> Optional[str]:
    obj = fingerprint.resolve(target.removesuffix(".__code__"))
    code = getattr(getattr(obj, "__func__", obj), "__code__", None)
    known = _fingerprints.get(target)
    if known is not None and known[0] is obj and known[1] is code:
        return known[2]
    value = fingerprint.live(target)
    _fingerprints[target] = (obj, code, value)
    return value


# CPython 3.11's ast module keeps its recursion depth per interpreter: two threads parsing at once (workers
# calling install() together) can fail with "AST constructor recursion depth mismatch".
_parsing = threading.Lock()


def has_verified_code(target: str, obj: Callable[..., Any]) -> bool:
    """Whether ``obj``, what stands at ``target`` now, has the code ``target`` has in a verified release."""
    with _parsing:
        try:
            now = fingerprint.of_source(inspect.getsource(obj))
        except (OSError, TypeError, SyntaxError):
            return False
    return any(record["symbols"].get(target) == now for record in fingerprint.load()["releases"].values())


def differences(patches: Iterable[Any], exclude: Iterable[str] = ()) -> tuple[Optional[str], bool, list[Difference]]:
    """``(reference release, whether it is the running one, differences)`` of the patches install()
    would apply (``exclude`` left out) and of every check."""
    with _parsing:
        return _differences(list(patches), exclude)


def _differences(patches: list, exclude: Iterable[str]) -> tuple[Optional[str], bool, list[Difference]]:
    version, verified = reference()
    if version is None:
        return None, False, [Difference("(all)", "fingerprints.json", "no verified release is recorded")]
    record = fingerprint.load()["releases"][version]
    excluded = set(exclude)
    found: list[Difference] = []
    for patch in patches:
        if patch.name in excluded or not patch.applies():
            continue
        missing = set(patch.missing())
        for target in [*patch.targets(), *patch.assumes]:
            if target.replace(":", ".") in missing or target not in record["symbols"]:
                continue  # a missing target is install()'s own error; an unrecorded one is compared nowhere
            try:
                now = _live_fingerprint(target)
            except (ImportError, AttributeError):
                found.append(Difference(patch.name, target.replace(":", "."), f"missing (present in torch {version})"))
                continue
            then = record["symbols"][target]
            if now != then:
                found.append(Difference(patch.name, target.replace(":", "."),
                                        f"its code differs from torch {version}'s (fingerprint {now}; {then} in {version})"))
    recorded = record.get("checks", {})
    for name, (check, users) in CHECKS.items():
        if name not in recorded:
            continue
        now, then = _json(_run(check)), recorded[name]
        if now != then:
            for user in users:
                if user not in excluded:
                    found.append(Difference(user, f"threadgraph._compat check {name}",
                                            f"answers {now!r} where torch {version} answered {then!r}"))
    return version, verified, found


_reported: set[Difference] = set()


def check(patches: Iterable[Any], exclude: Iterable[str] = ()) -> list[Difference]:
    """install()'s check: raise in strict mode on any difference, before anything is patched; else warn
    once per difference per process. Returns the differences."""
    is_strict = strict()
    patches = list(patches)
    version, verified, found = differences(patches, exclude)
    if found and is_strict:
        listed = "\n  ".join(d.message(version, verified) for d in found)
        raise UnsupportedTorchError(f"threadgraph: {STRICT_ENV}=1 and torch {torch.__version__} differs from what "
                                    f"threadgraph verified; nothing was patched:\n  {listed}")
    for difference in found:
        if difference in _reported:
            continue
        _reported.add(difference)
        message = difference.message(version, verified)
        log.warning(message)
        warnings.warn(message, ThreadgraphWarning, stacklevel=3)
    return found


def statuses(rows: list[dict], found: list[Difference], version: Optional[str]) -> dict[str, str]:
    """Patch name -> doctor's word for it: applies / not needed (why) / changed since <release> / missing."""
    changed: dict[str, list[Difference]] = {}
    for difference in found:
        changed.setdefault(difference.patch, []).append(difference)
    out = {}
    for row in rows:
        name = row["name"]
        if row["missing"]:
            out[name] = f"missing: this torch lacks {', '.join(row['missing'])}"
        elif name in changed:
            what = "; ".join(f"{d.symbol}: {d.what}" for d in changed[name])
            out[name] = f"target changed since torch {version}: {what}"
        elif not row["applies"]:
            out[name] = f"not needed on this torch ({NOT_NEEDED.get(name, 'its condition does not hold')})"
        else:
            out[name] = "active" if row["active"] else "applies"
    return out
