"""Drafters compile their step on an example item while the targets compile theirs: the example
must look to torch.compile exactly like the items the targets hand over (else a second compile),
and warming up on it must leave the training as it was."""

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from examples.dflash_trainer.drafter.step import make_step_fn
from examples.dflash_trainer.pipeline import Pipeline

from tests.trainer.tiny_run import tiny_config

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def parts(tiny_assets, tmp_path_factory):
    return Pipeline.build(tiny_config(tiny_assets, tmp_path_factory.mktemp("out"), targets=1, drafters=1, max_steps=4))


def _layout(t):
    return t.shape, t.dtype, t.stride(), t.device, t.requires_grad


def test_the_example_item_has_the_layout_of_a_handed_over_item(parts):
    example = parts.example_item(CPU)
    _, real = parts.target_stage(CPU).step(parts.batches(0))
    assert example.keys() == real.keys()
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
                                      autocast_dtype=None), backend=counter)
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
