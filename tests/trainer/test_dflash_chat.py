"""Chat records through the tokenizer's own chat template (a Qwen3-style one built by the tests):
several turns, the loss on the assistant turns only, reasoning trained on, kept or dropped."""

import json

import pytest

from examples.dflash_trainer.data.records import DataError, read_jsonl

from tests.helpers.chat_tokenizer import qwen3_style_tokenizer

TURNS = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "<think>\nLet me think about the sum.\n</think>\n\nTwo plus two is four."},
    {"role": "user", "content": "Tell me more."},
    {"role": "assistant", "content": "The capital of France is Paris.", "reasoning_content": "step by step"},
]


@pytest.fixture(scope="module")
def tokenizer():
    return qwen3_style_tokenizer()


def _read(tmp_path, tokenizer, reasoning, records=(TURNS,)):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": list(m)}) + "\n" for m in records))
    data = read_jsonl(path, tokenizer=tokenizer, seq_len=256, reasoning=reasoning)
    ids, mask = data.ids[0], data.loss_mask[0]
    length = int((ids != tokenizer.pad_token_id).sum())
    return ids[:length].tolist(), mask[:length].tolist()


def _loss_text(tokenizer, ids, mask):
    """The loss tokens' text, each run of loss tokens on its own line."""
    runs, current = [], []
    for token, loss in zip(ids, mask):
        if loss:
            current.append(token)
        elif current:
            runs.append(tokenizer.decode(current))
            current = []
    return runs + ([tokenizer.decode(current)] if current else [])


def test_the_tokens_are_the_templates_rendering_and_only_assistant_turns_carry_loss(tmp_path, tokenizer):
    ids, mask = _read(tmp_path, tokenizer, "keep")
    assert tokenizer.decode(ids) == tokenizer.apply_chat_template(TURNS, tokenize=False)
    assert ids == tokenizer.encode(tokenizer.apply_chat_template(TURNS, tokenize=False))
    assert _loss_text(tokenizer, ids, mask) == ["Two plus two is four.", "The capital of France is Paris."]


def test_train_puts_the_loss_on_the_last_turns_reasoning_the_template_keeps(tmp_path, tokenizer):
    ids, mask = _read(tmp_path, tokenizer, "train")
    text = tokenizer.decode(ids)
    assert "Let me think" not in text  # the template drops reasoning before the last user turn
    assert _loss_text(tokenizer, ids, mask) == ["Two plus two is four.",
                                                "step by step\n</think>\n\nThe capital of France is Paris."]


def test_drop_removes_every_reasoning_block(tmp_path, tokenizer):
    ids, mask = _read(tmp_path, tokenizer, "drop")
    text = tokenizer.decode(ids)
    assert "step by step" not in text and "Let me think" not in text
    assert "<think>\n\n</think>" in text  # the template's own empty block, as the target sees a turn without one
    assert _loss_text(tokenizer, ids, mask) == ["Two plus two is four.", "The capital of France is Paris."]


def test_prompt_response_records_go_through_the_template_too(tmp_path, tokenizer):
    path = tmp_path / "pr.jsonl"
    path.write_text(json.dumps({"prompt": "Hello, how are you?", "response": "<think>fine</think>I am fine."}) + "\n")
    for reasoning, loss in [("train", ["fine\n</think>\n\nI am fine."]), ("keep", ["I am fine."])]:
        data = read_jsonl(path, tokenizer=tokenizer, seq_len=64, reasoning=reasoning)
        ids, mask = data.ids[0].tolist(), data.loss_mask[0].tolist()
        assert _loss_text(tokenizer, ids, mask) == loss


def test_a_template_that_refuses_the_record_is_one_line_naming_it(tmp_path):
    tokenizer = qwen3_style_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('roles must alternate') }}"
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": TURNS}) + "\n")
    with pytest.raises(DataError, match=r"bad.jsonl:1: the tokenizer's chat template refused the messages .*"
                                        r"roles must alternate"):
        read_jsonl(path, tokenizer=tokenizer, seq_len=64)


def test_an_unknown_reasoning_mode_is_refused():
    from examples.dflash_trainer.config import TrainConfig

    with pytest.raises(ValueError, match=r"reasoning must be one of \['train', 'keep', 'drop'\]"):
        TrainConfig(reasoning="think")
