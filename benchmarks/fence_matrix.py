"""The fence-matrix results file, from the records of a GPU test run of the eager fence.

    THREADGRAPH_GPU_LOG=fence-log python -m pytest -m gpu -n 4 tests/library/test_gpu_fence.py
    python -m benchmarks fence-matrix fence-log

``tests/library/test_gpu_fence.py`` runs each scenario of ``tests/helpers/gpu_fence_scenarios.py`` in a
fresh process and asserts on it: every cell of the matrix (a plain thread's eager op class beside
3 workers' warm-ups and recordings, training and inference) with and without the fence, and
pytorch#123177's repro run after run, fenced and unfenced. A failure fails those tests; this
script asserts nothing. With THREADGRAPH_GPU_LOG naming a folder, ``tests/helpers/gpu_process.py`` keeps
each run's record there; this script turns them into ``fence-matrix_<gpu>_torch<version>_<date>.json``
(the cells, and the repro's runs by variant; a run that printed no result is kept with its exit
status) and its ``.md``, which docs/results.md and the README quote.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from . import common
from . import gpu_scenarios_results
from . import results_schema

MODULE = "tests.helpers.gpu_fence_scenarios"
OP_CLASSES = ("rng", "compiled_rng", "sync", "host", "memory")
KINDS = ("train", "infer")
VARIANTS = ("fenced", "unfenced")


def variant(args: list) -> str:
    return args[args.index("--variant") + 1] if "--variant" in args else "fenced"


def option(args: list, name: str, default: str) -> str:
    return args[args.index(name) + 1] if name in args else default


def entry(record: dict) -> dict:
    """A record as the results file keeps it: the scenario's result with its arguments and exit
    status, or, when it printed none, why."""
    args = record["args"][2:]
    if record["rc"] == 0 and record["result"] is not None:
        return {**record["result"], "args": args, "rc": 0}
    return {"args": args, "rc": record["rc"], "stderr_tail": record.get("last_stderr_line") or "no result printed"}


def _natural(tag: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", tag)]


def collect(folder: Path, out_dir: Path) -> Path:
    """The folder's fence scenario records as the day's fence-matrix results file; its path."""
    records = sorted(gpu_scenarios_results.read_records(folder, (MODULE,)), key=lambda r: _natural(r["tag"]))
    gpu, torch_version = gpu_scenarios_results.identity(records)
    last = gpu_scenarios_results.last_record_time(records)
    cells, repro = [], {v: [] for v in VARIANTS}
    for record in records:
        args = record["args"][2:]
        if args[:1] == ["matrix"]:
            cells.append(entry(record))
        elif args[:1] == ["repro_123177"]:
            repro[variant(args)].append(entry(record))
    order = {(v, c, k): i for i, (v, c, k) in enumerate((v, c, k) for v in VARIANTS for c in OP_CLASSES for k in KINDS)}
    cells.sort(key=lambda cell: order.get((variant(cell["args"]), option(cell["args"], "--ops", "rng"),
                                           option(cell["args"], "--kind", "train")), len(order)))
    env = {"gpu": gpu, "torch": torch_version, "date": last.date().isoformat()}
    data = {"gpu": results_schema.machine_of(gpu), "torch": torch_version.split("+")[0], "date": env["date"],
            "cells": cells, "repro": repro}
    path = out_dir / f"{results_schema.stem(env, 'fence-matrix')}.json"
    results_schema.write(path, data, render(data))
    return path


def missing_cells(data: dict) -> list[str]:
    """Cells of the whole matrix that the run has no record of (a run of some of the tests)."""
    have = {(variant(c["args"]), option(c["args"], "--ops", "rng"), option(c["args"], "--kind", "train")) for c in data["cells"]}
    return [f"{c} {k} {v}" for v in VARIANTS for c in OP_CLASSES for k in KINDS if (v, c, k) not in have]


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
    missing = missing_cells(data)
    if missing:
        lines += ["", f"Not recorded by this run: {'; '.join(missing)}."]
    for name, runs in data["repro"].items():
        failed = [r for r in runs if r.get("errors") or r.get("rc") != 0 or not r.get("all_equal")]
        lines += ["", f"## pytorch#123177 repro, {name}: {len(runs) - len(failed)} of {len(runs)} runs clean", ""]
        for i, r in enumerate(runs):
            lines.append(f"- run {i + 1}: rc {r.get('rc')}, {len(r.get('errors', {}))} of {r.get('threads')} threads raised"
                         f"{': ' + sorted(set(r['errors'].values()))[0] if r.get('errors') else ''}; outputs equal eager: "
                         f"{r.get('all_equal')}; captures per thread min {min(r.get('captures') or [0])}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="the folder THREADGRAPH_GPU_LOG named")
    common.add_out_dir(p)
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        p.error(f"{args.folder}: no such folder (the one THREADGRAPH_GPU_LOG named)")
    path = collect(args.folder, common.results_dir(args.out_dir))
    missing = missing_cells(results_schema.load(path).data)
    if missing:
        print(f"no record of the cells {'; '.join(missing)}: the file holds the others", file=sys.stderr)
    print(f"wrote {path} and its .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
