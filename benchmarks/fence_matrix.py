"""Which eager ops of a bystander thread survive other threads' warm-ups and recordings, with and
without threadgraph's eager fence; and pytorch#123177's repro, run after run.

    python -m benchmarks fence-matrix [--runs 20] [--parallel 4] [--out-dir benchmarks/results]

Each cell (op class x training/inference x fenced/unfenced) and each repro run is a fresh process
of ``tests/gpu_fence_scenarios.py`` (a broken capture can poison a process). Writes
``fence-matrix_<gpu>_torch<version>_<date>.json`` and ``.md``. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OP_CLASSES = ("rng", "compiled_rng", "sync", "host", "memory")
KINDS = ("train", "infer")
VARIANTS = ("fenced", "unfenced")


def run_scenario(*args: str, timeout: int = 400) -> dict:
    cmd = [sys.executable, "-X", "faulthandler", "-m", "tests.gpu_fence_scenarios", *args]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"args": list(args), "rc": "timeout"}
    lines = proc.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    result.update(args=list(args), rc=proc.returncode)
    if proc.returncode != 0 or not lines:
        result["stderr_tail"] = proc.stderr[-1500:]
    return result


def cell_row(r: dict) -> list[str]:
    rows = []
    for op, s in sorted(r.get("ops_stats", {}).items()):
        outcome = "ok" if s["errors"] == 0 else f"{s['errors']} errors: {s['first_error']}"
        rows.append(f"| {r['ops']} | {op} | {r['kind']} | {r['variant']} | {s['calls']} | {s['during_capture']} | {outcome} |")
    if not rows:
        rows.append(f"| {' '.join(r['args'])} | - | - | - | - | - | process rc {r['rc']}: {r.get('stderr_tail', '')[-200:]!r} |")
    return rows


def render(data: dict) -> str:
    lines = [f"# Eager fence matrix: {data['gpu']}, torch {data['torch']}, {data['date']}", "",
             "A bystander plain thread runs each op in a tight loop while 3 worker threads warm up and record",
             f"CUDAGraph Trees ({len(data['cells'])} cells, a process each). `during capture`: calls that began "
             "while a thread held the device exclusively.", "",
             "| class | op | workers | fence | calls | during capture | outcome |", "|---|---|---|---|---|---|---|"]
    for r in data["cells"]:
        lines += cell_row(r)
    lines += ["", "| cell | workers equal their reference | captures | group error | RNG in the main thread after |",
              "|---|---|---|---|---|"]
    for r in data["cells"]:
        lines.append(f"| {r.get('ops')} {r.get('kind')} {r.get('variant')} | {r.get('workers_equal_reference')} | "
                     f"{r.get('captures')} | {r.get('group_error')} | {r.get('rng_in_main_thread_after')} |")
    for variant, runs in data["repro"].items():
        failed = [r for r in runs if r.get("errors") or r.get("rc") != 0 or not r.get("all_equal")]
        lines += ["", f"## pytorch#123177 repro, {variant}: {len(runs) - len(failed)} of {len(runs)} runs clean", ""]
        for i, r in enumerate(runs):
            lines.append(f"- run {i + 1}: rc {r.get('rc')}, {len(r.get('errors', {}))} of {r.get('threads')} threads raised"
                         f"{': ' + sorted(set(r['errors'].values()))[0] if r.get('errors') else ''}; outputs equal eager: "
                         f"{r.get('all_equal')}; captures per thread min {min(r.get('captures') or [0])}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=20, help="fenced repro runs (the unfenced repro runs 3)")
    p.add_argument("--parallel", type=int, default=4, help="processes at a time on the GPU")
    p.add_argument("--classes", default=",".join(OP_CLASSES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        sys.exit("fence_matrix.py needs a CUDA GPU: it measures captures, which only exist on one")
    classes = [c for c in args.classes.split(",") if c]
    unknown = set(classes) - set(OP_CLASSES)
    if unknown:
        sys.exit(f"unknown --classes {sorted(unknown)}; choose from {', '.join(OP_CLASSES)}")
    variants = [v for v in args.variants.split(",") if v]
    jobs = [("matrix", "--ops", c, "--kind", k, "--variant", v) for v in variants for c in classes for k in KINDS]
    repro = {v: [("repro_123177", "--variant", v)] * (args.runs if v == "fenced" else 3) for v in variants}
    with concurrent.futures.ThreadPoolExecutor(args.parallel) as pool:
        cells = list(pool.map(lambda a: run_scenario(*a), jobs))
        for c in cells:
            print("\n".join(cell_row(c)), flush=True)
        repro_results = {v: list(pool.map(lambda a: run_scenario(*a), runs)) for v, runs in repro.items()}
    gpu = torch.cuda.get_device_name(0).replace("NVIDIA ", "").lower().replace(" ", "-")
    data = {"gpu": f"nvidia-{gpu}", "torch": torch.__version__.split("+")[0], "date": datetime.date.today().isoformat(),
            "cells": cells, "repro": repro_results}
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"fence-matrix_{data['gpu']}_torch{data['torch']}_{data['date']}"
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(render(data))
    print(render(data))
    print(f"wrote {out / stem}.json and .md")


if __name__ == "__main__":
    main()
