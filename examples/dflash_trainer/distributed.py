"""Beyond one machine: torchrun starts one process per node; each runs its own targets and
drafters, and drafter gradients are averaged across processes with torch.distributed."""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time
from typing import Optional

import torch
import torch.distributed as dist

from .errors import EXIT_FAILED, InputError

log = logging.getLogger("dflash")

HEARTBEAT_S = 1.0  # how often each rank bumps its liveness counter in the job's store


class RankStalled(RuntimeError):
    """A collective waited longer than --collective-timeout-s; the message names the ranks."""


def init_from_env(timeout_s: Optional[float] = None) -> bool:
    """Join the process group torchrun describes (NCCL on GPU, gloo on CPU); False when alone.
    ``timeout_s`` bounds every collective (the backend's own timeout, set a little later than the
    Watchdog's so the Watchdog, which names the stalled rank, fires first)."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch was built without torch.distributed")
    if not dist.is_initialized():
        kwargs = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s + 30)}
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", **kwargs)
    return True


def rank_env() -> int:
    """This process's rank as torchrun announces it, before any process group exists."""
    return int(os.environ.get("RANK", "0"))


class Watchdog:
    """Bounds the time a rank spends in a collective, whatever the backend (NCCL or gloo).

    Every rank bumps a liveness counter in the job's store each HEARTBEAT_S from a thread of its
    own, and ``entering(n)`` / ``left()`` bracket the n-th gradient average. A collective that
    has not returned after ``timeout_s`` cannot be cancelled (NCCL and gloo both), so the
    watchdog names the ranks whose liveness counter stopped (suspended, hung or dead) or that
    have not reached average n, prints one line and ends the process with EXIT_FAILED; torchrun
    then ends the other ranks."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._store = dist.distributed_c10d._get_default_store()
        self._entered: Optional[tuple[int, float]] = None
        self._closed = threading.Event()
        self._beats = 0
        self._set("alive", 0)
        self._set("average", 0)
        self._thread = threading.Thread(target=self._run, name="dflash-watchdog", daemon=True)
        self._thread.start()

    def entering(self, n: int) -> None:
        self._set("average", n)
        self._entered = (n, time.monotonic())

    def left(self) -> None:
        self._entered = None

    def close(self) -> None:
        self._closed.set()

    def _set(self, what: str, value: int) -> None:
        self._store.set(f"dflash/{what}/{self.rank}", str(value))

    def _get(self, what: str, rank: int) -> Optional[int]:
        try:
            key = f"dflash/{what}/{rank}"
            return int(self._store.get(key)) if self._store.check([key]) else None
        except Exception:  # the store itself may be gone with its host
            return None

    def _run(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            self._beats += 1
            try:
                self._set("alive", self._beats)
            except Exception:
                return  # the store is gone: the job is ending
            entered = self._entered
            if entered is not None and time.monotonic() - entered[1] > self.timeout_s:
                self._fail(*entered)

    def _fail(self, n: int, since: float) -> None:
        others = [r for r in range(self.world) if r != self.rank]
        before = {r: self._get("alive", r) for r in others}
        time.sleep(3 * HEARTBEAT_S)
        silent = [r for r in others if self._get("alive", r) == before[r]]
        behind = [r for r in others if r not in silent and (self._get("average", r) or 0) < n]
        if silent:
            who = (f"rank {', '.join(map(str, silent))} stopped making progress (no heartbeat for "
                   f"{3 * HEARTBEAT_S:.0f} s: suspended, hung or dead)")
        elif behind:
            who = f"rank {', '.join(map(str, behind))} did not reach gradient average {n} (stuck before it)"
        else:
            who = "every rank is alive and inside this collective (a backend or network hang)"
        message = (f"error: rank {self.rank}: gradient average {n} waited {time.monotonic() - since:.0f} s, longer "
                   f"than --collective-timeout-s {self.timeout_s:g}: {who}; check that host, or raise "
                   f"--collective-timeout-s if steps are legitimately slow")
        log.error("dflash: %s", message)
        print(message, file=sys.stderr, flush=True)
        os._exit(EXIT_FAILED)  # a collective cannot be cancelled; torchrun ends the other ranks


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
        raise InputError(f"{local_world} processes on this node but only {len(devices)} devices; "
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
