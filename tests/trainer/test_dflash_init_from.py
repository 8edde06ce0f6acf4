"""--init-from: a run starts from a drafter in the z-lab or speculators format, the round trip with
the exporter; a checkpoint of another architecture is refused naming the flag to change."""

import pytest
import torch
from safetensors.torch import load_file

from examples.dflash_trainer.drafter.model import DFlashDrafter
from examples.dflash_trainer.export.export import export
from examples.dflash_trainer.export.init_from import InitFromError, load_into, read_published
from examples.dflash_trainer.pipeline import Pipeline
from examples.dflash_trainer.run.checkpoint import WEIGHTS
from examples.dflash_trainer.train import train

from tests.helpers.export_fixtures import load_heads, make_checkpoint, make_random_target
from tests.helpers.tiny_run import tiny_config

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def trained_zlab(tiny_assets, tmp_path_factory):
    """A tiny run's last checkpoint, exported in the z-lab format: (export dir, the checkpoint's weights)."""
    root = tmp_path_factory.mktemp("init")
    train(tiny_config(tiny_assets, root / "run", max_steps=3))
    out, _ = export(root / "run", "zlab", root / "zlab")
    step_dir = sorted((root / "run" / "checkpoints").glob("step_*"))[-1]
    return out, load_file(str(step_dir / WEIGHTS))


def test_a_run_starts_from_an_exported_zlab_drafter(tiny_assets, tmp_path, trained_zlab):
    out, weights = trained_zlab
    parts = Pipeline.build(tiny_config(tiny_assets, tmp_path, init_from=str(out)))
    assert parts.init_from.format == "zlab"
    state = parts.replica(CPU).drafter.state_dict()
    assert set(state) == set(weights)
    for name, value in weights.items():
        assert torch.equal(state[name], value.float()), name
    fresh = Pipeline.build(tiny_config(tiny_assets, tmp_path / "fresh")).replica(CPU).drafter.state_dict()
    assert any(not torch.equal(fresh[name], state[name]) for name in state)  # not the random init


def test_a_checkpoint_of_another_architecture_is_refused_naming_the_flag(tiny_assets, tmp_path, trained_zlab):
    out, _ = trained_zlab
    with pytest.raises(InitFromError, match=r"num_layers 1, this run's drafter 2.*pass --num-draft-layers 1"):
        Pipeline.build(tiny_config(tiny_assets, tmp_path / "a", init_from=str(out), num_draft_layers=2))
    with pytest.raises(InitFromError, match=r"block size 8, this run uses 16; pass --block-size 8"):
        Pipeline.build(tiny_config(tiny_assets, tmp_path / "b", init_from=str(out), block_size=16))
    with pytest.raises(InitFromError, match=r"config.json is missing"):
        Pipeline.build(tiny_config(tiny_assets, tmp_path / "c", init_from=str(tmp_path)))


def test_a_speculators_export_loads_back_into_the_drafter(tmp_path):
    from transformers import AutoConfig

    target_dir = make_random_target(tmp_path / "target")
    _, drafter = make_checkpoint(tmp_path / "run" / "checkpoints", target_dir, saved_target=str(target_dir), n=3)
    out, _ = export(tmp_path / "run", "speculators", tmp_path / "spec")
    published = read_published(out)
    assert published.format == "speculators" and published.block_size == 8
    target = load_heads(target_dir)
    fresh = DFlashDrafter.from_target_config(AutoConfig.from_pretrained(target_dir), target.embed_tokens,
                                             target.lm_head, num_layers=2, n=3)
    published.check(fresh.arch, [1, 3, 5], 8, published.mask_token_id)
    load_into(fresh, published)
    for name, value in drafter.state_dict().items():
        assert torch.equal(fresh.state_dict()[name], value), name
