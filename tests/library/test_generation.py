"""Per-worker generations against the tree manager's own generation logic.

Workers are real threads driven one operation at a time in an order hypothesis chooses.
Backward runs on one shared "device thread" that receives the calling worker's stash entry,
as autograd's device thread receives ThreadLocalState. The manager methods are upstream's,
called on a per-worker stand-in that holds the manager's generation fields.
"""

import queue
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import threadgraph
import torch
from threadgraph import _compat
from threadgraph._device import tls as _tls

trees = _compat.cudagraph_trees()
Manager = trees.CUDAGraphTreeManager
eval_frame = torch._dynamo.eval_frame


class Executor:
    """A thread that runs submitted callables in order, re-raising their errors to the caller."""

    def __init__(self, name):
        self.inbox = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            fn, reply = self.inbox.get()
            if fn is None:
                return
            try:
                reply.put((True, fn()))
            except BaseException as exc:  # travels back to the caller
                reply.put((False, exc))

    def call(self, fn):
        reply = queue.Queue()
        self.inbox.put((fn, reply))
        ok, value = reply.get(timeout=30)
        if not ok:
            raise value
        return value

    def close(self):
        self.inbox.put((None, None))
        self.thread.join(30)


class ManagerFields:
    """The generation fields of one tree manager. Every other attribute is upstream's own method,
    bound through the (patched) class at lookup time, so the stand-in calls whatever this torch's
    generation code calls, with the arguments it passes (2.14 added a ``curr_generation``
    snapshot that ``can_start_new_generation`` hands to ``in_new_torch_compile_invocation``)."""

    def __init__(self):
        self.current_gen = -1
        self.running_forwards_with_pending_backwards = False

    def __getattr__(self, name):
        try:
            descriptor = vars(Manager)[name]
        except KeyError:
            raise AttributeError(f"the stand-in has no {name!r}, and CUDAGraphTreeManager defines none") from None
        return descriptor.__get__(self, Manager)


def _new_manager_fields():
    return ManagerFields()


def _observe(manager):
    seen = (Manager.in_new_torch_compile_invocation(manager), Manager.can_start_new_generation(manager))
    if _compat.generation_snapshot_parameter():
        # The snapshot ``run`` takes once and passes down must say the same as asking again.
        snapshot = manager.get_curr_generation()
        assert seen == (
            Manager.in_new_torch_compile_invocation(manager, snapshot),
            Manager.can_start_new_generation(manager, snapshot),
        )
    return seen


def run_schedule(schedule, n_workers):
    """Run (worker, op) pairs; return each worker's observations."""
    workers = [Executor(f"worker-{i}") for i in range(n_workers)]
    device_thread = Executor("autograd-device-thread")
    states = [w.call(_tls.worker_for_current_thread) for w in workers]
    managers = [_new_manager_fields() for _ in range(n_workers)]
    seen = [[] for _ in range(n_workers)]
    try:
        for worker, op in schedule:
            m = managers[worker]
            if op == "mark":
                workers[worker].call(torch.compiler.cudagraph_mark_step_begin)
            elif op == "fwd":
                def fwd(m=m):
                    eval_frame.install_generation_tagging_init()  # what entering a compiled frame does
                    seen_now = _observe(m)
                    Manager.update_generation(m)
                    m.running_forwards_with_pending_backwards = True
                    return seen_now

                seen[worker].append(("fwd", workers[worker].call(fwd)))
            else:
                def bwd(m=m, state=states[worker]):
                    _compat.stash(_tls.WORKER_KEY, state)  # ThreadLocalState propagation
                    seen_now = _observe(m)
                    m.running_forwards_with_pending_backwards = False
                    Manager.update_generation(m)
                    return seen_now

                seen[worker].append(("bwd", device_thread.call(bwd)))
    finally:
        for executor in workers + [device_thread]:
            executor.close()
    return seen


ops = st.sampled_from(["mark", "fwd", "bwd"])
schedules = st.integers(2, 4).flatmap(
    lambda n: st.tuples(st.just(n), st.lists(st.tuples(st.integers(0, n - 1), ops), min_size=1, max_size=30))
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schedules)
def test_each_worker_sees_the_generations_it_would_see_alone(clean_patches, case):
    n, schedule = case
    threadgraph.install()
    together = run_schedule(schedule, n)
    for worker in range(n):
        alone = run_schedule([(0, op) for w, op in schedule if w == worker], 1)[0]
        assert together[worker] == alone, f"worker {worker} was disturbed by the others"


def test_without_the_patch_another_threads_mark_step_ends_a_generation(clean_patches):
    # Upstream behaviour (hazard global-generation): B's mark step makes A's pending backward start a
    # new generation, which frees A's live outputs.
    schedule = [(0, "fwd"), (1, "mark"), (0, "bwd")]
    unpatched = run_schedule(schedule, 2)[0]
    threadgraph.install()
    patched = run_schedule(schedule, 2)[0]
    assert unpatched[1] == ("bwd", (True, True))
    assert patched[1] == ("bwd", (False, False))


def test_without_the_patch_another_threads_compiled_call_ends_a_generation(clean_patches):
    schedule = [(0, "mark"), (0, "fwd"), (1, "fwd"), (0, "fwd")]
    unpatched = run_schedule(schedule, 2)[0]
    threadgraph.install()
    patched = run_schedule(schedule, 2)[0]
    assert unpatched != patched
    assert patched == run_schedule([(0, "mark"), (0, "fwd"), (0, "fwd")], 1)[0]


def test_the_counters_are_global_and_every_manager_read_goes_through_the_patched_readers():
    # What makes the generation patches both needed and sufficient on this torch.
    assert _compat.generation_counters_are_global()
    assert _compat.unpatched_generation_reads() == []


def test_a_manager_method_reading_a_counter_directly_is_found_and_install_warns(clean_patches, monkeypatch):
    def sneaky_generation(self):
        return trees.MarkStepBox.mark_step_counter or torch._dynamo.mutation_guard.GenerationTracker.generation

    monkeypatch.setattr(Manager, "sneaky_generation", sneaky_generation, raising=False)
    assert _compat.unpatched_generation_reads() == ["sneaky_generation"]
    with pytest.warns(threadgraph.ThreadgraphWarning, match="reads the global generation counters in sneaky_generation"):
        threadgraph.install()


def _in_fresh_thread(fn):
    box = {}

    def body():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised in the test
            box["error"] = exc

    thread = threading.Thread(target=body)
    thread.start()
    thread.join(120)
    assert not thread.is_alive()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _process_generation():
    return torch._dynamo.mutation_guard.GenerationTracker.generation


def test_a_worker_sees_the_process_generation_its_own_calls_and_a_rewind_left(clean_patches):
    # Upstream code that sets the counter back (to record a second function in the first one's
    # generation) must be seen by a worker's manager as upstream's sees it.
    threadgraph.install()

    def calls():
        double = torch.compile(lambda x: x * 2, backend="eager")
        double(torch.ones(2))
        first = (_tls.current_worker().generation, _process_generation())
        torch._dynamo.mutation_guard.GenerationTracker.generation -= 1
        double(torch.ones(2))
        rewound = (_tls.current_worker().generation, _process_generation())
        return first, rewound

    first, rewound = _in_fresh_thread(calls)
    assert first[0] == first[1]
    assert rewound[0] == rewound[1] == first[1]  # set back by one, moved on by one: the same generation


def test_dynamo_run_of_cached_code_moves_the_workers_generation(clean_patches):
    threadgraph.install()

    def calls():
        double = torch.compile(lambda x: x * 2, backend="eager")
        double(torch.ones(2))
        frozen = torch._dynamo.run(double)
        before = _tls.current_worker().generation
        frozen(torch.ones(2))
        return before, _tls.current_worker().generation, _process_generation()

    before, after, process = _in_fresh_thread(calls)
    assert after == process and after != before


def test_resetting_the_trees_zeroes_the_calling_workers_mark_step(clean_patches):
    threadgraph.install()

    def calls():
        threadgraph.ensure_cudagraph_tls()
        torch.compiler.cudagraph_mark_step_begin()
        marked = _tls.current_worker().mark_step_counter
        trees.reset_cudagraph_trees()
        return marked, _tls.current_worker().mark_step_counter

    marked, after_reset = _in_fresh_thread(calls)
    assert marked == -1 and after_reset == 0


def _tagging_calls(bump, calls):
    """Run ``bump`` ``calls`` times in a fresh thread; return how the process counter and that thread's
    worker generation moved."""
    tracker, seen = _compat.generation_tracker(), []

    def run():
        before = tracker.generation
        for _ in range(calls):
            bump()
        seen.append((tracker.generation - before, _tls.worker_for_current_thread().generation == tracker.generation))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return seen[0]


def test_on_a_verified_release_the_bump_calls_upstream_once_then_moves_the_counter_itself(clean_patches):
    from threadgraph._patches import generation

    upstream = torch._dynamo.mutation_guard.install_generation_tagging_init
    calls = []

    def counted():
        calls.append(1)
        upstream()

    assert generation._verified_body(upstream)  # this torch's body is a verified one
    # That body, through a stand-in that counts its calls.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(generation, "_verified_body", lambda original: original is counted)
        assert _tagging_calls(generation.worker_generation_bump(counted), 5) == (5, True)
    assert len(calls) == 1


def test_with_a_body_no_release_verified_every_bump_calls_it(clean_patches):
    from threadgraph._patches import generation

    tracker, calls = _compat.generation_tracker(), []

    def changed_upstream():  # a body no verified release has
        calls.append(1)
        tracker.generation += 2

    assert not generation._verified_body(changed_upstream)
    assert _tagging_calls(generation.worker_generation_bump(changed_upstream), 5) == (10, True)
    assert len(calls) == 5
