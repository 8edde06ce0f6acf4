"""Thread helpers the library and trainer tests share. Their timeouts only guard against a hang:
a test that passes never waits them out."""

import threading
import time

import torch


def run_in_thread(fn, *args, timeout=60):
    """Run ``fn`` in a fresh Python thread; return its result or re-raise its exception."""
    box = {}

    def target():
        try:
            box["result"] = fn(*args)
        except BaseException as exc:  # re-raised below in the test thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"{fn.__name__} did not finish in {timeout} s"
    if "error" in box:
        raise box["error"]
    return box.get("result")


def until(condition, timeout: float = 30.0) -> None:
    """Poll ``condition`` until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the condition never held"
        time.sleep(0.001)



class ParkedTrace(torch.nn.Module):
    """A module whose forward, traced by torch.fx, waits until ``release`` is set, so a test can act
    while a trace is open; ``tracing`` is set once the trace is inside."""

    def __init__(self) -> None:
        super().__init__()
        self.tracing, self.release = threading.Event(), threading.Event()

    def forward(self, x):
        self.tracing.set()
        assert self.release.wait(60), "the test never let the trace end"
        return x + 1
