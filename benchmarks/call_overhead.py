"""What ``threadgraph.install()`` adds to each call of a tiny compiled function (CPU), per patch.

    python -m benchmarks call-overhead [--reps 7] [--calls 5000] [--out-dir benchmarks/results]

The main thread calls a tiny ``torch.compile``d function (``x * 2 + 1`` on a 4-element tensor,
Inductor on the CPU) in a loop; nothing else runs. Variants, timed in turns within this one process
(so a machine that speeds up or slows down weighs on all of them alike): no patches, every patch,
and every patch that applies on this torch alone, each with its own copy of the function. Each round
times each single patch ``--reps`` times in all, each time right after a timing of no patches and
one of every patch. Before each timing the variant's patches are put in place, its copy is compiled
(its first call compiles it, once per process) and called ``--calls // 4`` times untimed (putting
patches in place leaves the processor's caches cold for the calls that follow), then ``--calls``
times, timed. Writes (to ``--out-dir``, else the scratch folder) and prints, for each variant, the
median per-call time, its cost over no patches (the median of its differences from the timing of
no patches just before it, in us) and its ratio to no patches. The row of every patch has a sample
per single patch and round, a single patch's row ``--reps`` samples: on a shared machine the single
rows move by a few tenths of a microsecond from run to run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from typing import Callable

import torch

import threadgraph

from . import common

THEME = "call-overhead"


def tiny(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


def own_copy(index: int) -> Callable:
    """``tiny`` with a code object of its own: Dynamo caches compiled code per code object, so each
    variant compiles its copy once, under its own patches, and never meets another variant's entries."""
    return types.FunctionType(tiny.__code__.replace(co_name=f"tiny_{index}"), tiny.__globals__, f"tiny_{index}")


def time_calls(compiled, x: torch.Tensor, calls: int) -> float:
    """CPU seconds of this thread per call of ``compiled(x)``, over ``calls`` calls: time the thread
    spent descheduled on a busy machine is not counted."""
    started = time.thread_time()
    for _ in range(calls):
        compiled(x)
    return (time.thread_time() - started) / calls


def applying() -> list[str]:
    """The patches install() applies on this torch."""
    return [p["name"] for p in threadgraph.patches() if p["applies"]]


def variants(names: list[str]) -> dict[str, frozenset]:
    """Variant name -> the patches to leave out of install() (None: no install at all)."""
    every = frozenset(names)
    table: dict = {"none": None, "all": frozenset()}
    for name in names:
        table[f"only {name}"] = every - {name}
    return table


def set_variant(exclude) -> None:
    threadgraph.uninstall()
    if exclude is not None:
        threadgraph.install(exclude=exclude)


def measure(reps: int, calls: int) -> dict:
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    names = applying()
    table = variants(names)
    x = torch.ones(4)
    times: dict[str, list[float]] = {name: [] for name in table}
    over_none: dict[str, list[float]] = {name: [] for name in table}
    recompiles_before = None
    functions = {name: own_copy(index) for index, name in enumerate(table)}
    singles = [name for name in table if name not in ("none", "all")]

    def timed(name: str) -> float:
        set_variant(table[name])
        compiled = torch.compile(functions[name])
        for _ in range(20):  # the first call compiles (once per process) and settles first_call's turn
            compiled(x)
        nonlocal recompiles_before
        if recompiles_before is None:
            recompiles_before = frames_compiled()
        time_calls(compiled, x, max(calls // 4, 1))  # untimed: the caches warm up again after set_variant
        times[name].append(time_calls(compiled, x, calls))
        return times[name][-1]

    for rep in range(reps):
        # Each single patch is timed after a timing of none and one of all, so the two ends of the
        # comparison are sampled all through the run, and each variant against the none just before it.
        for single in singles:
            none = timed("none")
            over_none["none"].append(0.0)
            for name in ("all", single):
                over_none[name].append(timed(name) - none)
        print(f"  round {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    threadgraph.uninstall()
    base = statistics.median(times["none"])
    rows = []
    for name in table:
        extra = statistics.median(over_none[name])
        rows.append({"variant": name, "per_call_us": round(statistics.median(times[name]) * 1e6, 3),
                     "over_none_us": round(extra * 1e6, 3), "ratio_to_none": round((base + extra) / base, 4)})
    return {"patches": names, "rows": rows, "frames_compiled_after_first_warmup": frames_compiled() - recompiles_before}


def frames_compiled() -> int:
    """Dynamo's count of frames it compiled in this process (a recompile would show here)."""
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values()) if "frames" in counters else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timings per variant (the median is reported)")
    parser.add_argument("--calls", type=int, default=5000, help="calls per timing")
    common.add_out_dir(parser)
    args = parser.parse_args(argv)
    if args.reps < 1 or args.calls < 1:
        print("call-overhead: --reps and --calls must be at least 1", file=sys.stderr)
        return 2
    env = common.environment()
    result = {"theme": THEME, "env": env, "args": {"reps": args.reps, "calls": args.calls},
              "command": f"python -m benchmarks call-overhead --reps {args.reps} --calls {args.calls}"}
    result |= measure(args.reps, args.calls)
    common.save(common.results_dir(args.out_dir) / f"{common.results_stem(env, THEME)}.json", result)
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
