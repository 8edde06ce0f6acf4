"""Run one conformance case in each placement, in this process, and say what each observed."""

from __future__ import annotations

import gc
import logging
import threading
import traceback
import warnings
from typing import Any, Callable

import torch

PLACEMENTS = ("main", "main+install", "thread+install", "worker+install")
_SKIP_SIGN = "skipping cudagraphs"


class _SkipMessages(logging.Handler):
    """Inductor's "skipping cudagraphs due to ..." lines, from any thread, as a user sees them."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if _SKIP_SIGN in message:
            # The first line says why; later lines hold file paths and the placement's frames.
            self.lines.append(message.splitlines()[0].strip())


def _observe(case: Callable[[], Any]) -> dict:
    """What a user sees of one run of ``case``: its result or its error, its warnings and skips."""
    handler = _SkipMessages()
    skips_before = _skip_count()
    inductor_log = logging.getLogger("torch._inductor")
    inductor_log.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                observed = {"result": case()}
            except Exception as exc:  # the error is the observation; it is compared, not swallowed
                observed = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                            "traceback": traceback.format_exc()}
    finally:
        inductor_log.removeHandler(handler)
    observed["warnings"] = sorted({f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught
                                   if not _is_threadgraphs(w)})
    observed["skips"] = handler.lines
    observed["skip_count"] = _skip_count() - skips_before
    return observed


def _skip_count() -> int:
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def show_skip_messages() -> None:
    """Turn on Inductor's ``cudagraphs`` log artifact (``TORCH_LOGS=cudagraphs``), where the skip
    messages go, so the placements' handlers see them."""
    torch._logging.set_logs(cudagraphs=True)


def _is_threadgraphs(w: warnings.WarningMessage) -> bool:
    return w.category.__module__.startswith("threadgraph") or str(w.message).startswith("threadgraph")


def _clean_up() -> None:
    # What upstream's tests do after each test, in the thread that owns the trees.
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _in_thread(case: Callable[[], Any]) -> dict:
    box: dict = {}

    def body() -> None:
        try:
            box["observed"] = _observe(case)
        finally:
            _clean_up()

    thread = threading.Thread(target=body, name="conformance-thread")
    thread.start()
    thread.join()
    return box["observed"]


def _in_worker(case: Callable[[], Any]) -> dict:
    import threadgraph

    box: dict = {}

    class CaseWorker(threadgraph.CompiledWorkerThread):
        def setup(self) -> None:
            try:
                box["observed"] = _observe(case)
            finally:
                _clean_up()

        def step(self) -> None:
            self.stop()

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    worker = CaseWorker(device, name="conformance-worker", warmup_steps=0, max_steps=1, daemon=False)
    worker.start()
    worker.join()  # raises the worker's error, if the case machinery itself failed
    return box["observed"]


def run_in(placement: str, case: Callable[[], Any]) -> dict:
    """What ``case`` shows in ``placement`` (one of :data:`PLACEMENTS`), run in this process."""
    import threadgraph

    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}; known: {PLACEMENTS}")
    if placement == "main":
        if threadgraph.installed():
            raise RuntimeError("the 'main' placement runs without threadgraph, but it is installed here")
    else:
        threadgraph.install()
    if placement in ("main", "main+install"):
        try:
            return _observe(case)
        finally:
            _clean_up()
    if placement == "thread+install":
        return _in_thread(case)
    return _in_worker(case)


def differences(observed: dict[str, dict], reference: str = "main") -> list[str]:
    """One line per placement whose observation differs from ``reference``'s, naming what differs."""
    lines = []
    base = observed[reference]
    for placement, seen in observed.items():
        if placement == reference:
            continue
        for key in ("result", "error", "warnings", "skips", "skip_count"):
            if seen.get(key) != base.get(key):
                lines.append(f"{placement}: {key} {seen.get(key)!r} where {reference} has {base.get(key)!r}")
    return lines
