"""The two kinds of worker thread, thin adapters that drive the pipeline's components: a target
worker runs a TargetStage over its shard of the batches; a drafter worker trains one
DrafterReplica on the batches the hand-off routes to it."""

from __future__ import annotations

import functools
import logging
import threading
import time
from typing import Callable, Optional

import torch

import threadgraph

from .data.records import ShardBatches
from .lead import Lead
from .run.metrics import PhaseTimes
from .run.warmers import WarmerWait
from .drafter.replica import DrafterReplica
from .channel import ChannelClosed
from .routing import GradientAverager, Handoff
from .target_stage import TargetStage

log = logging.getLogger("dflash")

# What a worker blocked on a peer sees when the run stops at a step boundary: not a failure.
_WOKEN = (ChannelClosed, threading.BrokenBarrierError)


class _Worker(threadgraph.CompiledWorkerThread):
    """What both kinds share: the first step's wait for a compile warmer (run/warmers.py), shown as
    the worker's activity, which the startup line reports."""

    _warmed: Optional[WarmerWait] = None
    _waiting: Optional[tuple[str, float]] = None  # what the worker waits for, since when (monotonic)
    phases: PhaseTimes

    @property
    def activity(self) -> tuple[str, float]:
        waiting = self._waiting
        if waiting is not None:
            return waiting[0], time.monotonic() - waiting[1]
        return super().activity

    def _wait_for_warmer(self) -> bool:
        """Wait for the compile warmer with the GIL and the device gate released (other workers go
        on meanwhile); False when the run stopped meanwhile."""
        warmer, self._warmed = self._warmed, None
        log.info("dflash: %s: waiting for the %s compile warmer (pid %d, log %s)", self.name, warmer.part,
                 warmer.pid, warmer.log_path)
        began = time.monotonic()
        self._waiting = (f"waiting for the {warmer.part} compile warmer (pid {warmer.pid})", began)
        try:
            with threadgraph.released():
                outcome = warmer.wait()
        finally:
            self._waiting = None
        log.info("dflash: %s: waited %.1f s for the %s compile warmer: %s", self.name, time.monotonic() - began,
                 warmer.part, outcome)
        self.phases.mark("compile_warmer")
        return not self.stopping


class TargetWorker(_Worker):
    """Global batch b of shard ``index``: host data and anchor draws, the target stage on the
    device, then the hand-off to drafter b % D."""

    def __init__(self, index: int, device: str, *, stage: Callable[[torch.device], TargetStage],
                 batches: ShardBatches, handoff: Handoff, warmed: Optional[WarmerWait] = None) -> None:
        super().__init__(device, name=f"target-{index}", warmup_steps=3)
        self._build, self.batches, self.handoff = stage, batches, handoff
        self.phases = PhaseTimes()
        self._warmed = warmed  # the compile warmer that compiles the step first (run/warmers.py)

    def setup(self) -> None:
        self.stage = self._build(self.device)  # WorkerGroup runs setups one at a time

    def step(self) -> None:
        if self.batches.done:
            self.stop()
            return
        self.phases.begin()
        if self._warmed is not None:
            if not self._wait_for_warmer():
                return
        b, item = self.stage.step(self.batches, mark=self.phases.mark)
        try:
            self.handoff.put(b, item)
        except _WOKEN:
            if self.stopping:  # the run stopped (or a peer failed): leave quietly
                return
            raise
        self.phases.mark("hand_off")


class DrafterWorker(_Worker):
    """One data-parallel replica: its next batch, forward and backward, the gradient average over
    all replicas, the update; replica 0 then runs the lead stages (log, eval, checkpoint)."""

    def __init__(self, index: int, device: str, *, replica: Callable[[torch.device], DrafterReplica],
                 handoff: Handoff, averager: GradientAverager, lead: Optional[Lead] = None,
                 example: Optional[Callable[[torch.device], dict]] = None,
                 warmed: Optional[WarmerWait] = None) -> None:
        super().__init__(device, name=f"drafter-{index}", warmup_steps=3)
        self.index, self._build, self.handoff, self.averager, self.lead = index, replica, handoff, averager, lead
        self.phases = PhaseTimes()
        # a partial, not a method: no frame of its own between the step and the averager in a profile
        self._average = functools.partial(averager.average, index)
        self._updated = averager.updated
        # An example item to compile the step on at the first step, while the targets compile.
        self._example = example
        self._warmed = warmed  # the compile warmer that compiles the step first (run/warmers.py)

    def setup(self) -> None:
        self.replica = self._build(self.device)  # WorkerGroup runs setups one at a time
        if self.lead is not None:
            self.lead.setup(self.replica, self.device)

    def step(self) -> None:
        replica = self.replica
        if replica.finished:
            self.stop()
            return
        self.phases.begin()
        if self._warmed is not None:  # before the lead's first step: a stop meanwhile ends the run at once
            if not self._wait_for_warmer():
                return
        if self.lead is not None:
            self.lead.before_step()
        if self._example is not None:
            example, self._example = self._example, None
            if replica.compiles:
                replica.warm_up(example(self.device))
                self.phases.mark("compile_ahead")
        try:
            # --grad-accum: all but the step's last micro-batch (their time shows in the wait_batch phase)
            for micro in range(replica.grad_accum - 1):
                replica.forward_backward(self.handoff.get(self.index, self.device), micro)
            batch = self.handoff.get(self.index, self.device)
            self.phases.mark("wait_batch")
            replica.train_step(batch, average=self._average, updated=self._updated, mark=self.phases.mark,
                               micro=replica.grad_accum - 1)
        except _WOKEN:  # from the hand-off or the averager's waits
            if self.stopping:  # the run stopped (or a peer failed): leave quietly
                return
            raise
        if self.lead is not None:
            self.lead.after_step(replica)
            self.phases.mark("leader")  # logging, eval and checkpoints: rare but long
