"""Where the threaded DFlash pipeline's GIL time goes: py-spy samples of a running trainer.

    python -m benchmarks gil-profile --cuda-graphs whole-step --steps 2000   # GPU, cuda:0
    python -m benchmarks gil-profile --quick --steps 200                     # CPU reduced form

It trains in this process with the throughput bench's settings (every option of
``dflash_throughput.py`` applies) and, once the leader has logged ``--start-step`` steps (after
compilation and capture), runs two py-spy recordings of itself for ``--seconds``:

- ``--gil``: only the thread that holds the GIL, so samples / ticks is the GIL's busy fraction
  and the frames they fall in are what the interpreter is busy with;
- ``--idle``: every thread, so each stage's share of a thread's wall time, waiting included.

Samples are keyed by what a worker's ``step`` was calling, through the trainer's step functions
(``TargetStage.step``, ``DrafterReplica.train_step``): a component's method (a stage's ``forward``,
the hand-off's ``put``/``get``, the replica's ``forward_backward`` or ``update``, the averager's
``average``). One that takes much wall time but little GIL time waits: for peers, for
the device, or for the GIL. Needs py-spy (``pip install py-spy``)
and permission to read this process's memory (ptrace); it asks Linux for that itself.
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
import tempfile
from pathlib import Path

from . import common
from . import results_schema
from . import dflash_throughput
from . import pyspy

def thread_kind(name: str) -> str:
    return name.split("-")[0] if re.match(r"^(target|drafter)-\d+$", name) else name


def _function(frame: str) -> str:
    match = pyspy.FRAME.match(frame)
    return match["func"] if match else frame


# The trainer's step functions between a worker's step() and the components' methods it is keyed by
# (TargetStage.step, DrafterReplica.train_step); py-spy may or may not prefix the class.
STEP_FUNCTIONS = ("step", "train_step")


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def step_stage(frames: list[str]) -> str:
    """The function a worker's step() had called, through the step functions, when sampled (a
    component's method: the target stage's forward, the hand-off, the replica's forward_backward,
    ...), else where it was."""
    names = [_function(f) for f in frames]
    # The worker's step is the outermost step(): the optimizer's and the scheduler's are inside it.
    at = next((i for i, name in enumerate(names) if _short(name) == "step"), None)
    if at is None:
        return f"(outside step) {names[-1] if names else '?'}"
    at += 1
    # A sample in a step function's own code (nothing called below it) is keyed by that function.
    while at + 1 < len(names) and _short(names[at]) in STEP_FUNCTIONS:
        at += 1
    return names[at] if at < len(names) else "(step itself)"


def summarise(gil: list, wall: list) -> dict:
    busy, gil_total, ticks = pyspy.gil_busy(gil, wall)
    by_kind = collections.Counter()
    by_stage = collections.Counter()
    by_leaf = collections.Counter()
    for thread, frames, count in gil:
        by_kind[thread_kind(thread)] += count
        by_stage[(thread_kind(thread), step_stage(frames))] += count
        by_leaf[frames[-1] if frames else "?"] += count
    wall_stage = collections.Counter()
    wall_kind = collections.Counter()
    for thread, frames, count in wall:
        wall_stage[(thread_kind(thread), step_stage(frames))] += count
        wall_kind[thread_kind(thread)] += count
    stages = [{"thread": kind, "stage": stage, "gil_share": count / gil_total,
               "thread_wall_share": wall_stage[(kind, stage)] / max(1, wall_kind[kind])}
              for (kind, stage), count in by_stage.most_common(18)]
    return {
        "gil_samples": gil_total, "ticks": ticks, "gil_busy": busy,
        "gil_share_by_thread": {k: v / gil_total for k, v in by_kind.most_common()},
        "stages": stages,
        "leaves": [{"frame": f, "gil_share": c / gil_total} for f, c in by_leaf.most_common(12)],
    }


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
        print("error: py-spy not found; pip install -r benchmarks/requirements.txt", file=sys.stderr)
        return 2
    from examples.dflash_trainer.train import train

    pyspy.allow_ptrace()
    env = common.environment()
    if not env["gpu"]:
        import torch

        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = dflash_throughput.make_config(args, run_dir)  # builds the assets (and a --target-shape) if missing
        out = common.results_dir(args.out_dir)
        recorder = pyspy.Recorder(py_spy, Path(run_dir), args.seconds, args.rate)
        results = train(cfg, progress=lambda r: recorder.start() if r.get("step", 0) >= args.start_step else None)
        if not recorder.procs:
            print(f"error: the run ended before step {args.start_step}; raise --steps", file=sys.stderr)
            return 2
        seconds = recorder.finish()
        summary = summarise(recorder.samples("gil"), recorder.samples("wall"))
        stem = common.results_stem(env, "gil-profile")
        for name in ("gil", "wall"):  # py-spy's raw stacks, beside the results but no results file
            (out / f"{stem}_{name}.txt").write_text(results_schema.neutral(Path(run_dir, f"{name}.txt").read_text()))
    common.save(out / f"{stem}.json", {"benchmark": "gil_profile", "env": env, "args": vars(args),
                                       "recorded_seconds": seconds, **summary,
                                       "tokens_per_s_steady": results.tokens_per_s_steady,
                                       "workers": results.to_json()["workers"]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
