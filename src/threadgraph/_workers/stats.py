"""Per-worker step timing: CUDA events on the worker's stream, resolved without host syncs."""

from __future__ import annotations

import collections
import dataclasses
import statistics
import time
from typing import Optional

import torch

from threadgraph._device.resolve import DeviceLike, resolve_device


@dataclasses.dataclass
class StepStats:
    """What a worker measured (``CompiledWorkerThread.stats``). Step times exclude the warmup steps.

    Attributes:
        steps: Steps run, warmup steps included.
        warmup_steps: Of those, the warmup steps (not timed).
        warmup_seconds: Seconds the warmup steps took.
        warmups: Eager warmup runs in the CUDA graph pool.
        captures: Graphs recorded (CUDAGraph Trees) or captured (``capture_step``, by hand).
        setup_seconds: Seconds in ``setup()`` itself (waiting for its turn not included).
        steps_began_at: Seconds from the thread's start to its first step (setup turns included).
        compile_seconds: Seconds in Dynamo's frame compiles (AOTAutograd and Inductor included).
        capture_seconds: Seconds recording or capturing graphs.
        turn_wait_seconds: Seconds waiting for another thread's first call of the same compiled code.
        step_ms: The timed steps' durations in milliseconds, in order.
    """

    steps: int = 0
    warmup_steps: int = 0
    warmup_seconds: float = 0.0
    warmups: int = 0
    captures: int = 0
    setup_seconds: float = 0.0
    steps_began_at: float = 0.0
    compile_seconds: float = 0.0
    capture_seconds: float = 0.0
    turn_wait_seconds: float = 0.0
    step_ms: list = dataclasses.field(default_factory=list)

    def percentile(self, q: float) -> Optional[float]:
        """The step time in ms below which a fraction ``q`` (0 to 1) of the timed steps lie; None without any."""
        if not self.step_ms:
            return None
        ordered = sorted(self.step_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def p50_ms(self) -> Optional[float]:
        """The median step time in ms; None before any step was timed."""
        return statistics.median(self.step_ms) if self.step_ms else None

    @property
    def p90_ms(self) -> Optional[float]:
        """The 90th percentile step time in ms; None before any step was timed."""
        return self.percentile(0.9)

    def summary(self) -> str:
        """One line for a log: steps, the startup's parts, captures and the p50/p90 step times."""
        startup = (f"{self.steps} steps, setup {self.setup_seconds:.2f} s, first step at {self.steps_began_at:.2f} s, "
                   f"warmup {self.warmup_seconds:.2f} s (compile {self.compile_seconds:.2f} s, "
                   f"capture {self.capture_seconds:.2f} s, waiting for a peer's compile {self.turn_wait_seconds:.2f} s), "
                   f"{self.captures} captures")
        if not self.step_ms:
            return startup
        return f"{startup}, step p50 {self.p50_ms:.3f} ms p90 {self.p90_ms:.3f} ms"


class StepTimer:
    """Times steps with CUDA events (GPU) or ``time.perf_counter`` (CPU), as a worker times its steps.

    Event pairs are resolved once ``query()`` says they finished, so timing never makes the
    host wait for the GPU inside the loop; ``finish()`` synchronises the rest once.

    Args:
        device: The device the steps run on, as a worker takes it (``"cpu"``, ``"cuda:1"``, a
            ``torch.device``, an index; None means cuda:0, or the CPU where there is no CUDA);
            CUDA devices are timed with events.
        keep: How many step times to keep (the oldest are dropped).

    Raises:
        UsageError: A bad ``device`` (as for a worker).
        ThreadgraphError: A CUDA device where torch sees no GPU.

    Attributes:
        cuda: Whether steps are timed with CUDA events.
        times: The step times resolved so far, in ms.
    """

    def __init__(self, device: DeviceLike = None, keep: int = 100_000) -> None:
        self.cuda = resolve_device(device).type == "cuda"
        self.times: collections.deque = collections.deque(maxlen=keep)
        self._pending: collections.deque = collections.deque()
        self._start = None

    def start(self) -> None:
        """Mark the start of a step (records a CUDA event on the current stream, or reads the clock)."""
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        """Mark the end of the step begun by ``start()``; steps whose events finished are resolved, without waiting."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._start, end))
            while self._pending and self._pending[0][1].query():
                begin, done = self._pending.popleft()
                self.times.append(begin.elapsed_time(done))
        else:
            self.times.append((time.perf_counter() - self._start) * 1e3)

    def discard(self) -> None:
        """Forget everything timed so far (warmup steps)."""
        self._pending.clear()
        self.times.clear()

    def finish(self) -> list:
        """Wait for the steps still in flight and return every kept step time, in ms."""
        for begin, done in self._pending:
            done.synchronize()
            self.times.append(begin.elapsed_time(done))
        self._pending.clear()
        return list(self.times)
