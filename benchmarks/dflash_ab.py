"""DFlash throughput of two or more source trees on one machine, in turns: is a change slower, or
was it the machine?

A launch-bound target (the embedded default) gives steady tokens/s that follow the host's speed
of the moment, which differs between machines and between runs on one. Comparing a results file
of one day with another's mixes the two. This script runs ``benchmarks/dflash_throughput.py`` of
each tree in turn (A, B, A, B, ...), with the same arguments, each run in processes of its own, and
lists every run with the sequential loop's host time per batch beside it (how fast the host was
during that run)::

    git worktree add /tmp/before 1635c9d          # or: mkdir /tmp/before; git archive 1635c9d | tar -x -C /tmp/before
    python benchmarks/dflash_ab.py --tree before=/tmp/before --tree after=. --reps 2 --work /tmp/ab \\
        -- --cuda-graphs whole-step --steps 60
    python benchmarks/dflash_ab.py --summarize /tmp/ab    # the summary again, from the runs' own files

Each run's results land in ``WORK/<tree>-<rep>/``; ``WORK/runs.json`` records the order they ran
in. Each tree runs with ``TORCHINDUCTOR_CACHE_DIR=WORK/inductor-cache-<tree>`` (trees whose cells
pick their own cache ignore it). The summary goes to ``benchmarks/results/dflash-ab-<target>-<graphs>_...``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

FIGURES = ("tokens_per_s_threaded", "tokens_per_s_sequential", "ratio", "host_gil_ms_per_batch", "gpu_ms_per_batch")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", action="append", default=[], metavar="NAME=DIR", help="a source tree to run (2 or more)")
    p.add_argument("--reps", type=int, default=2, help="turns of every tree (default 2)")
    p.add_argument("--work", type=Path, help="where the runs write (default: a new folder in /tmp)")
    p.add_argument("--timeout", type=int, default=900, help="seconds one run may take (default 900)")
    p.add_argument("--summarize", type=Path, metavar="WORK", help="only summarize the runs already in WORK")
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then dflash_throughput.py's arguments")
    args = p.parse_args(argv)
    args.bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if args.summarize is None:
        trees = {}
        for spec in args.tree:
            name, _, path = spec.partition("=")
            if not name or not path or "-" in name or not Path(path, "benchmarks", "dflash_throughput.py").is_file():
                p.error(f"--tree {spec}: give NAME=DIR, a name without '-' and a source tree with "
                        "benchmarks/dflash_throughput.py")
            trees[name] = Path(path).resolve()
        if len(trees) < 2:
            p.error("give at least two --tree NAME=DIR to compare")
        if any(a.startswith("--out-dir") for a in args.bench_args):
            p.error("--out-dir is this script's (each run writes to WORK/<tree>-<rep>)")
        args.trees = trees
    return args


def run_all(args) -> Path:
    work = args.work or Path(f"/tmp/dflash-ab-{os.getpid()}")
    work.mkdir(parents=True, exist_ok=True)
    order = []
    for rep in range(1, args.reps + 1):
        for name, tree in args.trees.items():
            run_dir = work / f"{name}-{rep}"
            env = {**os.environ, "PYTHONPATH": f"{tree / 'src'}{os.pathsep}{tree}",
                   "TORCHINDUCTOR_CACHE_DIR": str(work / f"inductor-cache-{name}")}
            cmd = [sys.executable, str(tree / "benchmarks" / "dflash_throughput.py"), "--out-dir", str(run_dir), *args.bench_args]
            print(f"[{name} {rep}/{args.reps}] {tree}", file=sys.stderr, flush=True)
            started = time.perf_counter()
            try:
                rc = subprocess.run(cmd, cwd=tree, env=env, stdout=subprocess.DEVNULL, timeout=args.timeout).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            order.append({"run": run_dir.name, "tree": name, "dir": str(tree), "rc": rc,
                          "took_s": round(time.perf_counter() - started, 1)})
            (work / "runs.json").write_text(json.dumps({"bench_args": args.bench_args, "runs": order}, indent=1) + "\n")
    return work


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
    done = [r for r in runs if r["tokens_per_s_threaded"] is not None]
    if not done:
        raise SystemExit(f"{work}: no run wrote a dflash_throughput results file")
    trees = {}
    for r in done:
        trees.setdefault(r["tree"], []).append(r)
    return {"benchmark": "dflash_ab", "env": done[0]["env"], "shape": done[0]["shape"], "graphs": done[0]["graphs"],
            **{k: v for k, v in meta.items() if k != "runs"}, "runs": runs,
            "trees": {name: {f"{k}_{agg.__name__}": agg(r[k] for r in rs) for k in FIGURES[:4] for agg in (min, max)}
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
        if r["tokens_per_s_threaded"] is None:
            lines.append(f"| {r['run']} | {r['tree']} | failed (rc {r['rc']}) | | | | | |")
            continue
        gpu = "-" if r["gpu_ms_per_batch"] is None else f"{r['gpu_ms_per_batch']:.3f}"
        given = " ".join([*r.get("extra_args", []), *([r["extra_env"]] if r.get("extra_env") else [])]) or "-"
        lines.append(f"| {r['run']} | {r['tree']} | {r['tokens_per_s_threaded']:.0f} | {r['tokens_per_s_sequential']:.0f} | "
                     f"{r['ratio']:.2f} | {r['host_gil_ms_per_batch']:.3f} | {gpu} | {given} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    work = args.summarize or run_all(args)
    summary = summarize(work)
    text = report(summary)
    print(text)
    stem = common.results_stem(summary["env"], f"dflash-ab-{summary['shape']}-{summary['graphs']}")
    out = common.results_dir(args.out_dir)
    (out / f"{stem}.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / f"{stem}.md").write_text(text)
    print(f"wrote {out / stem}.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
