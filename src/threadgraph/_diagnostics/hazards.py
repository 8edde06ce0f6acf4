"""The hazard catalogue: what goes wrong when CUDAGraph Trees (and the compile stack under it)
meet Python threads, how threadgraph tells whether this torch has it, and what addresses it.

One entry per hazard, under a stable name that patches, ``doctor``, the README and
``docs/hazards.md`` use (``python -m threadgraph hazards --write docs/hazards.md`` renders it, through
``_hazards_page``).
``detect`` answers by feature detection; a hazard without one is *assumed* present, and says so.
Upstream links are the ones verified to exist; none known is said as such.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from threadgraph import _compat

# The releases this catalogue was checked against; what each patch saw is in its own record.
READ_RELEASES = "2.13.0, 2.14.1, 2.15.0"
READ = f"{READ_RELEASES} (source)"
RUN_CPU = "2.13.0, 2.14.1, 2.15.0 (CPU test suite)"
RUN_GPU = "2.11.0, 2.14.1 and 2.15.0 (GPU tests and benchmarks), NVIDIA H200"
SIMULATED = "2.1 - 2.12 by simulation only (CPU tests swap in the older behaviour), except 2.11 on the GPU"


@dataclasses.dataclass(frozen=True)
class Hazard:
    name: str
    summary: str
    detection: str  # how ``detect`` decides, or why the hazard is assumed
    affected: str  # releases that have it, as far as read or run
    verified: str  # releases where it was seen, read or run
    upstream: tuple[str, ...] = ()  # verified upstream issues and pull requests
    mitigation: str = ""  # what threadgraph does besides patches (or instead of them)
    detect: Optional[Callable[[], bool]] = None  # None: assumed present

    def status(self) -> str:
        """``present`` or ``absent`` (detected), or ``assumed`` (no detection)."""
        if self.detect is None:
            return "assumed"
        return "present" if self.detect() else "absent"


def _gh(number: int, kind: str = "issues") -> str:
    return f"https://github.com/pytorch/pytorch/{kind}/{number}"


HAZARDS: tuple[Hazard, ...] = (
    Hazard(
        "tls-assert",
        "A plain thread calling a reduce-overhead function fails in `get_obj` "
        "(`assert torch._C._is_key_in_tls(attr_name)`): the tree-manager TLS exists only in the "
        "thread that imported `cudagraph_trees` and in autograd's threads.",
        "detected: `cudagraph_trees` has no `_initialize_tls` (2.13+ initialises the TLS lazily)",
        "2.1 - 2.12",
        f"2.11.0 (measured on an H200); {READ}: absent",
        (_gh(123177), _gh(184357, "pull")),
        "`ensure_cudagraph_tls()` at a thread's start does the same without `install()`.",
        _compat.get_obj_asserts,
    ),
    Hazard(
        "global-generation",
        "Mark-step and generation counters are process-wide (`MarkStepBox.mark_step_counter`, "
        "`GenerationTracker.generation`), but tree managers are per thread: one thread's "
        "`cudagraph_mark_step_begin()` or compiled call starts a new generation for every thread's "
        "manager and frees their live outputs (\"accessing tensor output of CUDAGraphs that has been "
        "overwritten by a subsequent run\").",
        "detected: both counters are plain attributes of process-wide objects, not thread-local",
        "2.1 - 2.15.0",
        f"2.11.0 (measured: 3 training threads on one GPU); {READ}",
        (),
        "Per-worker counters live in torch's C++ thread-local stash, which autograd copies into "
        "its device threads, so a worker's backward reads its own. A worker's generation is the process "
        "counter as the worker's own thread last moved it (every entry into compiled code, and each call "
        "through `torch._dynamo.run`, `worker_run_only_generation`), so code that sets "
        "`GenerationTracker.generation` back, as upstream's tests do to record a second function in the "
        "first one's generation, is seen exactly as upstream sees it; `reset_cudagraph_trees()` zeroes the "
        "calling worker's mark-step counter where upstream zeroes the process's (`worker_mark_step_reset`). "
        "Upstream's `test_checkpointing_resets_persistent_refs` (one live block where two were expected) "
        "and `test_frozen_fn` (a frozen call recorded a new graph) failed under `install()` on 2.11.0, also "
        "on the main thread, while the worker counted its own increments instead.",
        _compat.generation_counters_are_global,
    ),
    Hazard(
        "device-wide-capture",
        "Capture is device-wide in effect: while one thread records, another thread's "
        "`torch.cuda.synchronize` (\"operation not permitted when stream is capturing\") breaks the "
        "capture, and so does its eager RNG draw (\"Offset increment outside graph capture encountered "
        "unexpectedly\") where the CUDA generator keeps one offset for all captures "
        "(`_compat.generator_rejects_draws_beside_captures`: the check is in the CUDA library). 2.13+'s "
        "`graph_capture_lock` orders tree-manager operations against each other only.",
        "assumed: a property of CUDA capture, not of a Python symbol",
        "2.1 - 2.15.0 (the RNG part: releases whose CUDA library carries the generator's check)",
        "2.11.0 (measured on an H200: both parts); 2.14.1 (measured on an H200: the sync part; unfenced, "
        "RNG draws beside captures raised nothing and left the workers' outputs right, in 3 runs of "
        f"pytorch#123177's repro and 4 matrix cells; its CUDA library lacks the check); {READ}",
        (),
        "The device gate: workers hold a shared slot while they do CUDA work, capture paths (also any "
        "`torch.cuda.CUDAGraph` capture) take it exclusively. The eager fence orders every other thread: "
        "torch's RNG entry points, the ATen RNG overloads compiled code calls and `torch.cuda.synchronize` "
        "wait while another thread holds the device. Measured safe and left alone: stream and event "
        "syncs, host reads, allocation, `empty_cache`. Work reached from C++ without those entry points "
        "goes in `threadgraph.outside_captures()`. The RNG fence also applies where the generator no "
        "longer checks: there it only delays a draw until the capture ends, and the unfenced evidence "
        "is one release's few runs.",
    ),
    Hazard(
        "capture-lock-order",
        "2.13+ holds one process-wide `graph_capture_lock` around a tree manager's set-up, each warm-up "
        "and each recording. With the device gate taken inside it, a worker that calls a compiled "
        "function while holding its gate slot waits for the lock, and the lock's holder waits for that "
        "slot: training workers on one GPU hang for good.",
        "detected: `torch._inductor.cudagraph_trees` has `graph_capture_lock` (`_compat.has_graph_capture_lock`)",
        "2.13 - 2.15.0 (feature-detected)",
        "2.14.1 (measured on an H200: 3 and 8 training workers and the fence's 3 workers hung with the "
        "lock unpatched, and pass with the patch); 2.13.0, 2.14.1 (read)",
        (),
        "Patched: the lock gives up its thread's gate slots while waiting for and holding it, and the "
        "manager set-up takes it before the gate; lock first, then the gate, everywhere.",
        _compat.has_graph_capture_lock,
    ),
    Hazard(
        "autograd-device-thread",
        "CUDA backward of every caller on a device runs on one autograd device thread, which "
        "inherits the caller's ThreadLocalState: captures inside backward happen there, and a "
        "gate that waits for a worker blocked in `.backward()` deadlocks.",
        "assumed: inherent to autograd's engine",
        "2.1 - 2.15.0",
        f"2.11.0 (measured: a stop-the-world gate hung 3 and 8 training workers); {READ}",
        (),
        "A worker gives its gate slots up while it waits in `torch.autograd.backward` / `grad`.",
    ),
    Hazard(
        "global-compile-lock",
        "Dynamo compiles one frame at a time under a process-wide lock (`convert_frame.compile_lock`); "
        "a worker queued on it must hold nothing a capture elsewhere waits for.",
        "detected: `torch._dynamo.convert_frame.compile_lock` exists",
        "2.3 - 2.15.0",
        f"2.11.0 (measured: 8 DFlash workers on one GPU stalled behind queued compiles); {READ}",
        (_gh(105943),),
        "",
        _compat.has_global_compile_lock,
    ),
    Hazard(
        "concurrent-first-compile",
        "Threads that call one compiled function for the first time together each compile it: Dynamo "
        "looks the frame up in its cache before it takes the compile lock and not again after, so every "
        "thread that missed compiles the same frame once more (same guards, same graphs; Dynamo logs "
        "\"Unexpected recompilation: runtime guards failed even though they passed\"). N identical "
        "workers wait N times for one compilation. Where Dynamo guards cached code on the backend object's "
        "identity (2.11: BACKEND_MATCH), code one worker compiled never serves another worker's own "
        "`torch.compile` call either, since every call builds a new Inductor backend object.",
        "assumed present: the lookup and the lock are in Dynamo's frame evaluator and convert_frame, "
        "with no hook to test for a second lookup",
        "2.1 - 2.15.0 (as read)",
        f"{RUN_CPU}: 3 workers compiling one module, 3 compiles of its frame without the patch, 1 with it; "
        f"2.11.0 on an H200: BACKEND_MATCH recompiles in every DFlash target worker; {READ}",
        (_gh(168373),),
        "",
    ),
    Hazard(
        "stash-steals-reference",
        "`torch._C._stash_obj_in_tls` stores an object without taking a reference: once the caller "
        "drops its own, the stash points at freed memory (read back as an unrelated object).",
        "detected: a refcount probe of `_stash_obj_in_tls` on a throwaway object",
        "2.11.0 (measured); other releases by the probe",
        f"2.11.0 (measured); {RUN_CPU}: the probe decides",
        (),
        "`_compat.stash` gives the stash the reference it takes.",
        lambda: not _compat.stash_takes_reference(),
    ),
    Hazard(
        "stash-released-at-thread-exit",
        "Objects in torch's C++ thread-local stash are released by the thread's C++ destructor after "
        "Python's `join()` has returned; that takes the GIL, and while the interpreter finalises, "
        "Python < 3.14 ends the thread inside a noexcept destructor: \"terminate called without an "
        "active exception\".",
        "detected: Python < 3.14 (3.14 hangs such a thread instead of ending it)",
        "every torch release with the stash, on Python < 3.14",
        f"seen in one of three DFlash trainer runs on a CPU; {RUN_CPU}",
        (_gh(117762), _gh(182083, "pull")),
        "Workers empty their stash before they end (`release_cudagraph_tls()`, where torch has "
        "`_remove_obj_from_tls`) and `join()` waits for the OS thread to be gone (Linux). For plain "
        "threads, which nothing joins that way, interpreter exit waits (after Python joined its threads, "
        "5 s at most) until the OS threads of finished threads that stashed entries are gone; seen once "
        "in the CPU conformance suite before that wait (a plain thread under `install()`, exit right after). "
        "A thread still running is not waited for, judged by `threading.enumerate()`: a Ctrl-C inside "
        "`Thread.join()` leaves a running thread reporting `is_alive()` False.",
        _compat.thread_exit_during_finalization_aborts,
    ),
    Hazard(
        "per-thread-device",
        "The current CUDA device is per host thread; a new thread starts on device 0.",
        "assumed: a property of the CUDA runtime",
        "every release",
        f"2.11.0 (two H200s); {READ}",
        (),
        "`CompiledWorkerThread` sets its device before `setup()`.",
    ),
    Hazard(
        "per-thread-config",
        "Inductor/Dynamo config set in the main thread (`config.patch` or assignment) is invisible "
        "in a new thread on releases that keep config per thread; `torch.compile(..., options=...)` "
        "still applies.",
        "assumed: not detected; seen from 2.12 on",
        "2.12 - 2.15.0",
        f"2.11.0 (GPU) and {RUN_CPU}",
        (_gh(118387),),
        "The self-test and benchmarks set the config they need in each thread.",
    ),
    Hazard(
        "shared-cudagraphify-state",
        "One compiled graph's cudagraphify state binds to one tree manager: the first caller's "
        "(<= 2.12, a closure shared by all threads) or the executing thread's (2.13+, a "
        "`threading.local`), and every worker's backward executes on autograd's one device thread.",
        "assumed: both forms have it; nothing short of a per-worker key avoids it",
        "2.1 - 2.15.0",
        f"2.11.0 (measured: 3 training workers failed until the state was per worker); {READ}",
        (_gh(184357, "pull"), _gh(186192, "pull")),
        "",
    ),
    Hazard(
        "global-fx-tracing-flag",
        "FX's tracing flag is one module-global bool: while one thread traces (torch.fx, or make_fx "
        "inside a compile), a compiled call in another raises \"Detected that you are using FX to "
        "symbolically trace a dynamo-optimized function\".",
        "detected: `torch.fx._symbolic_trace._is_fx_tracing_flag` is a module-global bool "
        "(2.14+ keeps it in `_is_fx_tracing_tls`)",
        "2.1 - 2.13",
        "2.11.0 (seen in the DFlash trainer on an H200), 2.13.0 (CPU test); 2.14.1, 2.15.0: absent",
        (_gh(126024), _gh(168999, "pull")),
        "",
        _compat.fx_tracing_flag_is_global,
    ),
    Hazard(
        "global-compile-session-flag",
        "Since 2.13 every compile holds `torch.compiler.is_compiling()` True for the whole process "
        "(`_compile_session_context` sets the module global `_is_compiling_flag`), so eager code in every other "
        "thread takes its compiled-code branch while any thread compiles. transformers' output collector "
        "(`CompileableContextVar`) then becomes one process global: threads running `output_hidden_states` "
        "forwards at once get each other's hidden states or none (an IndexError in the DFlash trainer's "
        "target workers on 2.14.1).",
        "detected: `torch.compiler._compile_session_context` exists and `is_compiling` returns `_is_compiling_flag`",
        "2.13 - 2.15.0",
        f"{READ}; run on 2.13.0 and 2.14.1 (CPU test), seen on 2.14.1 in the DFlash trainer on an H200 (empty "
        "caches: 4 of 5 target workers failed with an IndexError in each of 2 Trees runs)",
        (),
        "The patch `compile_flag_per_thread` counts compile sessions per thread and gives `is_compiling` a body "
        "that reads this thread's count (the function object is kept: Dynamo folds it by identity). "
        "Non-strict export still sets the flag for the whole process.",
        _compat.compile_session_flag_is_global,
    ),
    Hazard(
        "global-fx-patcher",
        "FX tracing (`symbolic_trace`, and `make_fx`, which AOTAutograd runs in every compile) patches "
        "`nn.Module.__call__` and `__getattr__` process-wide and keeps the active patcher in a module "
        "global (`CURRENT_PATCHER`). Dynamo guards on `nn.Module.__call__` in code that reaches it through "
        "a subclass's own `__call__` (transformers' decoder layers), so a compiled call in another thread "
        "during a trace misses its cache and compiles the same code again, after waiting for the tracing "
        "compile; a module another thread calls eagerly can enter the tracer, and a compile started "
        "during a trace removes its patches (`_maybe_revert_all_patches`).",
        "detected: `torch.fx._symbolic_trace.CURRENT_PATCHER` is a module global",
        "2.1 - 2.15.0",
        f"{READ}; the recompile run on 2.11.0, 2.13.0, 2.15.0 (CPU test) and seen on 2.11.0 in the DFlash "
        "trainer on an H200 (each target worker compiled its step again while a drafter compiled)",
        (_gh(187589, "pull"), _gh(126024)),
        "The patch `fx_trace_window`: a cache miss in another thread while a trace's patches are in place "
        "waits for the trace to end, then, when cached code fits, runs that call uncompiled once (its nested "
        "frames from the cache) instead of compiling the same code again; inside a capture and for "
        "`fullgraph=True` it compiles, as upstream; calls that hit never wait. A whole-step capture "
        "(`capture_step`) waits for traces open elsewhere and holds new ones off until it ends (2.14+ refuses a "
        "compile inside a capture; a compile there lifts the hold). Not covered: the call run "
        "uncompiled sees `torch.compiler.is_compiling()` False; a trace doing real fenced device work while "
        "a capture waits for it (both go on after THREADGRAPH_GATE_TIMEOUT); eager module calls in other "
        "threads; two traces at once in two threads (they break each other upstream). Keep plain "
        "`torch.fx.symbolic_trace` out of the time workers run.",
        _compat.fx_patcher_is_global,
    ),
    Hazard(
        "global-rng-rewind",
        "Every Dynamo compile saves the global RNG state when it starts and restores it when it ends, "
        "so a compile in one thread rewinds seeded draws another thread made meanwhile.",
        "assumed: not detected",
        "2.1 - 2.15.0",
        f"2.11.0 (seen on an H200: one worker in eight started from other weights); {READ}",
        (),
        "Cannot be patched: draw model inits from a private `torch.Generator`, or in one thread "
        "before the workers start.",
    ),
    Hazard(
        "global-default-dtype",
        "torch's default dtype is process-wide and transformers' `from_pretrained(dtype=...)` sets it "
        "while it builds: a step in another thread then creates tensors of that dtype, and a compile "
        "fails its own guard (\"GLOBAL_STATE changed: default_dtype\").",
        "assumed: not detected",
        "every release",
        f"2.11.0 (seen on an H200); {RUN_CPU}",
        (),
        "A `WorkerGroup` runs its workers' `setup()`s one at a time and starts no `step()` before "
        "all have returned.",
    ),
    Hazard(
        "overload-hash",
        "An ATen overload hashes as the callable it dispatches to (`OpOverload.__hash__` is "
        "`hash(self._op)`), and Inductor's lowering table, its decomposition tables and fallback sets are "
        "keyed by overloads: replacing an overload's `_op` with a wrapper of another hash hides every "
        "entry made before, and after restoring, every entry made meanwhile. Under `fallback_random` with "
        "no implicit fallbacks, Inductor then finds no lowering for `aten.rand.default` "
        "(`MissingOperatorWithoutDecomp`: upstream's `test_rng_trees` and `test_rng_non_trees` failed "
        "under `install()` on 2.11.0, on the main thread too).",
        "detected: `OpOverload.__hash__` hashes `self._op`",
        "2.1 - 2.13 (any patch of `_op`; 2.14.1 and 2.15.0 hash `_cpp_dispatch_handle`)",
        "2.11.0 (measured on an H200), 2.13.0 (CPU test); 2.13.0 (source); 2.14.1, 2.15.0 (source: absent)",
        (),
        "The fence's overload patch `fence_rng_ops` replaces `_op` with an object that hashes and compares "
        "as the original, so every overload hashes the same with the fence in place or not.",
        _compat.overloads_hash_their_op,
    ),
    Hazard(
        "dynamo-wrapper-chain",
        "Dynamo finds the user's function under its own wrappers (`innermost_fn`) only through wrappers "
        "whose `_torchdynamo_wrapper_id` is their own id (2.13+); a wrapper built with `functools.wraps` "
        "copies the compiled function's attributes, ends the search at itself, and "
        "`torch._dynamo.run(fn)` then raises \"compile_wrapper already has a get_compiler_config "
        "attribute\".",
        "detected: `innermost_fn` checks `_torchdynamo_wrapper_id`",
        "2.13 - 2.15.0",
        "2.13.0 (CPU conformance case); 2.13.0, 2.14.1 (source)",
        (),
        "The first-call turn wrapper (`first_call_in_turn`) names the compiled function as what it wraps, "
        "with its own id, so Dynamo's search passes through it.",
        _compat.dynamo_checks_wrapper_ids,
    ),
)

_BY_NAME = {hazard.name: hazard for hazard in HAZARDS}


def get(name: str) -> Hazard:
    """The hazard called ``name``; a ``KeyError`` lists the known names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"threadgraph: no hazard named {name!r}; known: {sorted(_BY_NAME)}") from None


def names() -> list[str]:
    return [hazard.name for hazard in HAZARDS]


def report() -> list[dict]:
    """Every hazard with its status on this torch and the patches that address it."""
    from threadgraph._patches import PATCHES

    return [
        {
            "name": hazard.name,
            "status": hazard.status(),
            "detection": hazard.detection,
            "patches": [p.name for p in PATCHES if p.hazard == hazard.name],
        }
        for hazard in HAZARDS
    ]
