"""Drafter tokens/s: the threaded 5 + 3 DFlash pipeline against a sequential colocated loop.

    python -m benchmarks dflash-throughput                        # GPU: cuda:0, default assets
    python -m benchmarks dflash-throughput --devices cuda:0,cuda:1
    python -m benchmarks dflash-throughput --target-shape 0.6b    # a random-init Qwen3-0.6B-shaped target
    python -m benchmarks dflash-throughput --quick                # CPU reduced form (tiny assets)

threaded: ``examples.dflash_trainer.train.train`` with T target threads producing features and
D drafter threads training on them (threadgraph workers). Its tokens/s is the trainer's own
windowed counter (every LOG_EVERY drafter steps); the first window holds setup, compilation and
capture and is left out of the steady figure.

sequential: one thread trains what the threads train: each round, for each drafter in turn, the
target forward of its batch, then its forward-backward; then the round's mean gradient and one
AdamW step for each device's shared weights (the threads' replicas, placement, averaging and
optimizer steps: only the threads go). It calls the step functions the worker threads call
(``TargetStage.step``, ``DrafterReplica.forward_backward`` and ``update``) on the trainer's own
components (``examples.dflash_trainer.pipeline``: target stages, drafter replicas, the batches with
their anchors, the execution policy and the learning-rate schedule), so both pipelines see the same
data order, anchors, sizes and compilation (reduce-overhead on GPU, with CUDAGraph Trees or, with
``--cuda-graphs whole-step``, whole-step graphs; eager on CPU), and train to the same losses. It
processes as many batches as the threaded run; the same share of them is warmup.

Besides tokens/s, the sequential loop measures the GPU time of one batch's kernels (the GPU-bound
limit of both pipelines), its host time per batch (what one thread holds the GIL for) and both cells
their startup seconds; ``headline`` turns these into the figures of the results file (benchmarks/README.md).

Each pipeline runs in its own subprocess (``--cell``, internal), so one failing prints an
error row and the other still runs, and by default (``--inductor-cache per-cell``) with its own
empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR``): both startups are a first run's, neither
reuses the other's compiled kernels. ``--inductor-cache shared`` gives both cells one empty
cache, so the sequential cell reuses the threaded cell's kernels: a shorter run whose sequential
startup is a restart's, labelled so in the results. Each cell also reports Dynamo's own compile-phase seconds (``compile_phases_s``)
and its peak memory a device (``peak_memory_gib``: reserved by torch's allocator on a GPU, the
process's resident set on a CPU), set beside the trainer's own estimate, the figure it refuses a
run on (``memory_estimate_gib``, by part in ``memory_estimate_gib_by_part``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from . import common
from . import dflash_processes
from . import dflash_sequential
from . import thread_profile
from .results_schema import EMPTY, MIN_STEADY_WINDOWS, SHARED, above_gpu_bound, ratio_withheld, startup_comparable

import torch

from examples.dflash_trainer.run.metrics import LOG_EVERY  # (the trainer's tokens/s window)
from examples.dflash_trainer.errors import EXIT_BAD_INPUT, BadInput
from examples.dflash_trainer.assets.shapes import SHAPES


# steady windows no profiler touched, at the least, for a profiled run: as many as a ratio needs
MIN_CLEAN_WINDOWS = MIN_STEADY_WINDOWS


def profile_span(steps: int) -> tuple[int, int] | None:
    """The tokens/s windows (by count logged) at whose ends a profile of the threaded run starts
    and stops: it starts once the first half of the steady windows are in, so they are timed with
    no profiler having run, and stops at the end of the last steady window, before the drain. None
    when the run has too few steady windows to keep MIN_CLEAN_WINDOWS of them apart."""
    steady = -(-steps // LOG_EVERY) - 2  # without the first window (warmup) and the last (the drain)
    clean = max(MIN_CLEAN_WINDOWS, steady // 2)
    return (1 + clean, 1 + steady) if steady > clean else None


def run_threaded(cfg, profile_s: float = 0.0) -> dict:
    """The trainer itself. startup_s: from the call of ``train`` (pipeline build, model loads, worker
    setups, compilation, capture) to the end of the first tokens/s window, the first LOG_EVERY
    drafter steps; the steady figure is the median of the windows after it, without the last one,
    which holds the pipeline's drain (the targets have stopped feeding; it is reported apart).
    With ``profile_s`` on a GPU, a profile of at most that many seconds (thread_profile.py: each
    thread's share of the device) runs over the later steady windows (``profile_span``); no window
    that ended after it began enters the steady figure, and its export runs once training is over
    (the sequential cell's probes likewise run after its timed rounds)."""
    from examples.dflash_trainer.train import train

    windows, ends = [], []
    span = profile_span(cfg.max_steps)
    profiling = profile_s > 0 and common.on_gpu()
    profile = thread_profile.ThreadProfile(profile_s) if profiling and span is not None else None

    def progress(record):
        if "tokens_per_s" in record:
            windows.append(record["tokens_per_s"])
            ends.append(time.perf_counter())
            if profile is not None and len(windows) == span[0]:
                profile.start()
            if profile is not None and len(windows) == span[1]:
                profile.stop()

    t0 = time.perf_counter()
    results = train(cfg, progress=progress)
    trained = time.perf_counter()
    profiled = profile.outcome() if profile is not None else None
    if profiling and profile is None:
        profiled = {"error": f"not profiled: {cfg.max_steps} steps give too few steady windows to keep "
                             f"{MIN_CLEAN_WINDOWS} apart from a profile"}
    steady_ids = list(range(1, len(windows) - 1)) if len(windows) > 2 else list(range(1, len(windows))) or [0]
    overlapped = []
    if profile is not None and profile.started_at is not None:
        # every window that ended after the profile began: those it covered, and those after it
        # (a profile that ran out of seconds early leaves CUPTI's cost behind for a while)
        overlapped = [i for i in steady_ids if ends[i] > profile.started_at]
        ended = profile.ended_at if profile.ended_at is not None else float("inf")
        if "error" not in profiled and trained < ended:
            profiled["training_ended_inside"] = True  # the busy shares then count the idle end too
        steady_ids = [i for i in steady_ids if i not in overlapped]
    steady = [windows[i] for i in steady_ids]
    return {
        "tokens_per_s": statistics.median(steady),
        "tokens_per_s_last_window": windows[-1],
        "windows_tokens_per_s": windows,
        "steady_windows": len(steady),
        "startup_s": ends[0] - t0,
        "placement": results.placement,
        "mode": results.mode,
        "gil_switch_interval_ms": results.gil_switch_interval_ms,
        "loss_last": results.last.get("loss"),
        "workers": results.to_json()["workers"],
        "thread_profile": profiled,
        "profiled_windows": overlapped,
        "build_s": results.build_s,
        "compile_phases_s": common.compile_phases(),
        "peak_memory_gib": common.peak_memory_gib(cfg.device_list),
    }


# -- the driver -----------------------------------------------------------------------------------


def make_config(args, out_dir: str):
    from examples.dflash_trainer.config import TrainConfig

    kw = dict(out_dir=out_dir, targets=args.targets, drafters=args.drafters, devices=args.devices,
              max_steps=args.steps, eval_every=0, checkpoint_every=0, no_checkpoints=True, seed=0)
    for name in ("seq_len", "batch_size", "block_size", "num_anchors", "num_draft_layers", "num_target_layers_used",
                 "gil_switch_interval_ms", "cuda_graphs"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.preset is not None:  # the trainer's --preset; sizes given beside it win
        from examples.dflash_trainer.config import apply_preset

        kw = apply_preset(kw, args.preset, set(kw))
    from examples.dflash_trainer.assets.assets import BuildSpec, default_assets

    # Built (or found in the cache) once here, outside the timed cells.
    assets = default_assets(spec=BuildSpec.tiny() if args.assets == "tiny" else None)
    if args.target_shape is not None:
        from examples.dflash_trainer.assets.shapes import RANDOM_WEIGHTS_WARNING, shape_target

        print(f"[target shape {args.target_shape}: building it if it is not cached] WARNING: {RANDOM_WEIGHTS_WARNING}",
              file=sys.stderr, flush=True)
        kw.update(target=str(shape_target(args.target_shape, assets).dir), data=str(assets.train_jsonl))
    elif args.assets == "tiny":
        kw.update(target=str(assets.target_dir), data=str(assets.train_jsonl))
    return TrainConfig(**kw)


def theme(args) -> str:
    """``dflash-throughput-<target>-<graphs>``."""
    return f"dflash-throughput-{target_label(args)}{'-' + args.preset if args.preset else ''}-{graphs(args)}"


def target_label(args) -> str:
    """The --target-shape, or default / tiny-assets for the embedded targets."""
    return args.target_shape or ("default" if args.assets == "default" else "tiny-assets")


def graphs(args) -> str:
    return (args.cuda_graphs or "trees") if common.on_gpu() else "eager"


def run_cell_subprocess(args, name: str, cfg, cache_dir: str) -> dict:
    return common.run_cell([*common.module_command("dflash_throughput"), *args.argv, "--cell", name,
                            "--cell-config", json.dumps(cfg.to_dict()), "--cell-out"], cache_dir, args.cell_timeout)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="drafter steps of the threaded run (default 100; quick 30)")
    p.add_argument("--devices", help="comma list (default cuda:0, else cpu)")
    p.add_argument("--targets", type=int, default=5)
    p.add_argument("--drafters", type=int, default=3)
    p.add_argument("--seq-len", type=int, help="default: TrainConfig's (quick: 64)")
    p.add_argument("--batch-size", type=int, help="default: TrainConfig's (quick: 2)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-anchors", type=int, help="default: TrainConfig's (quick: 4)")
    p.add_argument("--num-draft-layers", type=int)
    p.add_argument("--preset", choices=("paper",), help="the trainer's --preset: paper = the DFlash paper's drafter "
                   "(5 layers, block 16, 512 anchors, seq-len 3072); sizes given beside it win")
    p.add_argument("--num-target-layers-used", type=int, help="default: TrainConfig's (tiny assets: 1)")
    p.add_argument("--cuda-graphs", choices=("trees", "whole-step"),
                   help="both pipelines: CUDAGraph Trees (default) or whole-step graphs (threadgraph.capture_step)")
    p.add_argument("--gil-switch-interval-ms", type=float,
                   help="the threaded run's GIL switch interval (default: Python's, 5 ms)")
    p.add_argument("--assets", choices=("default", "tiny"), help="embedded target and data (default; quick: tiny); "
                   "with --target-shape, the tokenizer and data only")
    p.add_argument("--target-shape", choices=tuple(SHAPES),
                   help="a random-init Qwen3 target of this published shape (tiny for tests) on the embedded tokenizer "
                        "and data, built once and cached: a target that gives the GPU real work")
    p.add_argument("--quick", action="store_true", help="CPU reduced form for CI: tiny assets and sizes, few steps")
    p.add_argument("--inductor-cache", choices=("per-cell", "shared"), default="per-cell",
                   help="per-cell: each cell starts with an empty Inductor cache (default); shared: one for both, "
                        "so the sequential cell's startup reuses the threaded cell's kernels (shorter runs)")
    p.add_argument("--processes", type=int, default=0, metavar="N",
                   help="also run the processes pipeline: N ranks under torchrun, one per device of --devices "
                        "(on a CPU, N ranks on the cpu), gradients averaged over them (dflash_processes.py)")
    p.add_argument("--profile-seconds", type=float, default=3.0,
                   help="GPU: profile this many seconds of the threaded run's steady state, attributing the device's "
                        "kernels to the threads that launched them (0: off; default %(default)s)")
    p.add_argument("--cell-timeout", type=int, default=600)
    common.add_out_dir(p)
    p.add_argument("--cell", choices=("threaded", "sequential"), help=argparse.SUPPRESS)
    p.add_argument("--cell-config", help=argparse.SUPPRESS)
    p.add_argument("--cell-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    gpu = common.on_gpu()
    args.devices = args.devices or ("cuda:0" if gpu else "cpu")
    from examples.dflash_trainer.config import TrainConfig
    from examples.dflash_trainer.run.placement import available_devices

    try:  # here, not in each cell subprocess after an asset build
        available_devices(TrainConfig(devices=args.devices).device_list)
    except (ValueError, RuntimeError) as exc:
        p.error(f"--devices {args.devices}: {exc}")
    devices = len(args.devices.split(","))
    if args.processes and (args.processes < 2 or (args.devices != "cpu" and args.processes != devices)):
        p.error(f"--processes {args.processes}: give one process per device of --devices {args.devices}, at least 2"
                + (f" (here {devices})" if args.devices != "cpu" else " (on a CPU all ranks share the cpu)"))
    args.steps = args.steps or (30 if args.quick else 100)  # quick: a steady window between the first and the last
    args.assets = args.assets or ("tiny" if args.quick else "default")
    if args.quick:
        for name, value in (("seq_len", 64), ("batch_size", 2), ("num_anchors", 4)):
            if getattr(args, name) is None:
                setattr(args, name, value)
    two_layers = args.target_shape == "tiny" if args.target_shape else args.assets == "tiny"
    if two_layers and args.num_target_layers_used is None:
        args.num_target_layers_used = 1  # the tiny targets have 2 layers: room for one feature layer
    if args.steps <= LOG_EVERY or args.steps % LOG_EVERY:
        p.error(f"--steps must be a multiple of {LOG_EVERY} above it, such as 100: the trainer's tokens/s windows are "
                f"{LOG_EVERY} steps, the first is warmup, and a short last one would leave the drain in a steady one")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common.exit_on_sigterm()
    if args.cell:
        from examples.dflash_trainer.config import TrainConfig

        if not common.on_gpu():
            torch.set_num_threads(1)
        cfg = TrainConfig.from_dict(json.loads(args.cell_config))
        try:
            if args.cell == "threaded":
                result = run_threaded(cfg, profile_s=args.profile_seconds)
            else:
                result = dflash_sequential.run_sequential(cfg, warmup_batches=LOG_EVERY * cfg.drafters)
        except BadInput as err:  # the trainer refused the run (its size check, for one): exit 2, one line
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        common.finish_cell(args.cell_out, result, default=str)
    steady = args.steps // LOG_EVERY - 2  # without the first window (warmup) and the last (the drain)
    if steady < MIN_STEADY_WINDOWS:
        print(f"note: --steps {args.steps} gives {steady} steady window{'s' if steady != 1 else ''}; a threaded / "
              f"sequential ratio needs {MIN_STEADY_WINDOWS} (--steps 50 or more), so this run reports none",
              file=sys.stderr, flush=True)
    env = common.environment()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        try:
            cfg = make_config(args, run_dir)
        except BadInput as err:  # a shape with no room to build, for one
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        estimate = memory_estimate_gib(cfg)  # before the cells: a failure here loses no measurement
        results = {}
        shared = str(Path(run_dir, "inductor-cache")) if args.inductor_cache == "shared" else ""
        for name in ("threaded", "sequential", *(("processes",) if args.processes else ())):
            print(f"[{name}]", file=sys.stderr, flush=True)
            results[name] = (dflash_processes.run_cell(cfg, args.processes, args.cell_timeout, shared)
                             if name == "processes" else run_cell_subprocess(args, name, cfg, shared))
            if results[name].get("exit_code") == EXIT_BAD_INPUT:  # refused before measuring: no results file
                print(f"the {name} cell refused the run ({results[name]['error']}): no results file written",
                      file=sys.stderr)
                return EXIT_BAD_INPUT
            results[name]["inductor_cache"] = EMPTY if name == "threaded" or not shared else SHARED
    figures = headline(cfg, results["threaded"], results["sequential"], env["gpu"] is not None,
                       results.get("processes"), estimate)
    stem = common.results_stem(env, theme(args))
    common.save(common.results_dir(args.out_dir) / f"{stem}.json",
                {"benchmark": "dflash_throughput", "env": env, "args": vars(args), "config": dataclasses.asdict(cfg),
                 "seconds": round(time.perf_counter() - started, 1), "shape": target_label(args), "graphs": graphs(args),
                 "target_params": target_params(args.assets, args.target_shape), "memory_estimate_gib_by_part": estimate,
                 **results, **figures})
    return 0


def headline(cfg, threaded: dict, sequential: dict, on_gpu: bool, processes: dict | None = None,
             estimate: dict | None = None) -> dict:
    """The figures the DFlash table of docs/results.md shows, from both cells.

    GPU-bound limit: the tokens/s the devices would give if their kernels ran back to back: batch x
    seq_len per batch over the GPU time of a batch (sequential loop, under torch.profiler): the
    busiest device's kernel time a round over the round's batches (a file whose sequential cell
    trained one batch a device a round: that time, the limit then times the devices). GIL: the sequential loop's host time per batch (perf_counter
    around one batch's Python work, the device synchronised before and after), and the number of GPUs
    one process could feed before that host time fills the GIL: GPU ms per batch / host ms per batch.
    Memory: each cell's peak on its busiest device, and the trainer's estimate for the threaded run.
    No ratio (``ratio_withheld`` says why) where a side rests on fewer than MIN_STEADY_WINDOWS steady
    windows; ``above_gpu_bound`` flags every pipeline faster than the GPU-bound limit, which no
    pipeline can be: a measurement error."""
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
    withheld = ratio_withheld(threaded, sequential)
    out["ratio_withheld"] = withheld and (f"{withheld} (the first steady window can hold batches the targets queued "
                                          f"during warmup; --steps 50 or more gives {MIN_STEADY_WINDOWS})")
    out["ratio"] = None if out["ratio_withheld"] else _div(out["tokens_per_s_threaded"], out["tokens_per_s_sequential"])
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
        out["ratio_threaded_to_processes"] = (None if out["ratio_withheld"] else
                                              _div(out["tokens_per_s_threaded"], out["tokens_per_s_processes"]))
        out["ratio_processes_to_gpu_bound"] = _div(out["tokens_per_s_processes"], out["gpu_bound_tokens_per_s"])
    out["above_gpu_bound"] = above_gpu_bound(out)
    return out


def _div(a, b):
    return a / b if a is not None and b else None


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


if __name__ == "__main__":
    sys.exit(main())
