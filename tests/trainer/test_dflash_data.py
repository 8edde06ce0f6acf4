"""JSONL parsing, errors naming file and line, padding, and the resumable sharded sampler."""

import json
import logging

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from examples.dflash_trainer.data.records import (DataError, SampleStream, ShardBatches, TokenData, anchor_seed, read_jsonl,
                                          tokenize_lines)


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level tokenizer (256 byte tokens + <eos>=256, <pad>=257); no download."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>")


def _write(tmp_path, records):
    path = tmp_path / "data.jsonl"
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def _loss_text(tokenizer, data, row):
    return tokenizer.decode(data.ids[row][data.loss_mask[row]].tolist())


def test_prompt_response_without_template(tmp_path, tokenizer):
    data = read_jsonl(_write(tmp_path, [{"prompt": "2+2?", "response": "four"}]),
                      tokenizer=tokenizer, seq_len=64)
    assert data.ids.shape == data.loss_mask.shape == (1, 64)
    n = len("user: 2+2?\nassistant: four\n")
    assert tokenizer.decode(data.ids[0, :n].tolist()) == "user: 2+2?\nassistant: four\n"
    assert _loss_text(tokenizer, data, 0) == "four\n"
    assert (data.ids[0, n:] == tokenizer.pad_token_id).all() and not data.loss_mask[0, n:].any()


def test_messages_with_chat_template(tmp_path, tokenizer):
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer,
                                  eos_token="<eos>", pad_token="<pad>")
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>"
                         "{% endfor %}")
    turns = [{"role": "user", "content": "say ok"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "again ok"}, {"role": "assistant", "content": "ok!!"}]
    data = read_jsonl(_write(tmp_path, [{"messages": turns}]), tokenizer=tok, seq_len=80)
    assert _loss_text(tok, data, 0) == "okok!!"  # both assistant contents, nothing else


def test_pretokenized_without_tokenizer(tmp_path):
    path = _write(tmp_path, [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 0]}])
    data = read_jsonl(path, tokenizer=None, seq_len=6, vocab_size=10)
    assert data.ids.tolist() == [[5, 6, 7, 8, 0, 0]]
    assert data.loss_mask.long().tolist() == [[0, 1, 1, 0, 0, 0]]


def test_truncates_to_seq_len(tmp_path):
    path = _write(tmp_path, [{"input_ids": list(range(10)), "loss_mask": [1] * 10}])
    data = read_jsonl(path, tokenizer=None, seq_len=4, vocab_size=10)
    assert data.ids.tolist() == [[0, 1, 2, 3]]


def test_skips_samples_without_two_consecutive_loss_tokens(tmp_path, caplog):
    path = _write(tmp_path, [
        {"input_ids": [1, 2, 3], "loss_mask": [1, 0, 1]},
        "",
        {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
        {"input_ids": [1, 2, 3, 4, 5], "loss_mask": [0, 0, 0, 1, 1]},  # loss cut by seq_len
    ])
    with caplog.at_level(logging.INFO):
        data = read_jsonl(path, tokenizer=None, seq_len=4, vocab_size=10)
    assert len(data) == 1 and data.skipped == 2
    assert "skipped 2 of 3" in caplog.text


def test_empty_dataset_is_an_error(tmp_path):
    path = _write(tmp_path, [{"input_ids": [1, 2], "loss_mask": [0, 1]}])
    with pytest.raises(DataError, match="no usable samples"):
        read_jsonl(path, tokenizer=None, seq_len=8, vocab_size=10)


@pytest.mark.parametrize("bad, what", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected a JSON object"),
    ({"text": "hi"}, "unknown record with keys \\['text'\\]"),
    ({"prompt": "hi"}, "'response' must be a string"),
    ({"prompt": "hi", "response": 3}, "'response' must be a string"),
    ({"messages": []}, "'messages' must be a non-empty list"),
    ({"messages": [{"role": "user"}]}, "messages\\[0\\] must be an object"),
    ({"messages": [{"role": "user", "content": "x"}]}, "no assistant turn"),
    ({"input_ids": [1, "2"], "loss_mask": [1, 1]}, "'input_ids' must be a list of integers"),
    ({"input_ids": [1, 2], "loss_mask": [1, 2]}, "'loss_mask' must be a list of 0/1"),
    ({"input_ids": [1, 2], "loss_mask": [1]}, "has 2 tokens but 'loss_mask' has 1"),
    ({"input_ids": [1, 999], "loss_mask": [1, 1]}, "token id 999 is outside"),
])
def test_bad_line_names_file_and_line(tmp_path, tokenizer, bad, what):
    good = {"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}
    path = _write(tmp_path, [good, good, bad])
    with pytest.raises(DataError, match=f"data\\.jsonl:3: .*{what}"):
        read_jsonl(path, tokenizer=tokenizer, seq_len=8)


def test_text_without_tokenizer_is_an_error(tmp_path):
    path = _write(tmp_path, [{"prompt": "a", "response": "b"}])
    with pytest.raises(DataError, match="data\\.jsonl:1: text records need the target's tokenizer"):
        read_jsonl(path, tokenizer=None, seq_len=8, vocab_size=10)


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl does not exist"):
        read_jsonl(tmp_path / "nope.jsonl", tokenizer=None, seq_len=8)


def test_embedded_lines_name_their_source():
    with pytest.raises(DataError, match="<embedded>:2: invalid JSON"):
        tokenize_lines(['{"input_ids": [1, 2], "loss_mask": [1, 1]}', "{"], source="<embedded>",
                       tokenizer=None, seq_len=4, vocab_size=10)


# ---- sampler --------------------------------------------------------------------------------

def _numbered(m, s=4):
    """Sample i is filled with the value i, so a batch tells which samples it holds."""
    ids = torch.arange(m, dtype=torch.int32)[:, None].repeat(1, s)
    return TokenData(ids=ids, loss_mask=torch.ones(m, s, dtype=torch.bool), skipped=0)


def test_batches_are_fixed_shape_and_long():
    ids, mask = SampleStream(_numbered(5), 3).next_batch()
    assert ids.shape == mask.shape == (3, 4)
    assert ids.dtype == mask.dtype == torch.long


def test_each_epoch_visits_every_sample_once_across_shards():
    data = _numbered(24)
    seen = []
    for rank in range(2):
        for shard in range(3):
            stream = SampleStream(data, 2, seed=5, shard=shard, num_shards=3, rank=rank,
                                  world_size=2)
            for _ in range(2):  # 24 samples / (6 consumers * batch 2) = 2 batches per epoch
                seen += stream.next_batch()[0][:, 0].tolist()
    assert sorted(seen) == list(range(24))


def test_epochs_are_reshuffled():
    stream = SampleStream(_numbered(16), 16, seed=1)
    first, second = stream.next_batch()[0][:, 0], stream.next_batch()[0][:, 0]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(16))
    assert not torch.equal(first, second)


def test_skipping_batches_yields_what_consuming_them_would():
    data = _numbered(7)
    stream = SampleStream(data, 3, seed=2, shard=1, num_shards=2)
    for _ in range(4):  # crosses epoch boundaries (7 samples, 2 consumers)
        stream.next_batch()
    skipped = SampleStream(data, 3, seed=2, shard=1, num_shards=2, skip_batches=4)
    for _ in range(5):
        assert torch.equal(skipped.next_batch()[0], stream.next_batch()[0])


def _shard_batches(data, shard, *, rank=0, first=0, end=12):
    return ShardBatches(data, 2, seed=3, shard=shard, num_shards=3, rank=rank, world_size=2, first=first, end=end)


def test_shard_batches_are_global_batches_b_mod_shards_until_the_end():
    shards = [_shard_batches(_numbered(30), t) for t in range(3)]
    indices = []
    while not all(s.done for s in shards):
        for s in shards:
            if not s.done:
                indices.append(s.next()[0])
    assert sorted(indices) == list(range(12)) and [b % 3 for b in indices[:3]] == [0, 1, 2]


def test_a_resumed_shard_continues_with_the_same_batches_and_anchor_draws():
    data = _numbered(30)
    full = _shard_batches(data, 1)
    batches = [full.next() for _ in range(4)]  # global batches 1, 4, 7, 10
    resumed = _shard_batches(data, 1, first=5)  # a run resumed at batch 5 starts this shard at 7
    for b, ids, mask, scores in batches[2:]:
        again = resumed.next()
        assert again[0] == b and all(torch.equal(x, y) for x, y in zip(again[1:], (ids, mask, scores)))
    assert resumed.done and full.done


def test_anchor_draws_depend_on_the_batch_and_the_rank():
    data = _numbered(30)
    b0, b1 = _shard_batches(data, 0).next()[3], _shard_batches(data, 1).next()[3]
    other_rank = _shard_batches(data, 0, rank=1).next()[3]
    assert not torch.equal(b0, b1) and not torch.equal(b0, other_rank)
    assert anchor_seed(3, 1, 0) != anchor_seed(3, 0, 0) != anchor_seed(3, 0, 1)


def test_a_huge_record_is_tokenised_only_as_far_as_seq_len_needs(tmp_path, tokenizer, monkeypatch):
    response = "four " * 2_000_000  # 10 MB on one line
    path = tmp_path / "huge.jsonl"
    path.write_text(json.dumps({"prompt": "2+2?", "response": response}) + "\n")
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"prompt": "2+2?", "response": response[:400]}) + "\n")
    encoded = []
    real = type(tokenizer).encode

    def counting(self, text, **kwargs):
        encoded.append(len(text))
        return real(self, text, **kwargs)

    monkeypatch.setattr(type(tokenizer), "encode", counting)
    data = read_jsonl(path, tokenizer=tokenizer, seq_len=64)
    assert max(encoded) < 10_000, encoded  # never the whole 10 MB
    expected = read_jsonl(small, tokenizer=tokenizer, seq_len=64)
    assert torch.equal(data.ids, expected.ids) and torch.equal(data.loss_mask, expected.loss_mask)
