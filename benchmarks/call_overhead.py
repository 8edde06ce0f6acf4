"""What ``threadgraph.install()`` adds to every call of a small compiled function, on the CPU, patch by patch.

    python -m benchmarks call-overhead [--reps 7] [--calls 5000] [--out-dir benchmarks/results]

The main thread calls a tiny ``torch.compile``d function (``x * 2 + 1`` on a 4-element tensor,
Inductor on the CPU) in a loop; nothing else runs. Variants, each timed ``--reps`` times in turns
within this one process (so a machine that speeds up or slows down weighs on all of them alike):
no patches, every patch, and every patch that applies on this torch alone. Before each timing the
variant's patches are put in place and the function is compiled again (Dynamo's cache serves it:
no recompilation), then called ``--calls`` times. Prints, and with ``--out-dir`` writes, the median
per-call time of each variant, its cost over no patches (us) and its ratio to no patches.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import torch  # noqa: E402

import threadgraph  # noqa: E402

THEME = "call-overhead"


def tiny(x: torch.Tensor) -> torch.Tensor:
    return x * 2 + 1


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
    recompiles_before = None
    for rep in range(reps):
        for name, exclude in table.items():
            set_variant(exclude)
            compiled = torch.compile(tiny)
            for _ in range(20):  # the first call compiles (once per process) and settles first_call's turn
                compiled(x)
            if recompiles_before is None:
                recompiles_before = frames_compiled()
            times[name].append(time_calls(compiled, x, calls))
        print(f"  round {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    threadgraph.uninstall()
    base = statistics.median(times["none"])
    rows = []
    for name in table:
        median = statistics.median(times[name])
        rows.append({"variant": name, "per_call_us": round(median * 1e6, 3),
                     "over_none_us": round((median - base) * 1e6, 3), "ratio_to_none": round(median / base, 4)})
    return {"patches": names, "rows": rows, "frames_compiled_after_first_warmup": frames_compiled() - recompiles_before}


def frames_compiled() -> int:
    """Dynamo's count of frames it compiled in this process (a recompile would show here)."""
    from torch._dynamo.utils import counters

    return sum(counters["frames"].values()) if "frames" in counters else 0


def environment() -> dict:
    return {"gpu": None, "gpus": 0, "torch": torch.__version__, "python": platform.python_version(),
            "cpus": os.cpu_count(), "date": datetime.date.today().isoformat(), "processor": platform.processor()}


def markdown(result: dict) -> str:
    env = result["env"]
    lines = [f"# call-overhead: install() on a tiny compiled function (CPU, torch {env['torch']})", "",
             f"- Python {env['python']}, {env['cpus']} CPUs, {env['date']}",
             f"- median of {result['args']['reps']} x {result['args']['calls']} calls per variant, all in one run",
             f"- frames Dynamo compiled after the first warm-up (a recompile shows here): {result['frames_compiled_after_first_warmup']}", "",
             "| variant | per call (us) | over none (us) | ratio to none |", "|---|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['variant']} | {row['per_call_us']:.3f} | {row['over_none_us']:+.3f} | "
                     f"{row['ratio_to_none']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7, help="timings per variant (the median is reported)")
    parser.add_argument("--calls", type=int, default=5000, help="calls per timing")
    parser.add_argument("--out-dir", help="write <theme>_cpu_torch<version>_<date>.json and .md here")
    args = parser.parse_args(argv)
    if args.reps < 1 or args.calls < 1:
        print("call-overhead: --reps and --calls must be at least 1", file=sys.stderr)
        return 2
    result = {"env": environment(), "args": {"reps": args.reps, "calls": args.calls}}
    result |= measure(args.reps, args.calls)
    text = markdown(result)
    print(text)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"{THEME}_cpu_torch{torch.__version__.split('+')[0]}_{result['env']['date']}"
        (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / f"{stem}.md").write_text(text)
        print(f"wrote {out / stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
