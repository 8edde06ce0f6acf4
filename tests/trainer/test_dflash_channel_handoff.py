"""The channel's CUDA hand-off on the CPU (tests/helpers/cuda_sim.py): which stream records the event,
which streams wait on it, which tensors are record_stream-ed and copied, in what order; the GPU tests
of test_dflash_channel.py check the same hand-off on real streams."""

import threading

import pytest
import torch

from examples.dflash_trainer.channel import Channel
from tests.helpers.cuda_sim import CudaSim


@pytest.fixture
def sim(monkeypatch):
    return CudaSim().install(monkeypatch)


def _put_from(sim, ch, item, stream=None):
    """``ch.put(item)`` in a producer thread whose current stream is ``stream`` (its default if None)."""
    def produce():
        if stream is not None:
            sim.use(stream)
        ch.put(item)

    t = threading.Thread(target=produce)
    t.start()
    t.join(30)
    assert not t.is_alive()


def test_a_consumer_on_another_stream_waits_on_the_producers_event_before_it_reads(sim):
    producer, consumer = sim.stream("cuda:0", "producer"), sim.stream("cuda:0", "consumer")
    ch = Channel(2)
    x = sim.tensor(torch.arange(3.0), name="x")
    _put_from(sim, ch, {"x": x}, producer)
    assert sim.log == [("record", "event0", "producer")]  # at put, on the stream that wrote the item
    sim.use(consumer)
    got = ch.get(timeout=5)
    assert got["x"] is x  # on its own device: the very tensor, no copy
    assert sim.log[1:] == [("wait_event", "consumer", "event0"),  # before anything else touches it
                           ("record_stream", "x", "consumer")]     # its memory kept until the consumer is done


def test_one_stream_for_both_hands_the_item_over_as_it_is(sim):
    ch = Channel(2)
    x = sim.tensor(torch.arange(3.0), name="x")
    _put_from(sim, ch, (x,))  # both on the device's default stream
    got = ch.get(timeout=5)
    assert got[0] is x and sim.log == [("record", "event0", "default:0")]  # no wait, no record_stream


def test_a_copy_to_another_device_waits_on_both_devices_and_does_not_block_the_host(sim):
    producer = sim.stream("cuda:0", "producer")
    ch = Channel(2)
    x = sim.tensor(torch.arange(3.0), name="x")
    _put_from(sim, ch, [x], producer)
    got = ch.get(timeout=5, device="cuda:1")
    assert got[0].device == torch.device("cuda:1") and torch.equal(got[0].as_subclass(torch.Tensor), torch.arange(3.0))
    assert sim.log[1:] == [("wait_event", "default:0", "event0"),  # the copy runs on the source's stream
                           ("wait_event", "default:1", "event0"),  # and the destination's reads wait too
                           ("record_stream", "x", "default:0"),
                           ("to", "x", "cuda:1", True)]


def test_a_copy_to_the_host_waits_and_is_the_synchronising_one(sim):
    producer = sim.stream("cuda:0", "producer")
    ch = Channel(2)
    _put_from(sim, ch, {"x": sim.tensor(torch.ones(2), name="x")}, producer)
    got = ch.get(timeout=5, device="cpu")
    assert type(got["x"]) is torch.Tensor and torch.equal(got["x"], torch.ones(2))
    assert sim.log[1:] == [("wait_event", "default:0", "event0"), ("record_stream", "x", "default:0"),
                           ("to", "x", "cpu", False)]  # blocking: the consumer wants the values


def test_cpu_tensors_beside_cuda_ones_move_to_the_device_after_the_wait(sim):
    ch = Channel(2)
    x = sim.tensor(torch.ones(2), name="x")
    mask = sim.tensor(torch.zeros(2), device="cpu", name="mask")  # a host tensor (moves to a device logged)
    _put_from(sim, ch, {"x": x, "mask": mask})  # same (default) stream, but a CPU tensor too
    got = ch.get(timeout=5, device="cuda:0")
    assert got["mask"].device == torch.device("cuda:0") and got["x"].device == torch.device("cuda:0")
    # (the source's stream and the destination's are the same one here: it is asked to wait twice)
    assert sim.log[1:] == [("wait_event", "default:0", "event0"), ("wait_event", "default:0", "event0"),
                           ("record_stream", "x", "default:0"), ("to", "x", "cuda:0", True),
                           ("to", "mask", "cuda:0", True)]


def test_an_item_on_two_devices_is_refused_before_any_event(sim):
    ch = Channel(2)
    with pytest.raises(ValueError, match="one event on one device"):
        ch.put([sim.tensor(torch.ones(1), "cuda:0"), sim.tensor(torch.ones(1), "cuda:1")])
    assert sim.log == [] and len(ch) == 0
