"""The drafter's compiled forward and backward alone, in each placement (tests/helpers/gpu_drafter_scenarios.py,
a fresh process each): where the trainer's Trees-mode crash on torch 2.14.1 (SIGSEGV in the first
warm-up of a drafter's compiled backward) comes from, and that it is gone."""

import math

import pytest

from tests.helpers.gpu_drafter_scenarios import PLACEMENTS
from tests.helpers.gpu_process import scenario


# Compiled against eager: on the GPU both run under bf16 autocast, where Inductor keeps fp32
# intermediates that eager rounds (as the trainer's own Trees-against-eager bound allows for); on the
# CPU, float32 throughout, only the order of reductions may differ.
GPU_TOLERANCE = dict(rel=2e-2, abs=1e-3)
CPU_TOLERANCE = dict(rel=1e-4, abs=1e-6)


def _finite_and_eager(result: dict, threads: int, tolerance: dict) -> None:
    """Each thread's losses finite and, with its gradients' norms, those of its seed's step run eagerly."""
    assert len(result["losses"]) == len(result["grad_norms"]) == threads, result
    assert all(math.isfinite(x) and 0 < x < 100 for pair in result["losses"] for x in pair), result
    assert all(math.isfinite(x) and x > 0 for pair in result["grad_norms"] for x in pair), result
    eager = result["eager"]
    assert len(eager["losses"]) == threads, result
    for name in ("losses", "grad_norms"):  # each thread's first and last step
        compiled, reference = sum(result[name], []), sum(eager[name], [])
        assert len(compiled) == len(reference) == 2 * threads and compiled == pytest.approx(reference, **tolerance), \
            (name, result)


@pytest.mark.gpu
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_drafters_compiled_backward_runs_as_cudagraph_trees(placement):
    result = scenario(placement, "--steps", 5, module="tests.helpers.gpu_drafter_scenarios")
    _finite_and_eager(result, 3 if placement == "threads-3" else 1, GPU_TOLERANCE)


def test_the_drafter_scenario_runs_on_the_cpu_in_three_threads():
    """The GPU test's own scenario on the CPU, compiled by AOTAutograd without Inductor (its backward
    is a compiled graph too): what the GPU test runs is a working step, compared as it is there."""
    result = scenario("threads-3", "--steps", 2, "--device", "cpu", "--backend", "aot_eager",
                      module="tests.helpers.gpu_drafter_scenarios")
    _finite_and_eager(result, 3, CPU_TOLERANCE)


def test_the_scenarios_switches_take_their_suspect_away():
    result = scenario("thread", "--steps", 1, "--device", "cpu", "--backend", "eager", "--sdpa", "math",
                      "--warmup-modes", "off", "--autograd-threads", "off", module="tests.helpers.gpu_drafter_scenarios")
    _finite_and_eager(result, 1, CPU_TOLERANCE)
    assert {"fused attention", "autograd device thread"} <= set(result["taken_away"]), result
