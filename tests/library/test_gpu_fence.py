"""GPU tests of the eager fence: each scenario of tests/gpu_fence_scenarios.py in a fresh process.

``benchmarks/fence_matrix.py`` runs the same scenarios with the fence switched off too and writes
the table docs/results.md quotes; these tests assert the fenced side and the hazard it removes."""

import concurrent.futures
import os

import pytest

from tests.gpu_process import scenario as _scenario

pytestmark = pytest.mark.gpu
RUNS = int(os.environ.get("THREADGRAPH_REPRO_RUNS", "20"))


def scenario(name, *args):
    return _scenario(name, *args, module="tests.gpu_fence_scenarios")


def _clean(run):
    return not run["errors"] and run["finished"] == run["threads"] and run["all_equal"]


@pytest.mark.slow  # RUNS fresh processes, 4 at a time: minutes
def test_pytorch_123177_repro_passes_run_after_run_and_every_thread_records_its_own_graph():
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # fresh processes, 4 at a time on the GPU
        runs = list(pool.map(lambda _: scenario("repro_123177", "--threads", 32), range(RUNS)))
    failed = [r for r in runs if not _clean(r)]
    assert not failed, failed[0]
    assert all(min(r["captures"]) >= 1 for r in runs), [r["not_recorded"] for r in runs if min(r["captures"]) < 1]


def test_without_the_fence_the_repro_raises_offset_increment_in_bystanders():
    for _ in range(5):  # the overlap is a race: stop at the first run that shows it
        run = scenario("repro_123177", "--threads", 32, "--variant", "unfenced")
        if run["errors"]:
            break
    assert run["errors"], "no run of five showed the hazard"
    assert all("Offset increment outside graph capture" in e for e in run["errors"].values()), run["errors"]


@pytest.mark.parametrize("kind", ["train", "infer"])
@pytest.mark.parametrize("ops", ["rng", "compiled_rng", "sync", "host", "memory"])
def test_eager_work_in_a_plain_thread_during_warmups_and_recordings(ops, kind):
    r = scenario("matrix", "--ops", ops, "--kind", kind)
    failing = {op: s["first_error"] for op, s in r["ops_stats"].items() if s["errors"]}
    assert not failing, failing
    assert r["group_error"] is None and all(r["workers_equal_reference"]), r
    assert r["rng_in_main_thread_after"] == "ok"
    assert min(r["captures"]) >= 1
    assert sum(s["calls"] for s in r["ops_stats"].values()) > 100  # the bystander kept going throughout


def test_without_the_fence_a_bystanders_rng_draw_raises_and_its_sync_breaks_a_capture():
    rng = scenario("matrix", "--ops", "rng", "--kind", "train", "--variant", "unfenced")
    errors = [s["first_error"] for s in rng["ops_stats"].values() if s["errors"]]
    assert errors and all("Offset increment outside graph capture" in e for e in errors), rng["ops_stats"]
    sync = scenario("matrix", "--ops", "sync", "--kind", "infer", "--variant", "unfenced")
    assert "operation not permitted when stream is capturing" in sync["ops_stats"]["torch.cuda.synchronize"]["first_error"]
    # The worker whose capture broke reports it as threadgraph's clear error (the CUDA error is its cause).
    assert "was broken by CUDA work of another thread" in (sync["group_error"] or ""), sync
