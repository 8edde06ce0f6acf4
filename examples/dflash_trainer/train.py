"""Build the pipeline, start 5 + 3 workers, join, report. The entry point calls ``train(config)``."""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import threadgraph

from . import distributed, outdir
from .channel import ChannelClosed
from .config import TrainConfig
from .lead import Lead
from .metrics import MetricsLogger
from .pipeline import Pipeline
from .placement import place
from .routing import GradientAverager, Handoff
from .run_result import RunResult, WorkerResult
from .startup import StartupMonitor
from .workers import DrafterWorker, TargetWorker

log = logging.getLogger("dflash")


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run; ``checkpoint`` is the one saved on the way out,
    or None; ``signum`` the signal; ``step`` the step the run stopped after, if it got that far."""

    def __init__(self, checkpoint: Optional[Path], signum: int = signal.SIGINT, step: Optional[int] = None,
                 *, forced: bool = False) -> None:
        super().__init__(checkpoint)
        self.checkpoint, self.signum, self.step = checkpoint, signum, step
        self.forced = forced  # a second signal during setup: exit without waiting for the workers


class StopSignals:
    """SIGINT and SIGTERM while a run trains: the first asks the lead to checkpoint at the next
    step boundary and stop (under torchrun every rank agrees on that step, see
    GradientAverager); more signals meanwhile (torchrun sends SIGINT and SIGTERM together) are
    ignored, so the save is not cut short. Before the first step (setup: nothing to save) every
    signal raises KeyboardInterrupt at once: the first stops the workers, which finish the setup
    call they are in (a model load cannot be cut short), and another one stops waiting for them.
    Installed only from the main thread."""

    def __init__(self) -> None:
        self.lead: Optional[Lead] = None  # set once the workers exist
        self.signum: Optional[int] = None
        self.requested = threading.Event()
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        in_setup = self.lead is None or not self.lead.stepping
        if self.signum is not None and not in_setup:
            log.warning("dflash: %s: already stopping after %s; waiting for the checkpoint", name,
                        signal.Signals(self.signum).name)
            return
        if in_setup:
            log.warning("dflash: %s during setup: stopping%s", name, " without waiting for the workers"
                        if self.signum is not None else "; the workers finish their current setup call first "
                        "(send it again to stop waiting)")
            forced, self.signum = self.signum is not None, self.signum or signum
            raise Interrupted(None, self.signum, forced=forced)
        self.signum = signum
        log.warning("dflash: %s: saving a checkpoint at the next step boundary, then stopping", name)
        self.requested.set()


def train(config: TrainConfig, progress: Optional[Callable[[dict], None]] = None) -> RunResult:
    with StopSignals() as signals:  # from the start: a stop during setup ends the run at once
        lock = outdir.prepare(config, leader=distributed.rank_env() == 0)
        try:
            return _train(config, progress, signals)
        finally:
            if lock is not None:
                lock.release()


def _train(config: TrainConfig, progress: Optional[Callable[[dict], None]], signals: StopSignals) -> RunResult:
    began = time.perf_counter()
    distributed.init_from_env(config.collective_timeout_s)
    parts = Pipeline.build(config)
    placement = place(config.targets, config.drafters, parts.devices)
    handoff = Handoff(config.drafters, first_step=parts.start_step, capacity=config.channel_capacity)
    leader = parts.rank == 0
    outdir.clear_overwritten(config, leader=leader)  # the inputs are checked by now
    watchdog = distributed.Watchdog(config.collective_timeout_s) if parts.world > 1 else None
    averager = GradientAverager(config.drafters, stop_requested=signals.requested.is_set, watchdog=watchdog)
    if leader and parts.start_step:
        outdir.cut_metrics(Path(config.out_dir) / outdir.METRICS, parts.start_step)
    metrics = MetricsLogger(Path(config.out_dir) / outdir.METRICS) if leader else None
    lead = Lead(parts.training_log(metrics, progress), start_step=parts.start_step,
                evaluator=parts.evaluator if leader and config.eval_every else None, eval_every=config.eval_every,
                checkpointer=parts.checkpointer if leader else None, checkpoint_every=config.checkpoint_every)
    targets = [TargetWorker(i, d, stage=parts.target_stage, batches=parts.batches(i), handoff=handoff)
               for i, d in enumerate(placement.targets)]
    drafters = [DrafterWorker(i, d, replica=parts.replica, handoff=handoff, averager=averager,
                              lead=lead if i == 0 else None)
                for i, d in enumerate(placement.drafters)]
    group = threadgraph.WorkerGroup(targets + drafters)
    group.on_failure(lambda error: (handoff.fail(error), averager.abort(error)))  # wake every blocked worker
    signals.lead = lead
    # Alone, a stop request is this process's; across processes, the sum the averager reduced.
    lead.should_stop = (lambda: averager.stop_agreed) if parts.world > 1 else signals.requested.is_set

    def stop_workers() -> None:  # on replica 0's thread, at the step boundary, after the save
        group.stop()
        handoff.fail(ChannelClosed("the run is stopping"))
        averager.abort()

    lead.on_stop = stop_workers
    log.info("dflash: %s; %d steps; %s", placement.describe(), parts.schedule.total_steps, parts.policy.mode)
    finished = False
    try:
        with _switch_interval(config.switch_interval_s):
            built_s = time.perf_counter() - began
            group.start()
            monitor = StartupMonitor(group.workers, progress).start()
            try:
                group.join()
            finally:
                monitor.stop()
        finished = lead.stopped_at is None
    except KeyboardInterrupt as interrupt:  # a signal before the first step, or a caller's
        group.stop()  # join stops the workers itself; an interrupt while they start has not
        raise Interrupted(lead.save_on_interrupt(), signals.signum or signal.SIGINT,
                          forced=getattr(interrupt, "forced", False)) from interrupt
    except Exception:
        if signals.signum is not None and parts.world > 1:  # a peer that left first, while stopping
            log.exception("dflash: while stopping")
            raise Interrupted(None, signals.signum) from None
        raise
    finally:
        if watchdog is not None:
            watchdog.close()
        if metrics is not None:
            metrics.close()
        distributed.shutdown(finished or lead.stopped_at is not None)
    if lead.stopped_at is not None:
        saved = lead.checkpointer.saved if lead.checkpointer is not None else None
        raise Interrupted(saved, signals.signum or signal.SIGTERM, lead.stopped_at)
    return RunResult(
        rank=parts.rank, world=parts.world, total_steps=parts.schedule.total_steps, start_step=parts.start_step,
        **lead.results(),
        placement=placement.describe(),
        mode=parts.policy.mode,
        gil_switch_interval_ms=(config.switch_interval_s or sys.getswitchinterval()) * 1000,
        target_report=parts.target_report,
        # From train() to the last worker's end of warmup: build (load, assets) + the slowest warmup.
        startup_s=round(built_s + max(w.stats.warmup_seconds for w in group.workers), 2),
        build_s=round(built_s, 2),
        workers={w.name: WorkerResult(
            device=str(w.device), p50_ms=w.stats.p50_ms, p90_ms=w.stats.p90_ms,
            setup_s=round(w.stats.setup_seconds, 2), first_step_at_s=round(w.stats.steps_began_at, 2),
            warmup_s=round(w.stats.warmup_seconds, 2), compile_s=round(w.stats.compile_seconds, 2),
            capture_s=round(w.stats.capture_seconds, 2), peer_compile_wait_s=round(w.stats.turn_wait_seconds, 2),
            captures=w.stats.captures, steps=w.stats.steps, phases_p50_ms=w.phases.medians(skip=w.warmup_steps))
            for w in group.workers},
        out_dir=str(Path(config.out_dir)),
    )


@contextlib.contextmanager
def _switch_interval(seconds: Optional[float]):
    """Run with this GIL switch interval, then restore the process's own."""
    previous = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
        log.info("dflash: GIL switch interval %.3g ms (was %.3g ms)", seconds * 1000, previous * 1000)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
