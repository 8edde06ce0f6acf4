"""The two ways around the capture patches' gate, on the CPU with stand-ins: a capture that fails to
begin (``torch.cuda.graph.__enter__`` ending it with ``capture_end_pre()`` alone, as 2.15 does) gives
the device gate back, and ``torch.accelerator.Graph`` captures take the gate as CUDAGraph's do."""

import threading

import pytest
import torch

import threadgraph
from threadgraph import _compat
from threadgraph._device import fence as _fence
from threadgraph._device.gate import gate_for
from threadgraph._patches import capture_guard


class FakeCUDAGraph:
    """Stands in for torch.cuda.CUDAGraph: its capture_begin goes through the capture patch's wrapper."""

    def __init__(self):
        self.calls = []

    def capture_begin(self):
        _fence.capture_begin_exclusive(lambda: self.calls.append("capture_begin"), self, (), {})

    def capture_end_pre(self):
        self.calls.append("capture_end_pre")


class FakeGraphContext:
    """torch.cuda.graph's __enter__ as 2.15 writes it: begin, fail while setting the capture up, end
    the capture with capture_end_pre() alone and re-raise."""

    def __init__(self):
        self.cuda_graph = FakeCUDAGraph()

    def __enter__(self):
        self.cuda_graph.capture_begin()
        try:
            raise RuntimeError("could not arm the node-creation callbacks")
        except BaseException:
            self.cuda_graph.capture_end_pre()
            raise


@pytest.fixture
def cuda0(monkeypatch, clean_patches):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    gate = gate_for("cuda:0")
    yield gate
    assert gate.holders()["exclusive"] is None


def test_without_the_guard_a_capture_that_fails_to_begin_keeps_the_gate(cuda0):
    context = FakeGraphContext()
    with pytest.raises(RuntimeError, match="could not arm"):
        context.__enter__()
    assert cuda0.holders()["exclusive"] == threading.current_thread().name  # the hole: nobody gives it back
    assert capture_guard.give_gate_back(context.cuda_graph)  # (so the fixture finds the gate free)


def test_a_capture_that_fails_to_begin_gives_the_gate_back(cuda0):
    context = FakeGraphContext()
    with pytest.raises(RuntimeError, match="could not arm"):
        capture_guard.enter_gives_gate_back(context.__enter__, context, (), {})
    assert context.cuda_graph.calls == ["capture_begin", "capture_end_pre"]
    assert cuda0.holders()["exclusive"] is None
    assert not capture_guard.give_gate_back(context.cuda_graph)  # nothing left to give back


def test_a_failure_before_the_capture_began_leaves_the_gate_alone(cuda0):
    class FailsFirst(FakeGraphContext):
        def __enter__(self):
            raise RuntimeError("stream not ready")

    context = FailsFirst()
    with pytest.raises(RuntimeError, match="stream not ready"):
        capture_guard.enter_gives_gate_back(context.__enter__, context, (), {})
    assert cuda0.holders()["exclusive"] is None


def test_install_wraps_torch_cuda_graph_enter(clean_patches):
    original = vars(torch.cuda.graph)["__enter__"]
    assert "capture_failure_gives_gate_back" in threadgraph.install()
    assert vars(torch.cuda.graph)["__enter__"] is not original
    threadgraph.uninstall()
    assert vars(torch.cuda.graph)["__enter__"] is original


@pytest.mark.skipif(_compat.accelerator_graph() is None, reason="this torch has no torch.accelerator.Graph")
def test_accelerator_graph_captures_take_the_gate_like_cuda_graphs(cuda0):
    graph_class = _compat.accelerator_graph()
    begin, end = vars(graph_class)["capture_begin"], vars(graph_class)["capture_end"]
    applied = threadgraph.install()
    assert {"accelerator_capture_begin_exclusive", "accelerator_capture_end_exclusive"} <= set(applied)
    wrapped_begin, wrapped_end = vars(graph_class)["capture_begin"], vars(graph_class)["capture_end"]
    assert wrapped_begin.__wrapped__ is begin and wrapped_end.__wrapped__ is end
    # Their wrappers are the capture patches': the gate is held from begin to end.
    assert wrapped_begin._self_wrapper is _fence.capture_begin_exclusive
    assert wrapped_end._self_wrapper is _fence.capture_end_exclusive
    threadgraph.uninstall()
    assert vars(graph_class)["capture_begin"] is begin and vars(graph_class)["capture_end"] is end
