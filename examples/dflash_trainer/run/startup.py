"""Startup as the user sees it: until every worker has finished its warmup steps, a report every
few seconds of what each one is doing (its setup, compiling a frame, waiting for a peer's compile
of the same code, warming up or recording CUDA graphs), read from the workers' own activity."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional, Sequence

import threadgraph

_DONE = ("stepping", "finished", "failed")  # a worker past its startup


def _doing(items: Sequence) -> list[dict]:
    out = []
    for item in items:
        what, seconds = item.activity
        out.append({"worker": item.name, "doing": what, "for_s": round(seconds, 1)})
    return out


def snapshot(workers: Sequence[threadgraph.CompiledWorkerThread], started: float, background: Sequence = ()) -> dict:
    """What each worker does, and each ``background`` task (anything with ``name`` and
    ``activity``, such as the baseline evaluation) that no worker waits for."""
    doing = _doing(workers)
    ready = sum(1 for d in doing if d["doing"] in _DONE)
    return {"seconds": round(time.monotonic() - started, 1), "ready": ready, "workers": len(workers), "doing": doing,
            "background": _doing(background)}


def past_startup(workers: Sequence[threadgraph.CompiledWorkerThread]) -> bool:
    """Whether every worker is past its startup (stepping, finished or failed)."""
    return all(w.activity[0] in _DONE for w in workers)


def describe(record: dict) -> str:
    """One line: ``startup 42 s, 3 of 8 workers ready; target-1 compiling features (12 s); ...``."""
    busy = [f"{d['worker']} {d['doing']} ({d['for_s']:.0f} s)" for d in [*record["doing"], *record.get("background", ())]
            if d["doing"] not in _DONE]
    head = f"startup {record['seconds']:.0f} s, {record['ready']} of {record['workers']} workers ready"
    return "; ".join([head, *busy])


class StartupMonitor:
    """Calls ``report({"startup": snapshot})`` every ``every_s`` seconds until all workers are
    ready (or ``stop()``)."""

    def __init__(self, workers: Sequence[threadgraph.CompiledWorkerThread],
                 report: Optional[Callable[[dict], None]], every_s: float = 2.0,
                 background: Callable[[], Sequence] = tuple) -> None:
        self.workers, self.report, self.every_s = list(workers), report, every_s
        self.background = background  # the background tasks as of each report
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-startup", daemon=True)
        self._started = 0.0

    def start(self) -> "StartupMonitor":
        self._started = time.monotonic()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stopped.wait(self.every_s):
            record = snapshot(self.workers, self._started, self.background())
            if record["ready"] == record["workers"]:
                return
            if self.report is not None:
                self.report({"startup": record})
