"""The suite's shared set-up.

Caches: every cache the code under test reads or writes (the trainer's ``THREADGRAPH_CACHE`` of
built assets and tokenized data, ``XDG_CACHE_HOME``, Inductor's and Triton's compile caches) lives in
one temporary folder of the session (``isolated_caches``), shared by the session's tests and by the
processes they start, never the user's: nothing a test writes is read back by a later run, and
nothing an earlier run left is found by this one.

Hypothesis: with ``CI`` set (.ci/run sets it), the ``ci`` profile is loaded: examples derandomised
(the same ones on every run, drawn from each test's own seed) and no example database read or
written, so a CI run never fails by chance; elsewhere each run draws new examples.
``--hypothesis-profile ci`` gives a CI run's examples anywhere."""

import os
import signal

import pytest
import torch
from hypothesis import settings
from hypothesis.errors import InvalidArgument

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

try:
    settings.get_profile("ci")  # Hypothesis's own, in releases that load it where they see a CI
except InvalidArgument:
    settings.register_profile("ci", derandomize=True, database=None, deadline=None, print_blob=True)
if os.environ.get("CI"):
    # Loaded here, before the test modules are imported: their @settings inherit the profile's values.
    settings.load_profile("ci")


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu` on a GPU machine)")
    one_gpu = pytest.mark.skip(reason=f"needs 2 CUDA GPUs, this machine has {gpus} (run `pytest -m multi_gpu` on one with 2+)")
    for item in items:
        if item.get_closest_marker("multi_gpu") and gpus < 2:
            item.add_marker(one_gpu)
        elif item.get_closest_marker("gpu") and gpus < 1:
            item.add_marker(no_gpu)


# The variables each naming a cache, and the folder each gets under the session's cache root.
CACHE_VARIABLES = {"THREADGRAPH_CACHE": "threadgraph", "XDG_CACHE_HOME": "xdg",
                   "TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton"}


@pytest.fixture(scope="session", autouse=True)
def isolated_caches(tmp_path_factory):
    """The session's cache root: each of CACHE_VARIABLES points into it for the whole session (a
    test may point one elsewhere with monkeypatch; it comes back here after). Under pytest-xdist the
    workers share one root, so the tiny assets are built once; the builds and caches take file locks
    or write by rename, as they do for concurrent runs."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "caches"
    with pytest.MonkeyPatch.context() as patch:
        for variable, folder in CACHE_VARIABLES.items():
            patch.setenv(variable, str(root / folder))
        yield root


@pytest.fixture
def clean_patches():
    """Every test that installs patches leaves torch exactly as it found it."""
    import threadgraph

    threadgraph.uninstall()
    yield
    threadgraph.uninstall()


@pytest.fixture(scope="session")
def tiny_assets(isolated_caches):
    """The tiny target and data set the trainer and benchmark tests run on, built once a session
    into the session's THREADGRAPH_CACHE (tests only read them), where a benchmark's subprocess that
    asks ``default_assets(spec=BuildSpec.tiny())`` finds the same build."""
    from examples.dflash_trainer.assets.assets import BuildSpec, default_assets

    return default_assets(isolated_caches / CACHE_VARIABLES["THREADGRAPH_CACHE"], spec=BuildSpec.tiny())


@pytest.fixture
def sigint_raises_keyboard_interrupt():
    """Python's own Ctrl-C handler for the test: a shell without job control starts background
    commands (a CI runner's, say) with SIGINT ignored, and Python then installs none."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)
