"""benchmarks/thread_profile.py: a profiler trace's kernels attributed to the threads that launched
them, on a hand-made Chrome trace (the GPU figures come from the throughput benchmark's runs)."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks import thread_profile


def runtime(tid, name, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "tid": tid, "ts": 0, "dur": 1, "args": {"correlation": correlation}}


def kernel(start, dur, correlation, device=0, cat="kernel", name="k"):
    return {"ph": "X", "cat": cat, "name": name, "ts": start, "dur": dur, "args": {"correlation": correlation, "device": device}}


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
    # busy 0-2000, 3000-3200, 4000-4100, 5000-5300 us of the 0-5300 us the device's work spans
    assert figures["devices"] == {"0": {"busy_ms": 2.6, "span_ms": 5.3, "busy_share": 0.4906}}
    threads = {name: {k: v for k, v in t.items() if k != "top_kernels"} for name, t in figures["threads"].items()}
    assert threads == {
        "drafter-0": {"kernel_ms": 1.3, "busy_ms": 1.3, "busy_share": 0.2453, "launches": 2, "graph_launches": 0},
        "other threads": {"kernel_ms": 0.2, "busy_ms": 0.2, "busy_share": 0.0377, "launches": 1, "graph_launches": 0},
        "target-0": {"kernel_ms": 1.5, "busy_ms": 1.5, "busy_share": 0.283, "launches": 1, "graph_launches": 1},
        "unattributed": {"kernel_ms": 0.1, "busy_ms": 0.1, "busy_share": 0.0189, "launches": 1, "graph_launches": 0},
    }
    assert figures["concurrent_ms"] == pytest.approx(0.5)  # drafter-0's kernel beside target-0's first
    assert figures["window_ms"] == 10.0  # the requested window, recorded only
    # the launch id that matched no thread, beside the ids it was matched against
    assert figures["unknown_launch_tids"] == [999]
    assert figures["named_tids"] == {"101": "target-0", "102": "drafter-0"}


def test_a_window_of_no_device_work_has_no_threads_and_a_zero_span_no_share():
    figures = thread_profile.attribute({"traceEvents": [runtime(1, "cudaLaunchKernel", 1)]}, {}, window_ms=0.0)
    assert figures == {"window_ms": 0.0, "devices": {}, "threads": {}, "concurrent_ms": 0.0,
                       "kernels": {"kernel_ms": 0.0, "names": 0, "top": [], "by_name": {}}}
    instant = thread_profile.attribute({"traceEvents": [kernel(700, 0, 1)]}, {}, window_ms=3.0)
    assert instant["devices"]["0"] == {"busy_ms": 0.0, "span_ms": 0.0, "busy_share": None}
    assert instant["threads"]["unattributed"]["busy_share"] is None


def test_shares_are_over_the_span_of_each_devices_work_not_the_requested_window():
    """The trace holds kernels that ran until the profiler stopped, past the requested window: a
    device busy from its first kernel to its last has a share of 1, not busy / window."""
    trace = {"traceEvents": [
        runtime(101, "cudaLaunchKernel", 1), runtime(102, "cudaLaunchKernel", 2),
        kernel(1000, 2000, 1), kernel(3000, 2000, 2),  # cuda:0, back to back 1000-5000 us
        kernel(0, 500, 2, device=1), kernel(1500, 500, 2, device=1),  # cuda:1, busy 1.0 of its 2.0 ms
    ]}
    figures = thread_profile.attribute(trace, {101: "target-0", 102: "drafter-0"}, window_ms=3.0)
    assert figures["window_ms"] == 3.0
    assert figures["devices"] == {"0": {"busy_ms": 4.0, "span_ms": 4.0, "busy_share": 1.0},
                                  "1": {"busy_ms": 1.0, "span_ms": 2.0, "busy_share": 0.5}}
    # target-0 ran on cuda:0 only; drafter-0 on both: its busy time over both devices' spans
    assert figures["threads"]["target-0"]["busy_share"] == 0.5
    assert figures["threads"]["drafter-0"]["busy_share"] == 0.5  # (2.0 + 1.0) / (4.0 + 2.0)
    assert all(0 < v["busy_share"] <= 1 for v in [*figures["devices"].values(), *figures["threads"].values()])


IDENT_HIGH_BIT = 0x7F3A_C2B4_F6C0  # its low 32 bits have the high bit set: a signed int32 trace writes them negative
IDENT = 0x7F3A_42C7_F6C0


def test_launches_are_attributed_by_the_low_32_bits_of_the_threads_ident():
    """Runtime events' tids are the launching threads' pthread_self() low 32 bits
    (threading.get_ident()), not their native ids (torch 2.15.0 on an H200)."""
    threads = [SimpleNamespace(name="target-0", ident=IDENT_HIGH_BIT, native_id=29313),
               SimpleNamespace(name="drafter-0", ident=IDENT, native_id=29314)]
    names = thread_profile.thread_names(threads)
    assert names == {29313: "target-0", 29314: "drafter-0", 0xC2B4_F6C0: "target-0", 0x42C7_F6C0: "drafter-0"}
    trace = {"traceEvents": [
        runtime(0xC2B4_F6C0 - 2 ** 32, "cudaGraphLaunch", 1),  # as a signed int32
        runtime(0x42C7_F6C0, "cudaLaunchKernel", 2),
        runtime(0xC2B4_F6C0, "cudaLaunchKernel", 3),  # the same thread, unsigned
        runtime(0x1234_F6C0, "cudaLaunchKernel", 4),  # a thread Python does not know
        kernel(0, 100, 1), kernel(100, 100, 2), kernel(200, 100, 3), kernel(300, 100, 4),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "tid": 29313, "ts": 0, "dur": 5},
    ]}
    threads = thread_profile.attribute(trace, names, window_ms=1.0)["threads"]
    assert {name: (t["launches"], t["graph_launches"]) for name, t in threads.items()} == {
        "target-0": (2, 1), "drafter-0": (1, 0), "other threads": (1, 0)}
    # the names map may hold full idents too: ids are compared modulo 2**32
    full = thread_profile.attribute(trace, {IDENT_HIGH_BIT: "target-0", IDENT: "drafter-0"}, window_ms=1.0)
    assert set(full["threads"]) == {"target-0", "drafter-0", "other threads"}


def test_launch_ids_written_negated_name_their_threads():
    """Torch 2.11's traces on an H200 wrote each launch id as minus the int32 of the thread's ident
    bits: target-0's 2506032832 appeared as 1788934464 (dflash-throughput results of 2026-12-04)."""
    threads = [SimpleNamespace(name="target-0", ident=0x7F3A_0000_0000 + 2506032832, native_id=2790),
               SimpleNamespace(name="drafter-0", ident=IDENT, native_id=2795)]
    names = thread_profile.thread_names(threads)
    trace = {"traceEvents": [
        runtime(1788934464, "cudaGraphLaunch", 1),  # 2**32 - 2506032832
        runtime(-0x42C7_F6C0, "cudaLaunchKernel", 2),  # drafter-0's bits, negated
        runtime(0x1234_F6C0, "cudaLaunchKernel", 3),  # a thread Python does not know, either way
        kernel(0, 100, 1), kernel(100, 100, 2), kernel(200, 100, 3),
    ]}
    figures = thread_profile.attribute(trace, names, window_ms=1.0)
    assert {name: t["launches"] for name, t in figures["threads"].items()} == {
        "target-0": 1, "drafter-0": 1, "other threads": 1}
    assert figures["unknown_launch_tids"] == [0x1234_F6C0]


def test_a_launch_id_that_equals_another_threads_native_id_names_the_launching_thread():
    threads = [SimpleNamespace(name="cpu-side", ident=0x7F00_0000_1000, native_id=0x5000),
               SimpleNamespace(name="launcher", ident=0x7F00_0000_5000, native_id=77)]
    assert thread_profile.thread_names(threads)[0x5000] == "launcher"


def test_thread_names_keys_running_threads_by_native_id_and_ident_bits():
    import threading

    started, stop = threading.Event(), threading.Event()
    worker = threading.Thread(target=lambda: (started.set(), stop.wait()), name="profiled-worker")
    worker.start()
    try:
        started.wait()
        names = thread_profile.thread_names()
    finally:
        stop.set()
        worker.join()
    assert names[worker.native_id] == names[worker.ident % 2 ** 32] == "profiled-worker"
    assert names[threading.get_ident() & 0xFFFFFFFF] == threading.current_thread().name


def test_union_counts_overlaps_once():
    assert thread_profile.union_ms([(0, 1000), (500, 1500), (2000, 2500), (2100, 2200)]) == 2.0


def named_trace(extra_launch=False):
    """target-0 launches a graph of gemm, norm, gemm and a copy; drafter-0 an attention kernel and a memset."""
    events = [runtime(101, "cudaGraphLaunch", 1), runtime(102, "cudaLaunchKernel", 2), runtime(102, "cudaMemsetAsync", 3),
              kernel(0, 300, 1, name="gemm"), kernel(300, 50, 1, name="norm"), kernel(350, 500, 1, name="gemm"),
              kernel(850, 20, 1, cat="gpu_memcpy", name="Memcpy DtoD (Device -> Device)"),
              kernel(900, 400, 2, name="attention"), kernel(1300, 10, 3, cat="gpu_memset", name="Memset (Device)")]
    if extra_launch:
        events += [runtime(102, "cudaLaunchKernel", 4), kernel(1400, 30, 4, name="fill")]
    return {"traceEvents": events}


def test_the_window_sums_its_kernels_by_name_overall_and_per_thread():
    figures = thread_profile.attribute(named_trace(), {101: "target-0", 102: "drafter-0"}, window_ms=1.0)
    kernels = figures["kernels"]
    assert kernels["kernel_ms"] == 1.28 and kernels["names"] == 5
    assert kernels["top"] == [
        {"name": "gemm", "ms": 0.8, "count": 2, "mean_us": 400.0},
        {"name": "attention", "ms": 0.4, "count": 1, "mean_us": 400.0},
        {"name": "norm", "ms": 0.05, "count": 1, "mean_us": 50.0},
        {"name": "gpu_memcpy", "ms": 0.02, "count": 1, "mean_us": 20.0},  # copies and memsets by category
        {"name": "gpu_memset", "ms": 0.01, "count": 1, "mean_us": 10.0},
    ]
    assert kernels["by_name"] == {"gemm": [0.8, 2], "attention": [0.4, 1], "norm": [0.05, 1], "gpu_memcpy": [0.02, 1],
                                  "gpu_memset": [0.01, 1]}
    assert [k["name"] for k in figures["threads"]["target-0"]["top_kernels"]] == ["gemm", "norm", "gpu_memcpy"]
    assert [k["name"] for k in figures["threads"]["drafter-0"]["top_kernels"]] == ["attention", "gpu_memset"]


def test_only_the_top_names_are_listed_and_every_name_is_kept_for_comparison():
    trace = {"traceEvents": [runtime(101, "cudaLaunchKernel", i) for i in range(20)]
             + [kernel(i * 100, 20 - i, i, name=f"k{i:02}") for i in range(20)]}
    figures = thread_profile.attribute(trace, {101: "target-0"}, window_ms=1.0)
    assert [k["name"] for k in figures["kernels"]["top"]] == [f"k{i:02}" for i in range(15)]
    assert [k["name"] for k in figures["threads"]["target-0"]["top_kernels"]] == [f"k{i:02}" for i in range(5)]
    assert len(figures["kernels"]["by_name"]) == figures["kernels"]["names"] == 20


class FakeProfiler:
    """What probe_kernels needs of a stopped torch.profiler.profile: its Chrome trace export."""

    def __init__(self, trace):
        self.trace = trace

    def export_chrome_trace(self, path):
        Path(path).write_text(json.dumps(self.trace))


def test_the_sequential_probe_records_the_same_summary_per_batch():
    summary = thread_profile.probe_kernels(FakeProfiler(named_trace()), batches=2)
    assert summary["batches"] == 2 and summary["kernel_ms_per_batch"] == 0.64 and summary["names"] == 5
    assert summary["top"][0] == {"name": "gemm", "ms_per_batch": 0.4, "count_per_batch": 1.0, "mean_us": 400.0}
    assert summary["by_name"]["attention"] == [0.2, 0.5]
    # the same function as the threaded window's: per batch, its figures over the batches
    window = thread_profile.attribute(named_trace(), {}, window_ms=1.0)["kernels"]
    assert {n: [ms / 2, count / 2] for n, (ms, count) in window["by_name"].items()} == summary["by_name"]
    assert thread_profile.probe_kernels(None, batches=5) is None  # the profiler never started
    assert thread_profile.probe_kernels(FakeProfiler(named_trace()), batches=0) is None


def test_a_probe_summary_that_fails_is_recorded_not_raised():
    class Broken:
        def export_chrome_trace(self, path):
            raise RuntimeError("no trace to export")

    assert thread_profile.probe_kernels(Broken(), batches=5) == {"error": "RuntimeError: no trace to export"}


def test_a_profile_that_never_started_has_no_result_and_one_that_failed_raises_its_error():
    probe = thread_profile.ThreadProfile(0.01)
    assert probe.result() is None
    probe._window = lambda: (_ for _ in ()).throw(RuntimeError("CUPTI busy"))
    probe.start()
    with pytest.raises(RuntimeError, match="CUPTI busy"):
        probe.result(timeout=30)


def test_cpu_ops_carry_native_thread_ids():
    """A traced CPU op's tid is the native id of the thread that ran it (thread_names keeps these
    keys); the CUDA runtime's launch records carry ident bits instead, which needs a GPU to see."""
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.mm(torch.ones(8, 8), torch.ones(8, 8))
    events = thread_profile.chrome_trace(prof)["traceEvents"]
    assert {e["tid"] for e in events if e.get("name") == "aten::mm"} == {threading.get_native_id()}
    assert thread_profile.thread_names()[threading.get_native_id()] == threading.current_thread().name


def test_stop_ends_a_window_before_its_seconds(monkeypatch):
    import torch

    class Profiler:  # CUDA activity needs a GPU; the window's timing does not
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.profiler, "profile", Profiler)
    monkeypatch.setattr(thread_profile, "chrome_trace", lambda prof: {"traceEvents": []})
    probe = thread_profile.ThreadProfile(120.0)
    probe.start()
    probe.stop()
    figures = probe.result(timeout=30)  # raises TimeoutError if the window ran its 120 s
    assert probe.started_at is not None and probe.ended_at is not None
    assert figures["window_ms"] < 30_000  # the window's own length, not the 120 s asked for
