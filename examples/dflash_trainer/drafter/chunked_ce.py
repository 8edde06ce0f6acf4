"""Weighted cross-entropy through the target's frozen LM head, a chunk of tokens at a time.

A drafter step at the paper's settings has ``batch * 512 * 16`` outputs over a vocabulary of
151,936 tokens: its ``[tokens, vocab]`` logits alone are tens of GiB, and the dense loss keeps
several copies of them alive (the logits, their float32 copy, the softmax, its gradient). Here the
logits exist one chunk at a time: the forward keeps only each token's log-sum-exp and argmax, and the
backward recomputes a chunk's logits to form its gradient ``w * (softmax - onehot)`` and multiplies
it straight back through the head. The number of chunks follows from the shapes alone and nothing
reads a value on the host, so the function compiles and captures like any other static-shape op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

DEFAULT_CHUNK_TOKENS = 512


class _ChunkedHeadCE(torch.autograd.Function):
    """sum_t w_t * CE(hidden_t @ weight.T, label_t), and each token's argmax; grad to ``hidden`` only."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, weights, chunk: int):
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        lse_parts, argmax_parts = [], []
        for start in range(0, hidden.shape[0], chunk):
            logits = F.linear(hidden[start:start + chunk], weight).float()
            picked = logits.gather(1, labels[start:start + chunk, None]).squeeze(1)
            top, argmax = logits.max(dim=-1)
            # log-sum-exp in place on the chunk's logits (torch.logsumexp would allocate a second copy)
            lse = logits.sub_(top[:, None]).exp_().sum(-1).log_().add_(top)
            total = total + ((lse - picked) * weights[start:start + chunk]).sum()
            lse_parts.append(lse)
            argmax_parts.append(argmax)
            del logits  # before the next chunk's are made, not after
        predicted = torch.cat(argmax_parts)
        ctx.save_for_backward(hidden, weight, labels, weights, torch.cat(lse_parts))
        ctx.chunk = chunk
        ctx.mark_non_differentiable(predicted)
        return total, predicted

    @staticmethod
    def backward(ctx, grad_total, grad_predicted):
        hidden, weight, labels, weights, lse = ctx.saved_tensors
        chunk = ctx.chunk
        parts = []
        for start in range(0, hidden.shape[0], chunk):
            stop = start + chunk
            # In place on the chunk's float32 logits: one [chunk, vocab] buffer at a time.
            grad = F.linear(hidden[start:stop], weight).float()
            grad.sub_(lse[start:stop, None]).exp_()  # softmax
            grad.scatter_add_(1, labels[start:stop, None], torch.full_like(lse[start:stop, None], -1.0))  # - onehot
            grad.mul_((weights[start:stop] * grad_total)[:, None])
            parts.append(grad.to(hidden.dtype) @ weight)
            del grad  # before the next chunk's are made, not after
        return torch.cat(parts), None, None, None, None


def chunked_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                               weights: torch.Tensor, *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum(w * CE), argmax)`` of the logits ``hidden @ weight.T``, never all of them at once.

    hidden [..., H] (the drafter's last hidden states), weight [V, H] (the frozen LM head: it gets no
    gradient, and one that asks for it is refused), labels and weights [...]; both matmuls run in
    ``dtype`` (default: ``weight``'s), the softmax in float32, as the dense loss does them.
    """
    if weight.requires_grad:
        raise ValueError("chunked_head_cross_entropy gives no gradient to the LM head weight; pass it frozen "
                         "(requires_grad=False) or detached")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    dtype = dtype or weight.dtype
    flat = hidden.reshape(-1, hidden.shape[-1]).to(dtype)
    total, predicted = _ChunkedHeadCE.apply(flat, weight.to(dtype), labels.reshape(-1),
                                            weights.reshape(-1).float(), chunk_tokens)
    return total, predicted.reshape(labels.shape)
