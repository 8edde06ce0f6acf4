"""Training metrics: the training log of a run, its JSON-lines file, and per-phase step times.

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
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .checkpoint import step_directories

__all__ = ["HISTORY_ROWS", "LOG_EVERY", "MetricsLogger", "PhaseTimes", "TrainingDiverged", "TrainingLog",
           "format_phases"]

LOG_EVERY = 10  # drafter steps per log line and tokens/s window; the first window holds warmup
# Rows of a replica's metrics history, a ring (step s in row (s - 1) % rows): the log reads it at
# least every LOG_EVERY steps, so its size never grows with the run's length.
HISTORY_ROWS = 1024
assert HISTORY_ROWS >= LOG_EVERY

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
        self.step_ms: list[float] = []  # from each step's begin() to the next's: the worker's step time
        self._last = 0.0
        self._began: Optional[float] = None

    def begin(self) -> None:
        self._last = time.perf_counter()
        if self._began is not None:
            self.step_ms.append((self._last - self._began) * 1000)
        self._began = self._last

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase].append((now - self._last) * 1000)
        self._last = now

    def totals_s(self, steps: int) -> dict[str, float]:
        """Seconds of each phase over the first ``steps`` steps (the warmup: where startup went).
        Every step marks every phase but the one a stop interrupts, and the first step may mark one
        more (``compile_warmer``, a drafter's ``compile_ahead``), so the first ``steps`` samples of a phase are warmup."""
        return {phase: round(sum(values[:steps]) / 1000, 2) for phase, values in self.ms.items() if values[:steps]}

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


class TrainingDiverged(FloatingPointError):
    """The loss or gradient norm became NaN or infinite."""


class TrainingLog:
    """What a run reports about its training: every ``LOG_EVERY`` steps the replica's rows of
    [metrics..., grad_norm] are read from the device (one host sync), checked for divergence, and
    recorded with the learning rate and the tokens/s of the window (to ``metrics`` and
    ``progress``). Windows after the first (compilation, capture) add to the steady tokens/s."""

    def __init__(self, *, metric_names: tuple[str, ...], start_step: int, tokens_per_step: int,
                 lr_at: Callable[[int], float], base_lr: float, checkpoint_dir: Path,
                 metrics: Optional[MetricsLogger], progress: Optional[Callable[[dict], None]]) -> None:
        self.names = metric_names + ("grad_norm",)
        self.tokens_per_step = tokens_per_step
        self.lr_at, self.base_lr, self.checkpoint_dir = lr_at, base_lr, checkpoint_dir
        self.metrics, self.progress = metrics, progress
        self.logged = start_step  # steps already logged
        self.start_step = start_step
        self.last: dict = {}
        self.losses: list[float] = []
        self._steady_tokens, self._steady_seconds = 0, 0.0
        self._window_start = time.perf_counter()

    def due(self, done: int) -> bool:
        return done - self.logged >= LOG_EVERY

    def flush(self, history: torch.Tensor, done: int) -> None:
        """Log steps ``logged + 1 .. done`` from ``history``, a ring (step s in row (s - 1) % its rows)."""
        if done - self.logged > history.shape[0]:
            raise RuntimeError(f"steps {self.logged + 1}..{done} do not fit the {history.shape[0]} rows of the "
                               f"metrics history: the log must read it at least every {history.shape[0]} steps")
        rows = history[torch.arange(self.logged, done) % history.shape[0]].tolist()
        now = time.perf_counter()
        for offset, row in enumerate(rows):
            if not all(math.isfinite(v) for v in row):
                step = self.logged + offset + 1
                values = dict(zip(self.names, row))
                if self.start_step and step == self.start_step + 1:  # at once after a resume: the checkpoint
                    raise TrainingDiverged(
                        f"step {step}: loss or gradient norm is not finite ({values}) on the first step after resuming "
                        f"from step {self.start_step}: that checkpoint's weights are likely bad; point "
                        f"{self.checkpoint_dir}/latest at an earlier step_* directory and --resume, or start a new run"
                    )
                saved = step_directories(self.checkpoint_dir)
                where = (f", or --resume from {saved[0]} (no checkpoint is written after a non-finite step)"
                         if saved else " (the run saved no checkpoint to resume from)")
                raise TrainingDiverged(
                    f"step {step}: loss or gradient norm is not finite ({values}); lower --lr (now {self.base_lr}) "
                    f"or check the data, and start a new run{where}"
                )
        tokens = len(rows) * self.tokens_per_step
        tokens_per_s = tokens / max(now - self._window_start, 1e-9)
        self.last = {"step": done, **dict(zip(self.names, rows[-1])), "lr": self.lr_at(done - 1),
                     "tokens_per_s": tokens_per_s}
        if self.logged >= LOG_EVERY:  # the first interval holds compilation and warmup
            self._steady_tokens += tokens
            self._steady_seconds += now - self._window_start
        self.losses.extend(r[0] for r in rows)
        self.record(self.last)
        self.logged, self._window_start = done, now

    def record(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(**record)
        if self.progress is not None:
            self.progress(record)

    def restart_window(self) -> None:
        """Leave the time since the last flush out of tokens/s (evaluation, saving)."""
        self._window_start = time.perf_counter()

    def results(self) -> dict:
        out: dict[str, Any] = {}
        if self.last:
            out["last"] = self.last
            out["losses"] = self.losses
        if self._steady_seconds:
            out["tokens_per_s_steady"] = self._steady_tokens / self._steady_seconds
        return out
