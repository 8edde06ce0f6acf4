"""The lead's baseline evaluation: tau of the untrained drafter, measured in a thread of its own on a
copy of it, so replica 0's setup (and so every worker's startup) does not wait for it."""

import concurrent.futures
import threading

import pytest
import torch

from examples.dflash_trainer.drafter.model import DFlashDrafter
from examples.dflash_trainer.lead import BaselineEvaluation
from tests.helpers.tiny_run import tiny_target

VOCAB, MASK = 300, 299


class GatedEvaluator:
    """baselines() waits for ``go``, then reports the sum of the drafter's weights it was given."""

    def __init__(self, fail: bool = False):
        self.go, self.fail, self.threads = threading.Event(), fail, []

    def baselines(self, drafter):
        self.threads.append(threading.current_thread().name)
        assert self.go.wait(10), "the test never let the evaluation go on"
        if self.fail:
            raise RuntimeError("tau failed")
        return {"weights": float(sum(p.detach().sum() for p in drafter.parameters())), "drafter": drafter}


@pytest.fixture(scope="module")
def drafter():
    target = tiny_target(VOCAB, MASK)
    torch.manual_seed(1)
    return DFlashDrafter.from_target_config(target.config, target.embed_tokens, target.lm_head, num_layers=1, n=1)


def test_the_baseline_runs_beside_training_on_the_untrained_weights(drafter):
    evaluator = GatedEvaluator()
    untrained = float(sum(p.detach().sum() for p in drafter.parameters()))
    baseline = BaselineEvaluation(evaluator, drafter)  # returns at once: nothing waits for it
    assert baseline.activity[0] == "evaluating tau of the untrained drafter"
    with torch.no_grad():  # training moves the replica's weights meanwhile
        for p in drafter.parameters():
            p.add_(1.0)
    evaluator.go.set()
    result = baseline.result()
    assert result["weights"] == pytest.approx(untrained) and evaluator.threads == ["dflash-baseline"]
    copy = result["drafter"]
    assert copy is not drafter and copy.embed_tokens is drafter.embed_tokens and copy.lm_head is drafter.lm_head
    assert baseline.activity[0] == "finished" and baseline.seconds >= 0
    with torch.no_grad():
        for p in drafter.parameters():
            p.sub_(1.0)


def test_a_failed_baseline_raises_in_whoever_waits_for_it(drafter):
    evaluator = GatedEvaluator(fail=True)
    baseline = BaselineEvaluation(evaluator, drafter)
    evaluator.go.set()
    with pytest.raises(RuntimeError, match="tau failed"):
        baseline.result()


def test_the_baseline_waits_for_every_workers_startup(drafter):
    """No eager forward of the target while a worker may still be tracing it (see lead.py)."""
    evaluator, started, asked = GatedEvaluator(), threading.Event(), threading.Semaphore(0)
    evaluator.go.set()

    def startup_done():
        asked.release()
        return started.is_set()

    baseline = BaselineEvaluation(evaluator, drafter, startup_done=startup_done)
    for _ in range(3):  # asked three times, told no each time
        assert asked.acquire(timeout=10), "the baseline never asked whether the startup was done"
    assert evaluator.threads == [] and baseline.activity[0] == "waiting for the workers' startup"
    started.set()
    assert baseline.result()["weights"] == pytest.approx(float(sum(p.detach().sum() for p in drafter.parameters())))
    assert evaluator.threads == ["dflash-baseline"]


def test_an_abandoned_baseline_never_begins_and_says_why(drafter):
    evaluator = GatedEvaluator()
    baseline = BaselineEvaluation(evaluator, drafter, startup_done=lambda: False)
    baseline.abandon()
    with pytest.raises(concurrent.futures.CancelledError, match="the run ended before its workers. startup did"):
        baseline.result()
    assert evaluator.threads == []
