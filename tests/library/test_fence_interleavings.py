"""The gate's protocol with the fence as a participant, under random interleavings: plain threads
and workers draw fenced ops, capture, compile and run backwards on two simulated devices."""

import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from threadgraph._device.gate import fenced, released

from tests.library.gate_sim import COMPILE_LOCK, DeviceThread, Monitor, fresh_gate


def _fenced_op(monitors, device):
    with fenced(device):
        monitors[device].enter("shared")
        monitors[device].leave("shared")


def _capture(gates, monitors, device):
    with gates[device].exclusive():
        monitors[device].enter("exclusive")
        with fenced(device):  # the capture's own RNG draw runs at once, inside it
            time.sleep(0.001)  # a recording lasts: fenced work that did not wait would overlap it
        monitors[device].leave("exclusive")


def _run(devices, gates, monitors, device_threads, own, program):
    for op, index in program:
        device = devices[index]
        if op == "fenced":
            _fenced_op(monitors, device)
        elif op == "capture":
            _capture(gates, monitors, own or device)
        elif op == "compile":  # a Dynamo compile that autotunes: fenced draws and syncs under the lock
            with released(), COMPILE_LOCK:
                _fenced_op(monitors, device)
        elif op == "backward" and own is not None:
            with released():
                error = device_threads[own].backward(1).get(timeout=30)
            if error is not None:
                raise error


fenced_programs = st.lists(
    st.tuples(
        st.sampled_from(["worker:0", "worker:1", "plain"]),
        st.lists(st.tuples(st.sampled_from(["fenced", "capture", "compile", "backward"]), st.integers(0, 1)), max_size=10),
    ),
    min_size=1,
    max_size=6,
)


@settings(max_examples=40, deadline=None)
@given(fenced_programs)
def test_random_interleavings_with_fenced_ops_keep_captures_exclusive_and_finish(programs):
    # two fresh registered devices per example: fenced() and released() see them as any device's
    fresh = [fresh_gate("sim", timeout=30) for _ in range(2)]
    devices = tuple(g.device for g in fresh)
    gates = dict(zip(devices, fresh))
    monitors = {d: Monitor() for d in devices}
    device_threads = {d: DeviceThread(gates[d], monitors[d]) for d in devices}
    errors = []
    try:
        def participant(role, program):
            try:
                if role == "plain":
                    _run(devices, gates, monitors, device_threads, None, program)
                else:
                    own = devices[int(role[-1])]
                    with gates[own].shared():  # like CompiledWorkerThread.step()
                        monitors[own].enter("shared")
                        monitors[own].leave("shared")
                        _run(devices, gates, monitors, device_threads, own, program)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=participant, args=p) for p in programs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), f"deadlock: {[g.holders() for g in gates.values()]}"
        assert errors == []
        for device in devices:
            assert monitors[device].violations == [], device
            assert gates[device].holders() == {"exclusive": None, "shared": [], "exclusive_waiting": 0}
    finally:
        for thread in device_threads.values():
            thread.close()
