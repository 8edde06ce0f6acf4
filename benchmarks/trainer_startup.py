"""The DFlash trainer's startup to its first steady step, each run in a fresh process.

The README's main job, each run on an empty Inductor cache, with the compiles of each worker and
Dynamo's recompilations.

    python -m benchmarks trainer-startup                      # Trees, whole-step, then Trees again on Trees' cache
    python -m benchmarks trainer-startup --graphs trees --no-restart --label "before X"   # one run, named
    python -m benchmarks trainer-startup --append --label "after X"   # add runs to today's file

Each run is ``python -m examples.dflash_trainer --out-dir DIR --json [--cuda-graphs whole-step]``
(the arguments after ``--`` added) with ``TORCHINDUCTOR_CACHE_DIR`` an empty folder of its own and
``TORCH_LOGS=recompiles``; the restart runs Trees again on the first Trees run's cache, as a user's
second start does. Its ``--json`` line is kept whole under the run's name, with ``recompiles`` (how
many "Recompiling function" records Dynamo logged) and their first lines, and ``took_s``, the
process's wall time. The results go to ``dflash-trainer-startup_...`` in ``--out-dir``; with
``--append`` a run of a name already there replaces it. Needs a GPU for the figures docs/results.md
quotes; on a CPU the trainer runs eager, so its startup says nothing about graphs.
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

from . import common
from . import results_schema
from . import trainer_process

THEME = "dflash-trainer-startup"
GRAPHS = {"trees": "Trees", "whole-step": "whole-step"}
RECOMPILE = re.compile(r"Recompiling function (\S+)")
KEPT_RECOMPILES = 5  # the first records, each a line and its reason, kept in the results


def parse_args(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graphs", default="trees,whole-step", help="comma-separated --cuda-graphs values (default: %(default)s)")
    p.add_argument("--no-restart", dest="restart", action="store_false",
                   help="leave out the Trees run again on the first Trees run's Inductor cache")
    p.add_argument("--label", default="", help="words in every run's name (which code ran, say: 'after X')")
    p.add_argument("--append", action="store_true", help="add the runs to today's results file (same name: replaced)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one run may take (default %(default)s)")
    common.add_out_dir(p)
    p.add_argument("trainer_args", nargs=argparse.REMAINDER, help="-- then arguments for every trainer run")
    args = p.parse_args(argv)
    args.trainer_args = args.trainer_args[1:] if args.trainer_args[:1] == ["--"] else args.trainer_args
    args.graphs = [g.strip() for g in args.graphs.split(",") if g.strip()]
    unknown = [g for g in args.graphs if g not in GRAPHS]
    if unknown or not args.graphs:
        p.error(f"--graphs {','.join(unknown) or '(none)'}: give one or more of {', '.join(GRAPHS)}")
    reserved = [a for a in args.trainer_args if a.split("=")[0] in ("--out-dir", "--json", "--cuda-graphs", "--resume")]
    if reserved:
        p.error(f"{reserved[0]} is this script's to set (each run has its own --out-dir, --cuda-graphs and cache)")
    return args


def planned_runs(args) -> list:
    """(name, --cuda-graphs value, cache): each on an empty cache, the restart on the Trees run's."""
    def name(graphs, cache):
        return f"{GRAPHS[graphs]}{' ' + args.label if args.label else ''}, {cache}"

    runs = [(name(g, "empty Inductor cache"), g, g) for g in args.graphs]
    if args.restart and "trees" in args.graphs:
        runs.append((name("trees", "restart on that cache"), "trees", "trees"))
    return runs


def recompiles(stderr: str) -> dict:
    """Dynamo's recompilation records in a run's log (TORCH_LOGS=recompiles): the count and the first few."""
    lines = stderr.splitlines()
    found = [i for i, line in enumerate(lines) if RECOMPILE.search(line)]
    kept = [" / ".join(s.strip() for s in lines[i:i + 3])[:400] for i in found[:KEPT_RECOMPILES]]
    return {"recompiles": len(found), "recompile_records": kept}


def run_one(graphs: str, cache: Path, out_dir: Path, trainer_args: list, timeout: int) -> dict:
    """One trainer run in a fresh process: its --json result, or {"error": ...} naming why there is none."""
    run = trainer_process.run_trainer(["--out-dir", out_dir, "--json", "--cuda-graphs", graphs, *trainer_args],
                                      timeout=timeout, env={"TORCHINDUCTOR_CACHE_DIR": str(cache), "TORCH_LOGS": "recompiles"})
    given = {"command": run.command, "took_s": run.took_s}
    if run.result is None:
        return {"error": run.error, **given}
    return {**run.result, **recompiles(run.stderr), **given}


def run_all(args) -> dict:
    runs = {}
    with tempfile.TemporaryDirectory(prefix="trainer-startup-") as tmp:
        for i, (name, graphs, cache) in enumerate(planned_runs(args), 1):
            print(f"[{i}] {name}", file=sys.stderr, flush=True)
            result = run_one(graphs, Path(tmp, f"inductor-cache-{cache}"), Path(tmp, f"run-{i}"), args.trainer_args,
                             args.timeout)
            runs[name] = result
            print(f"[{i}] {describe(result)}", file=sys.stderr, flush=True)
    return runs


def describe(run: dict) -> str:
    if "error" in run:
        return f"failed: {run['error']}"
    compiled = sum(1 for w in run["workers"].values() if w["compile_s"] > 0)
    steady = run.get("tokens_per_s_steady")
    return (f"startup {run['startup_s']:.1f} s, {compiled} of {len(run['workers'])} workers compiled, "
            f"{run['recompiles']} recompiles, {'-' if steady is None else f'{steady:.0f}'} tokens/s steady")


def runs_of(data: dict) -> dict:
    """A results file's runs by name (its other entries say how they were made)."""
    return {name: run for name, run in data.items() if isinstance(run, dict) and ("startup_s" in run or "error" in run)}


RECORDED_BY = ("benchmarks/trainer_startup.py (python -m benchmarks trainer-startup): each run's `command` in a fresh process with TORCHINDUCTOR_CACHE_DIR an "
               "empty folder (the restart: the first Trees run's) and TORCH_LOGS=recompiles; each entry is the run's "
               "--json line, with `recompiles`, `recompile_records`, `command` and `took_s` added")


def main(argv=None, prog=None) -> int:
    common.exit_on_sigterm()  # a `timeout` around this script stops the run in progress too (wait_or_stop)
    args = parse_args(argv, prog)
    env = common.environment()
    path = common.results_dir(args.out_dir) / f"{results_schema.stem(env, THEME)}.json"
    data = results_schema.load(path).data if args.append and path.is_file() else {}
    runs = run_all(args)
    replaced = [name for name in runs if name in data]
    if replaced:
        print(f"replacing the earlier runs {', '.join(replaced)} in {path}", file=sys.stderr)
    data = {"recorded_by": RECORDED_BY, "env": env, **data, **runs}
    common.save(path, data)
    return 1 if any("error" in run for run in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
