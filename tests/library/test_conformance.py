"""Every conformance case (tests/conformance) observes the same in every placement: the main
thread without threadgraph, the main thread with install(), a plain thread with install() and a
CompiledWorkerThread. Each case runs in a fresh process; a difference fails and names the placement."""

import pytest

from tests.conformance import registry
from tests.conformance.placements import PLACEMENTS, differences
from tests.conformance.subprocess_run import run_case


def _check(name):
    row = run_case(name)
    assert set(row["observed"]) == set(PLACEMENTS), row["stderr_tail"]
    assert row["equal"], f"{name}: " + "; ".join(row["differences"]) + "\n" + row["stderr_tail"]
    return row


@pytest.mark.parametrize("name", sorted(registry.CPU_CASES))
def test_cpu_case_same_in_every_placement(name):
    _check(name)


# What some cases must show on the main thread for the case to test what it says it tests.
_SHOWS = {
    "overwritten_output": lambda seen: [("overwritten by a subsequent run" in str(r)) for r in seen["result"]["reads"]]
    == [True, True, False],
    "mutated_input_skip": lambda seen: any("mutated inputs" in line for line in seen["skips"]),
    "cpu_input_skip": lambda seen: any("cpu device" in line for line in seen["skips"]),
    "dynamic_shape_skip": lambda seen: any("symbolic shapes" in line for line in seen["skips"]),
    # The manager's own flag, not its warning: 2.13+ no longer warns of pending, uninvoked backwards.
    "pending_backward_and_mark_step": lambda seen: all(seen["result"][f"forward only {call}"]["pending_backward"]
                                                       for call in range(3)),
    "checkpoint_accounting": lambda seen: seen["result"]["trees"]["checkpoints"] == 2,
    "rng_trees_fallback_random": lambda seen: seen["result"]["reseeded_runs_equal"],
}


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(registry.GPU_CASES))
def test_gpu_case_same_in_every_placement(name):
    row = _check(name)
    main = row["observed"]["main"]
    assert "error" not in main, main
    if name in _SHOWS:
        assert _SHOWS[name](main), main


def test_a_difference_names_its_placement():
    observed = {p: {"result": 1, "warnings": [], "skips": [], "skip_count": 0} for p in PLACEMENTS}
    observed["thread+install"] = {"error": "RuntimeError: boom", "warnings": [], "skips": [], "skip_count": 0}
    found = differences(observed)
    assert [line.split(":")[0] for line in found] == ["thread+install", "thread+install"]
    assert "RuntimeError: boom" in found[1]
