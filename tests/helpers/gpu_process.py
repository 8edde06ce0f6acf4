"""Run one GPU scenario or trainer run in a fresh process and return the JSON it prints last.

A fresh process each: a failed capture can poison a process (hazard device-wide-capture), and a
compile cache warmed by one test must not hide another's first compile. Set THREADGRAPH_GPU_LOG
to a folder to keep every run's stdout and stderr."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def run_json(tag: str, args: list, timeout: float = 580) -> dict:
    """``python -X faulthandler ARGS...`` from the repository root; its last stdout line as JSON.
    Fails the calling test, with the process's stderr, when it exits non-zero or prints no JSON."""
    return run_logged(tag, args, timeout)[0]


def run_logged(tag: str, args: list, timeout: float = 580, env: dict | None = None) -> tuple[dict, str]:
    """``run_json`` with ``env`` added to the process's environment; (the JSON, its stderr)."""
    cmd = [sys.executable, "-X", "faulthandler", *map(str, args)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **(env or {}))
    started = time.perf_counter()
    # An outer `timeout` sends SIGTERM: stop the session and let subprocess.run kill the child,
    # which would otherwise keep the GPU after pytest is gone. (Only the main thread can set a
    # handler; runs started from a pool rely on the main thread's.)
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _interrupt) if in_main else None
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    seconds = round(time.perf_counter() - started, 1)
    lines = proc.stdout.strip().splitlines()
    printed = lines[-1] if lines and lines[-1].startswith("{") else None
    log_dir = os.environ.get("THREADGRAPH_GPU_LOG")
    if log_dir:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        Path(log_dir, f"{tag}.log").write_text(
            f"rc={proc.returncode} seconds={seconds}\n{' '.join(cmd)}\n"
            + proc.stdout + "\n--- stderr ---\n" + proc.stderr[-20000:])
        _record(Path(log_dir, f"{tag}.json"), tag, args, proc, seconds, printed)
    assert proc.returncode == 0 and printed, (
        f"{tag} exited {proc.returncode} ({'after' if printed else 'without'} printing its result):\n"
        f"{proc.stderr[-4000:]}")
    return json.loads(printed), proc.stderr


def _record(path: Path, tag: str, args: list, proc: subprocess.CompletedProcess, seconds: float,
            printed) -> None:
    """The run as JSON beside its log, what ``benchmarks/gpu_scenarios_results.py`` collects: its
    arguments, exit status, seconds, the result it printed (None when it printed none) and the torch
    and GPU of the machine (the trainer's result names neither)."""
    stderr = [line for line in proc.stderr.splitlines() if line.strip()]
    errors = [line for line in stderr if line.startswith("error:")]  # the trainer's one-line failure, if any
    last = (errors or stderr)[-1][:300] if stderr else None
    try:
        result = json.loads(printed) if printed else None
    except ValueError as exc:  # kept as the run's failure: the collector reports it, run_json fails the test
        result, last = None, f"its last stdout line is not JSON ({exc})"
    machine = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}
    path.write_text(json.dumps({"tag": tag, "args": [str(a) for a in args], "rc": proc.returncode, "seconds": seconds,
                                "result": result, "last_stderr_line": last, "machine": machine}))


def scenario(name: str, *args, timeout: float = 580, module: str = "tests.helpers.gpu_scenarios") -> dict:
    """One scenario of ``module`` (tests/helpers/gpu_scenarios.py or tests/library/gpu_fence_scenarios.py)."""
    tag = "_".join([name, *map(str, args)]).replace("-", "")
    return run_json(tag, ["-m", module, name, *args], timeout=timeout)
