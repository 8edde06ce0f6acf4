"""The sequential cell of dflash_throughput: the threaded trainer's training done by one thread, on
the trainer's own components and step functions, with the probes that give the GPU-bound limit
and the host time a batch (dflash_report turns them into the headline figures)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repo root and src/ on sys.path)
import thread_profile  # noqa: E402
from results_schema import AS_THREADED  # noqa: E402

import torch  # noqa: E402

PROBE_ROUNDS = 5  # rounds of the host-time probe, and again of the GPU-time probe


def run_sequential(cfg, warmup_batches: int) -> dict:
    """The threaded trainer's training, done by one thread: each round (one drafter step), for each
    drafter d in turn the target stage of global batch b = round * drafters + d on d's device, then
    d's forward-backward; then the mean of the round's gradients (``routing.mean_into``, as the
    threads' averager makes it) and the update of each device's shared weights by their owner.
    The same replicas, placement, schedule and optimizer steps as the threads: only the threads go.

    Rounds: warmup (compilation, capture; startup_s ends with it), then PROBE_ROUNDS of the host
    probe (the device is synchronised before and after each batch, so the perf_counter span around
    its Python work is host time alone, which holds the GIL; the round's averaging and updates are
    timed with its last batch), then, on GPU, PROBE_ROUNDS under torch.profiler (each device's
    kernel-busy time: the GPU time of a batch; and its kernels by name, per batch:
    thread_profile.probe_kernels), then the timed rounds of tokens/s."""
    from examples.dflash_trainer.drafter.replica import SharedDrafterWeights
    from examples.dflash_trainer.pipeline import Pipeline
    from examples.dflash_trainer.placement import place
    from examples.dflash_trainer.routing import mean_into

    t0 = time.perf_counter()
    parts = Pipeline.build(cfg)
    placement = place(cfg.targets, cfg.drafters, parts.devices)
    devices = [torch.device(d) for d in placement.drafters]
    weights, owners = SharedDrafterWeights(), placement.owners
    drafters = []
    for d, device in enumerate(devices):
        if device.type == "cuda":
            torch.cuda.set_device(device)
        drafters.append((parts.target_stage(device), parts.replica(device, weights=weights, steps_optimizer=d in owners)))
    setup_s = time.perf_counter() - t0
    batches = [parts.batches(shard) for shard in range(cfg.targets)]  # global batch b is shard b % T's
    rounds = parts.schedule.total_steps
    on_gpu = devices[0].type == "cuda"

    warm_rounds = min(rounds - 1, -(-warmup_batches // len(drafters)))
    probe = max(0, min(PROBE_ROUNDS, (rounds - warm_rounds - 1) // (2 if on_gpu else 1)))
    host_end, gpu_end = warm_rounds + probe, warm_rounds + probe * (2 if on_gpu else 1)
    fwd_timer, step_timer = common.StepTimer(devices[0]), common.StepTimer(devices[0])
    wall = common.StepTimer(devices[0])
    busy, host_ms, startup_s, first_round_s, probe_kernels = common.BusyProbe(), [], None, None, None

    # The timers' spans, by the phases the step functions mark: the target's forward; the drafter's
    # forward-backward (its share of the round's averaging and update is not in it).
    timing = {"prepare": [fwd_timer.start], "forward": [fwd_timer.stop, step_timer.start],
              "forward_backward": [step_timer.stop]}

    def timed_mark(phase):
        for call in timing.get(phase, ()):
            call()

    def one_batch(r, d, timed):
        b = r * len(drafters) + d
        stage, replica = drafters[d]
        if stage.device.type == "cuda":
            torch.cuda.set_device(stage.device)
        # The very step functions the trainer's worker threads call (workers.py).
        index, batch = stage.step(batches[b % cfg.targets], mark=timed_mark if timed else None)
        assert index == b, (index, b)
        replica.forward_backward(batch)
        if timed:
            timed_mark("forward_backward")

    def update():
        first = drafters[0][1].grads.buffer
        mean_into(first, [replica.grads.buffer for _, replica in drafters[1:]])
        for d in owners[1:]:
            drafters[d][1].grads.buffer.copy_(first, non_blocking=True)
        for _, replica in drafters:
            replica.update()  # the owners step their device's weights; every replica counts the step

    for r in range(rounds):
        if r == 1:
            _sync_all(devices)
            first_round_s = time.perf_counter() - t0 - setup_s
        if r == warm_rounds:
            _sync_all(devices)
            startup_s = time.perf_counter() - t0
        if r == host_end and on_gpu and probe:
            busy.start()
        if r == gpu_end:
            if on_gpu and probe:
                busy.stop()
                probe_kernels = thread_profile.probe_kernels(busy.prof, probe * len(drafters))
            _sync_all(devices)
            fwd_timer.discard()
            step_timer.discard()
            wall.begin()
        torch.compiler.cudagraph_mark_step_begin()
        hosted, round_ms = warm_rounds <= r < host_end, 0.0
        for d in range(len(drafters)):
            if hosted:
                _sync_all(devices)
                h0 = time.perf_counter()
            one_batch(r, d, timed=d == 0 and r >= gpu_end)
            if d == len(drafters) - 1:
                update()
            if hosted:
                round_ms += (time.perf_counter() - h0) * 1000
                _sync_all(devices)
        if hosted:
            host_ms.append(round_ms / len(drafters))  # a batch's mean, its share of the update in it
    wall.finish()
    fwd_timer.finish()
    step_timer.finish()
    timed_batches = (rounds - gpu_end) * len(drafters)
    seconds = wall.t1 - wall.t0
    return {
        "tokens_per_s": timed_batches * cfg.batch_size * cfg.seq_len / seconds,
        "timed_batches": timed_batches,
        "warmup_batches": warm_rounds * len(drafters),
        "training": AS_THREADED,
        "startup_s": startup_s,
        "setup_s": setup_s,
        "first_round_s": first_round_s,  # its compilation (and warmup runs) of the target and drafter steps
        "compile_phases_s": common.compile_phases(),
        "host_ms_per_batch": common.p50(host_ms),
        "host_probe_batches": len(host_ms),
        # per batch: the probe rounds' batches on that device (one a drafter there, each round)
        "gpu_ms_per_batch_by_device": {str(d): us / 1000 / (probe * sum(x.index == d for x in devices))
                                       for d, us in busy.busy_us.items()}
        if on_gpu and probe else {},
        "gpu_probe_batches_per_device": probe * len(drafters) // len(set(devices)) if on_gpu else 0,
        "gpu_probe_kernels": probe_kernels,  # the probe's kernels by name, per batch (thread_profile.kernel_summary)
        "devices": sorted(set(placement.drafters)),
        "mode": parts.policy.mode,
        "loss_last": float(drafters[0][1].history[-1, 0]),
        "losses": drafters[0][1].history[:, 0].tolist(),  # the mean over the round's batches, a step each
        "target_fwd_p50_ms": common.p50(fwd_timer.ms),
        "drafter_step_p50_ms": common.p50(step_timer.ms),
        "drafter_step_p90_ms": common.p90(step_timer.ms),
        "peak_memory_gib": common.peak_memory_gib(parts.devices),
    }


def _sync_all(devices) -> None:
    for device in dict.fromkeys(devices):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
