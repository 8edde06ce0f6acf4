"""Rewrite README.md's generated results (DFlash, and the other benchmarks' headlines) from the
committed results files (``--check``: only compare).

    python benchmarks/readme_tables.py            # rewrite the sections between the markers
    python benchmarks/readme_tables.py --check    # exit 1 if the README is stale

Each section takes the newest file of what it shows (``results_index.recency``: the date in the
file's name, then a GPU's run over a CPU's, then the torch version). The section between
``<!-- dflash-table:begin -->`` and ``<!-- dflash-table:end -->`` gets one row per (target shape,
graphs mode) of ``dflash-throughput-*.json``. A startup figure is a first run's (each cell on an
empty Inductor cache) unless the run shared one cache between its cells: then the sequential startup
is marked a restart and the startup ratio is left out. The embedded default target is labelled a
launch-bound smoke case: it gives the GPU less than a millisecond of work per batch, so it measures
overheads, not a pipeline. The section between ``<!-- dflash-tau:begin -->`` and
``<!-- dflash-tau:end -->`` gets ``dflash-tau-reproducibility_*.json``
(benchmarks/tau_reproducibility.py): tau next to its baselines. The section between
``<!-- results-headlines:begin -->`` and ``<!-- results-headlines:end -->`` gets the other
benchmarks' headlines (fence, GPU scenarios, per-thread step time), one file per theme, as
``results_index.py`` words them.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import results_index
from dflash_results import RESTART, startup_comparable

ROOT = Path(__file__).resolve().parent.parent
TABLE = ("<!-- dflash-table:begin -->", "<!-- dflash-table:end -->")
TAU = ("<!-- dflash-tau:begin -->", "<!-- dflash-tau:end -->")
HEADLINES = ("<!-- results-headlines:begin -->", "<!-- results-headlines:end -->")
# The themes of the README's other results, in its order, each from its newest file; a scenarios
# file holds several device calls, of which each scenario's last counts.
HEADLINE_THEMES = {"conformance": results_index.conformance, "install-overhead": results_index.install_overhead,
                   "fence-matrix": results_index.fence_matrix, "fence-overhead": results_index.fence_overhead,
                   "gpu-scenarios": results_index.gpu_scenarios_latest, "replay-dflash": results_index.replay,
                   "replay-dflash-gil": results_index.replay, "replay-small": results_index.replay,
                   "replay-small-gil": results_index.replay, "dflash-trainer-startup": results_index.dflash_trainer}
HEADLINE_FAMILIES = {"dflash-ab-": results_index.dflash_ab}  # then every theme of these, by name
EMBEDDED_ORDER = ("default", "tiny-assets", "tiny")  # then the published shapes by size (0.6b, ..., 32b)
COLUMNS = ("target", "graphs", "threaded tokens/s", "sequential tokens/s", "threaded / sequential",
           "GPU-bound tokens/s", "threaded / GPU-bound", "sequential / GPU-bound", "startup s threaded",
           "startup s sequential", "startup threaded / sequential", "GIL host ms/batch", "GPUs one process feeds",
           "peak GiB threaded (estimate)", "results")


def newest_runs(results: Path) -> list[tuple[dict, str]]:
    """(data, file name) of the newest run per (shape, graphs): the embedded targets, then the
    published shapes by their size, each in graphs order."""
    newest: dict[tuple[str, str], tuple[tuple, dict, str]] = {}
    for path in sorted(results.glob("dflash-throughput-*.json")):
        try:
            data = json.loads(path.read_text())
            key = data["shape"], data["graphs"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SystemExit(f"{path}: not a dflash_throughput results JSON with shape and graphs ({exc!r})")
        if key not in newest or results_index.recency(path.name) > newest[key][0]:
            newest[key] = (results_index.recency(path.name), data, path.name)
    keys = sorted(newest, key=lambda k: (*_shape_rank(k[0]), k[1]))
    return [(newest[k][1], newest[k][2]) for k in keys]


def _shape_rank(shape: str) -> tuple[int, float, str]:
    if shape in EMBEDDED_ORDER:
        return 0, EMBEDDED_ORDER.index(shape), shape
    try:
        return 1, float(shape.removesuffix("b")), shape
    except ValueError:
        return 2, 0.0, shape


def _num(value, digits: int = 2) -> str:
    if value is None:
        return "-"
    if abs(value) >= 1000:
        return f"{value / 1000:.0f}k" if abs(value) < 1e6 else f"{value / 1e6:.2f}M"
    return f"{value:.{digits}f}"


def _target(data: dict) -> str:
    shape, params = data["shape"], data.get("target_params")
    if shape == "default":
        return f"embedded default ({params / 1e6:.1f}M-param toy): launch-bound smoke case" if params else \
            "embedded default (toy): launch-bound smoke case"
    if shape in ("tiny", "tiny-assets"):
        return f"{shape} (CI size): smoke case"
    return f"Qwen3-{shape.upper()} shape, random init" + (f" ({params / 1e9:.2f}B params)" if params else "")


def _startup_sequential(data: dict) -> str:
    value = _num(data.get("startup_s_sequential"), 1)
    return value if startup_comparable(data.get("sequential", {})) else f"{value} ({RESTART})"


def _startup_ratio(data: dict) -> str:
    if not startup_comparable(data.get("sequential", {})):
        return "- (not comparable)"
    return _num(data.get("startup_ratio"))  # dflash_report.headline's figure


def _peak(data: dict) -> str:
    """The threaded cell's peak memory on its busiest device, with the trainer's estimate beside it."""
    peak, estimate = data.get("peak_memory_gib_threaded"), data.get("memory_estimate_gib")
    if peak is None:
        return "- (not recorded)"
    return f"{peak:.0f}" + (f" ({estimate:.0f})" if estimate is not None else "")


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
                 _startup_sequential(data), _startup_ratio(data), _num(data.get("host_gil_ms_per_batch")),
                 _num(data.get("projected_gpus_per_process"), 1), _peak(data),
                 f"[{name}](benchmarks/results/{name}) ({device}, torch {data['env'].get('torch')})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tau_section(results: Path) -> str:
    found = sorted(results.glob("dflash-tau-reproducibility_*.json"), key=lambda p: results_index.recency(p.name))
    if not found:
        return "No tau reproducibility results yet (`python benchmarks/tau_reproducibility.py`)."
    data = json.loads(found[-1].read_text())
    env, builds = data["env"], data["builds"]
    runs = [b["run"] for b in builds if b.get("run")]
    where = f"{env.get('gpu') or 'CPU'}, {env.get('cpus')} CPUs, torch {env.get('torch')}, {env.get('date')}"
    same = ("bit-identical (the SHA-256 of every asset file; the build reports equal but for their timings)" if data["bit_identical"]
            else f"not bit-identical (differing: {', '.join(data['differing_files'])})")
    reports = [b["report"] for b in builds if b.get("report")]
    lines = [f"{len(builds)} fresh builds of the embedded default ({where}): {same}.",
             *([_assets_line(reports[0]), ""] if reports else [])]
    for i, run in enumerate(runs):
        lines.append(f"- run {i + 1}: tau {run['tau']:.3f} after {run['steps']} steps, against "
                     f"{run['tau_random_init']:.3f} for the random-init drafter and {run['tau_repeat_last_token']:.3f} "
                     "for repeat-last-token")
    if len(runs) > 1:
        lines.append(f"- spread of tau over the {len(runs)} runs: {data['tau']['min']:.3f} - {data['tau']['max']:.3f}")
    lines.append(f"\n([{found[-1].name}](benchmarks/results/{found[-1].name}))")
    return "\n".join(lines)


def headlines(results: Path) -> str:
    """One row per headline of the newest file of each of HEADLINE_THEMES, then of each theme of
    HEADLINE_FAMILIES (results_index's figures)."""
    newest = {}
    for path in sorted(results.glob("*.json"), key=lambda p: results_index.recency(p.name)):
        name = results_index.NAME.match(path.name)
        if name is not None and _headline_extractor(name["theme"]) is not None:
            newest[name["theme"]] = name
    if not newest:
        return "No benchmark results committed yet: run those of `benchmarks/README.md`, then `python benchmarks/readme_tables.py`."
    lines = ["| benchmark | configuration | figure | GPU | torch | results |", "|---|---|---|---|---|---|"]
    families = sorted(t for t in newest if t not in HEADLINE_THEMES)
    for theme, extract in [*HEADLINE_THEMES.items(), *((t, _headline_extractor(t)) for t in families)]:
        if theme in newest:
            name = newest[theme]
            file = name.string
            for configuration, figure in extract(json.loads((results / file).read_text())):
                lines.append(f"| {theme} | {configuration} | {figure} | {name['hardware']} | {name['torch']} "
                             f"| [{file}](benchmarks/results/{file}) |")
    return "\n".join(lines)


def _headline_extractor(theme: str):
    if theme in HEADLINE_THEMES:
        return HEADLINE_THEMES[theme]
    return next((extract for prefix, extract in HEADLINE_FAMILIES.items() if theme.startswith(prefix)), None)


def _assets_line(report: dict) -> str:
    """What the embedded default is, from a build's report."""
    spec, data = report["spec"], report["data"]
    return (f"Each build: a {report['num_parameters'] / 1e6:.2f}M-parameter Qwen3 target ({spec['num_layers']} layers, "
            f"hidden {spec['hidden_size']}, vocabulary {report['tokenizer_vocab']}) trained on Python's standard library "
            f"source for {spec['train_steps']} steps (held-out loss {report['heldout_loss_before']:.2f} -> "
            f"{report['heldout_loss_after']:.2f} nats), {data['num_samples']} training samples whose responses the target "
            f"regenerated greedily, {data['num_eval_prompts']} held-out prompts.")


def _replace(text: str, markers: tuple[str, str], body: str) -> str:
    begin, end = markers
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"the README must hold {begin} once, then {end} once")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render(readme_text: str, results: Path) -> str:
    text = _replace(readme_text, HEADLINES, headlines(results))
    return _replace(_replace(text, TABLE, table(results)), TAU, tau_section(results))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="results directory")
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--check", action="store_true", help="exit 1 if the README's sections are not what the results give")
    args = p.parse_args(argv)
    old = args.readme.read_text()
    new = render(old, args.results)
    if args.check:
        if new != old:
            print(f"{args.readme}: the generated results are stale; run python benchmarks/readme_tables.py", file=sys.stderr)
            return 1
        print(f"{args.readme}: the generated results are up to date")
        return 0
    if new != old:
        args.readme.write_text(new)
        print(f"rewrote the generated results of {args.readme}")
    else:
        print(f"{args.readme}: the generated results were up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
