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

A warmer that fails or outlasts ``--compile-warmer-timeout-s`` costs nothing but its time: it is
logged (with its log file) and stopped, and the workers compile as they would have. A warmer
reports its end by exiting at once after its compile (``os._exit``: no interpreter teardown, where
Inductor's compile-worker shutdown and CUDA's can take minutes, pytorch#162199). A run that fails
or stops ends its warmers at once, which also ends any worker's wait for them. Warmers hold a CUDA
context and the target's weights on the first device while they run, and are stopped when the run
ends. ``RunResult.compile_warmers`` holds each warmer's outcome and seconds, ``compile_caches`` the
run's own cache hits and misses. One process only: under torchrun each rank compiles for itself.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..config import TrainConfig

log = logging.getLogger("dflash")

PARTS = ("target", "drafter")
GRACE_S = 10.0  # from SIGTERM to SIGKILL when a warmer is ended
REAP_S = 30.0  # after SIGKILL: a process stuck in the driver may never go, and the run does not wait on it
# Inductor's FX graph cache and AOTAutograd's cache, as torch._dynamo.utils.counters counts them.
CACHE_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("inductor", "fxgraph_cache_miss"),
                  ("aot_autograd", "autograd_cache_hit"), ("aot_autograd", "autograd_cache_miss"))
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WarmerWait:
    """What a worker's first step waits for: ``wait()`` blocks until ``part``'s warmer has settled
    and returns its outcome (``done``, ``failed (exit N)``, ``timed out`` or ``stopped``)."""

    part: str
    pid: int
    log_path: Path
    wait: Callable[[], str]


class CompileWarmers:
    """The helper processes of one run, by part. A thread per warmer waits for its exit (at most
    ``wait_s`` from the start, then ends it) and records its outcome once, under a lock, with one
    log line; ``wait(part)`` returns that outcome once it is known; ``stop()`` ends any still running."""

    def __init__(self, procs: dict[str, subprocess.Popen], logs: dict[str, Path], wait_s: float) -> None:
        self._procs, self.logs, self.wait_s = procs, logs, wait_s
        self.seconds: dict[str, Optional[float]] = {part: None for part in procs}
        self.outcomes: dict[str, Optional[str]] = {part: None for part in procs}
        self._started = time.perf_counter()
        self._lock = threading.Lock()  # the outcomes, seconds and _stopping
        self._stopping = False  # set by stop(): a warmer ended by it is no failure to report
        self._settled = {part: threading.Event() for part in procs}
        self._watchers = [threading.Thread(target=self._watch, args=(part,), name=f"dflash-compile-warmer-{part}",
                                           daemon=True) for part in procs]
        for watcher in self._watchers:
            watcher.start()

    @classmethod
    def start(cls, config: TrainConfig) -> CompileWarmers:
        """One warmer process per part, its output in ``--out-dir``/compile-warmer-PART.log; if
        starting one fails, those already started are ended before the error goes on."""
        settings = json.dumps(warmer_config(config).to_dict())
        procs, logs = {}, {}
        try:
            for part in PARTS:
                logs[part] = Path(config.out_dir) / f"compile-warmer-{part}.log"
                with open(logs[part], "w", encoding="utf-8") as out:
                    # A session of its own: a terminal's Ctrl-C is the run's to handle (it stops them),
                    # and the warmer's process group, its compile workers included, can be ended whole.
                    procs[part] = subprocess.Popen(
                        [sys.executable, "-m", __name__, part, "--parent", str(os.getpid()), settings], stdout=out,
                        stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        except BaseException:
            for proc in procs.values():
                _end(proc)
            raise
        log.info("dflash: compile warmers started (pids %s; at most %.0f s, --compile-warmer-timeout-s)",
                 ", ".join(f"{p} {q.pid}" for p, q in procs.items()), config.compile_warmer_timeout_s)
        return cls(procs, logs, config.compile_warmer_timeout_s)

    def waiter(self, part: str) -> WarmerWait:
        return WarmerWait(part, self._procs[part].pid, self.logs[part], lambda: self.wait(part))

    def wait(self, part: str) -> str:
        """Block until ``part``'s warmer has settled (its watcher ends it ``wait_s`` after the start
        at the latest, and waits at most ``GRACE_S + REAP_S`` for it to go); its outcome."""
        self._settled[part].wait()
        return self.outcomes[part]

    def running(self, part: str) -> bool:
        return self._procs[part].poll() is None

    def report(self) -> dict[str, dict]:
        """Each warmer's outcome and seconds from the start to it (None for one not settled yet)."""
        with self._lock:
            return {part: {"outcome": self.outcomes[part], "seconds": self.seconds[part]} for part in self._procs}

    def stop(self) -> None:
        """End the warmers still running (the run ended, failed or stops); a worker waiting for one
        returns at once."""
        with self._lock:
            self._stopping = True
        for part, proc in self._procs.items():
            if self._record(part, "stopped"):
                log.info("dflash: the %s compile warmer: stopped after %.1f s", part, self.seconds[part])
            _end(proc)
            self._settled[part].set()  # also when it could not be ended: nothing waits for it any more

    def _watch(self, part: str) -> None:
        proc = self._procs[part]
        try:
            left = None if math.isinf(self.wait_s) else max(0.0, self.wait_s - (time.perf_counter() - self._started))
            try:
                code = proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                if self._record(part, "timed out"):
                    log.warning("dflash: the %s compile warmer still runs after %.0f s (--compile-warmer-timeout-s); "
                                "stopping it, its workers compile themselves (its log: %s)",
                                part, self.wait_s, self.logs[part])
                _end(proc)
                return
            with self._lock:
                stopping = self._stopping
            if code == 0:
                outcome = "done"
            else:
                outcome = "stopped" if stopping else f"failed (exit {code})"
            if not self._record(part, outcome):
                return
            if outcome.startswith("failed"):
                log.warning("dflash: the %s compile warmer failed (exit %d) after %.1f s; its workers compile "
                            "themselves (its log: %s)", part, code, self.seconds[part], self.logs[part])
            else:
                log.info("dflash: the %s compile warmer: %s after %.1f s", part, outcome, self.seconds[part])
        finally:
            self._settled[part].set()

    def _record(self, part: str, outcome: str) -> bool:
        """Record ``part``'s outcome unless one is already; whether this call recorded it."""
        with self._lock:
            if self.outcomes[part] is not None:
                return False
            self.outcomes[part] = outcome
            self.seconds[part] = round(time.perf_counter() - self._started, 2)
            return True


def cache_counts() -> dict[str, int]:
    """This process's Inductor FX graph cache and AOTAutograd cache hits and misses so far (0 for a
    counter this torch does not keep)."""
    from torch._dynamo.utils import counters

    return {name: int(counters.get(group, {}).get(name, 0)) for group, name in CACHE_COUNTERS}


def _end(proc: subprocess.Popen) -> None:
    """End a running warmer with its process group (it leads its own session, so Inductor's compile
    workers are in it): SIGTERM, SIGKILL after ``GRACE_S``. A warmer that has exited is left: its
    compile workers leave by themselves (they watch their parent), and its group id, once no
    process holds it, may be reused."""
    if proc.poll() is not None:
        return
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE_S)
        return
    except subprocess.TimeoutExpired:
        log.warning("dflash: compile warmer pid %d still runs %.0f s after SIGTERM; killing it", proc.pid, GRACE_S)
    _signal_group(proc.pid, signal.SIGKILL)
    try:
        proc.wait(timeout=REAP_S)
    except subprocess.TimeoutExpired:
        log.error("dflash: compile warmer pid %d did not end %.0f s after SIGKILL; leaving it", proc.pid, REAP_S)


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:  # the whole group has exited meanwhile: nothing left to end
        pass


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


def main(argv=None) -> None:
    """The warmer process: compile, report, and exit at once (``os._exit``) with 0 when done, 1
    when the compile failed (its traceback in the log first)."""
    parser = argparse.ArgumentParser(prog=f"python -m {__name__}", description=__doc__.splitlines()[0])
    parser.add_argument("part", choices=PARTS)
    parser.add_argument("--parent", type=int, required=True, help="the run's pid: the warmer ends with it")
    parser.add_argument("config", help="the run's TrainConfig as JSON")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    code = _main(args.part, args.parent, args.config)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _main(part: str, parent: int, settings: str) -> int:
    if not _end_with_parent(parent):
        log.info("compile warmer %s: the run (pid %d) ended before this warmer started; nothing to do", part, parent)
        return 0
    began = time.perf_counter()
    try:
        warm(TrainConfig.from_dict(json.loads(settings)), part)
    except Exception:  # reported here, as the exit status and the traceback in the warmer's log
        log.error("compile warmer %s: failed after %.1f s\n%s", part, time.perf_counter() - began,
                  traceback.format_exc())
        return 1
    log.info("compile warmer %s: done in %.1f s; caches %s", part, time.perf_counter() - began,
             json.dumps(cache_counts()))
    return 0


def _end_with_parent(parent: int) -> bool:
    """Have the kernel send SIGTERM when the run's thread that started this warmer ends (Linux;
    train() starts them from its own thread, which outlives them), then check the run is still
    this process's parent: it may have died before the prctl call. Whether it is."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGTERM), 0, 0, 0) != 0:
            log.warning("compile warmer: prctl(PR_SET_PDEATHSIG) failed (%s); if the run is killed, this warmer "
                        "still runs to its end", os.strerror(ctypes.get_errno()))
    return os.getppid() == parent


if __name__ == "__main__":
    main()
