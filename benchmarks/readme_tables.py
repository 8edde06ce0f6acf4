"""Rewrite the generated results of README.md, docs/results.md and examples/dflash_trainer/README.md
from the committed results files (``--check``: only compare).

    python -m benchmarks readme            # rewrite the sections between the markers
    python -m benchmarks readme --check    # exit 1 if any page is stale

Each section takes the newest file of what it shows (``results_index.recency``: the date in the
file's name, then a GPU's run over a CPU's, then the torch version); every link is relative to the
page that holds it. PAGES says which page holds which section:

- README.md, between ``<!-- readme-headlines:begin -->`` and ``<!-- readme-headlines:end -->``: three
  headlines, one sentence each: the conformance suite, pytorch#123177's repro fenced and unfenced, and
  the threaded DFlash trainer against one sequential thread (the range over the newest run of each
  target and graphs mode, and the ratio aimed for, ``dflash_results.TARGET_RATIO``).
- docs/results.md: ``results-headlines`` (every other benchmark's headlines, one file per theme, as
  ``results_index.py`` words them), ``dflash-table`` (one row per (target shape, graphs mode) of
  ``dflash-throughput-*.json``) and ``dflash-tau`` (``dflash-tau-reproducibility_*.json``,
  benchmarks/tau_reproducibility.py: tau next to its baselines). A startup figure is a first run's
  (each cell on an empty Inductor cache) unless the run shared one cache between its cells: then the
  sequential startup is marked a restart and the startup ratio is left out. The embedded default
  target is labelled a launch-bound smoke case: it gives the GPU less than a millisecond of work per
  batch, so it measures overheads, not a pipeline.
- examples/dflash_trainer/README.md, ``dflash-measured``: tau and the embedded default's build time
  as measured ranges, each with what it depends on (where the drafter trained, the Python whose
  standard library the target was trained on, the transformers and torch versions).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Optional

import results_index
from dflash_results import RESTART, TARGET_RATIO, startup_comparable

ROOT = Path(__file__).resolve().parent.parent
TABLE = ("<!-- dflash-table:begin -->", "<!-- dflash-table:end -->")
TAU = ("<!-- dflash-tau:begin -->", "<!-- dflash-tau:end -->")
HEADLINES = ("<!-- results-headlines:begin -->", "<!-- results-headlines:end -->")
README_HEADLINES = ("<!-- readme-headlines:begin -->", "<!-- readme-headlines:end -->")
MEASURED = ("<!-- dflash-measured:begin -->", "<!-- dflash-measured:end -->")
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


def table(results: Path, prefix: str = "") -> str:
    runs = newest_runs(results)
    if not runs:
        return ("No results yet: no `benchmarks/results/dflash-throughput-*.json` is committed. Run the commands of "
                "`benchmarks/README.md` (Running on a GPU) and then `python -m benchmarks readme`.")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for data, name in runs:
        device = data["env"].get("gpu") or "CPU"
        cells = [_target(data), data["graphs"], _num(data.get("tokens_per_s_threaded")),
                 _num(data.get("tokens_per_s_sequential")), _num(data.get("ratio")),
                 _num(data.get("gpu_bound_tokens_per_s")), _num(data.get("ratio_threaded_to_gpu_bound")),
                 _num(data.get("ratio_sequential_to_gpu_bound")), _num(data.get("startup_s_threaded"), 1),
                 _startup_sequential(data), _startup_ratio(data), _num(data.get("host_gil_ms_per_batch")),
                 _num(data.get("projected_gpus_per_process"), 1), _peak(data),
                 f"[{name}]({prefix}benchmarks/results/{name}) ({device}, torch {data['env'].get('torch')})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def tau_section(results: Path, prefix: str = "") -> str:
    found = sorted(results.glob("dflash-tau-reproducibility_*.json"), key=lambda p: results_index.recency(p.name))
    if not found:
        return "No tau reproducibility results yet (`python -m benchmarks tau-reproducibility`)."
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
    lines.append(f"\n([{found[-1].name}]({prefix}benchmarks/results/{found[-1].name}))")
    return "\n".join(lines)


def headlines(results: Path, prefix: str = "") -> str:
    """One row per headline of the newest file of each of HEADLINE_THEMES, then of each theme of
    HEADLINE_FAMILIES (results_index's figures)."""
    newest = {}
    for path in sorted(results.glob("*.json"), key=lambda p: results_index.recency(p.name)):
        name = results_index.NAME.match(path.name)
        if name is not None and _headline_extractor(name["theme"]) is not None:
            newest[name["theme"]] = name
    if not newest:
        return "No benchmark results committed yet: run those of `benchmarks/README.md`, then `python -m benchmarks readme`."
    lines = ["| benchmark | configuration | figure | GPU | torch | results |", "|---|---|---|---|---|---|"]
    families = sorted(t for t in newest if t not in HEADLINE_THEMES)
    for theme, extract in [*HEADLINE_THEMES.items(), *((t, _headline_extractor(t)) for t in families)]:
        if theme in newest:
            name = newest[theme]
            file = name.string
            for configuration, figure in extract(json.loads((results / file).read_text())):
                lines.append(f"| {theme} | {configuration} | {figure} | {name['hardware']} | {name['torch']} "
                             f"| [{file}]({prefix}benchmarks/results/{file}) |")
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


def _newest(results: Path, theme: str) -> Optional[Path]:
    found = sorted(results.glob(f"{theme}_*.json"), key=lambda p: results_index.recency(p.name))
    found = [p for p in found if (m := results_index.NAME.match(p.name)) is not None and m["theme"] == theme]
    return found[-1] if found else None


def _where(path: Path) -> str:
    name = results_index.NAME.match(path.name)
    return f"{name['hardware']}, torch {name['torch']}"


def readme_headlines(results: Path, prefix: str = "") -> str:
    """README's three headlines, one sentence each, each linking its results file."""
    lines = []
    conformance = _newest(results, "conformance")
    if conformance is not None:
        (placements, figure), *_ = results_index.conformance(json.loads(conformance.read_text()))
        lines.append(f"- **Same behaviour in threads**: the conformance suite runs each CUDAGraph Trees behaviour on the "
                     f"main thread and in threads ({placements}), and {figure} ({_where(conformance)}; "
                     f"[{conformance.name}]({prefix}benchmarks/results/{conformance.name})).")
    fence = _newest(results, "fence-matrix")
    if fence is not None:
        rows = dict(results_index.fence_matrix(json.loads(fence.read_text())))
        fenced, unfenced = rows.get("pytorch#123177 repro, fenced"), rows.get("pytorch#123177 repro, unfenced")
        if fenced and unfenced:
            lines.append(f"- **pytorch#123177 fixed**: its repro (32 plain threads drawing random inputs around one "
                         f"compiled function) had {fenced} with threadgraph, where {unfenced} without it "
                         f"({_where(fence)}; [{fence.name}]({prefix}benchmarks/results/{fence.name})).")
    runs = [(data, name) for data, name in newest_runs(results) if data.get("ratio") is not None]
    if runs:
        best_data, best_name = max(runs, key=lambda run: run[0]["ratio"])
        low, high = min(d["ratio"] for d, _ in runs), best_data["ratio"]
        verdict = "met" if low >= TARGET_RATIO else ("met by some" if high >= TARGET_RATIO else "not met")
        lines.append(f"- **DFlash trainer, threaded against one thread**: the 5 target + 3 drafter threads train at "
                     f"{low:.2f} - {high:.2f}x the drafter tokens/s of one thread doing the same steps in turn, over "
                     f"{len(runs)} runs of {len({d['shape'] for d, _ in runs})} target sizes in {len({d['graphs'] for d, _ in runs})} graphs "
                     f"modes (best: {_target(best_data)}, {best_data['graphs']}, "
                     f"{_num(best_data.get('tokens_per_s_threaded'))} against {_num(best_data.get('tokens_per_s_sequential'))}); "
                     f"the aim was {TARGET_RATIO}x, {verdict} ({best_data['env'].get('gpu') or 'CPU'}, torch "
                     f"{best_data['env'].get('torch')}; [{best_name}]({prefix}benchmarks/results/{best_name})).")
    if not lines:
        return "No results committed yet: run those of `benchmarks/README.md`, then `python -m benchmarks readme`."
    return "\n".join(lines)


def _span(values, fmt: str) -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)} - {fmt.format(high)}"


def measured(results: Path, prefix: str = "") -> str:
    """tau and the embedded default's build time as measured ranges, from the tau reproducibility runs
    (CPU, float32) and the trainer startup runs (GPU, bfloat16), each with what it depends on."""
    lines = []
    repro = _newest(results, "dflash-tau-reproducibility")
    if repro is not None:
        data = json.loads(repro.read_text())
        env, builds = data["env"], data["builds"]
        runs = [b["run"] for b in builds if b.get("run")]
        versions = next((b["report"].get("versions", {}) for b in builds if b.get("report")), {})
        python, transformers = versions.get("python") or env.get("python"), versions.get("transformers", "unrecorded")
        link = f"[{repro.name}]({prefix}benchmarks/results/{repro.name})"
        where = (f"{env.get('gpu') or 'CPU'} with {env.get('cpus')} CPUs, Python {python}, transformers {transformers}, "
                 f"torch {env.get('torch')}")
        if runs:
            lines.append(f"- tau, drafter trained on the CPU (float32): {_span([r['tau'] for r in runs], '{:.2f}')} over "
                         f"{len(runs)} runs on {len(builds)} fresh builds ({where}; baselines: random-init "
                         f"{_span([r['tau_random_init'] for r in runs], '{:.2f}')}, repeat-last-token "
                         f"{_span([r['tau_repeat_last_token'] for r in runs], '{:.2f}')}; {link}).")
        build_s = [b["build_s"] for b in builds if b.get("build_s") is not None]
        if build_s:
            lines.append(f"- building the embedded default (tokenizer, target, data) on the CPU: "
                         f"{_span([s / 60 for s in build_s], '{:.1f}')} min per build over {len(build_s)} builds "
                         f"({where}; {link}).")
    startup = _newest(results, "dflash-trainer-startup")
    if startup is not None:
        data = json.loads(startup.read_text())
        env = data.get("env", {})
        runs = [run for name, run in data.items() if isinstance(run, dict) and name != "env" and run.get("eval")]
        link = f"[{startup.name}]({prefix}benchmarks/results/{startup.name})"
        where = f"{env.get('gpu') or 'CPU'}, Python {env.get('python')}, torch {env.get('torch')}"
        groups: dict[str, list] = {}
        for run in runs:
            versions = (run.get("target_report") or {}).get("versions")
            built = (f"target built with Python {versions.get('python')}, transformers {versions.get('transformers', 'unrecorded')}"
                     if versions else "target's build unrecorded")
            groups.setdefault(built, []).append(run["eval"]["tau"])
        for built, taus in groups.items():
            lines.append(f"- tau, drafter trained on the GPU (bfloat16): {_span(taus, '{:.2f}')} over {len(taus)} "
                         f"runs ({where}; {built}; {link}).")
        build = [run["build_s"] for run in runs if run.get("build_s") is not None]
        if build:
            lines.append(f"- the trainer's build (load, assets) in those GPU runs: {_span(build, '{:.0f}')} s: loading the "
                         f"cached assets, or building them where a run found none (its .md says which run built them; {link}).")
    if not lines:
        return "No tau or build-time results committed yet (`python -m benchmarks tau-reproducibility`, `python -m benchmarks trainer-startup`)."
    return "\n".join(lines)


# Each page, relative to the repository root, and its generated sections with what renders them.
PAGES = {
    "README.md": ((README_HEADLINES, readme_headlines),),
    "docs/results.md": ((HEADLINES, headlines), (TABLE, table), (TAU, tau_section)),
    "examples/dflash_trainer/README.md": ((MEASURED, measured),),
}


def _replace(text: str, markers: tuple[str, str], body: str, page: str = "the page") -> str:
    begin, end = markers
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{page} must hold {begin} once, then {end} once")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render(page: str, text: str, results: Path) -> str:
    """``text`` of ``page`` (a key of PAGES) with its generated sections rewritten; links are made
    relative to the page's folder."""
    prefix = "../" * page.count("/")
    for markers, section in PAGES[page]:
        text = _replace(text, markers, section(results, prefix), page)
    return text


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results", help="results directory")
    p.add_argument("--root", type=Path, default=ROOT, help="the repository root that holds the pages")
    p.add_argument("--check", action="store_true", help="exit 1 if any page's sections are not what the results give")
    args = p.parse_args(argv)
    stale = []
    for page in PAGES:
        path = args.root / page
        old = path.read_text()
        new = render(page, old, args.results)
        if new == old:
            continue
        stale.append(page)
        if not args.check:
            path.write_text(new)
            print(f"rewrote the generated results of {page}")
    if args.check and stale:
        print(f"{', '.join(stale)}: the generated results are stale; run python -m benchmarks readme", file=sys.stderr)
        return 1
    if not stale:
        print(f"{', '.join(PAGES)}: the generated results are up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
