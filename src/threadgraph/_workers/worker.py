"""CompiledWorkerThread: a worker thread with a tiny lifecycle API in the spirit of concurrent.futures (its group: group.py)."""

from __future__ import annotations

import atexit
import contextlib
import logging
import threading
import time
import weakref
from typing import Optional, Protocol

import torch

from threadgraph._device.fence import clear_capture_conflict
from threadgraph._device.gate import gate_for
from threadgraph._device.resolve import DeviceLike, resolve_device
from threadgraph._device.tls import (WorkerState, bind_worker, doing, ensure_cudagraph_tls, release_cudagraph_tls,
                                     wait_for_thread_exit)
from threadgraph._errors import GroupStopped, JoinTimeout, UsageError, WorkerError, add_note
from threadgraph._patches import install
from threadgraph._workers.stats import StepStats, StepTimer

log = logging.getLogger("threadgraph")


class Membership(Protocol):
    """What a worker asks of the group it belongs to: ``WorkerGroup.add`` hands each of its workers
    one (``CompiledWorkerThread.join_group``), so neither reads the other's internals."""

    def setup_turn(self) -> contextlib.AbstractContextManager:
        """Held around the worker's setup: the group's one-at-a-time turn, or nothing."""

    def setup_done(self, worker: "CompiledWorkerThread") -> None:
        """Count the worker's setup as done; return once every worker's is, or the worker stops."""

    def wake(self) -> None:
        """Wake workers waiting for the others' setups (one of them was asked to stop)."""

    def stop(self) -> None:
        """Stop the whole group: every worker, and the group's queues."""

    def failed(self, worker: "CompiledWorkerThread", error: BaseException) -> None:
        """The worker failed: the first failure stops the group and runs its failure callbacks."""


EXIT_WAIT_S = 30.0  # how long interpreter exit waits for workers still running, all together
_running: "weakref.WeakSet[CompiledWorkerThread]" = weakref.WeakSet()
NOTICE_EVERY_S = 10.0  # how often a wait after an interrupt or failure says what it still waits for


def wait_stopped(workers: "list[CompiledWorkerThread]", why: str) -> None:
    """After an interrupt or a failure (``why``), with the workers asked to stop: wait until each
    one's ``run()`` has returned and its OS thread is gone, saying at once and every
    NOTICE_EVERY_S seconds which ones are still running, what each is doing, and that Ctrl-C stops
    the wait. A Ctrl-C here abandons the workers still running (left running, and not waited for
    again at exit) and propagates."""
    pending = [w for w in workers if w.ident is not None and not w._abandoned]
    said = None
    try:
        while pending:
            pending = [w for w in pending if not w._wait_gone(0.1)]
            now = time.monotonic()
            if pending and (said is None or now - said >= NOTICE_EVERY_S):
                said = now
                log.warning("threadgraph: %s; waiting for %s to stop; press Ctrl-C again to stop waiting and leave "
                            "them running", why, ", ".join(_doing(w) for w in pending))
    except KeyboardInterrupt:
        for worker in pending:
            worker._abandoned = True
        if pending:
            log.warning("threadgraph: stopped waiting; %s left running (the process may not exit cleanly while "
                        "they run)", ", ".join(w.name for w in pending))
        raise


def _doing(worker: "CompiledWorkerThread") -> str:
    activity, seconds = worker.activity
    return f"{worker.name} ({activity} for {seconds:.0f} s)"


def _stop_at_exit() -> None:
    """At interpreter exit, before daemon threads are frozen mid-step (torch can abort the process
    then), stop the daemon workers still running and wait for them a while, as concurrent.futures
    does. Non-daemon workers are left to finish: Python waits for them itself; workers a Ctrl-C
    already stopped waiting for are not waited for again."""
    workers = [w for w in list(_running) if w.daemon and w.is_alive() and not w._abandoned]
    if not workers:
        return
    log.warning("threadgraph: the interpreter is exiting with %d worker(s) running (%s); stopping them",
                len(workers), ", ".join(w.name for w in workers))
    for worker in workers:
        worker._stop_with_group()
    deadline = time.monotonic() + EXIT_WAIT_S
    left = [w.name for w in workers if not w._wait_gone(max(0.0, deadline - time.monotonic()))]
    if left:
        log.error("threadgraph: worker(s) %s did not stop within %.0f s of exit; leaving them", ", ".join(left),
                  EXIT_WAIT_S)


# threading's own exit hook (what concurrent.futures uses) runs before the interpreter stops
# daemon threads; atexit would run after.
getattr(threading, "_register_atexit", atexit.register)(_stop_at_exit)

class CompiledWorkerThread(threading.Thread):
    """A thread that owns one compiled model on one device.

    Override ``setup()`` (build and compile; runs in this thread on ``self.device``), ``step()``
    (one iteration) and ``teardown()``. ``run()`` belongs to the base class: it binds the device,
    gives the thread its CUDAGraph Trees state and its own generation counters, holds the
    device gate's shared slot around ``setup()`` and each ``step()``, begins a new cudagraph step
    before each ``step()``, times steps after ``warmup_steps``, and stores any exception for
    ``join()``. Call ``self.stop()`` (from anywhere, also from ``step()``) to finish. Constructing
    a worker calls :func:`install`.

    Args:
        device: The worker's device (``"cuda:1"``, a ``torch.device``, an index); None means
            cuda:0, or the CPU where there is no CUDA.
        name: The thread's name (default: Python's).
        warmup_steps: Steps not timed (compiles and captures happen in them).
        max_steps: Steps after which the worker stops by itself; None runs until ``stop()``.
        daemon: Whether the thread is a daemon thread.

    Raises:
        UsageError: A bad ``device``, ``warmup_steps`` or ``max_steps`` (also a ValueError).
        ThreadgraphError: A CUDA device where torch sees no GPU.
        SettingError: A ``THREADGRAPH_*`` variable holds a bad value (:func:`install` runs here).
        UnsupportedTorchError: What :func:`install` raises for this torch.

    Attributes:
        device: The worker's ``torch.device``.
        warmup_steps: As passed.
        max_steps: As passed.
        stats: What the worker measured (:class:`StepStats`).
        worker_state: threadgraph's per-worker CUDAGraph Trees state (its generation counters).
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
        if not _count(warmup_steps) or not (max_steps is None or _count(max_steps)):
            raise UsageError(f"threadgraph: warmup_steps must be an integer >= 0 and max_steps one or None, got "
                             f"warmup_steps={warmup_steps!r}, max_steps={max_steps!r}")
        self.device = resolve_device(device)
        install()  # here, in the constructing thread, so it precedes any compile in the worker
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.stats = StepStats()
        self.worker_state = WorkerState(self.name, self.device)
        self._stop_requested = threading.Event()
        self._done = threading.Event()  # run() returned
        self._exception: Optional[BaseException] = None
        self._phase = "start"
        self._membership: Optional[Membership] = None
        self._abandoned = False  # a Ctrl-C stopped the wait for it (wait_stopped): never waited for again

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
        if self._membership is not None:
            self._membership.wake()

    @property
    def stopping(self) -> bool:
        """Whether the worker was asked to stop (by ``stop()``, its group, or a failure)."""
        return self._stop_requested.is_set()

    @property
    def exception(self) -> Optional[BaseException]:
        """The exception the worker failed with, or None (``join()`` raises it as a WorkerError)."""
        return self._exception

    @property
    def activity(self) -> tuple[str, float]:
        """What the worker is doing now and for how many seconds: its setup turn, setup, compiling
        a frame, waiting for a peer's compile, warming up or recording graphs, warmup steps,
        stepping. Readable from any thread (a startup progress display polls it)."""
        state = self.worker_state
        return state.activity, time.monotonic() - state.activity_since

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the worker; re-raise its exception as WorkerError (the original as cause).
        Ctrl-C while waiting stops the worker, waits for it, and re-raises, as a group's join does.

        Raises:
            WorkerError: The worker failed.
            JoinTimeout: Still running after ``timeout`` seconds (also a TimeoutError); it names
                what the worker is doing and leaves it running (``stop()`` asks it to end).
        """
        try:
            super().join(timeout)
        except KeyboardInterrupt:
            self._stop_with_group()
            wait_stopped([self], "interrupted")
            raise
        if self.is_alive():
            raise JoinTimeout(f"threadgraph: worker {_doing(self)} still running after {timeout} s; "
                               "call stop() to ask it to end, or join() again to keep waiting")
        wait_for_thread_exit(self)
        if self._exception is not None:
            raise self.worker_error() from self._exception

    def join_group(self, membership: Membership) -> None:
        """Called by ``WorkerGroup.add``: the worker belongs to that group from now on."""
        if self._membership is not None:
            raise UsageError(f"threadgraph: worker {self.name} belongs to another group; a worker is in one group")
        self._membership = membership

    def gate(self) -> contextlib.AbstractContextManager:
        """The shared slot of this worker's device (a no-op on CPU)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return gate_for(str(self.device)).shared()

    def run(self) -> None:
        """The thread's body (do not override): setup, steps until stopped, teardown."""
        _running.add(self)
        try:
            self._run()
        finally:
            self._done.set()

    def _wait_gone(self, timeout: Optional[float] = None) -> bool:
        """Wait until ``run()`` has returned and the OS thread is gone (hazard
        stash-released-at-thread-exit); whether it is. Unlike ``Thread.join``, whose wait a Ctrl-C
        can leave reporting a running thread as stopped, this holds after an interrupt too."""
        if self.ident is None:
            return True
        if not self._done.wait(timeout):
            return False
        wait_for_thread_exit(self)
        return True

    def _stop_with_group(self) -> None:
        """Stop this worker and, when it has one, its group: the group's queues close too, waking
        a worker blocked on one."""
        if self._membership is not None:
            self._membership.stop()
        self.stop()

    def _run(self) -> None:
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
                    setup_began = time.perf_counter()
                    with doing(state, "setup"):
                        self.setup()
                    self.stats.setup_seconds = time.perf_counter() - setup_began
            if self._membership is not None:
                with doing(state, "waiting for the other workers' setups"):
                    self._membership.setup_done(self)
            self.stats.steps_began_at = time.perf_counter() - started
            if not skipped:
                self._phase = "step"
                state.begin("warmup steps")
                self._loop(timer, started)
        except GroupStopped as exc:
            if not self.stopping:  # another group's queue, or one closed by hand: this worker's failure
                error, failed_in = exc, self._phase
        except BaseException as exc:  # stored and re-raised from join(); nothing is swallowed
            error, failed_in = clear_capture_conflict(exc, self.device), self._phase
        if skipped and error is None:
            log.debug("threadgraph: worker %s stopped before its setup ran", self.name)
            release_cudagraph_tls()
            return
        try:
            self._phase = "teardown"
            with self.gate():  # CUDA work of this thread, event syncs included, holds the slot
                # teardown first (it may be what unblocks a stuck kernel, an aborted communicator
                # say); the timings are kept when it fails
                torn = None
                try:
                    self.teardown()
                except BaseException as exc:
                    torn = exc
                self.stats.step_ms = timer.finish()
                if torn is not None:
                    raise torn
        except BaseException as exc:
            if error is None:
                error, failed_in = exc, "teardown"
            else:
                add_note(error, f"teardown of {self.name} also failed: {exc!r}")
        finally:
            self._copy_startup_stats()
            self.worker_state.begin("failed" if error is not None else "finished")
            release_cudagraph_tls()
        if error is None:
            log.debug("threadgraph: worker %s on %s finished: %s", self.name, self.device, self.stats.summary())
            return
        self._phase = failed_in
        self._exception = error
        log.error("threadgraph: worker %s on %s failed in %s: %r", self.name, self.device, failed_in, error)
        if self._membership is not None:
            self._membership.failed(self, error)

    # -- internals -----------------------------------------------------------------------
    def _setup_turn(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext() if self._membership is None else self._membership.setup_turn()

    def _bind(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per host thread (hazard per-thread-device)
        install()
        ensure_cudagraph_tls()
        bind_worker(self.worker_state)

    def _loop(self, timer: StepTimer, started: float) -> None:
        mark_step = torch.compiler.cudagraph_mark_step_begin
        if self.warmup_steps == 0:
            with self.gate():
                self._end_warmup(timer, started)
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
        self.worker_state.begin("stepping")
        timer.discard()

    def _copy_startup_stats(self) -> None:
        state, stats = self.worker_state, self.stats
        stats.warmups, stats.captures = state.warmups, state.captures
        stats.compile_seconds, stats.capture_seconds = state.compile_seconds, state.capture_seconds
        stats.turn_wait_seconds = state.turn_wait_seconds

    def worker_error(self) -> Optional[WorkerError]:
        """The WorkerError that ``join()`` raises for this worker's failure (None while it has not
        failed): the worker's name, device and phase, from its exception."""
        exc = self._exception
        if exc is None:
            return None
        return WorkerError(
            f"threadgraph: worker {self.name!r} on {self.device} failed in {self._phase}: {type(exc).__name__}: {exc}",
            thread_name=self.name,
            device=str(self.device),
        )


def _count(value) -> bool:
    """An integer >= 0 (not a bool, not a float such as 2.5)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
