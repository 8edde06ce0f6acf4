"""The DFlash trainer's startup to its first steady step, each run in a fresh process.

The README's main job, each run on an empty Inductor cache, with the compiles of each worker and
Dynamo's recompilations.

    python -m benchmarks trainer-startup                      # Trees, whole-step, then Trees again on Trees' cache
    python -m benchmarks trainer-startup --graphs trees --no-restart --label "before X"   # one run, named
    python -m benchmarks trainer-startup --append --label "after X"   # add runs to today's file
    python -m benchmarks trainer-startup --report FILE.json   # the .md again from a results file

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
    p.add_argument("--report", type=Path, metavar="JSON", help="only write the .md of this results file again")
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
    return (f"startup {run['startup_s']:.1f} s, {compiled} of {len(run['workers'])} workers compiled, "
            f"{run['recompiles']} recompiles, {_steady(run)} tokens/s steady")


def _steady(run: dict) -> str:
    """Steady tokens/s; a run too short for a steady window has none."""
    return "-" if run.get("tokens_per_s_steady") is None else f"{run['tokens_per_s_steady']:.0f}"


def _per_worker(run: dict, key: str) -> str:
    return ", ".join(f"{name} {w[key]:.1f}" for name, w in run["workers"].items())


def report(data: dict, path: Path) -> str:
    """The .md of a results file: its runs' startups, compiles and waits per worker."""
    env, named = data.get("env"), results_schema.parse_name(path.name)  # a file without env: its name says where and when
    where = (f"{env['gpu'] or 'CPU'}, torch {env['torch']}, {env['date']}" if env else
             f"{named.machine}, torch {named.torch}, {named.date}" if named else path.stem)
    lines = [f"# DFlash trainer startup: the README's main job, {where}", "",
             f"- {data['recorded_by']}", "",
             "| run | startup s (to the last worker's first steady step) | build s | compile s per worker | "
             "waiting for a peer's compile s per worker | recompiles | tau | steady tokens/s | embedded target built with |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, run in runs_of(data).items():
        if "error" in run:
            lines.append(f"| {name} | failed: {run['error']} | | | | | | | |")
            continue
        tau = f"{run['eval']['tau']:.2f}" if run.get("eval") else "-"
        lines.append(f"| {name} | {run['startup_s']:.1f} | {run['build_s']:.1f} | {_per_worker(run, 'compile_s')} | "
                     f"{_per_worker(run, 'peer_compile_wait_s')} | {run.get('recompiles', '-')} | "
                     f"{tau} | {_steady(run)} | {_built_with(run)} |")
    return "\n".join(lines + _warmup_phases(runs_of(data))) + "\n"


def _warmup_phases(runs: dict) -> list:
    """Where each worker's warmup went: the seconds of each phase of its step (host wall time:
    waiting for a peer, compiling and capturing are inside the phase that did them)."""
    lines = []
    for name, run in runs.items():
        rows = [[worker, f"{w['warmup_s']:.1f}", ", ".join(f"{phase} {s:.1f}" for phase, s in w["phases_warmup_s"].items())]
                for worker, w in run.get("workers", {}).items() if w.get("phases_warmup_s")]
        if rows:
            lines += ["", f"{name}: each worker's warmup by phase of its step, seconds", "",
                      common.markdown_table(["worker", "warmup s", "by phase"], rows)]
    return lines


def _built_with(run: dict) -> str:
    """Where the run's embedded target came from: its build's Python and torch (the corpus is that
    Python's standard library, so a target built elsewhere is another target, with its own tau)."""
    versions = (run.get("target_report") or {}).get("versions")
    return f"Python {versions['python']}, torch {versions['torch']}" if versions else "-"


def runs_of(data: dict) -> dict:
    """A results file's runs by name (its other entries say how they were made)."""
    return {name: run for name, run in data.items() if isinstance(run, dict) and ("startup_s" in run or "error" in run)}


RECORDED_BY = ("benchmarks/trainer_startup.py (python -m benchmarks trainer-startup): each run's `command` in a fresh process with TORCHINDUCTOR_CACHE_DIR an "
               "empty folder (the restart: the first Trees run's) and TORCH_LOGS=recompiles; each entry is the run's "
               "--json line, with `recompiles`, `recompile_records`, `command` and `took_s` added")


def write_report(path: Path, data: dict) -> str:
    text = report(data, path)
    results_schema.write(path, data, text)
    print(f"wrote {path.with_suffix('.md')}", file=sys.stderr)
    return text


def main(argv=None, prog=None) -> int:
    common.exit_on_sigterm()  # a `timeout` around this script stops the run in progress too (wait_or_stop)
    args = parse_args(argv, prog)
    if args.report:
        print(write_report(args.report, results_schema.load(args.report).data))
        return 0
    env = common.environment()
    path = common.results_dir(args.out_dir) / f"{results_schema.stem(env, THEME)}.json"
    data = results_schema.load(path).data if args.append and path.is_file() else {}
    runs = run_all(args)
    replaced = [name for name in runs if name in data]
    if replaced:
        print(f"replacing the earlier runs {', '.join(replaced)} in {path}", file=sys.stderr)
    data = {"recorded_by": RECORDED_BY, "env": env, **data, **runs}
    print(write_report(path, data))
    return 1 if any("error" in run for run in runs.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
