"""The checkpoint an export reads (``Source``: the drafter's weights and the facts of its run,
checked as ``--resume`` checks them) and the new directory it writes into; shared by every format."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..run.checkpoint import STATE, WEIGHTS, latest_checkpoint, read_state, read_weights, verified
from ..drafter.model import target_layer_ids


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
    from ..target import TargetModel

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
        from ..assets.assets import default_assets
        from ..assets.shapes import shape_target

        return Path(shape_target(config["target_shape"], default_assets()).dir)
    if config.get("target") is None:
        # The run used the embedded default target; its build is cached (and rebuilt if absent,
        # deterministically, so the drafter's target is the same model).
        from ..assets.assets import default_assets

        return Path(default_assets().target_dir)
    saved = Path(config["target"])
    if not (saved / "config.json").is_file():
        raise ExportError(f"{step_dir / STATE} says the run trained against target {saved}, which "
                          f"is not a model directory here; pass --target DIR (the same model)")
    return saved


def fresh_dir(out: str | Path) -> Path:
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
