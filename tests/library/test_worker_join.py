"""``CompiledWorkerThread.join(timeout)`` and ``WorkerGroup.join(timeout)`` behave alike: a worker
still running when the timeout ends is a TimeoutError naming it, never a silent return."""

import threading

import pytest
import torch

from threadgraph import CompiledWorkerThread, WorkerGroup


class Stuck(CompiledWorkerThread):
    """A worker whose first step waits until the test lets it go."""

    def __init__(self, **kw):
        super().__init__("cpu", max_steps=1, **kw)
        self.entered, self.release = threading.Event(), threading.Event()

    def setup(self):
        self.model = torch.nn.Linear(2, 2)

    def step(self):
        self.entered.set()
        assert self.release.wait(60), "the test never let the stuck step go"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("through", ["worker", "group"])
def test_join_with_a_timeout_raises_while_the_worker_is_stuck(through):
    worker = Stuck(name=f"stuck-{through}")
    group = WorkerGroup([worker])
    group.start()
    try:
        assert worker.entered.wait(60), "the worker never reached its step"
        joiner = worker if through == "worker" else group
        with pytest.raises(TimeoutError, match=rf"worker stuck-{through}.* still running after 0\.2 s"):
            joiner.join(timeout=0.2)
        assert worker.is_alive()
    finally:
        worker.release.set()
    (worker if through == "worker" else group).join(timeout=60)  # once let go, the same call returns
    assert not worker.is_alive() and worker.exception is None
