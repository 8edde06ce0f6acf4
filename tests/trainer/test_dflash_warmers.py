"""Compile warmers (run/warmers.py): a warmer process fills Inductor's caches with the very graphs a
run's workers compile, whatever its weights; a worker waits for its warmer, and a warmer that fails
or hangs costs only its time."""

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.run.warmers import CompileWarmers, WarmerWait
from examples.dflash_trainer.train import train
from examples.dflash_trainer.workers import TargetWorker

from tests.helpers.tiny_run import tiny_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)

# Compile on a CPU (Inductor without CUDA graphs: the trainer itself only compiles on CUDA) as the
# run's worker would, and print Inductor's and AOTAutograd's cache counters.
COMPILE = """
import json, sys
from torch._dynamo.utils import counters
from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.policy import ExecutionPolicy
from examples.dflash_trainer.run.warmers import warm
config = TrainConfig.from_dict(json.loads(sys.argv[2]))
warm(config, sys.argv[1], policy=ExecutionPolicy(mode="reduce-overhead", bf16=False))
print(json.dumps({"inductor": dict(counters["inductor"]), "aot": dict(counters["aot_autograd"])}))
"""
# The warmer process itself (its main(), which exits with os._exit), its steps compiled on a CPU.
WARMER = """
import os, sys
from examples.dflash_trainer.policy import ExecutionPolicy
from examples.dflash_trainer.run import warmers
ExecutionPolicy.resolve = classmethod(lambda cls, config, devices: cls(mode="reduce-overhead", bf16=False))
warmers.main([sys.argv[1], "--parent", str(os.getppid()), sys.argv[2]])
"""


def _env(**extra):
    return dict(os.environ, PYTHONPATH=str(ROOT), **extra)


def _compile(part, config, cache):
    proc = subprocess.run([sys.executable, "-c", COMPILE, part, json.dumps(config.to_dict())], cwd=ROOT,
                          env=_env(TORCHINDUCTOR_CACHE_DIR=str(cache)), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _warm(part, config, cache):
    """The warmer's own cache counters, from its done line."""
    proc = subprocess.run([sys.executable, "-c", WARMER, part, json.dumps(config.to_dict())], cwd=ROOT,
                          env=_env(TORCHINDUCTOR_CACHE_DIR=str(cache)), capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    done = re.search(rf"compile warmer {part}: done in [0-9.]+ s; caches (\{{.*\}})", proc.stderr)
    assert done, proc.stderr[-3000:]
    return json.loads(done.group(1))


@pytest.mark.parametrize("part", ["drafter", "target"])
def test_a_warmer_with_other_weights_leaves_the_runs_compile_a_cache_hit(part, tiny_assets, tmp_path):
    cache = tmp_path / "inductor"
    # the warmer, through its main() and its os._exit: another seed (other drafter weights, other data order)
    warmer = _warm(part, tiny_config(tiny_assets, tmp_path / "warmer", seed=7), cache)
    assert warmer["fxgraph_cache_miss"] >= 1 and not warmer["fxgraph_cache_hit"], warmer
    run = _compile(part, tiny_config(tiny_assets, tmp_path / "run"), cache)
    assert run["inductor"].get("fxgraph_cache_hit", 0) >= 1 and not run["inductor"].get("fxgraph_cache_miss"), run
    if part == "drafter":  # forward and backward both from Inductor's cache; AOTAutograd's own cache passes the
        # chunked loss's autograd.Function by (a bypass), so its trace runs again, but never misses
        assert run["inductor"].get("fxgraph_cache_hit", 0) >= 2 and not run["aot"].get("autograd_cache_miss"), run


# The warmer's main() with its compile replaced: an atexit hook as slow as Inductor's compile-worker
# shutdown can be at exit (pytorch#162199), which the warmer's report must not wait for.
SLOW_EXIT = """
import atexit, os, sys, time
from examples.dflash_trainer.run import warmers
if len(sys.argv) > 2:  # the hook leaves a mark: a warmer that waited for it would show it
    atexit.register(lambda: (open(sys.argv[2], "w").write("atexit ran"), time.sleep(120)))
else:
    atexit.register(time.sleep, 120)
def warm(config, part):
    if sys.argv[1] == "fail":
        raise RuntimeError("no room on the device")
    if sys.argv[1] == "slow":
        print("warming", flush=True)
        time.sleep(120)
warmers.warm = warm
warmers.main(["target", "--parent", str(os.getppid()), "{}"])
"""
# Starts a warmer (SLOW_EXIT's "slow"), prints its pid, and waits to be killed.
PARENT = """
import subprocess, sys, time
warmer = subprocess.Popen([sys.executable, "-c", sys.argv[1], "slow"])
print(warmer.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("how, code, said", [("done", 0, "compile warmer target: done in"),
                                             ("fail", 1, "RuntimeError: no room on the device")])
def test_a_warmer_exits_right_after_its_report_whatever_its_exit_would_wait_for(how, code, said, tmp_path):
    mark = tmp_path / "atexit.mark"
    proc = subprocess.run([sys.executable, "-c", SLOW_EXIT, how, str(mark)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == code and said in proc.stderr, proc.stderr[-3000:]
    assert not mark.exists()  # it exited without running the slow exit hook


def test_a_warmer_whose_run_is_gone_before_it_starts_does_nothing():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    # settings that fail if it went on to build anything
    proc = subprocess.run([sys.executable, "-m", "examples.dflash_trainer.run.warmers", "target", "--parent",
                           str(gone.pid), '{"no_such_key": 1}'], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"the run (pid {gone.pid}) ended before this warmer started; nothing to do" in proc.stderr


def _gone(pid):
    """Whether ``pid`` has exited (a zombie not yet reaped by whoever inherited it counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _until_gone(pid, within_s=20.0):
    deadline = time.monotonic() + within_s
    while not _gone(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _gone(pid)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_warmer_ends_when_its_run_is_killed():
    parent = subprocess.Popen([sys.executable, "-c", PARENT, SLOW_EXIT], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              text=True)
    warmer = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "warming"  # past its check of its parent: the signal ends it
        parent.kill()
        parent.wait()
        assert _until_gone(warmer)
    finally:
        parent.stdout.close()
        with contextlib.suppress(ProcessLookupError):  # ended, as it should be
            os.kill(warmer, signal.SIGKILL)


def _warmers(tmp_path, scripts, wait_s=60.0):
    """Warmers of these scripts, started as CompileWarmers.start does: each in a session of its own."""
    procs, logs = {}, {}
    for part, script in scripts.items():
        logs[part] = tmp_path / f"{part}.log"
        with open(logs[part], "w", encoding="utf-8") as out:
            procs[part] = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT,
                                           start_new_session=True)
    return CompileWarmers(procs, logs, wait_s=wait_s)


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _ends_with_marker(marker: Path, sleep_s: float) -> str:
    """A warmer script that writes ``marker`` as its last act, after ``sleep_s``."""
    return f"import pathlib, time; time.sleep({sleep_s}); pathlib.Path({str(marker)!r}).write_text('end')"


def test_a_worker_waits_for_its_warmer_and_a_failed_one_is_logged_with_its_log(tmp_path, caplog):
    marker = tmp_path / "target.end"
    warmers = _warmers(tmp_path, {"target": _ends_with_marker(marker, 0.5), "drafter": "import sys; sys.exit(3)"})
    with caplog.at_level(logging.INFO, logger="dflash"):
        assert warmers.wait("target") == "done"
        # the wait returned after the warmer's last act, not before
        assert marker.read_text() == "end" and not warmers.running("target") and warmers.seconds["target"] > 0
        assert warmers.wait("drafter") == "failed (exit 3)"
    assert len(_warnings(caplog)) == 1 and re.fullmatch(
        r"dflash: the drafter compile warmer failed \(exit 3\) after [0-9.]+ s; its workers compile themselves "
        rf"\(its log: {re.escape(str(tmp_path / 'drafter.log'))}\)", _warnings(caplog)[0]), caplog.text
    assert "dflash: the target compile warmer: done after" in caplog.text
    assert warmers.report()["drafter"]["outcome"] == "failed (exit 3)"


def test_many_workers_waiting_on_a_warmer_past_its_time_see_one_outcome_logged_once(tmp_path, caplog):
    marker = tmp_path / "target.end"
    warmers = _warmers(tmp_path, {"target": _ends_with_marker(marker, 120)}, wait_s=1.0)
    outcomes = []
    waiters = [threading.Thread(target=lambda: outcomes.append(warmers.wait("target"))) for _ in range(5)]
    with caplog.at_level(logging.INFO, logger="dflash"):
        for waiter in waiters:
            waiter.start()
        for waiter in waiters:
            waiter.join(timeout=30)
    assert not any(waiter.is_alive() for waiter in waiters) and outcomes == ["timed out"] * 5
    assert not warmers.running("target")  # stopped, not left to compete
    assert len(_warnings(caplog)) == 1 and _warnings(caplog)[0].startswith(
        "dflash: the target compile warmer still runs after 1 s (--compile-warmer-timeout-s); stopping it"), caplog.text
    assert warmers.report() == {"target": {"outcome": "timed out", "seconds": warmers.seconds["target"]}}
    assert not marker.exists()  # ended before its own end, by the timeout


def test_stopping_the_warmers_ends_a_workers_wait_without_a_failure_reported(tmp_path, caplog):
    warmers = _warmers(tmp_path, {"drafter": "import time; time.sleep(120)"})
    outcome = []
    waiter = threading.Thread(target=lambda: outcome.append(warmers.wait("drafter")))
    with caplog.at_level(logging.INFO, logger="dflash"):
        waiter.start()
        warmers.stop()  # what a failing or stopping run does; a wait begun before or after it returns
        waiter.join(timeout=30)
    assert not waiter.is_alive() and outcome == ["stopped"]
    assert not warmers.running("drafter") and not _warnings(caplog)


# A warmer whose Inductor compile workers are its children: it writes their pid to its log and waits.
WITH_CHILD = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


def test_stopping_a_warmer_ends_its_whole_process_group(tmp_path):
    warmers = _warmers(tmp_path, {"target": WITH_CHILD})
    deadline = time.monotonic() + 30
    while not (tmp_path / "target.log").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.1)  # until the warmer has started its child
    child = int((tmp_path / "target.log").read_text())
    try:
        warmers.stop()
        assert not warmers.running("target") and _until_gone(child)
    finally:
        with contextlib.suppress(ProcessLookupError):  # ended, as it should be
            os.kill(child, signal.SIGKILL)


def test_a_warmer_started_before_another_fails_to_start_is_ended(tmp_path, monkeypatch):
    popen, started = subprocess.Popen, []

    def start(args, **kwargs):  # the first warmer a sleeper, the second cannot start
        if started:
            raise OSError("no more processes")
        started.append(popen([sys.executable, "-c", "import time; time.sleep(120)"], **kwargs))
        return started[0]

    monkeypatch.setattr(subprocess, "Popen", start)
    with pytest.raises(OSError, match="no more processes"):
        CompileWarmers.start(TrainConfig(out_dir=str(tmp_path), compile_warmers=True))
    assert len(started) == 1 and started[0].poll() is not None


def test_a_worker_says_what_it_waits_for_in_the_log_and_its_activity(tmp_path, caplog):
    seen = []

    def wait():
        seen.append(worker.activity[0])
        worker.stop()  # the step ends after the wait
        return "done"

    worker = TargetWorker(0, "cpu", stage=None, batches=types.SimpleNamespace(done=False), handoff=None,
                          warmed=WarmerWait("target", 4321, tmp_path / "target.log", wait))
    with caplog.at_level(logging.INFO, logger="dflash"):
        worker.step()
    assert seen == ["waiting for the target compile warmer (pid 4321)"]
    assert worker.activity[0] != seen[0]
    messages = [r.getMessage() for r in caplog.records]
    log_path = tmp_path / "target.log"
    assert messages[0] == f"dflash: target-0: waiting for the target compile warmer (pid 4321, log {log_path})"
    assert re.fullmatch(r"dflash: target-0: waited [0-9.]+ s for the target compile warmer: done", messages[1]), \
        messages
    assert "compile_warmer" in worker.phases.ms


def test_an_eager_run_asked_for_warmers_starts_none(tiny_assets, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dflash"):
        result = train(tiny_config(tiny_assets, tmp_path, max_steps=2, compile_warmers=True))
    assert len(result.losses) == 2
    assert "nothing compiles in this run (eager); no warmers" in caplog.text
    assert not list(tmp_path.glob("compile-warmer-*.log"))
    assert "compile_warmers" not in result.to_json()


def test_a_compiled_run_starts_its_warmers_and_reports_them_and_its_cache_hits(tiny_assets, tmp_path, monkeypatch,
                                                                               caplog):
    """The run's own path, on a CPU: its steps compiled (Inductor without CUDA graphs) by forcing the
    policy in this process; the warmer processes resolve theirs as a CPU run does (eager), so here
    they check the plumbing: started with the run's settings, waited for, reported, their logs kept."""
    from examples.dflash_trainer.policy import ExecutionPolicy

    monkeypatch.setattr(ExecutionPolicy, "resolve",
                        classmethod(lambda cls, config, devices: cls(mode="reduce-overhead", bf16=False)))
    with caplog.at_level(logging.INFO, logger="dflash"):
        result = train(tiny_config(tiny_assets, tmp_path, max_steps=3, compile_warmers=True))
    assert len(result.losses) == 3
    reported = result.to_json()
    workers = reported["workers"]
    assert len(workers) == 8 and all("compile_warmer" in w["phases_warmup_s"] for w in workers.values()), workers
    outcomes = [(part, r["outcome"]) for part, r in reported["compile_warmers"].items()]
    assert outcomes == [("target", "done"), ("drafter", "done")]
    assert all(r["seconds"] > 0 for r in reported["compile_warmers"].values())
    caches = reported["compile_caches"]
    assert set(caches) == {"fxgraph_cache_hit", "fxgraph_cache_miss", "autograd_cache_hit", "autograd_cache_miss"}
    assert caches["fxgraph_cache_hit"] + caches["fxgraph_cache_miss"] >= 2, caches  # the target's and the drafter's
    assert re.search(r"dflash: compile warmers: target done after [0-9.]+ s, drafter done after [0-9.]+ s; this run's "
                     rf"compiles: FX graph cache {caches['fxgraph_cache_hit']} hits, {caches['fxgraph_cache_miss']} "
                     "misses", caplog.text), caplog.text
    waits = re.findall(r"dflash: (\w+)-\d+: waited [0-9.]+ s for the (\w+) compile warmer: done", caplog.text)
    assert sorted(waits) == [("drafter", "drafter")] * 3 + [("target", "target")] * 5, waits
    for part in ("target", "drafter"):
        assert f"compile warmer {part}: done in" in (tmp_path / f"compile-warmer-{part}.log").read_text()


def test_a_warmer_timeout_must_be_positive(tmp_path):
    with pytest.raises(ValueError, match=r"compile_warmer_timeout_s must be > 0.0, got 0"):
        TrainConfig(out_dir=str(tmp_path), compile_warmer_timeout_s=0)
