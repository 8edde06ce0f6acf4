"""Size checks before any worker starts: an estimate of the memory a run needs against what is
free, so a batch that cannot fit is refused in a second instead of being OOM-killed minutes in.

The estimate is deliberately rough (within a factor of about two of the peak on the CPU runs it
was calibrated on): one copy of the target's weights per device (pipeline.SharedTargets), each
drafter's trainable layers with AdamW state once a device and a gradient a replica, each target's forward pass
activations, the hand-off items in flight, and per drafter step its logits over the vocabulary
(the largest tensors: block tokens x vocab, several live at once through the loss and its
backward). Above the free memory the run is refused; above half of it, a warning. And the disk of
``--out-dir`` must hold a checkpoint (``check_checkpoint_room``): the last one is written after the
final step, where a full disk would lose the whole run.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig
from ..errors import BadInput
from .capacity import GiB, free_bytes, human_bytes

log = logging.getLogger("dflash")

# Live copies of a drafter step's [tokens, vocab] logits (logits, log-softmax, their gradients,
# the autocast/fp32 copies), calibrated on CPU runs of the embedded target (SAFETY.md).
LOGITS_COPIES = 6
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
    block_tokens = b * config.num_anchors * config.block_size
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
        "drafter_step": config.drafters * block_tokens * (LOGITS_COPIES * vocab * 4
                                                          + ACTIVATION_COPIES * (hidden + s) * dtype_bytes
                                                          * (config.num_draft_layers + 1)),
    }


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
                           f"{free / GiB:.1f} GiB is free; lower --batch-size (now {config.batch_size}), "
                           f"--seq-len ({config.seq_len}) or --num-anchors ({config.num_anchors})")
        if need > free / 2:
            log.warning("dflash: this run needs about %.1f GiB on %s (%s GiB), more than half of the %.1f GiB free",
                        need / GiB, device, detail, free / GiB)
    return parts
