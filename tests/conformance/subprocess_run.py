"""Run a conformance case in every placement, each in a fresh Python process (a failed capture
can leave a process's CUDA state broken, and torch says some things once per process), and
compare what the placements observed."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from .placements import PLACEMENTS, differences

ROOT = Path(__file__).resolve().parents[2]


def _run_placement(name: str, placement: str, timeout: float) -> tuple[dict, str, str]:
    """(observation, failure or "", stderr tail) of case ``name`` in ``placement``.

    Each process compiles on an empty Inductor cache of its own: what Inductor says while it
    lowers (the TF32 hint, for one) would otherwise go to whichever placement compiled first."""
    cache = tempfile.mkdtemp(prefix="conformance-inductor-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    try:
        done = subprocess.run([sys.executable, "-m", "tests.conformance.one_case", name, placement], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=timeout)
        stdout, stderr = done.stdout, done.stderr
        failure = "" if done.returncode == 0 else f"exit {done.returncode}"
    except subprocess.TimeoutExpired as exc:
        stdout, stderr = (s.decode() if isinstance(s, bytes) else (s or "") for s in (exc.stdout, exc.stderr))
        failure = f"no result within {timeout:.0f} s"
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    tail = "\n".join(stderr.strip().splitlines()[-30:])
    lines = [line for line in stdout.splitlines() if line.startswith('{"case"')]
    if not failure and not lines:
        failure = "no result line"
    if failure:
        last = stderr.strip().splitlines()[-1] if stderr.strip() else "(no stderr)"
        return {"error": f"case process failed ({failure}): {last}"}, failure, tail
    return json.loads(lines[-1])["observed"], "", tail


def run_case(name: str, timeout: float = 600.0, parallel: bool = True) -> dict:
    """``{"case", "equal", "differences", "observed", "stderr_tail"}`` for case ``name``; with
    ``parallel`` its placements' processes run at the same time."""
    workers = len(PLACEMENTS) if parallel else 1
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        runs = dict(zip(PLACEMENTS, pool.map(lambda p: _run_placement(name, p, timeout), PLACEMENTS)))
    observed = {p: run[0] for p, run in runs.items()}
    found = [f"{p}: its process failed ({run[1]}): {observed[p]['error']}" for p, run in runs.items() if run[1]]
    found += [line for line in differences(observed) if not runs[line.split(":")[0]][1]]
    tails = "\n".join(f"--- {p}\n{run[2]}" for p, run in runs.items() if run[1])
    return {"case": name, "equal": not found, "differences": found, "observed": observed, "stderr_tail": tails}
