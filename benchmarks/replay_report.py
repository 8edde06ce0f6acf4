"""The results of ``replay_step_time.py``: merging with earlier runs, the markdown report, the
plot, and ``--render`` of a results JSON."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from . import common
from . import results_schema
from .replay_work import DFLASH_SIZES, MODES, TASKS

PLACEMENTS = ("main", "worker", "per-gpu", "shared", "procs-per-gpu", "procs-shared")
TASK_TITLES = {"train": "Training step (forward + backward + optimizer)", "infer": "Inference step (forward)"}
CPU_THREADS_NOTE = ("one intra-op thread per process (torch.set_num_threads(1)): OpenMP pools of several threads "
                    "oversubscribe small CPUs and turn contention into 100x outliers")


def merge_previous(path: Path, rows: list[dict]) -> list[dict]:
    """--append / --merge-from: keep the rows of an earlier run that this run did not measure again
    (each row says the date it was measured)."""
    if not path.exists():
        return rows
    try:
        previous = json.loads(path.read_text())
        prev_rows = [dict(r, date=r.get("date", previous["env"]["date"])) for r in previous["rows"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"cannot merge with {path}: not a replay_step_time results JSON ({type(exc).__name__}: {exc})")
    fresh = {(r["task"], r["placement"], r["mode"]) for r in rows}
    fresh_modes = {(r["task"], r["mode"]) for r in rows if r["placement"] == "-"}
    return [r for r in prev_rows
            if (r["task"], r["placement"], r["mode"]) not in fresh and (r["task"], r["mode"]) not in fresh_modes] + rows


def in_order(rows: list[dict]) -> list[dict]:
    """Rows by mode, then placement, as MODES and PLACEMENTS list them (tables and plot alike)."""
    order = {p: i for i, p in enumerate((*PLACEMENTS, "-"))}
    return sorted(rows, key=lambda r: (MODES.index(r["mode"]), order.get(r["placement"], 99)))


def add_ratios(rows: list[dict]) -> None:
    main = {(r["task"], r["mode"]): r.get("p50_ms") for r in rows if r["placement"] == "main"}
    for r in rows:
        ref = main.get((r["task"], r["mode"]))
        r["ratio_vs_main"] = r["p50_ms"] / ref if ref and r.get("p50_ms") else None


COLUMNS = ["configuration", "mode", "workers", "per-thread p50 ms", "p90 ms", "wall ms/step", "aggregate steps/s",
           "ratio vs main-thread same mode", "GPU-busy", "GIL-busy", "note"]


def table_rows(rows: list[dict], task: str) -> list[list]:
    out = []
    for r in rows:
        if r["task"] != task:
            continue
        note = r.get("note") or (f"error: {r['error']}" if r.get("error") else "")
        out.append([r["configuration"], r["mode"], r["workers"], r.get("p50_ms"), r.get("p90_ms"),
                    r.get("wall_ms"), r.get("steps_per_s"), r.get("ratio_vs_main"), r.get("gpu_busy"), r.get("gil_busy"),
                    note.replace("|", "/")])
    return out


def target_lines(rows: list[dict]) -> list[str]:
    """The issue's targets, as numbers next to their thresholds (printed, never asserted)."""
    def get(task, placement, mode, field):
        return next((r.get(field) for r in rows if (r["task"], r["placement"], r["mode"]) == (task, placement, mode)), None)

    lines = []
    for mode in ("reduce-overhead", "whole-step"):
        alone, per_gpu = get("train", "worker", mode, "p50_ms"), get("train", "per-gpu", mode, "p50_ms")
        if alone and per_gpu:
            lines.append(f"- N workers one per GPU / 1 worker alone, per-thread step, {mode}: {per_gpu / alone:.2f}x (target <= 1.05)")
        shared, eager = get("train", "shared", mode, "steps_per_s"), get("train", "shared", "eager", "steps_per_s")
        if shared and eager:
            lines.append(f"- M workers sharing one GPU, aggregate {mode} / eager threads: {shared / eager:.2f}x (target >= 2)")
        for placement in ("main", "worker"):
            for task in TASKS:
                busy = get(task, placement, mode, "gpu_busy")
                if busy is not None:
                    lines.append(f"- GPU-busy, {task}, {placement}, {mode}: {busy:.2f} (target >= 0.9)")
    for mode in MODES:
        for threads_key, procs_key, what in (("per-gpu", "procs-per-gpu", "N threads / N processes one per GPU"),
                                             ("shared", "procs-shared", "M threads / M processes sharing one device")):
            threads, procs = get("train", threads_key, mode, "steps_per_s"), get("train", procs_key, mode, "steps_per_s")
            if threads and procs:
                lines.append(f"- (no target) {what}, aggregate, {mode}: {threads / procs:.2f}x")
    return lines or ["- n/a: the targets are about CUDA graphs on GPUs; this run has none of the rows they need"]


def report(args, env: dict, rows: list[dict], interrupted: bool = False) -> str:
    form = "GPU" if env["gpu"] else "CPU reduced form (smaller model; says nothing about CUDA graphs)"
    model = {"small": f"{common.DEPTH} x [Linear {common.WIDTH}, GELU, LayerNorm], batch {common.BATCH}, bf16"
             if env["gpu"] else f"{common.CPU_DEPTH} x [Linear {common.CPU_WIDTH}, GELU, LayerNorm], batch {common.BATCH}, float32",
             "dflash": f"DFlash drafter step, {DFLASH_SIZES['cuda' if env['gpu'] else 'cpu']}"}[args.model]
    timing = "CUDA events" if env["gpu"] else "perf_counter"
    lines = [f"# Replay step time: {form}", "", *common.header_lines(env), f"- model: {model}",
             f"- {args.steps} timed steps per thread after {args.warmup} warmup steps (compile and capture are in the "
             f"warmup and excluded); per-thread p50/p90 by {timing} around each step; wall ms/step = the thread's timed "
             "window / its steps (CUDA events give the GPU-side span of a step, which hides host time when the GPU "
             "queue is backed up); aggregate = all timed steps / (last end - first start); GPU-busy = GPU activity / "
             f"wall time over {args.profile_steps} further steps under torch.profiler (main thread and 1 worker only)",
             *([] if env["gpu"] else [f"- {CPU_THREADS_NOTE}"]),
             *(["- merged with earlier runs (--append, --merge-from): each row's date and settings are in the JSON"]
               if args.append or getattr(args, "merge_from", None) else []),
             *(["- **interrupted**: only the cells listed were measured; the rest of the run never happened"]
               if interrupted else []), *unmeasured_lines(rows), ""]
    for task in present_tasks(rows):
        lines += [f"## {TASK_TITLES[task]}", "", common.markdown_table(COLUMNS, table_rows(rows, task)), ""]
    lines += ["## Targets", "", *target_lines(rows), "", *gil_lines(rows)]
    return "\n".join(lines)


def unmeasured_lines(rows: list[dict]) -> list[str]:
    """Cells of the run's grid (its tasks x modes x placements) that have no row: a run cut short."""
    out = []
    for task in present_tasks(rows):
        ran = [r for r in rows if r["task"] == task and r["placement"] != "-"]
        labels = {r["placement"]: r["configuration"] for r in ran}
        have = {(r["mode"], r["placement"]) for r in ran}
        missing = [f"{mode} / {labels[key]}" for mode in MODES if any(m == mode for m, _ in have)
                   for key in labels if (mode, key) not in have]
        if missing:
            out.append(f"- not measured ({task}): " + "; ".join(missing))
    return out


def gil_lines(rows: list[dict]) -> list[str]:
    """--gil-profile: what held the GIL in each profiled cell."""
    profiled = [r for r in rows if r.get("gil_leaves")]
    if not profiled:
        return []
    lines = ["## Where the GIL goes (py-spy --gil, thread placements)", ""]
    for r in profiled:
        lines += [f"### {r['task']}, {r['mode']}, {r['configuration']}: GIL busy {common.fmt(r['gil_busy'])} "
                  f"({r['gil_samples']} samples in {r['gil_ticks']} ticks)", "",
                  common.markdown_table(["innermost frame holding the GIL", "share"],
                                        [[frame, f"{100 * share:.1f}%"] for frame, share in r["gil_leaves"]]), "",
                  "By file: " + ", ".join(f"{name} {100 * share:.0f}%" for name, share in r["gil_files"]), ""]
    return lines


def present_tasks(rows: list[dict]) -> list[str]:
    return [t for t in TASKS if any(r["task"] == t for r in rows)]


def plot_groups(rows: list[dict], tasks: list[str]) -> dict:
    groups: dict = {TASK_TITLES[t]: {} for t in tasks}
    for r in rows:
        if r.get("p50_ms") is not None:
            groups[TASK_TITLES[r["task"]]].setdefault(r["configuration"], {})[r["mode"]] = r["p50_ms"]
    return groups


def write_results(args, env: dict, rows: list[dict], started: float, interrupted: bool) -> None:
    out = common.results_dir(args.out_dir)
    stem = common.results_stem(env, "replay-" + args.model + ("-gil" if args.gil_profile else ""))
    rows = [dict(r, date=env["date"]) for r in rows]
    if args.merge_from or args.append:
        rows = merge_previous(Path(args.merge_from) if args.merge_from else out / f"{stem}.json", rows)
    rows = in_order(rows)
    add_ratios(rows)
    results_schema.write(out / f"{stem}.json", {"benchmark": "replay_step_time", "env": env, "args": vars(args),
                                             "seconds": round(time.perf_counter() - started, 1),
                                             "interrupted": interrupted, "rows": rows})
    print(write_views(out / stem, args, env, rows, interrupted))
    print(f"\nwrote {out / stem}.{{json,md,png}}", file=sys.stderr)


def write_views(stem: Path, args, env: dict, rows: list[dict], interrupted: bool) -> str:
    """The markdown report and the plot beside a results JSON; returns the report."""
    text = report(args, env, rows, interrupted)
    Path(f"{stem}.md").write_text(results_schema.neutral(text))
    common.bar_plot(Path(f"{stem}.png"), plot_groups(rows, present_tasks(rows)),
                    f"per-thread step time, {env['gpu'] or 'CPU reduced form'}, torch {env['torch']}")
    return text


def render(path: Path) -> None:
    """--render: the views of a results JSON again (after a change to the report)."""
    try:
        data = json.loads(path.read_text())
        args, env, rows = argparse.Namespace(**data["args"]), data["env"], data["rows"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"--render {path}: not a replay_step_time results JSON ({type(exc).__name__}: {exc})")
    stem = path.parent / path.name.removesuffix(".json")
    write_views(stem, args, env, in_order(rows), data.get("interrupted", False))
    print(f"wrote {stem}.{{md,png}}", file=sys.stderr)
