"""The results files of a GPU test run, from its records: ``gpu-scenarios`` and ``fence-matrix``.

    THREADGRAPH_GPU_LOG=gpu-log python -m pytest -m gpu --junitxml=gpu-log/junit.xml
    python -m benchmarks gpu-scenarios gpu-log --label suite
    THREADGRAPH_GPU_LOG=fence-log python -m pytest -m gpu -n 4 tests/library/test_gpu_fence.py
    python -m benchmarks fence-matrix fence-log

``tests/helpers/gpu_process.py`` writes each scenario run's record (``<tag>.json``: arguments, exit
status, seconds, the result it printed) to the folder THREADGRAPH_GPU_LOG names.

``gpu-scenarios`` adds the records of ``tests/helpers/gpu_scenarios.py``'s scenarios and of the
trainer's GPU runs (``python -m examples.dflash_trainer``: mode, steps, losses, steady tokens/s,
startup) as one phase, named by ``--label`` and the time of the last record, to
``gpu-scenarios_<gpu>_torch<version>_<date>.json`` (a label the file has is refused); with the junit
XML in the folder the phase holds every test's outcome (``pytest_outcomes``).
``THREADGRAPH_GPU_STEPS=1000`` gives the 1000-step figures of docs/results.md.

``fence-matrix`` writes the records of ``tests/library/gpu_fence_scenarios.py`` (asserted on by
``tests/library/test_gpu_fence.py``, not here) to ``fence-matrix_<gpu>_torch<version>_<date>.json``:
every cell of the matrix (a plain thread's eager op class beside 3 workers' warm-ups and recordings,
training and inference, fenced and unfenced) and pytorch#123177's repro runs by variant.
A run that failed is kept with its exit status.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from . import common
from . import results_schema
from .headlines import fence_variant, option

MODULE = "tests.helpers.gpu_scenarios"
FENCE_MODULE = "tests.library.gpu_fence_scenarios"
OP_CLASSES = ("rng", "compiled_rng", "sync", "host", "memory")
KINDS = ("train", "infer")
VARIANTS = ("fenced", "unfenced")
TRAINER = "examples.dflash_trainer"
TRAINER_KEPT = ("mode", "placement", "total_steps", "losses", "tokens_per_s_steady", "startup_s", "build_s")
OUTCOMES = "pytest_outcomes"


class NoRecords(SystemExit):
    """The folder holds no scenario records to collect."""


def read_records(folder: Path, modules: tuple = (MODULE, TRAINER)) -> list[dict]:
    """The folder's records of runs of ``modules`` (the scenarios, the trainer), with each file's
    modification time."""
    modules = (modules,) if isinstance(modules, str) else tuple(modules)
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = json.loads(path.read_text())
        except ValueError as exc:
            raise SystemExit(f"{path}: not a scenario record ({exc}); give the folder THREADGRAPH_GPU_LOG named")
        if not isinstance(record, dict) or "tag" not in record or "args" not in record:
            raise SystemExit(f"{path}: not a scenario record (no tag or args); give the folder THREADGRAPH_GPU_LOG named")
        if record["args"][:1] == ["-m"] and record["args"][1:2] and record["args"][1] in modules:
            records.append(dict(record, mtime=path.stat().st_mtime))
    if not records:
        raise NoRecords(f"{folder}: no records of {' or '.join(modules)} runs; run the GPU tests with "
                        f"THREADGRAPH_GPU_LOG={folder}")
    return records


def is_trainer(record: dict) -> bool:
    return record["args"][1] == TRAINER


def entry(record: dict) -> dict:
    """A record's result (a trainer run's main figures), or its failure."""
    if record["rc"] == 0 and record["result"] is not None:
        if is_trainer(record):
            result = record["result"]
            return {**{k: result.get(k) for k in TRAINER_KEPT}, "seconds": record["seconds"],
                    "versions": (result.get("target_report") or {}).get("versions")}
        return record["result"]
    return {"error": f"exit {record['rc']}: {record.get('last_stderr_line') or 'no result printed'}",
            "seconds": record["seconds"]}


INTERRUPTED = "pytest::internal"  # the case pytest's junit XML adds for an error of its own


def outcomes(junit: Path) -> dict:
    """Each test of a junit XML: passed, or failed / error / skipped with its message."""
    try:
        root = ET.parse(junit).getroot()
    except ET.ParseError as exc:
        raise SystemExit(f"{junit}: not a junit XML ({exc}); pytest's --junitxml writes one")
    out = {}
    for case in root.iter("testcase"):
        if not case.get("name"):  # what an interrupted run leaves: no test, no outcome, but a sign
            out.setdefault(INTERRUPTED, "error: the run was interrupted (a test case without a name)")
            continue
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        verdict = next((child for child in case if child.tag in ("failure", "error", "skipped")), None)
        message = " ".join((verdict.get("message") or "").split())[:200] if verdict is not None else ""
        out[name] = "passed" if verdict is None else f"{verdict.tag}: {message}"  # one line: a table cell
    return out


def last_record_time(records: list[dict]) -> datetime.datetime:
    """When the run ended: its last record's modification time, in UTC."""
    return datetime.datetime.fromtimestamp(max(r["mtime"] for r in records), datetime.timezone.utc)


def identity(records: list[dict]) -> tuple[str, str]:
    """The GPU and torch the runs had: one of each, or the records are of several runs. A scenario
    names them in its result, a trainer run's record the machine's."""
    seen = set()
    for r in records:
        if r["rc"] != 0 or not r["result"]:
            continue
        if is_trainer(r) and not r.get("machine"):
            raise SystemExit(f"{r['tag']}: a trainer run whose record names no GPU")
        source = r["machine"] if is_trainer(r) else r["result"]
        seen.add((source["gpu"], source["torch"]))
    if len(seen) != 1:
        raise SystemExit(f"the records name {len(seen)} GPU / torch pairs ({sorted(seen)}): "
                         "give a folder of one test run whose scenarios measured")
    return seen.pop()


def collect(folder: Path, label: str, out_dir: Path) -> Path:
    """Add the folder's run as a phase of its day's results file; the file's path."""
    records = read_records(folder)
    gpu, torch_version = identity(records)
    last = last_record_time(records)
    env = {"gpu": gpu, "torch": torch_version, "date": last.date().isoformat()}
    path = out_dir / f"{results_schema.stem(env, 'gpu-scenarios')}.json"
    data = results_schema.load(path).data if path.exists() else {}
    if any(name.split(" ")[0] == label for name in data):
        raise SystemExit(f"{path} already has a phase {label!r}: give another --label")
    phase = {r["tag"]: entry(r) for r in sorted(records, key=lambda r: r["tag"])}
    junit = folder / "junit.xml"
    if junit.exists():
        phase[OUTCOMES] = outcomes(junit)
    data[f"{label} ({last:%H:%M} UTC)"] = phase
    return common.save(path, data)


def fence_entry(record: dict) -> dict:
    """A record as the results file keeps it: the scenario's result with its arguments and exit
    status, or, when it printed none, why."""
    args = record["args"][2:]
    if record["rc"] == 0 and record["result"] is not None:
        return {**record["result"], "args": args, "rc": 0}
    return {"args": args, "rc": record["rc"], "stderr_tail": record.get("last_stderr_line") or "no result printed"}


def _natural(tag: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", tag)]


def collect_fence(folder: Path, out_dir: Path) -> Path:
    """The folder's fence scenario records as the day's fence-matrix results file; its path."""
    records = sorted(read_records(folder, (FENCE_MODULE,)), key=lambda r: _natural(r["tag"]))
    gpu, torch_version = identity(records)
    last = last_record_time(records)
    cells, repro = [], {v: [] for v in VARIANTS}
    for record in records:
        args = record["args"][2:]
        if args[:1] == ["matrix"]:
            cells.append(fence_entry(record))
        elif args[:1] == ["repro_123177"]:
            repro[fence_variant({"args": args})].append(fence_entry(record))
    order = {(v, c, k): i for i, (v, c, k) in enumerate((v, c, k) for v in VARIANTS for c in OP_CLASSES for k in KINDS)}
    cells.sort(key=lambda cell: order.get((fence_variant(cell), option(cell["args"], "--ops", "rng"),
                                           option(cell["args"], "--kind", "train")), len(order)))
    env = {"gpu": gpu, "torch": torch_version, "date": last.date().isoformat()}
    data = {"gpu": results_schema.machine_of(gpu), "torch": torch_version.split("+")[0], "date": env["date"],
            "cells": cells, "repro": repro}
    path = out_dir / f"{results_schema.stem(env, 'fence-matrix')}.json"
    return common.save(path, data)


def missing_cells(data: dict) -> list[str]:
    """Cells of the whole matrix that the run has no record of (a run of some of the tests)."""
    have = {(fence_variant(c), option(c["args"], "--ops", "rng"), option(c["args"], "--kind", "train")) for c in data["cells"]}
    return [f"{c} {k} {v}" for v in VARIANTS for c in OP_CLASSES for k in KINDS if (v, c, k) not in have]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    what = argv.pop(0) if argv[:1] in (["gpu-scenarios"], ["fence-matrix"]) else "gpu-scenarios"
    p = argparse.ArgumentParser(prog=f"python -m benchmarks {what}", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="the folder THREADGRAPH_GPU_LOG named")
    common.add_out_dir(p)
    if what == "gpu-scenarios":
        p.add_argument("--label", default="suite", help="the phase's name (one word; default suite)")
    args = p.parse_args(argv)
    if not args.folder.is_dir():
        p.error(f"{args.folder}: no such folder (the one THREADGRAPH_GPU_LOG named)")
    if what == "fence-matrix":
        missing = missing_cells(results_schema.load(collect_fence(args.folder, common.results_dir(args.out_dir))).data)
        if missing:
            print(f"no record of the cells {'; '.join(missing)}: the file holds the others", file=sys.stderr)
        return 0
    if not args.label or " " in args.label:
        p.error(f"--label {args.label!r}: one word, e.g. suite or recheck")
    collect(args.folder, args.label, common.results_dir(args.out_dir))
    return 0

if __name__ == "__main__":
    sys.exit(main())
