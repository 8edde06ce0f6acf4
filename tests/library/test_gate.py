"""The device gate: mutual exclusion of capture and other work, no deadlock, bounded waits."""

import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import threadgraph
from threadgraph._device.gate import DeviceGate, gate_for, released

from tests.library.gate_sim import COMPILE_LOCK, DeviceThread, Monitor, fresh_gate
from tests.helpers.threads import until


def run_program(gate, monitor, device_thread, program, fail_at, peers):
    with gate.shared():  # like CompiledWorkerThread.step()
        for i, op in enumerate(program):
            if i == fail_at:
                raise ValueError("planned failure")
            if op == "work":
                monitor.enter("shared")
                monitor.leave("shared")
            elif op == "capture":  # an upgrade from the shared slot
                with gate.exclusive():
                    monitor.enter("exclusive")
                    monitor.leave("exclusive")
            elif op in ("backward", "backward_capture", "backward_compile"):
                with released():  # what the gate_release_in_backward patch does
                    job = device_thread.backward(0 if op == "backward" else 1, compiles=op == "backward_compile")
                    error = job.get(timeout=30)
                if error is not None:
                    raise error
            elif op == "compile":  # a Dynamo cache miss: the gate_release_in_compile patch, then the lock
                with released(), COMPILE_LOCK:
                    time.sleep(0.001)
            elif op == "wait_peers":  # a queue wait on other workers
                with released():
                    peers.wait(timeout=30)


programs = st.lists(
    st.tuples(
        st.lists(st.sampled_from(["work", "capture", "backward", "backward_capture", "backward_compile", "compile", "wait_peers"]), max_size=12),
        st.one_of(st.none(), st.integers(0, 11)),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(programs)
def test_random_interleavings_keep_capture_exclusive_and_finish(programs):
    gate = fresh_gate("test-random", timeout=30)  # a registered gate, so released() sees it
    monitor = Monitor()
    device_thread = DeviceThread(gate, monitor)
    try:
        peers = _Peers(len(programs))
        results = {}

        def worker(index, program, fail_at):
            try:
                run_program(gate, monitor, device_thread, program, fail_at, peers)
                results[index] = "ok"
            except ValueError:
                results[index] = "failed as planned"
            except BaseException as exc:  # a peers' wait that timed out too: asserted below
                results[index] = exc
            finally:
                peers.leave()

        threads = [threading.Thread(target=worker, args=(i, p, f)) for i, (p, f) in enumerate(programs)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), f"deadlock: holders {gate.holders()}"
        assert monitor.violations == []
        for i, (program, fail_at) in enumerate(programs):
            expected = "failed as planned" if fail_at is not None and fail_at < len(program) else "ok"
            assert results[i] == expected, results[i]
        assert gate.holders() == {"exclusive": None, "shared": [], "exclusive_waiting": 0}
    finally:
        device_thread.close()


class _Peers:
    """A barrier of the workers whose programs still run: ``wait`` returns once every such worker waits
    (one that ends its program, as planned or failing as planned, ``leave``s: it is waited for no more).
    Every worker reaches a wait or its end, so a wait that times out is a deadlock, and fails the test."""

    def __init__(self, workers: int) -> None:
        self._cond = threading.Condition()
        self._running, self._waiting, self._round = workers, 0, 0

    def wait(self, timeout: float) -> None:
        with self._cond:
            round_ = self._round
            self._waiting += 1
            self._release_if_all_wait()
            if not self._cond.wait_for(lambda: self._round != round_, timeout):
                raise AssertionError(f"a worker waited {timeout} s for its peers: {self._waiting} of "
                                     f"{self._running} came")

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            self._release_if_all_wait()

    def _release_if_all_wait(self) -> None:
        if self._waiting and self._waiting == self._running:
            self._waiting, self._round = 0, self._round + 1
            self._cond.notify_all()


def test_exclusive_waits_for_shared_and_blocks_new_shared():
    gate = DeviceGate("t:1", timeout=10)
    order = []
    gate.acquire_shared()
    got_exclusive = threading.Event()

    def capturer():
        with gate.exclusive():
            order.append("exclusive")
            got_exclusive.set()

    t = threading.Thread(target=capturer)
    t.start()
    until(lambda: gate.holders()["exclusive_waiting"] == 1)
    assert not got_exclusive.is_set()  # queued, held back by our shared slot
    late_shared = threading.Thread(target=lambda: (gate.acquire_shared(), order.append("late shared"), gate.release_shared()))
    late_shared.start()
    gate.release_shared()
    t.join(10)
    late_shared.join(10)
    assert order == ["exclusive", "late shared"]


def test_upgrade_from_shared_does_not_deadlock_two_upgraders():
    gate = DeviceGate("t:2", timeout=10)
    barrier = threading.Barrier(2)
    errors = []

    def upgrader():
        try:
            with gate.shared():
                barrier.wait(5)
                with gate.exclusive():
                    with gate.exclusive():  # reentrant
                        pass
                assert gate.holders()["shared"]  # slot given back after the exclusive section
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=upgrader) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert errors == [] and not any(t.is_alive() for t in threads)


def test_timeout_names_the_holder():
    gate = DeviceGate("cuda:9", timeout=0.3)
    holder_in = threading.Event()
    finish = threading.Event()

    def holder():
        with gate.shared():
            holder_in.set()
            finish.wait(10)

    t = threading.Thread(target=holder, name="stuck-worker")
    t.start()
    holder_in.wait(5)
    with pytest.raises(threadgraph.GateTimeout, match="stuck-worker") as info:
        gate.acquire_exclusive()
    assert info.value.device == "cuda:9"
    finish.set()
    t.join(10)
    gate.acquire_exclusive()  # nothing left held after the failed wait
    gate.release_exclusive()


def test_release_without_holding_is_an_error():
    gate = DeviceGate("t:3")
    with pytest.raises(RuntimeError, match="does not hold"):
        gate.release_shared()
    with pytest.raises(RuntimeError, match="without owning"):
        gate.release_exclusive()


def test_released_restores_slots_on_every_gate():
    a, b = gate_for("test:a"), gate_for("test:b")
    me = [threading.current_thread().name]
    with a.shared(), b.shared():
        with a.shared():  # two slots of a
            with released():
                assert a.holders()["shared"] == [] and b.holders()["shared"] == []
            assert a.holders()["shared"] == me and b.holders()["shared"] == me
        assert a.holders()["shared"] == me  # both slots came back: leaving one keeps the other
    assert a.holders()["shared"] == [] and b.holders()["shared"] == []


def test_a_timed_out_restore_surfaces_as_the_timeout_not_as_a_bookkeeping_error(caplog):
    """Seen on an H200: a worker leaving released() timed out behind a stuck capture, and its
    gate's exit then reported "releases a shared slot it does not hold", hiding the timeout."""
    gate = gate_for("test:restore")
    gate.timeout = 0.3
    owner_in, owner_out = threading.Event(), threading.Event()

    def owner():
        with gate.exclusive():
            owner_in.set()
            owner_out.wait(10)

    with pytest.raises(threadgraph.GateTimeout, match="a shared slot"):
        with gate.shared():
            with released():
                t = threading.Thread(target=owner, name="stuck-capture")
                t.start()
                owner_in.wait(10)
    owner_out.set()
    t.join(10)
    assert gate.holders()["shared"] == [] and gate.holders()["exclusive"] is None
    assert "--- thread stuck-capture ---" in caplog.text  # every thread's stack is logged


def test_a_dynamo_compile_gives_the_slot_up_while_it_runs():
    """Dynamo compiles under one process-wide lock; a worker that waits for it must not hold
    its slot (a one-GPU DFlash run stalled that way on an H200)."""
    import torch

    threadgraph.install()
    gate = gate_for("test:compile")
    seen = []

    def backend(gm, example_inputs):
        seen.append(gate.holders()["shared"])
        return gm.forward

    fn = torch.compile(lambda x: x * 3, backend=backend)
    with gate.shared():
        assert fn(torch.ones(2)).tolist() == [3.0, 3.0]
        assert gate.holders()["shared"] == [threading.current_thread().name]
    assert seen == [[]]


def _capture_while_a_worker_is_queued_on_the_compile_lock(gate) -> str:
    """Thread C compiles (holding Dynamo's compile lock, its backend parked); worker W, holding
    its slot, calls another compiled function and queues on that lock; a capture then asks for
    the gate. Returns what the capture got."""
    import torch

    torch._dynamo.reset()  # the lambdas below share code objects across calls: start uncompiled
    in_compile, finish = threading.Event(), threading.Event()

    def slow_backend(gm, example_inputs):
        in_compile.set()
        assert finish.wait(30)
        return gm.forward

    slow = torch.compile(lambda x: x - 1, backend=slow_backend)
    other = torch.compile(lambda x: x + 1, backend="eager")
    compiler = threading.Thread(target=lambda: slow(torch.ones(2)), name="compiling")
    worker_done = threading.Event()

    worker_calls = threading.Event()

    def worker_body():
        with gate.shared():
            worker_calls.set()
            other(torch.ones(2))  # queues on the compile lock
        worker_done.set()

    worker = threading.Thread(target=worker_body, name="worker")
    compiler.start()
    assert in_compile.wait(30)
    worker.start()
    # From here the worker holds its slot until its compile (queued behind ours) is done, unless
    # the compile patch gives the slot up: the capture below tells the two apart without timing.
    assert worker_calls.wait(30)
    outcome = "captured"
    try:
        with gate.exclusive():
            pass
    except threadgraph.GateTimeout as exc:
        outcome = f"timeout: {exc}"
    finally:
        finish.set()
        compiler.join(30)
        worker.join(30)
    assert worker_done.is_set()
    return outcome


def test_a_worker_queued_on_dynamos_compile_lock_does_not_hold_captures_up():
    """The one-GPU DFlash stall on an H200: workers queued on Dynamo's process-wide compile
    lock while holding their slots, so every capture on the device waited for every compile."""
    threadgraph.uninstall()
    threadgraph.install()
    gate = gate_for("test:convoy")
    gate.timeout = 5
    assert _capture_while_a_worker_is_queued_on_the_compile_lock(gate) == "captured"


def test_without_the_compile_patch_the_capture_waits_for_the_compile():
    threadgraph.uninstall()
    threadgraph.install(exclude={"gate_release_in_compile"})
    try:
        gate = gate_for("test:convoy-unpatched")
        gate.timeout = 1.5
        assert _capture_while_a_worker_is_queued_on_the_compile_lock(gate).startswith("timeout")
    finally:
        threadgraph.uninstall()
