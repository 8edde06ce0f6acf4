"""The report of ``dflash_throughput.py``: the headline figures computed from its cells, and the
markdown that presents them (both go into the results JSON / .md; ``render.py`` reads the JSON)."""

from __future__ import annotations

from typing import Optional

from . import common
from .headlines import RESTART, target_ratio
from .results_schema import EMPTY, inductor_cache, sequential_training, startup_comparable, timed_alike
from examples.dflash_trainer.run.metrics import LOG_EVERY, format_phases


def headline(cfg, threaded: dict, sequential: dict, on_gpu: bool, processes: Optional[dict] = None,
             estimate: Optional[dict] = None) -> dict:
    """The figures the DFlash table of docs/results.md shows, from both cells.

    GPU-bound limit: the tokens/s the devices would give if their kernels ran back to back: batch x
    seq_len per batch over the GPU time of a batch (sequential loop, under torch.profiler): the
    busiest device's kernel time a round over the round's batches (a file whose sequential cell
    trained one batch a device a round: that time, the limit then times the devices). GIL: the sequential loop's host time per batch (perf_counter
    around one batch's Python work, the device synchronised before and after), and the number of GPUs
    one process could feed before that host time fills the GIL: GPU ms per batch / host ms per batch.
    Memory: each cell's peak on its busiest device, and the trainer's estimate for the threaded run."""
    batch_tokens = cfg.batch_size * cfg.seq_len
    per_round = sequential.get("gpu_ms_per_round_by_device") or {}
    if per_round:  # a round: one batch a drafter, spread over the devices as the threads' are
        gpu_ms_per_batch, parallel = max(per_round.values()) / sequential["batches_per_round"], 1
    else:  # a sequential cell of one batch a device a round
        per_batch = sequential.get("gpu_ms_per_batch_by_device") or {}
        gpu_ms_per_batch = max(per_batch.values()) if per_batch else None
        parallel = len(sequential.get("devices") or [None])
    out = {"tokens_per_s_threaded": threaded.get("tokens_per_s"),
           "tokens_per_s_sequential": sequential.get("tokens_per_s"),
           "tokens_per_s_last_window_threaded": threaded.get("tokens_per_s_last_window"),
           "startup_s_threaded": threaded.get("startup_s"), "startup_s_sequential": sequential.get("startup_s"),
           "host_gil_ms_per_batch": sequential.get("host_ms_per_batch"),
           "gpu_ms_per_batch": gpu_ms_per_batch}
    for name, cell in (("threaded", threaded), ("sequential", sequential)):
        peaks = cell.get("peak_memory_gib") or {}
        out[f"peak_memory_gib_{name}"] = max(peaks.values()) if peaks else None
    out["memory_estimate_gib"] = sum(estimate.values()) if estimate else None
    out["ratio"] = _div(out["tokens_per_s_threaded"], out["tokens_per_s_sequential"])
    out["startup_ratio"] = (_div(out["startup_s_threaded"], out["startup_s_sequential"])
                            if startup_comparable(sequential) else None)
    if out["gpu_ms_per_batch"]:
        out["gpu_bound_tokens_per_s"] = parallel * batch_tokens / (out["gpu_ms_per_batch"] / 1000)
        out["gpu_bound_reason"] = None
    else:
        out["gpu_bound_tokens_per_s"] = None
        out["gpu_bound_reason"] = ("no CUDA: the GPU-bound limit needs the GPU kernel time of a batch" if not on_gpu
                                   else "the sequential cell measured no GPU kernel time (it failed, or ran too few rounds)")
    out["ratio_threaded_to_gpu_bound"] = _div(out["tokens_per_s_threaded"], out["gpu_bound_tokens_per_s"])
    out["ratio_sequential_to_gpu_bound"] = _div(out["tokens_per_s_sequential"], out["gpu_bound_tokens_per_s"])
    out["projected_gpus_per_process"] = _div(out["gpu_ms_per_batch"], out["host_gil_ms_per_batch"])
    if processes is not None:  # --processes: one process per device (dflash_processes.py)
        out["tokens_per_s_processes"] = processes.get("tokens_per_s")
        out["startup_s_processes"] = processes.get("startup_s")
        out["ratio_threaded_to_processes"] = _div(out["tokens_per_s_threaded"], out["tokens_per_s_processes"])
        out["ratio_processes_to_gpu_bound"] = _div(out["tokens_per_s_processes"], out["gpu_bound_tokens_per_s"])
    return out


def _div(a, b):
    return a / b if a is not None and b else None


def report(env: dict, cfg, shape: str, threaded: dict, sequential: dict, figures: dict,
           processes: Optional[dict] = None, estimate: Optional[dict] = None) -> str:
    drafter_p50 = [w["p50_ms"] for name, w in threaded.get("workers", {}).items() if name.startswith("drafter") and w["p50_ms"]]
    target_p50 = [w["p50_ms"] for name, w in threaded.get("workers", {}).items() if name.startswith("target") and w["p50_ms"]]
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    form = "GPU" if env["gpu"] else "CPU reduced form (tiny sizes; says nothing about CUDA graphs)"
    columns = ["pipeline", "threads", "tokens/s (steady)", "tokens/s (last window)", "startup s", "drafter step p50 ms",
               "target forward p50 ms", "mode", "note"]
    rows = [
        [f"threaded {cfg.targets} + {cfg.drafters}", cfg.targets + cfg.drafters, threaded.get("tokens_per_s"),
         threaded.get("tokens_per_s_last_window"), threaded.get("startup_s"), mean(drafter_p50), mean(target_p50),
         threaded.get("mode"), f"error: {threaded['error']}" if "error" in threaded else
         f"median of {threaded.get('steady_windows')} windows; step = worker step(), mean over workers"],
        ["sequential colocated", 1, sequential.get("tokens_per_s"), None, sequential.get("startup_s"),
         sequential.get("drafter_forward_backward_p50_ms", sequential.get("drafter_step_p50_ms")),
         sequential.get("target_fwd_p50_ms"), sequential.get("mode"),
         f"error: {sequential['error']}" if "error" in sequential else
         (f"median of {len(sequential['windows_tokens_per_s'])} window(s) of {LOG_EVERY} rounds, "
          f"{sequential.get('timed_batches')} timed batches after {sequential.get('warmup_batches')} warmup, the probes "
          f"after them; " if timed_alike(sequential) else
          f"{sequential.get('timed_batches')} timed batches after {sequential.get('warmup_batches')} warmup and the "
          f"probes; ") + sequential_training(sequential)
         + ("; drafter step = its forward-backward" if "drafter_forward_backward_p50_ms" in sequential else "")],
    ]
    if processes is not None:
        rows.append([f"processes ({processes.get('processes', '?')} ranks, torchrun)", "1 per rank", processes.get("tokens_per_s"), None,
                     processes.get("startup_s"), None, None, processes.get("mode"),
                     f"error: {processes['error']}" if "error" in processes else
                     f"{processes.get('timed_batches')} timed batches on {', '.join(processes.get('devices') or [])}; "
                     f"ranks' weights max diff {common.fmt(processes.get('ranks_weights_max_diff'), 6)}"])
    limit = figures["gpu_bound_tokens_per_s"]
    gpu_line = (f"- GPU-bound limit: {common.fmt(limit, 0)} tokens/s ({common.fmt(figures['gpu_ms_per_batch'], 3)} ms of kernels "
                f"per batch); threaded {common.fmt(figures['ratio_threaded_to_gpu_bound'])}x of it, sequential "
                f"{common.fmt(figures['ratio_sequential_to_gpu_bound'])}x" if limit is not None
                else f"- GPU-bound limit: not available ({figures['gpu_bound_reason']})")
    workers = threaded.get("workers", {})
    profiled = threaded.get("thread_profile") or {}
    busy = profiled.get("threads", {})  # absent when the profile failed
    wcols = ["worker", "device", "p50 ms", "p90 ms", "steps", "setup s", "first step at s", "compile s", "peer compile wait s",
             "capture s", "captures", "GPU-busy share (profiled)", "host ms per phase (p50)"]
    wrows = [[name, w["device"], w["p50_ms"], w["p90_ms"], w["steps"], w.get("setup_s"), w.get("first_step_at_s"),
              w.get("compile_s"), w.get("peer_compile_wait_s"), w.get("capture_s"), w["captures"],
              busy.get(name, {}).get("busy_share", "-") if profiled else "-",
              format_phases(w.get("phases_p50_ms", {})) or "-"] for name, w in workers.items()]
    lines = [
        f"# DFlash drafter throughput: {form}", "", *common.header_lines(env),
        f"- devices: {cfg.devices or 'all visible GPUs, else cpu'}; {cfg.targets} target + {cfg.drafters} drafter threads "
        f"vs one thread; {cfg.max_steps} drafter steps = {cfg.max_steps * cfg.drafters} batches of {cfg.batch_size} x "
        f"{cfg.seq_len} tokens; block {cfg.block_size}, {cfg.num_anchors} anchors, {cfg.num_draft_layers} drafter layers",
        f"- target: {shape}" + (" (random weights: throughput only)" if shape in _random_shapes() else "")
        + f" ({cfg.target or 'embedded default assets'}); GIL switch interval of the threaded run: "
        f"{common.fmt(threaded.get('gil_switch_interval_ms'))} ms",
        f"- excluded from the steady figures: the threaded run's first {LOG_EVERY}-step window (setup, compilation, capture) "
        "and its last (the drain), the same warmup share of the sequential batches and its probe rounds"
        + excluded_profile(threaded, sequential),
        *([] if env["gpu"] else ["- one intra-op thread per process (torch.set_num_threads(1))"]),
        "", common.markdown_table(columns, rows), "",
        f"**threaded / sequential tokens/s: {common.fmt(figures['ratio'])}x** (target >= {target_ratio(cfg.devices, env.get('gpus'))})", "",
        *([f"**threaded / processes tokens/s: {common.fmt(figures['ratio_threaded_to_processes'])}x** (target >= 0.95)", ""]
          if processes is not None else []),
        gpu_line,
        f"- host time per batch holding the GIL (sequential loop): {common.fmt(figures['host_gil_ms_per_batch'], 3)} ms; "
        f"GPUs one process could feed before the GIL saturates: {common.fmt(figures['projected_gpus_per_process'], 1)}",
        memory_line(env, figures, estimate),
        "", *startup_lines(threaded, sequential, figures),
        "", "## Threaded workers", "", common.markdown_table(wcols, wrows) if wrows else "(none: the threaded run failed)", "",
        *profile_lines(profiled),
        *kernel_lines(profiled.get("kernels"), sequential.get("gpu_probe_kernels")),
    ]
    return "\n".join(lines)


def excluded_profile(threaded: dict, sequential: dict) -> str:
    """What the steady figures say of the profiler: nothing for a run not timed alike (no sequential
    windows)."""
    if not timed_alike(sequential):
        return ""
    after = "; the sequential probes come after its timed rounds"
    if not threaded.get("thread_profile") or "error" in threaded["thread_profile"]:
        return after
    windows = threaded.get("profiled_windows") or []
    return (f"; the threaded windows that the profile (after the first half of the steady ones) overlapped: "
            f"{', '.join(map(str, windows)) or 'none'}" + after)


def profile_lines(profiled: dict) -> list[str]:
    """The profiled window of the threaded run: each device's busy share, each launching thread's."""
    if not profiled:
        return []
    if "error" in profiled:
        if profiled["error"].startswith("not profiled"):
            return [f"Profiled window: none, {profiled['error']}.", ""]
        return [f"Profiled window: failed ({profiled['error']}).", ""]
    # a share is over the span the device's kernels cover; files without span_ms have shares over the window
    devices = "; ".join(f"cuda:{d} busy {common.fmt(v['busy_share'])} of the {common.fmt(v['span_ms'] / 1000)} s its kernels span"
                        if "span_ms" in v else f"cuda:{d} busy {common.fmt(v['busy_share'])} of the window"
                        for d, v in profiled["devices"].items())
    spanned = any("span_ms" in v for v in profiled["devices"].values())
    ended = ("the spans hold the pipeline's drain" if spanned else "the shares count its idle end")
    rows = [[name, t["kernel_ms"], t["busy_ms"], t["busy_share"], t["launches"], t["graph_launches"]]
            for name, t in profiled["threads"].items()]
    return [f"Profiled window ({common.fmt(profiled['window_ms'] / 1000, 1)} s of steady state, CUDA activity only): "
            f"{devices}; kernels of two threads at once {common.fmt(profiled['concurrent_ms'], 1)} ms"
            + (f" (training ended inside the window: {ended})" if profiled.get("training_ended_inside") else "") + ".", "",
            common.markdown_table(["launching thread", "kernel ms", "busy ms", "busy share", "launches", "graph launches"],
                                  rows), ""]


KERNEL_ROWS, KERNEL_NAME_CHARS = 12, 60


def kernel_lines(threaded: Optional[dict], sequential: Optional[dict]) -> list[str]:
    """The profiled window's kernels beside the sequential GPU probe's, by name (thread_profile.kernel_summary):
    the same kernels running slower in the threaded run show as a ratio of means above 1, extra ones
    as names only in the window. The threaded side is not per batch: the trainer's step records mark
    LOG_EVERY-step windows, not which batches finished inside the profiled one."""
    if not threaded or not sequential or "by_name" not in threaded or "by_name" not in sequential:
        return []
    ours, theirs = threaded["by_name"], sequential["by_name"]
    total = sum(ms for ms, _ in ours.values())
    mean_us = (lambda figures: figures[0] * 1000 / figures[1] if figures and figures[1] else None)
    rows = []
    for name in sorted(ours, key=lambda n: -ours[n][0])[:KERNEL_ROWS]:
        mine, seq = mean_us(ours[name]), mean_us(theirs.get(name))
        short = name if len(name) <= KERNEL_NAME_CHARS else name[:KERNEL_NAME_CHARS - 3] + "..."
        rows.append([f"`{short.replace('`', '')}`".replace("|", "\\|"),
                     common.fmt(theirs[name][0], 3) if name in theirs else "-", common.fmt(seq, 1), common.fmt(mine, 1),
                     common.fmt(_div(mine, seq)), common.fmt(_div(ours[name][0], total), 3)])
    only_ours, only_theirs = len(set(ours) - set(theirs)), len(set(theirs) - set(ours))
    return [f"Kernels by name: the profiled window's (top {len(rows)} by its total) beside the sequential GPU probe's "
            f"({sequential.get('batches', '?')} batches):", "",
            common.markdown_table(["kernel", "sequential ms/batch", "sequential mean us", "threaded mean us",
                                   "threaded / sequential mean", "threaded share of kernel time"], rows), "",
            f"- names only in the threaded window: {only_ours} of {len(ours)}; only in the sequential probe: "
            f"{only_theirs} of {len(theirs)} (copies and memsets count as one name each)", ""]


def memory_line(env: dict, figures: dict, estimate: Optional[dict]) -> str:
    """Each cell's peak memory on its busiest device against the trainer's estimate, by part."""
    what = "reserved by torch's allocator" if env["gpu"] else "the process's peak resident set"
    gib = (lambda v: "-" if v is None else f"{v:.3g}")
    parts = f" ({', '.join(f'{k} {gib(v)}' for k, v in estimate.items())})" if estimate else ""
    return (f"- peak memory a device, GiB ({what}): threaded {gib(figures.get('peak_memory_gib_threaded'))}, "
            f"sequential {gib(figures.get('peak_memory_gib_sequential'))}; the trainer's estimate for the threaded "
            f"run {gib(figures.get('memory_estimate_gib'))}{parts}")


def startup_lines(threaded: dict, sequential: dict, figures: dict) -> list[str]:
    """Where each pipeline's startup went, and with which Inductor cache each cell started."""
    ours, theirs = threaded.get("compile_phases_s", {}), sequential.get("compile_phases_s", {})
    phases = sorted(set(ours) | set(theirs), key=lambda k: -max(ours.get(k, 0), theirs.get(k, 0)))
    rows = [[k, ours.get(k), theirs.get(k)] for k in phases]
    ratio = (f"{common.fmt(figures.get('startup_ratio'))}x (target <= 1.3)" if startup_comparable(sequential)
             else f"not comparable (the sequential cell started {RESTART}: a restart's startup)")
    return [
        f"## Startup: threaded / sequential {ratio}", "",
        f"- threaded: {common.fmt(threaded.get('startup_s'), 1)} s to the end of the first {LOG_EVERY}-step window; "
        f"pipeline build {common.fmt(threaded.get('build_s'), 1)} s, then the workers (table below)",
        f"- sequential: {common.fmt(sequential.get('startup_s'), 1)} s to the end of its warmup batches; setup (build, "
        f"target and drafter) {common.fmt(sequential.get('setup_s'), 1)} s, first round (compiles) "
        f"{common.fmt(sequential.get('first_round_s'), 1)} s",
        f"- Inductor cache at the start: threaded {threaded.get('inductor_cache', EMPTY)}, sequential "
        f"{inductor_cache(sequential)}; Dynamo's compile phases, seconds over all threads:",
        "", common.markdown_table(["phase", "threaded", "sequential"], rows) if rows else "(none recorded)",
    ]


def memory_estimate_gib(cfg) -> dict:
    """The trainer's own estimate of what the threaded run needs on each device, GiB by part
    (``sizes.per_device``, the figure it refuses a run on): set beside the cells' measured peaks."""
    from examples.dflash_trainer.assets import sizes
    from examples.dflash_trainer.pipeline import resolve_inputs
    from examples.dflash_trainer.policy import ExecutionPolicy
    from examples.dflash_trainer.target import TargetSource

    devices = cfg.device_list
    policy = ExecutionPolicy.resolve(cfg, devices)
    shape = TargetSource(resolve_inputs(cfg)[0], cfg.num_feature_layers, policy.target_dtype).shape()
    parts = sizes.per_device(cfg, shape.config, sum(p.numel() for p in shape.model.parameters()),
                             policy.target_dtype, devices)
    return {k: v / sizes.GiB for k, v in parts.items()}


def target_params(assets_kind: str, target_shape) -> int:
    """The target's parameter count, from its build report (both builds are cached by now)."""
    from examples.dflash_trainer.assets.assets import BuildSpec, default_assets
    from examples.dflash_trainer.assets.shapes import shape_target

    assets = default_assets(spec=BuildSpec.tiny() if assets_kind == "tiny" else None)
    if target_shape is not None:
        return shape_target(target_shape, assets).report["num_parameters"]
    return assets.load_report()["num_parameters"]


def _random_shapes():
    from examples.dflash_trainer.assets.shapes import SHAPES

    return SHAPES
