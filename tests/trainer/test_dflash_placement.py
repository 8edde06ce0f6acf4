import pytest
import torch

from examples.dflash_trainer.run.placement import available_devices, place


def test_eight_gpus_give_every_worker_its_own():
    devices = [f"cuda:{i}" for i in range(8)]
    p = place(5, 3, devices)
    assert sorted(p.targets + p.drafters) == sorted(devices)


def test_two_gpus_spread_drafters_first_then_targets_round_robin():
    p = place(5, 3, ["cuda:0", "cuda:1"])
    assert p.drafters == ("cuda:0", "cuda:1", "cuda:0")
    assert p.targets == ("cuda:1", "cuda:0", "cuda:1", "cuda:0", "cuda:1")


def test_one_device_holds_everyone():
    p = place(5, 3, ["cpu"])
    assert set(p.targets + p.drafters) == {"cpu"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_asking_for_a_gpu_without_one_is_a_clear_error():
    with pytest.raises(ValueError, match="sees no GPU; use --devices cpu"):
        available_devices(["cuda:0"])


def test_unknown_device_kind_is_rejected():
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        available_devices(["meta"])
