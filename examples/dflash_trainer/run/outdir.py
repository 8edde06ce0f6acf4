"""The run directory (``--out-dir``): one run at a time, and a fresh run never overwrites another.

A directory *holds a run* when its ``checkpoints/`` has what the checkpointer writes (step
directories, ``latest``) or its ``metrics.jsonl`` has records. A fresh run into it stops with one
line unless ``--overwrite`` says to delete that run; ``--resume`` continues it, and cuts
``metrics.jsonl`` back to the resumed step so the file is the history of one run. ``--overwrite``
deletes only what the trainer wrote, and only once the run's inputs have been checked
(``clear_overwritten``, after the pipeline is built): a typo in another flag costs nothing. Other
files (torchrun logs, notes, someone's files in ``checkpoints/``) are left alone.

While a run is in a directory its leader holds an advisory lock there (``RunLock``), so a second
run into the same directory is refused instead of mixing its checkpoints and log with the first's.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

from .checkpoint import interrupted_saves, written_by_checkpointer
from ..config import TrainConfig
from ..errors import BadInput

try:
    import fcntl
except ImportError:  # not POSIX: no lock, the other checks still hold
    fcntl = None

log = logging.getLogger("dflash")

CHECKPOINTS = "checkpoints"
METRICS = "metrics.jsonl"
LOCK = ".dflash.lock"


class OutDirError(BadInput):
    """``--out-dir`` is a file, unwritable, in use, or holds a run that a fresh run would overwrite."""


def held_run(out: Path) -> list[str]:
    """What of a run `out` holds (``checkpoints/``, ``metrics.jsonl``); empty when none. An empty
    ``metrics.jsonl`` is no run: one that failed before its first step leaves it, and neither is what an
    interrupted save left (a temporary step directory holds no checkpoint)."""
    found = []
    interrupted = set(interrupted_saves(out / CHECKPOINTS))
    if [p for p in written_by_checkpointer(out / CHECKPOINTS) if p not in interrupted]:
        found.append(f"{CHECKPOINTS}/")
    metrics = out / METRICS
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS)
    return found


class RunLock:
    """An exclusive ``flock`` on ``<out>/.dflash.lock`` for as long as the run lasts; the kernel
    drops it when the process ends, however it ends, so a crashed run never blocks the next."""

    def __init__(self, out: Path) -> None:
        self.path = out / LOCK
        self._file = None

    def acquire(self) -> RunLock:
        if fcntl is None:
            return self
        f = open(self.path, "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise OutDirError(f"--out-dir {self.path.parent} is in use by another run (pid {holder}); wait for it "
                              f"to end or choose another --out-dir") from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()}\n")
        f.flush()
        self._file = f
        return self

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing drops the flock
            self._file = None


def prepare(config: TrainConfig, *, leader: bool) -> Optional[RunLock]:
    """Check the run directory before anything is written; every process checks. The leader
    creates it, takes its lock (returned; release it when the run ends) and checks it is writable."""
    out = Path(config.out_dir)
    if out.exists() and not out.is_dir():
        raise OutDirError(f"--out-dir {out} is a file, not a directory; pass a directory path")
    checkpoints = out / CHECKPOINTS
    if checkpoints.exists() and not checkpoints.is_dir():
        raise OutDirError(f"{checkpoints} is a file, but the run saves its checkpoints in a directory of that "
                          f"name; move the file away or choose another --out-dir")
    lock = None
    if leader:
        try:
            out.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=out, prefix=".write_test_"):
                pass
        except OSError as err:
            raise OutDirError(f"--out-dir {out} is not writable ({err.strerror or err}); pass a directory you "
                              f"can write to") from None
        lock = RunLock(out).acquire()  # before looking for a run: two fresh runs cannot both find none
    try:
        _check_fresh(config, out)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return lock


def _check_fresh(config: TrainConfig, out: Path) -> None:
    held = held_run(out) if out.is_dir() else []
    if config.resume and f"{CHECKPOINTS}/" not in held:  # said before anything is built or loaded
        raise OutDirError(f"--resume: --out-dir {out} holds no checkpoint to resume from; start over: drop --resume "
                          f"and pass --overwrite, or choose a new --out-dir")
    if not held or config.resume or config.overwrite:
        return
    if held == [METRICS]:
        raise OutDirError(f"--out-dir {out} holds the log of a run that saved no checkpoint ({METRICS}); pass "
                          f"--overwrite to start over there, or choose a new --out-dir")
    raise OutDirError(f"--out-dir {out} already holds a run ({', '.join(held)}); continue it with --resume, "
                      f"choose a new --out-dir, or pass --overwrite to delete it")


def clear_overwritten(config: TrainConfig, *, leader: bool) -> None:
    """A fresh run, on the leader, once its inputs are checked: delete what an interrupted save left and,
    with ``--overwrite``, what the trainer wrote there (step directories, ``latest``, ``metrics.jsonl``),
    nothing else."""
    out = Path(config.out_dir)
    if leader and not config.resume:
        for leftover in interrupted_saves(out / CHECKPOINTS):
            log.info("dflash: removing %s, left by a save that was cut short (it holds no checkpoint)", leftover)
            if leftover.is_dir():
                shutil.rmtree(leftover)
            else:
                leftover.unlink()
    held = held_run(out)
    if not (leader and config.overwrite and not config.resume and held):
        return
    log.warning("dflash: --overwrite: deleting the run in %s (%s)", out, ", ".join(held))
    for path in written_by_checkpointer(out / CHECKPOINTS):
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    (out / METRICS).unlink(missing_ok=True)


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
