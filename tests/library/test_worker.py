import threading

import pytest
import torch

import threadgraph
from threadgraph import CompiledWorkerThread, WorkerError, WorkerGroup
from tests.helpers.threads import until


class Counter(CompiledWorkerThread):
    def __init__(self, fail_in=None, at_step=0, **kw):
        super().__init__("cpu", **kw)
        self.fail_in, self.at_step = fail_in, at_step
        self.events = []

    def setup(self):
        self.events.append("setup")
        self.model = torch.nn.Linear(4, 4)
        if self.fail_in == "setup":
            raise ValueError("boom in setup")

    def step(self):
        if self.fail_in == "step" and self.stats.steps == self.at_step:
            raise ValueError("boom in step")
        self.model(torch.randn(2, 4)).sum().backward()

    def teardown(self):
        self.events.append("teardown")
        if self.fail_in == "teardown":
            raise ValueError("boom in teardown")


@pytest.mark.parametrize("phase", ["setup", "step", "teardown"])
def test_exception_in_each_phase_reaches_join_with_the_workers_name(phase):
    worker = Counter(fail_in=phase, at_step=2, name=f"w-{phase}", max_steps=5)
    worker.start()
    with pytest.raises(WorkerError, match=rf"w-{phase}.*cpu.*{phase}.*boom in {phase}") as info:
        worker.join(30)
    assert isinstance(info.value.__cause__, ValueError)
    assert info.value.thread_name == f"w-{phase}" and info.value.device == "cpu"
    assert worker.events[-1] == "teardown"  # teardown runs after any failure


def test_teardown_failure_after_step_failure_keeps_both():
    class Both(Counter):
        def teardown(self):
            raise RuntimeError("teardown too")

    worker = Both(fail_in="step", name="both", max_steps=3)
    worker.start()
    with pytest.raises(WorkerError, match="boom in step") as info:
        worker.join(30)
    notes = getattr(info.value.__cause__, "__notes__", [])
    assert any("teardown too" in n for n in notes)


def test_max_steps_warmup_and_stats():
    worker = Counter(name="ok", max_steps=10, warmup_steps=3)
    worker.start()
    worker.join(30)
    assert worker.stats.steps == 10 and worker.stats.warmup_steps == 3
    assert len(worker.stats.step_ms) == 7 and worker.stats.p50_ms > 0
    assert worker.stats.p90_ms >= worker.stats.p50_ms


def test_stop_is_idempotent_and_ends_an_unbounded_worker():
    worker = Counter(name="forever")
    worker.start()
    worker.stop()
    worker.stop()
    worker.join(30)
    assert not worker.is_alive() and worker.exception is None


def test_group_fail_fast_stops_the_others_and_wakes_blocked_peers():
    blocked = threading.Event()
    wake = threading.Event()

    class Blocker(Counter):
        def step(self):
            blocked.set()
            with threadgraph.released():
                wake.wait(30)  # a queue wait; the failure callback wakes it

    class FailsWhileTheBlockerWaits(Counter):
        def step(self):
            # Fail only once the blocker is in its wait: on a loaded machine the failing worker
            # can otherwise reach its step 3 before the blocker has run a step at all.
            if self.stats.steps == self.at_step:
                assert blocked.wait(30), "the blocker never started a step"
            super().step()

    bad = FailsWhileTheBlockerWaits(fail_in="step", at_step=3, name="bad")
    group = WorkerGroup([Blocker(name="blocker"), Counter(name="healthy"), bad])
    group.on_failure(lambda exc: wake.set())
    group.start()
    with pytest.raises(WorkerError, match="'bad'"):
        group.join(60)
    assert group.broken
    assert all(not w.is_alive() for w in group.workers)
    assert blocked.is_set()


@pytest.mark.timeout(60)
def test_workers_blocked_on_a_group_queue_wake_when_another_fails_without_a_callback():
    group = WorkerGroup()
    inbox = group.queue()
    blocked = threading.Barrier(4)

    class Waiter(Counter):
        def step(self):
            blocked.wait(30)
            inbox.get()  # nothing ever arrives: only the group's failure ends this wait

    class Failer(Counter):
        def step(self):
            blocked.wait(30)
            raise ValueError("boom after the others blocked")

    for i in range(3):
        group.add(Waiter(name=f"waiter-{i}"))
    group.add(Failer(name="failer"))
    group.start()
    with pytest.raises(WorkerError, match="'failer'") as info:
        group.join(30)
    assert all(not w.is_alive() for w in group.workers)
    assert all(w.exception is None for w in group.workers[:3])  # woken, not failed
    assert "also failed" not in str(getattr(info.value, "__notes__", ""))


def test_a_group_queue_passes_items_and_honours_timeouts():
    import queue

    q = WorkerGroup().queue(maxsize=1)
    q.put(1)
    with pytest.raises(queue.Full):
        q.put(2, timeout=0.05)
    assert q.get() == 1
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)
    q.close()
    with pytest.raises(threadgraph.GroupStopped):
        q.get()


@pytest.mark.timeout(60)
def test_ctrl_c_during_serial_setups_skips_the_setups_still_waiting(sigint_raises_keyboard_interrupt):
    import signal

    started = threading.Event()

    class SlowSetup(Counter):
        def setup(self):
            started.set()
            self.events.append("setup")
            until(lambda: self.stopping)  # runs until the Ctrl-C stops the group, however late it comes

    workers = [SlowSetup(name=f"slow-{i}") for i in range(4)]
    group = WorkerGroup(workers)
    group.start()
    assert started.wait(30), "no setup began"
    threading.Timer(0.1, signal.raise_signal, (signal.SIGINT,)).start()  # Ctrl-C, once the main thread is in join()
    with pytest.raises(KeyboardInterrupt):
        group.join(30)
    ran = [w.name for w in workers if "setup" in w.events]
    assert len(ran) == 1, ran  # the one already running; the three queued ones never started
    assert all("teardown" not in w.events for w in workers if w.name not in ran)


def test_group_context_manager_stops_everything_on_ctrl_c():
    workers = [Counter(name=f"w{i}") for i in range(3)]
    with pytest.raises(KeyboardInterrupt):
        with WorkerGroup(workers):
            raise KeyboardInterrupt
    assert all(not w.is_alive() for w in workers)


def test_group_join_reports_other_failures_as_notes():
    gate = threading.Barrier(2)

    class FailTogether(Counter):
        def step(self):
            gate.wait(10)
            raise ValueError(f"boom {self.name}")

    group = WorkerGroup([FailTogether(name="a"), FailTogether(name="b")])
    group.start()
    with pytest.raises(WorkerError) as info:
        group.join(30)
    assert len(getattr(info.value, "__notes__", [])) == 1


def test_step_must_be_overridden():
    worker = CompiledWorkerThread("cpu", name="bare")
    worker.start()
    with pytest.raises(WorkerError, match="must override step"):
        worker.join(30)


def test_adding_a_started_worker_is_an_error():
    worker = Counter(name="early", max_steps=1)
    worker.start()
    worker.join(30)
    with pytest.raises(ValueError, match="already started"):
        WorkerGroup([worker])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cuda_device_without_gpu_gets_one_clear_error():
    with pytest.raises(threadgraph.ThreadgraphError, match="sees no GPU.*device='cpu'"):
        CompiledWorkerThread("cuda:0")


@pytest.mark.parametrize("device", ["tpu:0", "gibberish", 3.5])
def test_bad_device_strings_are_rejected(device):
    with pytest.raises(ValueError, match="device"):
        CompiledWorkerThread(device)


def test_each_worker_has_its_own_generation_state():
    seen = {}

    class Marker(Counter):
        def step(self):
            seen.setdefault(self.name, []).append(threadgraph._device.tls.current_worker())

    workers = [Marker(name=f"m{i}", max_steps=3) for i in range(2)]
    with WorkerGroup(workers) as group:
        group.join()  # the workers end by themselves (max_steps); leaving the block would stop them
    states = {name: {id(s) for s in v} for name, v in seen.items()}
    assert all(len(s) == 1 for s in states.values()) and states["m0"] != states["m1"]
    assert workers[0].worker_state.mark_step_counter == -3  # base class begins a step each time


class Loader(Counter):
    """A setup that does what transformers' from_pretrained(dtype=torch.bfloat16) does: set the
    process-wide default dtype while it builds, then restore it."""

    def __init__(self, in_setup, peer_seen, **kw):
        super().__init__(**kw)
        self.in_setup, self.peer_seen = in_setup, peer_seen

    def setup(self):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            self.in_setup.set()
            self.peer_overlapped = self.peer_seen.wait(0.5)  # a peer observed us mid-setup
        finally:
            torch.set_default_dtype(previous)
        self.model = torch.nn.Linear(4, 4)


class Observer(Counter):
    def __init__(self, in_setup, peer_seen, **kw):
        super().__init__(max_steps=1, **kw)
        self.in_setup, self.peer_seen = in_setup, peer_seen
        self.dtypes = {}

    def setup(self):
        if self.in_setup.wait(2):  # the loader set up first: look while it may still be loading
            self.dtypes["setup"] = torch.get_default_dtype()
            self.peer_seen.set()

    def step(self):
        self.dtypes["step"] = torch.zeros(1).dtype
        self.peer_seen.set()


@pytest.mark.parametrize("serial_setup", [True, False])
def test_no_worker_steps_while_another_sets_up(serial_setup):
    """Hazard 13: another thread's model load changes the default dtype under a running step."""
    in_setup, peer_seen = threading.Event(), threading.Event()
    loader = Loader(in_setup, peer_seen, name="loader", max_steps=1)
    observer = Observer(in_setup, peer_seen, name="observer")
    with WorkerGroup([loader, observer], serial_setup=serial_setup) as group:
        group.join()
    assert observer.dtypes["step"] == torch.float32
    if serial_setup:  # the observer's setup waited for the loader's turn to end
        assert not loader.peer_overlapped
    else:  # setups overlap: the observer saw the loader's dtype, which is why serial is the default
        assert loader.peer_overlapped and observer.dtypes["setup"] == torch.bfloat16


def test_a_failing_setup_releases_the_workers_waiting_for_it():
    done = threading.Event()

    class SlowFailure(Counter):
        def setup(self):
            done.wait(30)
            raise ValueError("boom in setup")

    waiting = Counter(name="waiting")
    group = WorkerGroup([waiting, SlowFailure(name="slow")], serial_setup=False)
    group.start()
    done.set()
    with pytest.raises(WorkerError, match="'slow'.*boom in setup"):
        group.join(30)
    assert waiting.stats.steps == 0 and not waiting.is_alive()


def test_stopping_a_worker_that_waits_for_the_others_setups_ends_it():
    release = threading.Event()

    class Slow(Counter):
        def setup(self):
            release.wait(30)
            super().setup()

    quick, slow = Counter(name="quick"), Slow(name="slow", max_steps=2)
    group = WorkerGroup([quick, slow], serial_setup=False)
    group.start()
    quick.stop()
    threading.Thread.join(quick, 30)
    assert not quick.is_alive() and quick.stats.steps == 0
    release.set()
    group.join(30)
    assert slow.stats.steps == 2
