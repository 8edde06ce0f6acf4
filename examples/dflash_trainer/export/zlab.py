"""The z-lab DFlash checkpoint (SGLang, the published ``z-lab/*-DFlash*`` drafters): a Qwen3
``config.json`` with the DFlash fields and the draft body's weights; and the way back, a
project drafter built from such a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import load_file, save_file
from torch import nn

from ..run.checkpoint import CheckpointError
from ..drafter.model import DFlashDrafter
from .source import ExportError, Source, fresh_dir

ZLAB_ARCHITECTURE = "DFlashDraftModel"


def zlab_config(src: Source) -> dict[str, Any]:
    """The z-lab/SGLang `config.json` of the drafter: a Qwen3 config of the draft body plus the
    DFlash fields. Written from the drafter's own arch, not copied from the target: the drafter
    uses plain RoPE with the target's base, whatever rope scaling the target declares."""
    a = src.arch
    hf = src.target_config
    return {
        "architectures": [ZLAB_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": a["hidden_size"],
        "intermediate_size": a["intermediate_size"],
        "num_hidden_layers": a["num_layers"],
        "num_attention_heads": a["num_heads"],
        "num_key_value_heads": a["num_kv_heads"],
        "head_dim": a["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": a["rms_norm_eps"],
        # Both spellings: transformers 5 reads rope_parameters, older readers rope_theta.
        "rope_theta": a["rope_theta"],
        "rope_parameters": {"rope_type": "default", "rope_theta": a["rope_theta"]},
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "layer_types": ["full_attention"] * a["num_layers"],  # non-causal in every layer
        "max_position_embeddings": getattr(hf, "max_position_embeddings", 32768),
        "vocab_size": src.vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": getattr(hf, "bos_token_id", None),
        "eos_token_id": getattr(hf, "eos_token_id", None),
        "pad_token_id": getattr(hf, "pad_token_id", None),
        "dtype": str(next(iter(src.weights.values())).dtype).removeprefix("torch."),
        "block_size": src.block_size,
        "num_target_layers": src.num_target_layers,
        "dflash_config": {
            "mask_token_id": src.mask_token_id,
            "target_layer_ids": src.layer_ids,
            # What readers cannot infer but a user should know; readers ignore unknown keys.
            "trained_by": {
                "trainer": "threadgraph examples.dflash_trainer",
                "step": src.step,
                "target": str(src.target_dir),
                "features": "target hidden_states[id + 1] of each target_layer_ids entry, concatenated",
                "sample_from_anchor": False,
                "loss": "cross-entropy on the target's regenerated tokens, outputs k >= 1 of each block",
            },
        },
    }


def last_layer_warning(src: Source) -> str | None:
    """A feature read from the target's last layer is post-norm in HF's hidden_states."""
    if src.num_target_layers - 1 in src.layer_ids:
        return (f"target_layer_ids {src.layer_ids} include the target's last layer "
                f"({src.num_target_layers - 1}); the drafter was trained on HF hidden_states"
                f"[{src.num_target_layers}], which is after the final norm, while serving engines "
                f"may capture the stream before it; train with a deeper target or fewer "
                f"--num-target-layers-used for serving")
    return None


def write_zlab(src: Source, out: str | Path) -> Path:
    out = fresh_dir(out)
    (out / "config.json").write_text(json.dumps(zlab_config(src), indent=2) + "\n")
    # The project's parameter names are the z-lab names already (checked by the reference test).
    save_file({k: v.contiguous() for k, v in src.weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def load_zlab_drafter(path: str | Path, embed_tokens: nn.Embedding,
                      lm_head: nn.Linear) -> DFlashDrafter:
    """Build the project's drafter from a z-lab checkpoint (the round trip, or fine-tuning a
    published drafter) around the target's frozen `embed_tokens` and `lm_head`."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ExportError(f"{config_file} is missing; pass a directory written by --format zlab")
    cfg = json.loads(config_file.read_text())
    if ZLAB_ARCHITECTURE not in cfg.get("architectures", []) or "dflash_config" not in cfg:
        raise ExportError(f"{config_file} is not a z-lab DFlash config (architectures "
                          f"{cfg.get('architectures')}); pass a directory written by --format zlab")
    rope = cfg.get("rope_parameters") or {"rope_type": "default", "rope_theta": cfg.get("rope_theta")}
    if rope.get("rope_type", "default") != "default":
        raise ExportError(f"{config_file}: rope_type {rope['rope_type']!r} is not plain RoPE, which "
                          f"is all the project's drafter implements")
    drafter = DFlashDrafter(
        hidden_size=cfg["hidden_size"], num_heads=cfg["num_attention_heads"],
        num_kv_heads=cfg["num_key_value_heads"], head_dim=cfg["head_dim"],
        intermediate_size=cfg["intermediate_size"], num_layers=cfg["num_hidden_layers"],
        num_feature_layers=len(cfg["dflash_config"]["target_layer_ids"]),
        rms_norm_eps=cfg["rms_norm_eps"], rope_theta=float(rope["rope_theta"]),
        embed_tokens=embed_tokens, lm_head=lm_head)
    weights = load_file(str(path / "model.safetensors"), device="cpu")
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{path / 'model.safetensors'} does not fit {config_file} ({err})") from None
    return drafter
