"""Acceptance length by greedy speculative decoding on a tiny random Qwen3."""

import pytest
import torch

from examples.dflash_trainer.eval import acceptance_length, dflash_proposer, repeat_last_token
from examples.dflash_trainer.drafter.model import DFlashDrafter
from tests.helpers.tiny_run import tiny_target

MASK, BS = 299, 4


@pytest.fixture(scope="module")
def target():
    return tiny_target(300, MASK)


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 290, (n,), generator=g) for n in (3, 7)]


def _greedy(target, tokens, count):
    out = tokens
    for _ in range(count):
        logits, _ = target.logits_and_features(out[None])
        out = torch.cat([out, logits[0, -1].argmax()[None]])
    return out[tokens.shape[0]:]


def test_oracle_drafter_accepts_every_block(target, prompts):
    def oracle(tokens, context, block_size):
        # The context is the target's features of every token but the newest (the anchor).
        assert context.shape[0] == tokens.shape[0] - 1
        torch.testing.assert_close(context, target.features(tokens[None, :-1])[0])
        return _greedy(target, tokens, block_size - 1)

    result = acceptance_length(target, oracle, prompts, BS, max_new_tokens=9, mask_token_id=MASK)
    assert result["tau"] == BS
    assert result["accepted_hist"] == [0, 0, 0, result["steps"]]
    assert result["steps"] == 2 * 2  # per prompt: 1 prefill token + 2 blocks of 4 >= 9


@pytest.mark.parametrize("right", [0, 1, 2])
def test_accepts_the_matching_prefix(target, prompts, right):
    def partly_right(tokens, context, block_size):
        draft = _greedy(target, tokens, block_size - 1)
        draft[right] = (draft[right] + 1) % 290  # first `right` tokens match, then a miss
        return draft

    result = acceptance_length(target, partly_right, prompts, BS, 6, MASK)
    assert result["tau"] == right + 1
    assert result["accepted_hist"][right] == result["steps"]


def test_random_drafter_and_baseline(target, prompts):
    torch.manual_seed(3)
    drafter = DFlashDrafter.from_target_config(target.config, target.embed_tokens,
                                               target.lm_head, num_layers=1, n=2)
    drafter.train()
    result = acceptance_length(target, drafter, prompts, BS, 8, MASK)
    assert drafter.training  # eval put it back the way it was
    drafter.eval()  # the reference proposes as eval does: dropout off
    assert result == _reference(target, dflash_proposer(drafter, MASK), prompts, BS, 8)
    baseline = acceptance_length(target, repeat_last_token, prompts, BS, 8, MASK)
    assert baseline == _reference(target, repeat_last_token, prompts, BS, 8)


def _reference(target, propose, prompts, block_size, max_new_tokens):
    """What acceptance_length must return, worked out another way: the tokens are the target's greedy
    continuation (speculative decoding changes how many calls make them, never which), so a step's
    accepted count is how far its draft agrees with that continuation; no KV cache, no stop tokens."""
    hist, tokens = [0] * block_size, 0
    for prompt in prompts:
        greedy = _greedy(target, prompt, max_new_tokens + block_size)
        seq, produced = torch.cat([prompt, greedy[:1]]), 1
        while produced < max_new_tokens:
            draft = propose(seq, target.features(seq[None, :-1])[0], block_size)
            ahead = greedy[produced:produced + block_size - 1]
            accepted = int((draft == ahead).long().cumprod(0).sum())
            hist[accepted] += 1
            seq = torch.cat([seq, greedy[produced:produced + accepted + 1]])
            produced += accepted + 1
        tokens += produced
    steps = sum(hist)
    assert steps > 0
    return {"tau": sum((j + 1) * c for j, c in enumerate(hist)) / steps, "steps": steps, "tokens": tokens,
            "accepted_hist": hist}


def test_stop_token_ends_the_prompt(target, prompts):
    first = _greedy(target, prompts[0], 1)
    result = acceptance_length(target, repeat_last_token, prompts[:1], BS, 50, MASK,
                               stop_token_ids=[int(first)])
    assert result["steps"] == 0 and result["tokens"] == 1 and result["tau"] == 1.0


def test_the_kv_cache_decodes_what_rereading_the_prefix_decodes(target, prompts):
    """An oracle that gets a varying number of tokens right: rejected tokens must leave the cache,
    and the features handed to the drafter must be those of a full forward."""
    def partly_right(tokens, context, block_size):
        torch.testing.assert_close(context, target.features(tokens[None, :-1])[0], rtol=1e-4, atol=1e-5)
        draft = _greedy(target, tokens, block_size - 1)
        wrong = tokens.shape[0] % block_size  # 0 .. block_size - 1: the first wrong slot, if any
        if wrong < draft.shape[0]:
            draft[wrong] = (draft[wrong] + 1) % 290
        return draft

    for block in (4, 8):
        cached = acceptance_length(target, partly_right, prompts, block, max_new_tokens=20, mask_token_id=MASK)
        reread = acceptance_length(target, partly_right, prompts, block, max_new_tokens=20, mask_token_id=MASK,
                                   kv_cache=False)
        assert cached == reread
        assert sum(cached["accepted_hist"][1:]) > 0 and cached["accepted_hist"][0] > 0  # some accepted, some not
