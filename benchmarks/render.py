"""Render the committed results: the results index (results_index.py) and the generated sections of the pages.

    python -m benchmarks index [--check]     # benchmarks/results/README.md, one row per headline of every JSON
    python -m benchmarks readme [--check]    # README.md, docs/results.md, examples/dflash_trainer/README.md

(``python benchmarks/render.py index|readme [--check]`` is the same.) ``--check`` writes nothing and
exits 1 when a file is stale. Every results file is read through ``results_schema.load`` (a bad one
is one error naming the file and field) and its figures worded by ``headlines.py``. Each page
section takes the newest file of what it shows (``results_schema.recency``: the date in the file's
name, then a GPU's run over a CPU's, then the torch version); every link is relative to the page
that holds it. PAGES says which page holds which section:

- README.md, ``readme-headlines``: three headlines, one sentence each: the conformance suite,
  pytorch#123177's repro fenced and unfenced, and the threaded DFlash trainer against one sequential
  thread (the range over the newest run of each target and graphs mode, and the ratio aimed for).
- docs/results.md: ``results-headlines`` (every other benchmark's headlines, one file per theme),
  ``dflash-table`` (one row per (target shape, graphs mode) of ``dflash-throughput-*.json``) and
  ``dflash-tau`` (tau next to its baselines); its ``results-headlines`` gives each theme's newest file
  per torch release. A startup figure is a first run's (each cell on an
  empty Inductor cache) unless the run shared one cache between its cells: then the sequential
  startup is marked a restart and the startup ratio is left out. The embedded default target is
  labelled a launch-bound smoke case: it gives the GPU less than a millisecond of work per batch.
- docs/projection.md, ``seed-projection``: the seed topology past one GPU, projected from the
  DFlash throughput runs' GPU and GIL times per batch (benchmarks/projection.py).
- examples/dflash_trainer/README.md, ``dflash-measured``: tau and the embedded default's build time
  as measured ranges, each with what it depends on (where the drafter trained, the Python whose
  standard library the target was trained on, the transformers and torch versions).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import headlines
from . import projection
from . import results_index
from . import results_schema as schema
from .headlines import RESTART, target_ratio
from .results_schema import Results, ResultsError, sequential_training, startup_comparable, timed_alike

ROOT = Path(__file__).resolve().parent.parent
# The themes of docs/results.md's other results, in its order, each from its newest file; a scenarios
# file holds several device calls, of which each scenario's last counts. Then every dflash-ab theme.
HEADLINE_THEMES = {"conformance": headlines.conformance, "doctor-selftest": headlines.doctor_selftest,
                   "install-overhead": headlines.install_overhead,
                   "fence-matrix": headlines.fence_matrix, "fence-overhead": headlines.fence_overhead,
                   "gpu-scenarios": headlines.gpu_scenarios_latest, "replay-dflash": headlines.replay,
                   "replay-dflash-gil": headlines.replay, "replay-small": headlines.replay,
                   "replay-small-gil": headlines.replay, "dflash-trainer-startup": headlines.dflash_trainer}
HEADLINE_FAMILIES = {"dflash-ab": headlines.dflash_ab}
EMBEDDED_ORDER = ("default", "tiny-assets", "tiny")  # then the published shapes by size (0.6b, ..., 32b)
COLUMNS = ("target", "graphs", "threaded tokens/s", "sequential tokens/s", "threaded / sequential",
           "GPU-bound tokens/s", "threaded / GPU-bound", "sequential / GPU-bound", "startup s threaded",
           "startup s sequential", "startup threaded / sequential", "GIL host ms/batch", "GPUs one process feeds",
           "peak GiB threaded (estimate)", "results")


def link(results: Results, prefix: str) -> str:
    return f"[{results.name}]({prefix}benchmarks/results/{results.name})"


# -- the DFlash table -----------------------------------------------------------------------------------

def newest_runs(folder: Path, release: str | None = None) -> list[Results]:
    """The newest dflash-throughput run per (torch release, shape, graphs), or of ``release`` only:
    the embedded targets, then the published shapes by their size, each in graphs order, then by release."""
    newest: dict[tuple[str, str, str], Results] = {}
    for r in schema.load_folder(folder):  # oldest first: a newer run replaces an older one
        if schema.family(r.theme) == "dflash-throughput" and release in (None, r.torch):
            newest[r.torch, r.data["shape"], r.data["graphs"]] = r
    return [newest[k] for k in sorted(newest, key=lambda k: (*_shape_rank(k[1]), k[2], schema.release(k[0])))]


def matrix_release(runs: list[Results]) -> str | None:
    """The torch release with the most (shape, graphs) cells measured, the newer on a tie: the one
    whose runs the headline's range and the projection speak for (releases are not mixed in one range)."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.torch] = counts.get(r.torch, 0) + 1
    return max(counts, key=lambda t: (counts[t], schema.release(t))) if counts else None


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
    return value if startup_comparable(data["sequential"]) else f"{value} ({RESTART})"


def _startup_ratio(data: dict) -> str:
    if not startup_comparable(data["sequential"]):
        return "- (not comparable)"
    return _num(data.get("startup_ratio"))  # dflash_report.headline's figure


def _peak(data: dict) -> str:
    """The threaded cell's peak memory on its busiest device, with the trainer's estimate beside it."""
    peak, estimate = data.get("peak_memory_gib_threaded"), data.get("memory_estimate_gib")
    if peak is None:
        return "- (not recorded)"
    return f"{peak:.0f}" + (f" ({estimate:.0f})" if estimate is not None else "")


def table(folder: Path, prefix: str = "") -> str:
    runs = newest_runs(folder)
    if not runs:
        return ("No results yet: no `benchmarks/results/dflash-throughput-*.json` is committed. Run the commands of "
                "`benchmarks/README.md` (Running on a GPU) and then `python -m benchmarks readme`.")
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for run in runs:
        data = run.data
        cells = [_target(data), data["graphs"], _num(data.get("tokens_per_s_threaded")),
                 _num(data.get("tokens_per_s_sequential")), _num(data.get("ratio")),
                 _num(data.get("gpu_bound_tokens_per_s")), _num(data.get("ratio_threaded_to_gpu_bound")),
                 _num(data.get("ratio_sequential_to_gpu_bound")), _num(data.get("startup_s_threaded"), 1),
                 _startup_sequential(data), _startup_ratio(data), _num(data.get("host_gil_ms_per_batch")),
                 _num(data.get("projected_gpus_per_process"), 1), _peak(data),
                 f"{link(run, prefix)} ({data['env'].get('gpu') or 'CPU'}, torch {data['env'].get('torch')})"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- tau, the other headlines, the README's, the trainer's ranges -----------------------------------------

def tau_section(folder: Path, prefix: str = "") -> str:
    repro = schema.newest(folder, "dflash-tau-reproducibility")
    if repro is None:
        return "No tau reproducibility results yet (`python -m benchmarks tau-reproducibility`)."
    data = repro.data
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
    lines.append(f"\n({link(repro, prefix)})")
    return "\n".join(lines)


def _assets_line(report: dict) -> str:
    """What the embedded default is, from a build's report."""
    spec, data = report["spec"], report["data"]
    return (f"Each build: a {report['num_parameters'] / 1e6:.2f}M-parameter Qwen3 target ({spec['num_layers']} layers, "
            f"hidden {spec['hidden_size']}, vocabulary {report['tokenizer_vocab']}) trained on Python's standard library "
            f"source for {spec['train_steps']} steps (held-out loss {report['heldout_loss_before']:.2f} -> "
            f"{report['heldout_loss_after']:.2f} nats), {data['num_samples']} training samples whose responses the target "
            f"regenerated greedily, {data['num_eval_prompts']} held-out prompts.")


def _headline_extractor(theme: str):
    if theme in HEADLINE_THEMES:
        return HEADLINE_THEMES[theme]
    return next((extract for kind, extract in HEADLINE_FAMILIES.items() if schema.family(theme) == kind), None)


def other_headlines(folder: Path, prefix: str = "") -> str:
    """One row per headline of the newest file of each of HEADLINE_THEMES, then of each theme of
    HEADLINE_FAMILIES, for each torch release it ran on (oldest release first)."""
    newest = {(r.theme, r.torch): r for r in schema.load_folder(folder) if _headline_extractor(r.theme) is not None}
    if not newest:
        return "No benchmark results committed yet: run those of `benchmarks/README.md`, then `python -m benchmarks readme`."
    lines = ["| benchmark | configuration | figure | GPU | torch | results |", "|---|---|---|---|---|---|"]
    themes = {theme for theme, _ in newest}
    families = sorted(t for t in themes if t not in HEADLINE_THEMES)
    for theme in [*(t for t in HEADLINE_THEMES if t in themes), *families]:
        for key in sorted((k for k in newest if k[0] == theme), key=lambda k: schema.release(k[1])):
            r = newest[key]
            for configuration, figure in _headline_extractor(theme)(r.data):
                lines.append(f"| {theme} | {configuration} | {figure} | {r.machine} | {r.torch} | {link(r, prefix)} |")
    return "\n".join(lines)


def readme_headlines(folder: Path, prefix: str = "") -> str:
    """README's three headlines, one sentence each, each linking its results file."""
    lines = []
    conformance = schema.newest(folder, "conformance")
    if conformance is not None:
        (placements, figure), *_ = headlines.conformance(conformance.data)
        lines.append(f"- **Same behaviour in threads**: the conformance suite runs each CUDAGraph Trees behaviour on the "
                     f"main thread and in threads ({placements}), and {figure} ({conformance.machine}, torch "
                     f"{conformance.torch}; {link(conformance, prefix)}).")
    fences = [(r, _repro_rows(r)) for r in schema.load_folder(folder) if r.theme == "fence-matrix"]
    fences = [(r, rows) for r, rows in fences if all(rows)]
    # The newest file where the repro still raised without threadgraph; a newer one where it did not
    # (a torch that keeps RNG state per capture) is said after it.
    raised = [(r, rows) for r, rows in fences if not rows[1].startswith("0 of")]
    if raised:
        fence, (fenced, unfenced) = raised[-1]
        newer = fences[-1] if fences[-1][0] is not fence else None
        tail = ("" if newer is None else f"; on torch {newer[0].torch} the repro ran clean without it too, and had "
                f"{newer[1][0]} with it ({link(newer[0], prefix)})")
        lines.append(f"- **pytorch#123177 fixed**: its repro (32 plain threads drawing random inputs around one "
                     f"compiled function) had {fenced} with threadgraph, where {unfenced} without it "
                     f"({fence.machine}, torch {fence.torch}; {link(fence, prefix)}){tail}.")
    measured = [run for run in newest_runs(folder) if run.data.get("ratio") is not None]
    main = matrix_release(measured)
    runs = [run for run in measured if run.torch == main]
    if runs:
        best = max(runs, key=lambda run: run.data["ratio"])
        low, high = min(run.data["ratio"] for run in runs), best.data["ratio"]
        aims = [target_ratio((run.data.get("args") or {}).get("devices"), run.data["env"].get("gpus")) for run in runs]
        aim = " and ".join(f"{a}x on {'one GPU' if a < 1 else 'several GPUs'}" for a in sorted(set(aims)))
        met = [run.data["ratio"] >= a for run, a in zip(runs, aims) if timed_alike(run.data.get("sequential") or {})]
        verdict = ("not judged: none of these runs timed both sides alike" if not met else
                   ("met" if all(met) else "met by some" if any(met) else "not met")
                   + ("" if len(met) == len(runs) else f" by the {len(met)} timed alike"))
        data = best.data
        lines.append(f"- **DFlash trainer, threaded against one thread**: the 5 target + 3 drafter threads train at "
                     f"{low:.2f} - {high:.2f}x the drafter tokens/s of one thread doing the same batches in turn "
                     f"({'; or '.join(sorted({sequential_training(r.data['sequential']) for r in runs}))}), over "
                     f"{len(runs)} runs of {len({r.data['shape'] for r in runs})} target sizes in "
                     f"{len({r.data['graphs'] for r in runs})} graphs modes (best: {_target(data)}, {data['graphs']}, "
                     f"{_num(data.get('tokens_per_s_threaded'))} against {_num(data.get('tokens_per_s_sequential'))}); "
                     f"the aim was {aim}, {verdict} ({data['env'].get('gpu') or 'CPU'}, torch "
                     f"{data['env'].get('torch')}; {link(best, prefix)})" + _other_releases(measured, main, prefix) + ".")
    if not lines:
        return "No results committed yet: run those of `benchmarks/README.md`, then `python -m benchmarks readme`."
    return "\n".join(lines)


def _other_releases(runs: list[Results], main: str, prefix: str) -> str:
    """'; on torch X: ratio at shape graphs (link), ...' for the runs of releases other than ``main``."""
    others = [run for run in runs if run.torch != main]
    return "".join(f"; on torch {run.torch}: {run.data['ratio']:.2f}x at {run.data['shape']} {run.data['graphs']} "
                   f"({link(run, prefix)})" for run in others)


def _repro_rows(results) -> tuple:
    """pytorch#123177's repro in a fence-matrix file: (fenced, unfenced) figures, each None if absent."""
    rows = dict(headlines.fence_matrix(results.data))
    return rows.get("pytorch#123177 repro, fenced"), rows.get("pytorch#123177 repro, unfenced")


def _span(values, fmt: str) -> str:
    low, high = min(values), max(values)
    return fmt.format(low) if fmt.format(low) == fmt.format(high) else f"{fmt.format(low)} - {fmt.format(high)}"


def measured(folder: Path, prefix: str = "") -> str:
    """tau and the embedded default's build time as measured ranges, from the tau reproducibility runs
    (CPU, float32) and the trainer startup runs (GPU, bfloat16), each with what it depends on."""
    lines = []
    repro = schema.newest(folder, "dflash-tau-reproducibility")
    if repro is not None:
        env, builds = repro.data["env"], repro.data["builds"]
        runs = [b["run"] for b in builds if b.get("run")]
        versions = next((b["report"].get("versions", {}) for b in builds if b.get("report")), {})
        python, transformers = versions.get("python") or env.get("python"), versions.get("transformers", "unrecorded")
        where = (f"{env.get('gpu') or 'CPU'} with {env.get('cpus')} CPUs, Python {python}, transformers {transformers}, "
                 f"torch {env.get('torch')}")
        if runs:
            lines.append(f"- tau, drafter trained on the CPU (float32): {_span([r['tau'] for r in runs], '{:.2f}')} over "
                         f"{len(runs)} runs on {len(builds)} fresh builds ({where}; baselines: random-init "
                         f"{_span([r['tau_random_init'] for r in runs], '{:.2f}')}, repeat-last-token "
                         f"{_span([r['tau_repeat_last_token'] for r in runs], '{:.2f}')}; {link(repro, prefix)}).")
        build_s = [b["build_s"] for b in builds if b.get("build_s") is not None]
        if build_s:
            lines.append(f"- building the embedded default (tokenizer, target, data) on the CPU: "
                         f"{_span([s / 60 for s in build_s], '{:.1f}')} min per build over {len(build_s)} builds "
                         f"({where}; {link(repro, prefix)}).")
    startup = schema.newest(folder, "dflash-trainer-startup")
    if startup is not None:
        env = startup.data.get("env", {})
        runs = [run for name, run in schema.trainer_runs_of(startup.data).items() if name]
        where = f"{env.get('gpu') or 'CPU'}, Python {env.get('python')}, torch {env.get('torch')}"
        groups: dict[str, list] = {}
        for run in runs:
            versions = (run.get("target_report") or {}).get("versions")
            built = (f"target built with Python {versions.get('python')}, transformers {versions.get('transformers', 'unrecorded')}"
                     if versions else "target's build unrecorded")
            groups.setdefault(built, []).append(run["eval"]["tau"])
        for built, taus in groups.items():
            lines.append(f"- tau, drafter trained on the GPU (bfloat16): {_span(taus, '{:.2f}')} over {len(taus)} "
                         f"runs ({where}; {built}; {link(startup, prefix)}).")
        build = [run["build_s"] for run in runs if run.get("build_s") is not None]
        if build:
            lines.append(f"- the trainer's build (load, assets) in those GPU runs: {_span(build, '{:.0f}')} s: loading the "
                         f"cached assets, or building them where a run found none (its .md says which run built them; "
                         f"{link(startup, prefix)}).")
    if not lines:
        return "No tau or build-time results committed yet (`python -m benchmarks tau-reproducibility`, `python -m benchmarks trainer-startup`)."
    return "\n".join(lines)


# -- the pages ----------------------------------------------------------------------------------------

def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def seed_projection(folder: Path, prefix: str = "") -> str:
    """docs/projection.md's table (benchmarks/projection.py) from the newest run per shape and mode."""
    runs = newest_runs(folder)
    main = matrix_release(runs)
    return projection.section([r for r in runs if r.torch == main], lambda r: link(r, prefix))


# Each page, relative to the repository root, and its generated sections with what renders them.
PAGES = {
    "README.md": (("readme-headlines", readme_headlines),),
    "docs/results.md": (("results-headlines", other_headlines), ("dflash-table", table), ("dflash-tau", tau_section)),
    "docs/projection.md": (("seed-projection", seed_projection),),
    "examples/dflash_trainer/README.md": (("dflash-measured", measured),),
}


def _replace(text: str, section: str, body: str, page: str) -> str:
    begin, end = markers(section)
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{page} must hold {begin} once, then {end} once")
    head, rest = text.split(begin)
    _, tail = rest.split(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def render_page(page: str, text: str, folder: Path) -> str:
    """``text`` of ``page`` (a key of PAGES) with its generated sections rewritten; links are made
    relative to the page's folder."""
    prefix = "../" * page.count("/")
    for section, body in PAGES[page]:
        text = _replace(text, section, body(folder, prefix), page)
    return text


def write_pages(folder: Path, root: Path, check: bool) -> int:
    stale = []
    for page in PAGES:
        path = root / page
        old = path.read_text()
        new = render_page(page, old, folder)
        if new == old:
            continue
        stale.append(page)
        if not check:
            path.write_text(new)
            print(f"rewrote the generated results of {page}")
    if check and stale:
        print(f"{', '.join(stale)}: the generated results are stale; run python -m benchmarks readme", file=sys.stderr)
        return 1
    if not stale:
        print(f"{', '.join(PAGES)}: the generated results are up to date")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("index", "readme"), help="the results index, or the pages' generated sections")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 when a file differs from a fresh render")
    p.add_argument("--results", type=Path, default=schema.RESULTS, help="the results folder (default: %(default)s)")
    p.add_argument("--root", type=Path, default=ROOT, help="readme: the repository root that holds the pages")
    args = p.parse_args(argv)
    try:
        if args.what == "index":
            return results_index.write(args.results, args.check)
        return write_pages(args.results, args.root, args.check)
    except ResultsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
