"""The step functions of both workers, static-shape and device-only (execution policy decides
whether they run eager, as CUDAGraph Trees or captured whole).

Inputs have fixed shapes (batch, seq_len, num_anchors), so a compiled graph is recorded once
and replayed; there are no host syncs. The drafter's loss comes with a small metrics vector that
stays on the device: [loss, weight_sum, accuracy, accuracy at k=1].
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from .loss import (anchors_from_scores, block_positions, build_blocks, dflash_attention_mask, dflash_head_loss,
                   labels_and_weights, prediction_accuracy)
from .chunked_ce import DEFAULT_CHUNK_TOKENS
from .grads import FlatGrads
from .model import DFlashDrafter

StepFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def make_step_fn(drafter: DFlashDrafter, *, block_size: int, gamma: float, mask_token_id: int,
                 autocast_dtype: torch.dtype | None, loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> StepFn:
    """The loss of one batch and its metrics; the LM head's logits are never whole (loss.dflash_head_loss)."""
    head_dtype = autocast_dtype or drafter.lm_head.weight.dtype  # what the head's matmul runs in under the step's autocast

    def drafter_loss(ids, loss_mask, features, anchors, keep):
        b, s = ids.shape
        autocast = (
            torch.autocast(ids.device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
        )
        with autocast:
            block_ids = build_blocks(ids, anchors, mask_token_id, block_size)
            q_pos = block_positions(anchors, block_size)
            ctx_pos = torch.arange(s, device=ids.device).expand(b, s)
            mask = dflash_attention_mask(anchors, keep, s, block_size)
            hidden = drafter.hidden(block_ids, features, q_pos, ctx_pos, mask)
        labels, weights = labels_and_weights(ids, loss_mask, anchors, keep, block_size, gamma)
        loss, weight_sum, predicted = dflash_head_loss(hidden, drafter.lm_head.weight, labels, weights,
                                                       chunk_tokens=loss_chunk_tokens, dtype=head_dtype)
        acc, acc_first = prediction_accuracy(predicted, labels, weights, block_size)
        return loss, torch.stack([loss.detach(), weight_sum, acc, acc_first])

    return drafter_loss


def make_target_step(features: Callable[[torch.Tensor], torch.Tensor], num_anchors: int) -> Callable:
    """A target worker's device work for one batch: the target's features and the batch's
    anchors, from the anchor draws ``scores`` made on the host (loss.sample_anchors' recipe)."""

    def target_step(ids, loss_mask, scores):
        anchors, keep = anchors_from_scores(loss_mask, num_anchors, scores)
        return features(ids), anchors, keep

    return target_step


def make_forward_backward(step_fn: StepFn, grads: FlatGrads) -> Callable[..., None]:
    """Zero the gradients, run the step's loss.backward() into them (grads.FlatGrads) and put the
    metrics in ``grads.extras``; captured whole with whole-step graphs, zeroing included."""

    def forward_backward(ids, loss_mask, features, anchors, keep) -> None:
        grads.zero_()
        loss, metrics = step_fn(ids, loss_mask, features, anchors, keep)
        loss.backward()
        grads.extras.copy_(metrics)

    return forward_backward


def make_update(grads: FlatGrads, optimizer: torch.optim.Optimizer, history: torch.Tensor, *,
                max_norm: float, first_step: int) -> Callable[[], None]:
    """After averaging: clip, AdamW, and the row [metrics..., grad_norm] into ``history[step % rows]``.
    Device work only (the row index is a device counter), so whole-step graphs capture it too;
    the learning-rate schedule reaches the graph through the optimizer's lr tensor."""
    index = torch.full((1,), first_step, dtype=torch.long, device=history.device)
    capturable = [g for g in optimizer.param_groups if g.get("capturable")]
    for group in capturable:
        # A restored checkpoint holds the lr as a float (uncaptured run) or a CPU tensor (torch.load
        # to CPU): fused AdamW would copy a CPU lr to the device inside the graph, and a replay
        # repeats that copy's captured value, so the schedule would stop at the capture's lr.
        group["lr"] = torch.tensor(float(group["lr"]), dtype=torch.float32, device=history.device)

    def update() -> None:
        if any(not isinstance(g["lr"], torch.Tensor) or g["lr"].device != index.device for g in capturable):
            raise RuntimeError("the learning-rate scheduler replaced the optimizer's lr tensor on the device, so a captured "
                               "step would ignore the schedule; this torch needs --cuda-graphs trees")
        norm = grads.clip_(max_norm)
        optimizer.step()
        history.index_copy_(0, index % history.shape[0], torch.cat([grads.extras, norm.reshape(1)]).unsqueeze(0))
        index.add_(1)

    return update


METRIC_NAMES = ("loss", "weight_sum", "acc", "acc_k1")
