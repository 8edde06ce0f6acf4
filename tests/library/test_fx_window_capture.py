"""Hazard global-fx-patcher, whole-step captures: an FX trace in another thread (make_fx inside a
drafter's compile) during a capture made the captured step miss its compiled code and compile
inside the capture, which torch 2.14 refuses ("torch.compile cannot JIT compile during CUDA graph
capture": the DFlash trainer's whole-step mode on an H200, empty Inductor cache). A capture now
waits for traces open elsewhere and holds new ones off until it ends; these tests drive the hold
(``_fx_window.windows_held_off``) directly, as CaptureStep enters it, on the CPU."""

import threading

import pytest
import torch

import threadgraph
from threadgraph._patches import fx_window as _fx_window
from threadgraph._device.gate import gate_for

from tests.helpers.threads import ParkedTrace


@pytest.fixture
def shim(clean_patches):
    threadgraph.install()
    yield


def start(target, name):
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def test_a_trace_started_during_a_capture_waits_for_its_end(shim):
    module, traced = ParkedTrace(), {}
    module.release.set()
    with _fx_window.windows_held_off():
        assert _fx_window.holding() == ["MainThread"]
        tracer = start(lambda: traced.setdefault("gm", torch.fx.symbolic_trace(module)), "tracer")
        assert not module.tracing.wait(0.5), "the trace started while a capture held traces off"
        assert _fx_window.open_windows() == {}
    assert module.tracing.wait(30), "the trace never started after the capture ended"
    tracer.join(30)
    assert traced["gm"](torch.zeros(1)).item() == 1.0


def test_a_capture_waits_for_a_trace_already_open(shim):
    module, order = ParkedTrace(), []
    tracer = start(lambda: (torch.fx.symbolic_trace(module), order.append("trace ended")), "tracer")
    assert module.tracing.wait(30)

    def capture():
        with _fx_window.windows_held_off():
            order.append("capture began")

    capturer = start(capture, "capturer")
    capturer.join(0.5)
    assert capturer.is_alive() and order == [], "the capture began inside another thread's trace"
    module.release.set()
    capturer.join(30), tracer.join(30)
    assert order == ["trace ended", "capture began"]


def test_a_compile_inside_the_capture_lifts_the_hold_for_its_duration(shim):
    module = ParkedTrace()
    module.release.set()
    with _fx_window.windows_held_off():
        with _fx_window.hold_lifted():
            tracer = start(lambda: torch.fx.symbolic_trace(module), "tracer")
            assert module.tracing.wait(30), "a trace stayed held off while the capture compiled"
            tracer.join(30)
        # held again once the compile is over
        later = ParkedTrace()
        later.release.set()
        second = start(lambda: torch.fx.symbolic_trace(later), "second tracer")
        assert not later.tracing.wait(0.5)
    second.join(30)
    assert later.tracing.is_set()


def test_inside_a_trace_of_its_own_a_thread_holds_nothing_off(shim):
    seen = {}

    class Inner(torch.nn.Module):
        def forward(self, x):
            with _fx_window.windows_held_off():
                seen["holding"] = _fx_window.holding()
            return x

    torch.fx.symbolic_trace(Inner())
    assert seen == {"holding": []}


def test_a_worker_whose_trace_waits_for_a_capture_gives_up_its_device_slot_meanwhile(shim):
    """The capture takes the device exclusively after its hold: a tracing worker keeping its slot
    while it waits would wait for that capture forever."""
    gate, module, order = gate_for("cuda:0"), ParkedTrace(), []
    module.release.set()

    def worker():
        with gate.shared():
            torch.fx.symbolic_trace(module)
            order.append("traced")

    with _fx_window.windows_held_off():
        tracer = start(worker, "worker")
        assert not module.tracing.wait(0.5)
        with gate.exclusive():  # would hang if the waiting worker still held its slot
            order.append("captured")
    tracer.join(30)
    assert order == ["captured", "traced"]


def test_a_thread_holding_a_device_exclusively_traces_without_waiting_for_a_capture(shim):
    module, done = ParkedTrace(), threading.Event()
    module.release.set()

    def recorder():  # a Trees recording on another device, say
        with gate_for("cuda:1").exclusive():
            torch.fx.symbolic_trace(module)
            done.set()

    with _fx_window.windows_held_off():
        other = start(recorder, "recorder")
        assert done.wait(30), "a thread holding a device exclusively waited for another thread's capture"
    other.join(30)
