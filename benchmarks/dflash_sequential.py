"""The sequential cell of dflash_throughput: the threaded trainer's training done by one thread, on
the trainer's own components and step functions, with the probes that give the GPU-bound limit
and the host time a batch (dflash_throughput.headline turns them into the figures of the results file)."""

from __future__ import annotations

import contextlib
import statistics
import time

from . import common
from . import thread_profile
from .results_schema import AS_THREADED

import torch

PROBE_ROUNDS = 5  # rounds of the host-time probe, and again of the GPU-time probe


def run_sequential(cfg, warmup_batches: int) -> dict:
    """The threaded trainer's training, done by one thread. Each round (one drafter step), for each
    drafter d in turn: global batch b = round * drafters + d through the target stage on its target
    worker's device (target b % targets, as placed for the threads), moved to d's device where that
    differs (the hand-off's copy), then d's forward-backward; then the round's mean gradient
    (``routing.mean_into``, as the threads' averager makes it), each replica's update (the owners
    step their device's shared weights), and every LOG_EVERY rounds the read of drafter 0's history
    that the lead's training log does. The same replicas, placement, schedule, optimizer steps and
    host syncs as the threads: only the threads go.

    Rounds: warmup (compilation, capture; startup_s ends with it), then the timed rounds, whole
    windows of LOG_EVERY rounds timed on the host as the trainer's log times its tokens/s windows
    (tokens_per_s: their median, as the threaded cell's steady figure is), then the probes, after
    the timed rounds so that no profiler has run before them: PROBE_ROUNDS of the host probe (the
    devices are synchronised before and after each batch, so the perf_counter span around its
    Python work is host time alone, which holds the GIL; the round's averaging and updates are
    timed with its last batch), then, on GPU, PROBE_ROUNDS under torch.profiler (each device's
    kernel-busy time a round; and the kernels by name, per batch: thread_profile.probe_kernels)."""
    from examples.dflash_trainer.drafter.replica import SharedDrafterWeights
    from examples.dflash_trainer.pipeline import Pipeline
    from examples.dflash_trainer.run.placement import place
    from examples.dflash_trainer.routing import mean_into
    from examples.dflash_trainer.run.metrics import LOG_EVERY

    t0 = time.perf_counter()
    parts = Pipeline.build(cfg)
    placement = place(cfg.targets, cfg.drafters, parts.devices)
    devices = [torch.device(d) for d in placement.drafters]
    used = [torch.device(d) for d in dict.fromkeys(placement.drafters + placement.targets)]
    weights, owners = SharedDrafterWeights(), placement.owners
    replicas = []
    for d, device in enumerate(devices):
        with _on(device):
            replicas.append(parts.replica(device, weights=weights, steps_optimizer=d in owners))
    stages = {}
    for name in dict.fromkeys(placement.targets):
        with _on(torch.device(name)):
            stages[name] = parts.target_stage(torch.device(name))
    setup_s = time.perf_counter() - t0
    batches = [parts.batches(shard) for shard in range(cfg.targets)]  # global batch b is shard b % T's
    rounds = parts.schedule.total_steps
    on_gpu = devices[0].type == "cuda"

    warm_rounds = min(rounds - 1, -(-warmup_batches // len(replicas)))
    probe = max(0, min(PROBE_ROUNDS, (rounds - warm_rounds - 1) // (3 if on_gpu else 2)))
    probe_start = rounds - probe * (2 if on_gpu else 1)
    host_end = probe_start + probe
    # Whole windows of LOG_EVERY rounds from the end of warmup (rounds past the last whole one train
    # untimed until the probes), as many as fit; one shorter window only when not even one does.
    whole = (probe_start - warm_rounds) // LOG_EVERY * LOG_EVERY
    timed_end = warm_rounds + whole if whole else probe_start
    edges = list(range(warm_rounds, timed_end, LOG_EVERY)) + [timed_end]
    edge_s = []
    fwd_timer, step_timer = common.StepTimer(devices[0]), common.StepTimer(devices[0])
    wall = common.StepTimer(devices[0])
    busy, host_ms, startup_s, first_round_s, probe_kernels = common.BusyProbe(), [], None, None, None

    # The timers' spans, by the phases the step functions mark: the target's forward; the drafter's
    # forward-backward (its share of the round's averaging and update is not in it).
    timing = {"prepare": [fwd_timer.start], "forward": [fwd_timer.stop], "forward_backward": [step_timer.stop]}

    def timed_mark(phase):
        for call in timing.get(phase, ()):
            call()

    def one_batch(r, d, timed):
        b = r * len(replicas) + d
        target = placement.targets[b % cfg.targets]
        with _on(torch.device(target)):
            # The very step functions the trainer's worker threads call (workers.py).
            index, batch = stages[target].step(batches[b % cfg.targets], mark=timed_mark if timed else None)
        assert index == b, (index, b)
        with _on(devices[d]):
            if target != placement.drafters[d]:
                batch = {k: v.to(devices[d], non_blocking=True) for k, v in batch.items()}
            if timed:  # started on the drafter's device, where its stop is recorded
                step_timer.start()
            replicas[d].forward_backward(batch)
            if timed:
                timed_mark("forward_backward")

    def close_timed_span():  # its last window ends when its work has (the trainer's windows end on the
        _sync_all(used)      # history read's sync, the other windows here too)
        edge_s.append(time.perf_counter())
        wall.finish()
        fwd_timer.finish()
        step_timer.finish()

    def update(r):
        first = replicas[0].grads.buffer
        with _on(devices[0]):
            mean_into(first, [replica.grads.buffer for replica in replicas[1:]])
            for d in owners[1:]:
                replicas[d].grads.buffer.copy_(first, non_blocking=True)
        for device, replica in zip(devices, replicas):
            with _on(device):  # a whole-step update graph is bound to the current device
                replica.update()  # the owners step their device's weights; every replica counts the step
        if (r + 1) % LOG_EVERY == 0:  # the training log's read (Lead.after_step): a host sync
            replicas[0].history[r + 1 - LOG_EVERY:r + 1].tolist()

    for r in range(rounds):
        if r == 1:
            _sync_all(used)
            first_round_s = time.perf_counter() - t0 - setup_s
        if r == warm_rounds:
            _sync_all(used)
            startup_s = time.perf_counter() - t0
            fwd_timer.discard()
            step_timer.discard()
            wall.begin()
        if r == timed_end:
            close_timed_span()
        elif r in edges:
            edge_s.append(time.perf_counter())
        if r == host_end and on_gpu and probe:
            busy.start()
        torch.compiler.cudagraph_mark_step_begin()
        hosted, round_ms = probe_start <= r < host_end, 0.0
        for d in range(len(replicas)):
            if hosted:
                _sync_all(used)
                h0 = time.perf_counter()
            one_batch(r, d, timed=d == 0 and warm_rounds <= r < timed_end)
            if d == len(replicas) - 1:
                update(r)
            if hosted:
                round_ms += (time.perf_counter() - h0) * 1000
                _sync_all(used)
        if hosted:
            host_ms.append(round_ms / len(replicas))  # a batch's mean, its share of the update in it
    if on_gpu and probe:
        busy.stop()
        probe_kernels = thread_profile.probe_kernels(busy.prof, probe * len(replicas))
    _sync_all(used)
    if timed_end == rounds:  # no probe rounds: the timed span ran to the end
        close_timed_span()
    round_tokens = len(replicas) * cfg.batch_size * cfg.seq_len
    windows = [(b - a) * round_tokens / (t1 - t0_) for a, b, t0_, t1 in zip(edges, edges[1:], edge_s, edge_s[1:])]
    timed_batches = (timed_end - warm_rounds) * len(replicas)
    seconds = wall.t1 - wall.t0
    return {
        "tokens_per_s": statistics.median(windows),
        "tokens_per_s_overall": timed_batches * cfg.batch_size * cfg.seq_len / seconds,
        "windows_tokens_per_s": windows,
        "timed_batches": timed_batches,
        "warmup_batches": warm_rounds * len(replicas),
        "training": AS_THREADED,
        "startup_s": startup_s,
        "setup_s": setup_s,
        "first_round_s": first_round_s,  # its compilation (and warmup runs) of the target and drafter steps
        "compile_phases_s": common.compile_phases(),
        "host_ms_per_batch": common.p50(host_ms),
        "host_probe_rounds": len(host_ms),
        "host_probe_batches": len(host_ms) * len(replicas),
        # each device's kernel-busy time a round (a round: one batch a drafter, on the devices the
        # threads would use); dflash_throughput.headline turns the busiest into the GPU-bound limit
        "gpu_ms_per_round_by_device": {str(d): us / 1000 / probe for d, us in busy.busy_us.items()}
        if on_gpu and probe else {},
        "batches_per_round": len(replicas),
        "gpu_probe_rounds": probe if on_gpu else 0,
        "gpu_probe_kernels": probe_kernels,  # the probe's kernels by name, per batch (thread_profile.kernel_summary)
        "devices": parts.devices,
        "mode": parts.policy.mode,
        "loss_last": float(replicas[0].history[-1, 0]),
        "losses": replicas[0].history[:, 0].tolist(),  # the mean over the round's batches, a step each
        "target_fwd_p50_ms": common.p50(fwd_timer.ms),
        "drafter_forward_backward_p50_ms": common.p50(step_timer.ms),
        "drafter_forward_backward_p90_ms": common.p90(step_timer.ms),
        "peak_memory_gib": common.peak_memory_gib(parts.devices),
    }


def _on(device: torch.device):
    """Work enqueued on ``device`` (a CUDA device made current; nothing to do on the CPU)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _sync_all(devices) -> None:
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
