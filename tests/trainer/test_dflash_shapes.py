"""Random-init targets of published Qwen3 shapes (--target-shape): the shape table, the cached build,
and both ways in: the trainer's --target-shape and the normal --target path."""

import logging

import pytest
import torch

from examples.dflash_trainer.assets import assets as assets_module
from examples.dflash_trainer import __main__ as cli
from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.errors import EXIT_BAD_INPUT
from examples.dflash_trainer.assets import shapes as shapes_module
from examples.dflash_trainer.assets.shapes import RANDOM_WEIGHTS_WARNING, SHAPES, NoRoomToBuild, qwen3_config, shape_target
from examples.dflash_trainer.train import train
from tests.helpers.tiny_run import TINY

VOCAB = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 1}  # the embedded target's
# The model cards' non-embedding parameter counts (Qwen/Qwen3-*), and their config.json values.
PUBLISHED = {"0.6b": (0.44e9, 1024, 28, 3072, 16, 8, True), "1.7b": (1.4e9, 2048, 28, 6144, 16, 8, True),
             "4b": (3.6e9, 2560, 36, 9728, 32, 8, True), "8b": (6.95e9, 4096, 36, 12288, 32, 8, False),
             "14b": (13.2e9, 5120, 40, 17408, 40, 8, False), "32b": (31.2e9, 5120, 64, 25600, 64, 8, False)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_shapes_build_the_published_configurations_on_the_meta_device(name):
    from transformers import Qwen3ForCausalLM

    non_embedding, hidden, layers, inter, heads, kv, tied = PUBLISHED[name]
    config = qwen3_config(name, VOCAB)
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size, config.num_attention_heads,
            config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (hidden, layers, inter, heads,
                                                                                       kv, 128, tied)
    assert (config.rope_theta if hasattr(config, "rope_theta") else config.rope_parameters["rope_theta"]) == 1e6
    assert config.rms_norm_eps == 1e-6 and config.vocab_size == 151_936  # Qwen3's, whatever the tokenizer
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    embedding = 151_936 * hidden * (1 if tied else 2)
    assert abs(params - embedding - non_embedding) / non_embedding < 0.02, params
    if name == "0.6b":  # the model card's 0.6B, embedding included
        assert 0.59e9 < params < 0.61e9


def test_unknown_shape_and_shape_with_target_are_clear_errors(tmp_path, capsys, monkeypatch):
    with pytest.raises(ValueError, match="target_shape must be one of"):
        TrainConfig(target_shape="70b")
    with pytest.raises(ValueError, match="--target-shape and --target are mutually exclusive"):
        TrainConfig(target_shape="tiny", target=str(tmp_path))
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr
    code = cli.main(["--target-shape", "tiny", "--target", str(tmp_path), "--out-dir", str(tmp_path / "run")])
    assert code == EXIT_BAD_INPUT
    assert "--target-shape and --target are mutually exclusive" in capsys.readouterr().err


def _config(out_dir, **overrides):
    return TrainConfig(**{**TINY, "max_steps": 2, "out_dir": str(out_dir), **overrides})


def test_a_built_shape_is_cached_seeded_and_trains_through_the_target_path(tiny_assets, tmp_path):
    from safetensors.torch import load_file

    built = shape_target("tiny", tiny_assets, tmp_path / "cache")
    assert built.report["random_weights"] and built.report["shape"] == "tiny"
    assert shape_target("tiny", tiny_assets, tmp_path / "cache").dir == built.dir  # found, not rebuilt
    again = shape_target("tiny", tiny_assets, tmp_path / "other")
    a, b = load_file(built.dir / "model.safetensors"), load_file(again.dir / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # the private seed, not the global RNG
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    result = train(_config(tmp_path / "run", target=str(built.dir), data=str(tiny_assets.train_jsonl)))
    assert len(result.losses) == 2 and all(loss == loss for loss in result.losses)


def test_target_shape_trains_on_the_embedded_data_and_warns(tiny_assets, tmp_path, monkeypatch, caplog):
    # The embedded default takes minutes to build; the tiny assets stand in for it here.
    monkeypatch.setattr(assets_module, "default_assets", lambda: tiny_assets)
    monkeypatch.setenv("THREADGRAPH_CACHE", str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING):
        result = train(_config(tmp_path / "run", target_shape="tiny"))
    assert result.target_report["shape"] == "tiny" and len(result.losses) == 2
    assert RANDOM_WEIGHTS_WARNING in caplog.text
    assert (tmp_path / "cache" / f"dflash-shape-tiny-vocab151936-on-{tiny_assets.root.name}").is_dir()
    assert set(SHAPES) >= {"tiny", *PUBLISHED}


def _no_leftovers(cache):
    return not cache.exists() or [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []


def test_a_shape_too_large_for_the_cache_disk_is_refused_before_drawing(tiny_assets, tmp_path, monkeypatch, capsys):
    free = type("Usage", (), {"free": 1000})()
    monkeypatch.setattr(shapes_module.shutil, "disk_usage", lambda path: free)
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: pytest.fail("gave the weights storage"))
    with pytest.raises(NoRoomToBuild, match=r"tiny.*0\.0 GiB.*THREADGRAPH_CACHE"):
        shape_target("tiny", tiny_assets, tmp_path / "cache")
    assert _no_leftovers(tmp_path / "cache")
    monkeypatch.setattr(assets_module, "default_assets", lambda: tiny_assets)
    monkeypatch.setenv("THREADGRAPH_CACHE", str(tmp_path / "cache"))
    assert shapes_module.main(["tiny"]) == EXIT_BAD_INPUT
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "THREADGRAPH_CACHE" in last, last


def test_a_shape_too_large_for_the_build_device_is_refused_before_drawing(tiny_assets, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(shapes_module, "free_bytes", lambda device: 1000 if device == "cpu" else pytest.fail(device))
    monkeypatch.setattr(torch.nn.Module, "to_empty", lambda *a, **k: pytest.fail("gave the weights storage"))
    with pytest.raises(NoRoomToBuild, match=r"tiny.*0\.0 GiB.* cpu"):
        shape_target("tiny", tiny_assets, tmp_path / "cache", device="cpu")
    assert _no_leftovers(tmp_path / "cache")

    # The trainer's command line: one line naming the fix, exit EXIT_BAD_INPUT.
    monkeypatch.setattr(assets_module, "default_assets", lambda: tiny_assets)
    monkeypatch.setenv("THREADGRAPH_CACHE", str(tmp_path / "cli-cache"))
    monkeypatch.setattr(shapes_module.torch.cuda, "is_available", lambda: False)  # the build draws on the cpu
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr
    code = cli.main(["--target-shape", "tiny", "--devices", "cpu", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == EXIT_BAD_INPUT, err
    assert err.strip().splitlines()[-1].startswith("error: ") and "cpu" in err.strip().splitlines()[-1], err
