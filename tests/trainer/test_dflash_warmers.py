"""Compile warmers (run/warmers.py): a warmer process fills Inductor's caches with the very graphs a
run's workers compile, whatever its weights; a worker waits for its warmer, and a warmer that fails
or hangs costs only its time."""

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.dflash_trainer.run.warmers import CompileWarmers
from examples.dflash_trainer.train import train

from tests.trainer.tiny_run import tiny_config

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(600)

# Compile on a CPU (Inductor without CUDA graphs: the trainer itself only compiles on CUDA) as a
# warmer or as the run's worker would, and print Inductor's and AOTAutograd's cache counters.
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


def _compile(part, config, cache):
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", COMPILE, part, json.dumps(config.to_dict())], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("part", ["drafter", "target"])
def test_a_warmer_with_other_weights_leaves_the_runs_compile_a_cache_hit(part, tiny_assets, tmp_path):
    cache = tmp_path / "inductor"
    # the warmer: another seed (other drafter weights, other data order)
    warmer = _compile(part, tiny_config(tiny_assets, tmp_path / "warmer", seed=7), cache)
    assert warmer["inductor"].get("fxgraph_cache_miss", 0) >= 1 and not warmer["inductor"].get("fxgraph_cache_hit")
    run = _compile(part, tiny_config(tiny_assets, tmp_path / "run"), cache)
    assert run["inductor"].get("fxgraph_cache_hit", 0) >= 1 and not run["inductor"].get("fxgraph_cache_miss"), run
    if part == "drafter":  # forward and backward: AOTAutograd's cache holds the pair
        assert run["aot"].get("autograd_cache_hit") == 1 and not run["aot"].get("autograd_cache_miss"), run


def _warmers(tmp_path, scripts, wait_s=60.0):
    procs, logs = {}, {}
    for part, script in scripts.items():
        logs[part] = tmp_path / f"{part}.log"
        procs[part] = subprocess.Popen([sys.executable, "-c", script])
    return CompileWarmers(procs, logs, wait_s=wait_s)


def test_a_worker_waits_for_its_warmer_and_a_failed_one_is_logged_with_its_log(tmp_path, caplog):
    warmers = _warmers(tmp_path, {"target": "import time; time.sleep(1.0)", "drafter": "import sys; sys.exit(3)"})
    began = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="dflash"):
        warmers.wait("target")
        assert time.perf_counter() - began >= 0.9 and warmers.seconds["target"] >= 0.9
        assert not caplog.records
        warmers.wait("drafter")
    assert [r.getMessage() for r in caplog.records] == [
        f"dflash: the drafter compile warmer failed (exit 3); compiling here instead (its log: {tmp_path / 'drafter.log'})"]


def test_a_warmer_past_its_time_is_stopped_and_the_worker_goes_on(tmp_path, caplog):
    warmers = _warmers(tmp_path, {"target": "import time; time.sleep(120)"}, wait_s=1.0)
    began = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="dflash"):
        warmers.wait("target")
    assert time.perf_counter() - began < 30
    assert not warmers.running("target")  # stopped, not left to compete
    assert "the target compile warmer still runs after 1 s; stopping it and compiling here" in caplog.text


def test_stopping_the_warmers_ends_a_workers_wait_without_a_failure_reported(tmp_path, caplog):
    import threading

    warmers = _warmers(tmp_path, {"drafter": "import time; time.sleep(120)"})
    waiter = threading.Thread(target=warmers.wait, args=("drafter",))
    with caplog.at_level(logging.WARNING, logger="dflash"):
        waiter.start()
        time.sleep(0.5)
        began = time.perf_counter()
        warmers.stop()  # what a failing or stopping run does
        waiter.join(timeout=30)
    assert not waiter.is_alive() and time.perf_counter() - began < 15
    assert not warmers.running("drafter") and not caplog.records


def test_an_eager_run_asked_for_warmers_starts_none(tiny_assets, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="dflash"):
        result = train(tiny_config(tiny_assets, tmp_path, max_steps=2, compile_warmers=True))
    assert len(result.losses) == 2
    assert "nothing compiles in this run (eager); no warmers" in caplog.text
    assert not list(tmp_path.glob("compile-warmer-*.log"))


def test_a_compiled_run_starts_its_warmers_and_every_worker_waits_for_its_own(tiny_assets, tmp_path, monkeypatch):
    """The run's own path, on a CPU: its steps compiled (Inductor without CUDA graphs) by forcing the
    policy in this process; the warmer processes resolve theirs as a CPU run does (eager), so here
    they check the plumbing: started with the run's settings, waited for, their logs kept."""
    from examples.dflash_trainer.policy import ExecutionPolicy

    monkeypatch.setattr(ExecutionPolicy, "resolve", classmethod(lambda cls, config, devices: cls(mode="reduce-overhead", bf16=False)))
    result = train(tiny_config(tiny_assets, tmp_path, max_steps=3, compile_warmers=True))
    assert len(result.losses) == 3
    workers = result.to_json()["workers"]
    assert len(workers) == 8 and all("compile_warmer" in w["phases_warmup_s"] for w in workers.values()), workers
    for part in ("target", "drafter"):
        assert f"compile warmer {part}: done in" in (tmp_path / f"compile-warmer-{part}.log").read_text()
