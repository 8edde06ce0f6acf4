"""Which host thread's GPU work fills the device: a window of a running process under torch.profiler
(CUDA activity: kernels, copies and the CUDA runtime calls that launched them), each kernel
attributed to the thread whose runtime call (``cudaLaunchKernel``, ``cudaGraphLaunch``, ...) has
its correlation id (``cuda_runtime`` and ``cuda_driver`` events: Triton's kernels go through the
driver's ``cuLaunchKernel``).

    probe = ThreadProfile(seconds=3.0)
    probe.start()            # from any thread: the profile runs in a helper thread of its own
    ...                      # the workers go on
    figures = probe.result() # waits for the window to end; None without a GPU

``attribute`` turns a Chrome trace (what ``torch.profiler`` exports) into per-device busy time
(the union of its kernels' intervals) and per-thread figures: kernel time, busy time (the union
of that thread's kernels), their share of the window, launches and graph launches. Threads are
named from ``threading.enumerate()`` by native id; kernels launched by threads Python does not
know (autograd's device threads) count under ``other threads``, and kernels whose launch the
trace lacks under ``unattributed``. ``concurrent_ms`` is how much the threads' busy times overlap
on a device: kernels of two threads running at once (positive), where per-thread busy times sum to
more than the device's.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
OTHER, UNATTRIBUTED = "other threads", "unattributed"


def union_ms(spans: list) -> float:
    """Total length of the union of (start_us, end_us) spans, in ms."""
    total, end = 0.0, None
    for a, b in sorted(spans):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total / 1000


def attribute(trace: dict, names: dict, window_ms: float) -> dict:
    """Per-device and per-thread GPU time of a Chrome trace; ``names`` maps native thread ids to names."""
    events = trace.get("traceEvents", [])
    launcher = {}  # correlation id -> (thread id, runtime call name)
    for e in events:
        if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {}):
            launcher[e["args"]["correlation"]] = (e.get("tid"), e.get("name", ""))
    by_device: dict = {}
    by_thread: dict = {}
    for e in events:
        if e.get("cat") not in DEVICE_WORK or "dur" not in e:
            continue
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        device = str(e.get("args", {}).get("device", "?"))
        by_device.setdefault(device, []).append(span)
        correlation = e.get("args", {}).get("correlation")
        tid, call = launcher.get(correlation, (None, ""))
        name = UNATTRIBUTED if tid is None else names.get(_int(tid), OTHER)
        entry = by_thread.setdefault(name, {"spans": {}, "kernel_us": 0.0, "launches": set(), "graph_launches": set()})
        entry["spans"].setdefault(device, []).append(span)
        entry["kernel_us"] += span[1] - span[0]
        entry["launches"].add(correlation)
        if call.startswith(GRAPH_LAUNCHES):
            entry["graph_launches"].add(correlation)
    devices = {d: {"busy_ms": round(union_ms(s), 3), "busy_share": _share(union_ms(s), window_ms)} for d, s in sorted(by_device.items())}
    threads = {}
    for name, entry in sorted(by_thread.items()):
        busy = sum(union_ms(s) for s in entry["spans"].values())
        threads[name] = {"kernel_ms": round(entry["kernel_us"] / 1000, 3), "busy_ms": round(busy, 3),
                         "busy_share": _share(busy, window_ms), "launches": len(entry["launches"]),
                         "graph_launches": len(entry["graph_launches"])}
    concurrent = sum(t["busy_ms"] for t in threads.values()) - sum(d["busy_ms"] for d in devices.values())
    return {"window_ms": round(window_ms, 3), "devices": devices, "threads": threads, "concurrent_ms": round(concurrent, 3)}


def _int(tid) -> Optional[int]:
    try:
        return int(tid)
    except (TypeError, ValueError):
        return None


def _share(ms: float, window_ms: float) -> Optional[float]:
    return round(ms / window_ms, 4) if window_ms > 0 else None


class ThreadProfile:
    """One profiled window of ``seconds``, taken in a helper thread (see the module's doc)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._figures: Optional[dict] = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        # time.perf_counter() when the profile began to cost the workers, and when it stopped
        self.started_at = self.ended_at = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="thread-profile", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:
            self._figures = self._window()
        except BaseException as exc:  # reported by result(), to whoever waits
            self._error = exc

    def _window(self) -> Optional[dict]:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if not torch.cuda.is_available():
            return None
        self.started_at = time.perf_counter()  # the profiler's own setup counts as the window's
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
        started = time.perf_counter()
        time.sleep(self.seconds)
        names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
        window_ms = (time.perf_counter() - started) * 1000
        prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as folder:
            path = Path(folder) / "trace.json"
            prof.export_chrome_trace(str(path))
            trace = json.loads(path.read_text())
        figures = attribute(trace, names, window_ms)
        self.ended_at = time.perf_counter()  # and so do the export and the attribution, which hold the GIL
        return figures

    def result(self, timeout: float = 600.0) -> Optional[dict]:
        """The window's figures (None without a GPU, or if it never started); raises what it raised."""
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the profiled window of {self.seconds} s did not end within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._figures

