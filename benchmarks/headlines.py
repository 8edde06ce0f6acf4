"""The headline figures of each results theme: ``(configuration, figure)`` pairs, one sentence
each, that the results index, docs/results.md and the README quote (render.py). JSON only, no torch."""

from __future__ import annotations

import re
from typing import Optional

from .results_schema import (AS_THREADED, above_gpu_bound, family, ratio_withheld, startup_comparable, timed_alike,
                             trainer_runs_of)

MODE_NAMES = {"reduce-overhead": "Trees", "trees": "Trees"}  # other modes by their own name
RESTART = "on the threaded cell's cache"  # how a sequential startup that is not a first run's is labelled


# -- one extractor per theme: (configuration, figure) pairs -----------------------------------------

def device_word(data: dict) -> str:
    """'GPU' for a run on a GPU, 'CPU' for a CPU run: what its placements are named by."""
    return "GPU" if (data.get("env") or {}).get("gpu") else "CPU"


def replay(data: dict) -> list:
    """Per-thread p50 of one worker; two workers one per GPU against it (the scaling target), with
    the steps/s of both and of two processes; M workers sharing one device, in steps/s."""
    rows = {(r["task"], r["placement"], r["mode"]): r for r in data["rows"] if r.get("p50_ms") is not None}
    device = device_word(data)
    out = []
    for (task, placement, mode), row in rows.items():
        if placement != "worker":
            continue
        figure = f"1 worker thread {row['p50_ms']:.2f} ms"
        per_gpu, procs, shared = (rows.get((task, p, mode)) for p in ("per-gpu", "procs-per-gpu", "shared"))
        if per_gpu is not None:
            figure += (f"; {per_gpu['workers']} workers one per {device} {per_gpu['p50_ms']:.2f} ms ({per_gpu['p50_ms'] / row['p50_ms']:.2f}x alone; "
                       f"{per_gpu['steps_per_s']:.0f} steps/s together, {row['steps_per_s']:.0f} alone)")
        if procs is not None:
            figure += f"; {procs['workers']} processes one per {device} {procs['steps_per_s']:.0f} steps/s"
        if shared is not None:
            figure += f"; {shared['workers']} workers on one {device} {shared['steps_per_s']:.0f} steps/s"
        if row.get("gil_busy") is not None:
            figure += f"; GIL busy {float(row['gil_busy']):.0%}"
        out.append((f"{task}, {MODE_NAMES.get(mode, mode)}", figure))
    return out


def dflash_throughput(data: dict) -> list:
    mode = data["sequential"].get("mode", data["args"].get("cuda_graphs"))
    devices = len(data["sequential"].get("devices", [])) or 1
    # the rule applies to every file, also those written before it: the JSON keeps its figures
    withheld = ratio_withheld(data["threaded"], data["sequential"])
    device, ratio = device_word(data), "-" if data["ratio"] is None or withheld else f"{data['ratio']:.2f}"
    figure = (f"threaded {_kilo(data['threaded'].get('tokens_per_s'))} tokens/s, sequential "
              f"{_kilo(data['sequential'].get('tokens_per_s'))}: {ratio}x")
    if withheld:
        figure += f" ({withheld})"
    caveats = [*([] if data["sequential"].get("training") == AS_THREADED else ["a sequential loop of more optimizer work"]),
               *([] if timed_alike(data["sequential"]) else ["the two sides not timed alike"])]
    if caveats:
        figure += f" ({', '.join(caveats)})"
    if data.get("gpu_bound_tokens_per_s"):
        figure += f"; GPU-bound limit {data['gpu_bound_tokens_per_s'] / 1e3:.0f}k"
    above = above_gpu_bound(data)
    if above:
        figure += ("; IMPOSSIBLE: " + ", ".join(f"{name} {share:.2f}x" for name, share in above.items())
                   + " the GPU-bound limit, a measurement error (no pipeline outruns its devices' kernels)")
    if data.get("startup_s_threaded") and data.get("startup_s_sequential"):
        figure += (f"; startup {data['startup_s_threaded']:.0f} s threaded, {data['startup_s_sequential']:.0f} s sequential"
                   + ("" if startup_comparable(data["sequential"]) else f" ({RESTART})"))
    target = f"{data['shape']} target, " if "shape" in data else ""
    return [(f"{target}{MODE_NAMES.get(mode, mode)}, {devices} {device}{'s' if devices > 1 else ''}", figure)]


def _kilo(value) -> str:
    """Thousands, as the headlines give tokens/s; '-' for a figure a failed cell left out."""
    return "-" if value is None else f"{value / 1e3:.0f}k"


def tau_reproducibility(data: dict) -> list:
    tau = data["tau"]
    same = "bit-identical" if data["bit_identical"] else f"differing in {len(data['differing_files'])} files"
    return [(f"{len(data['builds'])} fresh builds of the embedded default",
             f"{same}; tau {tau['min']:.3f} - {tau['max']:.3f} over {tau['runs']} trainer runs")]


def _trainer_run(name: str, run: dict) -> tuple:
    gpus = len(set(re.findall(r"cuda:\d+", run["placement"])))
    base = run["baseline"]
    where = f"{gpus} GPU{'s' if gpus > 1 else ''}" if gpus else "CPU"
    build = f" ({run['build_s']:.0f} s of it the build: load, assets)" if run.get("build_s") is not None else ""
    startup = "" if run.get("startup_s") is None else f"; startup {run['startup_s']:.0f} s{build}"
    return (f"{name}{MODE_NAMES.get(run['mode'], run['mode'])}, {run['total_steps']} steps, {where}",
            f"tau {run['eval']['tau']:.2f} (random init {base['tau_random_init']:.2f}, repeat last token "
            f"{base['tau_repeat_last_token']:.2f}); {_kilo(run.get('tokens_per_s_steady'))} tokens/s{startup}")


def dflash_trainer(data: dict) -> list:
    """A trainer's --json output, or several runs under names (plus resume comparisons)."""
    out = [_trainer_run(f"{name}: " if name else "", run) for name, run in trainer_runs_of(data).items()]
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
    """The repro's runs and the matrix's cells; a run or cell whose process printed no result
    (``rc`` non-zero, no figures) counts as neither clean nor silent."""
    def clean(run):
        return not run.get("errors") and run.get("threads") is not None and run.get("finished") == run["threads"] \
            and bool(run.get("all_equal"))

    def erred(cell):
        return "ops_stats" not in cell or cell.get("group_error") is not None \
            or any(s["errors"] for s in cell["ops_stats"].values())

    out = []
    repro = data["repro"]
    out.append(("pytorch#123177 repro, fenced", f"{sum(map(clean, repro['fenced']))} of {len(repro['fenced'])} runs clean"))
    out.append(("pytorch#123177 repro, unfenced", f"{sum(bool(r.get('errors')) for r in repro['unfenced'])} of "
                f"{len(repro['unfenced'])} runs raised"))
    for variant in ("fenced", "unfenced"):
        cells = [c for c in data["cells"] if fence_variant(c) == variant]
        out.append((f"eager ops beside captures, {variant}", f"{sum(map(erred, cells))} of {len(cells)} cells raised"))
    return out


def fence_variant(cell: dict) -> str:
    """A fence scenario's variant: its result's, else its arguments' (a run that printed no result)."""
    return cell.get("variant") or option(cell.get("args", []), "--variant", "fenced")


def option(args: list, name: str, default: str) -> str:
    """A scenario's option from its arguments."""
    return args[args.index(name) + 1] if name in args else default


def fence_overhead(data: dict) -> list:
    return [(f"{r['task']}, {r['workers']} worker{'s' if r['workers'] > 1 else ''}",
             f"fenced / unfenced {r['ratio_fenced_over_unfenced']:.2f} ({r['fenced_p50_ms']:.2f} / {r['unfenced_p50_ms']:.2f} ms)")
            for r in data["rows"]]


def install_overhead(data: dict) -> list:
    return [(f"{task}, main thread, CUDAGraph Trees",
             f"install() / plain {r['ratio']:.3f} ({r['installed_p50_ms']:.3f} / {r['plain_p50_ms']:.3f} ms)")
            for task, r in data["summary"].items()]


def call_overhead(data: dict) -> list:
    rows = {r["variant"]: r for r in data["rows"]}
    every, none = rows["all"], rows["none"]
    return [("tiny compiled function, CPU, main thread",
             f"install() / none {every['ratio_to_none']:.3f}, {every['over_none_us']:+.2f} us per call "
             f"({every['per_call_us']:.2f} / {none['per_call_us']:.2f} us)")]


def regenerate_throughput(data: dict) -> list:
    """The fastest cell of each decoding path, and transformers' generate_batch() beside them."""
    where = "CPU" if not data["env"].get("gpu") else data["env"]["gpu"]
    best: dict = {}
    for row in data["rows"]:
        if row.get("steady_tokens_per_s") and row["steady_tokens_per_s"] > best.get(row["decode"], {}).get(
                "steady_tokens_per_s", 0):
            best[row["decode"]] = row
    found = []
    for decode, row in sorted(best.items(), key=lambda item: -item[1]["steady_tokens_per_s"]):
        figure = (f"{row['steady_tokens_per_s']:,.0f} generated tokens/s steady, {row['fraction_of_bound']:.0%} of the "
                  f"memory-bandwidth bound ({row['bound_tokens_per_s']:,.0f}); startup {row['startup_s']:.0f} s")
        if "above_bound" in row:
            figure += " (ABOVE the bound: a measurement error)"
        if data.get("notes"):
            figure += " (see the file's notes)"
        found.append((f"regeneration, {data['shape']} shape, {decode}, {row['threads']} thread(s) x batch "
                      f"{row['batch']}, {where}", figure))
    failed = [f"{r['decode']}:{r['threads']}:{r['batch']}" for r in data["rows"] if "error" in r]
    if failed:
        found.append((f"regeneration, {data['shape']} shape, {where}", f"cells that failed: {', '.join(failed)}"))
    return found


def conformance(data: dict) -> list:
    differing = [row["case"] for row in data["rows"] if not row["equal"]]
    figure = f"{data['equal']} of {data['cases']} cases observe the same in all {len(data['placements'])} placements"
    return [(" / ".join(data["placements"]), figure + (f"; differ: {', '.join(differing)}" if differing else ""))]


def scenario_headline(scenario: str, result: dict) -> Optional[tuple]:
    """The headline of a run of tests/helpers/gpu_scenarios.py (its record's tag) or None: 8 training workers
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
    """The headline scenarios, each from the last phase that ran it (phases are in the order they ran)."""
    latest = {scenario: (label, result) for label, phase in data.items() for scenario, result in phase.items()}
    rows = [(label, scenario_headline(scenario, result)) for scenario, (label, result) in latest.items()]
    return [(f"{row[0]} ({label.split(' ')[0]})", row[1]) for label, row in rows if row is not None]


def dflash_loss_memory(data: dict) -> list:
    """The drafter loss's peak memory, dense and chunked, and the step estimate against its measured peak."""
    rows = [(f"DFlash drafter loss, vocabulary {data['vocab']:,}, {data.get('tokens', '?')} outputs, CPU",
             f"peak chunked {data['chunked_peak_bytes'] / 2**20:.0f} MiB, dense {data['dense_peak_bytes'] / 2**20:.0f} MiB "
             f"({data['chunked_peak_bytes'] / data['dense_peak_bytes']:.3f} of dense)")]
    if "step" in data:
        rows.append(("DFlash drafter step, the trainer's memory estimate",
                     f"{data['step']['estimate_over_measured']:.3f} of the measured peak"))
    return rows


EXTRACTORS = {"replay": replay, "dflash-throughput": dflash_throughput, "dflash-trainer": dflash_trainer,
              "gil-profile": gil_profile, "fence-matrix": fence_matrix, "fence-overhead": fence_overhead,
              "gpu-scenarios": gpu_scenarios, "dflash-tau-reproducibility": tau_reproducibility,
              "install-overhead": install_overhead, "call-overhead": call_overhead, "conformance": conformance,
              "dflash-loss-memory": dflash_loss_memory, "regenerate-throughput": regenerate_throughput}


def extractor(theme: str):
    """The extractor of a theme's family (results_schema.family: ``replay-dflash-gil`` is a replay file)."""
    return EXTRACTORS[family(theme)]
