"""Drafters compile their step on an example item while the targets compile theirs: the example
must look to torch.compile exactly like the items the targets hand over (else a second compile),
and warming up on it must leave the training as it was."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from examples.dflash_trainer.drafter.replica import DrafterReplica
from examples.dflash_trainer.drafter.step import make_step_fn
from examples.dflash_trainer.pipeline import Pipeline
from examples.dflash_trainer.train import train

from tests.helpers.tiny_run import tiny_config

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def parts(request, tiny_assets, tmp_path_factory):
    return Pipeline.build(tiny_config(tiny_assets, tmp_path_factory.mktemp("out"), targets=1, drafters=1, max_steps=4,
                                      dtype=request.param))


def _layout(t):
    return t.shape, t.dtype, t.stride(), t.device, t.requires_grad


def test_the_example_item_has_the_layout_of_a_handed_over_item(parts):
    example = parts.example_item(CPU)
    _, real = parts.target_stage(CPU).step(parts.batches(0))
    assert example.keys() == real.keys()
    assert real["features"].dtype == parts.policy.target_dtype
    for key in real:
        assert _layout(example[key]) == _layout(real[key]), key
    assert torch.equal(example["anchors"], real["anchors"]) and torch.equal(example["keep"], real["keep"])


def test_a_step_compiled_on_the_example_is_not_compiled_again_for_real_items(parts):
    replica = parts.replica(CPU)
    target = parts.targets.get(CPU)
    counter = CompileCounter()
    torch._dynamo.reset()
    step = torch.compile(make_step_fn(replica.drafter, block_size=parts.config.block_size,
                                      gamma=parts.config.gamma_value, mask_token_id=target.mask_token_id,
                                      autocast_dtype=parts.policy.autocast_dtype), backend=counter)
    keys = ("ids", "loss_mask", "features", "anchors", "keep")
    step(*(parts.example_item(CPU)[k] for k in keys))
    compiled = counter.frame_count
    stage, batches = parts.target_stage(CPU), parts.batches(0)
    for _ in range(2):
        _, item = stage.step(batches)
        step(*(item[k] for k in keys))
    assert compiled >= 1 and counter.frame_count == compiled
    torch._dynamo.reset()


def test_warming_up_on_the_example_leaves_the_training_as_it_was(parts):
    stage, batches = parts.target_stage(CPU), parts.batches(0)
    items = [stage.step(batches)[1] for _ in range(3)]
    runs = []
    for warm in (False, True):
        replica = parts.replica(CPU)
        if warm:
            replica.warm_up(parts.example_item(CPU))
        for item in items:
            replica.train_step(item)
        runs.append(replica)
    plain, warmed = runs
    assert torch.equal(plain.history, warmed.history) and plain.history[:len(items), 0].ne(0).all()
    for p, q in zip(plain.drafter.parameters(), warmed.drafter.parameters()):
        assert torch.equal(p, q)


def test_compiled_drafter_workers_warm_up_first_and_train_as_without(tiny_assets, tmp_path, monkeypatch):
    """The worker's path on a CPU: replicas that say they compile (the step itself stays eager
    here) run the example first, mark it as the first step's compile_ahead, and train the same."""
    plain = train(tiny_config(tiny_assets, tmp_path / "plain", targets=2, drafters=3, max_steps=4))
    init = DrafterReplica.__init__
    warmed = []

    def compiling_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.compiles = True

    def counted_warm_up(self, item):
        warmed.append(sorted(item))
        self.forward_backward(item)

    monkeypatch.setattr(DrafterReplica, "__init__", compiling_init)
    monkeypatch.setattr(DrafterReplica, "warm_up", counted_warm_up)
    ahead = train(tiny_config(tiny_assets, tmp_path / "ahead", targets=2, drafters=3, max_steps=4))
    assert ahead.losses == plain.losses
    assert warmed == [["anchors", "features", "ids", "keep", "loss_mask"]] * 3
    for name in ("drafter-0", "drafter-1", "drafter-2"):
        worker = ahead.workers[name]
        assert "compile_ahead" in worker.phases_warmup_s and "compile_ahead" not in worker.phases_p50_ms
