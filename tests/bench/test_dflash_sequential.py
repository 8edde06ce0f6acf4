"""dflash_throughput's sequential loop trains what the threads train, with the trainer's own step
code: on the tiny assets, three drafters sharing one device's weights, it trains to the threaded
trainer's per-step losses, bit for bit."""

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
    # Three drafters on one device: their gradients averaged, the shared weights stepped once a
    # round by the first. Two targets: batches alternate between the shards.
    return TrainConfig(target=str(assets.target_dir), data=str(assets.train_jsonl), devices="cpu", seq_len=64,
                       block_size=8, num_anchors=4, batch_size=2, num_draft_layers=1, num_target_layers_used=1,
                       targets=2, drafters=3, max_steps=8, eval_every=0, checkpoint_every=0, out_dir=str(out_dir),
                       lr=3e-3)


def test_the_sequential_loop_trains_to_the_threaded_trainers_losses(tiny_assets, tmp_path, monkeypatch):
    threaded = train(tiny_config(tiny_assets, tmp_path / "threaded")).losses

    sys.path.insert(0, str(ROOT / "benchmarks"))
    bench = importlib.import_module("dflash_sequential")
    calls = {"target": 0, "drafter": 0, "update": 0}
    stage_step, forward_backward, update = TargetStage.step, DrafterReplica.forward_backward, DrafterReplica.update

    def counted_stage_step(self, *args, **kwargs):
        calls["target"] += 1
        return stage_step(self, *args, **kwargs)

    def counted_forward_backward(self, *args, **kwargs):
        calls["drafter"] += 1
        return forward_backward(self, *args, **kwargs)

    def counted_update(self, *args, **kwargs):
        calls["update"] += 1
        return update(self, *args, **kwargs)

    monkeypatch.setattr(TargetStage, "step", counted_stage_step)
    monkeypatch.setattr(DrafterReplica, "forward_backward", counted_forward_backward)
    monkeypatch.setattr(DrafterReplica, "update", counted_update)
    sequential = bench.run_sequential(tiny_config(tiny_assets, tmp_path / "sequential"), warmup_batches=6)

    assert len(threaded) == 8 and threaded[-1] < threaded[0]
    assert sequential["losses"] == threaded
    # every batch through the trainer's step functions; every replica counts each of the 8 steps
    assert calls == {"target": 24, "drafter": 24, "update": 24}


def test_the_gpu_bound_limit_takes_the_busiest_device_of_a_round_over_the_rounds_batches():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    report = importlib.import_module("dflash_report")
    cfg = TrainConfig(batch_size=4, seq_len=256)
    # drafters on cuda:0, cuda:1, cuda:0: a round is 3 batches; cuda:0 is busy 20 ms of it, cuda:1 12 ms
    sequential = {"tokens_per_s": 1.0, "gpu_ms_per_round_by_device": {"0": 20.0, "1": 12.0}, "batches_per_round": 3,
                  "devices": ["cuda:0", "cuda:1"], "training": "as threaded"}
    figures = report.headline(cfg, {"tokens_per_s": 1.0}, sequential, on_gpu=True)
    assert figures["gpu_ms_per_batch"] == pytest.approx(20.0 / 3)
    assert figures["gpu_bound_tokens_per_s"] == pytest.approx(3 * 1024 / 0.020)  # 3 batches in the busiest 20 ms
    # files of the earlier loop: each device's time for its one batch a round, times the devices
    older = {"tokens_per_s": 1.0, "gpu_ms_per_batch_by_device": {"0": 10.0, "1": 8.0}, "devices": ["cuda:0", "cuda:1"]}
    figures = report.headline(cfg, {"tokens_per_s": 1.0}, older, on_gpu=True)
    assert figures["gpu_bound_tokens_per_s"] == pytest.approx(2 * 1024 / 0.010)
