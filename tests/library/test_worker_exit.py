"""Hazard stash-released-at-thread-exit: a joined worker's C++ thread-local destructor runs after
join() returns; join() waits for the OS thread, release_cudagraph_tls() empties the stash, and a
process that exits right after joining its workers exits cleanly."""

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import threadgraph
from threadgraph import CompiledWorkerThread, WorkerGroup


class _EndTogether(CompiledWorkerThread):
    """Workers whose threads all end at one moment (the race is widest then)."""

    def __init__(self, barrier, **kw):
        super().__init__("cpu", max_steps=2, **kw)
        self.barrier = barrier

    def step(self):
        torch.ones(4).add_(1)

    def teardown(self):
        self.barrier.wait()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")
def test_join_returns_after_the_os_threads_are_gone():
    for _ in range(20):  # without the wait, about one round in four found a thread still there
        barrier = threading.Barrier(8)
        workers = [_EndTogether(barrier, name=f"w{i}") for i in range(8)]
        WorkerGroup(workers).start().join()
        assert not [w.name for w in workers if os.path.exists(f"/proc/self/task/{w.native_id}")]
    alone = _EndTogether(threading.Barrier(1))
    alone.start()
    alone.join()
    assert not os.path.exists(f"/proc/self/task/{alone.native_id}")


@pytest.mark.skipif(not threadgraph._compat.has_remove_obj_from_tls(), reason="this torch cannot remove stash entries")
def test_release_cudagraph_tls_empties_the_threads_stash():
    from threadgraph._device import tls as _tls

    seen = {}

    def thread():
        threadgraph.ensure_cudagraph_tls()
        _tls.worker_for_current_thread()
        seen["before"] = [torch._C._is_key_in_tls(k) for k in (_tls.WORKER_KEY, *_tls.TREE_TLS_KEYS)]
        threadgraph.release_cudagraph_tls()
        seen["after"] = [torch._C._is_key_in_tls(k) for k in (_tls.WORKER_KEY, *_tls.TREE_TLS_KEYS)]

    t = threading.Thread(target=thread)
    t.start()
    t.join()
    assert seen == {"before": [True, True, True], "after": [False, False, False]}


def test_the_process_exits_cleanly_right_after_join(tmp_path):
    # Before the fix, 32 workers ending together and an immediate exit aborted about one run in
    # three: "terminate called without an active exception" (rc 134).
    script = tmp_path / "exit_after_join.py"
    script.write_text(
        "import threading, threadgraph, torch\n"
        "barrier = threading.Barrier(32)\n"
        "class W(threadgraph.CompiledWorkerThread):\n"
        "    def step(self):\n"
        "        torch.ones(4).add_(1)\n"
        "    def teardown(self):\n"
        "        barrier.wait()\n"
        "threadgraph.WorkerGroup([W('cpu', max_steps=2, name=f'w{i}') for i in range(32)]).start().join()\n"
    )
    src = str(Path(__file__).resolve().parents[2] / "src")
    env = dict(os.environ, PYTHONPATH=src)
    for _ in range(3):
        procs = [subprocess.Popen([sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
        for proc in procs:
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
