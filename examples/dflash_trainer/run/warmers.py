"""Compile warmers (``--compile-warmers``): the target step and the drafter step compiled first in
two helper processes, one each, while this process builds its pipeline.

Dynamo compiles one frame at a time in a process (a process-wide lock), so the target's compile and
the drafters' queue behind each other however many threads wait for them. Processes do not share
that lock: a warmer runs the very components of the run (``pipeline.Pipeline``: the target stage on
the first batch, a drafter replica's forward-backward on the example hand-off item) on the first
device, and so fills Inductor's caches (FX graph, AOTAutograd) with the same graphs; the workers of
this process then wait for their warmer (phase ``compile_warmer`` of their first step) and load the
compiled code instead of generating it. On a CPU, with the drafter compiled by a warmer whose
weights and seed differed, the replica's first forward-backward took 2.1 s against 21 s cold: the
caches key on the graphs, shapes and dtypes, not on weight values.

Limits (the feature is off by default until a GPU run measures it): a warmer loads the whole target
on the first device, so the run needs room for two more copies of its weights there, which the
trainer's memory check does not count; the caches key on the device, so only the first device's
workers wait for warmers; with bf16 autocast (the GPU default) AOTAutograd's cache may refuse the
drafter's graph on some torch releases, leaving only Inductor's FX graph cache to hit.

A warmer that fails or outlasts ``WAIT_S`` costs nothing but its time: the workers log it (with
the warmer's log file) and compile as they would have. A run that fails or stops ends its warmers
at once, which also ends any worker's wait for them. Warmers hold a CUDA context and the target's
weights on the first device while they run, and are stopped when the run ends. One process only:
under torchrun each rank compiles for itself.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from ..config import TrainConfig

log = logging.getLogger("dflash")

PARTS = ("target", "drafter")
WAIT_S = 600.0  # the most a worker waits for its warmer before compiling for itself


class CompileWarmers:
    """The helper processes of one run, by part; ``wait(part)`` returns once that part's warmer
    has ended (or after ``wait_s``), ``stop()`` ends any still running."""

    def __init__(self, procs: dict[str, subprocess.Popen], logs: dict[str, Path], wait_s: float = WAIT_S) -> None:
        self._procs, self.logs, self.wait_s = procs, logs, wait_s
        self.seconds: dict[str, Optional[float]] = {part: None for part in procs}
        self._started = time.perf_counter()
        self._stopping = False  # set by stop(): a warmer ended by it is no failure to report

    @classmethod
    def start(cls, config: TrainConfig, wait_s: float = WAIT_S) -> CompileWarmers:
        """One warmer process per part, its output in ``--out-dir``/compile-warmer-PART.log."""
        settings = json.dumps(warmer_config(config).to_dict())
        procs, logs = {}, {}
        for part in PARTS:
            logs[part] = Path(config.out_dir) / f"compile-warmer-{part}.log"
            with open(logs[part], "w", encoding="utf-8") as out:
                # A session of its own (a terminal's Ctrl-C is the run's to handle: it stops them), and
                # ended with this process even when it is killed.
                procs[part] = subprocess.Popen([sys.executable, "-m", __name__, part, settings], stdout=out,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=dict(os.environ),
                                               start_new_session=True, preexec_fn=_end_with_parent)
        log.info("dflash: compile warmers started (pids %s)", ", ".join(f"{p} {q.pid}" for p, q in procs.items()))
        return cls(procs, logs, wait_s)

    def wait(self, part: str) -> None:
        """Block until ``part``'s warmer has ended; log a failure or a timeout (then stop it)."""
        proc = self._procs[part]
        left = self.wait_s - (time.perf_counter() - self._started)
        try:
            code = proc.wait(timeout=max(0.0, left))
        except subprocess.TimeoutExpired:
            log.warning("dflash: the %s compile warmer still runs after %.0f s; stopping it and compiling here "
                        "(its log: %s)", part, self.wait_s, self.logs[part])
            _end(proc)
            return
        if self.seconds[part] is None:
            self.seconds[part] = round(time.perf_counter() - self._started, 2)
        if code != 0 and not self._stopping:
            log.warning("dflash: the %s compile warmer failed (exit %d); compiling here instead (its log: %s)",
                        part, code, self.logs[part])

    def running(self, part: str) -> bool:
        return self._procs[part].poll() is None

    def stop(self) -> None:
        """End the warmers still running (the run ended, failed or stops): a worker waiting for one
        returns at once."""
        self._stopping = True
        for proc in self._procs.values():
            _end(proc)


def _end_with_parent() -> None:
    """In the warmer, before it starts: SIGTERM when the process that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1: PR_SET_PDEATHSIG


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warmer_config(config: TrainConfig) -> TrainConfig:
    """The run's settings for a warmer: the same model, data, shapes and graphs; it evaluates,
    saves, resumes and overwrites nothing."""
    values = config.to_dict()
    values.update(eval_every=0, checkpoint_every=0, no_checkpoints=True, resume=False, overwrite=False,
                  compile_warmers=False)
    return TrainConfig.from_dict(values)


def warm(config: TrainConfig, part: str, policy=None) -> None:
    """Compile ``part``'s step as the run's workers will, on the run's first device. ``policy``
    replaces the run's execution policy (tests compile on a CPU this way)."""
    import dataclasses

    import torch

    from ..pipeline import Pipeline

    parts = Pipeline.build(config)
    if policy is not None:
        parts = dataclasses.replace(parts, policy=policy)
    device = torch.device(parts.devices[0])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if part == "target":
        parts.target_stage(device).step(parts.batches(0))
    else:
        parts.replica(device).warm_up(parts.example_item(device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("config", help="the run's TrainConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    began = time.perf_counter()
    warm(TrainConfig.from_dict(json.loads(args.config)), args.part)
    print(f"compile warmer {args.part}: done in {time.perf_counter() - began:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
