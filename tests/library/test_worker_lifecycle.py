"""Lifecycle faults a fault probe found (CPU workers): a failed consumer never hangs a producer in
``GroupQueue.join()``, a group runs once and each worker is in it once, a stray GroupStopped is a
failure, a group's with-block waits for and names its workers, warm-up ends even with no warm-up
steps, a failing teardown keeps the step timings, Ctrl-C in a worker's join stops it, and workers
still running when the interpreter exits are stopped first."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from threadgraph import CompiledWorkerThread, GroupStopped, JoinTimeout, UsageError, WorkerError, WorkerGroup

ROOT = Path(__file__).resolve().parents[2]


class Stepper(CompiledWorkerThread):
    """A CPU worker that runs ``body`` each step (by default a tiny matmul)."""

    def __init__(self, name, body=None, **kw):
        kw.setdefault("max_steps", None)
        super().__init__("cpu", name=name, **kw)
        self.body = body
        self.torn_down = False

    def setup(self):
        self.model = torch.nn.Linear(4, 4)

    def step(self):
        if self.body is not None:
            self.body(self)
        else:
            self.model(torch.ones(2, 4)).sum()
            time.sleep(0.001)

    def teardown(self):
        self.torn_down = True


def test_a_producer_waiting_on_join_wakes_when_its_consumer_fails():
    group = WorkerGroup()
    q = group.queue()

    def produce(worker):
        q.put(1)
        q.join()

    def consume(worker):
        q.get()
        raise ValueError("consumer failed before task_done()")

    group.add(Stepper("producer", produce))
    group.add(Stepper("consumer", consume))
    group.start()
    with pytest.raises(WorkerError, match="consumer.*consumer failed before task_done"):
        group.join(timeout=20)
    assert not any(w.is_alive() for w in group.workers)


def test_a_group_runs_once_and_holds_each_worker_once():
    worker = Stepper("w", max_steps=2)
    with pytest.raises(ValueError, match="worker w is in the group already"):
        WorkerGroup([worker, worker])
    group = WorkerGroup([Stepper("a", max_steps=2)])
    member = Stepper("m", max_steps=2)
    WorkerGroup([member])
    with pytest.raises(ValueError, match="worker m belongs to another group"):
        group.add(member)
    fresh = WorkerGroup()
    with pytest.raises(RuntimeError, match="never started.*start\\(\\)"):
        fresh.join()
    group.start()
    with pytest.raises(RuntimeError, match="the group already started; add worker late before start"):
        group.add(Stepper("late"))
    with pytest.raises(RuntimeError, match="the group was started already; a group runs once"):
        group.start()
    group.join(timeout=20)  # the second start() changed nothing: the group still finishes


def test_a_group_stopped_by_another_groups_queue_is_this_workers_failure():
    other = WorkerGroup()
    q = other.queue()
    in_step = threading.Event()
    worker = Stepper("consumer", lambda w: (in_step.set(), q.get()))
    worker.start()
    assert in_step.wait(20)
    q.close()  # the other group stopped: a get() before or after this raises GroupStopped
    with pytest.raises(WorkerError, match="consumer.*failed in step: GroupStopped") as info:
        worker.join(20)
    assert isinstance(info.value.__cause__, GroupStopped) and worker.torn_down


def test_a_with_block_that_raises_waits_for_its_workers_and_names_their_failures():
    failed = threading.Event()

    def fail(worker):
        failed.set()
        raise ValueError("worker boom")

    bad = Stepper("bad", fail)
    good = Stepper("good")
    with pytest.raises(KeyError) as info:
        with WorkerGroup([bad, good]):
            assert failed.wait(30)
            raise KeyError("body boom")
    assert not bad.is_alive() and not good.is_alive() and good.torn_down
    assert any("worker bad also failed: ValueError('worker boom')" in note
               for note in getattr(info.value, "__notes__", [])), getattr(info.value, "__notes__", None)


def test_no_warmup_steps_still_ends_the_warmup_and_times_every_step():
    worker = Stepper("w", warmup_steps=0, max_steps=5)
    worker.start()
    worker.join(20)
    assert worker.activity[0] == "finished" and worker.stats.warmup_steps == 0
    assert len(worker.stats.step_ms) == 5


def test_a_failing_teardown_keeps_the_step_timings():
    class Broken(Stepper):
        def teardown(self):
            raise OSError("teardown failed")

    worker = Broken("tb", warmup_steps=2, max_steps=10)
    worker.start()
    with pytest.raises(WorkerError, match="failed in teardown: OSError: teardown failed"):
        worker.join(20)
    assert len(worker.stats.step_ms) == 8


@pytest.mark.parametrize("kw", [{"warmup_steps": "3"}, {"max_steps": 2.5}, {"warmup_steps": -1}])
def test_step_counts_must_be_integers(kw):
    with pytest.raises(ValueError, match="warmup_steps.*max_steps"):
        Stepper("w", **kw)


def test_ctrl_c_in_a_workers_join_stops_it():
    # Python's own handler: a shell without job control starts background jobs (CI) with SIGINT ignored
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    worker = Stepper("w", max_steps=20_000)  # bounded: a join the signal misses ends, and fails below
    worker.start()
    timer = threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT))  # a real Ctrl-C wakes a blocked join
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            worker.join()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not worker.is_alive() and worker.torn_down, (worker.exception, worker.activity, worker.stats.steps)
    assert worker.stats.steps < 20_000


# A stand-in worker for the scripts below, each run in an interpreter of its own until it exits.
WORKER = textwrap.dedent("""
    import sys, threading, time, torch, threadgraph
    class W(threadgraph.CompiledWorkerThread):
        stepping = None  # an Event per worker, set in its first step
        def step(self):
            self.stepping.set()
            torch.ones(4, 4).sum()
            time.sleep(0.001)  # a step's work, not a wait for anything
        def teardown(self):
            sys.stdout.write(f"teardown {self.name} after {self.stats.steps} steps\\n")
""")

LEFT_RUNNING = WORKER + textwrap.dedent("""
    workers = [W("cpu", name=f"w{i}") for i in range(4)]
    for w in workers:
        w.stepping = threading.Event()
        w.start()
    for w in workers:
        assert w.stepping.wait(60), f"{w.name} never stepped"
    # the script ends without stopping or joining them
""")


def _run_to_exit(script: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))


def test_workers_still_running_at_exit_are_stopped_and_torn_down():
    proc = _run_to_exit(LEFT_RUNNING)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(line.split(" after ")[0] for line in proc.stdout.splitlines()) == [f"teardown w{i}" for i in range(4)]
    assert "the interpreter is exiting with 4 worker(s) running" in proc.stderr


AT_EXIT_MIXED = WORKER + textwrap.dedent("""
    group = threadgraph.WorkerGroup()
    q = group.queue()
    class Consumer(W):
        def step(self):
            self.stepping.set()
            q.get()  # nothing ever comes: only the group's stop wakes it
    consumer = group.add(Consumer("cpu", name="consumer"))
    consumer.stepping = threading.Event()
    group.start()
    finisher = W("cpu", name="finisher", daemon=False, max_steps=200)  # Python waits for it: left to finish
    finisher.stepping = threading.Event()
    finisher.start()
    assert consumer.stepping.wait(60) and finisher.stepping.wait(60), "a worker never stepped"
""")


def test_at_exit_a_worker_blocked_on_its_groups_queue_wakes_and_a_non_daemon_one_finishes():
    proc = _run_to_exit(AT_EXIT_MIXED)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # torn down, so woken: a consumer left blocked would be named as not stopping in time instead
    assert "teardown finisher after 200 steps" in proc.stdout and "teardown consumer" in proc.stdout, proc.stdout
    assert "did not stop" not in proc.stderr, proc.stderr[-3000:]
    assert "exiting with 1 worker(s) running (consumer)" in proc.stderr



CTRL_C_TWICE = textwrap.dedent("""
    import logging, os, signal, sys, threading, time
    from threadgraph import CompiledWorkerThread, WorkerGroup
    logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # CI starts jobs with SIGINT ignored
    never = threading.Event()

    class Blocked(CompiledWorkerThread):
        def step(self):
            never.wait()  # blocked in step(), deaf to stop(): only the process's end frees it

    class Quick(CompiledWorkerThread):
        def step(self):
            time.sleep(0.01)

    class SecondCtrlC(logging.Handler):  # the second Ctrl-C, once the first one's wait has printed that it waits
        sent = False

        def emit(self, record):
            if "press Ctrl-C again" in record.getMessage() and not self.sent:
                self.sent = True
                os.kill(os.getpid(), signal.SIGINT)

    logging.getLogger().addHandler(SecondCtrlC())
    group = WorkerGroup([Blocked("cpu", name="blocked"), Quick("cpu", name="quick")])
    group.start()
    # the first Ctrl-C, while the main thread waits in join() (it enters it at once)
    threading.Timer(1.0, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    try:
        group.join()
    except KeyboardInterrupt:
        print("join raised KeyboardInterrupt", flush=True)
""")


def test_a_second_ctrl_c_leaves_a_wait_for_a_worker_blocked_in_step_and_exit_does_not_wait_again():
    proc = subprocess.run([sys.executable, "-c", CTRL_C_TWICE], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr
    waiting = [line for line in out.splitlines() if "waiting for" in line]
    assert waiting and "interrupted; stopping 2 workers" in waiting[0], out
    assert "blocked (warmup steps for" in waiting[0] and "quick" not in waiting[0].split("waiting for")[1], out
    assert "press Ctrl-C again to stop waiting" in waiting[0], out
    assert "stopped waiting; blocked left running" in out, out
    assert "join raised KeyboardInterrupt" in out, out
    assert "interpreter is exiting" not in out + proc.stderr, out  # the exit hook does not wait for it again


@pytest.mark.timeout(120)
def test_a_with_block_stops_workers_without_max_steps_on_exit():
    stepping = threading.Event()
    workers = [Stepper(f"endless-{i}", lambda w: (stepping.set(), w.model(torch.ones(2, 4)))) for i in range(2)]
    left = threading.Event()

    def block():
        with WorkerGroup(workers):
            assert stepping.wait(60), "no worker stepped"
        left.set()

    body = threading.Thread(target=block, name="with-block", daemon=True)
    body.start()
    try:
        assert left.wait(60), "leaving the with-block did not stop its workers"
        assert all(not w.is_alive() and w.torn_down and w.exception is None for w in workers)
    finally:
        for worker in workers:  # on failure: let the block end
            worker.stop()
        body.join(60)


@pytest.mark.timeout(120)
def test_ctrl_c_in_a_with_block_stops_every_worker_and_propagates(sigint_raises_keyboard_interrupt):
    stepping = threading.Event()
    workers = [Stepper(f"w{i}", lambda w: (stepping.set(), w.model(torch.ones(2, 4)))) for i in range(3)]
    with pytest.raises(KeyboardInterrupt):
        with WorkerGroup(workers):
            assert stepping.wait(60), "no worker stepped"
            signal.raise_signal(signal.SIGINT)  # Ctrl-C, delivered to this (the main) thread
    assert all(not w.is_alive() for w in workers)
    assert all(w.torn_down for w in workers if w.stats.steps)


@pytest.mark.timeout(120)
def test_misusing_a_group_raises_threadgraph_errors_that_are_also_the_builtin_ones():
    started = Stepper("started", max_steps=1)
    started.start()
    started.join(30)
    with pytest.raises(UsageError, match="worker started was already started; add workers before start") as info:
        WorkerGroup([started])
    assert isinstance(info.value, ValueError)
    worker = Stepper("twice")
    group = WorkerGroup([worker])
    with pytest.raises(UsageError, match="worker twice is in the group already"):
        group.add(worker)
    with pytest.raises(UsageError, match=r"join\(\) of a group that was never started; call start\(\) first") as info:
        group.join()
    assert isinstance(info.value, RuntimeError)
    entered, release = threading.Event(), threading.Event()
    worker.body = lambda w: (entered.set(), release.wait(60))
    group.start()
    try:
        with pytest.raises(UsageError, match="the group was started already; a group runs once"):
            group.start()
        with pytest.raises(UsageError, match="the group already started; add worker late before start"):
            group.add(Stepper("late"))
        assert entered.wait(60), "the worker never stepped"
        for joiner in (worker, group):
            with pytest.raises(JoinTimeout, match=r"worker twice \(warmup steps for \d+ s\) still running after 0\.1 s") as info:
                joiner.join(timeout=0.1)
            assert isinstance(info.value, TimeoutError)
    finally:
        group.stop()
        release.set()
        group.join(60)


@pytest.mark.timeout(60)
def test_ctrl_c_in_a_failure_callback_is_not_swallowed_and_the_other_callbacks_still_run():
    group = WorkerGroup([Stepper("spin")])
    ran = []

    def interrupted(error):
        ran.append("first")
        raise KeyboardInterrupt  # a second Ctrl-C while the group fails

    group.on_failure(interrupted)
    group.on_failure(lambda error: ran.append("second"))
    group.start()
    with pytest.raises(KeyboardInterrupt):
        group._fail_all(RuntimeError("a worker failed"))
    assert ran == ["first", "second"]
    group.join()  # the workers were stopped before the callbacks ran
