"""The drafter's compiled forward and backward alone, in each placement (tests/helpers/gpu_drafter_scenarios.py,
a fresh process each): where the trainer's Trees-mode crash on torch 2.14.1 (SIGSEGV in the first
warm-up of a drafter's compiled backward) comes from, and that it is gone."""

import math

import pytest

from tests.helpers.gpu_drafter_scenarios import PLACEMENTS
from tests.helpers.gpu_process import scenario


def _finite(result: dict, threads: int) -> None:
    assert len(result["losses"]) == threads, result
    assert all(math.isfinite(x) and 0 < x < 100 for pair in result["losses"] for x in pair), result


@pytest.mark.gpu
@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_drafters_compiled_backward_runs_as_cudagraph_trees(placement):
    result = scenario(placement, "--steps", 5, module="tests.helpers.gpu_drafter_scenarios")
    _finite(result, 3 if placement == "threads-3" else 1)


def test_the_drafter_scenario_runs_on_the_cpu_in_three_threads():
    """The GPU test's own scenario, eager on the CPU: what the GPU test runs is a working step."""
    result = scenario("threads-3", "--steps", 2, "--device", "cpu", "--backend", "eager",
                      module="tests.helpers.gpu_drafter_scenarios")
    _finite(result, 3)


def test_the_scenarios_switches_take_their_suspect_away():
    result = scenario("thread", "--steps", 1, "--device", "cpu", "--backend", "eager", "--sdpa", "math",
                      "--warmup-modes", "off", "--autograd-threads", "off", module="tests.helpers.gpu_drafter_scenarios")
    _finite(result, 1)
    assert {"fused attention", "autograd device thread"} <= set(result["taken_away"]), result
