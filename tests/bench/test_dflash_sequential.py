"""dflash_throughput's sequential loop steps the trainer's own step code: on the tiny assets it
trains to the threaded trainer's per-step losses, bit for bit."""

import importlib
import sys
from pathlib import Path

import pytest

from examples.dflash_trainer.assets.assets import BuildSpec, default_assets
from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.drafter.replica import DrafterReplica
from examples.dflash_trainer.target_stage import TargetStage
from examples.dflash_trainer.train import train

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tiny_assets(tmp_path_factory):
    return default_assets(tmp_path_factory.mktemp("assets"), spec=BuildSpec.tiny())


def tiny_config(assets, out_dir):
    # One drafter: the sequential loop does not average gradients, and with one replica the
    # threaded average is the identity. Two targets: batches alternate between the shards.
    return TrainConfig(target=str(assets.target_dir), data=str(assets.train_jsonl), devices="cpu", seq_len=64,
                       block_size=8, num_anchors=4, batch_size=2, num_draft_layers=1, num_target_layers_used=1,
                       targets=2, drafters=1, max_steps=8, eval_every=0, checkpoint_every=0, out_dir=str(out_dir),
                       lr=3e-3)


def test_the_sequential_loop_trains_to_the_threaded_trainers_losses(tiny_assets, tmp_path, monkeypatch):
    threaded = train(tiny_config(tiny_assets, tmp_path / "threaded")).losses

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = importlib.import_module("dflash_throughput")
    calls = {"target": 0, "drafter": 0}
    stage_step, train_step = TargetStage.step, DrafterReplica.train_step

    def counted_stage_step(self, *args, **kwargs):
        calls["target"] += 1
        return stage_step(self, *args, **kwargs)

    def counted_train_step(self, *args, **kwargs):
        calls["drafter"] += 1
        return train_step(self, *args, **kwargs)

    monkeypatch.setattr(TargetStage, "step", counted_stage_step)
    monkeypatch.setattr(DrafterReplica, "train_step", counted_train_step)
    sequential = bench.run_sequential(tiny_config(tiny_assets, tmp_path / "sequential"), warmup_batches=2)

    assert len(threaded) == 8 and threaded[-1] < threaded[0]
    assert sequential["losses"] == threaded
    assert calls == {"target": 8, "drafter": 8}  # every batch through the trainer's step functions
