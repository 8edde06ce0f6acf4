"""The paper's settings: --preset paper, the memory estimate at a Qwen3-8B target with its real
vocabulary, the estimate against a measured peak, and a run that cannot fit refused before any model
is loaded."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from examples.dflash_trainer import __main__ as cli
from examples.dflash_trainer.assets import assets as assets_module
from examples.dflash_trainer.assets import sizes
from examples.dflash_trainer.config import PRESETS, TrainConfig
from examples.dflash_trainer.errors import EXIT_BAD_INPUT, EXIT_FAILED

ROOT = Path(__file__).resolve().parents[2]
GB80 = 80 * 10**9


def _config_of(argv, monkeypatch):
    """The TrainConfig the command line ``argv`` trains with (train() stands in, and stops there)."""
    from examples.dflash_trainer import train as train_module

    seen = []

    def fake_train(config, progress=None):
        seen.append(config)
        raise RuntimeError("stop here")

    monkeypatch.setattr(train_module, "train", fake_train)
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr
    assert cli.main(argv) == EXIT_FAILED
    return seen[0]


def test_preset_paper_is_the_papers_drafter_and_flags_beside_it_win(monkeypatch, tmp_path):
    config = _config_of(["--preset", "paper", "--out-dir", str(tmp_path)], monkeypatch)
    assert (config.num_draft_layers, config.block_size, config.num_anchors, config.seq_len) == (5, 16, 512, 3072)
    assert config.gamma_value == 7.0
    # an explicit flag wins, even one equal to its default; gamma follows the block size
    config = _config_of(["--preset", "paper", "--block-size", "8", "--out-dir", str(tmp_path)], monkeypatch)
    assert (config.block_size, config.num_draft_layers, config.gamma_value) == (8, 5, 4.0)
    assert set(PRESETS["paper"]) <= {f.name for f in __import__("dataclasses").fields(TrainConfig)}


def _qwen3_8b():
    from examples.dflash_trainer.assets.shapes import shape_num_params

    return shape_num_params("8b")


def test_the_paper_drafter_on_a_qwen3_8b_target_fits_one_80gb_gpu_per_drafter_at_batch_2():
    model_config, num_params = _qwen3_8b()
    assert model_config.vocab_size == 151_936
    at = {b: sum(sizes.drafter_device_bytes(TrainConfig(**PRESETS["paper"], batch_size=b), model_config,
                                            num_params, 2).values()) for b in (1, 2, 3, 4)}
    assert at[2] < GB80, at
    assert at[1] < at[2] < at[3] < at[4]  # the step's part grows with the batch
    # no [tokens, vocab] tensor is counted: a vocabulary 10x larger adds only the loss chunk's logits
    wide = SimpleNamespace(**{**model_config.to_dict(), "vocab_size": 10 * 151_936})
    paper = TrainConfig(**PRESETS["paper"], batch_size=2)
    grown = sum(sizes.drafter_step_bytes(paper, wide, 2).values()) - sum(
        sizes.drafter_step_bytes(paper, model_config, 2).values())
    assert grown <= paper.loss_chunk_tokens * 9 * 151_936 * (4 + 2)


def test_the_estimate_of_a_drafter_step_is_within_20_percent_of_its_measured_peak():
    """At a shape whose activations, not the loss chunk, make most of the peak: the count of the
    layers' saved tensors is what is checked (the benchmark checks the paper-shaped mix)."""
    shape = dict(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=512, layers=2, feature_layers=2,
                 batch=2, seq_len=256, anchors=48, block_size=16)
    done = subprocess.run([sys.executable, "-m", "benchmarks.dflash_loss_memory", "--child", "step",
                           json.dumps(shape), "151936", "128"], capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**__import__("os").environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert 0.8 <= result["estimate_bytes"] / result["peak_bytes"] <= 1.2, result


def test_a_run_that_cannot_fit_names_the_flag_and_exits_2_before_any_model_is_loaded(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(sizes, "free_bytes", lambda device: 100 * sizes.GiB)
    monkeypatch.setattr(assets_module, "default_assets",
                        lambda *a, **k: pytest.fail("built the embedded assets before the size check"))
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr
    code = cli.main(["--target-shape", "8b", "--preset", "paper", "--batch-size", "8", "--devices", "cpu",
                     "--targets", "1", "--drafters", "1", "--out-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT
    assert err[-1].startswith("error: this run needs about") and "pass --batch-size " in err[-1], err[-1]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    print(err[-1])
