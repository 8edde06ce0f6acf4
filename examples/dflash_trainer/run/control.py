"""Stopping a run: SIGINT and SIGTERM, the step every process agrees to stop after, the callbacks
that stop the workers there, and what ``train()`` raises when a stop ended the run (``Interrupted``).

``train()`` makes one ``RunControl`` before anything else (a signal during setup ends the run at
once) and hands it at construction to the components that take part: the gradient averager, whose
all-reduce carries this process's stop request and brings back the sum over processes, and the
lead, which marks the end of setup at replica 0's first step, asks at each step boundary whether
to stop, saves and stops there.
"""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Optional

import torch

log = logging.getLogger("dflash")


class Interrupted(KeyboardInterrupt):
    """SIGINT (Ctrl-C) or SIGTERM stopped the run; ``checkpoint`` is the one saved on the way out,
    or None; ``signum`` the signal; ``step`` the step the run stopped after, if it got that far."""

    def __init__(self, checkpoint: Optional[Path], signum: int = signal.SIGINT, step: Optional[int] = None,
                 *, forced: bool = False) -> None:
        super().__init__(checkpoint)
        self.checkpoint, self.signum, self.step = checkpoint, signum, step
        self.forced = forced  # a second signal during setup: exit without waiting for the workers


class RunControl:
    """The first SIGINT or SIGTERM while the run trains asks the lead to checkpoint at the next step
    boundary and stop (under torchrun every rank agrees on that step: ``agree``); more signals
    meanwhile (torchrun sends SIGINT and SIGTERM together) are ignored, so the save is not cut
    short. Before the first step (setup: nothing to save) every signal raises ``Interrupted`` at
    once: the first stops the workers, which finish the setup call they are in (a model load
    cannot be cut short), and another one stops waiting for them. As a context manager it installs
    its signal handlers, from the main thread only."""

    def __init__(self) -> None:
        self.signum: Optional[int] = None
        self.requested = threading.Event()  # this process was asked to stop
        self.stepping = False  # replica 0 took its first step: every setup has returned
        self.stopped_at: Optional[int] = None  # the step after which a stop request ended the run
        self._on_stop: list[Callable[[], None]] = []
        self._previous: dict = {}
        # Across processes, the sum of the stop requests of every rank at the last gradient
        # average (on the host); None in a single process, where the request alone decides.
        self._votes: Optional[torch.Tensor] = None
        self._votes_ready: Any = None  # a CUDA event after the votes' copy to the host

    def __enter__(self) -> RunControl:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        in_setup = not self.stepping
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

    def began_stepping(self) -> None:
        """Replica 0's first step: from now on a signal stops the run at a step boundary."""
        self.stepping = True

    def vote(self) -> float:
        """This process's stop request, as the averager adds it to its all-reduce."""
        return 1.0 if self.requested.is_set() else 0.0

    def agree(self, votes: torch.Tensor) -> None:
        """Called by the averager with the all-reduced votes (one element, the same on every rank).
        On a GPU it queues their copy to pinned host memory, with no stream sync in the step."""
        if not votes.is_cuda:
            self._votes = votes
            return
        if self._votes is None:
            self._votes = torch.zeros(1, dtype=votes.dtype, pin_memory=True)
            self._votes_ready = torch.cuda.Event()
        self._votes.copy_(votes, non_blocking=True)
        self._votes_ready.record(torch.cuda.current_stream(votes.device))

    def should_stop(self) -> bool:
        """Whether to stop after the step just completed; read by replica 0's thread after its
        average. Across processes: some rank asked before the last average (every rank reads the
        same answer; on a GPU it waits for the votes' copy only, not for the update queued after it)."""
        if self._votes is None:
            return self.requested.is_set()
        if self._votes_ready is not None:
            self._votes_ready.synchronize()
        return bool(self._votes[0] > 0)

    def on_stop(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` when the run stops at a step boundary (``stop_after``)."""
        self._on_stop.append(callback)

    def stop_after(self, step: int) -> None:
        """The lead saved step ``step`` and the run ends there: stop the workers."""
        self.stopped_at = step
        for callback in self._on_stop:
            callback()

    def interrupted(self, checkpoint: Optional[Path], *, forced: bool = False) -> Interrupted:
        """What ``train()`` raises for an interrupt before the run reached a step boundary."""
        return Interrupted(checkpoint, self.signum or signal.SIGINT, forced=forced)

    def stopped(self, checkpoint: Optional[Path]) -> Interrupted:
        """What ``train()`` raises after the run stopped at a step boundary (``stop_after``)."""
        return Interrupted(checkpoint, self.signum or signal.SIGTERM, self.stopped_at)
