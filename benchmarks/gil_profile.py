"""Where the threaded DFlash pipeline's GIL time goes: py-spy samples of a running trainer.

    python benchmarks/gil_profile.py --cuda-graphs whole-step --steps 2000   # GPU, cuda:0
    python benchmarks/gil_profile.py --quick --steps 200                     # CPU reduced form

It trains in this process with the throughput bench's settings (every option of
``dflash_throughput.py`` applies) and, once the leader has logged ``--start-step`` steps (after
compilation and capture), runs two py-spy recordings of itself for ``--seconds``:

- ``--gil``: only the thread that holds the GIL, so samples / ticks is the GIL's busy fraction
  and the lines they fall on are what the interpreter is busy with;
- ``--idle``: every thread, so each line's share of a thread's wall time, waiting included.

A line of ``workers.py`` (a phase of a worker's ``step``) that takes much wall time but little
GIL time waits: for peers, for the device, or for the GIL. Needs py-spy (``pip install py-spy``)
and permission to read this process's memory (ptrace); it asks Linux for that itself.
"""

from __future__ import annotations

import argparse
import collections
import linecache
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import dflash_throughput  # noqa: E402
import pyspy  # noqa: E402

STEP_FRAME = re.compile(r"^(?:\w+\.)?step \((.*workers\.py):(\d+)\)$")
REPO = Path(__file__).resolve().parent.parent


def thread_kind(name: str) -> str:
    return name.split("-")[0] if re.match(r"^(target|drafter)-\d+$", name) else name


def step_line(frames: list[str]) -> str:
    """The line of a worker's step() this sample is in, else the innermost frame."""
    for frame in reversed(frames):
        match = STEP_FRAME.match(frame)
        if match:
            file, line = match.group(1), int(match.group(2))
            path = file if os.path.isabs(file) else str(REPO / "examples" / "dflash_trainer" / Path(file).name)
            return f"workers.py:{line} {linecache.getline(path, line).strip()[:70]}"
    return f"(outside step) {frames[-1] if frames else '?'}"


def summarise(gil: list, wall: list) -> dict:
    busy, gil_total, ticks = pyspy.gil_busy(gil, wall)
    by_kind = collections.Counter()
    by_line = collections.Counter()
    by_leaf = collections.Counter()
    for thread, frames, count in gil:
        by_kind[thread_kind(thread)] += count
        by_line[(thread_kind(thread), step_line(frames))] += count
        by_leaf[frames[-1] if frames else "?"] += count
    wall_line = collections.Counter()
    wall_kind = collections.Counter()
    for thread, frames, count in wall:
        wall_line[(thread_kind(thread), step_line(frames))] += count
        wall_kind[thread_kind(thread)] += count
    lines = [{"thread": kind, "line": line, "gil_share": count / gil_total,
              "thread_wall_share": wall_line[(kind, line)] / max(1, wall_kind[kind])}
             for (kind, line), count in by_line.most_common(18)]
    return {
        "gil_samples": gil_total, "ticks": ticks, "gil_busy": busy,
        "gil_share_by_thread": {k: v / gil_total for k, v in by_kind.most_common()},
        "lines": lines,
        "leaves": [{"frame": f, "gil_share": c / gil_total} for f, c in by_leaf.most_common(12)],
    }


def report(summary: dict, args, env: dict, seconds: float) -> str:
    pct = lambda x: f"{100 * x:.1f}%"  # noqa: E731
    rows = [[r["thread"], r["line"], pct(r["gil_share"]), pct(r["thread_wall_share"])] for r in summary["lines"]]
    leaves = [[r["frame"], pct(r["gil_share"])] for r in summary["leaves"]]
    return "\n".join([
        f"# GIL profile of the threaded DFlash pipeline ({'GPU' if env['gpu'] else 'CPU reduced form'})", "",
        *common.header_lines(env),
        f"- devices {args.devices}; cuda graphs {args.cuda_graphs or 'trees'}; {args.targets} + {args.drafters} "
        f"threads; py-spy at {args.rate} Hz for {seconds:.1f} s from step {args.start_step}",
        "", f"**GIL busy: {common.fmt(summary['gil_busy'])}** ({summary['gil_samples']} GIL samples in "
        f"{summary['ticks']} ticks)", "",
        "GIL share by thread kind: " + ", ".join(f"{k} {pct(v)}" for k, v in summary["gil_share_by_thread"].items()), "",
        common.markdown_table(["thread", "where (line of the worker's step)", "share of GIL samples",
                               "share of that thread kind's wall samples"], rows), "",
        "## Innermost frames holding the GIL", "", common.markdown_table(["frame", "share of GIL samples"], leaves), "",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each recording (default 10)")
    parser.add_argument("--start-step", type=int, default=60, help="start once the leader logged this step")
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second (default 250)")
    own, rest = parser.parse_known_args(argv)
    args = dflash_throughput.parse_args(rest)
    args.seconds, args.start_step, args.rate = own.seconds, own.start_step, own.rate
    py_spy = pyspy.find()
    if py_spy is None:
        print("error: py-spy not found; pip install py-spy (in threadgraph's bench extra)", file=sys.stderr)
        return 2
    from examples.dflash_trainer.train import train

    pyspy.allow_ptrace()
    env = common.environment()
    if not env["gpu"]:
        import torch

        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        if args.assets == "default":
            from examples.dflash_trainer.assets import default_assets

            default_assets()
        cfg = dflash_throughput.make_config(args, run_dir)
        out = common.results_dir(args.out_dir)
        recorder = pyspy.Recorder(py_spy, Path(run_dir), args.seconds, args.rate)
        results = train(cfg, progress=lambda r: recorder.start() if r.get("step", 0) >= args.start_step else None)
        if not recorder.procs:
            print(f"error: the run ended before step {args.start_step}; raise --steps", file=sys.stderr)
            return 2
        seconds = recorder.finish()
        summary = summarise(recorder.samples("gil"), recorder.samples("wall"))
        stem = common.results_stem(env, "_gil-profile")
        for name in ("gil", "wall"):
            shutil.copy(Path(run_dir, f"{name}.txt"), out / f"{stem}_{name}.txt")
    text = report(summary, args, env, seconds)
    print(text)
    common.write_json(out / f"{stem}.json", {"benchmark": "gil_profile", "env": env, "args": vars(args),
                                             "recorded_seconds": seconds, **summary,
                                             "tokens_per_s_steady": results.get("tokens_per_s_steady"),
                                             "workers": results.get("workers")})
    (out / f"{stem}.md").write_text(text)
    print(f"\nwrote {out / stem}.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
