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
status), which docs/results.md and the README quote.
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
    return common.save(path, data)


def missing_cells(data: dict) -> list[str]:
    """Cells of the whole matrix that the run has no record of (a run of some of the tests)."""
    have = {(variant(c["args"]), option(c["args"], "--ops", "rng"), option(c["args"], "--kind", "train")) for c in data["cells"]}
    return [f"{c} {k} {v}" for v in VARIANTS for c in OP_CLASSES for k in KINDS if (v, c, k) not in have]


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
