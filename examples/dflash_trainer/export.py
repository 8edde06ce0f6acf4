"""Export a trainer checkpoint as a drafter that serving stacks read.

    python -m examples.dflash_trainer.export --checkpoint DIR --format zlab|speculators --out OUT

`DIR` is a run's out_dir, its `checkpoints/` folder (the `latest` step is taken) or one
`step_*` directory, of a finished or an interrupted run. The target the drafter was trained
against comes from the run config saved in the checkpoint (`--target DIR` overrides it, and is
needed when that path does not exist on this machine); its layer ids, the block size and the
mask token are recorded in the exported config.

Formats (see EXPORT.md):
- `zlab`: the z-lab DFlash checkpoint (SGLang, the published `z-lab/*-DFlash*` drafters): a
  Qwen3 `config.json` with `block_size`, `dflash_config`, `num_target_layers`, and the draft
  body `layers.*`, `fc`, `hidden_norm`, `norm`; embedding and LM head come from the target.
- `speculators`: `DFlashSpeculatorConfig` + `DFlashDraftModel` weights (vLLM); written by
  `export_speculators.py` without needing the `speculators` package.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from .checkpoint import STATE, WEIGHTS, CheckpointError, latest_checkpoint, read_state, read_weights, verified
from .model import DFlashDrafter, target_layer_ids

FORMATS = ("zlab", "speculators")
# float32 is what the trainer holds (lossless); bfloat16 halves the files.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ZLAB_ARCHITECTURE = "DFlashDraftModel"


class ExportError(ValueError):
    """The checkpoint cannot be exported as asked; the message names the file or flag and the fix."""


@dataclass
class Source:
    """Everything an exporter needs: the drafter's weights and the facts of its training run."""

    step_dir: Path
    step: int
    weights: dict[str, torch.Tensor]
    arch: dict[str, Any]
    block_size: int
    target_dir: Path
    target_config: Any  # the target's transformers config
    num_target_layers: int
    layer_ids: list[int]
    mask_token_id: int
    vocab_size: int  # rows of the target's embedding (the drafter's vocabulary)


def find_step_dir(path: str | Path) -> Path:
    """A step directory from a step dir, a checkpoints root or a run's out_dir."""
    path = Path(path)
    if (path / WEIGHTS).is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = latest_checkpoint(root)
        if found is not None:
            return found
    raise ExportError(f"--checkpoint {path}: no {WEIGHTS} there and no 'latest' in it or in "
                      f"{path / 'checkpoints'}; pass a run's out_dir, its checkpoints/ folder or a "
                      f"step_* directory")


def read_source(checkpoint: str | Path, target: str | Path | None = None) -> Source:
    """Read a checkpoint and resolve its target (the saved run config's, unless `target`)."""
    from .target import TargetModel

    step_dir = find_step_dir(checkpoint)
    verified(step_dir)  # what --resume checks: the manifest, every file's size and SHA-256
    weights = read_weights(step_dir)
    _check_finite(weights, step_dir)
    with safe_open(str(step_dir / WEIGHTS), framework="pt") as f:
        meta = f.metadata() or {}
    if "arch" not in meta:
        raise ExportError(f"{step_dir / WEIGHTS} has no 'arch' metadata (written by an older "
                          f"trainer); re-save it with the current checkpoint.save_checkpoint")
    arch = json.loads(meta["arch"])
    state = read_state(step_dir)
    config = json.loads(state.get("extra", {}).get("config", "null") or "null")
    if not isinstance(config, dict):
        raise ExportError(f"{step_dir / STATE} holds no run config (extra['config']), so the block "
                          f"size and target are unknown; export a checkpoint written by the trainer")
    target_dir = _resolve_target(config, target, step_dir)
    n = arch["num_feature_layers"]
    shape = TargetModel.shape_only(target_dir, num_feature_layers=n)
    hf = shape.config
    if shape.hidden_size != arch["hidden_size"]:
        raise ExportError(f"target {target_dir} has hidden_size={shape.hidden_size} but the drafter "
                          f"in {step_dir} has {arch['hidden_size']}; pass --target the model it was "
                          f"trained against")
    num_layers = len(shape.model.model.layers)
    return Source(step_dir=step_dir, step=int(state["step"]), weights=weights, arch=arch,
                  block_size=int(config["block_size"]), target_dir=target_dir, target_config=hf,
                  num_target_layers=num_layers, layer_ids=target_layer_ids(num_layers, n),
                  mask_token_id=shape.mask_token_id, vocab_size=shape.vocab_size)


def _check_finite(weights: dict[str, torch.Tensor], step_dir: Path) -> None:
    bad = [name for name, t in weights.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
    if bad:
        raise ExportError(f"{step_dir / WEIGHTS} holds non-finite values (inf or NaN) in {', '.join(bad[:5])}"
                          f"{' and more' if len(bad) > 5 else ''}: the run diverged at or before "
                          f"{step_dir.name}; export an earlier step directory")


def _resolve_target(config: dict, target: str | Path | None, step_dir: Path) -> Path:
    if target is not None:
        return Path(target)
    if config.get("target_shape") is not None:
        # A --target-shape run: the random-init target of that shape on the embedded assets,
        # found in the cache (or built again, as the run did).
        from .assets import default_assets
        from .shapes import shape_target

        return Path(shape_target(config["target_shape"], default_assets()).dir)
    if config.get("target") is None:
        # The run used the embedded default target; its build is cached (and rebuilt if absent,
        # deterministically, so the drafter's target is the same model).
        from .assets import default_assets

        return Path(default_assets().target_dir)
    saved = Path(config["target"])
    if not (saved / "config.json").is_file():
        raise ExportError(f"{step_dir / STATE} says the run trained against target {saved}, which "
                          f"is not a model directory here; pass --target DIR (the same model)")
    return saved


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
    out = _fresh_dir(out)
    (out / "config.json").write_text(json.dumps(zlab_config(src), indent=2) + "\n")
    # The project's parameter names are the z-lab names already (checked by the reference test).
    save_file({k: v.contiguous() for k, v in src.weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def export(checkpoint: str | Path, fmt: str, out: str | Path, target: str | Path | None = None,
           dtype: str = "float32") -> tuple[Path, list[str]]:
    """Write `checkpoint` as `fmt` under `out`, weights in `dtype`; returns (out, warnings)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {list(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
    src = read_source(checkpoint, target)
    src.weights = {k: v.to(DTYPES[dtype]) for k, v in src.weights.items()}
    warnings = [w for w in (last_layer_warning(src),) if w]
    if fmt == "zlab":
        return write_zlab(src, out), warnings
    from .export_speculators import write_speculators

    return write_speculators(src, out), warnings


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


def _fresh_dir(out: str | Path) -> Path:
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file, not a directory; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"--out {out} exists and is not empty; choose a new directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ExportError(f"--out {out} cannot be created ({err.strerror or err}); choose a directory you can write")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.dflash_trainer.export",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="run out_dir, its checkpoints/ folder, or a step_* directory")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True, help="new directory for the exported drafter")
    parser.add_argument("--target", default=None,
                        help="the target model directory, when the one saved in the checkpoint's "
                             "run config does not exist here")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="weight dtype of the export (default: float32, as trained)")
    args = parser.parse_args(argv)
    try:
        out, warnings = export(args.checkpoint, args.format, args.out, args.target, args.dtype)
    except (ValueError, CheckpointError, FileNotFoundError) as err:  # ExportError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {args.format} drafter to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
