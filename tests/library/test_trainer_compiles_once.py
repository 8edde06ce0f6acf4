"""The trainer's startup: its 5 target and 3 drafter workers compile each kind of step once, and the
startup report says what each worker is doing."""

import threading

import pytest
import torch

from examples.dflash_trainer import policy

from examples.dflash_trainer.drafter import step
from examples.dflash_trainer.run.startup import StartupMonitor, describe, snapshot
from examples.dflash_trainer.target import TargetSource
from examples.dflash_trainer.train import train
from tests.helpers.threads import until
from tests.helpers.tiny_run import tiny_config

import threadgraph
from threadgraph._patches import first_call as _first_call


def _inner_code(factory, name):
    return next(c for c in factory.__code__.co_consts if getattr(c, "co_name", None) == name)


def _compiles(code):
    return len(torch._C._dynamo.eval_frame._debug_get_cache_entry_list(code))


def _compiled_run(assets, out_dir):
    """The trainer with its steps compiled on the CPU (torch.compile without CUDA graphs there)."""
    torch._dynamo.reset()
    _first_call.forget()
    return train(tiny_config(assets, out_dir, max_steps=6))


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    monkeypatch.setattr(policy.ExecutionPolicy, "resolve", classmethod(lambda cls, c, d: cls(mode="reduce-overhead", bf16=False)))
    yield
    torch._dynamo.reset()
    _first_call.forget()


def test_five_targets_and_three_drafters_compile_each_step_once(tiny_assets, tmp_path, compiled_on_cpu, monkeypatch):
    target_step = _inner_code(step.make_target_step, "target_step")
    drafter_loss = _inner_code(step.make_step_fn, "drafter_loss")
    once = _compiled_run(tiny_assets, tmp_path / "once")
    assert (_compiles(target_step), _compiles(drafter_loss)) == (1, 1)
    compile_s = {name: w.compile_s for name, w in once.workers.items()}
    assert sum(1 for name, s in compile_s.items() if name.startswith("target") and s > 0) == 1, compile_s
    # Left out, every worker compiles its own (hazard concurrent-first-compile); the losses are the same.
    monkeypatch.setenv("THREADGRAPH_EXCLUDE_PATCHES", "first_call_in_turn")
    threadgraph.uninstall(["first_call_in_turn"])
    apart = _compiled_run(tiny_assets, tmp_path / "apart")
    assert _compiles(target_step) > 1 and _compiles(drafter_loss) > 1
    assert once.losses == pytest.approx(apart.losses, rel=1e-5)
    assert once.startup_s > 0 and once.build_s > 0
    assert all(0 <= w.setup_s <= w.first_step_at_s <= w.warmup_s for w in once.workers.values()), once.workers


class FakeWorker:
    def __init__(self, name, activity):
        self.name, self.activity = name, activity


def test_the_startup_line_names_what_each_busy_worker_does():
    workers = [FakeWorker("target-0", ("compiling target_step", 12.3)),
               FakeWorker("target-1", ("waiting for target-0 to compile target_step", 11.0)),
               FakeWorker("drafter-0", ("stepping", 2.0))]
    record = snapshot(workers, started=0.0)
    assert (record["ready"], record["workers"]) == (1, 3)
    line = describe(record)
    assert line.endswith("1 of 3 workers ready; target-0 compiling target_step (12 s); "
                         "target-1 waiting for target-0 to compile target_step (11 s)")
    assert "drafter-0" not in line


def test_the_monitor_reports_until_every_worker_is_ready():
    workers = [FakeWorker("a", ("setup", 0.0)), FakeWorker("b", ("compiling f", 0.0))]
    seen = []

    def report(record):
        seen.append(record["startup"]["ready"])
        if len(seen) == 2:
            for w in workers:
                w.activity = ("stepping", 0.0)

    monitor = StartupMonitor(workers, report, every_s=0.01).start()
    # it ends on its own once every worker is ready (its thread is named in stack dumps as this)
    until(lambda: not any(t.name == "dflash-startup" for t in threading.enumerate()), timeout=5)
    assert seen == [0, 0]
    monitor.stop()


def test_the_workers_on_a_device_load_the_target_once_and_leave_it_unchanged(tiny_assets, tmp_path, monkeypatch):
    """5 target stages, 3 drafter replicas and the evaluator on one device: one load of the target
    (pipeline.SharedTargets), whose weights training leaves exactly as loaded."""
    loaded, real_load = [], TargetSource.load
    monkeypatch.setattr(TargetSource, "load", lambda self, device: loaded.append(real_load(self, device)) or loaded[-1])
    train(tiny_config(tiny_assets, tmp_path, max_steps=4, eval_every=4, eval_prompts=1, eval_max_new_tokens=4))
    assert [str(t.device) for t in loaded] == ["cpu"]
    fresh = real_load(TargetSource(str(tiny_assets.target_dir), 1, torch.float32), "cpu").model
    for tensors in (lambda m: dict(m.named_parameters()), lambda m: dict(m.named_buffers())):  # buffers: rotary too
        after, before = tensors(loaded[0].model), tensors(fresh)
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


def test_the_startup_line_names_a_background_task_without_counting_it_as_a_worker():
    workers = [FakeWorker("target-0", ("stepping", 1.0))]
    record = snapshot(workers, started=0.0, background=[FakeWorker("baseline", ("evaluating tau of the untrained drafter", 7.2))])
    assert (record["ready"], record["workers"]) == (1, 1)
    assert describe(record).endswith("1 of 1 workers ready; baseline evaluating tau of the untrained drafter (7 s)")
    record = snapshot(workers, started=0.0, background=[FakeWorker("baseline", ("finished", 9.0))])
    assert "baseline" not in describe(record)
