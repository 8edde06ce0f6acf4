import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    one_gpu = pytest.mark.skip(reason=f"needs 2 CUDA GPUs, this machine has {gpus} (run `pytest -m multi_gpu` on one with 2+)")
    for item in items:
        if item.get_closest_marker("multi_gpu") and gpus < 2:
            item.add_marker(one_gpu)
        elif item.get_closest_marker("gpu") and gpus < 1:
            item.add_marker(no_gpu)


@pytest.fixture
def clean_patches():
    """Every test that installs patches leaves torch exactly as it found it."""
    import threadgraph

    threadgraph.uninstall()
    yield
    threadgraph.uninstall()


def run_in_thread(fn, *args, timeout=60):
    """Run ``fn`` in a fresh Python thread; return its result or re-raise its exception."""
    import threading

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
