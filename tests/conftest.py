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


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The tiny target and data set the trainer tests run on, built once (tests only read them)."""
    from examples.dflash_trainer.assets.assets import BuildSpec, default_assets

    return default_assets(tmp_path_factory.mktemp("assets"), spec=BuildSpec.tiny())
