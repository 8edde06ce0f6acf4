"""Drafter tokens/s: the threaded 5 + 3 DFlash pipeline against a sequential colocated loop.

    python benchmarks/dflash_throughput.py                        # GPU: cuda:0, default assets
    python benchmarks/dflash_throughput.py --devices cuda:0,cuda:1
    python benchmarks/dflash_throughput.py --quick                # CPU reduced form (tiny assets)

threaded: ``examples.dflash_trainer.train.train`` with T target threads producing features and
D drafter threads training on them (threadgraph workers). Its tokens/s is the trainer's own
windowed counter (every 10 drafter steps); the first window holds setup, compilation and
capture and is left out of the steady figure.

sequential: one thread does what early SpecForge did: for each batch, the target forward, then
the drafter step (forward, backward, clip, AdamW), on the same devices (one replica per device,
stepped in turn; replicas do not average gradients, which only favours this baseline), the
same data order, anchors and sizes, compiled the same way (reduce-overhead on GPU, with
CUDAGraph Trees or, with ``--cuda-graphs whole-step``, whole-step graphs; eager on CPU). It
processes as many batches as the threaded run; the same share of them is warmup.

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

LOG_EVERY = 10  # the trainer's tokens/s window, in drafter steps (examples/dflash_trainer/run.py)


def anchor_seed(seed: int, batch_index: int) -> int:
    """The trainer's per-batch anchor seed (Run.anchor_seed, rank 0)."""
    return (seed * 1_000_003 + batch_index) % 2**62


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
    from examples.dflash_trainer.data import SampleStream, read_jsonl
    from examples.dflash_trainer.model import DFlashDrafter
    from examples.dflash_trainer.placement import available_devices
    from examples.dflash_trainer.grads import FlatGrads, make_optimizer
    from examples.dflash_trainer.loss import anchor_scores
    from examples.dflash_trainer.step import (METRIC_NAMES, capture_graph, captures, compile_fn,
                                              make_forward_backward, make_step_fn, make_target_step,
                                              make_update)
    from examples.dflash_trainer.target import TargetModel
    from examples.dflash_trainer.train import resolve_inputs

    devices = available_devices(cfg.device_list)
    on_cuda = devices[0].startswith("cuda")
    compiled = cfg.compiled_on(on_cuda)
    bf16 = cfg.bf16_on(on_cuda)
    autocast = torch.bfloat16 if bf16 else None
    target_dir, train_jsonl, _, _ = resolve_inputs(cfg)
    n = cfg.num_feature_layers
    target_shape = TargetModel.shape_only(target_dir, num_feature_layers=n)
    data = read_jsonl(train_jsonl, tokenizer=target_shape.tokenizer, seq_len=cfg.seq_len,
                      vocab_size=target_shape.vocab_size)
    how = dict(compiled=compiled, cuda_graphs=cfg.cuda_graphs)
    total = (cfg.max_steps or 1) * cfg.drafters  # batches, as many as the threaded run
    rounds = -(-total // len(devices))

    replicas = []
    for i, dev in enumerate(devices):
        device = torch.device(dev)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        target = TargetModel.from_pretrained(target_dir, num_feature_layers=n,
                                             dtype=torch.bfloat16 if bf16 else torch.float32, device=device)
        drafter = DFlashDrafter.from_target_config(target.config, target.embed_tokens, target.lm_head,
                                                   cfg.num_draft_layers, n,
                                                   generator=torch.Generator().manual_seed(cfg.seed)).to(device)
        params = [p for p in drafter.parameters() if p.requires_grad]
        grads = FlatGrads(params, extras=len(METRIC_NAMES))
        opt = make_optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay, capturable=captures(**how))
        step_fn = make_step_fn(drafter, block_size=cfg.block_size, gamma=cfg.gamma_value,
                               mask_token_id=target_shape.mask_token_id, autocast_dtype=autocast)
        history = torch.zeros(rounds, len(METRIC_NAMES) + 1, device=device)
        replicas.append(dict(device=device, target_step=capture_graph(compile_fn(make_target_step(target.features, cfg.num_anchors), **how), **how),
                             forward_backward=capture_graph(make_forward_backward(compile_fn(step_fn, **how), grads), **how),
                             update=capture_graph(make_update(grads, opt, history, max_norm=cfg.grad_clip, first_step=0), **how),
                             history=history, sched=torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                             stream=SampleStream(data, cfg.batch_size, seed=cfg.seed, shard=i, num_shards=len(devices))))

    warm_rounds = min(rounds - 1, -(-warmup_batches // len(replicas)))
    anchor_rng = torch.Generator()
    fwd_timer, step_timer = common.StepTimer(devices[0]), common.StepTimer(devices[0])
    wall = common.StepTimer(devices[0])
    for r in range(rounds):
        if r == warm_rounds:
            common.sync()
            fwd_timer.discard()
            step_timer.discard()
            wall.begin()
        torch.compiler.cudagraph_mark_step_begin()
        for i, rep in enumerate(replicas):
            b = r * len(replicas) + i
            device = rep["device"]
            if device.type == "cuda":
                torch.cuda.set_device(device)
            ids, loss_mask = rep["stream"].next_batch()
            anchor_rng.manual_seed(anchor_seed(cfg.seed, b))
            scores = anchor_scores(loss_mask, anchor_rng)
            ids, loss_mask, scores = (t.to(device, non_blocking=True) for t in (ids, loss_mask, scores))
            if i == 0:
                fwd_timer.start()
            features, anchors, keep = rep["target_step"](ids, loss_mask, scores)
            features, anchors, keep = features.clone(), anchors.clone(), keep.clone()  # as the target worker does
            if i == 0:
                fwd_timer.stop()
                step_timer.start()
            rep["forward_backward"](ids, loss_mask, features, anchors, keep)
            rep["update"]()
            rep["sched"].step()
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
        "devices": devices,
        "mode": cfg.mode_on(on_cuda),
        "loss_last": float(replicas[0]["history"][-1, 0]),
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
    stem = common.results_stem(env, "_dflash-throughput")
    common.write_json(out / f"{stem}.json", {"benchmark": "dflash_throughput", "env": env, "args": vars(args),
                                             "config": dataclasses.asdict(cfg), "seconds": round(time.perf_counter() - started, 1),
                                             **results, **extra})
    (out / f"{stem}.md").write_text(text)
    print(f"\nwrote {out / stem}.{{json,md}}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
