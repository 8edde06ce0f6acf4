"""The chunked cross-entropy through the LM head against the dense loss: values, gradients, argmax,
in float32 and bfloat16, eager and compiled; and the trainer's step built on it.

Tolerances: float32 1e-5 relative (the two differ only in summation order); bfloat16 2e-2 relative
on the loss and the gradient (both sides round the logits and the gradient to bfloat16 the same
way; what differs is the order of the float32 sums, then one bfloat16 rounding of the gradient).
"""

import pytest
import torch

from examples.dflash_trainer.drafter.chunked_ce import chunked_head_cross_entropy
from examples.dflash_trainer.drafter.loss import dflash_head_loss, dflash_loss

TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2e-2, atol=2e-3)}


def _case(dtype, *, b=2, q=24, h=16, v=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, q, h, generator=g).to(dtype)
    head = (torch.randn(v, h, generator=g) * 0.5).to(dtype)
    labels = torch.randint(0, v, (b, q), generator=g)
    weights = torch.rand(b, q, generator=g) * (torch.rand(b, q, generator=g) > 0.3)  # some zero weights
    return hidden, head, labels, weights


def _dense(hidden, head, labels, weights):
    hidden = hidden.detach().requires_grad_(True)
    logits = torch.nn.functional.linear(hidden, head)
    loss, wsum = dflash_loss(logits, labels, weights)
    loss.backward()
    return loss.detach(), wsum, hidden.grad, logits.argmax(-1)


def _chunked(hidden, head, labels, weights, chunk, fn=dflash_head_loss):
    hidden = hidden.detach().requires_grad_(True)
    loss, wsum, predicted = fn(hidden, head, labels, weights, chunk_tokens=chunk)
    loss.backward()
    return loss.detach(), wsum, hidden.grad, predicted


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 16, 48, 1000])  # 7 does not divide the 48 tokens; 1000 is one chunk
def test_equals_dense_loss_and_gradient(dtype, chunk):
    case = _case(dtype)
    loss, wsum, grad, predicted = _chunked(*case, chunk)
    ref_loss, ref_wsum, ref_grad, ref_predicted = _dense(*case)
    assert grad.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE[dtype])
    torch.testing.assert_close(wsum, ref_wsum)
    torch.testing.assert_close(grad.float(), ref_grad.float(), **TOLERANCE[dtype])
    if dtype == torch.float32:  # bfloat16 logits tie more often, and a tie may resolve either way
        assert torch.equal(predicted, ref_predicted)


def test_gradient_is_scaled_by_upstream_and_weights():
    hidden, head, labels, weights = _case(torch.float32)
    h = hidden.detach().requires_grad_(True)
    total, _ = chunked_head_cross_entropy(h, head, labels, weights, chunk_tokens=5)
    (3.0 * total).backward()
    h_ref = hidden.detach().requires_grad_(True)
    ce = torch.nn.functional.cross_entropy(torch.nn.functional.linear(h_ref, head).flatten(0, 1), labels.flatten(),
                                           reduction="none")
    (3.0 * (ce * weights.flatten()).sum()).backward()
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)
    zero_weight = weights == 0
    assert zero_weight.any() and torch.all(h.grad[zero_weight] == 0)


def test_compiled_equals_eager():
    case = _case(torch.float32)
    compiled = torch.compile(dflash_head_loss, fullgraph=True, dynamic=False)
    loss, wsum, grad, predicted = _chunked(*case, 7, fn=compiled)
    ref_loss, _, ref_grad, ref_predicted = _chunked(*case, 7)
    torch.testing.assert_close(loss, ref_loss, **TOLERANCE[torch.float32])
    torch.testing.assert_close(grad, ref_grad, **TOLERANCE[torch.float32])
    assert torch.equal(predicted, ref_predicted)


def test_trainable_head_is_refused():
    hidden, head, labels, weights = _case(torch.float32)
    with pytest.raises(ValueError, match="no gradient to the LM head weight"):
        chunked_head_cross_entropy(hidden, head.requires_grad_(True), labels, weights)


def test_bad_chunk_is_refused():
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        chunked_head_cross_entropy(*_case(torch.float32), chunk_tokens=0)
