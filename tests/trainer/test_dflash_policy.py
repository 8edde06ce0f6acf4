"""The execution policy is resolved once from the config and the devices; the schedule's
learning rate warms up linearly, then decays along a cosine to zero."""

import math

import pytest
import torch

from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.policy import ExecutionPolicy
from examples.dflash_trainer.run.schedule import Schedule


@pytest.mark.parametrize("compile, cuda_graphs, dtype, devices, mode, bf16", [
    ("auto", "trees", "auto", ["cpu"], "eager", False),
    ("auto", "trees", "auto", ["cuda:0"], "reduce-overhead", True),
    ("auto", "whole-step", "auto", ["cuda:0", "cuda:1"], "whole-step", True),
    ("eager", "trees", "auto", ["cuda:0"], "eager", True),
    ("reduce-overhead", "trees", "float32", ["cuda:0"], "reduce-overhead", False),
    ("auto", "trees", "bfloat16", ["cpu"], "eager", True),
])
def test_modes_and_dtypes_follow_the_config_and_the_devices(compile, cuda_graphs, dtype, devices, mode, bf16):
    policy = ExecutionPolicy.resolve(TrainConfig(compile=compile, cuda_graphs=cuda_graphs, dtype=dtype), devices)
    assert (policy.mode, policy.bf16, policy.captures) == (mode, bf16, mode == "whole-step")
    assert policy.target_dtype == (torch.bfloat16 if bf16 else torch.float32)
    assert policy.autocast_dtype == (torch.bfloat16 if bf16 else None)


@pytest.mark.parametrize("config, message", [
    (TrainConfig(compile="reduce-overhead"), "reduce-overhead needs CUDA devices"),
    (TrainConfig(cuda_graphs="whole-step"), "whole-step needs CUDA devices"),
])
def test_cuda_graphs_on_a_cpu_are_an_error(config, message):
    with pytest.raises(ValueError, match=message):
        ExecutionPolicy.resolve(config, ["cpu"])


def test_eager_runs_the_function_itself():
    policy = ExecutionPolicy(mode="eager", bf16=False)

    def fn(x):
        return x + 1

    assert policy.compile(fn) is fn and policy.graph(fn) is fn


def test_the_schedule_warms_up_then_decays_to_zero():
    schedule = Schedule.of(100, warmup_ratio=0.04)
    assert schedule.warmup_steps == 4
    assert [schedule.lr_factor(s) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert schedule.lr_factor(4) == 1.0 and schedule.lr_factor(99) == pytest.approx(0.5 * (1 + math.cos(math.pi * 95 / 96)))
    assert schedule.lr_factor(100) == schedule.lr_factor(500) == pytest.approx(0.0)


def test_run_length_counts_every_replica_of_every_process():
    config = TrainConfig(batch_size=4, drafters=3, epochs=2)
    assert Schedule.for_run(config, num_samples=240, world=2).total_steps == 240 // (4 * 3 * 2) * 2
    assert Schedule.for_run(config, num_samples=5, world=1).total_steps == 2  # at least one step per epoch
    assert Schedule.for_run(TrainConfig(max_steps=7), num_samples=5, world=1).total_steps == 7
