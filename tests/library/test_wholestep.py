"""CPU tests of capture_step: API, error paths, fallback choice. Capture itself is GPU-only
(tests/library/test_gpu.py); here torch.cuda.graph is replaced by a stand-in that fails like a capture."""

import contextlib
import logging

import pytest
import torch

import threadgraph
from threadgraph import CaptureError, capture_step
from threadgraph import _wholestep


def test_inputs_must_be_tensors():
    step = capture_step(lambda x: x)
    with pytest.raises(CaptureError, match="inputs must be tensors"):
        step(3)


def test_cpu_inputs_are_rejected_with_a_fix():
    step = capture_step(lambda x: x)
    with pytest.raises(CaptureError, match=r"one CUDA device.*\.to\(device\)"):
        step(torch.ones(2))


@pytest.mark.parametrize("kwargs, match", [({"fallback": "maybe"}, "fallback must be"), ({"warmup_steps": 0}, "warmup_steps >= 1")])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        capture_step(lambda: None, **kwargs)


class _FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def failing_capture(monkeypatch):
    """A capture that fails the way a host sync inside a capture does on CUDA."""

    @contextlib.contextmanager
    def graph(*args, **kwargs):
        yield
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)


def _prepared(fn, fallback):
    step = capture_step(fn, warmup_steps=1, fallback=fallback)
    step._device = torch.device("cuda", 0)  # as _check_inputs would set on a GPU
    step._stream = _FakeStream()
    return step


def test_failed_capture_raises_naming_the_likely_cause(failing_capture):
    calls = []
    step = _prepared(lambda x: calls.append(x) or x * 2, "raise")
    with pytest.raises(CaptureError, match=r"(?s)could not be captured.*host synchronisation.*fallback=.uncaptured."):
        step._capture((torch.ones(2),))
    assert not step.captured and step.uncaptured_reason is None


def test_fallback_uncaptured_logs_warns_and_keeps_running(failing_capture, caplog):
    step = _prepared(lambda x: x * 2, "uncaptured")
    with caplog.at_level(logging.WARNING, logger="threadgraph"), pytest.warns(threadgraph.ThreadgraphWarning):
        out = step._capture((torch.ones(2),))
    assert torch.equal(out, torch.full((2,), 2.0))
    assert "running it uncaptured" in caplog.text and step.uncaptured_reason
    # later calls run the function directly, without touching CUDA
    assert torch.equal(step(torch.ones(3)), torch.full((3,), 2.0))


def test_replay_rejects_a_new_shape():
    step = capture_step(lambda x: x)
    step._static_inputs = (torch.zeros(2, 3),)
    step.graph = object()
    with pytest.raises(CaptureError, match="fixed input shapes.*Pad inputs"):
        step._replay((torch.zeros(4, 3),))


def test_explain_names_known_causes():
    assert "capturable=True" in _wholestep._explain(RuntimeError("optimizer is not capturable"))
    assert _wholestep._explain(ValueError("other")) == "ValueError: other"


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach_copy", "per_tensor"])
def test_input_copies_land_in_every_static_buffer(monkeypatch, foreach):
    from threadgraph import _compat

    if not foreach:
        monkeypatch.delattr(torch, "_foreach_copy_", raising=False)
    statics = (torch.zeros(3), torch.zeros(2, 2, dtype=torch.long), torch.zeros(4, dtype=torch.bool))
    sources = (torch.arange(3.0), torch.arange(4).reshape(2, 2), torch.tensor([True, False, True, True]))
    _compat.copy_all_(statics, sources)
    for static, source in zip(statics, sources):
        assert torch.equal(static, source)
    _compat.copy_all_((), ())  # a step without inputs
