"""The stages drafter replica 0 runs after its optimizer step, in order and each when due: log
the training metrics (every process), evaluate tau and save a checkpoint (process 0 only).

They run on replica 0's thread because they read its weights at a step boundary: the other
replicas wait for it at the next gradient average, so nothing changes the weights meanwhile.
A stop request (SIGINT/SIGTERM, see run.control.RunControl) is honoured there too: the lead saves a
checkpoint of the step just completed and stops the workers.

tau before training (the baselines) is the exception: measured in a thread of its own on a copy of
the untrained drafter (BaselineEvaluation), so no worker's startup waits for it. It starts once
every worker is past its startup: an eager forward of the target while another thread traces it is
not safe (transformers' hidden-state collector becomes one process-wide variable while Dynamo
traces, so the eager forward would collect into the tracing thread's outputs).
"""

from __future__ import annotations

import concurrent.futures
import copy
import logging
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from .run.checkpoint import Checkpointer
from .eval import Evaluator
from .run.metrics import TrainingLog
from .drafter.replica import DrafterReplica
from .run.control import RunControl

log = logging.getLogger(__name__)


class BaselineEvaluation:
    """Evaluator.baselines on a copy of the untrained drafter (sharing the target's frozen embedding
    and LM head), in a thread of its own; ``result()`` waits for it and raises what it raised.
    ``name`` and ``activity`` are what the startup line reads, as it does from the workers."""

    name = "baseline"
    POLL_S = 0.2

    def __init__(self, evaluator: Evaluator, drafter: torch.nn.Module,
                 startup_done: Callable[[], bool] = lambda: True) -> None:
        shared = {id(m): m for m in (drafter.embed_tokens, drafter.lm_head)}
        self._drafter = copy.deepcopy(drafter, memo=shared)  # training changes the replica's weights
        self._evaluator, self._startup_done = evaluator, startup_done
        self._future: concurrent.futures.Future = concurrent.futures.Future()
        self._started = time.monotonic()
        self._evaluating: Optional[float] = None  # when the evaluation itself began
        self._abandoned = threading.Event()
        self.seconds: Optional[float] = None  # how long the evaluation took
        self._thread = threading.Thread(target=self._run, name="dflash-baseline", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._startup_done():
                if self._abandoned.wait(self.POLL_S):
                    raise concurrent.futures.CancelledError("the run ended before its workers' startup did")
            self._evaluating = time.monotonic()
            self._future.set_result(self._evaluator.baselines(self._drafter))
        except BaseException as exc:  # travels to whoever waits in result()
            self._future.set_exception(exc)
        finally:
            self._drafter = None  # its memory goes back as soon as it is measured
            self.seconds = round(time.monotonic() - (self._evaluating or self._started), 2)

    @property
    def activity(self) -> tuple[str, float]:
        if self._future.done():
            return "finished", self.seconds or 0.0
        if self._evaluating is None:
            return "waiting for the workers' startup", time.monotonic() - self._started
        return "evaluating tau of the untrained drafter", time.monotonic() - self._evaluating

    def abandon(self) -> None:
        """The run failed or stopped: an evaluation not yet begun never begins; one under way is
        waited for, so no GPU work of it outlives the run."""
        self._abandoned.set()
        if self._thread.is_alive():
            log.info("waiting for the baseline evaluation to end: %s for %.0f s", *self.activity)
            self._thread.join()

    def result(self) -> dict:
        if not self._future.done():
            log.info("waiting for the baseline evaluation (tau of the untrained drafter): %s for %.0f s", *self.activity)
        return self._future.result()


class Lead:
    def __init__(self, log: TrainingLog, *, control: RunControl, start_step: int,
                 evaluator: Optional[Callable[[torch.device], Evaluator]], eval_every: int,
                 checkpointer: Optional[Checkpointer], checkpoint_every: int,
                 startup_done: Callable[[], bool] = lambda: True) -> None:
        self.startup_done = startup_done  # every worker is past its startup (the baseline waits for it)
        self.log, self.control, self.start_step = log, control, start_step
        self._make_evaluator, self.eval_every = evaluator, eval_every
        self.checkpointer, self.checkpoint_every = checkpointer, checkpoint_every
        self.evaluator: Optional[Evaluator] = None
        self.replica: Optional[DrafterReplica] = None
        self.background: Optional[BaselineEvaluation] = None  # tau before training, measured beside it
        self.eval: Optional[dict] = None

    def setup(self, replica: DrafterReplica, device: torch.device) -> None:
        """In replica 0's setup: the evaluator's target, and tau before training (fresh runs)."""
        self.replica = replica
        if self._make_evaluator is not None:
            self.evaluator = self._make_evaluator(device)
            if self.start_step == 0:
                self.background = BaselineEvaluation(self.evaluator, replica.drafter, self.startup_done)

    def before_step(self) -> None:
        """In replica 0's step, before its work: every setup has returned."""
        self.control.began_stepping()

    def after_step(self, replica: DrafterReplica) -> None:
        done = replica.step
        last = done == replica.total_steps
        evaluate = self.evaluator is not None and (done % self.eval_every == 0 or last)
        stop = not last and self.control.should_stop()  # every rank answers alike
        save = self.checkpointer is not None and ((self.checkpoint_every and done % self.checkpoint_every == 0)
                                                  or last or stop)
        if self.log.due(done) or last or evaluate or save:
            self.log.flush(replica.history, done)
        if evaluate:
            self.eval = self.evaluator(replica.drafter)
            self.log.record({"step": done, **{f"eval_{k}": v for k, v in self.eval.items() if k != "accepted_hist"}})
        if save:
            self._save(replica, done)
        if evaluate or save:  # tokens/s counts training, not evaluation or saving
            self.log.restart_window()
        if stop:
            self.control.stop_after(done)

    def abandon(self) -> None:
        """The run failed or stopped before its end: see BaselineEvaluation.abandon."""
        if self.background is not None:
            self.background.abandon()

    def save_on_interrupt(self) -> Optional[Path]:
        """After Ctrl-C: checkpoint the steps replica 0 completed (its step boundary is consistent);
        None when this process saves no checkpoints or no step completed."""
        replica = self.replica
        if replica is None or self.checkpointer is None or replica.step == self.start_step:
            return None
        return self._save(replica, replica.step)

    def results(self) -> dict:
        out = self.log.results()
        if self.background is not None:
            out["baseline"] = self.background.result()
        if self.eval is not None:
            out["eval"] = self.eval
        if self.checkpointer is not None and self.checkpointer.saved is not None:
            out["checkpoint"] = str(self.checkpointer.saved)
        return out

    def _save(self, replica: DrafterReplica, step: int) -> Path:
        return self.checkpointer.save(step, replica.drafter, replica.optimizer, replica.scheduler)
