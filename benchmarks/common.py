"""Shared pieces of the benchmark scripts: the environment, where results go, the small model,
timing and JSON. Benchmarks print numbers; they never assert on them."""

from __future__ import annotations

import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

from threadgraph import StepTimer as LibraryStepTimer
from . import render, results_schema
from .small_model import allow_recompiles, mlp  # noqa: F401 (allow_recompiles: used by the scripts)

def exit_on_sigterm() -> None:
    """Turn SIGTERM (a `timeout` around the script) into SystemExit, so subprocess.run kills the
    cell it is waiting for instead of leaving it running, holding the GPU and the output pipe."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


def cell_env(tmp: str, cache_dir: str) -> dict:
    """A benchmark cell's environment: ``cache_dir`` as its Inductor cache, else an empty one in ``tmp``."""
    return {**child_env(), "TORCHINDUCTOR_CACHE_DIR": cache_dir or str(Path(tmp, "inductor-cache"))}


def child_env() -> dict:
    """This process's environment, with the repository root first on ``PYTHONPATH``: a child started
    as ``python -m benchmarks.<module>`` imports this package (and ``examples``) from any folder."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def module_command(module: str) -> list:
    """The command that runs ``benchmarks/<module>.py`` as a script, in a fresh process."""
    return [sys.executable, "-m", f"benchmarks.{module}"]


def wait_or_stop(proc: subprocess.Popen, timeout: float) -> Optional[tuple]:
    """``proc.communicate()`` within ``timeout`` seconds, or None when it ran out. A child that runs
    out, or whose parent is leaving (SIGTERM turned SystemExit, Ctrl-C), is stopped, never left
    running: SIGTERM first (torchrun passes it on to its ranks, which run in sessions of their own
    and would outlive a SIGKILL of torchrun), SIGKILL 60 s later."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return None
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def run_cell(cmd_before_out: list, cache_dir: str, timeout: int) -> dict:
    """Run a benchmark cell subprocess: ``cmd_before_out + [path]``, which writes its result as
    JSON to ``path``, with ``cell_env``; its result, or {"error": ..., "exit_code": ...} with its last
    stderr line and exit status (``wait_or_stop``: a cell never outlives its timeout or its parent)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "cell.json")
        proc = subprocess.Popen([*cmd_before_out, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=cell_env(tmp, cache_dir))
        outputs = wait_or_stop(proc, timeout)
        if outputs is None:
            return {"error": f"timed out after {timeout} s"}
        stderr = outputs[1]
        if out.exists():
            return json.loads(out.read_text())
        sys.stderr.write(stderr[-3000:])
        return {"error": exit_error(proc.returncode, stderr), "exit_code": proc.returncode}


def exit_error(returncode: int, stderr: str) -> str:
    """A failed subprocess's error, as results files record it: its exit status and last stderr line."""
    lines = [line for line in stderr.splitlines() if line.strip()]
    return f"exit {returncode}: {lines[-1][:300] if lines else 'no output'}"


def finish_cell(out_path: str, result, default=None) -> None:
    """End a benchmark cell subprocess: write its result as JSON for the driver, then exit at once,
    skipping interpreter teardown (leftover compile, worker or profiler threads can abort it)."""
    Path(out_path).write_text(json.dumps(result, default=default))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


ROOT = Path(__file__).resolve().parent.parent
# Where a run writes unless given --out-dir: a scratch folder git ignores, so that a trial run never
# reaches the committed results (``--out-dir benchmarks/results`` for a run meant to be committed).
SCRATCH = Path("bench-out")

WIDTH, DEPTH, BATCH = 512, 24, 16  # the launch-bound model of the H200 measurements
CPU_WIDTH, CPU_DEPTH = 128, 6  # CPU reduced form


def on_gpu() -> bool:
    return torch.cuda.is_available()


def environment() -> dict:
    """Hardware and versions: a results file's ``env``."""
    gpus = torch.cuda.device_count() if on_gpu() else 0
    return {
        "gpu": torch.cuda.get_device_name(0) if gpus else None,
        "gpus": gpus,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "date": datetime.date.today().isoformat(),
    }


def results_stem(env: dict, theme: str) -> str:
    """`<theme>_<gpu-or-cpu>_torch<ver>_<YYYY-MM-DD>` (results_schema's naming rule)."""
    return results_schema.stem(env, theme)


def results_dir(out_dir: Optional[str]) -> Path:
    """``--out-dir``, else the scratch folder; created if missing."""
    path = Path(out_dir) if out_dir else SCRATCH
    path.mkdir(parents=True, exist_ok=True)
    return path


def add_out_dir(parser) -> None:
    """The ``--out-dir`` flag every benchmark takes, worded once."""
    parser.add_argument("--out-dir", help=f"results folder (default ./{SCRATCH}, ignored by git; "
                                          "--out-dir benchmarks/results for a run to commit)")


def save(path: Path, data: dict) -> Path:
    """Write a run's results file (``results_schema.write``) and print its key figures."""
    results_schema.write(path, data)
    print(render.figures(path))
    print(f"\nwrote {path}", file=sys.stderr)
    return path


# -- the small launch-bound model -----------------------------------------------------------------

def small_model(seed: int, device, width: int = WIDTH, depth: int = DEPTH) -> torch.nn.Module:
    """depth x [Linear, GELU, LayerNorm]; bf16 on GPU, float32 on CPU. Raises this thread's
    recompile limits (small_model.allow_recompiles): every benchmark thread compiles the same code."""
    allow_recompiles()
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return mlp(seed, device, width, depth, dtype)


# -- timing ---------------------------------------------------------------------------------------


class StepTimer(LibraryStepTimer):
    """threadgraph's per-step timer (CUDA events resolved without host syncs, or perf_counter),
    plus ``begin()``/``finish()`` wall-clock marks for aggregate throughput."""

    def __init__(self, device) -> None:
        super().__init__(torch.device(device))
        self.ms: list[float] = []
        self.t0 = self.t1 = None

    def begin(self) -> None:
        self.t0 = time.perf_counter()

    def discard(self) -> None:
        super().discard()
        self.ms = []

    def finish(self) -> list[float]:
        self.ms = super().finish()
        sync()
        self.t1 = time.perf_counter()
        return self.ms


def sync() -> None:
    if on_gpu():
        torch.cuda.current_stream().synchronize()


def p50(ms: Sequence[float]) -> Optional[float]:
    return statistics.median(ms) if ms else None


def p90(ms: Sequence[float]) -> Optional[float]:
    if not ms:
        return None
    ordered = sorted(ms)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


class BusyProbe:
    """GPU-busy fraction: union of GPU activity intervals / wall time between ``start()`` and
    ``stop()``, under torch.profiler (CUDA activity only; CUPTI sees every thread's kernels,
    autograd's backward thread included). ``stop()`` returns None without a GPU. Profiling adds
    some launch cost, so read the fraction as a lower bound. After ``stop()``, ``busy_us`` holds each
    device's own busy microseconds (the union of its intervals), what its kernels took."""

    def start(self) -> None:
        self.prof = None
        self.busy_us: dict[int, float] = {}
        if not on_gpu():
            return
        from torch.profiler import ProfilerActivity, profile

        sync()
        try:
            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as exc:  # a profiler problem costs the GPU-busy figure, not the row
            print(f"GPU-busy: profiler did not start: {exc!r}", file=sys.stderr)
            return
        self.prof = prof
        self.t0 = time.perf_counter()

    def stop(self) -> Optional[float]:
        if self.prof is None:
            return None
        from torch.autograd import DeviceType

        for index in range(torch.cuda.device_count()):  # every device's queued work is inside the window
            torch.cuda.synchronize(index)
        wall_us = (time.perf_counter() - self.t0) * 1e6
        try:
            self.prof.__exit__(None, None, None)
            events = [(e.device_index, e.time_range.start, e.time_range.end) for e in self.prof.events()
                      if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start]
        except Exception as exc:
            print(f"GPU-busy: profiler failed: {exc!r}", file=sys.stderr)
            return None
        for index in sorted({d for d, _, _ in events}):
            self.busy_us[index] = _union_us([(a, b) for d, a, b in events if d == index])
        busy = _union_us([(a, b) for _, a, b in events])
        return busy / wall_us if wall_us else None


def _union_us(spans: list) -> float:
    """Length of the union of [start, end) intervals (overlapping streams count once)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


# -- figures --------------------------------------------------------------------------------------


# Dynamo's compile-time counters (torch._dynamo.utils.compile_times) worth reading for startup:
# the whole frame compile, AOTAutograd, Inductor's lowering and code generation, loading the
# generated module, waiting for the kernel compile workers, and the guards.
COMPILE_PHASES = ("_compile.compile_inner", "create_aot_dispatcher_function", "compile_fx_inner",
                  "GraphLowering.codegen", "PyCodeCache.load_by_key_path", "async_compile.wait", "build_guards")


def compile_phases() -> dict:
    """Seconds spent in each of COMPILE_PHASES so far in this process, all threads together."""
    from torch._dynamo.utils import compile_times

    names, values = compile_times(repr="csv", aggregate=True)
    seconds = dict(zip(names, (float(v) for v in values)))
    return {name: round(seconds[name], 2) for name in COMPILE_PHASES if name in seconds}


def peak_memory_gib(devices: Sequence[str]) -> dict:
    """This process's peak memory so far, GiB: each CUDA device's reserved by torch's caching
    allocator (CUDA graph pools included), and for the cpu the process's peak resident set."""
    import resource

    out = {}
    for device in dict.fromkeys(map(str, devices)):
        if device.startswith("cuda"):
            out[device] = torch.cuda.max_memory_reserved(torch.device(device)) / 2**30
        else:  # ru_maxrss is in KiB on Linux
            out[device] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return out
