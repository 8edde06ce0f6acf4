"""Atomic, resumable checkpoints: drafter weights, optimiser, schedule, RNG, and the run's settings.

Layout under `root`: `step_00000100/{model.safetensors, state.pt}` plus a `latest` file naming
the newest step directory. A step directory is written under a temporary name and renamed, and
`latest` is replaced atomically, so a crash mid-save leaves the previous checkpoint usable.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from .config import TrainConfig

WEIGHTS = "model.safetensors"
STATE = "state.pt"
LATEST = "latest"
# Fields that must match between a checkpoint and the run resuming from it.
RESUME_KEYS = ("target", "data", "seq_len", "block_size", "num_anchors", "num_draft_layers", "num_target_layers_used",
               "batch_size", "drafters", "seed", "lr", "epochs", "max_steps")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, corrupt or does not fit the model; the message names it."""


def save_checkpoint(root: str | Path, step: int, drafter: nn.Module,
                    optimizer: torch.optim.Optimizer | None, scheduler: Any,
                    extra: dict | None = None) -> Path:
    """Write checkpoint `step` under `root`; returns its directory.

    `extra` must be plain Python data (dicts, lists, numbers, strings, tensors): it is loaded
    back with torch.load(weights_only=True). The data position needs no saving: it follows from
    the step (data.ShardBatches).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:08d}"
    final, tmp = root / name, root / f".tmp_{name}"
    shutil.rmtree(tmp, ignore_errors=True)  # leftover of a crashed save
    tmp.mkdir()
    # state_dict() holds only the drafter's own weights (the target's modules are unregistered).
    weights = {k: v.detach().cpu().contiguous() for k, v in drafter.state_dict().items()}
    meta = {"step": str(step)}
    if hasattr(drafter, "arch"):
        meta["arch"] = json.dumps(drafter.arch)
    save_file(weights, str(tmp / WEIGHTS), metadata=meta)
    torch.save({
        "step": step,
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "extra": extra or {},
        "rng": _rng_state(),
    }, tmp / STATE)
    if final.exists():
        shutil.rmtree(final)  # re-saving a step (e.g. after a resume) replaces it
    os.replace(tmp, final)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name + "\n")
    os.replace(pointer, root / LATEST)
    return final


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory `latest` points to, or None when `root` holds no checkpoint yet."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text().strip()
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names {path}, which does not exist; delete {pointer} "
                              f"or point it at an existing step_* directory")
    return path


def load_checkpoint(path: str | Path, drafter: nn.Module,
                    optimizer: torch.optim.Optimizer | None = None,
                    scheduler: Any = None) -> tuple[int, dict]:
    """Restore from a root (via `latest`) or a step directory; returns (step, extra).

    Also restores the torch, Python and (if saved and available) CUDA RNG states.
    """
    path = Path(path)
    if not (path / WEIGHTS).exists():
        found = latest_checkpoint(path)
        if found is None:
            raise CheckpointError(f"no checkpoint at {path}: neither {path / WEIGHTS} nor "
                                  f"{path / LATEST} exists; check the path or start without resume")
        path = found
    weights = _read(path / WEIGHTS, lambda f: load_file(str(f), device="cpu"))
    state = read_state(path)
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{path / WEIGHTS} does not fit this drafter ({err}); build the "
                              f"drafter with the same architecture as the saved run") from None
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    _set_rng_state(state["rng"])
    return state["step"], state["extra"]


def read_state(path: str | Path) -> dict:
    """The non-weight state of a step directory (step, optimizer, scheduler, extra, RNG)."""
    return _read(Path(path) / STATE, lambda f: torch.load(f, map_location="cpu", weights_only=True))


class Checkpointer:
    """A run's checkpoint directory: the checkpoint ``--resume`` starts from (refused when it was
    written with other settings), restoring a replica from it, and saving."""

    def __init__(self, directory: str | Path, config: TrainConfig) -> None:
        self.directory = Path(directory)
        self.config = config
        self.resume_from: Optional[Path] = self._resume_path() if config.resume else None
        self.start_step = self._checked_step(self.resume_from) if self.resume_from is not None else 0
        self.saved: Optional[Path] = None  # the newest checkpoint this run wrote

    def restore(self, drafter: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        """Load the resume checkpoint into a replica; nothing when the run starts fresh."""
        if self.resume_from is not None:
            load_checkpoint(self.resume_from, drafter, optimizer, scheduler)

    def save(self, step: int, drafter: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Path:
        self.saved = save_checkpoint(self.directory, step, drafter, optimizer, scheduler,
                                     {"config": json.dumps(self.config.to_dict())})
        return self.saved

    def _resume_path(self) -> Path:
        path = latest_checkpoint(self.directory)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.directory}; run without --resume to start fresh")
        return path

    def _checked_step(self, path: Path) -> int:
        state = read_state(path)
        saved = json.loads(state.get("extra", {}).get("config", "{}"))
        mine = self.config.to_dict()
        differ = {k: (saved.get(k), mine[k]) for k in RESUME_KEYS if k in saved and saved[k] != mine[k]}
        if differ:
            raise ValueError(f"--resume: checkpoint {path} was written with different settings {differ} (saved, now); "
                             "resume with the same settings or use a new --out-dir")
        return int(state["step"])


def _read(file: Path, loader: Any) -> Any:
    if not file.is_file():
        raise CheckpointError(f"checkpoint file {file} is missing; the checkpoint is incomplete, "
                              f"resume from an earlier step directory")
    try:
        return loader(file)
    except Exception as err:  # safetensors and pickle raise many types on corrupt bytes
        raise CheckpointError(f"checkpoint file {file} is corrupt or unreadable "
                              f"({type(err).__name__}: {err}); resume from an earlier step "
                              f"directory") from err


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
