"""What checkpoints need of files and of the process: a file's SHA-256, fsync of a file or a
directory (so a rename survives power loss), and the RNG states saved with every checkpoint."""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path

import torch


def sha256_file(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's contents to disk (directories: their entries, i.e. renames)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # a directory cannot be opened on some platforms (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
