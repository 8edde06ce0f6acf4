"""The eager fence against a simulated capture: a thread that holds the device's gate exclusively.

On a CPU the fence would pass every op straight through (it fences CUDA devices only), so these
tests make every op count as work on ``cuda:0`` (``on_cuda0``) and stand for a capture with a
thread that holds ``cuda:0``'s gate exclusively, as the capture patches do.
"""

import threading

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

import threadgraph
from threadgraph._device import fence as _fence
from threadgraph._device.gate import gate_for, released

from tests.helpers.threads import until

# How long a capture holds the gate when the op under test should wait for it: a fenced op that
# waits passes whatever the machine's speed; the hold is the window in which an op that does not
# wait shows it, by ending first.
WINDOW_S = 0.3
# How long a capture holds the gate at most when the op under test should run during it: the op
# ends the capture early; the bound only guards against a hang.
GUARD_S = 60.0


@pytest.fixture
def on_cuda0(monkeypatch, clean_patches):
    monkeypatch.setattr(_fence, "_tensor_index", lambda value: 0)
    monkeypatch.setattr(_fence, "_device_index", lambda device: 0)
    threadgraph.install()
    yield gate_for("cuda:0")


def during_capture(gate, op, hold_s):
    """Run ``op`` in a new thread while another thread holds ``gate`` exclusively, like a
    recording that lasts until ``op`` ends or ``hold_s`` passes. Returns the order in which the two
    ended (["capture", "op"]: the op waited for the capture) and the op's result or exception."""
    inside, op_ended = threading.Event(), threading.Event()
    order, box = [], {}

    def capture():
        with gate.exclusive():
            inside.set()
            op_ended.wait(hold_s)
            order.append("capture")

    def bystander():
        try:
            box["result"] = op()
        except BaseException as exc:  # returned to the test, which checks it
            box["error"] = exc
        order.append("op")
        op_ended.set()

    capturing = threading.Thread(target=capture, name="capturing-thread")
    capturing.start()
    assert inside.wait(GUARD_S)
    running = threading.Thread(target=bystander, name="bystander")
    running.start()
    running.join(hold_s + GUARD_S)
    capturing.join(GUARD_S)
    assert not running.is_alive() and not capturing.is_alive(), "hung"
    return order, box


def _compiled_dropout():
    fn = torch.compile(lambda x: F.dropout(x, 0.5, training=True) + torch.rand_like(x))
    return lambda: fn(torch.ones(8))


OPS = {
    "torch.rand": lambda: torch.rand(3),
    "torch.randn": lambda: torch.randn(3),
    "torch.randint": lambda: torch.randint(0, 10, (3,)),
    "torch.randperm": lambda: torch.randperm(5),
    "torch.normal": lambda: torch.normal(torch.zeros(3), torch.ones(3)),
    "torch.bernoulli": lambda: torch.bernoulli(torch.full((3,), 0.5)),
    "torch.multinomial": lambda: torch.multinomial(torch.ones(4), 2),
    "Tensor.uniform_": lambda: torch.empty(3).uniform_(),
    "Tensor.normal_": lambda: torch.empty(3).normal_(),
    "Tensor.bernoulli_": lambda: torch.empty(3).bernoulli_(0.5),
    "Tensor.exponential_": lambda: torch.empty(3).exponential_(),
    "Tensor.random_": lambda: torch.empty(3).random_(0, 5),
    "F.dropout": lambda: F.dropout(torch.ones(3), 0.5, training=True),
    "nn.Dropout": lambda: torch.nn.Dropout(0.5)(torch.ones(3)),
    "aten.randint.low_out": lambda: torch.ops.aten.randint.low_out(0, 9, [3], out=torch.empty(3, dtype=torch.int64)),
}


@pytest.mark.parametrize("name", list(OPS) + ["compiled code, uncaptured"])
def test_an_eager_rng_op_in_a_plain_thread_waits_until_the_capture_ends(on_cuda0, name):
    op = OPS.get(name) or _compiled_dropout()
    if name.startswith("compiled"):
        op()  # compile now, outside the capture: the wait below is the compiled code's seed draw
    torch.manual_seed(0)
    expected = op()

    def seeded():
        torch.manual_seed(0)
        return op()

    order, box = during_capture(on_cuda0, seeded, WINDOW_S)
    assert order == ["capture", "op"], f"{name} ran during the capture"
    assert torch.equal(box["result"], expected), f"{name} drew other numbers after the wait"


def test_the_capturing_thread_runs_its_own_rng_and_syncs_at_once(on_cuda0):
    with on_cuda0.exclusive():  # would deadlock if the fence waited for its own thread's capture
        torch.rand(3)
        torch.empty(3).uniform_()
        with gate_for("cuda:1").exclusive():
            torch.rand(3)  # an op on another device from inside a capture does not wait either


def test_a_worker_holding_its_slot_does_not_wait_for_a_queued_capture(on_cuda0):
    # The capture queued behind the worker's slot cannot start before the slot is given back: an
    # RNG op that waited for it would wait for itself (the gate would time out, and raise).
    order = []
    queued = threading.Event()

    def capture():
        queued.set()
        with on_cuda0.exclusive():
            order.append("capture")

    def worker():
        with on_cuda0.shared():
            t = threading.Thread(target=capture)
            t.start()
            queued.wait(5)
            until(lambda: on_cuda0.holders()["exclusive_waiting"] == 1)  # the capture is queued on the gate
            torch.rand(3)
            order.append("rand")
        t.join(10)

    w = threading.Thread(target=worker)
    w.start()
    w.join(30)  # a guard against a hang, not a measurement
    assert not w.is_alive()
    assert order == ["rand", "capture"]


def test_a_thread_with_slots_elsewhere_gives_them_up_while_it_waits(monkeypatch, clean_patches):
    """W0 holds cuda:0 and draws on cuda:1; W1 holds cuda:1 and draws on cuda:0; both devices have
    a capture queued. Holding a slot while waiting for the other device would close a cycle."""
    drawing_on = threading.local()  # the device each thread's torch.rand counts as working on
    monkeypatch.setattr(_fence, "_device_index", lambda device: drawing_on.index)
    threadgraph.install()
    gates = [gate_for("cuda:0"), gate_for("cuda:1")]
    barrier, both_queued = threading.Barrier(4), threading.Barrier(2)
    errors = []

    def worker(own):
        try:
            with gates[own].shared():
                barrier.wait(5)
                until(lambda: gates[own].holders()["exclusive_waiting"] == 1)  # queued behind this slot
                both_queued.wait(5)
                drawing_on.index = 1 - own
                torch.rand(3)
        except BaseException as exc:
            errors.append(exc)

    def capture(index):
        try:
            barrier.wait(5)
            with gates[index].exclusive():
                pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(0,)), threading.Thread(target=worker, args=(1,)),
               threading.Thread(target=capture, args=(0,)), threading.Thread(target=capture, args=(1,))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), f"deadlock: {[g.holders() for g in gates]}"
    assert errors == []
    assert all(g.holders() == {"exclusive": None, "shared": [], "exclusive_waiting": 0} for g in gates)


def test_without_the_fence_a_plain_thread_runs_straight_into_the_capture(monkeypatch, clean_patches):
    monkeypatch.setattr(_fence, "_tensor_index", lambda value: 0)
    monkeypatch.setattr(_fence, "_device_index", lambda device: 0)
    threadgraph.install(exclude=frozenset({"fence_rng"}))
    order, _ = during_capture(gate_for("cuda:0"), lambda: torch.rand(3), GUARD_S)
    assert order == ["op", "capture"]  # this is the overlap that breaks a real capture


def test_a_fenced_wait_is_bounded_and_names_the_capturing_thread(on_cuda0, monkeypatch):
    monkeypatch.setattr(on_cuda0, "timeout", 0.1)
    order, box = during_capture(on_cuda0, lambda: torch.rand(3), GUARD_S)
    assert order == ["op", "capture"]  # the wait gave up while the capture still held the device
    assert isinstance(box["error"], threadgraph.GateTimeout)
    assert "capturing-thread" in str(box["error"])


def test_cpu_ops_pass_straight_through_without_touching_a_gate(clean_patches):
    threadgraph.install()
    order, _ = during_capture(gate_for("cuda:0"), lambda: (torch.rand(3), F.dropout(torch.ones(3), 0.5)), GUARD_S)
    assert order == ["op", "capture"]  # a CPU op has nothing to wait for


def test_the_fence_leaves_compiled_graphs_unchanged(clean_patches):
    def f(x):
        return torch.rand(x.shape) + F.dropout(x, 0.5, training=True) + torch.empty_like(x).uniform_()

    for _ in range(2):  # installed twice, with an uninstall between (Dynamo's rules are refreshed each time)
        threadgraph.install()
        torch._dynamo.reset()
        fenced = torch._dynamo.explain(f)(torch.ones(4, 4))
        threadgraph.uninstall()
        assert (fenced.graph_count, fenced.graph_break_count) == (1, 0), fenced.break_reasons
        code = fenced.graphs[0].code
        # The originals are in the graph, as without the fence: no wrapper, no lock, no break.
        assert "torch.rand(" in code and "torch.nn.functional.dropout(" in code and ".uniform_()" in code, code
        assert "fenced" not in code and "threadgraph" not in code


def test_outside_captures_fences_any_block(on_cuda0):
    def block():
        with threadgraph.outside_captures("cuda:0"):
            return on_cuda0.holders()

    order, box = during_capture(on_cuda0, block, WINDOW_S)
    assert order == ["capture", "op"]
    assert box["result"]["shared"] == ["bystander"]  # and the block held captures off while it ran


def test_a_hand_made_capture_takes_the_gate_from_begin_to_end(monkeypatch, clean_patches):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    gate = gate_for("cuda:0")

    class Graph:
        pass

    graph, calls = Graph(), []
    _fence.capture_begin_exclusive(lambda: calls.append("begin"), graph, (), {})
    assert gate.holders()["exclusive"] == threading.current_thread().name
    with released():  # a worker's released() block inside a capture keeps the exclusive section
        assert gate.holders()["exclusive"] == threading.current_thread().name
    with pytest.raises(RuntimeError, match="capture failed"):
        _fence.capture_end_exclusive(lambda: (_ for _ in ()).throw(RuntimeError("capture failed")), graph, (), {})
    assert gate.holders()["exclusive"] is None  # released even though capture_end raised
    with pytest.raises(RuntimeError, match="begin failed"):
        _fence.capture_begin_exclusive(lambda: (_ for _ in ()).throw(RuntimeError("begin failed")), graph, (), {})
    assert gate.holders()["exclusive"] is None


def _raise_in_user_code(message):
    def user_draws_noise():
        raise RuntimeError(message)

    try:
        user_draws_noise()
    except RuntimeError as exc:
        return exc


def test_a_bystanders_cuda_error_becomes_one_clear_error_naming_op_thread_and_fix(on_cuda0):
    with on_cuda0.exclusive():  # the capture this thread, "MainThread" here, made
        pass
    exc = _raise_in_user_code("Offset increment outside graph capture encountered unexpectedly.")
    clear = _fence.explain_capture_conflict(exc, "cuda:0")
    assert isinstance(clear, threadgraph.CaptureConflictError)
    assert clear.capturing_thread == threading.current_thread().name and clear.device == "cuda:0"
    assert "raise RuntimeError(message)" in clear.op and "test_fence.py" in clear.op  # the user's line
    message = str(clear)
    assert clear.op in message and clear.capturing_thread in message and "outside_captures" in message
    assert _fence.explain_capture_conflict(RuntimeError("CUDA out of memory"), "cuda:0") is None


class _FailingWorker(threadgraph.CompiledWorkerThread):
    def __init__(self, device, error):
        super().__init__(device, warmup_steps=0, name="failing-worker")
        self.error = error

    def step(self):
        raise self.error


def _worker_error(device, error):
    worker = _FailingWorker(device, error)
    worker.start()
    with pytest.raises(threadgraph.WorkerError):
        worker.join(60)
    return worker.exception


@pytest.mark.gpu
def test_a_cuda_worker_reports_a_capture_conflict_as_the_clear_error(clean_patches):
    exc = _raise_in_user_code("CUDA error: operation not permitted when stream is capturing")
    clear = _worker_error("cuda:0", exc)
    assert isinstance(clear, threadgraph.CaptureConflictError) and clear.__cause__ is exc
    assert clear.device == "cuda:0"
    other = ValueError("unrelated")
    assert _worker_error("cuda:0", other) is other


def test_a_cpu_worker_reports_its_error_as_it_is(clean_patches):
    exc = _raise_in_user_code("CUDA error: operation not permitted when stream is capturing")
    assert _worker_error("cpu", exc) is exc  # no captures on the CPU: nothing to explain


def test_a_capture_broken_by_unordered_work_says_so(clean_patches):
    broken = RuntimeError("CUDA error: operation failed due to a previous error during capture")
    clear = _fence.explain_broken_capture(broken, "cuda:0")
    assert isinstance(clear, threadgraph.CaptureConflictError) and "restart" in str(clear)
    assert _fence.explain_broken_capture(RuntimeError("Offset increment outside graph capture"), "cuda:0") is None


def test_a_default_cuda_device_is_seen_through_set_default_device(monkeypatch, clean_patches):
    seen = []
    monkeypatch.setattr(_fence, "_device_index", lambda device: seen.append(str(device)) or None)
    threadgraph.install()
    torch.rand(2)
    with torch.device("meta"):  # a default device other than the CPU is a torch-function mode
        torch.rand(2)
    assert seen == ["cpu", "meta"]


def _scripted_user_code(x: torch.Tensor) -> torch.Tensor:
    return x + torch.rand(3) + F.dropout(x, 0.5) + torch.empty(3).uniform_()


def test_torchscript_still_scripts_code_that_calls_fenced_functions(clean_patches):
    # TorchScript finds builtins by identity and compiles Python functions with their globals.
    threadgraph.install()
    threadgraph.uninstall()
    threadgraph.install()  # a second install puts the same wrappers back
    scripted = torch.jit.script(_scripted_user_code)
    assert scripted(torch.ones(3)).shape == (3,)


def test_a_fake_trace_in_another_thread_does_not_wait_for_the_capture(clean_patches):
    # AOTAutograd's make_fx traces on fake tensors: an RNG op there is traced, not run on the device.
    threadgraph.install()

    def trace():
        return make_fx(lambda: torch.rand(2, device="cuda:0") * 2, tracing_mode="fake")()

    order, box = during_capture(gate_for("cuda:0"), trace, GUARD_S)
    assert order == ["op", "capture"], "the fake trace waited for the capture"
    rand = [n for n in box["result"].graph.nodes if n.target is torch.ops.aten.rand.default]
    assert len(rand) == 1 and rand[0].kwargs["device"] == torch.device("cuda", 0)  # traced, for the GPU


def test_a_synchronize_under_a_fake_mode_still_waits_for_the_capture(on_cuda0, monkeypatch):
    from torch._subclasses.fake_tensor import FakeTensorMode

    def sync():
        with FakeTensorMode():
            torch.cuda.synchronize()  # a real device sync under any mode

    monkeypatch.setattr(_fence, "_current_or", lambda device: 0)
    order, box = during_capture(on_cuda0, sync, WINDOW_S)
    assert order == ["capture", "op"]
    if not torch.cuda.is_available():  # no CUDA here: after the fence, the sync itself fails
        assert isinstance(box["error"], (AssertionError, RuntimeError)), box


def test_under_no_dispatch_an_rng_op_in_a_fake_mode_is_real_work_and_waits_for_the_capture(clean_patches):
    # Inductor's passes draw real random inputs this way (pad_mm's benchmark) while a fake mode is active.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._mode_utils import no_dispatch
    threadgraph.install()

    def real_draw():
        with FakeTensorMode(), no_dispatch():
            return torch.randn(4, device="cuda:0")

    order, box = during_capture(gate_for("cuda:0"), real_draw, WINDOW_S)
    assert order == ["capture", "op"], "the real draw ran during the capture"
    if not torch.cuda.is_available():  # no CUDA here: after the fence, the draw itself fails
        assert isinstance(box["error"], (AssertionError, RuntimeError)), box


def test_overloads_hash_and_find_their_lowerings_with_the_fence_in_place(clean_patches):
    # Inductor's tables are keyed by overloads, which hash as their _op: the fence must not move them.
    import torch._inductor.lowering as lowering

    rand = torch.ops.aten.rand.default
    before = hash(rand)
    assert "fence_rng_ops" in threadgraph.install()
    assert hash(rand) == before and rand in lowering.lowerings
    threadgraph.uninstall()
    assert hash(rand) == before and rand in lowering.lowerings
