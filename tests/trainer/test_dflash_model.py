"""The drafter, the target-layer choice and the target adapter, on a tiny random Qwen3."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from examples.dflash_trainer.drafter.loss import (block_positions, build_blocks, dflash_attention_mask,
                                          dflash_loss, labels_and_weights, sample_anchors)
from examples.dflash_trainer.drafter.model import DFlashDrafter, target_layer_ids
from examples.dflash_trainer.target import TargetModel, choose_mask_token_id
from tests.helpers.tiny_run import tiny_target

VOCAB, MASK = 300, 299


@pytest.fixture(scope="module")
def target():
    return tiny_target(VOCAB, MASK)


@pytest.fixture
def drafter(target):
    torch.manual_seed(1)
    return DFlashDrafter.from_target_config(target.config, target.embed_tokens, target.lm_head,
                                            num_layers=2, n=2)


def _run(drafter, features, block_ids, anchors, keep, bs):
    b, s = features.shape[:2]
    mask = dflash_attention_mask(anchors, keep, s, bs)
    ctx_pos = torch.arange(s).expand(b, s)
    return drafter(block_ids, features, block_positions(anchors, bs), ctx_pos, mask)


# ---- target layer choice ----------------------------------------------------------------------

def test_target_layer_ids_match_paper():
    assert target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert target_layer_ids(36, 1) == [1]
    assert target_layer_ids(6, 2) == [1, 3]


@given(st.integers(2, 10), st.integers(0, 60))
def test_target_layer_ids_spread_first_to_third_from_last(n, extra):
    layers = n + 3 + extra
    ids = target_layer_ids(layers, n)
    assert ids[0] == 1 and ids[-1] == layers - 3
    assert ids == sorted(set(ids)) and len(ids) == n


def test_target_layer_ids_too_few_layers():
    with pytest.raises(ValueError, match="L >= n\\+3 = 8"):
        target_layer_ids(6, 5)
    with pytest.raises(ValueError, match="at least 2 layers"):
        target_layer_ids(1, 1)


# ---- drafter --------------------------------------------------------------------------------

def test_target_modules_are_neither_parameters_nor_saved(drafter, target):
    keys = drafter.state_dict().keys()
    assert not any("embed" in k or "lm_head" in k for k in keys)
    own = {id(p) for p in drafter.parameters()}
    assert id(target.embed_tokens.weight) not in own and id(target.lm_head.weight) not in own
    assert all(p.requires_grad for p in drafter.parameters())
    assert not target.lm_head.weight.requires_grad


def test_trains_through_target_features(drafter, target):
    # Features come from no_grad (not inference_mode), so the drafter can save them for backward.
    ids = torch.randint(0, 290, (2, 24))
    lm = torch.ones_like(ids)
    anchors, keep = sample_anchors(lm, 4)
    logits = _run(drafter, target.features(ids), build_blocks(ids, anchors, MASK, 4),
                  anchors, keep, 4)
    assert logits.shape == (2, 16, VOCAB)
    loss, _ = dflash_loss(logits, *labels_and_weights(ids, lm, anchors, keep, 4, 4.0))
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in drafter.parameters())
    assert target.lm_head.weight.grad is None


def test_padded_blocks_produce_no_nan(drafter):
    feats = torch.randn(2, 12, 128)
    anchors = torch.zeros(2, 3, dtype=torch.long)
    keep = torch.zeros(2, 3, dtype=torch.bool)  # every block is padding: rows see nothing
    logits = _run(drafter, feats, torch.full((2, 12), MASK), anchors, keep, 4)
    assert logits.isfinite().all()
    loss, wsum = dflash_loss(logits, torch.zeros(2, 12, dtype=torch.long), torch.zeros(2, 12))
    loss.backward()
    assert loss.item() == 0 and wsum.item() == 0
    assert all(p.grad.isfinite().all() for p in drafter.parameters())


def test_model_blocks_isolated_and_context_strict(drafter):
    torch.manual_seed(2)
    feats = torch.randn(1, 16, 128)
    anchors, keep = torch.tensor([[4, 10]]), torch.tensor([[True, True]])
    blocks = torch.randint(0, 290, (1, 8))
    base = _run(drafter, feats, blocks, anchors, keep, 4)
    other = blocks.clone()
    other[0, 5] = (other[0, 5] + 1) % 290  # change block 1 only
    changed = _run(drafter, feats, other, anchors, keep, 4)
    torch.testing.assert_close(changed[0, :4], base[0, :4])  # block 0 does not see block 1
    assert not torch.allclose(changed[0, 4:], base[0, 4:])  # bidirectional: slot 4 sees slot 5
    late = feats.clone()
    late[0, 4:] += 1.0  # features at or after anchor 4 (the anchor itself included)
    moved = _run(drafter, late, blocks, anchors, keep, 4)
    torch.testing.assert_close(moved[0, :4], base[0, :4])


def test_from_target_config_copies_shapes(drafter, target):
    assert drafter.arch["hidden_size"] == 64 and drafter.arch["num_kv_heads"] == 2
    assert drafter.arch["head_dim"] == 16 and drafter.arch["rope_theta"] == 10000.0
    assert drafter.fc.in_features == 2 * 64


# ---- target adapter -------------------------------------------------------------------------

def test_features_are_selected_hidden_states(target):
    ids = torch.randint(0, 290, (1, 9))
    out = target.model(input_ids=ids, output_hidden_states=True, use_cache=False)
    expected = torch.cat([out.hidden_states[2], out.hidden_states[4]], -1)  # layers 1 and 3
    torch.testing.assert_close(target.features(ids), expected)
    logits, feats = target.logits_and_features(ids)
    torch.testing.assert_close(logits, out.logits)
    torch.testing.assert_close(feats, expected)


@pytest.mark.parametrize("load", [TargetModel.from_pretrained, TargetModel.shape_only])
def test_from_pretrained_errors(tmp_path, load):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load(tmp_path / "nope", num_feature_layers=2)
    with pytest.raises(FileNotFoundError, match="config.json is missing"):
        load(tmp_path, num_feature_layers=2)


def test_unsupported_layout():
    with pytest.raises(ValueError, match="Qwen3/Llama layout"):
        TargetModel(torch.nn.Linear(2, 2), num_feature_layers=1)


def test_mask_token_needs_tokenizer_or_id(target):
    bare = TargetModel(target.model, num_feature_layers=2)
    with pytest.raises(ValueError, match="pass mask_token_id"):
        bare.mask_token_id
    with pytest.raises(ValueError, match="not a row"):
        TargetModel(target.model, num_feature_layers=2, mask_token_id=VOCAB)


class _Tok:
    """Just what choose_mask_token_id reads from a HF tokenizer."""

    def __init__(self, size, specials, chat_template=None):
        self.size, self.all_special_ids = size, list(specials)
        self.names = specials
        self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id = 0, 1, 2, None
        self.chat_template = chat_template

    def __len__(self):
        return self.size

    def convert_ids_to_tokens(self, i):
        return self.names[i]


def test_choose_mask_token(target):
    # The embedding has 300 rows: the first row past the tokenizer wins.
    assert choose_mask_token_id(target.model, _Tok(290, {})) == 290
    full = {0: "<s>", 1: "</s>", 2: "<pad>", 7: "<|im_start|>", 9: "<|reserved_3|>"}
    assert choose_mask_token_id(target.model, _Tok(VOCAB, full)) == 9
    no_reserved = {0: "<s>", 1: "</s>", 7: "<|im_start|>", 8: "<|tool|>"}
    assert choose_mask_token_id(target.model, _Tok(VOCAB, no_reserved, "<|im_start|>")) == 8
    with pytest.raises(ValueError, match="pass mask_token_id"):
        choose_mask_token_id(target.model, _Tok(VOCAB, {0: "<s>", 1: "</s>"}))


def _frames_compiled(target: TargetModel) -> int:
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(target.features, backend=backend)
    for _ in range(2):
        compiled(torch.randint(0, 100, (2, 8)))
    torch._dynamo.reset()
    return len(frames)


def test_a_loaded_target_compiles_its_features_as_one_frame(tiny_assets):
    """transformers installs its hidden-state hooks in the first forward that asks for hidden states,
    under a lock Dynamo cannot trace: loading runs that forward eagerly, so the first compiled call
    has no graph break (the target's compile is one frame, not a prologue and a resumed second one)."""
    loaded = TargetModel.from_pretrained(tiny_assets.target_dir, num_feature_layers=1)
    assert _frames_compiled(loaded) == 1
    fresh = TargetModel(type(loaded.model).from_pretrained(tiny_assets.target_dir), num_feature_layers=1)
    assert _frames_compiled(fresh) == 2  # without that forward: the graph break this test is about
