"""Hazard global-compile-session-flag: from 2.13 a compile holds ``torch.compiler.is_compiling()``
True for every thread, so eager code elsewhere takes its compiled branch; transformers' output
collector then turns into one process global and concurrent ``output_hidden_states`` forwards take
each other's hidden states (the DFlash trainer's target workers on an H200, torch 2.14.1). The
patch ``compile_flag_per_thread`` answers per thread. Where the flag is not global (up to 2.12)
the patch is not applied and doctor reports the hazard absent."""

import threading

import pytest
import torch

import threadgraph
from threadgraph import _compat, _patches
from threadgraph._diagnostics import hazards as _hazards

GLOBAL_FLAG = _compat.compile_session_flag_is_global()
needs_global_flag = pytest.mark.skipif(not GLOBAL_FLAG, reason=f"torch {torch.__version__} has no process-wide compile session flag")


def during_a_compile_elsewhere(observe):
    """Run ``observe()`` in this thread while another thread is inside a compile's backend; returns
    (what the compiling thread's backend saw of is_compiling(), what observe returned)."""
    inside, done = threading.Event(), threading.Event()
    seen = {}

    def backend(gm, example_inputs):
        seen["compiling"] = torch.compiler.is_compiling()
        inside.set()
        assert done.wait(60), "the observing thread never finished"
        return gm.forward

    def compile_one():
        try:
            torch.compile(lambda x: x + 1, backend=backend)(torch.ones(2))
        except BaseException as exc:  # the main thread reports it below
            seen["error"] = exc

    compiler = threading.Thread(target=compile_one, name="compiler")
    compiler.start()
    try:
        assert inside.wait(60), f"the compile never reached its backend: {seen.get('error')!r}"
        observed = observe()
    finally:
        done.set()
        compiler.join(60)
    torch._dynamo.reset()
    assert "error" not in seen, seen["error"]
    return seen["compiling"], observed


@needs_global_flag
def test_without_the_patch_another_threads_compile_makes_is_compiling_true_here(clean_patches):
    compiling, here = during_a_compile_elsewhere(torch.compiler.is_compiling)
    assert (compiling, here) == (True, True)


@needs_global_flag
def test_with_the_patch_only_the_compiling_thread_is_compiling(clean_patches):
    assert "compile_flag_per_thread" in threadgraph.install()
    compiling, here = during_a_compile_elsewhere(torch.compiler.is_compiling)
    assert (compiling, here) == (True, False)
    # the older spellings answer through it
    assert during_a_compile_elsewhere(torch._dynamo.external_utils.is_compiling)[1] is False
    assert torch.compiler.is_compiling() is False  # a bool, as upstream's


@needs_global_flag
def test_traced_code_still_takes_its_compiled_branch(clean_patches):
    threadgraph.install()
    fn = torch.compile(lambda x: x * 2 if torch.compiler.is_compiling() else x * 3, backend="eager", fullgraph=True)
    assert fn(torch.ones(1)).item() == 2.0
    torch._dynamo.reset()


@needs_global_flag
def test_install_keeps_the_function_and_uninstall_puts_its_exact_code_back(clean_patches):
    function, code, session = torch.compiler.is_compiling, torch.compiler.is_compiling.__code__, torch.compiler._compile_session_context
    threadgraph.install()
    threadgraph.install()  # idempotent: the swapped body is not swapped again
    assert torch.compiler.is_compiling is function and function.__code__ is not code
    assert torch.compiler._compile_session_context is not session
    assert threadgraph.uninstall() and function.__code__ is code and torch.compiler._compile_session_context is session


@needs_global_flag
def test_transformers_output_collector_stays_per_thread_during_a_compile_elsewhere(clean_patches):
    transformers = pytest.importorskip("transformers")
    from transformers.utils import output_capturing

    collector = getattr(output_capturing, "_active_collector", None)
    if not hasattr(collector, "compiling"):
        pytest.skip(f"transformers {transformers.__version__} has no CompileableContextVar")
    config = transformers.Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    model = transformers.Qwen3Model(config).eval()
    seen = []
    model.layers[0].register_forward_hook(lambda *_: seen.append(collector.compiling))

    def forward():
        with torch.no_grad():
            return len(model(input_ids=torch.zeros(1, 4, dtype=torch.long), output_hidden_states=True).hidden_states)

    assert during_a_compile_elsewhere(forward)[1] == 3
    assert seen == [True], "without the patch the collector goes process-wide while another thread compiles"
    seen.clear()
    threadgraph.install()
    assert during_a_compile_elsewhere(forward)[1] == 3
    assert seen == [False]


def test_doctor_reports_the_hazard_as_this_torch_has_it():
    hazard = {h.name: h for h in _hazards.HAZARDS}["global-compile-session-flag"]
    assert hazard.status() == ("present" if GLOBAL_FLAG else "absent")
    patch = {p.name: p for p in _patches.PATCHES}["compile_flag_per_thread"]
    assert patch.hazard == hazard.name and patch.applies() is GLOBAL_FLAG


def _scripted_branch(x: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling():
        return x + 1
    return x


@needs_global_flag
def test_torchscript_and_dynamos_skip_rules_still_see_upstreams_function(clean_patches):
    from torch._dynamo import trace_rules

    threadgraph.install()
    body = torch.compiler.is_compiling.__code__
    assert trace_rules.check(body), "Dynamo would trace the swapped body as user code"
    assert torch.jit.script(_scripted_branch)(torch.zeros(1)).item() == 0.0
