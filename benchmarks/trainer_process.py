"""One run of the DFlash trainer in a process of its own, what trainer_startup.py and
tau_reproducibility.py share. A run never outlives its timeout or its parent (``common.wait_or_stop``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from . import common

TRAINER = [sys.executable, "-m", "examples.dflash_trainer"]


@dataclass
class Finished:
    """A run's exit status ("timeout" when it was stopped), its output and its wall time."""
    rc: Union[int, str]
    stdout: str
    stderr: str
    took_s: float


def tree_env(tree: Path, **extra: str) -> dict:
    """This process's environment with ``tree``'s ``src/`` and root first on ``PYTHONPATH``, plus ``extra``."""
    path = os.pathsep.join([str(tree / "src"), str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


def run(cmd: list, *, cwd: Path, env: dict, timeout: float, capture: bool = True) -> Finished:
    """``cmd`` in a fresh process; without ``capture`` its stderr goes to ours and its stdout nowhere."""
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE if capture else subprocess.DEVNULL,
                            stderr=subprocess.PIPE if capture else None, text=True)
    outputs = common.wait_or_stop(proc, timeout)
    took = round(time.perf_counter() - started, 1)
    if outputs is None:
        return Finished("timeout", "", "", took)
    return Finished(proc.returncode, outputs[0] or "", outputs[1] or "", took)


@dataclass
class TrainerRun:
    """A trainer run: its ``--json`` result, or the error that left it without one."""
    result: Optional[dict]
    error: Optional[str]
    stderr: str
    command: str
    took_s: float


def run_trainer(args: list, *, timeout: float, env: Optional[dict] = None, tree: Path = common.ROOT) -> TrainerRun:
    """``python -m examples.dflash_trainer ARGS`` (which must include ``--json``) in ``tree``; the
    last stdout line that is a JSON object is its result."""
    cmd = [*TRAINER, *map(str, args)]
    done = run(cmd, cwd=tree, env=tree_env(tree, **(env or {})), timeout=timeout)
    command = " ".join(["python -m examples.dflash_trainer", *cmd[len(TRAINER):]])
    if done.rc == "timeout":
        return TrainerRun(None, f"timed out after {timeout} s", "", command, done.took_s)
    results = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.rc != 0 or not results:
        sys.stderr.write(done.stderr[-3000:])
        return TrainerRun(None, common.exit_error(done.rc, done.stderr), done.stderr, command, done.took_s)
    return TrainerRun(json.loads(results[-1]), None, done.stderr, command, done.took_s)
