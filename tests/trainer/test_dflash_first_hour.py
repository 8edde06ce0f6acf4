"""Issue 57, the trainer: what a new user's first hour ran into. Every flag says what it does, the
data formats are documented, and bad input (a flag, a file, a directory) is one line naming the flag
and exit 2, never a raw error."""

import logging
import os
import re
from pathlib import Path

import pytest

from examples.dflash_trainer import __main__ as cli

ROOT = Path(__file__).resolve().parents[2]
TRAINER = ROOT / "examples" / "dflash_trainer"

pytestmark = pytest.mark.timeout(300)


def test_every_flag_has_a_help_line_that_says_more_than_its_default():
    bare = []
    for action in cli._parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        words = re.sub(r"(^|;\s*)default: .*$", "", action.help or "").strip()
        if len(words) < 10:
            bare.append(f"{action.option_strings[0]}: {action.help!r}")
    assert not bare, "flags whose --help says nothing but a default:\n" + "\n".join(bare)


def _readme_section(heading: str) -> str:
    text = (TRAINER / "README.md").read_text()
    assert f"\n## {heading}\n" in text, f"the trainer's README has no '## {heading}' section"
    return text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]


def test_the_readme_shows_the_three_data_formats_and_its_examples_are_read_as_written():
    from examples.dflash_trainer.data.records import tokenize_lines
    from tests.helpers.chat_tokenizer import qwen3_style_tokenizer

    section = _readme_section("Data formats")
    example = re.search(r"```jsonl\n(.*?)```", section, re.S).group(1).splitlines()
    kinds = [next(k for k in ("prompt", "messages", "input_ids") if f'"{k}"' in line) for line in example]
    assert sorted(kinds) == ["input_ids", "messages", "prompt"]
    for key in ("response", "role", "content", "reasoning_content", "loss_mask", "--seq-len", "--target"):
        assert key in section, key
    data = tokenize_lines(example, source="README", tokenizer=qwen3_style_tokenizer(), seq_len=64)
    assert len(data) == 3 and data.skipped == 0


@pytest.fixture
def quiet_cli(monkeypatch):
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr


def _last_error(capsys) -> str:
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("error: "), lines
    assert not any("Traceback" in line for line in lines), lines
    return lines[-1]


def test_data_without_target_is_refused_before_the_embedded_target_is_built(tiny_assets, tmp_path, quiet_cli, capsys,
                                                                            monkeypatch):
    from examples.dflash_trainer.assets import assets

    def built(*args, **kwargs):
        raise AssertionError("the embedded default target was built to train on the user's data")

    monkeypatch.setattr(assets, "default_assets", built)
    code = cli.main(["--data", str(tiny_assets.train_jsonl), "--devices", "cpu", "--out-dir", str(tmp_path / "run"),
                     "--data-cache", str(tmp_path / "cache")])
    last = _last_error(capsys)
    assert code == 2 and re.search(r"--data needs --target: .*pass --target DIR", last), last


def test_the_requirements_ask_for_a_transformers_that_takes_the_dtype_keyword():
    import inspect

    from packaging.requirements import Requirement

    from examples.dflash_trainer.target import TargetModel

    # The target is loaded with from_pretrained(dtype=...): transformers before 4.56 called it torch_dtype and
    # would load the weights in float32, ignoring the keyword.
    assert 'kwargs["dtype"]' in inspect.getsource(TargetModel.from_pretrained)
    lines = (TRAINER / "requirements.txt").read_text().splitlines()
    spec = next(Requirement(line.split("#")[0]) for line in lines if line.startswith("transformers"))
    assert "4.56.0" in spec.specifier and "4.55.4" not in spec.specifier, spec


def _tiny_flags(assets, tmp_path, *extra):
    """A run on the tiny assets with only the flags given (tiny_cli's would override a --preset)."""
    return ["--target", str(assets.target_dir), "--data", str(assets.train_jsonl), "--devices", "cpu",
            "--out-dir", str(tmp_path / "run"), "--data-cache", str(tmp_path / "cache"), "--eval-every", "0",
            "--checkpoint-every", "0", *extra]


def test_preset_paper_beyond_the_targets_positions_is_refused_naming_seq_len(tiny_assets, tmp_path, quiet_cli,
                                                                              capsys, monkeypatch):
    from examples.dflash_trainer import pipeline

    def read(*args, **kwargs):
        raise AssertionError("the data was read: the run went on past the target's positions")

    monkeypatch.setattr(pipeline, "read_cached", read)
    code = cli.main(_tiny_flags(tiny_assets, tmp_path, "--preset", "paper", "--num-draft-layers", "1",
                                "--num-target-layers-used", "1", "--batch-size", "1", "--max-steps", "1"))
    last = _last_error(capsys)
    assert code == 2 and re.search(r"--seq-len 3072 exceeds the 512 positions of the target .*pass --seq-len 512 or "
                                   r"less", last), last


def test_a_tensorboard_dir_that_is_a_file_or_unwritable_is_one_line_naming_the_flag(tiny_assets, tmp_path, quiet_cli,
                                                                                    capsys):
    from tests.helpers.tiny_run import tiny_cli

    as_file = tmp_path / "events"
    as_file.write_text("x")
    if os.geteuid() == 0:  # root writes through any mode bits, but creates nothing in /proc
        locked = Path("/proc/self/tensorboard")
    else:
        (tmp_path / "locked").mkdir(mode=0o500)
        locked = tmp_path / "locked" / "tensorboard"
    for where, says in ((as_file, "is a file, not a directory"), (locked, "cannot be created")):
        code = cli.main(tiny_cli(tiny_assets, tmp_path / f"run-{where.name}", "--max-steps", "1", "--tensorboard",
                                 str(where)))
        last = _last_error(capsys)
        assert code == 2 and last.startswith(f"error: --tensorboard {where} {says}"), last


def test_init_from_with_corrupt_weights_is_one_line_naming_the_flag(tiny_assets, tmp_path, quiet_cli, capsys):
    from examples.dflash_trainer.export.export import export
    from tests.helpers.export_fixtures import make_checkpoint
    from tests.helpers.tiny_run import tiny_cli

    make_checkpoint(tmp_path / "ckpt", tiny_assets.target_dir, saved_target=str(tiny_assets.target_dir),
                    num_layers=1, n=1)
    published, _ = export(tmp_path / "ckpt", "zlab", tmp_path / "zlab")
    weights = published / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    code = cli.main(tiny_cli(tiny_assets, tmp_path / "run", "--max-steps", "1", "--init-from", str(published)))
    last = _last_error(capsys)
    assert code == 2 and re.search(r"--init-from .*zlab: model\.safetensors is not a readable safetensors file "
                                   r"\(.*\d+ bytes\): it is truncated or corrupt", last), last


def test_bad_yaml_in_config_is_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("seq-len: [64, 128\nlr: 0.001\n")
    assert cli.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.match(rf"error: --config {re.escape(str(path))} is not valid YAML \(ParserError: "
                                      r".*at line 2, column \d+\); fix the file$", err[0]), err


def test_a_flag_that_overrides_the_config_file_is_logged_with_both_values(tmp_path, caplog):
    path = tmp_path / "run.toml"
    path.write_text('seq-len = 48\nreasoning = "keep"\nlr = 0.002\n')
    with caplog.at_level(logging.INFO, logger="dflash"):
        args, _ = cli.parse_flags(["--config", str(path), "--seq-len", "32", "--reasoning", "keep", "--epochs", "2"])
    assert (args["seq_len"], args["reasoning"], args["lr"], args["epochs"]) == (32, "keep", 0.002, 2)
    said = [r.getMessage() for r in caplog.records if r.name == "dflash"]
    assert said == [f"dflash: --seq-len 32 on the command line overrides seq_len = 48 from {path}"], said


def _unwritable_dir(tmp_path) -> Path:
    """A directory that exists and that this process cannot create files in."""
    if os.geteuid() == 0:  # root writes through any mode bits, but creates nothing in /proc
        return Path("/proc/self")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked


def test_an_unwritable_data_cache_is_one_warning_and_the_data_is_read(tmp_path, caplog):
    from examples.dflash_trainer.data import cache as data_cache
    from tests.helpers.chat_tokenizer import qwen3_style_tokenizer

    path = tmp_path / "train.jsonl"
    path.write_text("".join(f'{{"prompt": "What is {i} and {i}?", "response": "It is {2 * i}."}}\n' for i in range(6)))
    tokenizer = qwen3_style_tokenizer()
    with caplog.at_level(logging.WARNING, logger="dflash"):
        data = data_cache.read_cached(path, tokenizer=tokenizer, seq_len=48, cache_dir=_unwritable_dir(tmp_path))
    plain = data_cache.read_cached(path, tokenizer=tokenizer, seq_len=48, cache_dir=None)
    assert data.ids.equal(plain.ids) and data.loss_mask.equal(plain.loss_mask)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and re.search(r"could not write the data cache entry .*training goes on", warned[0]), warned


def test_a_grad_accum_that_makes_a_step_many_passes_over_the_data_is_refused(tiny_assets, tmp_path, quiet_cli,
                                                                             capsys, monkeypatch):
    from examples.dflash_trainer import pipeline
    from tests.helpers.tiny_run import tiny_cli

    def went_on(*args, **kwargs):
        raise AssertionError("the run went on to steps of millions of samples each")

    monkeypatch.setattr(pipeline, "Checkpointer", went_on)
    code = cli.main(tiny_cli(tiny_assets, tmp_path / "run", "--grad-accum", "1000000"))
    last = _last_error(capsys)
    # the tiny run: --batch-size 2 x 3 drafters
    assert code == 2 and re.search(r"--grad-accum 1000000 makes one optimizer step take 6,000,000 samples "
                                   r"\(--batch-size 2 x --drafters 3 x --grad-accum 1000000\), [\d,.]+ passes over "
                                   r"the (\d+) samples of the data; pass --grad-accum \d+ or less", last), last
    samples = int(re.search(r"passes over the (\d+) samples", last).group(1))
    most = int(re.search(r"pass --grad-accum (\d+) or less", last).group(1))
    assert most == samples // 6 >= 1


def test_a_grad_accum_within_one_pass_a_step_is_accepted(tiny_assets, tmp_path):
    from examples.dflash_trainer.pipeline import Pipeline
    from tests.helpers.tiny_run import tiny_config

    config = tiny_config(tiny_assets, tmp_path / "run", grad_accum=2)
    assert Pipeline.build(config).schedule.total_steps == config.max_steps
