"""Drafter replicas on one device share one copy of the weights, and only the first steps it:
the same training as replicas that each hold and step their own copy, with one optimizer step
a round instead of one a replica."""

import functools
import threading

import pytest
import torch

from examples.dflash_trainer.drafter.replica import SharedDrafterWeights
from examples.dflash_trainer.pipeline import Pipeline
from examples.dflash_trainer.run.placement import available_devices, place
from examples.dflash_trainer.routing import GradientAverager

from tests.helpers.tiny_run import tiny_config

pytestmark = pytest.mark.timeout(300)
CPU = torch.device("cpu")
REPLICAS, ROUNDS = 3, 3


def _trainable(replica):
    return [p for p in replica.drafter.parameters() if p.requires_grad]


def _train_in_threads(parts, items, *, shared: bool, groups: int = 1):
    """REPLICAS * groups replicas; shared: each group of REPLICAS shares one copy of the weights
    (as the drafters of one device do; a group stands for a device here) and its first steps it."""
    n = REPLICAS * groups
    owners = list(range(0, n, REPLICAS)) if shared else list(range(n))
    weights = [SharedDrafterWeights() if shared else None for _ in range(groups)]
    replicas = [parts.replica(CPU, weights=weights[i // REPLICAS], steps_optimizer=i in owners) for i in range(n)]
    averager = GradientAverager(n, owners=owners)
    errors = []

    def run(i):
        try:
            for r in range(ROUNDS):
                replicas[i].train_step(items[(r * n + i) % len(items)], average=functools.partial(averager.average, i),
                                       updated=averager.updated)
        except BaseException as exc:
            errors.append(exc)
            averager.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a replica thread is still waiting in the averager"
    assert not errors, errors
    return replicas


@pytest.fixture(scope="module")
def parts_and_items(tiny_assets, tmp_path_factory):
    config = tiny_config(tiny_assets, tmp_path_factory.mktemp("out"), drafters=REPLICAS, targets=1,
                         max_steps=ROUNDS)
    parts = Pipeline.build(config)
    stage, batches = parts.target_stage(CPU), parts.batches(0)
    items = [stage.step(batches)[1] for _ in range(REPLICAS * ROUNDS)]
    return parts, items


def test_shared_weights_train_as_replicas_that_each_step_their_own(parts_and_items):
    parts, items = parts_and_items
    shared = _train_in_threads(parts, items, shared=True)
    separate = _train_in_threads(parts, items, shared=False)

    assert torch.equal(shared[0].history, separate[0].history)
    assert shared[0].history[:, 0].ne(0).all()  # a loss logged for every step
    for i in range(REPLICAS):
        assert shared[i].step == separate[i].step == ROUNDS
        for mine, theirs in zip(_trainable(shared[i]), _trainable(separate[i])):
            assert torch.equal(mine, theirs)


def test_two_groups_of_shared_weights_train_as_replicas_that_each_step_their_own(parts_and_items):
    """Owners besides replica 0 (drafters on two devices): the mean is copied to them, and each
    steps its group's weights."""
    parts, items = parts_and_items
    shared = _train_in_threads(parts, items, shared=True, groups=2)
    separate = _train_in_threads(parts, items, shared=False, groups=2)
    assert torch.equal(shared[0].history, separate[0].history)
    assert torch.equal(shared[REPLICAS].history, separate[REPLICAS].history)
    for i in range(2 * REPLICAS):
        for mine, theirs in zip(_trainable(shared[i]), _trainable(separate[i])):
            assert torch.equal(mine, theirs)
    assert _trainable(shared[0])[0].data_ptr() != _trainable(shared[REPLICAS])[0].data_ptr()


def test_followers_hold_views_of_the_first_replicas_weights_and_no_optimizer(parts_and_items):
    parts, items = parts_and_items
    replicas = _train_in_threads(parts, items, shared=True)
    first, followers = replicas[0], replicas[1:]
    assert first.optimizer is not None and first.optimizer.state  # AdamW stepped
    for follower in followers:
        assert follower.optimizer is None and follower.scheduler is None
        for mine, theirs in zip(_trainable(follower), _trainable(first)):
            assert mine is not theirs and mine.data_ptr() == theirs.data_ptr()
            assert mine.grad.data_ptr() != theirs.grad.data_ptr()  # each replica its own gradients


def test_a_drafter_of_other_shapes_cannot_share_a_devices_weights():
    weights = SharedDrafterWeights()
    weights.place(torch.nn.Linear(4, 4), CPU, steps=True)
    with pytest.raises(ValueError, match=r"SharedDrafterWeights: a drafter of other parameter shapes than the first on cpu"):
        weights.place(torch.nn.Linear(4, 5), CPU, steps=False)


def test_a_second_replica_stepping_one_devices_weights_is_refused():
    weights = SharedDrafterWeights()
    weights.place(torch.nn.Linear(4, 4), CPU, steps=True)
    weights.place(torch.nn.Linear(4, 4), CPU, steps=False)
    with pytest.raises(ValueError, match=r"a second replica that steps the weights on cpu"):
        weights.place(torch.nn.Linear(4, 4), CPU, steps=True)


def test_device_names_are_canonical_so_drafters_on_one_device_find_one_owner():
    assert available_devices(["cpu", "cpu:0"]) == ["cpu", "cpu"]
    assert place(1, 2, available_devices(["cpu:0", "cpu"])).drafters == ("cpu", "cpu")


def test_the_averager_refuses_owners_without_replica_0():
    with pytest.raises(ValueError, match=r"owners must include replica 0 and name replicas 0 - 2, got \[1, 2\]"):
        GradientAverager(3, owners=[1, 2])
