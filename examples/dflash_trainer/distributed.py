"""Beyond one machine: torchrun starts one process per node; each runs its own targets and
drafters, and drafter gradients are averaged across processes with torch.distributed."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

log = logging.getLogger("dflash")


def init_from_env() -> bool:
    """Join the process group torchrun describes (NCCL on GPU, gloo on CPU); False when alone."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch was built without torch.distributed")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return True


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of processes; (0, 1) outside a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def local_devices(devices: list[str]) -> list[str]:
    """With several processes on one node, each takes its share of the node's devices."""
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if local_world <= 1 or devices == ["cpu"]:
        return devices
    mine = devices[local_rank::local_world]
    if not mine:
        raise ValueError(f"{local_world} processes on this node but only {len(devices)} devices; "
                         "start one process per node (torchrun --nproc-per-node 1)")
    return mine


def shutdown(finished: bool) -> None:
    """Leave the process group. After a finished run every rank first waits for the others: a rank
    that tears gloo down while its peer still finishes its last step can abort the peer
    ("terminate called without an active exception"). After a failure, peers may be stuck in a
    collective, and both the barrier and the teardown could hang: the process exits with the
    group still up instead (as torchtitan does)."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if not finished:
        log.warning("dflash: the run failed; leaving the process group without tearing it down")
        return
    dist.barrier()
    dist.destroy_process_group()
