"""What the eager fence costs a steady-state step, fenced and unfenced phases in turn.

    python -m benchmarks fence-overhead [--phases 10] [--phase-seconds 0.6] [--out-dir DIR]

Workers (``CompiledWorkerThread``) train or infer the small launch-bound model of
``replay_step_time.py`` (24 x [Linear 512, GELU, LayerNorm], batch 16) with CUDAGraph Trees, alone
and 3 sharing one GPU. After warm-up (compile and capture) the main thread alternates phases:
the fence's eager-path patches (``fence_rng``, ``fence_synchronize``) installed, then removed,
and so on; each worker times its steps by wall clock and tags each with the phase it began in
(a step that straddles a switch is dropped). Prints and writes the median step of each phase
kind and their ratio, per configuration. The capture patches are left in place: they run only
while capturing, never in a steady-state step. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import threading
import time

import torch
import torch.nn.functional as F

from . import common
from . import results_schema
from .small_model import allow_recompiles, mlp

import threadgraph

EAGER_PATH_PATCHES = ("fence_rng", "fence_synchronize")


class Phase:
    """The phase the main thread is in: its number (even: fenced, odd: unfenced) and whether a switch is under way."""

    def __init__(self):
        self.number, self.switching = -1, False  # -1: workers still warming up, nothing is timed


class StepWorker(threadgraph.CompiledWorkerThread):
    def __init__(self, seed: int, task: str, phase: Phase, warmup: int):
        super().__init__("cuda:0", name=f"{task}-{seed}", warmup_steps=warmup)
        self.seed, self.task, self.phase, self.times = seed, task, phase, []
        self.warm = threading.Event()

    def setup(self):
        allow_recompiles()  # every worker compiles the same code for its own model
        model = mlp(self.seed, self.device, common.WIDTH, common.DEPTH, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(100 + self.seed)
        self.x, self.y = (torch.randn(common.BATCH, common.WIDTH, generator=g).to(self.device, torch.bfloat16)
                          for _ in range(2))
        if self.task == "train":
            self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            self.fn = torch.compile(lambda x, y: F.mse_loss(model(x), y), mode="reduce-overhead")
        else:
            self.fn = torch.compile(model, mode="reduce-overhead")

    def step(self):
        phase, switching = self.phase.number, self.phase.switching
        started = time.perf_counter()
        if self.task == "train":
            self.fn(self.x, self.y).backward()
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                self.fn(self.x)
        torch.cuda.current_stream().synchronize()  # wall time of the whole step, GPU included
        if self.stats.steps >= self.warmup_steps:
            self.warm.set()
            if phase >= 0 and not switching and not self.phase.switching and phase == self.phase.number:
                self.times.append((phase, time.perf_counter() - started))


def measure(task: str, workers: int, phases: int, phase_seconds: float, warmup: int) -> dict:
    phase = Phase()
    group = threadgraph.WorkerGroup([StepWorker(seed, task, phase, warmup) for seed in range(workers)])
    group.start()
    try:
        for w in group.workers:
            if not w.warm.wait(300):
                raise RuntimeError(f"{w.name} did not finish warm-up in 300 s")
        for number in range(phases):
            phase.switching = True
            if number % 2 == 0:
                threadgraph.install()
            else:
                threadgraph.uninstall(EAGER_PATH_PATCHES)
            phase.number = number
            phase.switching = False
            time.sleep(phase_seconds)
    finally:
        threadgraph.install()
        group.stop()
        group.join(120)
    times = {"fenced": [], "unfenced": []}
    for w in group.workers:
        for number, seconds in w.times:
            times["fenced" if number % 2 == 0 else "unfenced"].append(seconds * 1e3)
    fenced, unfenced = statistics.median(times["fenced"]), statistics.median(times["unfenced"])
    return {"task": task, "workers": workers, "fenced_p50_ms": round(fenced, 4), "unfenced_p50_ms": round(unfenced, 4),
            "ratio_fenced_over_unfenced": round(fenced / unfenced, 4),
            "steps": {k: len(v) for k, v in times.items()}}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phases", type=int, default=10, help="alternating phases, fenced first (even count)")
    p.add_argument("--phase-seconds", type=float, default=0.6)
    p.add_argument("--warmup", type=int, default=10, help="steps before timing (compile and capture)")
    common.add_out_dir(p)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("fence_overhead.py needs a CUDA GPU: it times CUDAGraph Trees replays")
    if args.phases < 2 or args.phases % 2:
        sys.exit(f"--phases must be an even number >= 2 (fenced and unfenced in turn), got {args.phases}")
    rows = []
    for task in ("train", "infer"):
        for workers in (1, 3):
            row = measure(task, workers, args.phases, args.phase_seconds, args.warmup)
            print(json.dumps(row), flush=True)
            rows.append(row)
    gpu = results_schema.machine_of(torch.cuda.get_device_name(0))
    meta = {"gpu": gpu, "torch": torch.__version__.split("+")[0], "date": datetime.date.today().isoformat(),
            "phases": args.phases, "phase_seconds": args.phase_seconds}
    stem = f"fence-overhead_{gpu}_torch{meta['torch']}_{meta['date']}"
    common.save(common.results_dir(args.out_dir) / f"{stem}.json", {**meta, "rows": rows})


if __name__ == "__main__":
    main()
