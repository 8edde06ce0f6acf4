"""Hazard global-fx-tracing-flag: where FX's tracing flag is one module-global bool (up to 2.13),
a compiled function called in one thread while another traces (torch.fx, or make_fx inside a
compile) raises "Detected that you are using FX to symbolically trace a dynamo-optimized
function" (seen on an H200, torch 2.11, in the DFlash trainer); the per-thread patches keep each
thread's answer to its own tracing. Where the flag is per thread (2.14+), the patches are not
applied, doctor reports the hazard absent, and the call runs without them."""

import threading

import pytest
import torch

import threadgraph
from threadgraph import _compat, _patches
from threadgraph._diagnostics import hazards as _hazards

FX_PATCHES = frozenset({"fx_trace_marks_thread", "fx_symbolic_tracing_per_thread", "fx_tracing_per_thread"})
# fx_trace_window would hold the call back until the trace ends (test_fx_window.py): these tests need it during one.
WINDOW = ["fx_trace_window"]
GLOBAL_FLAG = _compat.fx_tracing_flag_is_global()


class _SlowTraced(torch.nn.Module):
    """A module whose forward, under torch.fx tracing, parks until told to go on."""

    def __init__(self, tracing: threading.Event, release: threading.Event) -> None:
        super().__init__()
        self.tracing, self.release = tracing, release

    def forward(self, x):
        self.tracing.set()
        assert self.release.wait(60), "the compiled call did not finish"
        return x + 1


def _compiled_call_while_another_thread_traces() -> str:
    """Call a compiled function while a second thread is inside torch.fx tracing."""
    fn = torch.compile(lambda x: x * 2, backend="eager")  # wrapper made after install(), as in workers
    tracing, release = threading.Event(), threading.Event()
    traced = {}
    tracer = threading.Thread(target=lambda: traced.setdefault("gm", torch.fx.symbolic_trace(_SlowTraced(tracing, release))))
    tracer.start()
    try:
        assert tracing.wait(60)
        try:
            out = fn(torch.ones(3))
            outcome = "ran" if torch.equal(out, torch.full((3,), 2.0)) else "wrong result"
        except RuntimeError as exc:
            outcome = f"RuntimeError: {exc}"
    finally:
        release.set()
        tracer.join(60)
    assert "gm" in traced, "the tracing thread did not finish"
    return outcome


@pytest.fixture
def clean_shim():
    threadgraph.uninstall()
    torch._dynamo.reset()
    yield
    threadgraph.uninstall()
    torch._dynamo.reset()


def test_without_the_fx_patches_a_compiled_call_fails_exactly_where_the_flag_is_global(clean_shim):
    threadgraph.install(exclude=[*FX_PATCHES, *WINDOW])
    outcome = _compiled_call_while_another_thread_traces()
    if GLOBAL_FLAG:  # the hazard: the other thread's trace is seen in this one
        assert "symbolically trace a dynamo-optimized function" in outcome, outcome
    else:
        assert outcome == "ran"


def test_install_patches_a_global_flag_and_leaves_a_per_thread_one_alone(clean_shim):
    applied = set(threadgraph.install(exclude=WINDOW))
    active = {p["name"] for p in threadgraph.patches() if p["active"]}
    if GLOBAL_FLAG:
        assert {"fx_trace_marks_thread", "fx_symbolic_tracing_per_thread"} <= applied & active
    else:
        assert not FX_PATCHES & (applied | active)
    assert _compiled_call_while_another_thread_traces() == "ran"


def test_doctor_says_whether_the_hazard_is_present_and_which_fx_patches_are_needed(clean_shim):
    from threadgraph._diagnostics.doctor import format_report, report

    hazard = _hazards.get("global-fx-tracing-flag")
    assert hazard.status() == ("present" if GLOBAL_FLAG else "absent")
    text = format_report(report()).splitlines()
    assert f"  {'[x]' if GLOBAL_FLAG else '[ ]'} global-fx-tracing-flag" in "\n".join(text)
    states = {line.split()[0]: line.split()[1] for line in text if line.split() and line.split()[0] in FX_PATCHES}
    assert states["fx_trace_marks_thread"] == ("applies" if GLOBAL_FLAG else "not")
    assert states["fx_tracing_per_thread"] == "not"  # every release read has is_fx_symbolic_tracing


def test_tracing_is_still_seen_in_the_tracing_thread(clean_shim, monkeypatch):
    monkeypatch.setattr(_compat, "fx_tracing_flag_is_global", lambda: True)  # patched on every torch
    threadgraph.install()
    assert "fx_symbolic_tracing_per_thread" in {p["name"] for p in threadgraph.patches() if p["active"]}
    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen["during"] = torch.fx._symbolic_trace.is_fx_symbolic_tracing()
            return x

    torch.fx.symbolic_trace(Probe())
    assert seen["during"] is True
    assert torch.fx._symbolic_trace.is_fx_symbolic_tracing() is False


def test_uninstall_restores_the_fx_functions(clean_shim, monkeypatch):
    import torch.fx._symbolic_trace as fx

    monkeypatch.setattr(_compat, "fx_tracing_flag_is_global", lambda: True)  # patched on every torch
    originals = (vars(fx.Tracer)["trace"], fx.is_fx_symbolic_tracing)
    threadgraph.install()
    assert fx.is_fx_symbolic_tracing is not originals[1]
    threadgraph.uninstall()
    assert vars(fx.Tracer)["trace"] is originals[0] and fx.is_fx_symbolic_tracing is originals[1]
    assert _patches.patches()  # still described when inactive


def test_the_flag_probe_reads_the_module_global_that_tracer_trace_sets(monkeypatch):
    import torch.fx._symbolic_trace as fx

    monkeypatch.setattr(fx, "_is_fx_tracing_flag", False, raising=False)
    assert _compat.fx_tracing_flag_is_global()
    monkeypatch.delattr(fx, "_is_fx_tracing_flag")
    assert not _compat.fx_tracing_flag_is_global()
