"""GPU tests of the eager fence: each scenario of tests/library/gpu_fence_scenarios.py in a fresh process.

The fence matrix: a plain thread's eager op class beside 3 workers' warm-ups and recordings
(training and inference), with the fence (nothing raises, the workers' outputs stay right) and
without it (device syncs raise, and RNG draws where the CUDA generator still checks its offset
during another thread's capture; what the fence leaves alone still does not); and
pytorch#123177's repro, run after run, fenced and unfenced. With THREADGRAPH_GPU_LOG set, every
run's record is kept, and ``python -m benchmarks fence-matrix DIR`` writes them as the
fence-matrix results file that docs/results.md quotes."""

import concurrent.futures
import os

import pytest

from threadgraph import _compat
from tests.helpers.gpu_process import run_json
from tests.helpers.gpu_process import scenario as _scenario

pytestmark = pytest.mark.gpu
MODULE = "tests.library.gpu_fence_scenarios"
RUNS = int(os.environ.get("THREADGRAPH_REPRO_RUNS", "20"))
UNFENCED_RUNS = 3  # the repro without the fence: how many runs the results file records
OFFSET = _compat.GENERATOR_CAPTURE_CHECK.decode()
# Whether this torch's CUDA generator refuses a draw beside another thread's capture (2.14.1 does not).
GENERATOR_CHECKS = _compat.generator_rejects_draws_beside_captures() is not False
OP_CLASSES = ["rng", "compiled_rng", "sync", "host", "memory"]


def scenario(name, *args):
    return _scenario(name, *args, module=MODULE)


def repro_runs(variant, runs):
    """``runs`` runs of the repro, 4 fresh processes at a time, each recorded under a tag of its own."""
    def one(i):
        return run_json(f"repro_123177_threads_32_{variant}_run_{i}", ["-m", MODULE, "repro_123177", "--threads", 32,
                                                                       "--variant", variant])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, range(1, runs + 1)))


def _clean(run):
    return not run["errors"] and run["finished"] == run["threads"] and run["all_equal"]


@pytest.mark.slow  # RUNS fresh processes, 4 at a time: minutes
def test_pytorch_123177_repro_passes_run_after_run_and_every_thread_records_its_own_graph():
    runs = repro_runs("fenced", RUNS)
    failed = [r for r in runs if not _clean(r)]
    assert not failed, failed[0]
    assert all(min(r["captures"]) >= 1 for r in runs), [r["not_recorded"] for r in runs if min(r["captures"]) < 1]


def test_without_the_fence_the_repro_raises_offset_increment_in_bystanders_where_the_generator_checks():
    runs = repro_runs("unfenced", UNFENCED_RUNS)
    errors = [e for r in runs for e in r["errors"].values()]
    if GENERATOR_CHECKS:
        assert errors, f"no run of {UNFENCED_RUNS} showed the hazard"  # a race: one run showing it is enough
        assert all(OFFSET in e for e in errors), errors
    else:  # RNG state kept per capture: the bystanders' draws are safe on their own
        assert not [r for r in runs if not _clean(r)], runs


@pytest.mark.parametrize("kind", ["train", "infer"])
@pytest.mark.parametrize("ops", OP_CLASSES)
def test_eager_work_in_a_plain_thread_during_warmups_and_recordings(ops, kind):
    r = scenario("matrix", "--ops", ops, "--kind", kind)
    failing = {op: s["first_error"] for op, s in r["ops_stats"].items() if s["errors"]}
    assert not failing, failing
    assert r["group_error"] is None and all(r["workers_equal_reference"]), r
    assert r["rng_in_main_thread_after"] == "ok"
    assert min(r["captures"]) >= 1
    assert sum(s["calls"] for s in r["ops_stats"].values()) > 100  # the bystander kept going throughout


@pytest.mark.parametrize("kind", ["train", "infer"])
@pytest.mark.parametrize("ops", OP_CLASSES)
def test_without_the_fence_only_rng_draws_and_device_syncs_fail(ops, kind):
    """What the fence wraps is what fails without it; what it leaves alone (stream and event syncs,
    host reads, allocation, empty_cache) is safe beside captures on its own."""
    r = scenario("matrix", "--ops", ops, "--kind", kind, "--variant", "unfenced")
    assert r["variant"] == "unfenced" and sum(s["calls"] for s in r["ops_stats"].values()) > 100
    failing = {op: s["first_error"] for op, s in r["ops_stats"].items() if s["errors"]}
    # Every branch asserts what it expects to see, never over a list that may be empty: the results
    # files (benchmarks/results/fence-matrix_*) show every cell of each branch doing so.
    if ops in ("rng", "compiled_rng") and GENERATOR_CHECKS:
        assert failing and all(OFFSET in e for e in failing.values()), failing
    elif ops == "sync":
        assert set(failing) == {"torch.cuda.synchronize"}, failing
    else:  # safe on its own, so long as the bystander's work did overlap the captures
        assert sum(s["during_capture"] for s in r["ops_stats"].values()) > 0, r["ops_stats"]
        assert not failing and r["group_error"] is None, (failing, r["group_error"])
        if ops in ("rng", "compiled_rng"):
            assert all(r["workers_equal_reference"]), r


@pytest.mark.skipif(not GENERATOR_CHECKS, reason="this torch keeps RNG state per capture: a bystander's draw "
                    "is safe (test_without_the_fence_only_rng_draws_and_device_syncs_fail checks it)")
def test_without_the_fence_a_bystanders_rng_draw_raises():
    rng = scenario("matrix", "--ops", "rng", "--kind", "train", "--variant", "unfenced")
    errors = [s["first_error"] for s in rng["ops_stats"].values() if s["errors"]]
    assert errors and all(OFFSET in e for e in errors), rng["ops_stats"]


def test_without_the_fence_a_bystanders_sync_breaks_a_capture():
    sync = scenario("matrix", "--ops", "sync", "--kind", "infer", "--variant", "unfenced")
    assert "operation not permitted when stream is capturing" in sync["ops_stats"]["torch.cuda.synchronize"]["first_error"]
    # The worker whose capture broke reports it as threadgraph's clear error (the CUDA error is its cause).
    assert "was broken by CUDA work of another thread" in (sync["group_error"] or ""), sync
