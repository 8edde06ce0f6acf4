"""Every torch-version special case lives here, answered by feature detection (the calls
threadgraph's wrappers make into torch while they run are in ``_torch_calls``).

Nothing else in threadgraph looks at ``torch.__version__``; it asks these functions.
They are cheap and re-evaluated on each call (except the stash probe and the generator's
capture check, which are properties of the C++ build), so tests can swap in the module
behaviour of an older release and see the shim react.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import inspect
import itertools
import json
import mmap
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from threadgraph._errors import UnsupportedTorchError

# (import path, attribute) pairs threadgraph reads directly; a missing one is reported by name.
# The symbols its patches replace are not listed: the registry checks each patch's own targets.
REQUIRED_SYMBOLS = (
    ("torch._inductor.cudagraph_trees", "local"),
    ("torch._inductor.cudagraph_trees", "MarkStepBox"),
    ("torch._inductor.cudagraph_trees", "CUDAGraphTreeManager"),
    ("torch._dynamo.mutation_guard", "GenerationTracker"),
    ("torch._C", "_stash_obj_in_tls"),
    ("torch._C", "_is_key_in_tls"),
    ("torch._C", "_get_obj_in_tls"),
)


def _newest_recorded() -> tuple[int, ...]:
    # Without the file (a build that left it out) no release counts as verified: install() says so.
    path = Path(__file__).parent / "_patches" / "fingerprints.json"
    versions = json.loads(path.read_text(encoding="utf-8"))["releases"] if path.is_file() else {}
    return max((tuple(int(part) for part in version.split(".")) for version in versions), default=(0, 0, 0))


# The newest torch whose fingerprints were recorded after its tests passed (_patches/fingerprints.json).
# doctor warns beyond it; this is the one version comparison threadgraph makes, and it chooses no
# behaviour (features are detected).
NEWEST_VERIFIED = _newest_recorded()


def release(version: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of a torch version string (local and pre-release tags dropped)."""
    numbers = []
    for piece in (version or torch.__version__).split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        numbers.append(int(digits or 0))
    major, minor, patch = (numbers + [0, 0, 0])[:3]
    return major, minor, patch


def newer_than_verified(version: str | None = None) -> bool:
    return release(version) > NEWEST_VERIFIED


ISSUES_URL = "https://github.com/threadgraph/threadgraph/issues"  # where error messages ask users to report


def require(module_path: str, attribute: str) -> Any:
    """Return ``module.attribute`` or raise an error that names the missing symbol."""
    try:
        module = importlib.import_module(module_path)
    except ImportError as exc:
        raise UnsupportedTorchError(
            f"threadgraph needs {module_path} (torch {torch.__version__} does not provide it: {exc}); "
            "install torch>=2.1 with CUDAGraph Trees"
        ) from exc
    try:
        return getattr(module, attribute)
    except AttributeError:
        raise UnsupportedTorchError(
            f"threadgraph needs {module_path}.{attribute}, which torch {torch.__version__} lacks; "
            "threadgraph cannot patch it; please report it at " + ISSUES_URL
        ) from None


def missing_required() -> dict[str, list[str]]:
    """Each symbol of :data:`REQUIRED_SYMBOLS` this torch lacks -> ``["threadgraph"]`` (its user)."""
    missing = {}
    for module_path, attribute in REQUIRED_SYMBOLS:
        try:
            present = hasattr(importlib.import_module(module_path), attribute)
        except ImportError:
            present = False
        if not present:
            missing[f"{module_path}.{attribute}"] = ["threadgraph"]
    return missing


def unsupported_torch(missing: dict[str, list[str]]) -> UnsupportedTorchError:
    """One error for every symbol this torch lacks (symbol -> the patches, or threadgraph, needing it)."""
    listed = "; ".join(f"{symbol} (needed by {', '.join(users)})" for symbol, users in sorted(missing.items()))
    patches = sorted({user for users in missing.values() for user in users} - {"threadgraph"})
    only_patches = patches and not any("threadgraph" in users for users in missing.values())
    leave_out = (f" To try it anyway without those patches (their hazards then stay unfixed): "
                 f"install(exclude={patches!r})." if only_patches else "")
    verified = ".".join(map(str, NEWEST_VERIFIED))
    return UnsupportedTorchError(
        f"threadgraph: torch {torch.__version__} lacks {listed}; nothing was patched (this torch moved or "
        f"renamed what threadgraph relies on). Use a torch threadgraph supports (2.1 - {verified}) or a "
        f"threadgraph release that supports this torch, and please report it at {ISSUES_URL}; `python -m threadgraph doctor` "
        f"lists what is missing.{leave_out}"
    )


def cudagraph_trees() -> ModuleType:
    return importlib.import_module("torch._inductor.cudagraph_trees")


def get_obj_asserts() -> bool:
    """True on releases (2.1 - 2.12) whose ``get_obj`` asserts in a thread without TLS.

    2.13+ added ``_initialize_tls`` and calls it lazily from ``get_obj``.
    """
    return not hasattr(cudagraph_trees(), "_initialize_tls")


def has_graph_capture_lock() -> bool:
    """2.13+ serialises tree-manager init, warmup and recording with a module lock."""
    return hasattr(cudagraph_trees(), "graph_capture_lock")


# The CUDA generator's refusal of an eager draw while another thread captures (pytorch#123177).
GENERATOR_CAPTURE_CHECK = b"Offset increment outside graph capture"


def cuda_library() -> Path | None:
    """This torch's CUDA library (``torch/lib/libtorch_cuda.so``), or None on a CPU build."""
    path = Path(torch.__file__).parent / "lib" / "libtorch_cuda.so"
    return path if path.is_file() else None


@functools.lru_cache(maxsize=None)
def generator_rejects_draws_beside_captures(library: Path | None = None) -> bool | None:
    """Whether an eager RNG draw raises while another thread captures on the device: the CUDA
    generator's offset check (its message) is in the CUDA library. Releases whose RNG state is kept
    per capture no longer carry it (2.14.1). None on a CPU build: there is nothing to capture."""
    library = library or cuda_library()
    if library is None:
        return None
    with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as image:
        return image.find(GENERATOR_CAPTURE_CHECK) != -1


def fx_tracing_flag_is_global() -> bool:
    """Whether FX keeps its "tracing now" flag in one module-global bool (``_is_fx_tracing_flag``,
    which ``Tracer.trace`` sets), so every thread's ``is_fx_tracing()`` sees any thread's trace.
    Releases that keep it in a ``threading.local`` (``_is_fx_tracing_tls``) answer per thread."""
    fx = importlib.import_module("torch.fx._symbolic_trace")
    return isinstance(vars(fx).get("_is_fx_tracing_flag"), bool)


def fx_patcher_is_global() -> bool:
    """Whether FX keeps the active tracing patcher (which patches ``nn.Module.__call__`` for every
    thread) in the module global ``CURRENT_PATCHER`` rather than per thread."""
    fx = importlib.import_module("torch.fx._symbolic_trace")
    return "CURRENT_PATCHER" in vars(fx)


def compile_session_flag_is_global() -> bool:
    """Whether a compile holds ``torch.compiler.is_compiling()`` True for every thread: Dynamo enters
    ``torch.compiler._compile_session_context`` (2.13+), which sets the module global
    ``_is_compiling_flag`` that ``is_compiling`` returns."""
    compiler = importlib.import_module("torch.compiler")
    code = getattr(getattr(compiler, "is_compiling", None), "__code__", None)
    return callable(vars(compiler).get("_compile_session_context")) and "_is_compiling_flag" in getattr(code, "co_names", ())


def generation_counters_are_global() -> bool:
    """Whether CUDAGraph Trees' generation counters are plain attributes of process-wide objects:
    ``MarkStepBox.mark_step_counter`` (a class attribute) and ``GenerationTracker.generation``
    (a class attribute, or an attribute of one module-level instance), not thread- or worker-local."""
    mark_step_box = require("torch._inductor.cudagraph_trees", "MarkStepBox")
    tracker = require("torch._dynamo.mutation_guard", "GenerationTracker")
    counter = vars(mark_step_box).get("mark_step_counter")
    return isinstance(counter, int) and not isinstance(tracker, threading.local) and isinstance(
        getattr(tracker, "generation", None), int
    )


@functools.lru_cache(maxsize=None)
def generation_tracker() -> Any:
    """What holds Dynamo's process-wide generation counter in its ``generation`` attribute: the
    class ``GenerationTracker`` (2.1 - 2.14), or its one module-level instance (2.15)."""
    return require("torch._dynamo.mutation_guard", "GenerationTracker")


def process_generation() -> int:
    """Dynamo's process-wide generation counter (``GenerationTracker.generation``)."""
    return generation_tracker().generation


def dynamo_contexts_have_enter_hooks() -> bool:
    """Whether Dynamo's contexts run a list of enter hooks (``enter_exit_hooks``, each returning
    its exit) that ``RunOnlyContext``'s generation bump is one of."""
    eval_frame = importlib.import_module("torch._dynamo.eval_frame")
    context = getattr(eval_frame, "_TorchDynamoContext", None)
    if context is None or not hasattr(eval_frame, "RunOnlyContext"):
        return False
    return _source_has(context.__init__, "self.enter_exit_hooks")


def fullgraph_error_skips_exit_hooks() -> bool:
    """Whether a ``fullgraph=True`` call that compiled no frame fails ("found no compiled frames")
    from where its context's exit hooks no longer run, asking ``get_skip_reasons`` first (2.13+)."""
    eval_frame = importlib.import_module("torch._dynamo.eval_frame")
    context = getattr(eval_frame, "_TorchDynamoContext", None)
    return (hasattr(eval_frame, "get_skip_reasons") and context is not None
            and _source_has(context.__call__, "get_skip_reasons()"))


def _source_has(owner: Any, text: str) -> bool:
    try:
        return text in inspect.getsource(owner)
    except (OSError, TypeError):
        return False


def overloads_hash_their_op() -> bool:
    """Whether an ATen overload hashes as its ``_op`` (so replacing ``_op`` changes its hash)."""
    return _source_has(torch._ops.OpOverload.__hash__, "self._op")


def dynamo_checks_wrapper_ids() -> bool:
    """Whether Dynamo's ``innermost_fn`` follows a wrapper only when its ``_torchdynamo_wrapper_id``
    is the wrapper's own id."""
    eval_frame = importlib.import_module("torch._dynamo.eval_frame")
    return _source_has(getattr(eval_frame, "innermost_fn", None), "_torchdynamo_wrapper_id")


# The manager methods threadgraph patches to answer with the worker's generation; every other
# manager method must reach the counters through them for the patches to be complete.
GENERATION_READERS = ("get_curr_generation", "user_invoked_mark_step")
_COUNTER_READS = ("MarkStepBox.mark_step_counter", "GenerationTracker.generation")


def unpatched_generation_reads() -> list[str] | None:
    """Tree-manager methods that read a global generation counter directly instead of through
    :data:`GENERATION_READERS` (whose answers the generation patches replace). ``[]`` means
    the patches see every read; ``None`` means the source cannot be read here.

    The generation snapshot (``curr_generation``) that 2.14+ takes once per call and passes
    down (``try_end_curr_execution``, ``can_start_new_generation``,
    ``in_new_torch_compile_invocation``) is taken with ``self.get_curr_generation()``, so it is
    the worker's; a release that read the counters anywhere else would be listed here."""
    manager = require("torch._inductor.cudagraph_trees", "CUDAGraphTreeManager")
    readers = []
    for name, member in vars(manager).items():
        if name in GENERATION_READERS:
            continue
        function = getattr(member, "__wrapped__", member)
        function = getattr(function, "__func__", function)
        if not inspect.isfunction(function):
            continue
        try:
            source = inspect.getsource(function)
        except (OSError, TypeError):
            return None
        if any(read in source for read in _COUNTER_READS):
            readers.append(name)
    return readers


def generation_snapshot_parameter() -> bool:
    """Whether the manager's generation checks take a ``curr_generation`` snapshot (2.14+) that
    callers pass down instead of asking ``get_curr_generation()`` again."""
    manager = require("torch._inductor.cudagraph_trees", "CUDAGraphTreeManager")
    return "curr_generation" in inspect.signature(manager.in_new_torch_compile_invocation).parameters


def dynamo_fx_tracing_check() -> str | None:
    """The predicate Dynamo asks before running a compiled function: ``is_fx_symbolic_tracing``
    where it exists, else ``is_fx_tracing``. Both read the flag ``Tracer.trace`` sets; where that
    flag is process-global (:func:`fx_tracing_flag_is_global`), a compile (make_fx) in one thread
    makes compiled calls in another raise "Detected that you are using FX to symbolically trace a
    dynamo-optimized function"."""
    fx = importlib.import_module("torch.fx._symbolic_trace")
    for name in ("is_fx_symbolic_tracing", "is_fx_tracing"):
        if hasattr(fx, name) and hasattr(fx, "Tracer"):
            return name
    return None


def dynamo_frame_callback() -> str | None:
    """The outermost class whose ``__call__`` Dynamo runs on a cache miss; it takes Dynamo's
    process-wide ``compile_lock`` (``CatchErrorsWrapper``; older releases use a closure)."""
    convert_frame = importlib.import_module("torch._dynamo.convert_frame")
    cls = getattr(convert_frame, "CatchErrorsWrapper", None)
    return "CatchErrorsWrapper" if cls is not None and "__call__" in vars(cls) else None


def has_global_compile_lock() -> bool:
    """Dynamo's ``compile_lock``: one process-wide lock around every frame's compile."""
    convert_frame = importlib.import_module("torch._dynamo.convert_frame")
    return getattr(convert_frame, "compile_lock", None) is not None


def accelerator_graph() -> Any:
    """``torch.accelerator.Graph`` (2.13+), a capture API beside ``torch.cuda.CUDAGraph`` whose
    ``capture_begin`` / ``capture_end`` do not go through CUDAGraph's; None where torch lacks it."""
    accelerator = getattr(torch, "accelerator", None)
    graph = getattr(accelerator, "Graph", None)
    return graph if isinstance(graph, type) and "capture_begin" in vars(graph) else None


def has_remove_obj_from_tls() -> bool:
    return hasattr(torch._C, "_remove_obj_from_tls")


@functools.lru_cache(maxsize=None)
def stash_takes_reference() -> bool:
    """Whether ``torch._C._stash_obj_in_tls`` takes its own reference to the object.

    On 2.11 it steals one it was never given (a use-after-free once the caller drops its
    reference: hazard ``stash-steals-reference``). Measured once with the refcount of a throwaway object under a
    throwaway key, which is then removed or overwritten with an owned object.
    """
    probe = object()
    before = sys.getrefcount(probe)
    key = "threadgraph.stash_probe"
    torch._C._stash_obj_in_tls(key, probe)
    takes = sys.getrefcount(probe) > before
    if not takes:
        # The stash now owns a reference nobody gave it: give it one.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(probe))
    if has_remove_obj_from_tls():
        torch._C._remove_obj_from_tls(key)
    return takes


def stash(key: str, obj: Any) -> None:
    """Store ``obj`` in the C++ thread-local Python-object stash, reference-correct on
    every release. The stash travels with ThreadLocalState into autograd's threads."""
    if not stash_takes_reference():
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    torch._C._stash_obj_in_tls(key, obj)


def unstash(key: str) -> bool:
    """Remove ``key`` from this thread's stash where torch can (2.13+); returns whether it did.

    Without ``_remove_obj_from_tls`` the entry lives until the thread exits, which is
    harmless because :func:`stash` gave it a reference of its own.
    """
    if has_remove_obj_from_tls() and torch._C._is_key_in_tls(key):
        torch._C._remove_obj_from_tls(key)
        return True
    return False


def thread_exit_during_finalization_aborts() -> bool:
    """Python < 3.14 ends a thread that wants the GIL during finalisation with pthread_exit,
    whose unwinding through a noexcept C++ destructor aborts the process (3.14 hangs it instead)."""
    return sys.version_info < (3, 14)
