"""Build the pipeline, start 5 + 3 workers, join, report. The entry point calls ``train(config)``."""

from __future__ import annotations

import contextlib
import logging
import sys
from pathlib import Path
from typing import Callable, Optional

import threadgraph

from . import distributed
from .config import TrainConfig
from .lead import Lead
from .metrics import MetricsLogger
from .pipeline import Pipeline
from .placement import place
from .routing import GradientAverager, Handoff
from .workers import DrafterWorker, TargetWorker

log = logging.getLogger("dflash")


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run; ``checkpoint`` is the one saved on the way out, or None."""

    def __init__(self, checkpoint: Optional[Path]) -> None:
        super().__init__(checkpoint)
        self.checkpoint = checkpoint


def train(config: TrainConfig, progress: Optional[Callable[[dict], None]] = None) -> dict:
    distributed.init_from_env()
    parts = Pipeline.build(config)
    placement = place(config.targets, config.drafters, parts.devices)
    handoff = Handoff(config.drafters, first_step=parts.start_step, capacity=config.channel_capacity)
    averager = GradientAverager(config.drafters)
    leader = parts.rank == 0
    metrics = MetricsLogger(Path(config.out_dir) / "metrics.jsonl") if leader else None
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
    log.info("dflash: %s; %d steps; %s", placement.describe(), parts.schedule.total_steps, parts.policy.mode)
    finished = False
    try:
        with _switch_interval(config.switch_interval_s):
            group.start()
            group.join()
        finished = True
    except KeyboardInterrupt as interrupt:
        raise Interrupted(lead.save_on_interrupt()) from interrupt
    finally:
        if metrics is not None:
            metrics.close()
        distributed.shutdown(finished)
    return {
        "rank": parts.rank, "world": parts.world, "total_steps": parts.schedule.total_steps,
        "start_step": parts.start_step, **lead.results(),
        "placement": placement.describe(),
        "mode": parts.policy.mode,
        "gil_switch_interval_ms": (config.switch_interval_s or sys.getswitchinterval()) * 1000,
        "target_report": parts.target_report,
        "workers": {w.name: {"device": str(w.device), "p50_ms": w.stats.p50_ms, "p90_ms": w.stats.p90_ms,
                             "warmup_s": round(w.stats.warmup_seconds, 2), "captures": w.stats.captures,
                             "steps": w.stats.steps, "phases_p50_ms": w.phases.medians(skip=w.warmup_steps)}
                    for w in group.workers},
        "out_dir": str(Path(config.out_dir)),
    }


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
