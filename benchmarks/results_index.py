"""Write benchmarks/results/README.md: one row per headline of every results JSON, latest first.

    python -m benchmarks index            # rewrite the index from benchmarks/results/*.json
    python -m benchmarks index --check    # exit 1 when the index is stale or a name breaks the rule

Every file in the folder must be named `<theme>_<gpu-or-cpu>_torch<version>_<YYYY-MM-DD>.<ext>`
(common.results_stem); the theme picks the headline extractor below.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Optional

from dflash_results import RESTART, startup_comparable

RESULTS = Path(__file__).resolve().parent / "results"
INDEX = "README.md"
NAME = re.compile(r"^(?P<theme>[a-z0-9.-]+)_(?P<hardware>[a-z0-9-]+)_torch(?P<torch>\d[\w.]*)_"
                  r"(?P<date>\d{4}-\d{2}-\d{2})\.(?P<ext>json|md|png)$")
MODE_NAMES = {"reduce-overhead": "Trees", "trees": "Trees", "whole-step": "whole-step", "eager": "eager",
              "compile": "compile"}


def recency(file_name: str) -> tuple:
    """Sort key of a results file, newest last: its date, then a GPU's run before a CPU's of that
    date, then the torch version (as numbers: 2.11 after 2.9), then the name."""
    name = NAME.match(file_name)
    if name is None:
        return "", False, (), file_name
    version = tuple(int(part) for part in re.findall(r"\d+", name["torch"])[:3])
    return name["date"], name["hardware"] != "cpu", version, file_name


# -- one extractor per theme: (configuration, figure) pairs -----------------------------------------

def replay(data: dict) -> list:
    """Per-thread p50 of one worker; two workers one per GPU against it (the scaling target), with
    the steps/s of both and of two processes; three workers sharing one GPU, in steps/s."""
    rows = {(r["task"], r["placement"], r["mode"]): r for r in data["rows"] if r.get("p50_ms") is not None}
    out = []
    for (task, placement, mode), row in rows.items():
        if placement != "worker":
            continue
        figure = f"1 worker thread {row['p50_ms']:.2f} ms"
        per_gpu, procs, shared = (rows.get((task, p, mode)) for p in ("per-gpu", "procs-per-gpu", "shared"))
        if per_gpu is not None:
            figure += (f"; 2 workers one per GPU {per_gpu['p50_ms']:.2f} ms ({per_gpu['p50_ms'] / row['p50_ms']:.2f}x alone; "
                       f"{per_gpu['steps_per_s']:.0f} steps/s together, {row['steps_per_s']:.0f} alone)")
        if procs is not None:
            figure += f"; 2 processes one per GPU {procs['steps_per_s']:.0f} steps/s"
        if shared is not None:
            figure += f"; {shared['workers']} workers on one GPU {shared['steps_per_s']:.0f} steps/s"
        if row.get("gil_busy") is not None:
            figure += f"; GIL busy {float(row['gil_busy']):.0%}"
        out.append((f"{task}, {MODE_NAMES.get(mode, mode)}", figure))
    return out


def dflash_throughput(data: dict) -> list:
    mode = data["sequential"].get("mode", data["args"].get("cuda_graphs"))
    gpus = len(data["sequential"].get("devices", [])) or 1
    figure = (f"threaded {data['threaded']['tokens_per_s'] / 1e3:.0f}k tokens/s, sequential "
              f"{data['sequential']['tokens_per_s'] / 1e3:.0f}k: {data['ratio']:.2f}x")
    if data.get("gpu_bound_tokens_per_s"):
        figure += f"; GPU-bound limit {data['gpu_bound_tokens_per_s'] / 1e3:.0f}k"
    if data.get("startup_s_threaded") and data.get("startup_s_sequential"):
        figure += (f"; startup {data['startup_s_threaded']:.0f} s threaded, {data['startup_s_sequential']:.0f} s sequential"
                   + ("" if startup_comparable(data["sequential"]) else f" ({RESTART})"))
    target = f"{data['shape']} target, " if "shape" in data else ""
    return [(f"{target}{MODE_NAMES.get(mode, mode)}, {gpus} GPU{'s' if gpus > 1 else ''}", figure)]


def dflash_ab(data: dict) -> list:
    """One row per tree: the range of its runs, taken in turns with the other trees on one machine."""
    mode = MODE_NAMES.get(data["graphs"], data["graphs"])

    def span(t, key, scale, fmt):
        lo, hi = (format(t[f"{key}_{end}"] / scale, fmt) for end in ("min", "max"))
        return lo if lo == hi else f"{lo} - {hi}"

    return [(f"{data['shape']} target, {mode}: tree {name}, {t['runs']} run{'s' if t['runs'] > 1 else ''}",
             f"threaded {span(t, 'tokens_per_s_threaded', 1e3, '.0f')}k tokens/s, sequential "
             f"{span(t, 'tokens_per_s_sequential', 1e3, '.0f')}k; sequential host {span(t, 'host_gil_ms_per_batch', 1, '.2f')} ms/batch")
            for name, t in data["trees"].items()]


def tau_reproducibility(data: dict) -> list:
    tau = data["tau"]
    same = "bit-identical" if data["bit_identical"] else f"differing in {len(data['differing_files'])} files"
    return [(f"{len(data['builds'])} fresh builds of the embedded default",
             f"{same}; tau {tau['min']:.3f} - {tau['max']:.3f} over {tau['runs']} trainer runs")]


def _trainer_run(name: str, run: dict) -> tuple:
    gpus = len(set(re.findall(r"cuda:\d+", run["placement"])))
    base = run["baseline"]
    return (f"{name}{MODE_NAMES.get(run['mode'], run['mode'])}, {run['total_steps']} steps, {gpus} GPU{'s' if gpus > 1 else ''}",
            f"tau {run['eval']['tau']:.2f} (random init {base['tau_random_init']:.2f}, repeat last token "
            f"{base['tau_repeat_last_token']:.2f}); {run['tokens_per_s_steady'] / 1e3:.0f}k tokens/s"
            + _startup(run))


def _startup(run: dict) -> str:
    if run.get("startup_s") is None:
        return ""
    build = f" ({run['build_s']:.0f} s of it the build: load, assets)" if run.get("build_s") is not None else ""
    return f"; startup {run['startup_s']:.0f} s{build}"


def dflash_trainer(data: dict) -> list:
    """A trainer's --json output, or several runs under names (plus resume comparisons)."""
    if "losses" in data:
        return [_trainer_run("", data)]
    out = [_trainer_run(f"{name}: ", run) for name, run in data.items() if isinstance(run, dict) and "eval" in run]
    for name, pair in data.get("resume", {}).items():
        full, rest = pair.get("uninterrupted"), pair.get("resumed_from_50")
        if full and rest:
            gap = max(abs(a - b) for a, b in zip(full[len(full) - len(rest):], rest))
            out.append((f"resumed from step 50 ({name})", f"max loss difference {gap:.4f}"))
    return out


def gil_profile(data: dict) -> list:
    mode = data["args"].get("cuda_graphs") or "reduce-overhead"
    return [(f"{MODE_NAMES.get(mode, mode)}, {data['args']['devices']}",
             f"GIL busy {data['gil_busy']:.0%}; {data['tokens_per_s_steady'] / 1e3:.0f}k tokens/s")]


def fence_matrix(data: dict) -> list:
    def clean(run):
        return not run["errors"] and run["finished"] == run["threads"] and run["all_equal"]

    def erred(cell):
        return cell["group_error"] is not None or any(s["errors"] for s in cell["ops_stats"].values())

    out = []
    repro = data["repro"]
    out.append(("pytorch#123177 repro, fenced", f"{sum(map(clean, repro['fenced']))} of {len(repro['fenced'])} runs clean"))
    out.append(("pytorch#123177 repro, unfenced", f"{sum(bool(r['errors']) for r in repro['unfenced'])} of "
                f"{len(repro['unfenced'])} runs raised"))
    for variant in ("fenced", "unfenced"):
        cells = [c for c in data["cells"] if c["variant"] == variant]
        out.append((f"eager ops beside captures, {variant}", f"{sum(map(erred, cells))} of {len(cells)} cells raised"))
    return out


def fence_overhead(data: dict) -> list:
    return [(f"{r['task']}, {r['workers']} worker{'s' if r['workers'] > 1 else ''}",
             f"fenced / unfenced {r['ratio_fenced_over_unfenced']:.2f} ({r['fenced_p50_ms']:.2f} / {r['unfenced_p50_ms']:.2f} ms)")
            for r in data["rows"]]


def install_overhead(data: dict) -> list:
    return [(f"{task}, main thread, CUDAGraph Trees",
             f"install() / plain {r['ratio']:.3f} ({r['installed_p50_ms']:.3f} / {r['plain_p50_ms']:.3f} ms)")
            for task, r in data["summary"].items()]


def conformance(data: dict) -> list:
    differing = [row["case"] for row in data["rows"] if not row["equal"]]
    figure = f"{data['equal']} of {data['cases']} cases observe the same in all {len(data['placements'])} placements"
    return [(" / ".join(data["placements"]), figure + (f"; differ: {', '.join(differing)}" if differing else ""))]


def scenario_headline(scenario: str, result: dict) -> Optional[tuple]:
    """The headline of a run of tests/gpu_scenarios.py (its record's tag) or None: 8 training workers
    on one GPU, or one worker's step by mode; a run that failed says so."""
    many = re.fullmatch(r"many_workers_8_steps_(\d+)", scenario)
    if many:
        config = f"8 training workers on one GPU, {many[1]} steps"
        if "error" in result:
            return config, f"failed: {result['error']}"
        return (config, f"{result['together_steps_per_s']:.0f} steps/s against {result['eager_steps_per_s']:.0f} for eager "
                        f"threads; {sum(result['losses_allclose'])} of 8 equal to alone")
    if re.fullmatch(r"whole_step_steps_\d+", scenario):
        if "error" in result:
            return "one worker, step p50", f"failed: {result['error']}"
        figure = " / ".join(f"{MODE_NAMES.get(m, m)} {ms:.2f} ms" for m, ms in result["p50_ms"].items())
        if result.get("floor_ms") is not None:
            figure += f"; hand-captured floor {result['floor_ms']:.2f} ms"
        return "one worker, step p50", figure
    return None


def gpu_scenarios(data: dict) -> list:
    """Each phase's run of the headline scenarios (a phase is one device call, named by its label)."""
    out = []
    for label, phase in data.items():
        for scenario, result in phase.items():
            row = scenario_headline(scenario, result)
            if row is not None:
                out.append((f"{row[0]} ({label.split(' ')[0]})", row[1]))
    return out


def gpu_scenarios_latest(data: dict) -> list:
    """The headline scenarios, each from the last phase that ran it (phases are in the order they ran)."""
    latest = {scenario: (label, result) for label, phase in data.items() for scenario, result in phase.items()}
    rows = [(label, scenario_headline(scenario, result)) for scenario, (label, result) in latest.items()]
    return [(f"{row[0]} ({label.split(' ')[0]})", row[1]) for label, row in rows if row is not None]


EXTRACTORS = {"replay": replay, "dflash-throughput": dflash_throughput, "dflash-ab": dflash_ab, "dflash-trainer": dflash_trainer,
              "gil-profile": gil_profile, "fence-matrix": fence_matrix, "fence-overhead": fence_overhead,
              "gpu-scenarios": gpu_scenarios, "dflash-tau-reproducibility": tau_reproducibility,
              "install-overhead": install_overhead, "conformance": conformance}


def extractor(theme: str):
    """Longest prefix wins: `replay-dflash-gil` is a replay file, `dflash-throughput-0.6b-trees` a throughput one."""
    for prefix in sorted(EXTRACTORS, key=len, reverse=True):
        if theme == prefix or theme.startswith(prefix + "-"):
            return EXTRACTORS[prefix]
    raise ValueError(f"no headline extractor for theme {theme!r}: add one to benchmarks/results_index.py")


# -- the index ------------------------------------------------------------------------------------

def misnamed(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir() if p.name != INDEX and not NAME.match(p.name))


def render(folder: Path) -> str:
    rows = []
    for path in folder.glob("*.json"):
        name = NAME.match(path.name)
        if name is None:
            continue  # reported by misnamed()
        for configuration, figure in extractor(name["theme"])(json.loads(path.read_text())):
            rows.append((name["date"], name["theme"], configuration, figure, name["hardware"], name["torch"], path.name))
    # latest first; within a date by theme and file, each file's rows in its extractor's order
    rows.sort(key=lambda r: (r[1], r[6]))
    rows.sort(key=lambda r: r[0], reverse=True)
    lines = ["# Benchmark results", "",
             "Generated by `python -m benchmarks index` from the JSON in this folder (do not edit;",
             "`--check` fails when it is stale). One row per headline, latest first; the file's `.md` has the",
             "full report. Older runs are in git history.", "",
             "| date | benchmark | configuration | figure | GPU | torch | file |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {date} | {theme} | {config} | {figure} | {gpu} | {torch} | `{file}` |"
              for date, theme, config, figure, gpu, torch, file in rows]
    reports = sorted((p for p in folder.glob("*.md") if p.name != INDEX and not p.with_suffix(".json").exists()),
                     key=lambda p: (NAME.match(p.name)["date"], p.name), reverse=True)
    if reports:  # notes written by hand about several runs: nothing to extract, still worth finding
        lines += ["", "Reports without a JSON of their own: " + ", ".join(f"`{p.name}`" for p in reports) + "."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the index differs from a fresh one")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the results folder (default: %(default)s)")
    args = parser.parse_args(argv)
    bad = misnamed(args.results)
    if bad:
        print("not named <theme>_<gpu-or-cpu>_torch<version>_<YYYY-MM-DD>.{json,md,png}: " + ", ".join(bad), file=sys.stderr)
        return 1
    text, index = render(args.results), args.results / INDEX
    if args.check:
        if not index.exists() or index.read_text() != text:
            print(f"{index} is stale: run python -m benchmarks index", file=sys.stderr)
            return 1
        return 0
    index.write_text(text)
    print(f"wrote {index}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
