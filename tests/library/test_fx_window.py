"""Hazard global-fx-patcher: while one thread FX-traces, nn.Module.__call__ is patched for every
thread; a compiled call in another thread then fails the guard Dynamo keeps on it and compiles its
code again (seen in the DFlash trainer: every target worker recompiled its step while a drafter
compiled). With the patch fx_trace_window the call waits for the trace to end and runs from its
cache (the missed frame uncompiled once) instead of compiling its code again."""

import contextlib
import gc
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

import threadgraph
from threadgraph._patches import first_call as _first_call
from threadgraph._patches import fx_window as _fx_window
from threadgraph._device.gate import gate_for

from tests.helpers.threads import ParkedTrace

_new_patcher = torch.fx._symbolic_trace._new_patcher  # the original, before any install()


class Layer(torch.nn.Linear):
    """A layer with its own __call__ over nn.Module's, as transformers' decoder layers have: Dynamo
    then guards on nn.Module.__call__ itself."""

    def __call__(self, *args, **kwargs):
        return super().__call__(*args, **kwargs)


@pytest.fixture
def shim(clean_patches):
    torch._dynamo.reset()
    _first_call.forget()  # every test's compiled lambdas share code objects: their turns start afresh
    yield
    torch._dynamo.reset()
    _first_call.forget()


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _until_waiting(name: str) -> None:
    deadline = time.monotonic() + 60
    while name not in _fx_window.waiting() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert name in _fx_window.waiting(), f"{name} did not wait for the trace"


def _settled_compiled_call():
    layer = torch.nn.Sequential(Layer(4, 4), torch.nn.ReLU())
    fn = torch.compile(lambda x: layer(x) * 2, backend="eager")
    x = torch.randn(2, 4)
    expected = layer(x) * 2
    fn(x), fn(x)  # compiled, and a second call that compiles nothing: its turn is over
    return fn, x, expected


def _call_during_a_trace(fn, x, *, wait_for_waiter: bool, capturing: bool = False):
    """Call ``fn(x)`` in a thread while another thread is inside an FX trace, in a simulated capture
    (cuda:0's gate held exclusively) if ``capturing``; (result, frames compiled)."""
    traced = ParkedTrace()
    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(traced,), name="tracer")
    before, box = counters["frames"]["ok"], {}

    def call():
        try:
            with gate_for("cuda:0").exclusive() if capturing else contextlib.nullcontext():
                box["out"] = fn(x)
        except Exception as error:  # raised again in the test's thread
            box["error"] = error

    tracer.start()
    try:
        assert traced.tracing.wait(60)
        caller = threading.Thread(target=call, name="caller")
        caller.start()
        if wait_for_waiter:
            _until_waiting("caller")
            assert "out" not in box and _fx_window.open_windows() == {"tracer": 1}
        else:
            caller.join(60)
    finally:
        traced.release.set()
        tracer.join(60)
    caller.join(60)
    assert not caller.is_alive() and not tracer.is_alive()
    if "error" in box:
        raise box["error"]
    return box["out"], counters["frames"]["ok"] - before


def test_a_compiled_call_during_another_threads_trace_waits_and_compiles_nothing(shim):
    threadgraph.install()
    assert "fx_trace_window" in {p["name"] for p in threadgraph.patches() if p["active"]}
    fn, x, expected = _settled_compiled_call()
    out, compiled = _call_during_a_trace(fn, x, wait_for_waiter=True)
    assert torch.allclose(out, expected) and compiled == 0
    assert _fx_window.open_windows() == {} and _fx_window.waiting() == []
    before = counters["frames"]["ok"]
    assert torch.allclose(fn(x), expected) and counters["frames"]["ok"] == before  # and then from the cache


def test_inside_a_capture_the_call_waits_and_then_compiles_rather_than_record_its_frame_uncompiled(shim):
    threadgraph.install()
    fn, x, expected = _settled_compiled_call()
    out, compiled = _call_during_a_trace(fn, x, wait_for_waiter=True, capturing=True)
    assert torch.allclose(out, expected) and compiled == 1


def test_a_call_whose_guards_fail_after_the_trace_too_compiles(shim):
    threadgraph.install()
    fn, x, _ = _settled_compiled_call()
    wider = torch.randn(3, 4)  # another shape: no cached entry fits once the trace is over either
    out, compiled = _call_during_a_trace(fn, wider, wait_for_waiter=True)
    assert out.shape == (3, 4) and compiled == 1


def test_without_the_patch_the_call_during_the_trace_compiles_its_code_again(shim):
    threadgraph.install(exclude=["fx_trace_window"])
    fn, x, expected = _settled_compiled_call()
    out, compiled = _call_during_a_trace(fn, x, wait_for_waiter=False)
    assert torch.allclose(out, expected) and compiled == 1  # the hazard: the same code, once more


def test_a_first_compile_during_another_threads_trace_waits_for_it_to_end(shim):
    threadgraph.install()
    layer = torch.nn.Sequential(Layer(4, 4), torch.nn.ReLU())
    fn = torch.compile(lambda x: layer(x) - 1, backend="eager")  # not compiled yet: the call compiles
    x = torch.randn(2, 4)
    out, compiled = _call_during_a_trace(fn, x, wait_for_waiter=True)
    assert torch.allclose(out, layer(x) - 1) and compiled == 1


def test_windows_nest_per_thread_and_a_thread_inside_its_own_does_not_wait(shim):
    threadgraph.install()
    new_patcher = torch.fx._symbolic_trace._new_patcher
    entered, leave = threading.Event(), threading.Event()

    def other_window():
        with new_patcher():
            entered.set()
            assert leave.wait(60)

    me = threading.current_thread().name
    with new_patcher():
        with new_patcher():
            assert _fx_window.open_windows() == {me: 2} and _fx_window.tracing_here()
            other = threading.Thread(target=other_window, name="other")
            other.start()
            assert entered.wait(60)
            assert _fx_window.wait_for_other_traces() is False  # inside its own: no wait for "other"
            leave.set()
            other.join(60)
        assert _fx_window.open_windows() == {me: 1}
    assert _fx_window.open_windows() == {} and not _fx_window.tracing_here()
    threadgraph.uninstall()
    assert torch.fx._symbolic_trace._new_patcher is _new_patcher


def test_a_trace_that_outlasts_the_timeout_lets_the_call_go_on_with_a_warning(shim, monkeypatch, caplog):
    threadgraph.install()
    monkeypatch.setattr(_fx_window, "DEFAULT_TIMEOUT_S", 0.2)
    fn, x, expected = _settled_compiled_call()
    with caplog.at_level(logging.WARNING, logger="threadgraph"):
        out, compiled = _call_during_a_trace(fn, x, wait_for_waiter=False)
    assert torch.allclose(out, expected) and compiled == 1
    # one warning naming the thread it gave up on and how long it waited
    assert any("tracer" in m and "0.2" in m for m in _warnings(caplog)), caplog.text


@pytest.mark.parametrize("fallback", [True, False], ids=["uncompiled-once", "without-it"])
def test_a_call_that_reaches_a_resume_frame_during_the_trace_runs_it_uncompiled_once(shim, monkeypatch, fallback):
    threadgraph.install()
    if not fallback:  # what the wait alone gives: the piece compiles again once the trace ends
        monkeypatch.setattr(threadgraph._patches.frame_cache, "run_uncompiled_once", lambda: None)
    layer, reached, resume, parked = Layer(4, 4), threading.Event(), threading.Event(), {"on": False}

    @torch._dynamo.disable
    def eager_between():  # a graph break: the rest of f is a resume frame, looked up when reached
        if parked["on"]:
            reached.set()
            assert resume.wait(60), "the test never let the call go on"

    def f(x):
        y = layer(x)
        eager_between()
        return layer(y) * 2

    fn, x = torch.compile(f, backend="eager"), torch.randn(2, 4)
    fn(x), fn(x)
    before, box, traced = counters["frames"]["ok"], {}, ParkedTrace()
    parked["on"] = True
    caller = threading.Thread(target=lambda: box.setdefault("out", fn(x)), name="caller")
    caller.start()
    assert reached.wait(60)  # the call is past its own wait, between its two compiled pieces
    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(traced,), name="tracer")
    tracer.start()
    try:
        assert traced.tracing.wait(60)
        resume.set()  # its resume frame now misses on the trace's patched nn.Module.__call__
        _until_waiting("caller")
        assert "out" not in box
    finally:
        traced.release.set()
        tracer.join(60)
        caller.join(60)
    parked["on"] = False
    assert torch.allclose(box["out"], layer(layer(x)) * 2)
    assert torch.allclose(fn(x), layer(layer(x)) * 2)
    assert counters["frames"]["ok"] - before == (0 if fallback else 1)  # with it, neither call compiled


def test_a_fullgraph_call_during_a_trace_compiles_rather_than_run_with_no_compiled_frame(shim):
    threadgraph.install()
    layer = torch.nn.Sequential(Layer(4, 4), torch.nn.ReLU())
    fn = torch.compile(lambda x: layer(x) * 2, backend="eager", fullgraph=True)
    x = torch.randn(2, 4)
    fn(x), fn(x)
    out, _ = _call_during_a_trace(fn, x, wait_for_waiter=True)  # uncompiled, it raises "found no compiled frames"
    assert torch.allclose(out, layer(x) * 2)


def _marked(layer):
    """A function whose result says whether it ran compiled (0 added) or as written (1000 added)."""
    return lambda x, *_: layer(x) + (0.0 if torch.compiler.is_compiling() else 1000.0)


def test_an_entry_of_another_backend_does_not_count_as_cached_code_that_fits(shim):
    threadgraph.install()
    layer, x = Layer(4, 4), torch.randn(2, 4)
    f = _marked(layer)
    first = torch.compile(f, backend="eager")
    first(x), first(x)
    second = torch.compile(f, backend="aot_eager")  # its first call: the only entry is the other backend's
    out, _ = _call_during_a_trace(second, x, wait_for_waiter=True)
    assert torch.allclose(out, layer(x))  # compiled, not run as written
    assert len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__)) == 2


def test_an_invalidated_entry_does_not_count_as_cached_code_that_fits(shim):
    threadgraph.install()
    layer, x = Layer(4, 4), torch.randn(2, 4)

    def f(x, holder):
        return layer(x) * holder.k + (0.0 if torch.compiler.is_compiling() else 1000.0)

    fn = torch.compile(f, backend="eager")
    gone = type("Gone", (), {"k": 2.0})
    fn(x, gone), fn(x, gone)
    del gone
    gc.collect()  # its entry guarded a freed object: Dynamo invalidated it
    kinds = [type(e.guard_manager).__name__ for e in torch._C._dynamo.eval_frame._debug_get_cache_entry_list(f.__code__)]
    assert kinds == ["DeletedGuardManagerWrapper"], kinds
    fresh = type("Fresh", (), {"k": 3.0})
    out, compiled = _call_during_a_trace(lambda x: fn(x, fresh), x, wait_for_waiter=True)
    assert torch.allclose(out, layer(x) * 3)  # compiled, not run as written


def test_a_thread_holding_the_compile_lock_does_not_wait_for_a_trace(shim):
    threadgraph.install()
    entered, leave = threading.Event(), threading.Event()

    def other_window():
        with torch.fx._symbolic_trace._new_patcher():
            entered.set()
            assert leave.wait(60)

    other = threading.Thread(target=other_window, name="other")
    other.start()
    try:
        assert entered.wait(60)
        with torch._dynamo.convert_frame.compile_lock:  # compiling: the trace may be waiting for this lock
            assert _fx_window.wait_for_other_traces() is False
        assert not _fx_window.waiting()
    finally:
        leave.set()
        other.join(60)


def test_a_window_a_wait_timed_out_on_is_not_waited_for_again(shim, monkeypatch, caplog):
    threadgraph.install()
    monkeypatch.setattr(_fx_window, "DEFAULT_TIMEOUT_S", 0.2)
    new_patcher = torch.fx._symbolic_trace._new_patcher
    opened, leave = threading.Semaphore(0), threading.Event()

    def windows(n):
        for _ in range(n):
            with new_patcher():
                opened.release()
                assert leave.wait(60)
            leave.clear()

    other = threading.Thread(target=windows, args=(2,), name="other")
    other.start()
    try:
        assert opened.acquire(timeout=60)
        with caplog.at_level(logging.WARNING, logger="threadgraph"):
            assert _fx_window.wait_for_other_traces() is True  # it waited, and the warning says it timed out
        assert any("other" in m and "0.2" in m for m in _warnings(caplog)), caplog.text
        assert _fx_window.wait_for_other_traces() is False  # False: it did not wait (it returns True whenever it does)
        leave.set()
        assert opened.acquire(timeout=60)  # the other thread's next window: a wait waits for it again
        assert _fx_window.wait_for_other_traces() is True
    finally:
        leave.set()
        other.join(60)


def test_an_older_entry_of_the_code_counts_as_cached_code_that_fits(shim):
    threadgraph.install()
    layer = torch.nn.Sequential(Layer(4, 4), torch.nn.ReLU())
    f = lambda x: layer(x) * 2  # noqa: E731
    fn = torch.compile(f, backend="eager", dynamic=False)
    older, newer = torch.randn(2, 4), torch.randn(3, 4)
    fn(older), fn(older), fn(newer), fn(newer)  # two entries; the newer one is the one Dynamo hands over
    listed = torch._C._dynamo.eval_frame._debug_get_cache_entry_list
    assert len(listed(f.__code__)) == 2
    out, _ = _call_during_a_trace(fn, older, wait_for_waiter=True)
    assert torch.allclose(out, layer(older) * 2) and len(listed(f.__code__)) == 2  # nothing compiled again


RESET_DURING_A_WAIT = textwrap.dedent("""
    import gc, threading, time, torch, threadgraph
    from threadgraph._patches import fx_window as _fx_window
    from test_fx_window import Layer, ParkedTrace
    threadgraph.install()
    layer = torch.nn.Sequential(Layer(4, 4), torch.nn.ReLU())
    fn = torch.compile(lambda x: layer(x) * 2, backend="eager")
    x = torch.randn(2, 4)
    fn(x), fn(x)
    traced, box = ParkedTrace(), {}
    tracer = threading.Thread(target=torch.fx.symbolic_trace, args=(traced,))
    tracer.start()
    assert traced.tracing.wait(60)
    caller = threading.Thread(target=lambda: box.setdefault("out", fn(x)), name="caller")
    caller.start()
    while "caller" not in _fx_window.waiting():
        time.sleep(0.01)
    torch._dynamo.reset()  # frees the cache entries the waiting call was handed
    junk = [[bytearray(200) for _ in range(2000)] for _ in range(20)]  # reuse the freed memory
    gc.collect()
    traced.release.set()
    tracer.join(60)
    caller.join(60)
    print("equal" if torch.allclose(box["out"], layer(x) * 2) else "differs")
""")


# The same, and the code compiled again by a thread with no window open before the waiter looks:
# as many entries as before, none of them the ones the waiter was handed.
RESET_AND_RECOMPILE = RESET_DURING_A_WAIT.replace("threadgraph.install()\n", textwrap.dedent("""\
    threadgraph.install()
    from threadgraph._patches import frame_cache as _frame_cache
    woke, recompiled, run_uncompiled_once = threading.Event(), threading.Event(), _frame_cache.run_uncompiled_once
    def late():  # the waiter, woken, pauses here until the main thread compiled the code again
        if threading.current_thread().name == "caller":
            woke.set()
            assert recompiled.wait(60)
        return run_uncompiled_once()
    _frame_cache.run_uncompiled_once = late
""")).replace("tracer.join(60)\n", textwrap.dedent("""\
    tracer.join(60)
    assert woke.wait(60)
    fn(x), fn(x)
    recompiled.set()
"""))


def _run_script(script: str) -> subprocess.CompletedProcess:
    here = Path(__file__).resolve().parent
    paths = [str(here.parents[1] / "src"), str(here.parents[1]), str(here)]  # threadgraph, tests.helpers.threads, this module
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=here,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(paths)))


@pytest.mark.parametrize("script", [RESET_DURING_A_WAIT, RESET_AND_RECOMPILE], ids=["reset", "reset-and-recompile"])
def test_a_dynamo_reset_while_a_call_waits_leaves_that_call_intact(script):
    proc = _run_script(script)
    assert proc.returncode == 0 and proc.stdout.strip() == "equal", (proc.returncode, proc.stdout, proc.stderr[-2000:])
