"""Hazard 11: FX's tracing flag is process-global. While one thread traces (torch.fx, or make_fx
inside a compile), a compiled function called in another thread raises "Detected that you are
using FX to symbolically trace a dynamo-optimized function" (seen on an H200, torch 2.11, in the
DFlash trainer). The per-thread patches keep each thread's answer to its own tracing."""

import threading

import pytest
import torch

import threadgraph
from threadgraph import _patches

FX_PATCHES = frozenset({"fx_trace_marks_thread", "fx_symbolic_tracing_per_thread", "fx_tracing_per_thread"})


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


def test_without_the_patch_a_compiled_call_raises_while_another_thread_traces(clean_shim):
    threadgraph.install(exclude=FX_PATCHES)
    outcome = _compiled_call_while_another_thread_traces()
    assert "symbolically trace a dynamo-optimized function" in outcome, outcome


def test_with_the_patch_the_compiled_call_runs(clean_shim):
    threadgraph.install()
    assert {"fx_trace_marks_thread", "fx_symbolic_tracing_per_thread"} <= {p["name"] for p in threadgraph.patches() if p["active"]}
    assert _compiled_call_while_another_thread_traces() == "ran"


def test_tracing_is_still_seen_in_the_tracing_thread(clean_shim):
    threadgraph.install()
    seen = {}

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen["during"] = torch.fx._symbolic_trace.is_fx_symbolic_tracing()
            return x

    torch.fx.symbolic_trace(Probe())
    assert seen["during"] is True
    assert torch.fx._symbolic_trace.is_fx_symbolic_tracing() is False


def test_uninstall_restores_the_fx_functions(clean_shim):
    import torch.fx._symbolic_trace as fx

    originals = (vars(fx.Tracer)["trace"], fx.is_fx_symbolic_tracing)
    threadgraph.install()
    assert fx.is_fx_symbolic_tracing is not originals[1]
    threadgraph.uninstall()
    assert (vars(fx.Tracer)["trace"], fx.is_fx_symbolic_tracing) == originals
    assert _patches.patches()  # still described when inactive
