"""``python -m tests.conformance [--cases A,B] [--write DIR]``: every conformance case (those
this machine can run: GPU cases need CUDA), each in a fresh process, in every placement; prints
the cases x placements table, and with ``--write`` keeps it as
``DIR/conformance_<gpu-or-cpu>_torch<version>_<date>.{json,md}``. Exits 1 when a placement differs
from the main thread without threadgraph, 2 on bad arguments."""

from __future__ import annotations

import argparse
import concurrent.futures
import sys
from pathlib import Path

import torch

from . import registry
from .report import render_markdown, results_path, write_results
from .subprocess_run import run_case

def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="", help="comma list of case names (default: all this machine runs)")
    parser.add_argument("--write", metavar="DIR", help="write the results .json and .md into DIR")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds a case's process may take")
    parser.add_argument("--jobs", type=int, default=1, help="cases at a time (each runs its placements' processes at once)")
    args = parser.parse_args(argv)
    runnable = dict(registry.CPU_CASES)
    if torch.cuda.is_available():
        runnable.update(registry.GPU_CASES)
    names = [n.strip() for n in args.cases.split(",") if n.strip()] or list(runnable)
    unknown = [n for n in names if n not in registry.ALL]
    if unknown:
        print(f"no case named {', '.join(unknown)}; known: {', '.join(sorted(registry.ALL))}", file=sys.stderr)
        return 2
    not_here = [n for n in names if n not in runnable]
    if not_here:
        print(f"{', '.join(not_here)} need a CUDA GPU, which this machine lacks; leave them out", file=sys.stderr)
        return 2
    if args.jobs < 1:
        print(f"--jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        futures = {pool.submit(run_case, name, args.timeout): name for name in names}
        for index, future in enumerate(concurrent.futures.as_completed(futures), 1):
            row = future.result()
            print(f"[{index}/{len(names)}] {row['case']}: {'same everywhere' if row['equal'] else 'DIFFERS'}",
                  file=sys.stderr, flush=True)
        rows = [future.result() for future in futures]  # in the order asked for
    print(render_markdown(rows))
    if args.write:
        path = results_path(Path(args.write))
        write_results(rows, path)
        print(f"wrote {path} and its .md", file=sys.stderr)
    return 0 if all(row["equal"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
