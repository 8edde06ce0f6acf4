"""CPU tests of capture_step: API, error paths, fallback choice. Capture itself is GPU-only
(tests/library/test_gpu.py); here torch.cuda's functions are stand-ins: the capture fails like a real
one, or succeeds and its replays are counted (the replay's shape check and input copies)."""

import contextlib
import logging
import types
import warnings

import pytest
import torch

import threadgraph
from threadgraph import CaptureError, capture_step
from tests.helpers.cuda_sim import CudaSim


def test_inputs_must_be_tensors():
    step = capture_step(lambda x: x)
    with pytest.raises(CaptureError, match="inputs must be tensors"):
        step(3)


@pytest.fixture
def a_gpu(monkeypatch):
    """A machine that has a GPU (for the checks made before anything runs on it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)


def test_cpu_inputs_are_rejected_with_a_fix(a_gpu):
    step = capture_step(lambda x: x)
    with pytest.raises(CaptureError, match=r"(?s)on a CUDA device; got cpu\. Move them with \.to\(device\).*"
                                           r"pass fallback='uncaptured'"):
        step(torch.ones(2))


def test_without_a_gpu_cpu_inputs_are_told_there_is_no_gpu_not_to_move_them(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    step = capture_step(lambda x: x)
    with pytest.raises(CaptureError, match=r"(?s)capture_step needs a CUDA GPU.*sees none.*Run it on a GPU machine.*"
                                           r"pass fallback='uncaptured' to run it uncaptured instead") as info:
        step(torch.ones(2))
    assert ".to(device)" not in str(info.value)


def test_fallback_uncaptured_runs_cpu_inputs_uncaptured_and_says_so_once(a_gpu, caplog):
    step = capture_step(lambda x: x * 2, fallback="uncaptured")
    with caplog.at_level(logging.WARNING, logger="threadgraph"), \
            pytest.warns(threadgraph.ThreadgraphWarning, match="inputs must be on a CUDA device; got cpu"):
        assert torch.equal(step(torch.ones(2)), torch.full((2,), 2.0))
    assert "running it uncaptured from now on" in caplog.text and not step.captured
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: later calls run the function without a word
        assert torch.equal(step(torch.ones(3)), torch.full((3,), 2.0))
    assert step.calls == 2


def test_fallback_uncaptured_runs_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    x = torch.ones(2)
    step = capture_step(lambda: x + 1, fallback="uncaptured")
    with pytest.warns(threadgraph.ThreadgraphWarning, match="capture_step needs a CUDA GPU"):
        assert torch.equal(step(), torch.full((2,), 2.0))
    assert "needs a CUDA GPU" in step.uncaptured_reason


def test_inputs_on_several_devices_are_an_error_even_with_the_fallback(a_gpu):
    step = capture_step(lambda x, y: x, fallback="uncaptured")
    with pytest.raises(CaptureError, match=r"all be on one CUDA device; got \['cpu', 'meta'\]"):
        step(torch.ones(2), torch.ones(2, device="meta"))


@pytest.mark.parametrize("kwargs, match", [({"fallback": "maybe"}, "fallback must be"), ({"warmup_steps": 0}, "warmup_steps >= 1")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(threadgraph.UsageError, match=match):
        capture_step(lambda: None, **kwargs)


HOST_SYNC = "CUDA error: operation not permitted when stream is capturing"


@pytest.fixture
def cpu_as_gpu(monkeypatch):
    """torch.cuda's functions as a GPU machine has them, with streams that do nothing and a capture
    that fails with ``capture.error`` (by default: a host sync inside it; None: it succeeds, and
    ``capture.replays`` counts the graph's replays)."""
    capture = types.SimpleNamespace(error=RuntimeError(HOST_SYNC), began=0, replays=0)

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        capture.began += 1
        yield
        if capture.error is not None:
            raise capture.error

    class CUDAGraph:  # a capture that succeeds gives one of these; its replays are counted
        def replay(self):
            capture.replays += 1

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", CUDAGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    return capture


def _doubling_step(fallback):
    """A step without inputs (it closes over its tensor): the only kind a CPU can pass along."""
    x = torch.ones(2)
    return capture_step(lambda: x * 2, warmup_steps=1, fallback=fallback)


def test_failed_capture_raises_naming_the_likely_cause_and_the_fallback(cpu_as_gpu):
    step = _doubling_step("raise")
    assert torch.equal(step(), torch.full((2,), 2.0))  # the warmup step
    with pytest.raises(CaptureError) as info:
        step()
    assert cpu_as_gpu.began == 1 and info.value.__cause__ is cpu_as_gpu.error
    assert "host synchronisation" in str(info.value) and "fallback='uncaptured'" in str(info.value)
    assert not step.captured and step.uncaptured_reason is None


def test_fallback_uncaptured_logs_warns_and_keeps_running(cpu_as_gpu, caplog):
    step = _doubling_step("uncaptured")
    step()
    with caplog.at_level(logging.WARNING, logger="threadgraph"), pytest.warns(threadgraph.ThreadgraphWarning):
        out = step()
    assert torch.equal(out, torch.full((2,), 2.0))
    assert step.uncaptured_reason and step.uncaptured_reason in caplog.text
    # later calls run the function directly, without another capture
    assert torch.equal(step(), torch.full((2,), 2.0)) and cpu_as_gpu.began == 1 and not step.captured


def test_an_optimizer_that_is_not_capturable_is_named_with_its_fix(cpu_as_gpu):
    cpu_as_gpu.error = RuntimeError("optimizer is not capturable")
    step = _doubling_step("raise")
    step()
    with pytest.raises(CaptureError, match="capturable=True"):
        step()


def test_replay_copies_inputs_of_the_captured_shape_and_rejects_any_other_on_the_cpu(cpu_as_gpu):
    """test_replay_rejects_a_new_shape's logic with stand-ins: inputs that say they are on cuda:0, a
    capture that succeeds, a graph whose replays are counted."""
    sim = CudaSim()
    cpu_as_gpu.error = None
    step = capture_step(lambda x, n: x * 2, warmup_steps=1)
    x, n = sim.tensor(torch.ones(2, 3)), sim.tensor(torch.zeros(2, dtype=torch.long))
    step(x, n), step(x, n)  # the warmup, then the capture and its first replay
    assert step.captured and cpu_as_gpu.began == 1 and cpu_as_gpu.replays == 1
    static = step._static_inputs
    step(sim.tensor(torch.full((2, 3), 5.0)), sim.tensor(torch.tensor([1, 2])))
    assert cpu_as_gpu.replays == 2 and torch.equal(static[0], torch.full((2, 3), 5.0)) \
        and torch.equal(static[1], torch.tensor([1, 2]))  # the new values in the captured buffers
    for bad, says in [((sim.tensor(torch.zeros(4, 3)), n), r"got \(4, 3\) torch.float32, captured \(2, 3\)"),
                      ((x, sim.tensor(torch.zeros(2))), r"got \(2,\) torch.float32, captured \(2,\) torch.int64"),
                      ((x,), "captured with 2 inputs, got 1")]:
        with pytest.raises(CaptureError, match=says):
            step(*bad)
    assert cpu_as_gpu.replays == 2 and torch.equal(static[0], torch.full((2, 3), 5.0))  # nothing copied, no replay


@pytest.mark.gpu
def test_replay_rejects_a_new_shape():
    step = capture_step(lambda x: x * 2, warmup_steps=1)
    x = torch.ones(2, 3, device="cuda")
    step(x), step(x)
    assert step.captured and torch.equal(step(x + 1), torch.full((2, 3), 4.0, device="cuda"))
    with pytest.raises(CaptureError, match="fixed input shapes"):
        step(torch.zeros(4, 3, device="cuda"))


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_copy", "per_tensor"])
def test_input_copies_land_in_every_static_buffer(monkeypatch, foreach):
    from threadgraph import _torch_calls

    if not foreach:
        monkeypatch.delattr(torch, "_foreach_copy_", raising=False)
    statics = (torch.zeros(3), torch.zeros(2, 2, dtype=torch.long), torch.zeros(4, dtype=torch.bool))
    sources = (torch.arange(3.0), torch.arange(4).reshape(2, 2), torch.tensor([True, False, True, True]))
    _torch_calls.copy_all_(statics, sources)
    for static, source in zip(statics, sources):
        assert torch.equal(static, source)
    _torch_calls.copy_all_((), ())  # a step without inputs
