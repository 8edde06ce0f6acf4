"""Bad inputs found by fault probing: a damaged --target directory, data that is nearly all skipped,
silent data loading, an unusable THREADGRAPH_CACHE. Each is one clear line naming the file or flag
and the fix (a BadInput, exit 2), found before any worker starts."""

import json
import logging
import os
import re
import shutil
from pathlib import Path

import pytest

from examples.dflash_trainer import __main__ as cli
from examples.dflash_trainer.assets import assets as assets_module
from examples.dflash_trainer.data import records as data_module
from examples.dflash_trainer.assets import shapes as shapes_module
from examples.dflash_trainer import target as target_module
from examples.dflash_trainer.assets.assets import BuildSpec, CacheDirError, default_assets
from examples.dflash_trainer.data.records import read_jsonl, tokenize_lines
from examples.dflash_trainer.errors import EXIT_BAD_INPUT, InputError, MissingInput
from examples.dflash_trainer.target import TargetModel
from tests.helpers.tiny_run import tiny_cli


@pytest.fixture
def target_copy(tiny_assets, tmp_path):
    out = tmp_path / "target"
    shutil.copytree(tiny_assets.target_dir, out)
    return out


@pytest.fixture
def quiet_cli(monkeypatch):
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr


@pytest.fixture
def no_weight_load(monkeypatch):
    """Loading the weights happens in worker setup: a check that is left to it fails the test."""
    monkeypatch.setattr(target_module.TargetSource, "load", lambda self, device: pytest.fail("reached worker setup"))


def cli_args(assets, out_dir, *extra, target=None):
    return tiny_cli(assets, out_dir, "--max-steps", "2", *extra, target=target)


def last_error_line(capsys):
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "Traceback" not in last, last
    return last


# -- 1. a target without tokenizer files ------------------------------------------------------

@pytest.mark.parametrize("removed", [("tokenizer.json", "tokenizer_config.json"), ("tokenizer.json",)])
def test_a_target_without_tokenizer_files_is_refused_naming_the_directory(tiny_assets, target_copy, tmp_path,
                                                                         quiet_cli, no_weight_load, capsys, removed):
    for name in removed:
        (target_copy / name).unlink()
    match = rf"target {re.escape(str(target_copy))} has no tokenizer files \(looked for tokenizer\.json, .*\); save " \
            rf"the target's tokenizer next to the model with tokenizer\.save_pretrained"
    with pytest.raises(MissingInput, match=match):
        TargetModel.shape_only(target_copy, num_feature_layers=1)
    with pytest.raises(MissingInput, match=match):
        TargetModel.from_pretrained(target_copy, num_feature_layers=1)
    # The embedded data is token ids: without the check this trained, masking with a used id.
    assert cli.main(cli_args(tiny_assets, tmp_path / "run", target=target_copy)) == EXIT_BAD_INPUT
    assert re.search(match, last_error_line(capsys))


# -- 2. a damaged target, found at shape time -------------------------------------------------

def _truncate(d: Path):
    weights = d / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])


def _shard(d: Path, keep_second: bool):
    """The single file as shard 1 of 2 of a sharded checkpoint, its index naming a shard 2 too."""
    from safetensors import safe_open

    with safe_open(str(d / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    (d / "model.safetensors").rename(d / "model-00001-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in names}
    if not keep_second:
        weight_map["extra.weight"] = "model-00002-of-00002.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


DAMAGE = {
    "no weights": (lambda d: (d / "model.safetensors").unlink(), MissingInput,
                   r"target .*target has no weights \(looked for model\.safetensors, model\.safetensors\.index\.json, "
                   r"pytorch_model\.bin, pytorch_model\.bin\.index\.json\); .*save_pretrained"),
    "truncated weights": (_truncate, InputError,
                          r"target/model\.safetensors is not a readable safetensors file \(.*incomplete metadata.*; "
                          r"\d+ bytes\): it is truncated or corrupt; copy it again"),
    "missing shard": (lambda d: _shard(d, keep_second=False), MissingInput,
                      r"target/model-00002-of-00002\.safetensors is missing but .*model\.safetensors\.index\.json "
                      r"lists it; copy every shard"),
    "config not JSON": (lambda d: (d / "config.json").write_text("{not json"), InputError,
                        r"target/config\.json is not valid JSON \(.*line 1 column 2\); .*save_pretrained"),
    "empty config": (lambda d: (d / "config.json").write_text("{}"), InputError,
                     r"target/config\.json has no model_type, so it is not a HF model config; .*save_pretrained"),
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_target_is_one_line_naming_the_file_before_any_worker(tiny_assets, target_copy, tmp_path, quiet_cli,
                                                                        no_weight_load, capsys, damage):
    mutate, error, match = DAMAGE[damage]
    mutate(target_copy)
    with pytest.raises(error, match=match):
        TargetModel.shape_only(target_copy, num_feature_layers=1)
    with pytest.raises(error, match=match):
        TargetModel.from_pretrained(target_copy, num_feature_layers=1)
    assert cli.main(cli_args(tiny_assets, tmp_path / "run", target=target_copy)) == EXIT_BAD_INPUT
    assert re.search(match, last_error_line(capsys))


def test_a_complete_sharded_target_passes_the_shape_checks(target_copy):
    _shard(target_copy, keep_second=True)
    assert TargetModel.shape_only(target_copy, num_feature_layers=1).layer_ids == [1]


def test_more_feature_layers_than_the_target_has_names_the_flag(tiny_assets, tmp_path, quiet_cli, no_weight_load,
                                                                 capsys):
    match = (r"--num-target-layers-used 50 \(it defaults to --num-draft-layers\): cannot spread n=50 feature layers "
             r"over a 2-layer target .* L >= n\+3 = 53\); lower num_target_layers_used or use a deeper target")
    with pytest.raises(InputError, match=match):
        TargetModel.shape_only(tiny_assets.target_dir, num_feature_layers=50)
    args = cli_args(tiny_assets, tmp_path / "run", "--num-target-layers-used", "50")
    assert cli.main(args) == EXIT_BAD_INPUT
    assert re.search(match, last_error_line(capsys))


# -- 3. nearly all samples skipped ------------------------------------------------------------

def _record(prompt_len: int, response_len: int) -> str:
    return json.dumps({"input_ids": [1] * (prompt_len + response_len),
                       "loss_mask": [0] * prompt_len + [1] * response_len})


def test_skipping_most_samples_warns_and_says_what_to_do(caplog):
    lines = [_record(100, 8)] * 3 + [_record(4, 8)]  # 3 prompts longer than seq_len
    with caplog.at_level(logging.INFO, logger=data_module.__name__):
        data = tokenize_lines(lines, source="long.jsonl", tokenizer=None, seq_len=32, vocab_size=10)
    assert len(data) == 1 and data.skipped == 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert re.search(r"skipped 3 of 4 samples in long\.jsonl: .*seq_len=32.*trains on the remaining 1 only; raise "
                     r"--seq-len or shorten the prompts", warnings[0].getMessage())
    caplog.clear()
    with caplog.at_level(logging.INFO, logger=data_module.__name__):  # a few skipped: information, no warning
        tokenize_lines([_record(100, 8)] + [_record(4, 8)] * 3, source="ok.jsonl", tokenizer=None, seq_len=32,
                       vocab_size=10)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "skipped 1 of 4 samples in ok.jsonl" in caplog.text


# -- 4. data loading says what it does --------------------------------------------------------

def test_reading_data_logs_its_size_first_and_progress_while_it_runs(tmp_path, monkeypatch, caplog):
    path = tmp_path / "train.jsonl"
    path.write_text("\n".join([_record(4, 8)] * 5))  # no newline at the end: still 5 lines
    monkeypatch.setattr(data_module, "PROGRESS_EVERY_S", 0.0)  # every line counts as a long wait
    with caplog.at_level(logging.INFO, logger=data_module.__name__):
        data = read_jsonl(path, tokenizer=None, seq_len=32, vocab_size=10)
    assert len(data) == 5
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0] == f"tokenizing 5 lines of {path}"
    assert f"tokenizing {path}: 3 of 5 lines done" in "\n".join(messages)
    assert f"tokenized {path}: 5 samples in" in messages[-1]


# -- 5. an unusable THREADGRAPH_CACHE ---------------------------------------------------------

def _unwritable(tmp_path: Path) -> Path:
    if os.geteuid() == 0:  # root writes through any mode bits, but not into /proc
        return Path("/proc/self/threadgraph-cache")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    return locked


@pytest.mark.parametrize("kind", ["a file", "unwritable"])
def test_an_unusable_cache_is_one_line_naming_threadgraph_cache(tiny_assets, tmp_path, monkeypatch, quiet_cli, capsys,
                                                                kind):
    if kind == "a file":
        cache = tmp_path / "cache"
        cache.write_text("x")
        problem = r"is a file, not a directory"
    else:
        cache = _unwritable(tmp_path)
        problem = r"cannot be written \(.*\)"
    monkeypatch.setenv("THREADGRAPH_CACHE", str(cache))
    match = rf"THREADGRAPH_CACHE {re.escape(str(cache))} {problem}; point THREADGRAPH_CACHE at a writable directory"
    with pytest.raises(CacheDirError, match=match):
        default_assets(spec=BuildSpec.tiny())
    with pytest.raises(CacheDirError, match=match):
        shapes_module.shape_target("tiny", tiny_assets)
    with pytest.raises(CacheDirError, match=rf"cache directory {re.escape(str(cache))} {problem}; pass a writable"):
        default_assets(cache, spec=BuildSpec.tiny())

    assert shapes_module.main(["tiny"]) == EXIT_BAD_INPUT
    assert re.search(match, last_error_line(capsys))
    monkeypatch.setattr(assets_module, "default_assets", lambda: tiny_assets)  # the cache fails at the shape build
    assert shapes_module.main(["tiny"]) == EXIT_BAD_INPUT
    assert re.search(match, last_error_line(capsys))
    code = cli.main(["--target-shape", "tiny", "--devices", "cpu", "--out-dir", str(tmp_path / "run")])
    assert code == EXIT_BAD_INPUT
    assert re.search(match, last_error_line(capsys))


# -- 6. what a path is, named as it is -----------------------------------------------------------

def test_a_data_directory_an_empty_data_file_and_a_target_file_each_say_what_they_are(target_copy, tmp_path):
    with pytest.raises(data_module.DataError, match=f"data file {tmp_path} is a directory; pass a JSONL file"):
        read_jsonl(tmp_path, tokenizer=None, seq_len=8, vocab_size=10)
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n  \n")
    with pytest.raises(data_module.DataError, match=r"blank.jsonl holds no samples \(it is empty or blank\)"):
        read_jsonl(blank, tokenizer=None, seq_len=8, vocab_size=10)
    weights = target_copy / "model.safetensors"
    with pytest.raises(InputError, match=f"target {weights} is a file; pass a local HF model directory"):
        TargetModel.shape_only(weights, num_feature_layers=1)
