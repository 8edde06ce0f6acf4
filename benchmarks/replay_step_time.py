"""Per-thread step time of a training step and an inference step, by compile mode and placement.

    python benchmarks/replay_step_time.py                 # GPU: everything (several minutes)
    python benchmarks/replay_step_time.py --quick         # fewer steps, no process placements
    python benchmarks/replay_step_time.py --model dflash --tasks train --modes eager,reduce-overhead

Modes: eager; compile (torch.compile default mode); reduce-overhead (CUDAGraph Trees, in
threads through threadgraph.CompiledWorkerThread); whole-step (threadgraph.capture_step: one
CUDA graph of forward + backward + optimizer step). Placements: the main thread alone; one worker
thread; N workers one per GPU (N > 1); M workers sharing one GPU (--share); and the same work as
torch.multiprocessing (spawn) processes, which is what people use instead of threads.

Every (mode, placement) cell runs in its own subprocess (``--cell``, internal), so a failed
capture costs one error row and the rest carry on. Without a GPU it runs a CPU reduced form
(a smaller model, eager and compile only); those numbers say nothing about CUDA graphs.
Warmup steps (which include compilation and capture) are excluded from every time.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repo root and src/ on sys.path)
import pyspy  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MODES = ("eager", "compile", "reduce-overhead", "whole-step")
CPU_MODES = ("eager", "compile")
TASKS = ("train", "infer")
PLACEMENTS = ("main", "worker", "per-gpu", "shared", "procs-per-gpu", "procs-shared")
TASK_TITLES = {"train": "Training step (forward + backward + optimizer)", "infer": "Inference step (forward)"}
BARRIER_TIMEOUT_S = 900
_BUILD_LOCK = threading.Lock()
CPU_THREADS_NOTE = ("one intra-op thread per process (torch.set_num_threads(1)): OpenMP pools of several threads "
                    "oversubscribe small CPUs and turn contention into 100x outliers")


# -- what one step does ---------------------------------------------------------------------------


@dataclasses.dataclass
class Work:
    module: torch.nn.Module
    train_fn: Callable  # (*train_inputs) -> loss, or (loss, ...)
    train_inputs: tuple
    infer_fn: Callable  # (*infer_inputs) -> outputs
    infer_inputs: tuple
    make_opt: Callable[[bool], torch.optim.Optimizer]  # capturable -> optimizer


def small_work(device: torch.device, seed: int) -> Work:
    width, depth = (common.WIDTH, common.DEPTH) if device.type == "cuda" else (common.CPU_WIDTH, common.CPU_DEPTH)
    model = common.small_model(seed, device, width, depth)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(common.BATCH, width, generator=g).to(device, dtype)
    y = torch.randn(common.BATCH, width, generator=g).to(device, dtype)
    return Work(model, lambda x, y: F.mse_loss(model(x), y), (x, y), lambda x: model(x), (x,),
                lambda capturable: torch.optim.SGD(model.parameters(), lr=1e-3))


DFLASH_SIZES = {  # the drafter training step of examples/dflash_trainer, static random inputs
    "cuda": dict(hidden=1024, heads=8, kv_heads=4, head_dim=128, intermediate=3072, vocab=32000, layers=8,
                 batch=4, seq=512, anchors=32, block=16),
    "cpu": dict(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=1024, layers=8,
                batch=2, seq=64, anchors=4, block=8),
}


def _qwen3_config(s: dict):
    kw = dict(hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
              head_dim=s["head_dim"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
              num_hidden_layers=s["layers"])
    try:
        from transformers import Qwen3Config

        return Qwen3Config(**kw)
    except ImportError:  # from_target_config only reads attributes
        return __import__("types").SimpleNamespace(rms_norm_eps=1e-6, rope_theta=1e6, **kw)


def dflash_work(device: torch.device, seed: int) -> Work:
    from examples.dflash_trainer.config import TrainConfig
    from examples.dflash_trainer.loss import sample_anchors
    from examples.dflash_trainer.model import DFlashDrafter
    from examples.dflash_trainer.step import make_step_fn

    common.allow_recompiles()
    s = DFLASH_SIZES[device.type]
    cfg = TrainConfig(block_size=s["block"], num_anchors=s["anchors"], seq_len=s["seq"], batch_size=s["batch"])
    n, cuda = cfg.num_feature_layers, device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    with _BUILD_LOCK:  # one model at a time; weights only need to be sane, the cell measures time
        torch.manual_seed(seed)
        embed = torch.nn.Embedding(s["vocab"], s["hidden"])
        lm_head = torch.nn.Linear(s["hidden"], s["vocab"], bias=False)
        drafter = DFlashDrafter.from_target_config(_qwen3_config(s), embed, lm_head, cfg.num_draft_layers, n,
                                                   generator=torch.Generator().manual_seed(seed))
    embed.to(device, dtype).requires_grad_(False)  # Module.to is in place: the drafter sees the moved ones
    lm_head.to(device, dtype).requires_grad_(False)
    drafter.to(device)
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, s["vocab"] - 1, (s["batch"], s["seq"]), generator=g)
    loss_mask = torch.ones_like(ids)
    features = torch.randn(s["batch"], s["seq"], n * s["hidden"], generator=g).to(dtype)
    anchors, keep = sample_anchors(loss_mask, s["anchors"], g)
    inputs = tuple(t.to(device) for t in (ids, loss_mask, features, anchors, keep))
    fn = make_step_fn(drafter, block_size=s["block"], gamma=cfg.gamma_value, mask_token_id=s["vocab"] - 1,
                      autocast_dtype=torch.bfloat16 if cuda else None)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def make_opt(capturable: bool) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), capturable=capturable and cuda)

    return Work(drafter, fn, inputs, fn, inputs, make_opt)


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def make_step(mode: str, task: str, work: Work, whole_step_inner: str = "eager") -> Callable[[], object]:
    """A no-argument step on static inputs; built in the thread that will run it."""
    compile_mode = {"compile": None, "reduce-overhead": "reduce-overhead"}.get(mode)
    if task == "infer":
        work.module.eval()
        infer_fn, inputs = work.infer_fn, work.infer_inputs

        def forward(*args):
            with torch.no_grad():
                return infer_fn(*args)

        if mode == "whole-step":
            import threadgraph

            inner = torch.compile(forward) if whole_step_inner == "compile" else forward
            graph = threadgraph.capture_step(inner)
            return lambda: graph(*inputs)
        fn = forward if mode == "eager" else torch.compile(forward, mode=compile_mode)
        return lambda: fn(*inputs)

    train_fn, inputs = work.train_fn, work.train_inputs
    opt = work.make_opt(mode == "whole-step")
    if mode == "whole-step":
        import threadgraph

        inner = torch.compile(train_fn) if whole_step_inner == "compile" else train_fn

        def train_step(*args):
            loss = _loss(inner(*args))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()

        graph = threadgraph.capture_step(train_step)
        return lambda: graph(*inputs)
    fn = train_fn if mode == "eager" else torch.compile(train_fn, mode=compile_mode)

    def step():
        loss = _loss(fn(*inputs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


# -- placements -----------------------------------------------------------------------------------


@dataclasses.dataclass
class Plan:
    model: str
    mode: str
    task: str
    warmup: int
    steps: int
    profile: int  # steps of the GPU-busy window after the timed steps (0 = none)
    whole_step_inner: str

    def build(self, device: torch.device, seed: int) -> Callable[[], object]:
        work = (dflash_work if self.model == "dflash" else small_work)(device, seed)
        return make_step(self.mode, self.task, work, self.whole_step_inner)


def placements(args, every: bool = False) -> list[tuple[str, str, list[str]]]:
    """(key, label, devices: one entry per worker); ``every`` ignores --placements and --quick."""
    gpus = torch.cuda.device_count() if common.on_gpu() else 0
    dev0 = "cuda:0" if gpus else "cpu"
    m = args.share
    out = [("main", "main thread", [dev0]), ("worker", "1 worker thread", [dev0])]
    if gpus > 1:
        out.append(("per-gpu", f"{gpus} workers, one per GPU", [f"cuda:{i}" for i in range(gpus)]))
    out.append(("shared", f"{m} workers, one {'GPU' if gpus else 'CPU'}", [dev0] * m))
    if gpus > 1:
        out.append(("procs-per-gpu", f"{gpus} processes, one per GPU", [f"cuda:{i}" for i in range(gpus)]))
    out.append(("procs-shared", f"{m} processes, one {'GPU' if gpus else 'CPU'}", [dev0] * m))
    if every:
        return out
    if args.placements:
        wanted = args.placements.split(",")
        out = [p for p in out if p[0] in wanted]
    elif args.quick:
        out = [p for p in out if not p[0].startswith("procs")]
    return out


def warm_then_time(step, plan, device, before_timing=None) -> "common.StepTimer":
    """Warm up (compile, capture), then time ``plan.steps`` steps, each a new cudagraph step."""
    mark = torch.compiler.cudagraph_mark_step_begin
    for _ in range(plan.warmup):
        mark()
        step()
    common.sync()
    if before_timing is not None:
        before_timing()
    timer = common.StepTimer(device)
    timer.begin()
    for _ in range(plan.steps):
        mark()
        timer.start()
        step()
        timer.stop()
    timer.finish()
    return timer


def timed_result(timer: common.StepTimer, busy: Optional[float] = None) -> dict:
    return {"ms": timer.ms, "t0": timer.t0, "t1": timer.t1, "gpu_busy": busy}


def run_main_thread(plan: Plan, device: str) -> list[dict]:
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    step = plan.build(device, 0)
    timer = warm_then_time(step, plan, device)
    busy = None
    if plan.profile:
        probe = common.BusyProbe()
        probe.start()
        for _ in range(plan.profile):
            torch.compiler.cudagraph_mark_step_begin()
            step()
        busy = probe.stop()
    return [timed_result(timer, busy)]


def run_threads(plan: Plan, devices: list[str], recorder: Optional[pyspy.Recorder] = None) -> list[dict]:
    """``recorder``: after the timed (and GPU-busy) steps, every thread keeps stepping while py-spy
    records the process for its --duration (the GIL profile), then stops."""
    import threadgraph

    barrier = threading.Barrier(len(devices))

    class BenchWorker(threadgraph.CompiledWorkerThread):
        def setup(self):
            self.work = plan.build(self.device, self.seed)
            self.timer = common.StepTimer(self.device)
            self.probe = common.BusyProbe()
            self.busy = None

        def step(self):
            i, w, n, p = self.stats.steps, plan.warmup, plan.steps, plan.profile
            if i == w:  # everyone starts timing together, after every warmup (and capture) is done
                common.sync()
                with threadgraph.released():
                    barrier.wait(BARRIER_TIMEOUT_S)
                self.timer.begin()
            if i < w:
                self.work()
            elif i < w + n:
                self.timer.start()
                self.work()
                self.timer.stop()
                if i == w + n - 1:
                    self.timer.finish()
            elif i < w + n + p:
                if i == w + n:
                    self.probe.start()
                self.work()
                if i == w + n + p - 1:
                    self.busy = self.probe.stop()
            else:
                if i == w + n + p:
                    with threadgraph.released():
                        barrier.wait(BARRIER_TIMEOUT_S)
                    if self is workers[0]:
                        recorder.start()
                self.work()
                if recorder.done():
                    self.stop()

    workers = []
    for k, dev in enumerate(devices):
        worker = BenchWorker(dev, name=f"bench-{k}", warmup_steps=plan.warmup,
                             max_steps=None if recorder else plan.warmup + plan.steps + plan.profile)
        worker.seed = k
        workers.append(worker)
    group = threadgraph.WorkerGroup(workers)
    group.on_failure(lambda exc: barrier.abort())
    group.start()
    group.join()
    return [timed_result(w.timer, w.busy) for w in workers]


def _process_entry(rank: int, plan: Plan, devices: list[str], barrier, out_dir: str) -> None:
    device = torch.device(devices[rank])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    step = plan.build(device, rank)
    # t0/t1 are CLOCK_MONOTONIC, comparable across processes on Linux
    timer = warm_then_time(step, plan, device, before_timing=lambda: barrier.wait(BARRIER_TIMEOUT_S))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(timed_result(timer)))


def run_processes(plan: Plan, devices: list[str]) -> list[dict]:
    import torch.multiprocessing as mp

    barrier = mp.get_context("spawn").Barrier(len(devices))
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_process_entry, args=(dataclasses.replace(plan, profile=0), devices, barrier, tmp),
                 nprocs=len(devices), join=True)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(len(devices))]


def summarize(results: list[dict]) -> dict:
    p50s = [common.p50(r["ms"]) for r in results]
    p90s = [common.p90(r["ms"]) for r in results]
    steps = sum(len(r["ms"]) for r in results)
    window = max(r["t1"] for r in results) - min(r["t0"] for r in results)
    busy = [r["gpu_busy"] for r in results if r.get("gpu_busy") is not None]
    return {
        "p50_ms": sum(p50s) / len(p50s),
        "p90_ms": sum(p90s) / len(p90s),
        "per_worker_p50_ms": p50s,
        "wall_ms": sum((r["t1"] - r["t0"]) * 1e3 / len(r["ms"]) for r in results) / len(results),
        "steps_per_s": steps / window if window > 0 else None,
        "gpu_busy": busy[0] if len(busy) == 1 else None,
    }


def gil_summary(gil: list, wall: list) -> dict:
    busy, held, ticks = pyspy.gil_busy(gil, wall)
    return {"gil_busy": busy, "gil_samples": held, "gil_ticks": ticks,
            "gil_leaves": pyspy.top_shares(gil, lambda f: pyspy.short_frame(f[-1]) if f else "?", 6),
            "gil_files": pyspy.top_shares(gil, lambda f: pyspy.frame_file(f[-1]) if f else "?", 6)}


def run_cell(args, mode: str, placement: str, task: str) -> dict:
    """One (mode, placement, task) in this process; an exception becomes an error row."""
    key, label, devices = next(p for p in placements(args, every=True) if p[0] == placement)
    profile = args.profile_steps if key in ("main", "worker") and common.on_gpu() else 0
    plan = Plan(args.model, mode, task, args.warmup, args.steps, profile, args.whole_step_inner)
    row = {"task": task, "placement": key, "configuration": label, "mode": mode, "workers": len(devices)}
    started = time.perf_counter()
    try:
        if key == "main":
            results = run_main_thread(plan, devices[0])
        elif key.startswith("procs"):
            results = run_processes(plan, devices)
        elif args.gil_profile:
            with tempfile.TemporaryDirectory() as tmp:
                pyspy.allow_ptrace()
                recorder = pyspy.Recorder(pyspy.find(), Path(tmp), args.gil_profile, rate=250)
                results = run_threads(plan, devices, recorder)
                recorder.finish()
                row.update(gil_summary(recorder.samples("gil"), recorder.samples("wall")))
        else:
            results = run_threads(plan, devices)
        row.update(summarize(results), steps=args.steps, warmup=args.warmup)
    except Exception as exc:
        traceback.print_exception(exc)  # with the worker's own traceback as the cause
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        cause = exc.__cause__
        if cause is not None and str(cause) not in row["error"]:
            row["error"] += f" (cause: {type(cause).__name__}: {str(cause).splitlines()[0][:200] if str(cause) else ''})"
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


# -- the driver -----------------------------------------------------------------------------------


def run_all(args, rows: list[dict]) -> None:
    """Measure every cell into ``rows`` as it finishes, so an interrupted run keeps what it measured."""
    import threadgraph

    gpu = common.on_gpu()
    modes = args.modes.split(",") if args.modes else list(MODES if gpu else CPU_MODES)
    for mode in modes:
        skip = None
        if not gpu and mode not in CPU_MODES:
            skip = "needs CUDA (CPU reduced form runs eager and compile only)"
        elif mode == "whole-step" and not hasattr(threadgraph, "capture_step"):
            skip = "not available: this threadgraph has no capture_step"
        if skip:
            rows += [{"task": t, "placement": "-", "configuration": "-", "mode": mode, "workers": None, "note": skip}
                     for t in args.tasks.split(",")]
            continue
        for key, label, devices in placements(args):
            for task in args.tasks.split(","):
                row = run_cell_subprocess(args, mode, key, label, len(devices), task)
                print(f"[{mode} / {label} / {task}] " + (f"p50 {row['p50_ms']:.3f} ms" if row.get("p50_ms") else
                      f"error: {row.get('error')}"), file=sys.stderr, flush=True)
                rows.append(row)


def run_cell_subprocess(args, mode: str, key: str, label: str, workers: int, task: str) -> dict:
    """A fresh process per cell: a failed capture can leave CUDA state (the RNG, the allocator) broken."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "cell.json")
        cmd = [sys.executable, str(Path(__file__).resolve()), *args.argv, "--cell", mode, key, task, "--cell-out", str(out)]
        try:
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, timeout=args.cell_timeout)
        except subprocess.TimeoutExpired:
            error = f"timed out after {args.cell_timeout} s"
        else:
            row = json.loads(out.read_text()) if out.exists() else None
            if proc.returncode or row is None or row.get("error"):
                sys.stderr.write(proc.stderr[-4000:])
            if row is not None:
                return row
            lines = [line for line in proc.stderr.splitlines() if line.strip()]
            error = f"exit {proc.returncode}: {lines[-1][:300] if lines else 'no output'}"
    return {"task": task, "placement": key, "configuration": label, "mode": mode, "workers": workers, "error": error}


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


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="timed steps per thread (default 300 on GPU, 40 on CPU)")
    p.add_argument("--warmup", type=int, help="untimed steps first, compile and capture included (default 20; CPU 5)")
    p.add_argument("--model", choices=("small", "dflash"), default="small")
    p.add_argument("--modes", help=f"comma list of {', '.join(MODES)} (default: all; CPU: eager,compile)")
    p.add_argument("--tasks", default="train,infer", help="comma list of train, infer")
    p.add_argument("--placements", help=f"comma list of {', '.join(PLACEMENTS)}")
    p.add_argument("--share", type=int, default=3, help="M, the workers (and processes) sharing one device")
    p.add_argument("--profile-steps", type=int, default=20, help="steps in the GPU-busy window")
    p.add_argument("--whole-step-inner", choices=("eager", "compile"), default="eager",
                   help="what capture_step captures: the eager step or a torch.compile(default) one")
    p.add_argument("--quick", action="store_true", help="few steps, no process placements (CI smoke test)")
    p.add_argument("--cell-timeout", type=int, default=600, help="seconds per cell subprocess")
    p.add_argument("--out-dir", help="results directory (default benchmarks/results)")
    p.add_argument("--append", action="store_true",
                   help="merge into today's results file, replacing only the cells measured again (to split a "
                        "GPU run into several commands, e.g. one per --modes)")
    p.add_argument("--merge-from", metavar="JSON",
                   help="like --append, with the earlier rows from this results JSON (any day)")
    p.add_argument("--gil-profile", type=float, default=0.0, metavar="SECONDS",
                   help="in thread placements, after the timed steps, record the process with py-spy for SECONDS "
                        "(GIL-busy fraction and the frames holding the GIL; needs py-spy, in the bench extra)")
    p.add_argument("--render", metavar="JSON", help="rewrite the .md and .png of a results JSON, then exit")
    p.add_argument("--cell", nargs=3, metavar=("MODE", "PLACEMENT", "TASK"), help=argparse.SUPPRESS)
    p.add_argument("--cell-out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    gpu = common.on_gpu()
    if args.steps is None:
        args.steps = (50 if args.quick else 300) if gpu else (15 if args.quick else 40)
    if args.warmup is None:
        args.warmup = (10 if args.quick else 20) if gpu else (3 if args.quick else 5)
    if args.quick and args.profile_steps == 20:
        args.profile_steps = 5
    bad_modes = [m for m in (args.modes or "").split(",") if m and m not in MODES]
    if bad_modes:
        p.error(f"unknown modes {bad_modes}; choose from {', '.join(MODES)}")
    bad_placements = [k for k in (args.placements or "").split(",") if k and k not in PLACEMENTS]
    if bad_placements:
        p.error(f"unknown placements {bad_placements}; choose from {', '.join(PLACEMENTS)}")
    unknown = set(args.tasks.split(",")) - set(TASKS)
    if unknown:
        p.error(f"unknown tasks {sorted(unknown)}; use train, infer")
    if args.merge_from and not Path(args.merge_from).is_file():
        p.error(f"--merge-from {args.merge_from}: no such file")
    if args.gil_profile < 0:
        p.error("--gil-profile takes seconds >= 0")
    if args.gil_profile and pyspy.find() is None:
        p.error("--gil-profile needs py-spy: pip install py-spy (or threadgraph's bench extra)")
    if args.warmup < 3 or args.steps < 1 or args.share < 1:
        p.error("need --warmup >= 3 (compile and capture happen there), --steps >= 1, --share >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    common.exit_on_sigterm()
    if args.render:
        render(Path(args.render))
        return 0
    if args.cell:
        if not common.on_gpu():
            torch.set_num_threads(1)  # see CPU_THREADS_NOTE
        common.finish_cell(args.cell_out, run_cell(args, *args.cell))  # a row
    env = common.environment()
    started, rows = time.perf_counter(), []
    try:
        run_all(args, rows)
    except (KeyboardInterrupt, SystemExit):  # a timeout or Ctrl-C: write the cells done so far, then stop
        if rows:
            print(f"interrupted after {len(rows)} cells; writing those", file=sys.stderr, flush=True)
            write_results(args, env, rows, started, interrupted=True)
        raise
    write_results(args, env, rows, started, interrupted=False)
    return 0


def write_results(args, env: dict, rows: list[dict], started: float, interrupted: bool) -> None:
    out = common.results_dir(args.out_dir)
    stem = common.results_stem(env, ("" if args.model == "small" else "_dflash-step") + ("_gil" if args.gil_profile else ""))
    rows = [dict(r, date=env["date"]) for r in rows]
    if args.merge_from or args.append:
        rows = merge_previous(Path(args.merge_from) if args.merge_from else out / f"{stem}.json", rows)
    rows = in_order(rows)
    add_ratios(rows)
    common.write_json(out / f"{stem}.json", {"benchmark": "replay_step_time", "env": env, "args": vars(args),
                                             "seconds": round(time.perf_counter() - started, 1),
                                             "interrupted": interrupted, "rows": rows})
    print(write_views(out / stem, args, env, rows, interrupted))
    print(f"\nwrote {out / stem}.{{json,md,png}}", file=sys.stderr)


def write_views(stem: Path, args, env: dict, rows: list[dict], interrupted: bool) -> str:
    """The markdown report and the plot beside a results JSON; returns the report."""
    text = report(args, env, rows, interrupted)
    Path(f"{stem}.md").write_text(text)
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

if __name__ == "__main__":
    sys.exit(main())
