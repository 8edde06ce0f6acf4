"""Evaluation on held-out data: with --target and --data, a fixed split of the data that training
never reads; --eval-data FILE instead; tau with the number of prompts and tokens it rests on."""

import json

import pytest
import torch

from examples.dflash_trainer.data.records import TokenData
from examples.dflash_trainer.errors import InputError
from examples.dflash_trainer.eval import prompts_of, split_held_out
from examples.dflash_trainer.pipeline import Pipeline

from tests.helpers.tiny_run import tiny_config

pytestmark = pytest.mark.timeout(300)


def _rows(data: TokenData) -> set:
    return {tuple(row.tolist()) for row in data.ids}


def test_the_held_out_split_is_disjoint_from_what_training_reads(tiny_assets, tmp_path):
    parts = Pipeline.build(tiny_config(tiny_assets, tmp_path, eval_every=4, eval_prompts=6))
    assert parts.held_out is not None and len(parts.held_out) == 6
    assert not _rows(parts.held_out) & _rows(parts.data)  # no held-out sample is a training sample
    # and no training batch reads one: every batch of every shard comes from parts.data
    read = set()
    for shard in range(parts.config.targets):
        batches = parts.batches(shard)
        while not batches.done:
            _, ids, *_ = batches.next()
            read |= {tuple(row.tolist()) for row in ids.int()}
    assert read and not read & _rows(parts.held_out)
    prompts = parts.evaluator(torch.device("cpu")).prompts
    assert len(prompts) == 6
    held_rows = [row.tolist() for row in parts.held_out.ids]
    assert all(any(row[:len(p)] == p.tolist() for row in held_rows) for p in prompts)


def test_the_split_is_fixed_whatever_the_seed(tiny_assets, tmp_path):
    a = Pipeline.build(tiny_config(tiny_assets, tmp_path / "a", eval_every=4, seed=0)).held_out
    b = Pipeline.build(tiny_config(tiny_assets, tmp_path / "b", eval_every=4, seed=7)).held_out
    assert torch.equal(a.ids, b.ids)


def test_eval_data_replaces_the_split(tiny_assets, tmp_path):
    rows = [json.loads(line) for line in tiny_assets.train_jsonl.read_text().splitlines()[:5]]
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parts = Pipeline.build(tiny_config(tiny_assets, tmp_path / "run", eval_every=4, eval_prompts=3,
                                       eval_data=str(eval_file)))
    assert len(parts.held_out) == 5
    full = Pipeline.build(tiny_config(tiny_assets, tmp_path / "full", eval_every=0))
    assert len(parts.data) == len(full.data)  # nothing of --data held out
    assert len(parts.evaluator(torch.device("cpu")).prompts) == 3


def test_too_little_data_to_hold_some_out_names_the_flags():
    data = TokenData(torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, 4, dtype=torch.bool), 0)
    with pytest.raises(InputError, match=r"3 samples, too few to hold 8 out.*--eval-prompts.*--eval-data"):
        split_held_out(data, 8)


def test_prompts_are_the_parts_before_the_response():
    ids = torch.arange(12, dtype=torch.int32).reshape(2, 6)
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert [p.tolist() for p in prompts_of(TokenData(ids, mask, 0), 5)] == [[0, 1], [6, 7, 8, 9]]


def test_tau_says_how_many_prompts_and_tokens_it_rests_on(tiny_assets, tmp_path):
    parts = Pipeline.build(tiny_config(tiny_assets, tmp_path, eval_every=4, eval_prompts=2, eval_max_new_tokens=8,
                                       block_size=16, seq_len=64))
    result = parts.evaluator(torch.device("cpu"))(parts.replica(torch.device("cpu")).drafter)
    assert result["prompts"] == 2 and result["steps"] == sum(result["accepted_hist"]) > 0
    made = sum((j + 1) * c for j, c in enumerate(result["accepted_hist"]))  # each step: its accepted tokens + 1
    assert result["tau"] == made / result["steps"]
    # each prompt: its prefill's token, then its steps' tokens, up to 8 or a few past (the last block
    # is verified whole); no stop token came up in these prompts
    assert result["tokens"] == 2 + made and 2 * 8 <= result["tokens"] < 2 * (8 + 16)
