"""Per-thread step time of a training step and an inference step, by compile mode and placement.

    python -m benchmarks step-time                 # GPU: everything (several minutes)
    python -m benchmarks step-time --quick         # fewer steps, no process placements
    python -m benchmarks step-time --model dflash --tasks train --modes eager,reduce-overhead

Modes: eager; compile (torch.compile default mode); reduce-overhead (CUDAGraph Trees, in
threads through threadgraph.CompiledWorkerThread); whole-step (threadgraph.capture_step: one
CUDA graph of forward + backward + optimizer step). Placements: the main thread alone; one worker
thread; N workers one per GPU (N > 1); M workers sharing one GPU (--share); and the same work as
torch.multiprocessing (spawn) processes, which is what people use instead of threads.

Every (mode, placement) cell runs in its own subprocess (``--cell``, internal), so a failed
capture costs one error row and the rest carry on. Without a GPU it runs a CPU reduced form
(a smaller model, eager and compile only); those numbers say nothing about CUDA graphs.
Warmup steps (which include compilation and capture) are excluded from every time. What a cell
steps is in ``replay_work.py``; its results file is written by ``replay_results.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Optional

from . import common
from . import pyspy

import torch
from .replay_results import PLACEMENTS, write_results
from .replay_work import CPU_MODES, MODES, TASKS, Plan

BARRIER_TIMEOUT_S = 900


# -- placements -----------------------------------------------------------------------------------


def placements(args, every: bool = False) -> list[tuple[str, str, list[str]]]:
    """(key, label, devices: one entry per worker); ``every`` ignores --placements and --quick."""
    gpus = torch.cuda.device_count() if common.on_gpu() else 0
    dev0 = "cuda:0" if gpus else "cpu"
    m = args.share
    out = [("main", "main thread", [dev0]), ("worker", "1 worker thread", [dev0])]
    if gpus > 1:
        out.append(("per-gpu", f"{gpus} workers, one per GPU", [f"cuda:{i}" for i in range(gpus)]))
    out.append(("shared", f"{m} workers, one {'GPU' if gpus else 'CPU'}", [dev0] * m))
    if gpus > 1:
        out.append(("procs-per-gpu", f"{gpus} processes, one per GPU", [f"cuda:{i}" for i in range(gpus)]))
    out.append(("procs-shared", f"{m} processes, one {'GPU' if gpus else 'CPU'}", [dev0] * m))
    if every:
        return out
    if args.placements:
        wanted = args.placements.split(",")
        out = [p for p in out if p[0] in wanted]
    elif args.quick:
        out = [p for p in out if not p[0].startswith("procs")]
    return out


def warm_then_time(step, plan, device, before_timing=None) -> "common.StepTimer":
    """Warm up (compile, capture), then time ``plan.steps`` steps, each a new cudagraph step."""
    mark = torch.compiler.cudagraph_mark_step_begin
    for _ in range(plan.warmup):
        mark()
        step()
    common.sync()
    if before_timing is not None:
        before_timing()
    timer = common.StepTimer(device)
    timer.begin()
    for _ in range(plan.steps):
        mark()
        timer.start()
        step()
        timer.stop()
    timer.finish()
    return timer


def timed_result(timer: common.StepTimer, busy: Optional[float] = None) -> dict:
    return {"ms": timer.ms, "t0": timer.t0, "t1": timer.t1, "gpu_busy": busy}


def run_main_thread(plan: Plan, device: str) -> list[dict]:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    step = plan.build(device, 0)
    timer = warm_then_time(step, plan, device)
    busy = None
    if plan.profile:
        probe = common.BusyProbe()
        probe.start()
        for _ in range(plan.profile):
            torch.compiler.cudagraph_mark_step_begin()
            step()
        busy = probe.stop()
    return [timed_result(timer, busy)]


def run_threads(plan: Plan, devices: list[str], recorder: Optional[pyspy.Recorder] = None) -> list[dict]:
    """``recorder``: after the timed (and GPU-busy) steps, every thread keeps stepping while py-spy
    records the process for its --duration (the GIL profile), then stops."""
    import threadgraph

    barrier = threading.Barrier(len(devices))

    class BenchWorker(threadgraph.CompiledWorkerThread):
        def setup(self):
            self.work = plan.build(self.device, self.seed)
            self.timer = common.StepTimer(self.device)
            self.probe = common.BusyProbe()
            self.busy = None

        def step(self):
            i, w, n, p = self.stats.steps, plan.warmup, plan.steps, plan.profile
            if i == w:  # everyone starts timing together, after every warmup (and capture) is done
                common.sync()
                with threadgraph.released():
                    barrier.wait(BARRIER_TIMEOUT_S)
                self.timer.begin()
            if i < w:
                self.work()
            elif i < w + n:
                self.timer.start()
                self.work()
                self.timer.stop()
                if i == w + n - 1:
                    self.timer.finish()
            elif i < w + n + p:
                if i == w + n:
                    self.probe.start()
                self.work()
                if i == w + n + p - 1:
                    self.busy = self.probe.stop()
            else:
                if i == w + n + p:
                    with threadgraph.released():
                        barrier.wait(BARRIER_TIMEOUT_S)
                    if self is workers[0]:
                        recorder.start()
                self.work()
                if recorder.done():
                    self.stop()

    workers = []
    for k, dev in enumerate(devices):
        worker = BenchWorker(dev, name=f"bench-{k}", warmup_steps=plan.warmup,
                             max_steps=None if recorder else plan.warmup + plan.steps + plan.profile)
        worker.seed = k
        workers.append(worker)
    group = threadgraph.WorkerGroup(workers)
    group.on_failure(lambda exc: barrier.abort())
    group.start()
    group.join()
    return [timed_result(w.timer, w.busy) for w in workers]


def _process_entry(rank: int, plan: Plan, devices: list[str], barrier, out_dir: str) -> None:
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    step = plan.build(device, rank)
    # t0/t1 are CLOCK_MONOTONIC, comparable across processes on Linux
    timer = warm_then_time(step, plan, device, before_timing=lambda: barrier.wait(BARRIER_TIMEOUT_S))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(timed_result(timer)))


def run_processes(plan: Plan, devices: list[str]) -> list[dict]:
    import torch.multiprocessing as mp

    barrier = mp.get_context("spawn").Barrier(len(devices))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_process_entry, args=(dataclasses.replace(plan, profile=0), devices, barrier, tmp),
                 nprocs=len(devices), join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(len(devices))]


def summarize(results: list[dict]) -> dict:
    p50s = [common.p50(r["ms"]) for r in results]
    p90s = [common.p90(r["ms"]) for r in results]
    steps = sum(len(r["ms"]) for r in results)
    window = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    busy = [r["gpu_busy"] for r in results if r.get("gpu_busy") is not None]
    return {
        "p50_ms": sum(p50s) / len(p50s),
        "p90_ms": sum(p90s) / len(p90s),
        "per_worker_p50_ms": p50s,
        "wall_ms": sum((r["t1"] - r["t0"]) * 1e3 / len(r["ms"]) for r in results) / len(results),
        "steps_per_s": steps / window if window > 0 else None,
        "gpu_busy": busy[0] if len(busy) == 1 else None,
    }


def gil_summary(gil: list, wall: list) -> dict:
    busy, held, ticks = pyspy.gil_busy(gil, wall)
    return {"gil_busy": busy, "gil_samples": held, "gil_ticks": ticks,
            "gil_leaves": pyspy.top_shares(gil, lambda f: pyspy.short_frame(f[-1]) if f else "?", 6),
            "gil_files": pyspy.top_shares(gil, lambda f: pyspy.frame_file(f[-1]) if f else "?", 6)}


def run_cell(args, mode: str, placement: str, task: str) -> dict:
    """One (mode, placement, task) in this process; an exception becomes an error row."""
    key, label, devices = next(p for p in placements(args, every=True) if p[0] == placement)
    profile = args.profile_steps if key in ("main", "worker") and common.on_gpu() else 0
    plan = Plan(args.model, mode, task, args.warmup, args.steps, profile, args.whole_step_inner)
    row = {"task": task, "placement": key, "configuration": label, "mode": mode, "workers": len(devices)}
    started = time.perf_counter()
    try:
        if key == "main":
            results = run_main_thread(plan, devices[0])
        elif key.startswith("procs"):
            results = run_processes(plan, devices)
        elif args.gil_profile:
            with tempfile.TemporaryDirectory() as tmp:
                pyspy.allow_ptrace()
                recorder = pyspy.Recorder(pyspy.find(), Path(tmp), args.gil_profile, rate=250)
                results = run_threads(plan, devices, recorder)
                recorder.finish()
                row.update(gil_summary(recorder.samples("gil"), recorder.samples("wall")))
        else:
            results = run_threads(plan, devices)
        row.update(summarize(results), steps=args.steps, warmup=args.warmup)
    except Exception as exc:
        traceback.print_exception(exc)  # with the worker's own traceback as the cause
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        cause = exc.__cause__
        if cause is not None and str(cause) not in row["error"]:
            row["error"] += f" (cause: {type(cause).__name__}: {str(cause).splitlines()[0][:200] if str(cause) else ''})"
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


# -- the driver -----------------------------------------------------------------------------------


def run_all(args, rows: list[dict]) -> None:
    """Measure every cell into ``rows`` as it finishes, so an interrupted run keeps what it measured."""
    import threadgraph

    gpu = common.on_gpu()
    modes = args.modes.split(",") if args.modes else list(MODES if gpu else CPU_MODES)
    for mode in modes:
        skip = None
        if not gpu and mode not in CPU_MODES:
            skip = "needs CUDA (CPU reduced form runs eager and compile only)"
        elif mode == "whole-step" and not hasattr(threadgraph, "capture_step"):
            skip = "not available: this threadgraph has no capture_step"
        if skip:
            rows += [{"task": t, "placement": "-", "configuration": "-", "mode": mode, "workers": None, "note": skip}
                     for t in args.tasks.split(",")]
            continue
        for key, label, devices in placements(args):
            for task in args.tasks.split(","):
                row = run_cell_subprocess(args, mode, key, label, len(devices), task)
                print(f"[{mode} / {label} / {task}] " + (f"p50 {row['p50_ms']:.3f} ms" if row.get("p50_ms") else
                      f"error: {row.get('error')}"), file=sys.stderr, flush=True)
                rows.append(row)


def run_cell_subprocess(args, mode: str, key: str, label: str, workers: int, task: str) -> dict:
    """A fresh process per cell: a failed capture can leave CUDA state (the RNG, the allocator) broken."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "cell.json")
        cmd = [*common.module_command("replay_step_time"), *args.argv, "--cell", mode, key, task, "--cell-out", str(out)]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  timeout=args.cell_timeout, env=common.child_env())
        except subprocess.TimeoutExpired:
            error = f"timed out after {args.cell_timeout} s"
        else:
            row = json.loads(out.read_text()) if out.exists() else None
            if proc.returncode or row is None or row.get("error"):
                sys.stderr.write(proc.stderr[-4000:])
            if row is not None:
                return row
            error = common.exit_error(proc.returncode, proc.stderr)
    return {"task": task, "placement": key, "configuration": label, "mode": mode, "workers": workers, "error": error}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="timed steps per thread (default 300 on GPU, 40 on CPU)")
    p.add_argument("--warmup", type=int, help="untimed steps first, compile and capture included (default 20; CPU 5)")
    p.add_argument("--model", choices=("small", "dflash"), default="small")
    p.add_argument("--modes", help=f"comma list of {', '.join(MODES)} (default: all; CPU: eager,compile)")
    p.add_argument("--tasks", default="train,infer", help="comma list of train, infer")
    p.add_argument("--placements", help=f"comma list of {', '.join(PLACEMENTS)}")
    p.add_argument("--share", type=int, default=3, help="M, the workers (and processes) sharing one device")
    p.add_argument("--profile-steps", type=int, default=20, help="steps in the GPU-busy window")
    p.add_argument("--whole-step-inner", choices=("eager", "compile"), default="eager",
                   help="what capture_step captures: the eager step or a torch.compile(default) one")
    p.add_argument("--quick", action="store_true", help="few steps, no process placements (CI smoke test)")
    p.add_argument("--cell-timeout", type=int, default=600, help="seconds per cell subprocess")
    common.add_out_dir(p)
    p.add_argument("--append", action="store_true",
                   help="merge into today's results file, replacing only the cells measured again (to split a "
                        "GPU run into several commands, e.g. one per --modes)")
    p.add_argument("--merge-from", metavar="JSON",
                   help="like --append, with the earlier rows from this results JSON (any day)")
    p.add_argument("--gil-profile", type=float, default=0.0, metavar="SECONDS",
                   help="in thread placements, after the timed steps, record the process with py-spy for SECONDS "
                        "(GIL-busy fraction and the frames holding the GIL; needs py-spy, in benchmarks/requirements.txt)")
    p.add_argument("--cell", nargs=3, metavar=("MODE", "PLACEMENT", "TASK"), help=argparse.SUPPRESS)
    p.add_argument("--cell-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    gpu = common.on_gpu()
    if args.steps is None:
        args.steps = (50 if args.quick else 300) if gpu else (15 if args.quick else 40)
    if args.warmup is None:
        args.warmup = (10 if args.quick else 20) if gpu else (3 if args.quick else 5)
    if args.quick and args.profile_steps == 20:
        args.profile_steps = 5
    bad_modes = [m for m in (args.modes or "").split(",") if m and m not in MODES]
    if bad_modes:
        p.error(f"unknown modes {bad_modes}; choose from {', '.join(MODES)}")
    bad_placements = [k for k in (args.placements or "").split(",") if k and k not in PLACEMENTS]
    if bad_placements:
        p.error(f"unknown placements {bad_placements}; choose from {', '.join(PLACEMENTS)}")
    unknown = set(args.tasks.split(",")) - set(TASKS)
    if unknown:
        p.error(f"unknown tasks {sorted(unknown)}; use train, infer")
    if args.merge_from and not Path(args.merge_from).is_file():
        p.error(f"--merge-from {args.merge_from}: no such file")
    if args.gil_profile < 0:
        p.error("--gil-profile takes seconds >= 0")
    if args.gil_profile and pyspy.find() is None:
        p.error("--gil-profile needs py-spy: pip install -r benchmarks/requirements.txt")
    if args.warmup < 3 or args.steps < 1 or args.share < 1:
        p.error("need --warmup >= 3 (compile and capture happen there), --steps >= 1, --share >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common.exit_on_sigterm()
    if args.cell:
        if not common.on_gpu():
            torch.set_num_threads(1)  # OpenMP pools oversubscribe small CPUs: 100x outliers
        common.finish_cell(args.cell_out, run_cell(args, *args.cell))  # a row
    env = common.environment()
    started, rows = time.perf_counter(), []
    try:
        run_all(args, rows)
    except (KeyboardInterrupt, SystemExit):  # a timeout or Ctrl-C: write the cells done so far, then stop
        if rows:
            print(f"interrupted after {len(rows)} cells; writing those", file=sys.stderr, flush=True)
            write_results(args, env, rows, started, interrupted=True)
        raise
    write_results(args, env, rows, started, interrupted=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
