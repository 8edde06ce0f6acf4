"""The stages drafter replica 0 runs after its optimizer step, in order and each when due: log
the training metrics (every process), evaluate tau and save a checkpoint (process 0 only).

They run on replica 0's thread because they read its weights at a step boundary: the other
replicas wait for it at the next gradient average, so nothing changes the weights meanwhile.
A stop request (SIGINT/SIGTERM, see run.control.RunControl) is honoured there too: the lead saves a
checkpoint of the step just completed and stops the workers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

import torch

from .run.checkpoint import Checkpointer
from .eval import Evaluator
from .run.metrics import TrainingLog
from .drafter.replica import DrafterReplica
from .run.control import RunControl


class Lead:
    def __init__(self, log: TrainingLog, *, control: RunControl, start_step: int,
                 evaluator: Optional[Callable[[torch.device], Evaluator]], eval_every: int,
                 checkpointer: Optional[Checkpointer], checkpoint_every: int) -> None:
        self.log, self.control, self.start_step = log, control, start_step
        self._make_evaluator, self.eval_every = evaluator, eval_every
        self.checkpointer, self.checkpoint_every = checkpointer, checkpoint_every
        self.evaluator: Optional[Evaluator] = None
        self.replica: Optional[DrafterReplica] = None
        self.baseline: Optional[dict] = None
        self.eval: Optional[dict] = None

    def setup(self, replica: DrafterReplica, device: torch.device) -> None:
        """In replica 0's setup: the evaluator's target, and tau before training (fresh runs)."""
        self.replica = replica
        if self._make_evaluator is not None:
            self.evaluator = self._make_evaluator(device)
            if self.start_step == 0:
                self.baseline = self.evaluator.baselines(replica.drafter)

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

    def save_on_interrupt(self) -> Optional[Path]:
        """After Ctrl-C: checkpoint the steps replica 0 completed (its step boundary is consistent);
        None when this process saves no checkpoints or no step completed."""
        replica = self.replica
        if replica is None or self.checkpointer is None or replica.step == self.start_step:
            return None
        return self._save(replica, replica.step)

    def results(self) -> dict:
        out = self.log.results()
        if self.baseline is not None:
            out["baseline"] = self.baseline
        if self.eval is not None:
            out["eval"] = self.eval
        if self.checkpointer is not None and self.checkpointer.saved is not None:
            out["checkpoint"] = str(self.checkpointer.saved)
        return out

    def _save(self, replica: DrafterReplica, step: int) -> Path:
        return self.checkpointer.save(step, replica.drafter, replica.optimizer, replica.scheduler)
