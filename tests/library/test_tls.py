import gc
import threading

import torch

import threadgraph
from threadgraph import _compat
from threadgraph._device import tls as _tls

from tests.helpers.threads import run_in_thread

trees = _compat.cudagraph_trees()


def _tls_objects():
    return tuple(torch._C._get_obj_in_tls(k) for k in _tls.TREE_TLS_KEYS)


def test_fresh_thread_gets_its_own_state_once():
    def body():
        missing_before = not torch._C._is_key_in_tls("tree_manager_containers")
        first = threadgraph.ensure_cudagraph_tls()
        second = threadgraph.ensure_cudagraph_tls()
        containers, locks = _tls_objects()
        return missing_before, first, second, containers, locks, trees.local.tree_manager_containers

    missing, first, second, containers, locks, local_containers = run_in_thread(body)
    assert first is True and second is False
    assert isinstance(containers, dict) and containers is local_containers
    assert isinstance(locks[0], type(threading.Lock()))
    # on torch 2.13+ a thread only has TLS after something asked for it; on <=2.12 it never has it
    assert missing


def test_each_thread_has_distinct_objects_and_the_main_thread_is_untouched():
    main_before = _tls_objects() if torch._C._is_key_in_tls("tree_manager_containers") else None
    a = run_in_thread(lambda: (threadgraph.ensure_cudagraph_tls(), _tls_objects())[1])
    b = run_in_thread(lambda: (threadgraph.ensure_cudagraph_tls(), _tls_objects())[1])
    assert a[0] is not b[0] and a[1] is not b[1]
    if main_before is not None:
        assert _tls_objects()[0] is main_before[0]


def test_stashed_objects_survive_dropping_every_python_reference():
    # Hazard 4: on torch 2.11 the stash stole a reference; reading back returned freed memory.
    def body():
        threadgraph.ensure_cudagraph_tls()
        containers = torch._C._get_obj_in_tls("tree_manager_containers")
        containers["marker"] = "still here"
        del containers
        del trees.local.tree_manager_containers  # the only Python-side owner
        gc.collect()
        for _ in range(1000):  # churn the allocator so a freed dict would be reused
            [{} for _ in range(10)]
        return torch._C._get_obj_in_tls("tree_manager_containers").get("marker")

    assert run_in_thread(body) == "still here"


def test_stash_reference_probe_matches_refcount_behaviour():
    import sys

    def body():
        obj = object()
        before = sys.getrefcount(obj)
        _compat.stash("threadgraph.test_probe", obj)
        after = sys.getrefcount(obj)
        return after - before

    # our stash always leaves exactly one extra reference owned by the stash
    assert run_in_thread(body) == 1


def test_worker_state_is_read_from_torchs_stash_not_a_python_local():
    # Autograd copies the stash (ThreadLocalState) into its device threads; a threading.local does
    # not travel. Simulate the device thread by copying the stash entry as autograd does.
    def owner():
        state = _tls.WorkerState("owner")
        _tls.bind_worker(state)
        return torch._C._get_obj_in_tls(_tls.WORKER_KEY), _tls.current_worker()

    stashed, current = run_in_thread(owner)
    assert stashed is current and stashed.name == "owner"

    def device_thread():
        assert _tls.current_worker() is None
        _compat.stash(_tls.WORKER_KEY, stashed)  # what ThreadLocalState propagation does
        return _tls.current_worker()

    assert run_in_thread(device_thread) is stashed


def test_worker_for_current_thread_is_created_once_per_python_thread():
    def body():
        first = _tls.worker_for_current_thread()
        return first, _tls.worker_for_current_thread(), threading.current_thread().name

    a1, a2, name = run_in_thread(body)
    b1, _, _ = run_in_thread(body)
    assert a1 is a2 and a1 is not b1 and a1.name == name


def test_foreign_threads_get_no_worker_of_their_own():
    import _thread

    done = threading.Event()
    box = {}

    def foreign():
        box["state"] = _tls.worker_for_current_thread()
        done.set()

    _thread.start_new_thread(foreign, ())
    assert done.wait(30)
    assert box["state"] is None


def test_exit_waits_for_the_os_threads_of_finished_threads_that_stashed(clean_patches):
    # Their C++ thread-local destructor releases the stash after join() returns; exit must not
    # finalise the interpreter before it has run (hazard stash-released-at-thread-exit).
    import os
    import sys

    thread = threading.Thread(target=threadgraph.ensure_cudagraph_tls)
    thread.start()
    thread.join()
    assert _tls.wait_for_finished_stashing_threads(timeout=10) == []
    if sys.platform.startswith("linux"):
        assert not os.path.exists(f"/proc/self/task/{thread.native_id}")


def test_exit_does_not_wait_for_a_running_thread_that_an_interrupted_join_reports_stopped(monkeypatch):
    """A Ctrl-C inside Thread.join() leaves CPython's thread reporting is_alive() False while it
    runs on (a worker left running after a second Ctrl-C): the exit must not wait 5 s for it."""
    release = threading.Event()

    def body():
        threadgraph.ensure_cudagraph_tls()
        release.wait()

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    try:
        monkeypatch.setattr(thread, "is_alive", lambda: False)  # what the interrupted join leaves
        assert _tls.wait_for_finished_stashing_threads(timeout=3) == []
    finally:
        release.set()
        thread.join()


def test_plain_threads_that_ran_compiled_code_under_install_then_exit_end_the_process_cleanly():
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = (
        "import threading, torch, threadgraph\n"
        "threadgraph.install()\n"
        "def body():\n"
        "    f = torch.compile(lambda x: x * 2, backend='eager')\n"
        "    f(torch.ones(2))\n"
        "threads = [threading.Thread(target=body) for _ in range(4)]\n"
        "[t.start() for t in threads]\n[t.join() for t in threads]\n"
    )
    root = Path(__file__).resolve().parents[2]
    for _ in range(3):
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(root / "src")})
        assert proc.returncode == 0 and "terminate called" not in proc.stderr, proc.stderr[-2000:]
