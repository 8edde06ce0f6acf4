"""What ``threadgraph.install()`` costs a single-threaded user: replay step p50 with and without it.

    python -m benchmarks install-overhead [--turns 3] [--steps 400] [--out-dir DIR]

The main thread trains (forward, backward, SGD) and infers the small launch-bound model
(24 x [Linear 512, GELU, LayerNorm], batch 16, bf16) with CUDAGraph Trees; nothing else runs.
Each measurement is a fresh process (``--cell installed|plain``, internal), one with
``install()`` called before the first compile and one without, in turns (plain, installed,
installed, plain, ...) so a machine that speeds up or slows down weighs on both. Warm-up steps
(compile and capture) are not timed; each step is timed by wall clock to the end of its GPU work.
Prints and writes the median of each cell kind's p50 and their ratio (installed / plain), per task.
Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from . import common
from .small_model import mlp

TASKS = ("train", "infer")
WARMUP = 5


def cell(kind: str, steps: int) -> dict:
    """One process's p50 step (ms) per task, with threadgraph installed or not."""
    if kind == "installed":
        import threadgraph

        threadgraph.install()
    p50s = {}
    for seed, task in enumerate(TASKS):
        model = mlp(seed, "cuda", common.WIDTH, common.DEPTH, dtype=torch.bfloat16)
        g = torch.Generator().manual_seed(100 + seed)
        x, y = (torch.randn(common.BATCH, common.WIDTH, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
        if task == "train":
            opt = torch.optim.SGD(model.parameters(), lr=1e-3)
            loss = torch.compile(lambda a, b: F.mse_loss(model(a), b), mode="reduce-overhead")

            def step() -> None:
                loss(x, y).backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:
            forward = torch.compile(model, mode="reduce-overhead")

            def step() -> None:
                with torch.no_grad():
                    forward(x)
        times = []
        for index in range(WARMUP + steps):
            started = time.perf_counter()
            step()
            torch.cuda.current_stream().synchronize()
            if index >= WARMUP:
                times.append((time.perf_counter() - started) * 1e3)
        p50s[task] = statistics.median(times)
    return p50s


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--turns", type=int, default=3, help="pairs of processes (one plain, one installed)")
    parser.add_argument("--steps", type=int, default=400, help="timed steps per task and process")
    common.add_out_dir(parser)
    parser.add_argument("--cell", choices=("installed", "plain"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.turns < 1 or args.steps < 1:
        print("--turns and --steps must be at least 1", file=sys.stderr)
        return 2
    if not common.on_gpu():
        print("install_overhead.py needs a CUDA GPU (it times CUDAGraph Trees replays); run it on a GPU machine",
              file=sys.stderr)
        return 2
    if args.cell:
        print(json.dumps(cell(args.cell, args.steps)))
        return 0
    runs = []
    order = []
    for turn in range(args.turns):
        order += ["plain", "installed"] if turn % 2 == 0 else ["installed", "plain"]
    for index, kind in enumerate(order, 1):
        print(f"[{index}/{len(order)}] {kind} ...", file=sys.stderr, flush=True)
        done = subprocess.run([*common.module_command("install_overhead"), "--cell", kind, "--steps", str(args.steps)],
                              env=common.child_env(), capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            print(f"a {kind} process failed: {common.exit_error(done.returncode, done.stderr)}", file=sys.stderr)
            return 1
        runs.append({"kind": kind, "p50_ms": json.loads(done.stdout.strip().splitlines()[-1])})
    env = common.environment()
    summary = {}
    for task in TASKS:
        plain = statistics.median(r["p50_ms"][task] for r in runs if r["kind"] == "plain")
        installed = statistics.median(r["p50_ms"][task] for r in runs if r["kind"] == "installed")
        summary[task] = {"plain_p50_ms": plain, "installed_p50_ms": installed, "ratio": installed / plain}
    record = {"theme": "install-overhead", "env": env, "steps": args.steps, "turns": args.turns,
              "runs": runs, "summary": summary,
              "command": f"python -m benchmarks install-overhead --turns {args.turns} --steps {args.steps}"}
    common.save(common.results_dir(args.out_dir) / f"{common.results_stem(env, 'install-overhead')}.json", record)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
