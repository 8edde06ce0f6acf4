"""The DFlash mask, anchors, labels and weights against plain-loop references.

Each known pitfall (SpecForge #455, #427, #473) has its own test.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.dflash_trainer.drafter.loss import (block_positions, build_blocks, dflash_accuracy,
                                          dflash_attention_mask, dflash_loss, labels_and_weights,
                                          sample_anchors)

MASK = 99


# ---- plain-loop references, obviously right by inspection -------------------------------------

def ref_mask(anchors, keep, seq_len, bs):
    b, n = len(anchors), len(anchors[0])
    out = torch.zeros(b, n * bs, seq_len + n * bs, dtype=torch.bool)
    for i in range(b):
        for blk in range(n):
            if not keep[i][blk]:
                continue
            for k in range(bs):
                q = blk * bs + k
                for kv in range(seq_len):
                    out[i, q, kv] = kv < anchors[i][blk]
                for j in range(bs):
                    out[i, q, seq_len + blk * bs + j] = True
    return out


def ref_labels_weights(ids, loss_mask, anchors, keep, bs, gamma):
    b, s = len(ids), len(ids[0])
    n = len(anchors[0])
    labels = torch.zeros(b, n * bs, dtype=torch.long)
    weights = torch.zeros(b, n * bs)
    for i in range(b):
        for blk in range(n):
            for k in range(bs):
                p = anchors[i][blk] + k
                labels[i, blk * bs + k] = ids[i][min(p, s - 1)]
                if keep[i][blk] and k >= 1 and p < s and loss_mask[i][p]:
                    weights[i, blk * bs + k] = math.exp(-(k - 1) / gamma)
    return labels, weights


def ref_valid_anchors(row):
    return [i for i in range(len(row) - 1) if row[i] and row[i + 1]]


def _case(loss_mask_rows, anchors, keep, s):
    ids = torch.arange(100, 100 + s).repeat(len(loss_mask_rows), 1)  # ids[p] = 100 + p
    return ids, torch.tensor(loss_mask_rows), torch.tensor(anchors), torch.tensor(keep)


# ---- pitfalls -------------------------------------------------------------------------------

def test_labels_are_same_position_not_shifted():
    ids, lm, anchors, keep = _case([[1] * 10], [[3]], [[True]], 10)
    labels, _ = labels_and_weights(ids, lm, anchors, keep, block_size=4, gamma=4.0)
    assert labels.tolist() == [[103, 104, 105, 106]]  # output k predicts ids[a + k]
    assert torch.equal(labels, ref_labels_weights(ids.tolist(), lm.tolist(), anchors.tolist(),
                                                  keep.tolist(), 4, 4.0)[0])


def test_anchor_position_has_zero_weight():
    ids, lm, anchors, keep = _case([[1] * 10], [[3]], [[True]], 10)
    _, w = labels_and_weights(ids, lm, anchors, keep, block_size=4, gamma=4.0)
    assert w[0, 0] == 0 and (w[0, 1:] > 0).all()


def test_decay_is_exp_minus_k_minus_one_over_gamma():
    ids, lm, anchors, keep = _case([[1] * 20], [[2]], [[True]], 20)
    _, w = labels_and_weights(ids, lm, anchors, keep, block_size=8, gamma=4.0)
    expected = [0.0] + [math.exp(-(k - 1) / 4.0) for k in range(1, 8)]
    assert w[0].tolist() == pytest.approx(expected)
    assert w[0, 1] == 1.0  # not exp(-1/gamma)


def test_context_is_strictly_before_anchor():
    anchors, keep = torch.tensor([[5]]), torch.tensor([[True]])
    m = dflash_attention_mask(anchors, keep, seq_len=10, block_size=3)
    assert m[0, :, :5].all() and not m[0, :, 5:10].any()  # sees 0..4, not the anchor 5
    assert torch.equal(m, ref_mask([[5]], [[True]], 10, 3))


def test_bidirectional_within_block():
    m = dflash_attention_mask(torch.tensor([[4]]), torch.tensor([[True]]), seq_len=8, block_size=4)
    assert m[0, 0, 8:12].all()  # the first query sees the last block slot: not causal
    assert torch.equal(m, ref_mask([[4]], [[True]], 8, 4))


def test_blocks_are_isolated():
    anchors, keep = torch.tensor([[2, 6]]), torch.tensor([[True, True]])
    m = dflash_attention_mask(anchors, keep, seq_len=10, block_size=3)
    assert not m[0, 0:3, 13:16].any() and not m[0, 3:6, 10:13].any()
    assert torch.equal(m, ref_mask([[2, 6]], [[True, True]], 10, 3))


# ---- vectorised code == loop reference on random inputs ---------------------------------------

@st.composite
def batches(draw):
    b = draw(st.integers(1, 3))
    s = draw(st.integers(2, 24))
    n = draw(st.integers(1, 6))
    bs = draw(st.integers(2, 5))
    rows = [draw(st.lists(st.integers(0, 1), min_size=s, max_size=s)) for _ in range(b)]
    seed = draw(st.integers(0, 2**31 - 1))
    gamma = draw(st.floats(0.5, 10.0))
    return rows, n, bs, seed, gamma


@settings(max_examples=60, deadline=None)
@given(batches())
def test_matches_loop_reference(case):
    rows, n, bs, seed, gamma = case
    lm = torch.tensor(rows)
    s = lm.shape[1]
    ids = torch.randint(0, 50, lm.shape, generator=torch.Generator().manual_seed(seed))
    anchors, keep = sample_anchors(lm, n, torch.Generator().manual_seed(seed))
    assert anchors.shape == keep.shape == (lm.shape[0], n)
    for i, row in enumerate(rows):
        valid = ref_valid_anchors(row)
        picked = anchors[i][keep[i]].tolist()
        assert len(picked) == min(n, len(valid))
        assert set(picked) <= set(valid) and picked == sorted(set(picked))
        assert keep[i].tolist() == [True] * len(picked) + [False] * (n - len(picked))
        assert (anchors[i][~keep[i]] == 0).all()
    a, k = anchors.tolist(), keep.tolist()
    assert torch.equal(dflash_attention_mask(anchors, keep, s, bs), ref_mask(a, k, s, bs))
    labels, w = labels_and_weights(ids, lm, anchors, keep, bs, gamma)
    ref_l, ref_w = ref_labels_weights(ids.tolist(), rows, a, k, bs, gamma)
    assert torch.equal(labels, ref_l)
    torch.testing.assert_close(w, ref_w)


def test_blocks_and_positions():
    ids = torch.arange(100, 110)[None]
    anchors = torch.tensor([[2, 7]])
    assert build_blocks(ids, anchors, MASK, 3).tolist() == [[102, MASK, MASK, 107, MASK, MASK]]
    assert block_positions(anchors, 3).tolist() == [[2, 3, 4, 7, 8, 9]]


# ---- static shapes and padding --------------------------------------------------------------

@pytest.mark.parametrize("valid", [0, 1, 3, 30])
def test_shapes_do_not_depend_on_valid_anchor_count(valid):
    s, n, bs = 32, 8, 4
    lm = torch.zeros(2, s, dtype=torch.long)
    lm[:, :valid + 1 if valid else 0] = 1  # `valid` anchor positions
    anchors, keep = sample_anchors(lm, n)
    assert anchors.shape == keep.shape == (2, n)
    assert keep.sum(1).tolist() == [min(n, valid)] * 2
    ids = torch.randint(0, 50, (2, s))
    assert dflash_attention_mask(anchors, keep, s, bs).shape == (2, n * bs, s + n * bs)
    labels, w = labels_and_weights(ids, lm, anchors, keep, bs, 4.0)
    assert labels.shape == w.shape == (2, n * bs)
    assert (w.view(2, n, bs)[~keep] == 0).all()  # padded blocks carry no weight


def test_more_anchors_than_positions_pads():
    lm = torch.ones(1, 5, dtype=torch.long)
    anchors, keep = sample_anchors(lm, 10)
    assert anchors.shape == (1, 10) and keep.sum() == 4  # positions 0..3 are valid
    assert anchors[0, :4].tolist() == [0, 1, 2, 3]


def test_anchor_sampling_is_seeded():
    lm = torch.ones(2, 64, dtype=torch.long)
    a1, _ = sample_anchors(lm, 8, torch.Generator().manual_seed(3))
    a2, _ = sample_anchors(lm, 8, torch.Generator().manual_seed(3))
    a3, _ = sample_anchors(lm, 8, torch.Generator().manual_seed(4))
    assert torch.equal(a1, a2) and not torch.equal(a1, a3)


# ---- loss ----------------------------------------------------------------------------------

def test_loss_is_weighted_mean_of_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 6))
    w = torch.rand(2, 6)
    loss, wsum = dflash_loss(logits, labels, w)
    ce = [[-torch.log_softmax(logits[i, j].float(), -1)[labels[i, j]] for j in range(6)]
          for i in range(2)]
    ref = sum(w[i, j] * ce[i][j] for i in range(2) for j in range(6)) / w.sum()
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(wsum, w.sum())


def test_all_zero_weights_give_zero_loss_not_nan():
    logits = torch.randn(1, 4, 7, requires_grad=True)
    loss, wsum = dflash_loss(logits, torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4))
    loss.backward()
    assert loss.item() == 0 and wsum.item() == 0 and logits.grad.isfinite().all()


def test_accuracy_counts_weighted_outputs_and_first_draft():
    labels = torch.tensor([[5, 1, 2, 5, 3, 4]])  # two blocks of 3
    logits = torch.nn.functional.one_hot(torch.tensor([[0, 1, 0, 0, 0, 4]]), 6).float()
    w = torch.tensor([[0.0, 1.0, 0.5, 0.0, 1.0, 0.5]])
    acc, first = dflash_accuracy(logits, labels, w, block_size=3)
    assert acc.item() == pytest.approx(2 / 4)  # slots 1 and 5 right out of 1, 2, 4, 5
    assert first.item() == pytest.approx(1 / 2)  # k=1 slots: 1 right, 4 wrong


def test_target_step_draws_the_anchors_sample_anchors_draws():
    from examples.dflash_trainer.drafter.loss import anchor_scores
    from examples.dflash_trainer.drafter.step import make_target_step

    lm = torch.zeros(3, 40, dtype=torch.long)
    lm[:, 5:] = 1
    lm[1, 30:] = 0
    expected = sample_anchors(lm, 8, torch.Generator().manual_seed(11))
    scores = anchor_scores(lm, torch.Generator().manual_seed(11))  # the target workers' draw
    features, anchors, keep = make_target_step(lambda ids: ids * 2, 8)(torch.ones(3, 40), lm, scores)
    assert torch.equal(anchors, expected[0]) and torch.equal(keep, expected[1])
    assert torch.equal(features, torch.full((3, 40), 2.0))
