"""A group of workers: started together, joined together, the first failure stops all; and the
queues its workers hand work through, which wake every blocked worker when the group stops."""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Callable, Iterable, Optional

from threadgraph._device.gate import released
from threadgraph._device.tls import wait_for_thread_exit
from threadgraph._errors import GroupStopped, JoinTimeout, ThreadgraphError, UsageError, WorkerError, add_note
from threadgraph._workers.worker import CompiledWorkerThread, wait_stopped

log = logging.getLogger("threadgraph")


class GroupQueue(queue.Queue):
    """A ``queue.Queue`` owned by a WorkerGroup (``group.queue()``): ``get()`` and ``put()`` wait
    with the device gate's slots given up (``released()``) and raise GroupStopped in every blocked
    worker once the group stops or fails, so no ``on_failure`` callback is needed to wake them."""

    def __init__(self, maxsize: int = 0) -> None:
        super().__init__(maxsize)
        self._stopped = False

    def close(self) -> None:
        """Stop the queue: every worker blocked in ``get()``, ``put()`` or ``join()`` raises GroupStopped."""
        with self.mutex:
            self._stopped = True
            self.not_empty.notify_all()
            self.not_full.notify_all()
            self.all_tasks_done.notify_all()

    def join(self) -> None:
        """``queue.Queue.join``, woken like ``get()``: a producer waiting for a consumer that failed
        before its ``task_done()`` raises GroupStopped instead of waiting forever."""
        with released(), self.all_tasks_done:
            while self.unfinished_tasks:
                if self._stopped:
                    raise GroupStopped("threadgraph: the worker group stopped while this worker waited for its "
                                       "queue's tasks to be done")
                self.all_tasks_done.wait()

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
        """``queue.Queue.get``, with the device gate's slots given up while it waits; GroupStopped once stopped."""
        with released(), self.not_empty:
            self._wait(self.not_empty, lambda: self._qsize() > 0, block, timeout, queue.Empty)
            item = self._get()
            self.not_full.notify()
            return item

    def put(self, item, block: bool = True, timeout: Optional[float] = None) -> None:
        """``queue.Queue.put``, with the device gate's slots given up while it waits; GroupStopped once stopped."""
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
    is re-raised from ``join()``. As a context manager it starts the workers on entry, and on exit
    stops them (each finishes its current step) and joins them, re-raising the first failure: the
    block is the workers' lifetime, so call ``group.join()`` in it to wait for workers that end by
    themselves (``max_steps``). Ctrl-C, in the block or in a join, stops everything, setups still
    waiting their turn included, waits for the workers and propagates.

    No worker of a started group steps before every worker's ``setup()`` has returned, and with
    ``serial_setup`` (the default) setups run one at a time. Setups load models, and loading
    changes process-global state that other threads read: transformers' ``from_pretrained(dtype=)``
    sets torch's default dtype while it builds, so a step elsewhere creates bfloat16 tensors and
    a compile fails its own guards ("GLOBAL_STATE changed: default_dtype", hazard global-default-dtype). Pass
    ``serial_setup=False`` when setups must run together (for example, when they wait on each
    other); steps still wait for all setups.

    Args:
        workers: The workers, each not started yet and in no other group (more with ``add()``).
        serial_setup: Whether the workers' ``setup()``s run one at a time.

    Attributes:
        workers: The group's workers, in the order added.
        serial_setup: As passed.
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
        self._started = False
        self._start_error: Optional[BaseException] = None
        for worker in workers:
            self.add(worker)

    def queue(self, maxsize: int = 0) -> GroupQueue:
        """A queue between this group's workers that wakes every worker blocked on it when the
        group stops or fails (GroupQueue)."""
        q = GroupQueue(maxsize)
        self._queues.append(q)
        return q

    def add(self, worker: CompiledWorkerThread) -> CompiledWorkerThread:
        """Add a worker that was not started yet, before the group starts; returns it.

        Raises:
            UsageError: The group already started, or the worker was started already or is in
                this or another group already (a UsageError is also a ValueError and a RuntimeError).
        """
        if self._started:
            raise UsageError(f"threadgraph: the group already started; add worker {worker.name} before start(), "
                               f"or start it in a group of its own")
        if worker.is_alive() or worker.ident is not None:
            raise UsageError(f"threadgraph: worker {worker.name} was already started; add workers before start()")
        if worker in self.workers:
            raise UsageError(f"threadgraph: worker {worker.name} is in the group already; a worker is one thread, "
                             f"added once")
        worker.join_group(_Membership(self))
        self.workers.append(worker)
        return worker

    def on_failure(self, callback: Callable[[BaseException], None]) -> None:
        """Call ``callback(exc)`` once, when the first worker fails."""
        self._on_failure.append(callback)

    @property
    def broken(self) -> bool:
        """Whether a worker of the group has failed."""
        return self._first_failure is not None

    def start(self) -> "WorkerGroup":
        """Start every worker; returns the group. A group starts once.

        Raises:
            UsageError: The group was started already.
        """
        if self._started:
            raise UsageError("threadgraph: the group was started already; a group runs once, make a new one "
                               "(with new workers) to run again")
        self._started = True
        with self._setups_done:
            self._setups_left = len(self.workers)
        try:
            for worker in self.workers:
                worker.start()
        except BaseException as exc:  # the started ones would wait for the others' setups forever
            self._start_error = exc
            self._fail_all(exc)
            wait_stopped(self.workers, f"the group failed to start ({exc!r})")
            raise
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
        """Wait for all workers; raise the first failure. Ctrl-C stops all, waits for them, then re-raises.

        Raises:
            WorkerError: A worker failed (the first failure; later ones are its notes).
            JoinTimeout: A worker still runs after ``timeout`` seconds (also a TimeoutError); the
                workers are left running (``stop()`` asks them to end).
            UsageError: The group was never started.
            ThreadgraphError: The group failed to start (its workers were stopped).
        """
        if not self._started:
            raise UsageError("threadgraph: join() of a group that was never started; call start() first")
        if self._start_error is not None:
            raise ThreadgraphError(f"threadgraph: the group failed to start ({self._start_error!r}); its workers "
                               f"were stopped") from self._start_error
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            for worker in self.workers:
                while worker.is_alive():
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        activity, seconds = worker.activity
                        raise JoinTimeout(f"threadgraph: worker {worker.name} ({activity} for {seconds:.0f} s) still "
                                          f"running after {timeout} s; "
                                          "call stop() to ask the group to end, or join() again to keep waiting")
                    threading.Thread.join(worker, 0.2 if left is None else min(0.2, left))
                wait_for_thread_exit(worker)
        except KeyboardInterrupt:
            self._fail_all(KeyboardInterrupt())
            # not Thread.join: the interrupt may have left one reporting itself stopped
            wait_stopped(self.workers, f"interrupted; stopping {len(self.workers)} workers")
            raise
        failed = self._first_failure
        if failed is not None:
            others = [w for w in self.workers if w is not failed and w.exception is not None]
            error = failed.worker_error()
            for other in others:
                add_note(error, f"also failed: {other.name}: {other.exception!r}")
            raise error from failed.exception

    def __enter__(self) -> "WorkerGroup":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            self._fail_all(exc)
            named = isinstance(exc, WorkerError)  # join() raised it, naming every failed worker already
            wait_stopped(self.workers, f"the with-block raised {type(exc).__name__}")
            for worker in self.workers:
                if worker.exception is not None and not named:  # the body's exception carries theirs
                    add_note(exc, f"worker {worker.name} also failed: {worker.exception!r}")
            return None
        self.stop()
        self.join()

    def _worker_failed(self, worker: CompiledWorkerThread, error: BaseException) -> None:
        with self._lock:
            if self._first_failure is not None:
                return
            self._first_failure = worker
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        self.stop()
        interrupted: Optional[BaseException] = None
        for callback in self._on_failure:
            try:
                callback(error)
            except Exception as exc:  # a broken callback must not keep peers blocked
                log.error("threadgraph: failure callback %r raised %r", callback, exc)
                add_note(error, f"failure callback {callback!r} raised {exc!r}")
            except BaseException as exc:  # Ctrl-C or an exit in a callback: the others run, then it goes on
                interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted


class _Membership:
    """A worker's view of its group (the ``Membership`` the worker module asks for)."""

    def __init__(self, group: WorkerGroup) -> None:
        self._group = group

    def setup_turn(self) -> contextlib.AbstractContextManager:
        group = self._group
        return group._setup_lock if group.serial_setup else contextlib.nullcontext()

    def setup_done(self, worker: CompiledWorkerThread) -> None:
        self._group._wait_for_setups(worker)

    def wake(self) -> None:
        self._group._wake()

    def stop(self) -> None:
        self._group.stop()

    def failed(self, worker: CompiledWorkerThread, error: BaseException) -> None:
        self._group._worker_failed(worker, error)
