"""torch 2.13+'s graph_capture_lock beside the device gate (hazard capture-lock-order), on the CPU:
the gate and the lock are plain thread machinery, so the hang the GPU showed replays here with
threads standing in for a worker in its step and a thread warming up."""

import importlib
import threading

import pytest

from tests.library.gate_sim import fresh_gate
from threadgraph import GateTimeout
from threadgraph._patches.capture_lock import CaptureLock
from threadgraph._patches.gate_wrappers import exclusive


def _threads(*targets):
    errors = {}

    def wrap(name, fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported to the test below
                errors[name] = exc
        return threading.Thread(target=run, name=name)

    threads = [wrap(fn.__name__, fn) for fn in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), f"{t.name} still running"
    return errors


def _worker_meets_the_lock_held_by_a_warmup(lock, gate):
    """A warm-up holds the lock and wants the device; a worker holding its slot meets the lock."""
    in_lock, in_step = threading.Event(), threading.Event()
    seen = {}

    def warmup():
        with lock:
            in_lock.set()
            assert in_step.wait(30), "the worker never began its step"
            with gate.exclusive():
                seen["warmup"] = "ran"

    def worker():
        with gate.shared():
            in_step.set()
            assert in_lock.wait(30), "the warm-up never took the lock"
            with lock:
                seen["worker_holds_slot_in_lock"] = gate.holds_shared()
            seen["worker_slot_back"] = gate.holds_shared()

    return _threads(warmup, worker), seen


def test_a_worker_in_its_step_and_a_warmup_both_get_through():
    gate = fresh_gate("capture-lock-", timeout=20)
    errors, seen = _worker_meets_the_lock_held_by_a_warmup(CaptureLock(threading.Lock()), gate)
    assert not errors, errors
    assert seen == {"warmup": "ran", "worker_holds_slot_in_lock": False, "worker_slot_back": True}


def test_with_upstreams_plain_lock_the_warmup_never_gets_the_device():
    gate = fresh_gate("capture-lock-", timeout=1)
    errors, seen = _worker_meets_the_lock_held_by_a_warmup(threading.Lock(), gate)
    assert isinstance(errors.get("warmup"), GateTimeout), errors
    assert "exclusive use" in str(errors["warmup"]) and "warmup" not in seen


class _ObservedLock:
    """The lock under a CaptureLock, which tells when another thread comes to wait for it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.wanted = threading.Event()  # set by an acquire that finds the lock held

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        if self._lock.locked():
            self.wanted.set()
        return self._lock.acquire(blocking, timeout)

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


def _setup_while_a_warmup_holds_the_lock(lock_first, monkeypatch):
    """A manager set-up (wrapped like gate_manager_init; upstream's __init__ takes the lock inside)
    starts while a warm-up holds the lock; the warm-up then wants the device."""
    gate = fresh_gate("capture-lock-", timeout=1)
    inner = _ObservedLock()
    lock = CaptureLock(inner)
    trees = importlib.import_module("torch._inductor.cudagraph_trees")
    monkeypatch.setattr(trees, "graph_capture_lock", lock, raising=False)
    index = int(gate.device.split(":")[1])
    monkeypatch.setattr("threadgraph._patches.gate_wrappers.gate_for", lambda device: gate)
    in_lock, setup_done = threading.Event(), threading.Event()

    def upstream_init(device_index):
        with trees.graph_capture_lock:
            setup_done.set()

    def setup():
        assert in_lock.wait(30), "the warm-up never took the lock"
        exclusive(None, capture_lock_first=lock_first)(upstream_init, None, (index,), {})

    def warmup():
        with lock:
            in_lock.set()
            # Once the set-up waits for the lock, it has taken the device first or not at all:
            # the warm-up wants the device only then.
            assert inner.wanted.wait(30), "the set-up never came to the lock"
            with gate.exclusive():
                pass

    return _threads(warmup, setup), setup_done.is_set()


def test_the_manager_setup_takes_the_lock_before_the_gate(monkeypatch):
    errors, setup_done = _setup_while_a_warmup_holds_the_lock(True, monkeypatch)
    assert not errors and setup_done, errors


def test_a_setup_that_takes_the_gate_first_hangs_against_a_warmup(monkeypatch):
    errors, setup_done = _setup_while_a_warmup_holds_the_lock(False, monkeypatch)
    assert isinstance(errors.get("warmup"), GateTimeout), errors


def test_the_lock_is_reentrant_and_refuses_a_release_it_does_not_hold():
    lock = CaptureLock(threading.Lock())
    with lock:
        with lock:
            assert lock.locked()
        assert lock.locked()
    assert not lock.locked()
    with pytest.raises(RuntimeError, match="releases torch's CUDA graph capture lock without holding it"):
        lock.release()
    assert lock.acquire(blocking=False)
    lock.release()
