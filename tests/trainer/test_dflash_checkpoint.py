"""Checkpoint round trip, corrupt files, and the config that travels inside checkpoints."""

import random

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from examples.dflash_trainer.run.checkpoint import (CheckpointError, latest_checkpoint,
                                                load_checkpoint, save_checkpoint)
from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.drafter.model import DFlashDrafter

VOCAB, HIDDEN = 50, 32


@pytest.fixture(scope="module")
def frozen():
    torch.manual_seed(0)
    return nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB, bias=False)


def _setup(frozen, seed):
    torch.manual_seed(seed)
    drafter = DFlashDrafter(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8,
                            intermediate_size=64, num_layers=1, num_feature_layers=2,
                            rms_norm_eps=1e-6, rope_theta=10000.0, embed_tokens=frozen[0],
                            lm_head=frozen[1])
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return drafter, opt, sched


def _train_step(drafter, opt, sched):
    ids = torch.randint(0, VOCAB, (2, 4))
    logits = drafter(ids, torch.randn(2, 6, 2 * HIDDEN), torch.arange(6, 10).expand(2, 4),
                     torch.arange(6).expand(2, 6))
    logits.float().logsumexp(-1).mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def test_round_trip_restores_everything(tmp_path, frozen):
    drafter, opt, sched = _setup(frozen, 0)
    for _ in range(3):
        _train_step(drafter, opt, sched)
    cfg = TrainConfig(max_steps=10)
    save_checkpoint(tmp_path, 3, drafter, opt, sched, {"config": cfg.to_dict()})
    after_save = (torch.rand(3), random.random())

    fresh, fresh_opt, fresh_sched = _setup(frozen, 1)
    step, extra = load_checkpoint(tmp_path, fresh, fresh_opt, fresh_sched)
    assert step == 3
    assert TrainConfig.from_dict(extra["config"]) == cfg
    for (name, a), b in zip(drafter.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name  # bit-identical
    saved, loaded = opt.state_dict(), fresh_opt.state_dict()
    for key in saved["state"]:
        for field in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(saved["state"][key][field], loaded["state"][key][field])
    assert fresh_sched.last_epoch == sched.last_epoch == 3
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    assert torch.equal(torch.rand(3), after_save[0])  # RNG states restored
    assert random.random() == after_save[1]

    # Both continue identically from here.
    torch.manual_seed(7)
    _train_step(drafter, opt, sched)
    torch.manual_seed(7)
    _train_step(fresh, fresh_opt, fresh_sched)
    for a, b in zip(drafter.parameters(), fresh.parameters()):
        assert torch.equal(a, b)


def test_weights_file_holds_only_drafter_weights(tmp_path, frozen):
    drafter, opt, sched = _setup(frozen, 0)
    path = save_checkpoint(tmp_path, 1, drafter, opt, sched)
    keys = set(load_file(str(path / "model.safetensors")))
    assert keys == set(drafter.state_dict()) and not any("embed" in k for k in keys)


def test_latest_points_at_newest(tmp_path, frozen):
    drafter, opt, sched = _setup(frozen, 0)
    assert latest_checkpoint(tmp_path) is None
    save_checkpoint(tmp_path, 1, drafter, opt, sched)
    newest = save_checkpoint(tmp_path, 2, drafter, opt, sched)
    assert latest_checkpoint(tmp_path) == newest
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())  # no temp leftovers
    assert load_checkpoint(newest, drafter)[0] == 2  # a step directory also loads


def test_corrupt_weights_name_the_file(tmp_path, frozen):
    drafter, opt, sched = _setup(frozen, 0)
    path = save_checkpoint(tmp_path, 1, drafter, opt, sched)
    (path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="model.safetensors is corrupt"):
        load_checkpoint(tmp_path, drafter, opt, sched)


def test_missing_state_names_the_file(tmp_path, frozen):
    drafter, opt, sched = _setup(frozen, 0)
    path = save_checkpoint(tmp_path, 1, drafter, opt, sched)
    (path / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="state.pt is missing"):
        load_checkpoint(tmp_path, drafter, opt, sched)


def test_no_checkpoint_is_a_clear_error(tmp_path, frozen):
    with pytest.raises(CheckpointError, match="start without resume"):
        load_checkpoint(tmp_path, _setup(frozen, 0)[0])


def test_other_architecture_is_a_clear_error(tmp_path, frozen):
    drafter, opt, sched = _setup(frozen, 0)
    save_checkpoint(tmp_path, 1, drafter, opt, sched)
    other = DFlashDrafter(hidden_size=HIDDEN, num_heads=4, num_kv_heads=2, head_dim=8,
                          intermediate_size=64, num_layers=2, num_feature_layers=2,
                          rms_norm_eps=1e-6, rope_theta=10000.0, embed_tokens=frozen[0],
                          lm_head=frozen[1])
    with pytest.raises(CheckpointError, match="does not fit this drafter"):
        load_checkpoint(tmp_path, other)


# ---- config ---------------------------------------------------------------------------------

def test_config_defaults_and_derived_values():
    cfg = TrainConfig()
    assert cfg.gamma_value == 4.0 and cfg.num_feature_layers == cfg.num_draft_layers
    assert TrainConfig(block_size=16).gamma_value == 7.0
    assert TrainConfig(block_size=10).gamma_value == 5.0
    assert TrainConfig(block_size=12, gamma=3).gamma_value == 3.0
    assert TrainConfig(devices="cuda:0, cuda:1").device_list == ["cuda:0", "cuda:1"]
    assert TrainConfig.from_dict(cfg.to_dict()) == cfg


@pytest.mark.parametrize("kwargs, match", [
    ({"block_size": 12}, "pass --gamma"),
    ({"block_size": 1}, "block_size must be >= 2"),
    ({"seq_len": 0}, "seq_len must be >= 1"),
    ({"epochs": True}, "epochs must be an integer"),
    ({"lr": 0}, "lr must be > 0"),
    ({"warmup_ratio": 1.0}, "warmup_ratio must be >= 0.0 and < 1.0"),
    ({"gamma": -1.0}, "gamma must be > 0"),
    ({"lr": float("inf")}, "lr must be finite, got inf"),
    ({"seq_len": 8, "block_size": 16, "num_anchors": 4}, "block_size=16 exceeds seq_len=8: every block would be mostly padding"),
    ({"compile": "max"}, "compile must be one of"),
    ({"dtype": "float16"}, "dtype must be one of"),
    ({"devices": "cuda:0,,cuda:1"}, "empty entry"),
    ({"max_steps": 0}, "max_steps must be >= 1"),
    ({"num_target_layers_used": 0}, "num_target_layers_used must be >= 1"),
])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_config_from_dict_rejects_unknown_keys():
    with pytest.raises(ValueError, match="unknown TrainConfig keys \\['lr_max'\\]"):
        TrainConfig.from_dict({"lr_max": 1.0})


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1024 vs 990")])
def test_a_save_that_runs_out_of_disk_says_so_leaves_no_temp_dir_and_keeps_earlier_checkpoints(tmp_path, monkeypatch,
                                                                                              failure):
    from examples.dflash_trainer.run import checkpoint as ckpt

    model = torch.nn.Linear(3, 3)
    first = ckpt.save_checkpoint(tmp_path, 1, model, None, None)

    def full(*args, **kwargs):
        raise failure

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(ckpt.CheckpointError, match=rf"saving checkpoint .*step_00000002 failed: the disk of {tmp_path} "
                                                   r"is full \(.* free\); the earlier checkpoints are intact"):
        ckpt.save_checkpoint(tmp_path, 2, model, None, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_00000001"]
    assert ckpt.latest_checkpoint(tmp_path) == first
    ckpt.verify_checkpoint(first)


def test_sizes_are_said_in_a_unit_that_does_not_round_them_to_zero():
    from examples.dflash_trainer.assets.capacity import human_bytes

    assert [human_bytes(n) for n in (512, 3 << 10, 5 << 20, 3 << 30)] == ["512 bytes", "3.0 KiB", "5.0 MiB", "3.0 GiB"]
