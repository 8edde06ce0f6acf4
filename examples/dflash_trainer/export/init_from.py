"""``--init-from DIR``: start training from a published DFlash drafter, in the z-lab format (SGLang,
``z-lab/*-DFlash*``) or the speculators format (vLLM), the two this package exports.

The checkpoint must be of the run's architecture: the draft body's widths, heads and layers, the
target layers it reads, the block size it was trained for, and the target's mask token. Each
mismatch is refused up front (``check``, before any model is loaded) with the flag that would make
the run match. Its ``embed_tokens`` and ``lm_head``, where a checkpoint carries them, are not loaded:
the drafter always borrows the target's frozen ones.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import BadInput

log = logging.getLogger("dflash")

_TARGET_OWNED = ("embed_tokens.weight", "lm_head.weight")
# The drafter's arch keys, the Qwen3 config keys they come from, and the flag that sets them in a run.
_ARCH = {"hidden_size": ("hidden_size", "the target's width"), "num_heads": ("num_attention_heads", "the target's heads"),
         "num_kv_heads": ("num_key_value_heads", "the target's KV heads"), "head_dim": ("head_dim", "the target's head_dim"),
         "intermediate_size": ("intermediate_size", "the target's MLP width"),
         "num_layers": ("num_hidden_layers", "--num-draft-layers")}


class InitFromError(BadInput):
    """An --init-from checkpoint that cannot start this run; the message names the flag to change."""


@dataclass(frozen=True)
class PublishedDrafter:
    path: Path
    format: str  # "zlab" or "speculators"
    arch: dict[str, Any]  # DFlashDrafter.arch keys that the checkpoint fixes
    layer_ids: list[int]  # target layers read (HF hidden_states[id + 1])
    block_size: int | None
    mask_token_id: int | None

    def check(self, drafter_arch: dict[str, Any], layer_ids: list[int], block_size: int, mask_token_id: int) -> None:
        """Refuse a checkpoint that does not fit the run's drafter, naming what to change."""
        where = f"--init-from {self.path} ({self.format})"
        for key, (_, what) in _ARCH.items():
            if self.arch[key] != drafter_arch[key]:
                fix = (f"pass --num-draft-layers {self.arch[key]}" if key == "num_layers"
                       else "train against the target it was made for")
                raise InitFromError(f"{where} has {key} {self.arch[key]}, this run's drafter {drafter_arch[key]} "
                                    f"({what}); {fix}")
        if len(self.layer_ids) != len(layer_ids):
            raise InitFromError(f"{where} reads {len(self.layer_ids)} target layers, this run {len(layer_ids)}; pass "
                                f"--num-target-layers-used {len(self.layer_ids)}")
        if self.layer_ids != layer_ids:
            raise InitFromError(f"{where} reads target layers {self.layer_ids}, this run {layer_ids}: it was made "
                                f"for a target of another depth; train against that target")
        if self.block_size is not None and self.block_size != block_size:
            raise InitFromError(f"{where} was trained with block size {self.block_size}, this run uses {block_size}; "
                                f"pass --block-size {self.block_size}")
        if self.mask_token_id is not None and self.mask_token_id != mask_token_id:
            raise InitFromError(f"{where} uses mask token {self.mask_token_id}, this run's target {mask_token_id}: its "
                                f"drafter learned another embedding row as the mask; train against its target")

    def weights(self) -> dict[str, torch.Tensor]:
        """The draft body's weights, in float32 (the drafter trains in float32 with autocast)."""
        from safetensors.torch import load_file

        loaded: dict[str, torch.Tensor] = {}
        for file in weight_files(self.path):
            try:
                loaded.update(load_file(str(file), device="cpu"))
            except Exception as err:  # safetensors' SafetensorError, OSError: damaged after read_published
                raise _unreadable(self.path, file, err) from None
        skipped = [k for k in loaded if k in _TARGET_OWNED]
        if skipped:
            log.info("dflash: --init-from: not loading %s (the drafter uses the target's own)", ", ".join(skipped))
        return {k: v.float() for k, v in loaded.items() if k not in _TARGET_OWNED}


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files, each one's safetensors header read (not its weights): a truncated
    or corrupt file is refused here, before any model is loaded, and not in a drafter's setup."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InitFromError(f"--init-from {path} holds no *.safetensors weights")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                f.keys()
        except Exception as err:  # safetensors' SafetensorError, OSError
            raise _unreadable(path, file, err) from None
    return files


def _unreadable(path: Path, file: Path, err: Exception) -> InitFromError:
    size = file.stat().st_size if file.is_file() else 0
    reason = " ".join(str(err).split()) or type(err).__name__
    return InitFromError(f"--init-from {path}: {file.name} is not a readable safetensors file ({reason}; {size} "
                         f"bytes): it is truncated or corrupt; export or download the drafter again")


def read_published(path: str | Path) -> PublishedDrafter:
    """Its format and facts, from its config.json, and its weight files' headers (no weights read)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise InitFromError(f"--init-from {path}: {config_file} is missing; pass a DFlash drafter directory in "
                            f"the z-lab or speculators format")
    weight_files(path)
    try:
        cfg = json.loads(config_file.read_text())
    except ValueError as err:
        raise InitFromError(f"--init-from {path}: {config_file} is not JSON ({err})") from None
    if cfg.get("speculators_model_type") == "dflash":
        body = cfg.get("transformer_layer_config") or {}
        layer_ids = [i - 1 for i in cfg.get("aux_hidden_state_layer_ids") or []]  # hidden_states index -> layer id
        return PublishedDrafter(path, "speculators", _arch(body, config_file), layer_ids, cfg.get("block_size"),
                                cfg.get("mask_token_id"))
    if "dflash_config" in cfg:
        dflash = cfg["dflash_config"]
        return PublishedDrafter(path, "zlab", _arch(cfg, config_file), list(dflash.get("target_layer_ids") or []),
                                cfg.get("block_size"), dflash.get("mask_token_id"))
    raise InitFromError(f"--init-from {path}: {config_file} is neither a z-lab DFlash config (dflash_config) nor a "
                        f"speculators one (speculators_model_type 'dflash')")


def _arch(cfg: dict[str, Any], config_file: Path) -> dict[str, Any]:
    try:
        arch = {key: cfg[name] for key, (name, _) in _ARCH.items() if name != "head_dim"}
    except KeyError as err:
        raise InitFromError(f"--init-from: {config_file} lacks {err.args[0]!r}") from None
    arch["head_dim"] = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return arch


def load_into(drafter: torch.nn.Module, published: PublishedDrafter) -> None:
    """Copy the checkpoint's weights into ``drafter`` (every trainable tensor, none left over)."""
    weights = published.weights()
    own = drafter.state_dict()
    missing, extra = sorted(set(own) - set(weights)), sorted(set(weights) - set(own))
    if missing or extra:
        raise InitFromError(f"--init-from {published.path}: its weights do not match the drafter's (missing "
                            f"{missing[:4]}, unexpected {extra[:4]})")
    for name, value in weights.items():
        if value.shape != own[name].shape:
            raise InitFromError(f"--init-from {published.path}: {name} has shape {tuple(value.shape)}, the drafter's "
                                f"{tuple(own[name].shape)}")
    with torch.no_grad():
        for name, value in weights.items():
            own[name].copy_(value)
    log.info("dflash: drafter initialised from %s (%s format)", published.path, published.format)
