"""CompiledWorkerThread and WorkerGroup: a tiny lifecycle API in the spirit of concurrent.futures."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Callable, Iterable, Optional, Union

import torch

from ._errors import ThreadgraphError, WorkerError
from ._fence import explain_capture_conflict
from ._gate import gate_for, released
from ._patches import install
from ._stats import StepStats, StepTimer
from ._tls import WorkerState, bind_worker, doing, ensure_cudagraph_tls, release_cudagraph_tls, wait_for_thread_exit

log = logging.getLogger("threadgraph")

DeviceLike = Union[str, int, torch.device, None]


def resolve_device(device: DeviceLike) -> torch.device:
    """A validated torch.device; CUDA devices must exist. ``None`` means cuda:0, or cpu without CUDA."""
    if device is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"threadgraph: bad device {device!r}: {exc}; use 'cpu', 'cuda' or 'cuda:N'") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ThreadgraphError(
                f"threadgraph: device {device!r} asks for CUDA, but this torch sees no GPU "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use device='cpu' or run on a GPU machine"
            )
        index = 0 if resolved.index is None else resolved.index
        if index >= torch.cuda.device_count():
            raise ValueError(
                f"threadgraph: device {device!r} does not exist; this machine has "
                f"{torch.cuda.device_count()} GPU(s) (cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
            )
        resolved = torch.device("cuda", index)
    elif resolved.type != "cpu":
        raise ValueError(f"threadgraph: device type {resolved.type!r} is not supported; use 'cpu' or 'cuda:N'")
    return resolved


class CompiledWorkerThread(threading.Thread):
    """A thread that owns one compiled model on one device.

    Override ``setup()`` (build and compile; runs in this thread on ``self.device``), ``step()``
    (one iteration) and ``teardown()``. ``run()`` belongs to the base class: it binds the device,
    gives the thread its CUDAGraph Trees state and its own generation counters, holds the
    device gate's shared slot around ``setup()`` and each ``step()``, begins a new cudagraph step
    before each ``step()``, times steps after ``warmup_steps``, and stores any exception for
    ``join()``. Call ``self.stop()`` (from anywhere, also from ``step()``) to finish.
    """

    def __init__(
        self,
        device: DeviceLike = None,
        *,
        name: Optional[str] = None,
        warmup_steps: int = 3,
        max_steps: Optional[int] = None,
        daemon: bool = True,
    ) -> None:
        super().__init__(name=name, daemon=daemon)
        if warmup_steps < 0 or (max_steps is not None and max_steps < 0):
            raise ValueError("threadgraph: warmup_steps and max_steps must be >= 0")
        self.device = resolve_device(device)
        install()  # here, in the constructing thread, so it precedes any compile in the worker
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.stats = StepStats()
        self.worker_state = WorkerState(self.name, self.device)
        self._stop_requested = threading.Event()
        self._exception: Optional[BaseException] = None
        self._phase = "start"
        self._group: Optional["WorkerGroup"] = None

    # -- to override ---------------------------------------------------------------------
    def setup(self) -> None:
        """Build and compile the model. Runs in the worker thread, on the worker's device."""

    def step(self) -> None:
        """One iteration."""
        raise NotImplementedError(f"{type(self).__name__} must override step()")

    def teardown(self) -> None:
        """Release resources. Runs in the worker thread, also after a failure."""

    # -- lifecycle -----------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the worker to finish after its current step. Idempotent, callable from any thread."""
        self._stop_requested.set()
        if self._group is not None:
            self._group._wake()

    @property
    def stopping(self) -> bool:
        return self._stop_requested.is_set()

    @property
    def exception(self) -> Optional[BaseException]:
        return self._exception

    @property
    def activity(self) -> tuple[str, float]:
        """What the worker is doing now and for how many seconds: its setup turn, setup, compiling
        a frame, waiting for a peer's compile, warming up or recording graphs, warmup steps,
        stepping. Readable from any thread (a startup progress display polls it)."""
        state = self.worker_state
        return state.activity, time.monotonic() - state.activity_since

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the worker; re-raise its exception as WorkerError (the original as cause)."""
        super().join(timeout)
        if self.is_alive():
            return
        wait_for_thread_exit(self)
        if self._exception is not None:
            raise self._as_worker_error() from self._exception

    def gate(self) -> contextlib.AbstractContextManager:
        """The shared slot of this worker's device (a no-op on CPU)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return gate_for(str(self.device)).shared()

    def run(self) -> None:
        started = time.perf_counter()
        timer = StepTimer(self.device)
        error: Optional[BaseException] = None
        failed_in = None
        skipped = False
        try:
            self._phase = "setup"
            self._bind()
            state = self.worker_state
            with doing(state, "waiting for its setup turn"), self._setup_turn(), self.gate():
                # the turn first: a queued worker holds no slot. Stopped (Ctrl-C, a failed peer)
                # while waiting its turn: the setup does not run
                skipped = self.stopping
                if not skipped:
                    with doing(state, "setup"):
                        self.setup()
            if self._group is not None:
                with doing(state, "waiting for the other workers' setups"):
                    self._group._wait_for_setups(self)
            if not skipped:
                self._phase = "step"
                state.activity, state.activity_since = "warmup steps", time.monotonic()
                self._loop(timer, started)
        except GroupStopped:
            if not self.stopping:
                raise  # not this group's wake-up: a bug
        except BaseException as exc:  # stored and re-raised from join(); nothing is swallowed
            error, failed_in = _clear_capture_conflict(exc, self.device), self._phase
        if skipped and error is None:
            log.debug("threadgraph: worker %s stopped before its setup ran", self.name)
            release_cudagraph_tls()
            return
        try:
            self._phase = "teardown"
            with self.gate():  # CUDA work of this thread, event syncs included, holds the slot
                self.teardown()
                self.stats.step_ms = timer.finish()
        except BaseException as exc:
            if error is None:
                error, failed_in = exc, "teardown"
            else:
                _add_note(error, f"teardown of {self.name} also failed: {exc!r}")
        finally:
            self._copy_startup_stats()
            self.worker_state.activity = "failed" if error is not None else "finished"
            release_cudagraph_tls()
        if error is None:
            log.debug("threadgraph: worker %s on %s finished: %s", self.name, self.device, self.stats.summary())
            return
        self._phase = failed_in
        self._exception = error
        log.error("threadgraph: worker %s on %s failed in %s: %r", self.name, self.device, failed_in, error)
        if self._group is not None:
            self._group._worker_failed(self, error)

    # -- internals -----------------------------------------------------------------------
    def _setup_turn(self) -> contextlib.AbstractContextManager:
        if self._group is None or not self._group.serial_setup:
            return contextlib.nullcontext()
        return self._group._setup_lock

    def _bind(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per host thread (hazard per-thread-device)
        install()
        ensure_cudagraph_tls()
        bind_worker(self.worker_state)

    def _loop(self, timer: StepTimer, started: float) -> None:
        mark_step = torch.compiler.cudagraph_mark_step_begin
        while not self._stop_requested.is_set():
            if self.max_steps is not None and self.stats.steps >= self.max_steps:
                break
            with self.gate():
                mark_step()
                timer.start()
                self.step()
                timer.stop()
                self.stats.steps += 1
                if self.stats.steps == self.warmup_steps:
                    self._end_warmup(timer, started)
        if self.stats.steps < self.warmup_steps:
            with self.gate():
                self._end_warmup(timer, started)

    def _end_warmup(self, timer: StepTimer, started: float) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()  # warmup time includes its GPU work
        self.stats.warmup_steps = self.stats.steps
        self.stats.warmup_seconds = time.perf_counter() - started
        self._copy_startup_stats()
        self.worker_state.activity, self.worker_state.activity_since = "stepping", time.monotonic()
        timer.discard()

    def _copy_startup_stats(self) -> None:
        state, stats = self.worker_state, self.stats
        stats.warmups, stats.captures = state.warmups, state.captures
        stats.compile_seconds, stats.capture_seconds = state.compile_seconds, state.capture_seconds
        stats.turn_wait_seconds = state.turn_wait_seconds

    def _as_worker_error(self) -> WorkerError:
        exc = self._exception
        return WorkerError(
            f"threadgraph: worker {self.name!r} on {self.device} failed in {self._phase}: {type(exc).__name__}: {exc}",
            thread_name=self.name,
            device=str(self.device),
        )


def _clear_capture_conflict(exc: BaseException, device: torch.device) -> BaseException:
    """The CUDA error of a capture conflict, explained (the original as cause); anything else as it is."""
    if device.type != "cuda":
        return exc
    clear = explain_capture_conflict(exc, device)
    if clear is None:
        return exc
    clear.__cause__ = exc
    return clear


def _add_note(error: BaseException, note: str) -> None:
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:  # Python 3.10
        log.error("threadgraph: %s", note)


class GroupStopped(ThreadgraphError):
    """Raised in a worker blocked on its group's ``queue()`` when the group stops or fails; the
    worker then ends quietly (it is stopping), and ``join()`` raises the first failure, if any."""


class GroupQueue(queue.Queue):
    """A ``queue.Queue`` owned by a WorkerGroup (``group.queue()``): ``get()`` and ``put()`` wait
    with the device gate's slots given up (``released()``) and raise GroupStopped in every blocked
    worker once the group stops or fails, so no ``on_failure`` callback is needed to wake them."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self._stopped = False

    def close(self) -> None:
        with self.mutex:
            self._stopped = True
            self.not_empty.notify_all()
            self.not_full.notify_all()

    def _wait(self, condition: threading.Condition, ready: Callable[[], bool], block: bool,
              timeout: Optional[float], empty: type) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not ready():
            if self._stopped:
                raise GroupStopped("threadgraph: the worker group stopped while this worker waited on its queue")
            if not block:
                raise empty
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise empty
            condition.wait(left)
        if self._stopped:
            raise GroupStopped("threadgraph: the worker group stopped while this worker waited on its queue")

    def get(self, block: bool = True, timeout: Optional[float] = None):
        with released(), self.not_empty:
            self._wait(self.not_empty, lambda: self._qsize() > 0, block, timeout, queue.Empty)
            item = self._get()
            self.not_full.notify()
            return item

    def put(self, item, block: bool = True, timeout: Optional[float] = None) -> None:
        with released(), self.not_full:
            if self.maxsize > 0:
                self._wait(self.not_full, lambda: self._qsize() < self.maxsize, block, timeout, queue.Full)
            elif self._stopped:
                raise GroupStopped("threadgraph: the worker group stopped")
            self._put(item)
            self.unfinished_tasks += 1
            self.not_empty.notify()


class WorkerGroup:
    """Start, stop and join many workers, fail-fast.

    The first failure stops every other worker, closes the group's queues (``queue()``: workers
    blocked on them wake and end), runs the failure callbacks (wake waits of your own there) and
    is re-raised from ``join()``. As a context manager it starts the workers on entry and stops
    and joins them on exit; Ctrl-C stops everything, setups still waiting their turn included.

    No worker of a started group steps before every worker's ``setup()`` has returned, and with
    ``serial_setup`` (the default) setups run one at a time. Setups load models, and loading
    changes process-global state that other threads read: transformers' ``from_pretrained(dtype=)``
    sets torch's default dtype while it builds, so a step elsewhere creates bfloat16 tensors and
    a compile fails its own guards ("GLOBAL_STATE changed: default_dtype", hazard global-default-dtype). Pass
    ``serial_setup=False`` when setups must run together (for example, when they wait on each
    other); steps still wait for all setups.
    """

    def __init__(self, workers: Iterable[CompiledWorkerThread] = (), *, serial_setup: bool = True) -> None:
        self.workers: list[CompiledWorkerThread] = []
        self.serial_setup = serial_setup
        self._setup_lock = threading.Lock()
        self._setups_done = threading.Condition()
        self._setups_left = 0
        self._lock = threading.Lock()
        self._first_failure: Optional[CompiledWorkerThread] = None
        self._on_failure: list[Callable[[BaseException], None]] = []
        self._queues: list[GroupQueue] = []
        for worker in workers:
            self.add(worker)

    def queue(self, maxsize: int = 0) -> GroupQueue:
        """A queue between this group's workers that wakes every worker blocked on it when the
        group stops or fails (GroupQueue)."""
        q = GroupQueue(maxsize)
        self._queues.append(q)
        return q

    def add(self, worker: CompiledWorkerThread) -> CompiledWorkerThread:
        if worker.is_alive() or worker.ident is not None:
            raise ValueError(f"threadgraph: worker {worker.name} was already started; add workers before start()")
        worker._group = self
        self.workers.append(worker)
        return worker

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(exc)`` once, when the first worker fails."""
        self._on_failure.append(callback)

    @property
    def broken(self) -> bool:
        return self._first_failure is not None

    def start(self) -> "WorkerGroup":
        with self._setups_done:
            self._setups_left = len(self.workers)
        for worker in self.workers:
            worker.start()
        return self

    def stop(self) -> None:
        """Ask every worker to finish after its current step, and wake those blocked on the
        group's queues."""
        for worker in self.workers:
            worker.stop()
        for q in self._queues:
            q.close()

    def _wait_for_setups(self, worker: CompiledWorkerThread) -> None:
        """Count ``worker``'s setup as done; return when all are, or when ``worker`` is stopped."""
        with self._setups_done:
            self._setups_left -= 1
            self._setups_done.notify_all()
            while self._setups_left > 0 and not worker.stopping:
                self._setups_done.wait()

    def _wake(self) -> None:
        with self._setups_done:
            self._setups_done.notify_all()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for all workers; raise the first failure (WorkerError). Ctrl-C stops all, then re-raises."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for worker in self.workers:
                while worker.is_alive():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"threadgraph: worker {worker.name} still running after {timeout} s")
                    threading.Thread.join(worker, 0.2 if left is None else min(0.2, left))
                wait_for_thread_exit(worker)
        except KeyboardInterrupt:
            log.warning("threadgraph: interrupted; stopping %d workers", len(self.workers))
            self._fail_all(KeyboardInterrupt())
            for worker in self.workers:
                threading.Thread.join(worker)
                wait_for_thread_exit(worker)
            raise
        failed = self._first_failure
        if failed is not None:
            others = [w for w in self.workers if w is not failed and w.exception is not None]
            error = failed._as_worker_error()
            for other in others:
                _add_note(error, f"also failed: {other.name}: {other.exception!r}")
            raise error from failed.exception

    def __enter__(self) -> "WorkerGroup":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self._fail_all(exc)
            for worker in self.workers:
                if worker.ident is not None:
                    threading.Thread.join(worker)
            return None  # the body's exception propagates
        self.join()

    def _worker_failed(self, worker: CompiledWorkerThread, error: BaseException) -> None:
        with self._lock:
            if self._first_failure is not None:
                return
            self._first_failure = worker
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        self.stop()
        for callback in self._on_failure:
            try:
                callback(error)
            except BaseException as exc:  # a broken callback must not keep peers blocked
                log.error("threadgraph: failure callback %r raised %r", callback, exc)
                _add_note(error, f"failure callback {callback!r} raised {exc!r}")

