"""The tokenized-data cache: the second start with the same tokenizer, data and settings skips the
tokenization and gets the same tensors; any change to what the tokens depend on misses it."""

import json
import logging

import pytest
import torch

from examples.dflash_trainer.data import cache as data_cache
from examples.dflash_trainer.config import TrainConfig

from tests.helpers.chat_tokenizer import qwen3_style_tokenizer

RECORDS = [{"prompt": f"What is {i} plus {i}?", "response": f"<think>sum</think>It is {2 * i}."} for i in range(20)]


@pytest.fixture
def counted(monkeypatch):
    """How many times data_cache tokenized a file."""
    calls = []
    real = data_cache.read_jsonl

    def read_jsonl(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(data_cache, "read_jsonl", read_jsonl)
    return calls


def _write(path, records=RECORDS):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _read(path, cache, tokenizer, **settings):
    settings = {"seq_len": 48, "reasoning": "train", **settings}
    return data_cache.read_cached(path, tokenizer=tokenizer, cache_dir=cache, **settings)


def test_the_second_read_loads_the_cache_and_matches_the_first(tmp_path, counted):
    tokenizer, path = qwen3_style_tokenizer(), _write(tmp_path / "d.jsonl")
    first = _read(path, tmp_path / "cache", tokenizer)
    second = _read(path, tmp_path / "cache", qwen3_style_tokenizer())  # another instance of the same tokenizer
    assert len(counted) == 1
    assert torch.equal(first.ids, second.ids) and torch.equal(first.loss_mask, second.loss_mask)
    assert first.skipped == second.skipped


@pytest.mark.parametrize("change", ["seq_len", "reasoning", "template", "data"])
def test_a_change_to_what_the_tokens_depend_on_misses_the_cache(tmp_path, counted, change):
    tokenizer, path = qwen3_style_tokenizer(), _write(tmp_path / "d.jsonl")
    _read(path, tmp_path / "cache", tokenizer)
    settings = {}
    if change == "seq_len":
        settings["seq_len"] = 40
    elif change == "reasoning":
        settings["reasoning"] = "drop"
    elif change == "template":
        tokenizer.chat_template = tokenizer.chat_template.replace("<|im_end|>\\n", "<|im_end|>")
    else:
        _write(path, RECORDS[::-1])
    _read(path, tmp_path / "cache", tokenizer, **settings)
    assert len(counted) == 2


def test_a_damaged_entry_is_logged_and_tokenized_again(tmp_path, counted, caplog):
    tokenizer, path = qwen3_style_tokenizer(), _write(tmp_path / "d.jsonl")
    first = _read(path, tmp_path / "cache", tokenizer)
    (entry,) = (tmp_path / "cache").glob("tokens-*.pt")
    entry.write_bytes(b"not a torch file")
    with caplog.at_level(logging.WARNING, logger="dflash"):
        again = _read(path, tmp_path / "cache", tokenizer)
    assert len(counted) == 2 and torch.equal(first.ids, again.ids)
    assert "is unreadable" in caplog.text and "tokenizing" in caplog.text


def test_the_cache_directory_follows_the_flags(tmp_path):
    assert data_cache.data_cache_dir(TrainConfig(no_data_cache=True)) is None
    assert data_cache.data_cache_dir(TrainConfig(data_cache=str(tmp_path))) == tmp_path
    assert data_cache.data_cache_dir(TrainConfig()).name == "dflash-data"
