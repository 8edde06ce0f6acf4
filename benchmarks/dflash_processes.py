"""The ``processes`` pipeline of ``dflash_throughput.py``: one process per device, as a user would
run data parallelism without threads (SpecForge-style), launched by torchrun.

    torchrun --standalone --nproc-per-node N benchmarks/dflash_processes.py --cell-config JSON --cell-out FILE

Each rank runs the colocated loop on its own device with the trainer's own components
(``examples.dflash_trainer.pipeline``): for each of its batches the target stage, then its one
drafter replica's forward-backward, the gradient average over all ranks
(``routing.GradientAverager``: NCCL on GPUs, gloo on a CPU) and the update. The run's batches,
``max_steps x drafters`` of the threaded run, are split over the ranks (global batch b is rank
b % N's, ``ShardBatches``); the same number of warmup batches as the other pipelines is left out
of tokens/s. The ranks share the cell's Inductor cache, as torchrun ranks on one node do.
Rank 0 writes the cell's result: tokens/s over all ranks, startup seconds (from
``Pipeline.build`` to the end of the warmup rounds, every rank synchronised), and whether every
rank ended with the same drafter weights (the average reached them all).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

from . import common

import torch
import torch.distributed as dist


def rank_config(cfg, world: int):
    """Each rank's config: one target and one drafter replica, and its share of the run's batches."""
    batches = cfg.max_steps * cfg.drafters
    return dataclasses.replace(cfg, targets=1, drafters=1, max_steps=-(-batches // world))


def run_rank(cfg, warmup_batches: int) -> dict:
    """This rank's loop (see the module docstring); returns rank 0's result, {} on the others."""
    from examples.dflash_trainer import distributed
    from examples.dflash_trainer.pipeline import Pipeline
    from examples.dflash_trainer.routing import GradientAverager

    if cfg.device_list == ["cpu"]:  # gloo for CPU tensors, even where CUDA would make it NCCL
        dist.init_process_group("gloo")
    distributed.init_from_env()
    world, rank = dist.get_world_size(), dist.get_rank()
    t0 = time.perf_counter()
    parts = Pipeline.build(rank_config(cfg, world))
    device = torch.device(parts.devices[0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    stage, replica = parts.target_stage(device), parts.replica(device)
    batches, averager = parts.batches(0), GradientAverager(1)
    rounds = parts.schedule.total_steps
    warm = min(rounds - 1, -(-warmup_batches // world))
    startup_s = wall0 = None
    for r in range(rounds):
        if r == warm:
            _synchronise(device)
            startup_s = time.perf_counter() - t0
            wall0 = time.perf_counter()
        torch.compiler.cudagraph_mark_step_begin()
        _, batch = stage.step(batches)
        replica.train_step(batch, average=lambda grads: averager.average(0, grads))
    _synchronise(device)
    seconds = time.perf_counter() - wall0
    weights = torch.cat([p.detach().float().flatten() for p in replica.drafter.parameters() if p.requires_grad])
    high, low = weights.clone(), weights.clone()  # over the ranks: equal when the average reached every rank
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    result = {
        "tokens_per_s": world * (rounds - warm) * cfg.batch_size * cfg.seq_len / seconds,
        "processes": world,
        "timed_batches": world * (rounds - warm),
        "warmup_batches": world * warm,
        "startup_s": startup_s,
        "devices": [str(d) for d in _all_devices(device, world)],
        "mode": parts.policy.mode,
        "loss_last": float(replica.history[-1, 0]),
        "ranks_weights_max_diff": float((high - low).max()),
        "compile_phases_s": common.compile_phases(),
    }
    distributed.shutdown(finished=True)
    return result if rank == 0 else {}


def _synchronise(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _all_devices(device: torch.device, world: int) -> list:
    gathered = [None] * world
    dist.all_gather_object(gathered, str(device))
    return gathered


def run_cell(cfg, processes: int, cell_timeout: int, cache_dir: str) -> dict:
    """Launch the ranks with torchrun (Inductor cache: ``cache_dir``, else an empty one) and
    return rank 0's result, or {"error": ...}."""
    return common.run_cell([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                            str(processes), "-m", "benchmarks.dflash_processes", "--cell-config", json.dumps(cfg.to_dict()),
                            "--cell-out"], cache_dir, cell_timeout)


def main(argv=None) -> int:
    from examples.dflash_trainer.config import TrainConfig
    from examples.dflash_trainer.run.metrics import LOG_EVERY

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cell-config", required=True, help="the TrainConfig as JSON (dflash_throughput.py writes it)")
    p.add_argument("--cell-out", required=True, help="where rank 0 writes its result")
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    if not common.on_gpu():
        torch.set_num_threads(1)
    cfg = TrainConfig.from_dict(json.loads(args.cell_config))
    result = run_rank(cfg, warmup_batches=LOG_EVERY * cfg.drafters)
    if int(os.environ.get("RANK", "0")) == 0:
        common.finish_cell(args.cell_out, result, default=str)
    # The other ranks end the same way, without interpreter teardown (finish_cell says why); the
    # process group is already down (distributed.shutdown waited for every rank).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
