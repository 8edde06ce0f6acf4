"""Drafter tokens/s: the threaded 5 + 3 DFlash pipeline against a sequential colocated loop.

    python benchmarks/dflash_throughput.py                        # GPU: cuda:0, default assets
    python benchmarks/dflash_throughput.py --devices cuda:0,cuda:1
    python benchmarks/dflash_throughput.py --quick                # CPU reduced form (tiny assets)

threaded: ``examples.dflash_trainer.train.train`` with T target threads producing features and
D drafter threads training on them (threadgraph workers). Its tokens/s is the trainer's own
windowed counter (every LOG_EVERY drafter steps); the first window holds setup, compilation and
capture and is left out of the steady figure.

sequential: one thread does what early SpecForge did: for each batch, the target forward, then
the drafter step (forward, backward, clip, AdamW), on the same devices (one replica per device,
stepped in turn; replicas do not average gradients, which only favours this baseline). It steps
the trainer's own components (``examples.dflash_trainer.pipeline``: target stages, drafter
replicas, the batches with their anchors, the execution policy and the learning-rate schedule),
so both pipelines see the same data order, anchors, sizes and compilation (reduce-overhead on
GPU, with CUDAGraph Trees or, with ``--cuda-graphs whole-step``, whole-step graphs; eager on
CPU). It processes as many batches as the threaded run; the same share of them is warmup.

Each pipeline runs in its own subprocess (``--cell``, internal), so one failing prints an
error row and the other still runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repo root and src/ on sys.path)

import torch  # noqa: E402

from examples.dflash_trainer.metrics import LOG_EVERY  # noqa: E402  (the trainer's tokens/s window)

def run_threaded(cfg) -> dict:
    from examples.dflash_trainer.train import train

    windows = []
    results = train(cfg, progress=lambda r: windows.append(r["tokens_per_s"]) if "tokens_per_s" in r else None)
    steady = windows[1:] or windows
    return {
        "tokens_per_s": statistics.median(steady),
        "tokens_per_s_last": results["last"]["tokens_per_s"],
        "windows_tokens_per_s": windows,
        "placement": results.get("placement"),
        "mode": results.get("mode"),
        "gil_switch_interval_ms": results.get("gil_switch_interval_ms"),
        "loss_last": results["last"].get("loss"),
        "workers": results.get("workers", {}),
    }


def run_sequential(cfg, warmup_batches: int) -> dict:
    """The trainer's components stepped in turn by one thread: for global batch b, the target
    stage of replica b % R, then that drafter replica's forward-backward and update (no averaging)."""
    from examples.dflash_trainer.pipeline import Pipeline
    from examples.dflash_trainer.schedule import Schedule

    parts = Pipeline.build(cfg)
    devices = [torch.device(d) for d in parts.devices]
    total = parts.schedule.total_steps * cfg.drafters  # batches, as many as the threaded run
    rounds = -(-total // len(devices))
    # Each replica takes `rounds` optimizer steps, on the trainer's schedule stretched over them.
    schedule = Schedule.of(rounds, cfg.warmup_ratio)
    replicas = []
    for device in devices:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        stage = parts.target_stage(device)
        replicas.append((stage, parts.replica(device, schedule, target=stage.target)))  # one target per device
    batches = [parts.batches(shard) for shard in range(cfg.targets)]  # global batch b is shard b % T's

    warm_rounds = min(rounds - 1, -(-warmup_batches // len(replicas)))
    fwd_timer, step_timer = common.StepTimer(devices[0]), common.StepTimer(devices[0])
    wall = common.StepTimer(devices[0])
    for r in range(rounds):
        if r == warm_rounds:
            common.sync()
            fwd_timer.discard()
            step_timer.discard()
            wall.begin()
        torch.compiler.cudagraph_mark_step_begin()
        for i, (stage, replica) in enumerate(replicas):
            b = r * len(replicas) + i
            if stage.device.type == "cuda":
                torch.cuda.set_device(stage.device)
            index, *host = batches[b % cfg.targets].next()
            assert index == b, (index, b)
            inputs = stage.to_device(*host)
            if i == 0:
                fwd_timer.start()
            batch = stage.forward(*inputs)
            if i == 0:
                fwd_timer.stop()
                step_timer.start()
            replica.forward_backward(batch)
            replica.update()
            if i == 0:
                step_timer.stop()
    wall.finish()
    fwd_timer.finish()
    step_timer.finish()
    timed_batches = (rounds - warm_rounds) * len(replicas)
    seconds = wall.t1 - wall.t0
    return {
        "tokens_per_s": timed_batches * cfg.batch_size * cfg.seq_len / seconds,
        "timed_batches": timed_batches,
        "warmup_batches": warm_rounds * len(replicas),
        "devices": parts.devices,
        "mode": parts.policy.mode,
        "loss_last": float(replicas[0][1].history[-1, 0]),
        "target_fwd_p50_ms": common.p50(fwd_timer.ms),
        "drafter_step_p50_ms": common.p50(step_timer.ms),
        "drafter_step_p90_ms": common.p90(step_timer.ms),
    }


# -- the driver -----------------------------------------------------------------------------------


def make_config(args, out_dir: str):
    from examples.dflash_trainer.config import TrainConfig

    kw = dict(out_dir=out_dir, targets=args.targets, drafters=args.drafters, devices=args.devices,
              max_steps=args.steps, eval_every=0, checkpoint_every=0, seed=0)
    for name in ("seq_len", "batch_size", "block_size", "num_anchors", "num_draft_layers", "num_target_layers_used",
                 "gil_switch_interval_ms", "cuda_graphs"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    if args.assets == "tiny":
        from examples.dflash_trainer.assets import BuildSpec, default_assets

        tiny = default_assets(spec=BuildSpec.tiny())
        kw.update(target=str(tiny.target_dir), data=str(tiny.train_jsonl))
    return TrainConfig(**kw)


def run_cell_subprocess(args, name: str, cfg) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "cell.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--cell", name,
               "--cell-config", json.dumps(cfg.to_dict()), "--cell-out", str(out)]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=args.cell_timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {args.cell_timeout} s"}
        if out.exists():
            return json.loads(out.read_text())
        sys.stderr.write(proc.stderr[-3000:])
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        return {"error": f"exit {proc.returncode}: {lines[-1][:300] if lines else 'no output'}"}


def report(args, env: dict, cfg, threaded: dict, sequential: dict) -> tuple[str, dict]:
    from examples.dflash_trainer.metrics import format_phases

    ratio = None
    if threaded.get("tokens_per_s") and sequential.get("tokens_per_s"):
        ratio = threaded["tokens_per_s"] / sequential["tokens_per_s"]
    drafter_p50 = [w["p50_ms"] for name, w in threaded.get("workers", {}).items() if name.startswith("drafter") and w["p50_ms"]]
    target_p50 = [w["p50_ms"] for name, w in threaded.get("workers", {}).items() if name.startswith("target") and w["p50_ms"]]
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)
    form = "GPU" if env["gpu"] else "CPU reduced form (tiny sizes; says nothing about CUDA graphs)"
    columns = ["pipeline", "threads", "tokens/s (steady)", "tokens/s (last window)", "drafter step p50 ms",
               "target forward p50 ms", "mode", "note"]
    rows = [
        [f"threaded {cfg.targets} + {cfg.drafters}", cfg.targets + cfg.drafters, threaded.get("tokens_per_s"),
         threaded.get("tokens_per_s_last"), mean(drafter_p50), mean(target_p50), threaded.get("mode"),
         f"error: {threaded['error']}" if "error" in threaded else "mean over workers; step = worker step()"],
        ["sequential colocated", 1, sequential.get("tokens_per_s"), None, sequential.get("drafter_step_p50_ms"),
         sequential.get("target_fwd_p50_ms"), sequential.get("mode"),
         f"error: {sequential['error']}" if "error" in sequential else
         f"{sequential.get('timed_batches')} timed batches after {sequential.get('warmup_batches')} warmup"],
    ]
    workers = threaded.get("workers", {})
    wcols = ["worker", "device", "p50 ms", "p90 ms", "steps", "warmup s", "captures", "host ms per phase (p50)"]
    wrows = [[name, w["device"], w["p50_ms"], w["p90_ms"], w["steps"], w["warmup_s"], w["captures"],
              format_phases(w.get("phases_p50_ms", {})) or "-"] for name, w in workers.items()]
    lines = [
        f"# DFlash drafter throughput: {form}", "", *common.header_lines(env),
        f"- devices: {cfg.devices or 'all visible GPUs, else cpu'}; {cfg.targets} target + {cfg.drafters} drafter threads "
        f"vs one thread; {cfg.max_steps} drafter steps = {cfg.max_steps * cfg.drafters} batches of {cfg.batch_size} x "
        f"{cfg.seq_len} tokens; block {cfg.block_size}, {cfg.num_anchors} anchors, {cfg.num_draft_layers} drafter layers",
        f"- target: {cfg.target or 'embedded default assets'}; GIL switch interval of the threaded run: "
        f"{common.fmt(threaded.get('gil_switch_interval_ms'))} ms",
        f"- excluded: the threaded run's first {LOG_EVERY}-step window and the same share of the sequential batches "
        "(setup, compilation, capture)",
        *([] if env["gpu"] else ["- one intra-op thread per process (torch.set_num_threads(1))"]),
        "", common.markdown_table(columns, rows), "",
        f"**threaded / sequential tokens/s: {common.fmt(ratio)}x** (target >= 1.5)", "",
        "## Threaded workers", "", common.markdown_table(wcols, wrows) if wrows else "(none: the threaded run failed)", "",
    ]
    return "\n".join(lines), {"ratio": ratio}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="drafter steps of the threaded run (default 100; quick 20)")
    p.add_argument("--devices", help="comma list (default cuda:0, else cpu)")
    p.add_argument("--targets", type=int, default=5)
    p.add_argument("--drafters", type=int, default=3)
    p.add_argument("--seq-len", type=int, help="default: TrainConfig's (quick: 64)")
    p.add_argument("--batch-size", type=int, help="default: TrainConfig's (quick: 2)")
    p.add_argument("--block-size", type=int)
    p.add_argument("--num-anchors", type=int, help="default: TrainConfig's (quick: 4)")
    p.add_argument("--num-draft-layers", type=int)
    p.add_argument("--num-target-layers-used", type=int, help="default: TrainConfig's (tiny assets: 1)")
    p.add_argument("--cuda-graphs", choices=("trees", "whole-step"),
                   help="both pipelines: CUDAGraph Trees (default) or whole-step graphs (threadgraph.capture_step)")
    p.add_argument("--gil-switch-interval-ms", type=float,
                   help="the threaded run's GIL switch interval (default: Python's, 5 ms)")
    p.add_argument("--assets", choices=("default", "tiny"), help="embedded target and data (default; quick: tiny)")
    p.add_argument("--quick", action="store_true", help="CPU reduced form for CI: tiny assets and sizes, few steps")
    p.add_argument("--cell-timeout", type=int, default=600)
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    p.add_argument("--cell", choices=("threaded", "sequential"), help=argparse.SUPPRESS)
    p.add_argument("--cell-config", help=argparse.SUPPRESS)
    p.add_argument("--cell-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = [a for a in (sys.argv[1:] if argv is None else argv)]
    gpu = common.on_gpu()
    args.devices = args.devices or ("cuda:0" if gpu else "cpu")
    from examples.dflash_trainer.config import TrainConfig
    from examples.dflash_trainer.placement import available_devices

    try:  # here, not in each cell subprocess after a 3-minute asset build
        available_devices(TrainConfig(devices=args.devices).device_list)
    except (ValueError, RuntimeError) as exc:
        p.error(f"--devices {args.devices}: {exc}")
    args.steps = args.steps or (20 if args.quick else 100)
    args.assets = args.assets or ("tiny" if args.quick else "default")
    if args.quick:
        for name, value in (("seq_len", 64), ("batch_size", 2), ("num_anchors", 4)):
            if getattr(args, name) is None:
                setattr(args, name, value)
    if args.assets == "tiny" and args.num_target_layers_used is None:
        args.num_target_layers_used = 1  # the tiny target has 2 layers: room for one feature layer
    if args.steps <= LOG_EVERY:
        p.error(f"--steps must exceed {LOG_EVERY} (the first window of the trainer's tokens/s counter is warmup)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common.exit_on_sigterm()
    if args.cell:
        from examples.dflash_trainer.config import TrainConfig

        if not common.on_gpu():
            torch.set_num_threads(1)
        cfg = TrainConfig.from_dict(json.loads(args.cell_config))
        if args.cell == "threaded":
            result = run_threaded(cfg)
        else:
            result = run_sequential(cfg, warmup_batches=LOG_EVERY * cfg.drafters)
        common.finish_cell(args.cell_out, result, default=str)
    env = common.environment()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as run_dir:
        if args.assets == "default":  # build (or find) the cached assets once, outside the timed cells
            from examples.dflash_trainer.assets import default_assets

            default_assets()
        cfg = make_config(args, run_dir)
        results = {}
        for name in ("threaded", "sequential"):
            print(f"[{name}]", file=sys.stderr, flush=True)
            results[name] = run_cell_subprocess(args, name, cfg)
    text, extra = report(args, env, cfg, results["threaded"], results["sequential"])
    print(text)
    out = common.results_dir(args.out_dir)
    stem = common.results_stem(env, "dflash-throughput")
    common.write_json(out / f"{stem}.json", {"benchmark": "dflash_throughput", "env": env, "args": vars(args),
                                             "config": dataclasses.asdict(cfg), "seconds": round(time.perf_counter() - started, 1),
                                             **results, **extra})
    (out / f"{stem}.md").write_text(text)
    print(f"\nwrote {out / stem}.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
