"""Mode ``ab`` of trainer_runs.py, DFlash throughput of two or more source trees on one machine
in turns: is a change slower, or was it the machine?

A launch-bound target (the embedded default) gives steady tokens/s that follow the host's speed
of the moment, which differs between machines and between runs on one. Comparing a results file
of one day with another's mixes the two. This script runs ``benchmarks/dflash_throughput.py`` of
each tree in turn (A, B, A, B, ...), with the same arguments, each run in processes of its own, and
lists every run with the sequential loop's host time per batch beside it (how fast the host was
during that run)::

    git worktree add /tmp/before 1635c9d          # or: mkdir /tmp/before; git archive 1635c9d | tar -x -C /tmp/before
    python -m benchmarks dflash-ab --tree before=/tmp/before --tree after=. --reps 2 --work /tmp/ab \\
        -- --cuda-graphs whole-step --steps 60
    python -m benchmarks dflash-ab --summarize /tmp/ab    # the summary again, from the runs' own files

Each run's results land in ``WORK/<tree>-<rep>/`` (emptied first); ``WORK/runs.json`` records the
order they ran in. Run it again on the same ``--work`` (same arguments) to add turns after the
earlier ones: the summary then holds them all, and a results file is never replaced by one that
lacks its runs. Each tree runs with ``TORCHINDUCTOR_CACHE_DIR=WORK/inductor-cache-<tree>`` (trees
whose cells pick their own cache ignore it). ``--tree-arg NAME=ARG`` gives one tree an argument the
others lack (a flag an older tree does not know), ``--tree-env NAME=VAR=VALUE`` an environment
variable (a variant of one tree under a second name). The summary goes to
``benchmarks/results/dflash-ab-<target>-<graphs>_...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import results_schema  # noqa: E402
import trainer_process  # noqa: E402

REQUIRED = ("tokens_per_s_threaded", "tokens_per_s_sequential", "ratio", "host_gil_ms_per_batch")  # both cells measured
FIGURES = (*REQUIRED, "gpu_ms_per_batch")  # the GPU time only on a GPU


def parse_args(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR", help="a source tree to run (2 or more)")
    p.add_argument("--tree-arg", action="append", default=[], metavar="NAME=ARG", help="an argument for one tree only")
    p.add_argument("--tree-env", action="append", default=[], metavar="NAME=VAR=VALUE", help="a variable for one tree only")
    p.add_argument("--reps", type=int, default=2, help="turns of every tree (default 2)")
    p.add_argument("--work", type=Path, help="where the runs write (default: a new folder in /tmp)")
    p.add_argument("--timeout", type=int, default=1800,
                   help="seconds one run may take (default 1800: dflash_throughput's two cells of up to 600 s each, "
                        "and a shape build)")
    p.add_argument("--summarize", type=Path, metavar="WORK", help="only summarize the runs already in WORK")
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then dflash_throughput.py's arguments")
    args = p.parse_args(argv)
    args.bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.summarize is not None:
        return args
    args.trees = {}
    for spec in args.tree:
        name, _, path = spec.partition("=")
        if not name or not path:
            p.error(f"--tree {spec}: give NAME=DIR")
        if "-" in name:
            p.error(f"--tree {spec}: give a name without '-' (run folders are NAME-REP)")
        if name in args.trees:
            p.error(f"--tree {spec}: a second tree named {name}; give each tree its own name")
        if not Path(path, "benchmarks", "dflash_throughput.py").is_file():
            p.error(f"--tree {spec}: {path} has no benchmarks/dflash_throughput.py; give a source tree of this repository")
        args.trees[name] = Path(path).resolve()
    if len(args.trees) < 2:
        p.error("give at least two --tree NAME=DIR to compare")
    if args.reps < 1:
        p.error(f"--reps {args.reps}: give 1 or more")
    if any(a.startswith("--out-dir") for a in args.bench_args):
        p.error("--out-dir is this script's (each run writes to WORK/<tree>-<rep>)")
    args.extra_args, args.extra_env = {}, {}
    for flag, spec in [("--tree-arg", s) for s in args.tree_arg] + [("--tree-env", s) for s in args.tree_env]:
        name, _, value = spec.partition("=")
        if name not in args.trees or not value or (flag == "--tree-env" and "=" not in value):
            p.error(f"{flag} {spec}: give NAME={'VAR=VALUE' if flag == '--tree-env' else 'ARG'} for a tree of --tree")
        if flag == "--tree-arg":
            args.extra_args.setdefault(name, []).append(value)
        else:
            args.extra_env.setdefault(name, []).append(value)
    return args


def run_all(args) -> Path:
    work = args.work or Path(f"/tmp/dflash-ab-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    order = earlier_runs(work, args)
    for rep in range(1, args.reps + 1):
        for name, tree in args.trees.items():
            run_dir = work / f"{name}-{sum(r['tree'] == name for r in order) + 1}"
            shutil.rmtree(run_dir, ignore_errors=True)  # a run that writes nothing must not show an older one's figures
            extra_args, extra_env = args.extra_args.get(name, []), args.extra_env.get(name, [])
            env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}",
                   "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-cache-{name}"),
                   **dict(v.split("=", 1) for v in extra_env)}
            cmd = [sys.executable, str(tree / "benchmarks" / "dflash_throughput.py"), "--out-dir", str(run_dir),
                   *args.bench_args, *extra_args]
            print(f"[{name} {rep}/{args.reps}] {tree}", file=sys.stderr, flush=True)
            done = trainer_process.run(cmd, cwd=tree, env=env, timeout=args.timeout, capture=False)
            order.append({"run": run_dir.name, "tree": name, "dir": str(tree), "rc": done.rc, "took_s": done.took_s,
                          **({"extra_args": extra_args} if extra_args else {}),
                          **({"extra_env": " ".join(extra_env)} if extra_env else {})})
            (work / "runs.json").write_text(json.dumps({"bench_args": args.bench_args, "runs": order}, indent=1) + "\n")
    return work


def earlier_runs(work: Path, args) -> list:
    """The turns an earlier invocation took in WORK, which these turns follow; refused when they differ in kind."""
    if not (work / "runs.json").is_file():
        return []
    meta = json.loads((work / "runs.json").read_text())
    if meta["bench_args"] != args.bench_args:
        raise SystemExit(f"{work} holds an A/B of dflash_throughput.py {' '.join(meta['bench_args'])}, not of "
                         f"{' '.join(args.bench_args)}; give another --work")
    for r in meta["runs"]:
        if r["tree"] in args.trees and Path(r["dir"]) != args.trees[r["tree"]]:
            raise SystemExit(f"{work}: tree {r['tree']} was {r['dir']} in its earlier runs, not {args.trees[r['tree']]}; "
                             "give this tree another name or another --work")
    print(f"{work}: {len(meta['runs'])} earlier runs; these turns follow them", file=sys.stderr)
    return meta["runs"]


def counts(run: dict) -> bool:
    """A run counts when it ended well and both its cells measured (a failed cell leaves its figures None)."""
    return run["rc"] == 0 and all(run[k] is not None for k in REQUIRED)


def summarize(work: Path) -> dict:
    """Every run's figures, in the order they ran, and each tree's range."""
    if not (work / "runs.json").is_file():
        raise SystemExit(f"{work}: no runs.json, so not a folder this script ran in (--work)")
    meta = json.loads((work / "runs.json").read_text())
    runs = []
    for entry in meta["runs"]:
        files = sorted((work / entry["run"]).glob("dflash-throughput-*.json"))
        data = json.loads(files[-1].read_text()) if files else {}
        runs.append({**entry, **{k: data.get(k) for k in FIGURES}, "shape": data.get("shape"), "graphs": data.get("graphs"),
                     "env": data.get("env")})
    done = [r for r in runs if counts(r)]
    if not done:
        raise SystemExit(f"{work}: no run measured both cells (each run's own log says why)")
    trees = {}
    for r in done:
        trees.setdefault(r["tree"], []).append(r)
    return {"benchmark": "dflash_ab", "env": done[0]["env"], "shape": done[0]["shape"], "graphs": done[0]["graphs"],
            "work": str(work), **{k: v for k, v in meta.items() if k != "runs"}, "runs": runs,
            "trees": {name: {f"{k}_{agg.__name__}": agg(r[k] for r in rs) for k in REQUIRED for agg in (min, max)}
                      | {"runs": len(rs)} for name, rs in trees.items()}}


def report(summary: dict) -> str:
    env = summary["env"]
    lines = [f"# DFlash throughput A/B: {summary['shape']} target, {summary['graphs']}", "",
             f"- {env['gpu'] or 'CPU'}, torch {env['torch']}, {env['cpus']} CPUs, {env['date']}",
             f"- dflash_throughput.py {' '.join(summary['bench_args'])}, the trees in turn", "",
             *([f"- {summary['recorded_by']}", ""] if summary.get("recorded_by") else []),
             "| run | tree | threaded tokens/s | sequential tokens/s | threaded / sequential | sequential host ms/batch "
             "| GPU ms/batch | also given |", "|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        if not counts(r):
            why = f"failed (rc {r['rc']})" if r["rc"] != 0 else "a cell failed (no figures)"
            lines.append(f"| {r['run']} | {r['tree']} | {why} | | | | | |")
            continue
        gpu = "-" if r["gpu_ms_per_batch"] is None else f"{r['gpu_ms_per_batch']:.3f}"
        given = " ".join([*r.get("extra_args", []), *([r["extra_env"]] if r.get("extra_env") else [])]) or "-"
        lines.append(f"| {r['run']} | {r['tree']} | {r['tokens_per_s_threaded']:.0f} | {r['tokens_per_s_sequential']:.0f} | "
                     f"{r['ratio']:.2f} | {r['host_gil_ms_per_batch']:.3f} | {gpu} | {given} |")
    return "\n".join(lines) + "\n"


def keep_earlier(path: Path, summary: dict) -> None:
    """A results file of the same day, machine and kind is replaced only by a summary that holds its runs."""
    if not path.is_file():
        return
    earlier = results_schema.load(path).data
    same_work = earlier.get("work", summary["work"]) == summary["work"]
    if not same_work or earlier.get("runs") != summary["runs"][:len(earlier.get("runs", []))]:
        where = f" (its --work was {earlier['work']})" if earlier.get("work") else ""
        raise SystemExit(f"{path} holds another A/B's runs{where}; add turns to that one by giving its --work, "
                         "or write this one elsewhere with --out-dir")


def main(argv=None, prog=None) -> int:
    common.exit_on_sigterm()  # a `timeout` around this script stops the run in progress too (wait_or_stop)
    args = parse_args(argv, prog)
    work = args.summarize or run_all(args)
    summary = summarize(work)
    text = report(summary)
    print(text)
    stem = results_schema.stem(summary["env"], f"dflash-ab-{summary['shape']}-{summary['graphs']}")
    out = common.results_dir(args.out_dir)
    keep_earlier(out / f"{stem}.json", summary)
    results_schema.write(out / f"{stem}.json", summary)
    (out / f"{stem}.md").write_text(text)
    print(f"wrote {out / stem}.{{json,md}}", file=sys.stderr)
    return 0
