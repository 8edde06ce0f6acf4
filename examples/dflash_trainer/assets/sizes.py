"""Size checks before any model is loaded: an estimate of the memory a run needs against what is
free, so a batch that cannot fit is refused in a second instead of being OOM-killed minutes in.

The estimate counts tensors: one copy of the target's weights per device (pipeline.SharedTargets),
each drafter's trainable layers with AdamW state once a device and a gradient a replica, each target's
forward pass activations, the hand-off items in flight, and each drafter step's peak
(``drafter_step_bytes``): what its forward saves for the backward, counted op by op from the drafter's
code (drafter/model.py, drafter/step.py) at the run's shapes, plus the largest buffers its backward
holds at once. The loss takes the LM head a chunk at a time (drafter/chunked_ce.py), so no
``[tokens, vocab]`` tensor is counted. ``python -m benchmarks dflash-loss-memory`` sets this count
beside the measured peak of a drafter step on the CPU at Qwen3's vocabulary. Above the free memory the
run is refused; above half of it, a warning. And the disk of ``--out-dir`` must hold a checkpoint
(``check_checkpoint_room``): the last one is written after the final step, where a full disk would
lose the whole run.
"""

from __future__ import annotations

import dataclasses
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..errors import BadInput
from .capacity import GiB, free_bytes, human_bytes

log = logging.getLogger("dflash")

FLOAT32 = 4  # RMSNorm statistics, RoPE tables, log-sum-exp and the loss run in float32 whatever the dtype
ACTIVATION_COPIES = 4  # per target layer and token, of the hidden and MLP widths, in a forward
STEPPED_BYTES = 12  # per trainable drafter parameter, once a device: fp32 weight and two AdamW moments
GRADIENT_BYTES = 4  # per trainable drafter parameter and replica: its fp32 gradient
CHECKPOINT_BYTES = 12  # per trainable drafter parameter in a checkpoint: fp32 weight and two AdamW moments


class TooLarge(BadInput):
    """The run's memory estimate exceeds the free memory of a device."""


def estimate_bytes(config: TrainConfig, model_config: Any, num_params: int, dtype_bytes: int,
                   devices: int = 1) -> dict[str, int]:
    """Bytes the run needs over ``devices`` devices that share its workers, by part."""
    hidden, vocab = model_config.hidden_size, model_config.vocab_size
    layers = model_config.num_hidden_layers
    inter = getattr(model_config, "intermediate_size", 4 * hidden)
    heads = getattr(model_config, "num_attention_heads", 1)
    b, s = config.batch_size, config.seq_len
    item = b * s * hidden * config.num_feature_layers * dtype_bytes
    drafter_params = trainable_drafter_params(config, model_config, num_params)
    return {
        "weights": num_params * dtype_bytes * min(devices, config.targets + config.drafters),
        # The replicas on one device share one copy of the weights and AdamW (drafter.replica).
        "drafter_training": drafter_params * (min(devices, config.drafters) * STEPPED_BYTES
                                              + config.drafters * GRADIENT_BYTES),
        "target_forward": config.targets * b * s * (ACTIVATION_COPIES * (hidden + inter) * dtype_bytes
                                                    + (layers + 1) * hidden * dtype_bytes
                                                    + heads * s * dtype_bytes + vocab * 4),
        "hand_off": item * (config.targets + config.drafters * config.channel_capacity),
        "drafter_step": config.drafters * sum(drafter_step_bytes(config, model_config, dtype_bytes).values()),
    }


def drafter_device_bytes(config: TrainConfig, model_config: Any, num_params: int, dtype_bytes: int) -> dict[str, int]:
    """Bytes of a device that holds one drafter and no target worker (eight or more GPUs: a worker
    each): the target's weights (the drafter borrows its embedding and LM head), one drafter's
    training state and step, and its inbox of hand-off items."""
    drafter_params = trainable_drafter_params(config, model_config, num_params)
    item = config.batch_size * config.seq_len * model_config.hidden_size * config.num_feature_layers * dtype_bytes
    return {"weights": num_params * dtype_bytes,
            "drafter_training": drafter_params * (STEPPED_BYTES + GRADIENT_BYTES),
            "hand_off": item * (1 + config.channel_capacity),
            "drafter_step": sum(drafter_step_bytes(config, model_config, dtype_bytes).values())}


def drafter_step_bytes(config: TrainConfig, model_config: Any, dtype_bytes: int) -> dict[str, int]:
    """The peak of one drafter step (the start of its backward), by what holds the bytes.

    ``dtype_bytes``: the compute dtype's (the autocast dtype on a GPU, float32 on the CPU). Counted
    from the code, per sample with Q = anchors * block queries and K = seq_len + Q keys:
    each draft layer saves for its backward its two RMSNorms' float32 input and normalised input
    (4 QH), the inputs of q_proj and of gate/up_proj (2 QH), of k/v_proj ([context; block], KH),
    q_norm's and k_norm's input and normalised input (2 QA, 2 KG), the rotated queries, the keys and
    values repeated over the query heads (QA + 2 KA), the attention's output (o_proj's input, QA),
    its mask as an additive bias (QK) and log-sum-exp, RoPE's cos and sin (2 Q + 2 K of head_dim),
    and the MLP's gate, up, SiLU and product (4 QI); once a step, the feature fusion's RMSNorm
    (2 of context x hidden), the final RMSNorm (2 QH), the hidden states the loss keeps (QH), its
    labels, weights and log-sum-exp. At the backward's start all of that is live, with the largest
    of: a chunk's logits in the loss (drafter.chunked_ce), the MLP's gradients (3 QI), the attention's
    (QA + 2 KA).
    """
    cfg, mc = config, model_config
    hidden, vocab = mc.hidden_size, mc.vocab_size
    heads = getattr(mc, "num_attention_heads", 1)
    head_dim = getattr(mc, "head_dim", None) or hidden // heads
    kv_heads = getattr(mc, "num_key_value_heads", None) or heads
    inter = getattr(mc, "intermediate_size", 4 * hidden)
    b, ctx = cfg.batch_size, cfg.seq_len
    q = b * cfg.num_anchors * cfg.block_size  # drafter outputs of the step
    k = b * ctx + q  # keys: the context and the blocks
    a, g = heads * head_dim, kv_heads * head_dim
    f, d = FLOAT32, dtype_bytes
    per_layer = (q * hidden * (4 * f + 2 * d) + k * hidden * d
                 + 2 * q * a * f + 2 * k * g * f
                 + q * a * d + 2 * k * a * d + q * a * d
                 + b * cfg.num_anchors * cfg.block_size * (ctx + cfg.num_anchors * cfg.block_size) * d
                 + q * heads * f + 2 * (q + k) * head_dim * f
                 + 4 * q * inter * d)
    once = 2 * b * ctx * hidden * f + 2 * q * hidden * f + q * hidden * d + q * (8 + f + f)
    chunk = min(cfg.loss_chunk_tokens, q)
    loss_chunk = chunk * vocab * (f + (d if d != f else 0)) + 2 * q * hidden * d  # logits; the gradient's pieces
    return {"saved_for_backward": cfg.num_draft_layers * per_layer + once,
            "backward_transient": max(loss_chunk, 3 * q * inter * d, (q + 2 * k) * a * d) + q * hidden * f}


def trainable_drafter_params(config: TrainConfig, model_config: Any, num_params: int) -> int:
    """A drafter's trainable parameters: its layers, each the size of one target layer, and the
    projection of the target's features (it borrows the target's embedding and LM head)."""
    hidden, vocab = model_config.hidden_size, model_config.vocab_size
    embeddings = vocab * hidden * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    return (max(0, num_params - embeddings) // max(1, model_config.num_hidden_layers) * config.num_draft_layers
            + config.num_feature_layers * hidden * hidden)


def check_checkpoint_room(config: TrainConfig, model_config: Any, num_params: int, saves: int) -> None:
    """Refuse a run whose checkpoint cannot fit on the disk of ``--out-dir`` (the last one is
    written after the final step: found there, the whole run would be lost), and warn when all
    ``saves`` of them would not. A checkpoint holds the drafter's fp32 weights and AdamW's two moments."""
    one = trainable_drafter_params(config, model_config, num_params) * CHECKPOINT_BYTES
    out = Path(config.out_dir)
    existing = next((p for p in (out, *out.parents) if p.exists()), None)
    if existing is None or saves < 1:
        return
    free = shutil.disk_usage(existing).free
    if one > free:
        raise TooLarge(f"a checkpoint of this drafter needs about {human_bytes(one)} but the disk of --out-dir "
                       f"{out} has {human_bytes(free)} free; free some space, pass an --out-dir on a larger disk, or "
                       f"--no-checkpoints if the trained weights are not wanted")
    if one * saves > free:
        log.warning("dflash: the run's %d checkpoints need about %s, more than the %s free on the disk of "
                    "%s; raise --checkpoint-every or make room before they are written", saves, human_bytes(one * saves),
                    human_bytes(free), out)


def per_device(config: TrainConfig, model_config: Any, num_params: int, dtype: torch.dtype,
               devices: list[str]) -> dict[str, float]:
    """Bytes each of the run's devices needs, by part (the workers spread over the devices)."""
    share = max(1, len(set(devices)))
    parts = estimate_bytes(config, model_config, num_params, torch.empty((), dtype=dtype).element_size(), share)
    return {k: v / share for k, v in parts.items()}


def check(config: TrainConfig, model_config: Any, num_params: int, dtype: torch.dtype, devices: list[str]) -> dict:
    """Refuse (TooLarge) or warn before the run starts; returns the per-device estimate by part."""
    parts = per_device(config, model_config, num_params, dtype, devices)
    need = sum(parts.values())
    for device in dict.fromkeys(devices):
        free = free_bytes(device)
        if free is None:
            continue
        detail = ", ".join(f"{k} {v / GiB:.1f}" for k, v in parts.items())
        if need > free:
            raise TooLarge(f"this run needs about {need / GiB:.1f} GiB on {device} ({detail} GiB) but "
                           f"{free / GiB:.1f} GiB is free; {_what_fits(config, model_config, num_params, dtype, devices, free)}")
        if need > free / 2:
            log.warning("dflash: this run needs about %.1f GiB on %s (%s GiB), more than half of the %.1f GiB free",
                        need / GiB, device, detail, free / GiB)
    return parts


def _what_fits(config: TrainConfig, model_config: Any, num_params: int, dtype: torch.dtype, devices: list[str],
               free: int) -> str:
    """The one flag to change so that the estimate fits in ``free`` bytes: a smaller batch (with
    accumulation to keep the samples a step), else fewer anchors, else a shorter sequence."""
    def fits(**change: int) -> bool:
        changed = dataclasses.replace(config, **change)
        return sum(per_device(changed, model_config, num_params, dtype, devices).values()) <= free

    for batch in range(config.batch_size - 1, 0, -1):
        if fits(batch_size=batch):
            accum = -(-config.batch_size * config.grad_accum // batch)
            return (f"pass --batch-size {batch} (now {config.batch_size}) with --grad-accum {accum} to keep about "
                    f"{config.batch_size * config.grad_accum} samples a step")
    for anchors in (config.num_anchors // 2 ** i for i in range(1, 12)):
        if anchors >= 1 and fits(batch_size=1, num_anchors=anchors):
            return f"pass --batch-size 1 and --num-anchors {anchors} (now {config.num_anchors})"
    for seq_len in (config.seq_len // 2 ** i for i in range(1, 12)):
        if seq_len > config.num_anchors and fits(batch_size=1, seq_len=seq_len):
            return f"pass --batch-size 1 and --seq-len {seq_len} (now {config.seq_len})"
    return ("even --batch-size 1 does not fit: the target's weights and the drafter's training state need more; "
            "pass --devices with more devices, or use a smaller target")
