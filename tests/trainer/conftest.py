import pytest


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """The tiny target and data set the trainer tests run on, built once (tests only read them)."""
    from examples.dflash_trainer.assets.assets import BuildSpec, default_assets

    return default_assets(tmp_path_factory.mktemp("assets"), spec=BuildSpec.tiny())
