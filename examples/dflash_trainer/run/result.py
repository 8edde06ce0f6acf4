"""What ``train()`` returns: the run's losses, evaluation, placement, per-worker timings and compile
warmers and cache hits.

``to_json()`` is the ``--json`` line; the GPU tests and the benchmarks read it from subprocesses,
so its keys and their order are a format: a key that a run has no value for (no step logged, no
evaluation, no checkpoint, no compile warmers) is left out, not written as null, except ``target_report``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass(frozen=True)
class WorkerResult:
    """One worker thread's timings (seconds, rounded to 0.01 s) and step-time percentiles."""

    device: str
    p50_ms: Optional[float]  # None before its first steady step
    p90_ms: Optional[float]
    setup_s: float
    first_step_at_s: float  # from the start of the workers
    warmup_s: float
    compile_s: float
    capture_s: float
    peer_compile_wait_s: float  # waiting for another worker's compile of the same step
    captures: int
    steps: int
    phases_p50_ms: dict[str, float]  # host time of each phase of a steady step
    phases_warmup_s: dict[str, float] = field(default_factory=dict)  # each phase's seconds over the warmup steps


@dataclass(frozen=True)
class RunResult:
    rank: int
    world: int
    total_steps: int
    start_step: int  # 0, or the step a resumed run continued from
    placement: str
    mode: str  # the execution policy: eager, CUDAGraph Trees or whole-step graphs
    gil_switch_interval_ms: float
    target_report: Optional[dict[str, Any]]  # the embedded or shape target's build report
    startup_s: float  # from train() to the last worker's end of warmup
    build_s: float  # of it, building the pipeline: load, assets
    workers: dict[str, WorkerResult]
    out_dir: str
    last: Optional[dict[str, float]] = None  # the last logged step's metrics
    losses: Optional[list[float]] = None  # every logged step's loss, from start_step on
    tokens_per_s_steady: Optional[float] = None  # drafter tokens/s after warmup, eval excluded
    baseline: Optional[dict[str, float]] = None  # tau of a random-init drafter and of repeat-last-token
    eval: Optional[dict[str, Any]] = None  # the last evaluation: tau, steps, accepted_hist
    checkpoint: Optional[str] = None  # the last checkpoint this process saved
    # Per compile warmer (--compile-warmers): its outcome (done, failed (exit N), timed out, stopped)
    # and seconds from its start to that; None when the run started none.
    compile_warmers: Optional[dict[str, dict[str, Any]]] = None
    # This run's own Inductor FX graph cache and AOTAutograd cache hits and misses (warmers.CACHE_COUNTERS).
    compile_caches: Optional[dict[str, int]] = None

    def to_json(self) -> dict[str, Any]:
        """The ``--json`` object, keys in the order the entry point has always written them."""
        optional = {"last": self.last, "losses": self.losses, "tokens_per_s_steady": self.tokens_per_s_steady,
                    "baseline": self.baseline, "eval": self.eval, "checkpoint": self.checkpoint}
        return {
            "rank": self.rank, "world": self.world, "total_steps": self.total_steps, "start_step": self.start_step,
            **{k: v for k, v in optional.items() if v is not None},
            "placement": self.placement,
            "mode": self.mode,
            "gil_switch_interval_ms": self.gil_switch_interval_ms,
            "target_report": self.target_report,
            "startup_s": self.startup_s,
            "build_s": self.build_s,
            "workers": {name: dataclasses.asdict(w) for name, w in self.workers.items()},
            "out_dir": self.out_dir,
            **{k: v for k, v in {"compile_warmers": self.compile_warmers, "compile_caches": self.compile_caches}.items()
               if v is not None},
        }
