"""Training metrics: a JSON-lines log and a windowed tokens/s counter.

One JSON object per line so a crashed run still leaves every line written before
the crash readable (each line is flushed), and ``pandas.read_json(lines=True)`` or
a plain loop reads it back. Non-finite floats are written as the strings "NaN",
"Infinity", "-Infinity" so each line stays strict JSON; ``float()`` reads them.
"""

from __future__ import annotations

import collections
import json
import math
import os
import statistics
import threading
import time
from typing import Any, Callable

__all__ = ["MetricsLogger", "PhaseTimes", "Throughput", "format_phases"]

_RESERVED = ("step", "time", "elapsed_s")


class PhaseTimes:
    """Host wall time of each phase of a worker's steps, in ms: where a thread's step goes.

    ``begin()`` at the start of a step, ``mark("phase")`` at the end of each phase. Times are
    host-side (perf_counter): they include waiting for the GIL, for peers and for the device,
    which is what a threaded pipeline needs to attribute; GPU work that runs asynchronously is not
    in them.
    """

    def __init__(self) -> None:
        self.ms: dict[str, list[float]] = collections.defaultdict(list)
        self._last = 0.0

    def begin(self) -> None:
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase].append((now - self._last) * 1000)
        self._last = now

    def medians(self, skip: int = 0) -> dict[str, float]:
        """Median ms of each phase over its samples after the first ``skip`` (warmup)."""
        return {phase: statistics.median(values[skip:]) for phase, values in self.ms.items() if values[skip:]}


def format_phases(medians: dict[str, float]) -> str:
    """PhaseTimes.medians() as one line: "phase ms, phase ms"."""
    return ", ".join(f"{phase} {ms:.2f}" for phase, ms in medians.items())


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        # A one-element tensor / numpy scalar. For a CUDA tensor this syncs the host:
        # fine at log intervals, which is the only place this should be called.
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return value


class MetricsLogger:
    """Append-only JSONL metrics file; safe to call from several threads.

    ``log(step, loss=..., tau=..., tokens_per_s=..., lr=...)`` writes
    ``{"step": step, "time": <unix s>, "elapsed_s": <s since creation>, ...}``.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8")
        self._t0 = time.monotonic()

    def log(self, step: int, **fields: Any) -> dict:
        clash = [k for k in fields if k in _RESERVED]
        if clash:
            raise ValueError(f"MetricsLogger.log: {clash} are set by the logger itself; "
                             "rename the field")
        record = {"step": int(step), "time": time.time(),
                  "elapsed_s": round(time.monotonic() - self._t0, 6)}
        record.update({k: _jsonable(v) for k, v in fields.items()})
        line = json.dumps(record, allow_nan=False) + "\n"
        with self._lock:
            if self._file.closed:
                raise ValueError(f"MetricsLogger({self.path!r}) is closed; log before close()")
            self._file.write(line)
            self._file.flush()
        return record

    def close(self) -> None:
        with self._lock:
            self._file.close()

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Throughput:
    """Tokens counted from any thread; ``rate()`` is tokens/s over the last
    ``window_s`` seconds (over all time while the run is younger than the window)."""

    def __init__(self, window_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        if window_s <= 0:
            raise ValueError(f"Throughput: window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self.total = 0
        # (time, cumulative tokens) marks; the first one is the baseline of the window.
        self._marks: collections.deque[tuple[float, int]] = collections.deque([(clock(), 0)])

    def add(self, tokens: int) -> None:
        now = self._clock()
        with self._lock:
            self.total += int(tokens)
            self._marks.append((now, self.total))
            self._trim(now)

    def rate(self) -> float:
        now = self._clock()
        with self._lock:
            self._trim(now)
            t_base, n_base = self._marks[0]
            span = now - t_base
            return (self.total - n_base) / span if span > 0 else 0.0

    def _trim(self, now: float) -> None:
        # Keep the newest mark at or before the window start as the baseline.
        while len(self._marks) > 1 and self._marks[1][0] <= now - self.window_s:
            self._marks.popleft()
