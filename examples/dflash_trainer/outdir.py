"""The run directory (``--out-dir``): a fresh run never overwrites an existing one.

A directory *holds a run* when it has a non-empty ``checkpoints/`` or a ``metrics.jsonl``. A
fresh run into it stops with one line unless ``--overwrite`` says to delete that run; ``--resume``
continues it, and cuts ``metrics.jsonl`` back to the resumed step so the file is the history of
one run. Other files in the directory (torchrun logs, notes) are left alone.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .config import TrainConfig
from .errors import BadInput

log = logging.getLogger("dflash")

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"


class OutDirError(BadInput):
    """``--out-dir`` is a file, unwritable, or holds a run that a fresh run would overwrite."""


def held_run(out: Path) -> list[str]:
    """What of a run `out` holds (``checkpoints/``, ``metrics.jsonl``); empty when none."""
    found = []
    checkpoints = out / CHECKPOINTS
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        found.append(f"{CHECKPOINTS}/")
    if (out / METRICS).exists():
        found.append(METRICS)
    return found


def prepare(config: TrainConfig, *, leader: bool) -> Path:
    """Check (and with ``--overwrite``, on the leader, clear) the run directory before anything
    is written; every process checks, only the leader deletes."""
    out = Path(config.out_dir)
    if out.exists() and not out.is_dir():
        raise OutDirError(f"--out-dir {out} is a file, not a directory; pass a directory path")
    held = held_run(out) if out.is_dir() else []
    if held and not config.resume:
        if not config.overwrite:
            raise OutDirError(f"--out-dir {out} already holds a run ({', '.join(held)}); continue it with --resume, "
                              f"choose a new --out-dir, or pass --overwrite to delete it")
        if leader:
            log.warning("dflash: --overwrite: deleting the run in %s (%s)", out, ", ".join(held))
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
            (out / METRICS).unlink(missing_ok=True)
    if leader:
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=out, prefix=".write_test_"):
                pass
        except OSError as err:
            raise OutDirError(f"--out-dir {out} is not writable ({err.strerror or err}); pass a directory you "
                              f"can write to") from None
    return out


def cut_metrics(path: Path, step: int) -> None:
    """On resume: keep only the records of steps up to `step` (the checkpoint's), so records the
    stopped run wrote after its last checkpoint, and a torn last line, do not mix with the
    resumed ones. Rewritten atomically."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and int(record.get("step", 0)) <= step:
            kept.append(line)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(k + "\n" for k in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
