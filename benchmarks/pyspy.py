"""py-spy recordings of this very process: who holds the GIL, and how often anyone does.

Two recordings run side by side: ``--gil`` samples only the thread holding the GIL (samples /
ticks is the GIL's busy fraction; the frames say what the interpreter is busy with) and
``--idle`` samples every thread (a line's share of its thread's wall time, waiting included).
Used by ``gil_profile.py`` (the DFlash pipeline) and ``replay_step_time.py --gil-profile``.
"""

from __future__ import annotations

import collections
import ctypes
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

FRAME = re.compile(r"^(?P<func>.*) \((?P<file>[^()]*):(?P<line>\d+)\)$")
RECORDINGS = (("gil", ["--gil"]), ("wall", ["--idle"]))


def find() -> Optional[str]:
    """The py-spy executable (on PATH or beside this Python), or None."""
    path = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    return path if Path(path).exists() else None


def allow_ptrace() -> None:
    """Let a non-ancestor (py-spy, our child) read this process under Yama ptrace_scope 1."""
    if sys.platform.startswith("linux"):
        PR_SET_PTRACER, PR_SET_PTRACER_ANY = 0x59616D61, ctypes.c_ulong(-1)
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0)


class Recorder:
    """The two recordings of this process into ``out``/{gil,wall}.txt, started once."""

    def __init__(self, py_spy: str, out: Path, seconds: float, rate: int) -> None:
        self.py_spy, self.out, self.seconds, self.rate = py_spy, Path(out), seconds, rate
        self.procs: dict[str, subprocess.Popen] = {}
        self.started = self.run_ended = None

    def start(self) -> None:
        if self.procs:
            return
        base = [self.py_spy, "record", "--pid", str(os.getpid()), "--rate", str(self.rate), "--duration",
                str(max(1, round(self.seconds))), "--threads", "--nonblocking", "--format", "raw"]
        for name, extra in RECORDINGS:
            log = open(self.out / f"py-spy-{name}.log", "w")
            self.procs[name] = subprocess.Popen(base + extra + ["--output", str(self.out / f"{name}.txt")],
                                                stdout=log, stderr=subprocess.STDOUT)
        self.started = time.perf_counter()

    def done(self) -> bool:
        """Both recordings have ended by themselves (their --duration is over). Workers ask every
        step while being profiled, so the clock answers until the duration is over, not waitpid."""
        if not self.procs or time.perf_counter() - self.started < self.seconds:
            return False
        return all(proc.poll() is not None for proc in self.procs.values())

    def finish(self) -> float:
        """Wait for both recordings; a run that ended first cuts them short (SIGINT makes py-spy write).
        Returns the seconds recorded."""
        self.run_ended = time.perf_counter()
        for proc in self.procs.values():
            if proc.poll() is None and time.perf_counter() - self.started < self.seconds:
                proc.send_signal(signal.SIGINT)
        for name, proc in self.procs.items():
            if proc.wait(timeout=60) != 0 or not (self.out / f"{name}.txt").exists():
                raise RuntimeError(f"py-spy {name} recording failed (exit {proc.returncode}): "
                                   f"{(self.out / f'py-spy-{name}.log').read_text()[-600:]}")
        return min(self.seconds, self.run_ended - self.started)

    def samples(self, name: str) -> list[tuple[str, list[str], int]]:
        return read_samples(self.out / f"{name}.txt")


def read_samples(path: Path) -> list[tuple[str, list[str], int]]:
    """(thread name, frames root first, count) per line of py-spy's raw (collapsed) output."""
    samples = []
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[1] if ": " in frames[0] else frames[0]
        samples.append((thread, frames[1:], int(count)))
    return samples


def gil_busy(gil: list, wall: list) -> tuple[Optional[float], int, int]:
    """(busy fraction, GIL samples, ticks): ticks are the most-sampled thread's wall samples."""
    per_thread = collections.Counter()
    for thread, _, count in wall:
        per_thread[thread] += count
    ticks = max(per_thread.values()) if per_thread else 0
    held = sum(count for _, _, count in gil)
    return (held / ticks if ticks else None), held, ticks


def short_frame(frame: str) -> str:
    """'func (file.py:line)' with the path cut to its last two parts, for tables."""
    match = FRAME.match(frame)
    return f"{match['func']} ({_short_path(match['file'])}:{match['line']})" if match else frame


def frame_file(frame: str) -> str:
    match = FRAME.match(frame)
    return _short_path(match["file"]) if match else frame


def _short_path(path: str) -> str:
    parts = Path(path).parts
    if any(part.startswith("torchinductor") for part in parts):  # code Inductor wrote, named by a hash
        return f"inductor-generated {parts[-1][:8]}"
    return "/".join(parts[-2:])


def top_shares(gil: list, key, n: int) -> list[tuple[str, float]]:
    """The n commonest key(frames) among the GIL samples, with their share of them."""
    counts = collections.Counter()
    for _, frames, count in gil:
        counts[key(frames)] += count
    total = sum(counts.values()) or 1
    return [(name, count / total) for name, count in counts.most_common(n)]
