"""``--grad-accum N`` trains like an N-times larger batch: a replica that takes each batch of 4 as two
micro-batches of 2 ends with the weights, and logs the losses, of one that takes the 4 at once.

Tolerance: 1e-5 relative, 1e-6 absolute on the weights after the steps (float32 on the CPU; the two
differ only in the order of sums: the weighted mean over micro-batches against one over the batch)."""

import dataclasses

import pytest
import torch

from examples.dflash_trainer.drafter.grads import FlatGrads, GradAccumulator
from examples.dflash_trainer.pipeline import Pipeline, Schedule

from tests.helpers.tiny_run import tiny_config

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")
STEPS, BATCH = 3, 4


def _half(item, part):
    return {k: v[part * BATCH // 2:(part + 1) * BATCH // 2] for k, v in item.items()}


def test_two_micro_batches_train_as_one_batch_of_twice_the_size(tiny_assets, tmp_path):
    config = tiny_config(tiny_assets, tmp_path, drafters=1, targets=1, batch_size=BATCH, max_steps=STEPS)
    parts = Pipeline.build(config)
    stage, batches = parts.target_stage(CPU), parts.batches(0)
    items = [stage.step(batches)[1] for _ in range(STEPS)]

    whole = parts.replica(CPU)
    accumulating = dataclasses.replace(parts, config=dataclasses.replace(config, batch_size=BATCH // 2,
                                                                          grad_accum=2)).replica(CPU)
    assert accumulating.grad_accum == 2
    for item in items:
        whole.train_step(item)
        accumulating.forward_backward(_half(item, 0), 0)
        accumulating.train_step(_half(item, 1), micro=1)

    torch.testing.assert_close(accumulating.history[:, 0], whole.history[:, 0], rtol=1e-5, atol=1e-6)  # loss
    torch.testing.assert_close(accumulating.history[:, 1], whole.history[:, 1])  # weight sum of the step
    assert whole.history[:, 0].ne(0).all()
    moved = False
    for mine, theirs, start in zip(accumulating.drafter.parameters(), whole.drafter.parameters(),
                                   parts.replica(CPU).drafter.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
        moved = moved or not torch.equal(theirs, start)
    assert moved  # the steps changed the weights, so equal weights say something


def test_one_micro_batch_leaves_the_gradients_alone():
    params = [torch.nn.Parameter(torch.ones(3))]
    grads = FlatGrads(params, extras=4)
    grads.buffer.copy_(torch.tensor([1.0, 2.0, 3.0, 0.5, 2.0, 0.25, 0.5]))
    before = grads.buffer.clone()
    GradAccumulator(grads, 1).add(0)
    assert torch.equal(grads.buffer, before)


def test_accumulated_gradient_is_the_weight_sum_weighted_mean():
    params = [torch.nn.Parameter(torch.zeros(2))]
    grads = FlatGrads(params, extras=4)
    acc = GradAccumulator(grads, 2)
    # micro-batch 0: gradient G0/W0 = [1, 2] with W0 = 1; micro-batch 1: G1/W1 = [4, 0] with W1 = 3
    grads.buffer.copy_(torch.tensor([1.0, 2.0, 5.0, 1.0, 0.5, 0.0]))
    acc.add(0)
    grads.buffer.copy_(torch.tensor([4.0, 0.0, 1.0, 3.0, 1.0, 1.0]))
    acc.add(1)
    torch.testing.assert_close(grads.grads, torch.tensor([13.0 / 4, 2.0 / 4]))
    torch.testing.assert_close(grads.extras, torch.tensor([(5.0 + 3.0) / 4, 4.0, 0.75, 0.5]))


def test_zero_micro_batches_are_refused():
    grads = FlatGrads([torch.nn.Parameter(torch.zeros(2))], extras=4)
    with pytest.raises(ValueError, match="at least 1 micro-batch"):
        GradAccumulator(grads, 0)


def test_the_schedule_counts_a_step_as_grad_accum_batches(tiny_assets, tmp_path):
    one = tiny_config(tiny_assets, tmp_path, max_steps=None, epochs=1, drafters=2, batch_size=2)
    two = dataclasses.replace(one, grad_accum=2)
    assert Schedule.for_run(one, 400, 1).total_steps == 100
    assert Schedule.for_run(two, 400, 1).total_steps == 50


def test_threaded_run_with_grad_accum_takes_n_batches_a_step(tiny_assets, tmp_path):
    from examples.dflash_trainer.train import train

    # the loss in chunks of 24 of the step's 64 outputs: three chunks, the last one short
    result = train(tiny_config(tiny_assets, tmp_path, max_steps=4, grad_accum=2, loss_chunk_tokens=24))
    assert len(result.losses) == 4
    # every target's batches were consumed: 4 steps x 3 drafters x 2 micro-batches over the 5 targets
    assert sum(w.steps for name, w in result.workers.items() if name.startswith("target")) >= 4 * 3 * 2
