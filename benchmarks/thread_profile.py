"""Which host thread's GPU work fills the device: a window of a running process under torch.profiler
(CUDA activity: kernels, copies and the CUDA runtime calls that launched them), each kernel
attributed to the thread whose runtime call (``cudaLaunchKernel``, ``cudaGraphLaunch``, ...) has
its correlation id (``cuda_runtime`` and ``cuda_driver`` events: Triton's kernels go through the
driver's ``cuLaunchKernel``).

    probe = ThreadProfile(seconds=3.0)
    probe.start()            # from any thread: the profile runs in a helper thread of its own
    ...                      # the workers go on
    probe.stop()             # optional: ends the window before its seconds are up
    figures = probe.result() # waits for the window to end, then exports and attributes its trace
                             # in the calling thread (after the measured work); None without a GPU

``attribute`` turns a Chrome trace (what ``torch.profiler`` exports) into per-device busy time
(the union of its kernels' intervals) and per-thread figures: kernel time, busy time (the union
of that thread's kernels), launches and graph launches. A share is busy time over the span the
trace's device work covers on that device (its first kernel's start to its last kernel's end),
not over the window: the trace holds every kernel that ran until the profiler stopped, so the
window (``window_ms``, its start to its stop, kept for information) is shorter than what it measures.

Thread ids: a launch event's ``tid`` is Kineto's id of the launching thread, made of the low 32
bits of its ``pthread_self()``, which is what CPython's ``threading.get_ident()`` returns on Linux;
CPU ops carry the native id (``threading.get_native_id()``). ``thread_names`` keys each thread
Python knows by both, and ids are compared modulo 2**32, as an exporter may write them as signed
int32. Torch 2.11's traces (on an H200) wrote every launch id negated, as the signed int32 with its
sign flipped (target-0's ident bits 2506032832 as 1788934464 = 2**32 - 2506032832): a launch id that
names no thread is tried negated before it counts as unknown. Kernels launched by threads Python
does not know count under ``other threads`` (a thread Python met only through a callback, such as
autograd's device thread running a compiled backward, has a ``Dummy-N`` name), and kernels whose
launch the trace lacks under ``unattributed``; where some launches match no thread,
``unknown_launch_tids`` and ``named_tids`` keep the ids on both sides.
``concurrent_ms`` is how much the threads' busy times overlap on a device: kernels of two threads
running at once (positive), where per-thread busy times sum to more than the device's.

``kernels`` sums the device work by kernel name (copies and memsets by their category): where
the time goes, overall (``TOP_KERNELS`` names) and per thread (``TOP_PER_THREAD``). The
sequential loop's GPU probe records the same summary per batch (``probe_kernels``), so the
results file can set a threaded window's kernels beside one batch's.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable, Optional

DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCHES = ("cuda_runtime", "cuda_driver")
GRAPH_LAUNCHES = ("cudaGraphLaunch", "cuGraphLaunch")
OTHER, UNATTRIBUTED = "other threads", "unattributed"
TOP_KERNELS, TOP_PER_THREAD = 15, 5
MAX_IDS = 16  # unknown launch thread ids kept (with the known ones) when some launches match no thread
TID_BITS = 2 ** 32  # Kineto's thread ids are 32-bit; a trace may hold them signed or unsigned


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


def thread_names(threads: Optional[Iterable] = None) -> dict:
    """Trace thread id -> name for ``threads`` (default: ``threading.enumerate()``): each by its
    native id (CPU ops' tid) and by its ident's low 32 bits (launch events' tid). Where one
    thread's native id equals another's ident bits, the ident wins: only launches are attributed."""
    threads = list(threading.enumerate() if threads is None else threads)
    names = {t.native_id: t.name for t in threads if t.native_id is not None}
    names.update({t.ident % TID_BITS: t.name for t in threads if t.ident is not None})
    return names


def attribute(trace: dict, names: dict, window_ms: float) -> dict:
    """Per-device and per-thread GPU time of a Chrome trace, and its kernels by name; ``names`` maps
    trace thread ids (``thread_names``) to names; ``window_ms``, the window's length, is only recorded."""
    names = {_tid(k): v for k, v in names.items()}
    events = trace.get("traceEvents", [])
    launcher = {}  # correlation id -> (thread id, runtime call name)
    for e in events:
        if e.get("cat") in LAUNCHES and "correlation" in e.get("args", {}):
            launcher[e["args"]["correlation"]] = (e.get("tid"), e.get("name", ""))
    by_device: dict = {}
    by_thread: dict = {}
    work = []  # (kernel name, duration us) of every device event
    unknown: set = set()  # launch thread ids that no known thread has
    for e in device_work(events):
        span = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        device = str(e.get("args", {}).get("device", "?"))
        by_device.setdefault(device, []).append(span)
        correlation = e.get("args", {}).get("correlation")
        tid, call = launcher.get(correlation, (None, ""))
        name = UNATTRIBUTED if tid is None else names.get(_tid(tid)) or names.get(_negated(tid), OTHER)
        if name == OTHER:
            unknown.add(tid)
        entry = by_thread.setdefault(name, {"spans": {}, "work": [], "launches": set(), "graph_launches": set()})
        entry["spans"].setdefault(device, []).append(span)
        item = (work_name(e), span[1] - span[0])
        entry["work"].append(item)
        work.append(item)
        entry["launches"].add(correlation)
        if call.startswith(GRAPH_LAUNCHES):
            entry["graph_launches"].add(correlation)
    # each device's span: the time its kernels cover, from the first one's start to the last one's end
    spans = {d: (max(b for _, b in s) - min(a for a, _ in s)) / 1000 for d, s in by_device.items()}
    busy_ms = {d: union_ms(s) for d, s in by_device.items()}
    devices = {d: {"busy_ms": round(busy_ms[d], 3), "span_ms": round(spans[d], 3), "busy_share": _share(busy_ms[d], spans[d])}
               for d in sorted(by_device)}
    threads = {}
    for name, entry in sorted(by_thread.items()):
        busy = sum(union_ms(s) for s in entry["spans"].values())
        threads[name] = {"kernel_ms": round(sum(us for _, us in entry["work"]) / 1000, 3), "busy_ms": round(busy, 3),
                         # over the spans of the devices it ran on: each device's part is at most its span
                         "busy_share": _share(busy, sum(spans[d] for d in entry["spans"])),
                         "launches": len(entry["launches"]), "graph_launches": len(entry["graph_launches"]),
                         "top_kernels": _ranked(_totals(entry["work"]), TOP_PER_THREAD)}
    concurrent = sum(t["busy_ms"] for t in threads.values()) - sum(d["busy_ms"] for d in devices.values())
    figures = {"window_ms": round(window_ms, 3), "devices": devices, "threads": threads, "concurrent_ms": round(concurrent, 3),
               "kernels": kernel_summary(work)}
    if unknown:  # which ids the trace used and which it was matched against: what a fix for another release needs
        figures["unknown_launch_tids"] = sorted(unknown, key=str)[:MAX_IDS]
        figures["named_tids"] = {str(tid): name for tid, name in sorted(names.items(), key=lambda kv: str(kv[0]))[:2 * MAX_IDS]}
    return figures


def device_work(events: list) -> list:
    """The trace's device events: kernels, copies and memsets with a duration."""
    return [e for e in events if e.get("cat") in DEVICE_WORK and "dur" in e]


def work_name(event: dict) -> str:
    """A kernel by its name; copies and memsets by their category (their names say direction and memory kind)."""
    return event.get("name", "?") if event["cat"] == "kernel" else event["cat"]


def kernel_summary(work: list, batches: int = 0) -> dict:
    """(name, duration us) pairs by name: total ms, count and mean us of each, the ``TOP_KERNELS``
    names by total ms, and ``by_name`` (every name: [ms, count]) for comparisons. With ``batches``,
    the totals and counts are per batch (``*_per_batch`` keys); a mean is a mean either way."""
    totals = _totals(work)
    per = batches or 1
    suffix = "_per_batch" if batches else ""
    return {f"kernel_ms{suffix}": round(sum(us for us, _ in totals.values()) / 1000 / per, 4), "names": len(totals),
            **({"batches": batches} if batches else {}),
            "top": _ranked(totals, TOP_KERNELS, batches),
            "by_name": {name: [round(us / 1000 / per, 5), round(n / per, 3)] for name, (us, n) in _order(totals)}}


def _totals(work: list) -> dict:
    totals: dict = {}
    for name, us in work:
        entry = totals.setdefault(name, [0.0, 0])
        entry[0] += us
        entry[1] += 1
    return totals


def _order(totals: dict) -> list:
    return sorted(totals.items(), key=lambda item: (-item[1][0], item[0]))


def _ranked(totals: dict, top: int, batches: int = 0) -> list:
    per = batches or 1
    suffix = "_per_batch" if batches else ""
    return [{"name": name, f"ms{suffix}": round(us / 1000 / per, 4), f"count{suffix}": round(n / per, 3),
             "mean_us": round(us / n, 2)} for name, (us, n) in _order(totals)[:top]]


def chrome_trace(prof) -> dict:
    """A stopped ``torch.profiler.profile``'s Chrome trace, as exported (what ``attribute`` reads)."""
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        return json.loads(path.read_text())


def probe_kernels(prof, batches: int) -> Optional[dict]:
    """``kernel_summary`` per batch of a stopped profiler that saw ``batches`` batches (the sequential
    loop's GPU probe); None without one; a failure is recorded, not raised: it costs this summary only."""
    if prof is None or batches <= 0:
        return None
    try:
        events = device_work(chrome_trace(prof).get("traceEvents", []))
        return kernel_summary([(work_name(e), float(e["dur"])) for e in events], batches)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def _tid(tid) -> Optional[int]:
    try:
        return int(tid) % TID_BITS
    except (TypeError, ValueError):
        return None


def _negated(tid) -> Optional[int]:
    """A launch id written with its sign flipped (torch 2.11), back to the thread's ident bits."""
    try:
        return -int(tid) % TID_BITS
    except (TypeError, ValueError):
        return None


def _share(ms: float, span_ms: float) -> Optional[float]:
    return round(ms / span_ms, 4) if span_ms > 0 else None


class ThreadProfile:
    """One profiled window of at most ``seconds``, taken in a helper thread (see the module's doc)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._stop = threading.Event()
        self._figures: Optional[dict] = None
        self._taken: Optional[tuple] = None  # (profiler, thread names, window ms) until result() attributes it
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        # time.perf_counter() when the profile began to cost the workers, and when it stopped
        self.started_at = self.ended_at = None

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="thread-profile", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """End the window now (or, if it has not begun, as soon as it begins)."""
        self._stop.set()

    def _run(self) -> None:
        try:
            self._taken = self._window()
        except BaseException as exc:  # reported by result(), to whoever waits
            self._error = exc

    def _window(self) -> Optional[tuple]:
        import torch
        from torch.profiler import ProfilerActivity, profile

        if not torch.cuda.is_available():
            return None
        self.started_at = time.perf_counter()  # the profiler's own setup counts as the window's
        prof = profile(activities=[ProfilerActivity.CUDA])
        prof.__enter__()
        names = thread_names()
        began = time.perf_counter()
        self._stop.wait(self.seconds)
        names.update(thread_names())  # a thread started inside the window too; an ident reused since, by its latest
        window_ms = (time.perf_counter() - began) * 1000
        prof.__exit__(None, None, None)
        self.ended_at = time.perf_counter()  # and so does stopping the profiler
        return prof, names, window_ms

    def result(self, timeout: float = 600.0) -> Optional[dict]:
        """The window's figures (None without a GPU, or if it never started); raises what it raised."""
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the profiled window of {self.seconds} s did not end within {timeout} s")
        if self._error is not None:
            raise self._error
        if self._figures is None and self._taken is not None:
            # here, in the caller's thread: the export and the attribution hold the GIL for a while
            prof, names, window_ms = self._taken
            self._figures, self._taken = attribute(chrome_trace(prof), names, window_ms), None
        return self._figures

    def outcome(self) -> Optional[dict]:
        """``result()``, with a failure recorded as ``{"error": ...}``: a profiler that failed costs
        the profile, not the measured run."""
        try:
            return self.result()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
