"""Scenarios that need two or more GPUs (tests/helpers/gpu_scenarios.py, each in a fresh process).
The trainer's two-GPU test is in tests/trainer/test_gpu_trainer.py; the channel's in test_dflash_channel.py."""

import os

import pytest

from tests.helpers.gpu_process import scenario

pytestmark = pytest.mark.multi_gpu
STEPS = int(os.environ.get("THREADGRAPH_GPU_STEPS", "200"))


def test_two_workers_on_two_gpus_capture_concurrently_and_train_correctly():
    r = scenario("two_gpus", "--steps", STEPS)
    assert r["gpus"] >= 2 and all(r["losses_allclose"]), r
