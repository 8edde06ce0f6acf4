"""Per-thread CUDAGraph Trees state and the per-worker state threadgraph adds to it.

Both live in torch's C++ thread-local object stash, because autograd copies that stash
(as part of ThreadLocalState) into its device threads, where backward graphs are warmed
up, recorded and replayed. A plain ``threading.local`` does not travel there.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import sys
import threading
import time
import weakref
from collections import defaultdict
from typing import Any, Callable, Iterator, Optional

import torch

from threadgraph import _compat

TREE_TLS_KEYS = ("tree_manager_containers", "tree_manager_locks")
EXIT_WAIT_S = 5.0  # how long interpreter exit waits, all together, for finished threads' OS threads
WORKER_KEY = "threadgraph.worker"
log = logging.getLogger("threadgraph")


def ensure_cudagraph_tls() -> bool:
    """Give the calling thread its own CUDAGraph Trees state, as the importing thread has it.

    The fix for hazard ``tls-assert`` without :func:`install`: call it at the start of a thread
    that calls reduce-overhead functions. Idempotent and safe from any thread; on every torch
    2.1 - 2.15. The objects stay valid in autograd's backward thread (hazard
    ``stash-steals-reference``).

    Returns:
        Whether anything had to be created.
    """
    trees = _compat.cudagraph_trees()
    if all(torch._C._is_key_in_tls(key) for key in TREE_TLS_KEYS):
        return False
    local = trees.local
    if not hasattr(local, "tree_manager_containers"):
        # The same two objects the module creates at import (2.1 - 2.12) or in
        # ``_initialize_tls`` (2.13+): one tree-manager container and one lock per device.
        local.tree_manager_containers = {}
        local.tree_manager_locks = defaultdict(threading.Lock)
    for key in TREE_TLS_KEYS:
        if not torch._C._is_key_in_tls(key):
            _compat.stash(key, getattr(local, key))
    _note_stashing_thread()
    return True


class WorkerState:
    """What one worker owns that upstream keeps process-wide.

    ``mark_step_counter`` and ``generation`` replace ``MarkStepBox.mark_step_counter`` and
    ``GenerationTracker.generation`` for this worker's tree managers (hazard global-generation); instances
    also key the per-worker cudagraphify state (hazard shared-cudagraphify-state). Read from the stash, so the
    worker's backward on autograd's device thread sees the same object.
    """

    _ids = itertools.count()

    def __init__(self, name: str, device: Optional[torch.device] = None) -> None:
        self.id = next(self._ids)
        self.name = name
        self.device = device
        self.mark_step_counter = 0
        self.generation = 0
        self.warmups = 0
        self.captures = 0
        # Startup, as the worker's own thread spends it: Dynamo frame compiles, graph recording
        # or capture, waits for another worker's first call of the same compiled code.
        self.compile_seconds = 0.0
        self.capture_seconds = 0.0
        self.turn_wait_seconds = 0.0
        self.recording = False  # inside a tree manager's record_function (its captures count there)
        self.activity = "starting"
        self.activity_since = time.monotonic()

    def begin(self, what: str) -> None:
        """Show ``what`` as this worker's activity from now on."""
        self.activity, self.activity_since = what, time.monotonic()

    def current_generation(self) -> int:
        # Same rule as CUDAGraphTreeManager.get_curr_generation, on this worker's counters.
        return self.mark_step_counter if self.mark_step_counter != 0 else self.generation

    def __repr__(self) -> str:
        return f"WorkerState({self.name!r}, device={self.device}, generation={self.current_generation()})"


@contextlib.contextmanager
def doing(state: Optional[WorkerState], what: str) -> Iterator[None]:
    """Show ``what`` as the worker's activity for the block (nested blocks restore the outer one)."""
    if state is None:
        yield
        return
    outer = state.activity, state.activity_since
    state.begin(what)
    try:
        yield
    finally:
        state.activity, state.activity_since = outer


class _BoundWorker(threading.local):
    """The calling thread's worker as ``bind_worker`` bound it; None until then (a class default: see
    ``_per_thread``). It keeps the WorkerState alive where the stash cannot be cleared, and answers
    hot paths faster than the stash does."""

    state: Optional["WorkerState"] = None


bound = _BoundWorker()


def current_worker() -> Optional[WorkerState]:
    """The worker whose work the calling thread does (its own, or its caller's in backward)."""
    if torch._C._is_key_in_tls(WORKER_KEY):
        return torch._C._get_obj_in_tls(WORKER_KEY)
    return None


def bind_worker(state: WorkerState) -> None:
    """Make ``state`` the calling thread's worker, for this thread and its backward."""
    bound.state = state
    _compat.stash(WORKER_KEY, state)
    _note_stashing_thread()


# Python threads whose stash holds entries, by OS thread id: their C++ thread-local destructor
# releases the entries after join() returns (hazard stash-released-at-thread-exit), so the
# interpreter must not finalise before those OS threads are gone.
_stashing_threads: "dict[int, weakref.ref[threading.Thread]]" = {}
_stashing_lock = threading.Lock()


def _note_stashing_thread() -> None:
    thread = threading.current_thread()
    native_id = getattr(thread, "native_id", None)
    if native_id is None or isinstance(thread, threading._DummyThread) or thread is threading.main_thread():
        return
    with _stashing_lock:
        _stashing_threads[native_id] = weakref.ref(thread)


def wait_for_finished_stashing_threads(timeout: float = EXIT_WAIT_S) -> list[int]:
    """Wait until the OS threads of Python threads that stashed entries and have finished are gone
    (Linux; elsewhere nothing to wait for); returns the OS thread ids still there at ``timeout``.
    Runs at interpreter exit, after Python has joined its non-daemon threads: a plain thread that
    ran compiled code under ``install()`` and was joined just before exit would otherwise release
    its stash while the interpreter finalises, which aborts the process. Threads still running
    (daemons) are not waited for."""
    if not sys.platform.startswith("linux"):
        return []
    with _stashing_lock:
        entries = list(_stashing_threads.items())
    # Not is_alive(): a Ctrl-C inside Thread.join() can leave a running thread reporting itself
    # stopped (CPython's join marks it stopped when interrupted). A thread is listed by
    # enumerate() until its bootstrap returns.
    running = {thread.native_id for thread in threading.enumerate()}
    deadline = time.monotonic() + timeout
    left = []
    for native_id, ref in entries:
        thread = ref()
        if thread is not None and native_id in running:
            continue
        task = f"/proc/self/task/{native_id}"
        while os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.0005)
        if os.path.exists(task):
            left.append(native_id)
        else:
            with _stashing_lock:
                _stashing_threads.pop(native_id, None)
    if left:
        names = [getattr(_stashing_threads.get(tid, lambda: None)(), "name", "?") for tid in left]
        log.warning("threadgraph: OS thread(s) %s (%s) still exist %.1f s into interpreter exit; their stash entries may "
                    "be released while Python finalises", left, names, timeout)
    return left


atexit.register(wait_for_finished_stashing_threads)  # atexit runs after threading joined its threads


def release_cudagraph_tls() -> None:
    """Drop the calling thread's stash entries (tree state and worker) where torch can (2.13+).

    Call it last in a thread that called :func:`ensure_cudagraph_tls`. Entries left in the stash
    are released by the thread's C++ thread-local destructor after Python's ``join()`` returns;
    that takes the GIL, and while the interpreter finalises, Python (< 3.14) ends such a thread
    with ``pthread_exit`` inside a noexcept destructor: the process aborts with "terminate
    called without an active exception" (hazard ``stash-released-at-thread-exit``). Workers call
    it themselves.
    """
    for key in (WORKER_KEY, *TREE_TLS_KEYS):
        _compat.unstash(key)
    bound.state = None


def wait_for_thread_exit(thread: threading.Thread, timeout: float = 5.0) -> bool:
    """After ``thread.join()``: wait until the OS thread is gone too, so its C++ thread-local
    destructors (hazard stash-released-at-thread-exit) have run. Linux only (elsewhere returns at once); returns whether
    the thread is known to be gone."""
    native_id = getattr(thread, "native_id", None)
    if native_id is None or not sys.platform.startswith("linux"):
        return False
    task = f"/proc/self/task/{native_id}"
    deadline = time.monotonic() + timeout
    while os.path.exists(task):
        if time.monotonic() > deadline:
            log.warning("threadgraph: thread %s (tid %d) still exists %.1f s after join", thread.name, native_id, timeout)
            return False
        time.sleep(0.0005)
    return True


def worker_for_current_thread() -> Optional[WorkerState]:
    """The calling thread's worker, created on first use for Python threads.

    Threads Python did not start (autograd's device threads among them) get none: there the
    stash carries the caller's worker, and when it does not, upstream's global behaviour applies.
    """
    state = current_worker()
    if state is not None:
        return state
    thread = threading.current_thread()
    if isinstance(thread, threading._DummyThread):
        return None
    state = WorkerState(thread.name)
    bind_worker(state)
    return state


# -- the wrappers of patches lazy_tls and worker_cudagraphify (_patches.PATCHES) --------------
def lazy_tls(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    local, attr_name = args[0], args[1]
    if not hasattr(local, attr_name) and not torch._C._is_key_in_tls(attr_name):
        ensure_cudagraph_tls()
    return wrapped(*args, **kwargs)


class _NoWorker:
    """Key of the shared cudagraphify state used by threads without a worker (upstream behaviour)."""


_NO_WORKER = _NoWorker()


def per_worker_cudagraphify(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    # Upstream binds the recorded function, and with it one tree manager, to the first
    # caller (<=2.12) or to the executing thread (2.13+, so every worker's backward shares
    # autograd's device thread). Key it by the worker instead, which travels into backward.
    per_worker: "weakref.WeakKeyDictionary[Any, Callable]" = weakref.WeakKeyDictionary()
    lock = threading.Lock()

    def run(new_inputs: Any) -> Any:
        # Python threads get a worker of their own on first use (even when the generation
        # patches are left out); autograd's threads see their caller's through the stash.
        key = worker_for_current_thread() or _NO_WORKER
        fn = per_worker.get(key)
        if fn is None:
            with lock:
                fn = per_worker.get(key)
                if fn is None:
                    fn = per_worker[key] = wrapped(*args, **kwargs)
        return fn(new_inputs)

    return run
