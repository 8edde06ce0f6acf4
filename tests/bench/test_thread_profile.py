"""benchmarks/thread_profile.py: a profiler trace's kernels attributed to the threads that launched
them, on a hand-made Chrome trace (the GPU figures come from the throughput benchmark's runs); and
the throughput report's lines for a profiled window."""

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as the scripts run
thread_profile = importlib.import_module("thread_profile")
dflash_report = importlib.import_module("dflash_report")


def runtime(tid, name, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "tid": tid, "ts": 0, "dur": 1, "args": {"correlation": correlation}}


def kernel(start, dur, correlation, device=0, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": "k", "ts": start, "dur": dur, "args": {"correlation": correlation, "device": device}}


TRACE = {"traceEvents": [
    runtime(101, "cudaGraphLaunch", 1), runtime(102, "cudaLaunchKernel", 2), runtime(999, "cudaLaunchKernel", 4),
    dict(runtime(102, "cuLaunchKernel", 5), cat="cuda_driver"),  # a Triton kernel, launched through the driver
    # target-0's graph: two kernels, 0-1000 us and 1500-2000 us
    kernel(0, 1000, 1), kernel(1500, 500, 1),
    # drafter-0's kernel overlaps the first by 500 us
    kernel(500, 1000, 2),
    # a copy of an unknown (C++) thread, and a kernel whose launch the trace lacks
    kernel(3000, 200, 4, cat="gpu_memcpy"), kernel(4000, 100, 3),
    kernel(5000, 300, 5),
    {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 101, "ts": 0, "dur": 5},  # not device work
]}


def test_kernels_count_for_the_thread_whose_runtime_call_launched_them():
    figures = thread_profile.attribute(TRACE, {101: "target-0", 102: "drafter-0"}, window_ms=10.0)
    # 0-2000, 3000-3200, 4000-4100, 5000-5300 us
    assert figures["devices"] == {"0": {"busy_ms": 2.6, "busy_share": 0.26}}
    assert figures["threads"] == {
        "drafter-0": {"kernel_ms": 1.3, "busy_ms": 1.3, "busy_share": 0.13, "launches": 2, "graph_launches": 0},
        "other threads": {"kernel_ms": 0.2, "busy_ms": 0.2, "busy_share": 0.02, "launches": 1, "graph_launches": 0},
        "target-0": {"kernel_ms": 1.5, "busy_ms": 1.5, "busy_share": 0.15, "launches": 1, "graph_launches": 1},
        "unattributed": {"kernel_ms": 0.1, "busy_ms": 0.1, "busy_share": 0.01, "launches": 1, "graph_launches": 0},
    }
    assert figures["concurrent_ms"] == pytest.approx(0.5)  # drafter-0's kernel beside target-0's first


def test_a_window_of_no_device_work_has_no_threads_and_no_share_without_a_window():
    figures = thread_profile.attribute({"traceEvents": [runtime(1, "cudaLaunchKernel", 1)]}, {}, window_ms=0.0)
    assert figures == {"window_ms": 0.0, "devices": {}, "threads": {}, "concurrent_ms": 0.0}
    assert thread_profile.attribute(TRACE, {}, window_ms=0.0)["devices"]["0"]["busy_share"] is None


def test_union_counts_overlaps_once():
    assert thread_profile.union_ms([(0, 1000), (500, 1500), (2000, 2500), (2100, 2200)]) == 2.0


def test_the_report_shows_each_launching_threads_share_of_the_window():
    figures = thread_profile.attribute(TRACE, {101: "target-0", 102: "drafter-0"}, window_ms=10.0)
    lines = dflash_report.profile_lines(figures)
    assert lines[0].startswith("Profiled window (0.0 s of steady state, CUDA activity only): cuda:0 busy 0.26 of the window;")
    assert "| target-0 | 1.50 | 1.50 | 0.15 | 1 | 1 |" in lines[2]
    assert dflash_report.profile_lines({}) == []
    assert dflash_report.profile_lines({"error": "RuntimeError: CUPTI busy"}) == [
        "Profiled window: failed (RuntimeError: CUPTI busy).", ""]
    figures["training_ended_inside"] = True
    assert "(training ended inside the window: the shares count its idle end)." in dflash_report.profile_lines(figures)[0]


def test_a_profile_that_never_started_has_no_result_and_one_that_failed_raises_its_error():
    probe = thread_profile.ThreadProfile(0.01)
    assert probe.result() is None
    probe._window = lambda: (_ for _ in ()).throw(RuntimeError("CUPTI busy"))
    probe.start()
    with pytest.raises(RuntimeError, match="CUPTI busy"):
        probe.result(timeout=30)


def test_the_profilers_thread_ids_are_native_thread_ids(tmp_path):
    """attribute() names a launch's thread by the trace's tid: on this torch a traced op's tid is the
    native id of the thread that ran it (the CPU ops here; CUPTI's launch records use the same ids)."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    assert {e["tid"] for e in events if e.get("name") == "aten::mm"} == {threading.get_native_id()}
