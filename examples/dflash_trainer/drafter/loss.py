"""Anchors, blocks, the DFlash attention mask, labels, weights and the loss.

Everything here is vectorised with shapes fixed by (batch, seq_len, num_anchors, block_size):
no boolean indexing, no `.item()`, no data-dependent Python branches, so it can run inside a
CUDA-graph-captured step. Unused anchor slots are padded with keep=False and weight 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunked_ce import DEFAULT_CHUNK_TOKENS, chunked_head_cross_entropy


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample up to `num_anchors` anchors per row, uniformly without replacement, sorted.

    An anchor i needs loss_mask[i] and loss_mask[i+1], so its block has at least one token to
    learn. Returns anchors [B,N] long (padding slots hold 0) and keep [B,N] bool.
    """
    return anchors_from_scores(loss_mask, num_anchors, anchor_scores(loss_mask, generator))


def anchor_scores(loss_mask: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """The uniform [0, 1) draws behind sample_anchors(), one per position, on loss_mask's device."""
    return torch.rand(loss_mask.shape, generator=generator, device=loss_mask.device, dtype=torch.float32)


def anchors_from_scores(loss_mask: torch.Tensor, num_anchors: int,
                        scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_anchors() given its uniform [0, 1) draws ``scores`` [B,S]: the draws can be made
    on the host with a seeded generator and the rest run on the device, inside a graph."""
    lm = loss_mask.bool()
    b, s = lm.shape
    valid = torch.cat([lm[:, :-1] & lm[:, 1:], torch.zeros_like(lm[:, :1])], dim=1)
    # Random scores + top-k is a uniform sample without replacement; invalid slots score -1
    # (rand is in [0, 1)), so they are only picked once the valid ones run out.
    scores = torch.where(valid, scores, torch.full_like(scores, -1.0))
    k = min(num_anchors, s)
    top, idx = scores.topk(k, dim=1)
    keep = top >= 0
    # Sort kept anchors ascending with padding last: padding sorts as s.
    key, order = torch.where(keep, idx, torch.full_like(idx, s)).sort(dim=1)
    keep = keep.gather(1, order)
    anchors = torch.where(keep, key, torch.zeros_like(key))
    if k < num_anchors:  # static: depends on shapes only
        pad = num_anchors - k
        anchors = torch.cat([anchors, anchors.new_zeros(b, pad)], dim=1)
        keep = torch.cat([keep, keep.new_zeros(b, pad)], dim=1)
    return anchors, keep


def build_blocks(ids: torch.Tensor, anchors: torch.Tensor, mask_token_id: int,
                 block_size: int) -> torch.Tensor:
    """Block n = [ids[a_n], MASK, ..., MASK]; blocks packed to [B, N*block_size]."""
    b, n = anchors.shape
    first = ids.gather(1, anchors)[..., None]
    masks = torch.full((b, n, block_size - 1), mask_token_id, dtype=ids.dtype, device=ids.device)
    return torch.cat([first, masks], dim=2).reshape(b, n * block_size)


def block_positions(anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """Position of output k of block n is a_n + k (may run past seq_len; weight 0 there)."""
    b, n = anchors.shape
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors[..., None] + offsets).reshape(b, n * block_size)


def dflash_attention_mask(anchors: torch.Tensor, keep: torch.Tensor, seq_len: int,
                          block_size: int) -> torch.Tensor:
    """Bool [B, N*Bs, S + N*Bs], True = may attend; keys are [context (S) ; blocks].

    A query of block n sees context key kv iff keep[n] and kv < a_n (strictly: the anchor's own
    feature is not known at inference), and every key of block n (bidirectional) iff keep[n].
    Blocks never see each other.
    """
    b, n = anchors.shape
    q_len = n * block_size
    device = anchors.device
    q_block = torch.arange(q_len, device=device) // block_size  # [Q]
    kv = torch.arange(seq_len + q_len, device=device)  # [S+Q]
    anchor_q = anchors.repeat_interleave(block_size, dim=1)  # [B,Q]
    keep_q = keep.repeat_interleave(block_size, dim=1)  # [B,Q]
    context = (kv < seq_len)[None, None, :] & (kv[None, None, :] < anchor_q[..., None])
    same_block = (kv >= seq_len)[None, :] & (((kv - seq_len) // block_size)[None, :]
                                             == q_block[:, None])  # [Q,S+Q]
    return (context | same_block[None]) & keep_q[..., None]


def labels_and_weights(ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor,
                       keep: torch.Tensor, block_size: int,
                       gamma: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-position labels ids[a_n + k] and weights, both [B, N*Bs].

    w = keep * (k >= 1) * (a_n + k < S) * loss_mask[a_n + k] * exp(-(k-1)/gamma). Output k=0
    would only copy the anchor token it was given, so it carries no weight.
    """
    b, n = anchors.shape
    s = ids.shape[1]
    k = torch.arange(block_size, device=ids.device)
    pos = anchors[..., None] + k  # [B,N,Bs]
    in_range = pos < s
    safe = pos.clamp(max=s - 1).reshape(b, n * block_size)
    labels = ids.gather(1, safe)
    lm = loss_mask.gather(1, safe).reshape(b, n, block_size).float()
    decay = torch.exp(-(k - 1).clamp(min=0).float() / gamma) * (k >= 1).float()
    weights = keep[..., None].float() * in_range.float() * lm * decay
    return labels, weights.reshape(b, n * block_size)


def dflash_loss(logits: torch.Tensor, labels: torch.Tensor,
                weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """sum(w * CE) / sum(w) in float32; returns (loss, weight_sum). Zero weights give loss 0."""
    ce = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="none")
    w = weights.float().flatten()
    weight_sum = w.sum()
    return (w * ce).sum() / weight_sum.clamp(min=1e-6), weight_sum


def dflash_head_loss(hidden: torch.Tensor, head_weight: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                     *, chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
                     dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dflash_loss() of the logits ``hidden @ head_weight.T`` without holding them: the cross-entropy
    runs ``chunk_tokens`` outputs at a time (chunked_ce). Returns (loss, weight_sum, argmax [B,Q])."""
    total, predicted = chunked_head_cross_entropy(hidden, head_weight, labels, weights,
                                                  chunk_tokens=chunk_tokens, dtype=dtype)
    weight_sum = weights.float().sum()
    return total / weight_sum.clamp(min=1e-6), weight_sum, predicted


@torch.no_grad()
def dflash_accuracy(logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                    block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 accuracy over weighted outputs, and at k=1 alone (the first drafted token,
    which bounds acceptance). Both are 0-dim float tensors; no host sync."""
    return prediction_accuracy(logits.argmax(-1), labels, weights, block_size)


@torch.no_grad()
def prediction_accuracy(predicted: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                        block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """dflash_accuracy() given the argmax tokens ``predicted`` [B,Q] instead of the logits."""
    counted = (weights > 0).float()
    correct = (predicted == labels).float() * counted
    q = torch.arange(labels.shape[1], device=labels.device)
    first = (q % block_size == 1).float()  # 1 at each block's k=1
    acc = correct.sum() / counted.sum().clamp(min=1.0)
    acc_first = (correct * first).sum() / (counted * first).sum().clamp(min=1.0)
    return acc, acc_first
