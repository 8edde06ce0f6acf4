"""python -m benchmarks fence-matrix DIR: the fence GPU tests' records (tests/helpers/gpu_process.py, with
THREADGRAPH_GPU_LOG) become the fence-matrix results file, cells in matrix order and the repro's
runs by variant; a run that printed no result is kept with its exit status; the headlines count it."""

import json
import os

import pytest

from benchmarks import gpu_scenarios_results as collector
from benchmarks import headlines
from benchmarks import results_schema as schema

NOON = 1764590400  # 2025-12-01 12:00 UTC
WHO = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}


def record(folder, tag, args, result=None, rc=0, module="tests.library.gpu_fence_scenarios"):
    path = folder / f"{tag}.json"
    path.write_text(json.dumps({"tag": tag, "args": ["-m", module, *args], "rc": rc, "seconds": 9.0,
                                "result": result, "last_stderr_line": None if rc == 0 else "RuntimeError: CUDA error"}))
    os.utime(path, (NOON, NOON))


def cell(ops, kind, variant, errors=0):
    return {"ops": ops, "kind": kind, "variant": variant, "ops_stats": {"op": {"calls": 200, "during_capture": 2,
            "errors": errors, "first_error": "Offset increment outside graph capture" if errors else None}},
            "group_error": None, "workers_equal_reference": [True] * 3, "captures": [2, 2, 2],
            "rng_in_main_thread_after": "ok", **WHO}


def repro(errors):
    return {"threads": 32, "finished": 32, "errors": {str(i): "Offset increment" for i in range(errors)},
            "all_equal": not errors, "captures": [1] * 32, **WHO}


@pytest.fixture
def log(tmp_path):
    folder = tmp_path / "log"
    folder.mkdir()
    record(folder, "matrix_ops_sync_kind_train_variant_unfenced", ["matrix", "--ops", "sync", "--kind", "train",
           "--variant", "unfenced"], cell("sync", "train", "unfenced", errors=3))
    record(folder, "matrix_ops_rng_kind_infer", ["matrix", "--ops", "rng", "--kind", "infer"], cell("rng", "infer", "fenced"))
    record(folder, "matrix_ops_rng_kind_train", ["matrix", "--ops", "rng", "--kind", "train"], cell("rng", "train", "fenced"))
    record(folder, "matrix_ops_host_kind_train", ["matrix", "--ops", "host", "--kind", "train"], rc=-6)
    for i in (1, 2, 10):
        record(folder, f"repro_123177_threads_32_fenced_run_{i}", ["repro_123177", "--threads", "32", "--variant", "fenced"],
               repro(0))
    record(folder, "repro_123177_threads_32_unfenced_run_1", ["repro_123177", "--threads", "32", "--variant", "unfenced"],
           repro(7))
    record(folder, "many_workers_8_steps_200", ["many"], {"gpu": "other"}, module="tests.helpers.gpu_scenarios")  # not the fence's
    return folder


def test_a_test_runs_records_become_the_fence_matrix_file(log, tmp_path):
    path = collector.collect_fence(log, tmp_path)
    assert path.name == "fence-matrix_nvidia-h200_torch2.11.0_2025-12-01.json"
    data = schema.load(path).data
    assert [(c["args"][2], c["args"][4], c.get("variant")) for c in data["cells"]] == [
        ("rng", "train", "fenced"), ("rng", "infer", "fenced"), ("host", "train", None), ("sync", "train", "unfenced")]
    host = data["cells"][2]
    assert host["rc"] == -6 and host["stderr_tail"] == "RuntimeError: CUDA error" and "ops_stats" not in host
    assert [len(runs) for runs in data["repro"].values()] == [3, 1]
    assert dict(headlines.fence_matrix(data)) == {
        "pytorch#123177 repro, fenced": "3 of 3 runs clean", "pytorch#123177 repro, unfenced": "1 of 1 runs raised",
        "eager ops beside captures, fenced": "1 of 3 cells raised", "eager ops beside captures, unfenced": "1 of 1 cells raised"}
    assert [p.name for p in tmp_path.iterdir() if p.is_file()] == [path.name]  # the JSON only
    missing = collector.missing_cells(data)
    assert len(missing) == 16 and "host infer fenced" in missing and "rng train fenced" not in missing


def test_a_folder_without_fence_records_or_of_two_torches_is_refused(tmp_path, log):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit, match="no records of tests.library.gpu_fence_scenarios runs"):
        collector.collect_fence(empty, tmp_path)
    record(log, "matrix_ops_memory_kind_train", ["matrix", "--ops", "memory", "--kind", "train"],
           dict(cell("memory", "train", "fenced"), torch="2.12.0"))
    with pytest.raises(SystemExit, match="the records name 2 GPU / torch pairs"):
        collector.collect_fence(log, tmp_path)
