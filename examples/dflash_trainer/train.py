"""Build the pipeline, start 5 + 3 workers, join, report. The entry point calls ``train(config)``."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import threadgraph

from . import distributed
from .run import config_file, outdir
from .channel import ChannelClosed
from .config import TrainConfig
from .drafter.replica import SharedDrafterWeights
from .lead import Lead
from .run.metrics import MetricsLogger
from .pipeline import Pipeline
from .run.placement import available_devices, place
from .policy import ExecutionPolicy
from .routing import GradientAverager, Handoff
from .run.control import Interrupted, RunControl
from .run.result import RunResult, WorkerResult
from .run.startup import StartupMonitor, past_startup
from .run.tensorboard import TensorBoardLog, check_directory
from .run.warmers import CompileWarmers, WarmerWait, cache_counts
from .workers import DrafterWorker, TargetWorker

log = logging.getLogger("dflash")


def train(config: TrainConfig, progress: Optional[Callable[[dict], None]] = None) -> RunResult:
    with RunControl() as control:  # from the start: a stop during setup ends the run at once
        leader = distributed.rank_env() == 0
        lock = outdir.prepare(config, leader=leader)
        try:
            if leader and config.tensorboard:  # the leader writes the events: refused before anything is built
                check_directory(config.tensorboard)
            return _train(config, progress, control)
        finally:
            if lock is not None:
                lock.release()


def _train(config: TrainConfig, progress: Optional[Callable[[dict], None]], control: RunControl) -> RunResult:
    began = time.perf_counter()
    warmers = None
    try:
        # Before the build, so that the warmers compile while this process loads and builds.
        warmers = CompileWarmers.start(config) if _warms(config) else None
        return _run(config, progress, control, began, warmers)
    finally:
        if warmers is not None:
            warmers.stop()


def _warms(config: TrainConfig) -> bool:
    """Whether this run starts compile warmers: asked for, its steps compile, one process."""
    if not config.compile_warmers:
        return False
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        log.info("dflash: --compile-warmers: under torchrun each rank compiles for itself; no warmers")
        return False
    if not ExecutionPolicy.resolve(config, available_devices(config.device_list)).compiles:
        log.info("dflash: --compile-warmers: nothing compiles in this run (eager); no warmers")
        return False
    return True


def _run(config: TrainConfig, progress: Optional[Callable[[dict], None]], control: RunControl, began: float,
         warmers: Optional[CompileWarmers]) -> RunResult:
    caches_before = cache_counts()  # this process's counters are cumulative: the run's own are the difference
    distributed.init_from_env(config.collective_timeout_s)
    parts = Pipeline.build(config)
    placement = place(config.targets, config.drafters, parts.devices)
    handoff = Handoff(config.drafters, first_step=parts.start_step * config.grad_accum,  # rounds of D batches
                      capacity=config.channel_capacity)
    leader = parts.rank == 0
    outdir.clear_overwritten(config, leader=leader)  # the inputs are checked by now
    if leader:
        config_file.write(config, config.out_dir)  # what --resume reads again
    watchdog = distributed.Watchdog(config.collective_timeout_s) if parts.world > 1 else None
    # Drafters on one device share one copy of the weights; the first of them steps it.
    owners = placement.owners
    weights = SharedDrafterWeights()
    averager = GradientAverager(config.drafters, owners=owners, control=control, watchdog=watchdog)
    if leader and parts.start_step:
        outdir.cut_metrics(Path(config.out_dir) / outdir.METRICS, parts.start_step)
    metrics = MetricsLogger(Path(config.out_dir) / outdir.METRICS) if leader else None
    board = TensorBoardLog(config.tensorboard, workers=lambda: group.workers) if leader and config.tensorboard else None
    lead = Lead(parts.training_log(metrics, board.chain(progress) if board else progress), control=control,
                start_step=parts.start_step,
                evaluator=parts.evaluator if leader and config.eval_every else None, eval_every=config.eval_every,
                checkpointer=parts.checkpointer if leader and not config.no_checkpoints else None,
                checkpoint_every=config.checkpoint_every,
                startup_done=lambda: past_startup(group.workers))

    def ready(part: str, device: str) -> Optional[WarmerWait]:  # what a worker's first step waits for
        # A warmer compiles on the first device: the caches key on the device, so only its workers wait.
        return None if warmers is None or device != parts.devices[0] else warmers.waiter(part)

    targets = [TargetWorker(i, d, stage=parts.target_stage, batches=parts.batches(i), handoff=handoff,
                            warmed=ready("target", d)) for i, d in enumerate(placement.targets)]
    drafters = [DrafterWorker(i, d, replica=functools.partial(parts.replica, weights=weights, steps_optimizer=i in owners),
                              handoff=handoff, averager=averager, lead=lead if i == 0 else None,
                              example=parts.example_item, warmed=ready("drafter", d))
                for i, d in enumerate(placement.drafters)]
    group = threadgraph.WorkerGroup(targets + drafters)
    group.on_failure(lambda error: (handoff.fail(error), averager.abort(error),  # wake every blocked worker
                                    warmers is not None and warmers.stop()))

    def stop_workers() -> None:  # on replica 0's thread, at the step boundary, after the save
        group.stop()
        handoff.fail(ChannelClosed("the run is stopping"))
        averager.abort()
        if warmers is not None:
            warmers.stop()

    control.on_stop(stop_workers)
    log.info("dflash: %s; %d steps; %s", placement.describe(), parts.schedule.total_steps, parts.policy.mode)
    finished = False
    try:
        with _switch_interval(config.switch_interval_s):
            built_s = time.perf_counter() - began
            group.start()
            monitor = StartupMonitor(group.workers, progress,
                                     background=lambda: [b for b in (lead.background,) if b is not None]).start()
            try:
                group.join()
            finally:
                monitor.stop()
        finished = control.stopped_at is None
    except KeyboardInterrupt as interrupt:  # a signal before the first step, or a caller's
        group.stop()  # join stops the workers itself; an interrupt while they start has not
        raise control.interrupted(lead.save_on_interrupt(),
                                  forced=isinstance(interrupt, Interrupted) and interrupt.forced) from interrupt
    except Exception:
        if control.signum is not None and parts.world > 1:  # a peer that left first, while stopping
            log.exception("dflash: while stopping")
            raise Interrupted(None, control.signum) from None
        raise
    finally:
        if not finished:
            lead.abandon()
        if watchdog is not None:
            watchdog.close()
        if metrics is not None:
            metrics.close()
        if board is not None:
            board.close()
        distributed.shutdown(finished or control.stopped_at is not None)
    if control.stopped_at is not None:
        raise control.stopped(lead.checkpointer.saved if lead.checkpointer is not None else None)
    caches = {name: count - caches_before[name] for name, count in cache_counts().items()}
    if warmers is not None:
        warmers.stop()  # the workers are done with them: any still running is recorded as stopped
    _log_compiles(warmers, caches, parts.policy.compiles)
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
            captures=w.stats.captures, steps=w.stats.steps, phases_p50_ms=w.phases.medians(skip=w.warmup_steps),
            phases_warmup_s=w.phases.totals_s(w.warmup_steps))
            for w in group.workers},
        out_dir=str(Path(config.out_dir)),
        compile_warmers=warmers.report() if warmers is not None else None,
        compile_caches=caches,
    )


def _log_compiles(warmers: Optional[CompileWarmers], caches: dict[str, int], compiles: bool) -> None:
    """One line on whether the warmers worked: their outcomes and the run's own cache hits."""
    if not compiles:
        return
    said = [f"{part} {r['outcome']} after {r['seconds']:.1f} s" for part, r in warmers.report().items()] \
        if warmers is not None else ["none"]
    log.info("dflash: compile warmers: %s; this run's compiles: FX graph cache %d hits, %d misses; AOTAutograd cache "
             "%d hits, %d misses", ", ".join(said), caches["fxgraph_cache_hit"], caches["fxgraph_cache_miss"],
             caches["autograd_cache_hit"], caches["autograd_cache_miss"])


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
