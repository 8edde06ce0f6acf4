"""Rewrite README.md's DFlash headline table from the committed results (``--check``: only compare).

    python benchmarks/readme_tables.py            # rewrite the section between the markers
    python benchmarks/readme_tables.py --check    # exit 1 if the README is stale

The section between ``<!-- dflash-table:begin -->`` and ``<!-- dflash-table:end -->`` gets one row per
(target shape, graphs mode): the newest ``dflash-throughput-*.json`` of that pair (by the run's date,
then file name). The embedded default target is labelled a launch-bound smoke case: it gives the GPU
about 0.3 ms of work per batch, so it measures overheads, not a pipeline.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- dflash-table:begin -->", "<!-- dflash-table:end -->"
SHAPE_ORDER = ("default", "tiny-assets", "tiny", "0.6b", "1.7b", "4b", "8b")
COLUMNS = ("target", "graphs", "threaded tokens/s", "sequential tokens/s", "threaded / sequential",
           "GPU-bound tokens/s", "threaded / GPU-bound", "sequential / GPU-bound", "startup s threaded",
           "startup s sequential", "GIL host ms/batch", "GPUs one process feeds", "results")


def newest_runs(results: Path) -> list[tuple[dict, str]]:
    """(data, file name) of the newest run per (shape, graphs), in SHAPE_ORDER then graphs order."""
    newest: dict[tuple[str, str], tuple[tuple, dict, str]] = {}
    for path in sorted(results.glob("dflash-throughput-*.json")):
        try:
            data = json.loads(path.read_text())
            key, date = (data["shape"], data["graphs"]), data["env"]["date"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}: not a dflash_throughput results JSON with shape, graphs and env.date ({exc!r})")
        if key not in newest or (date, path.name) > newest[key][0]:
            newest[key] = ((date, path.name), data, path.name)
    order = {s: i for i, s in enumerate(SHAPE_ORDER)}
    keys = sorted(newest, key=lambda k: (order.get(k[0], len(order)), k[0], k[1]))
    return [(newest[k][1], newest[k][2]) for k in keys]


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value / 1000:.0f}k" if abs(value) < 1e6 else f"{value / 1e6:.2f}M"
    return f"{value:.{digits}f}"


def _target(data: dict) -> str:
    shape = data["shape"]
    if shape == "default":
        return "embedded default (1.7M-param toy): launch-bound smoke case"
    if shape in ("tiny", "tiny-assets"):
        return f"{shape} (CI size): smoke case"
    params = data.get("target_params")
    return f"Qwen3-{shape.upper()} shape, random init" + (f" ({params / 1e9:.2f}B params)" if params else "")


def table(results: Path) -> str:
    runs = newest_runs(results)
    if not runs:
        return ("No results yet: no `benchmarks/results/dflash-throughput-*.json` is committed. Run the commands of "
                "`benchmarks/README.md` (Running on a GPU) and then `python benchmarks/readme_tables.py`.")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for data, name in runs:
        device = data["env"].get("gpu") or "CPU"
        cells = [_target(data), data["graphs"], _num(data.get("tokens_per_s_threaded")),
                 _num(data.get("tokens_per_s_sequential")), _num(data.get("ratio")),
                 _num(data.get("gpu_bound_tokens_per_s")), _num(data.get("ratio_threaded_to_gpu_bound")),
                 _num(data.get("ratio_sequential_to_gpu_bound")), _num(data.get("startup_s_threaded"), 1),
                 _num(data.get("startup_s_sequential"), 1), _num(data.get("host_gil_ms_per_batch")),
                 _num(data.get("projected_gpus_per_process"), 1),
                 f"[{name}](benchmarks/results/{name}) ({device}, torch {data['env'].get('torch')})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def render(readme_text: str, results: Path) -> str:
    if readme_text.count(BEGIN) != 1 or readme_text.count(END) != 1 or readme_text.index(BEGIN) > readme_text.index(END):
        raise SystemExit(f"the README must hold {BEGIN} once, then {END} once")
    head, rest = readme_text.split(BEGIN)
    _, tail = rest.split(END)
    return f"{head}{BEGIN}\n{table(results)}\n{END}{tail}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="results directory")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--check", action="store_true", help="exit 1 if the README's table is not what the results give")
    args = p.parse_args(argv)
    old = args.readme.read_text()
    new = render(old, args.results)
    if args.check:
        if new != old:
            print(f"{args.readme}: the DFlash table is stale; run python benchmarks/readme_tables.py", file=sys.stderr)
            return 1
        print(f"{args.readme}: the DFlash table is up to date")
        return 0
    if new != old:
        args.readme.write_text(new)
        print(f"rewrote the DFlash table of {args.readme}")
    else:
        print(f"{args.readme}: the DFlash table was up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
