"""Atomic, resumable checkpoints: drafter weights, optimiser, schedule, RNG, and the run's settings.

Layout under `root`: `step_00000100/{model.safetensors, state.pt, manifest.json}` plus a `latest`
file naming the newest step directory. A step directory is written under a temporary name, each
file fsynced, then renamed, and `latest` is written, fsynced and renamed over the old one, so a
crash (or power loss) mid-save leaves the previous checkpoint usable.

The manifest records the step, the run's fingerprint (the settings that fix the model and the
data order, the worker topology included) and the size and SHA-256 of every file. Loading checks
all of it; any mismatch is a CheckpointError naming the file and the newest checkpoint that
still verifies.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from ..config import TrainConfig
from ..errors import BadInput
from ..assets.capacity import human_bytes
from .durable import fsync_path, rng_state, set_rng_state, sha256_file

WEIGHTS = "model.safetensors"
STATE = "state.pt"
MANIFEST = "manifest.json"
LATEST = "latest"
_STEP_DIR = re.compile(r"step_(\d{8})")
# Everything save_checkpoint writes in its root: step directories, their temporary forms and the pointer's.
_WRITTEN = re.compile(r"(\.tmp_)?step_\d{8}|latest|\.latest\.tmp")
# Fields that must match between a checkpoint and the run resuming from it. `targets`, `drafters`,
# `batch_size`, `seed` and the process count (added by the Checkpointer) fix the data order.
# Every setting that changes a resumed run's trajectory: the model and its target, the data and
# its order, the loss, and the optimiser's schedule.
RESUME_KEYS = ("target", "target_shape", "data", "seq_len", "block_size", "num_anchors", "num_draft_layers",
               "num_target_layers_used", "gamma", "batch_size", "targets", "drafters", "seed", "lr", "warmup_ratio",
               "grad_clip", "weight_decay", "epochs", "max_steps", "reasoning", "grad_accum")


PATH_KEYS = ("target", "data")


class CheckpointError(BadInput, RuntimeError):
    """A checkpoint file is missing, corrupt or does not fit the model; the message names it."""


class ResumeMismatch(BadInput, ValueError):
    """``--resume`` with settings other than the checkpoint's; the message lists them."""


class RunFinished(Exception):
    """``--resume`` of a run whose checkpoint is already at its last step: nothing to train."""

    def __init__(self, checkpoint: Path, step: int) -> None:
        super().__init__(f"the run in {checkpoint.parent.parent} already finished: {checkpoint} is step {step}, "
                         f"its last; nothing to train (start a new run with a new --out-dir)")
        self.checkpoint, self.step = checkpoint, step


def save_checkpoint(root: str | Path, step: int, drafter: nn.Module,
                    optimizer: torch.optim.Optimizer | None, scheduler: Any,
                    extra: dict | None = None, fingerprint: dict | None = None) -> Path:
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
    try:
        _write_step(tmp, step, drafter, optimizer, scheduler, extra, fingerprint)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)  # a half-written step is never left behind
        if _out_of_room(err):
            free = shutil.disk_usage(root).free
            raise CheckpointError(f"saving checkpoint {final} failed: the disk of {root} is full ({human_bytes(free)} "
                                  f"free); the earlier checkpoints are intact; free some space and --resume") from err
        raise
    if final.exists():
        shutil.rmtree(final)  # re-saving a step (e.g. after a resume) replaces it
    os.replace(tmp, final)
    fsync_path(root)
    pointer = root / f".{LATEST}.tmp"
    pointer.write_text(name + "\n")
    fsync_path(pointer)
    os.replace(pointer, root / LATEST)
    fsync_path(root)
    return final


def _out_of_room(err: BaseException) -> bool:
    """Whether a failed write ran out of disk: ENOSPC or EDQUOT, or torch's zip writer's way of
    saying so ("unexpected pos" from inline_container.cc, which hides the errno)."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return isinstance(err, RuntimeError) and "unexpected pos" in str(err)


def _write_step(tmp: Path, step: int, drafter: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any,
                extra: dict | None, fingerprint: dict | None) -> None:
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
        "rng": rng_state(),
    }, tmp / STATE)
    files = {f: {"size": (tmp / f).stat().st_size, "sha256": sha256_file(tmp / f)} for f in (WEIGHTS, STATE)}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "fingerprint": fingerprint or {}, "files": files},
                                           indent=1, sort_keys=True) + "\n")
    for f in (WEIGHTS, STATE, MANIFEST):
        fsync_path(tmp / f)
    fsync_path(tmp)


def verify_checkpoint(path: str | Path) -> dict:
    """Check a step directory against its manifest (present, readable, the step its name says,
    every file's size and SHA-256); returns the manifest. Raises CheckpointError naming the file."""
    path = Path(path)
    manifest_file = path / MANIFEST
    if not manifest_file.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (incomplete, or not written by this trainer)")
    try:
        manifest = json.loads(manifest_file.read_bytes().decode("utf-8"))
        step, files = int(manifest["step"]), dict(manifest["files"])
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"checkpoint file {manifest_file} is corrupt ({type(err).__name__}: {err})") from None
    named = _STEP_DIR.fullmatch(path.name)
    if named and int(named.group(1)) != step:
        raise CheckpointError(f"checkpoint {path} holds step {step} (see {manifest_file}), not the step its name says; "
                              f"it was copied or renamed")
    for name in (WEIGHTS, STATE):
        file, want = path / name, files.get(name)
        if want is None:
            raise CheckpointError(f"checkpoint file {manifest_file} does not list {name}")
        if not file.is_file():
            raise CheckpointError(f"checkpoint file {file} is missing; the checkpoint is incomplete")
        size = file.stat().st_size
        if size != want["size"]:
            raise CheckpointError(f"checkpoint file {file} is corrupt: {size} bytes, {manifest_file} says "
                                  f"{want['size']} (truncated or replaced)")
        if sha256_file(file) != want["sha256"]:
            raise CheckpointError(f"checkpoint file {file} is corrupt: its SHA-256 differs from the one in "
                                  f"{manifest_file} (damaged or replaced)")
    return manifest


def written_by_checkpointer(root: str | Path) -> list[Path]:
    """The entries of `root` that save_checkpoint wrote; anything else there is someone else's."""
    root = Path(root)
    return sorted(p for p in root.iterdir() if _WRITTEN.fullmatch(p.name)) if root.is_dir() else []


def interrupted_saves(root: str | Path) -> list[Path]:
    """What a save cut short (kill -9, power loss) left under `root`: temporaries, never a checkpoint."""
    return [p for p in written_by_checkpointer(root) if p.name.startswith(".")]


def step_directories(root: str | Path) -> list[Path]:
    """The step directories under `root`, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _STEP_DIR.fullmatch(p.name)), reverse=True)


def nearest_good(root: str | Path, *, exclude: Optional[Path] = None) -> Optional[Path]:
    """The newest step directory under `root` (other than `exclude`) that verifies."""
    for path in step_directories(root):
        if exclude is not None and path.name == exclude.name:
            continue
        try:
            verify_checkpoint(path)
        except CheckpointError:
            continue
        return path
    return None


def _fix(root: Path, bad: Optional[Path] = None) -> str:
    """The fix for a bad checkpoint: the newest good one to point `latest` at, if there is one (a
    `latest` that is not a file is moved aside first, or the shell could not write it)."""
    good = nearest_good(root, exclude=bad)
    if good is None:
        return ("no other checkpoint verifies; start a fresh run (a new --out-dir, or --overwrite to discard "
                "this one)")
    pointer = root / LATEST
    aside = f"mv {pointer} {pointer}.moved && " if pointer.exists() and not pointer.is_file() else ""
    return (f"the nearest good checkpoint is {good}: resume from it with `{aside}echo {good.name} > {pointer}` "
            f"and --resume")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory `latest` points to, or None when `root` holds no checkpoint yet (no `latest`
    and no step directory). A `latest` that is missing beside step directories, empty, garbled or
    naming a missing directory is a CheckpointError naming the nearest good checkpoint."""
    root = Path(root)
    pointer = root / LATEST
    if pointer.exists() and not pointer.is_file():
        kind = "a directory" if pointer.is_dir() else "not a regular file"
        raise CheckpointError(f"{pointer} is {kind}, not the file naming the newest checkpoint; {_fix(root)}")
    if not pointer.is_file():
        if step_directories(root):
            raise CheckpointError(f"{pointer} is missing but {root} holds step directories; {_fix(root)}")
        return None
    try:
        name = pointer.read_bytes().decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if not name or not _STEP_DIR.fullmatch(name):
        raise CheckpointError(f"{pointer} is {'empty' if name == '' else 'garbled'}: it should hold one "
                              f"step_NNNNNNNN name; {_fix(root)}")
    path = root / name
    if not path.is_dir():
        raise CheckpointError(f"{pointer} names {path}, which does not exist; {_fix(root)}")
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
    manifest = verified(path)
    weights = read_weights(path)
    state = read_state(path)
    if int(state["step"]) != int(manifest["step"]):
        raise CheckpointError(f"checkpoint file {path / STATE} is step {state['step']} but {path / MANIFEST} "
                              f"says {manifest['step']}; {_fix(path.parent, path)}")
    try:
        drafter.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise CheckpointError(f"{path / WEIGHTS} does not fit this drafter ({err}); build the "
                              f"drafter with the same architecture as the saved run") from None
    if optimizer is not None and state["optimizer"] is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and state["scheduler"] is not None:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state["step"], state["extra"]


def read_weights(path: str | Path) -> dict:
    """The drafter's weights of a step directory, on the CPU (a CheckpointError when unreadable)."""
    return _read(Path(path) / WEIGHTS, lambda f: load_file(str(f), device="cpu"))


def read_state(path: str | Path) -> dict:
    """The non-weight state of a step directory (step, optimizer, scheduler, extra, RNG)."""
    return _read(Path(path) / STATE, lambda f: torch.load(f, map_location="cpu", weights_only=True))


class Checkpointer:
    """A run's checkpoint directory: the checkpoint ``--resume`` starts from (verified against its
    manifest, and refused when it was written with other settings or topology), restoring a
    replica from it, and saving.

    ``topology`` adds what the config does not hold but the data order depends on (the number of
    processes, the number of samples)."""

    def __init__(self, directory: str | Path, config: TrainConfig, topology: Optional[dict] = None) -> None:
        self.directory = Path(directory)
        self.config = config
        mine = config.to_dict()
        self.fingerprint = {**{k: _same_path(k, mine[k]) for k in RESUME_KEYS}, **(topology or {})}
        self.resume_from: Optional[Path] = self._resume_path() if config.resume else None
        self.start_step = self._checked_step(self.resume_from) if self.resume_from is not None else 0
        self.saved: Optional[Path] = None  # the newest checkpoint this run wrote

    def restore(self, drafter: nn.Module, optimizer: Optional[torch.optim.Optimizer], scheduler: Any) -> None:
        """Load the resume checkpoint into a replica (its weights only, without an optimizer);
        nothing when the run starts fresh."""
        if self.resume_from is not None:
            load_checkpoint(self.resume_from, drafter, optimizer, scheduler)

    def save(self, step: int, drafter: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any) -> Path:
        self.saved = save_checkpoint(self.directory, step, drafter, optimizer, scheduler,
                                     {"config": json.dumps(self.config.to_dict())}, fingerprint=self.fingerprint)
        return self.saved

    def _resume_path(self) -> Path:
        path = latest_checkpoint(self.directory)
        interrupted = [p.name for p in interrupted_saves(self.directory)]
        if path is None and interrupted:
            raise CheckpointError(f"--resume: the run in {self.directory.parent} saved no checkpoint (its save "
                                  f"{interrupted[0]} was interrupted and holds none); start over: drop --resume and "
                                  f"pass --overwrite, or choose a new --out-dir")
        if path is None:
            raise CheckpointError(f"--resume: no checkpoint under {self.directory} (no {LATEST}, no step_* directory); "
                                  f"check --out-dir, or start a new run: drop --resume and add --overwrite to "
                                  f"replace what {self.directory.parent} holds")
        return path

    def _checked_step(self, path: Path) -> int:
        manifest = verified(path)
        state = read_state(path)
        # The saved run config holds every setting; the manifest's fingerprint adds the topology
        # (and is all an older checkpoint recorded of some settings).
        saved = {k: v for k, v in _saved_config(state).items() if k in RESUME_KEYS}
        saved.update(manifest.get("fingerprint") or {})
        differ = [(k, saved[k], v) for k, v in self.fingerprint.items() if k in saved and _same_path(k, saved[k]) != v]
        if differ:
            said = "; ".join(f"{_setting(k)} {old!r} when saved, {new!r} now" for k, old, new in differ)
            raise ResumeMismatch(f"--resume: checkpoint {path} was written with other settings: {said}; resume with "
                                 "the saved settings, or start a new run with a new --out-dir")
        if int(state["step"]) != int(manifest["step"]):
            raise CheckpointError(f"checkpoint file {path / STATE} is step {state['step']} but {path / MANIFEST} "
                                  f"says {manifest['step']}; {_fix(path.parent, path)}")
        return int(state["step"])


def _saved_config(state: dict) -> dict:
    try:
        config = json.loads(state.get("extra", {}).get("config", "{}") or "{}")
    except ValueError:
        return {}
    return config if isinstance(config, dict) else {}


def _setting(key: str) -> str:
    """How the user sets ``key``: its command-line flag, or what it is (topology is not a flag)."""
    if key in RESUME_KEYS:
        return "--" + key.replace("_", "-")
    return {"processes": "the number of processes (torchrun --nproc-per-node x nodes)",
            "samples": "the number of samples in the data", "data_digest": "the data's contents"}.get(key, key)


def _same_path(key: str, value: Any) -> Any:
    """A fingerprint's target or data path in one spelling (absolute, links resolved), so the same
    file named another way resumes; other values as they are."""
    return os.path.realpath(value) if key in PATH_KEYS and isinstance(value, str) else value


def verified(path: Path) -> dict:
    """:func:`verify_checkpoint`, its error naming the nearest good checkpoint to use instead."""
    try:
        return verify_checkpoint(path)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; {_fix(path.parent, path)}") from None


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
