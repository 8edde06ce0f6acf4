"""Run one conformance case in a fresh Python process (a failed capture can leave a process's
CUDA state broken, so cases never share one) and compare its placements."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from .placements import PLACEMENTS, differences

ROOT = Path(__file__).resolve().parents[2]


def run_case(name: str, timeout: float = 600.0) -> dict:
    """``{"case", "equal", "differences", "observed", "stderr_tail"}`` for case ``name``. A process
    that fails or prints no result is a row whose every placement holds that failure."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, "-m", "tests.conformance.one_case", name], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        stdout, stderr, failure = done.stdout, done.stderr, None if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = exc.stdout or "", exc.stderr or ""
        stdout, stderr = (s.decode() if isinstance(s, bytes) else s for s in (stdout, stderr))
        failure = f"no result within {timeout:.0f} s"
    lines = [line for line in stdout.splitlines() if line.startswith('{"case"')]
    if failure is None and lines:
        observed = json.loads(lines[-1])["observed"]
    else:
        why = failure or "no result line"
        observed = {p: {"error": f"case process failed: {why}"} for p in PLACEMENTS}
    found = differences(observed)
    if failure is not None or not lines:
        found.insert(0, f"the case's process failed ({failure or 'no result line'}); its stderr ends: "
                        f"{stderr.strip().splitlines()[-1] if stderr.strip() else '(empty)'}")
    return {"case": name, "equal": not found, "differences": found, "observed": observed,
            "stderr_tail": "\n".join(stderr.strip().splitlines()[-30:])}
