"""Channel: FIFO, backpressure, close/fail semantics, exactly-once delivery, CUDA hand-off.

Every wait in these tests has a timeout, so a deadlock fails the test instead of
hanging it; no test sleeps to order threads.
"""

import threading
import time
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.dflash_trainer.channel import Channel, ChannelClosed, ChannelFailed

JOIN_S = 10.0  # generous: only a deadlock gets near it


def _start(fn, name):
    """Run fn in a thread; its exception (if any) is kept for the test to re-raise."""
    box = {}

    def run():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    return t, box


def _join(t, timeout=JOIN_S):
    t.join(timeout)
    assert not t.is_alive(), f"{t.name} still blocked after {timeout}s (deadlock?)"


def _wait_until(pred, timeout=JOIN_S):
    """Poll a condition with a deadline (used to know a thread is parked in put/get)."""
    deadline = time.monotonic() + timeout
    ev = threading.Event()
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        ev.wait(0.001)


@pytest.mark.timeout(30)
def test_fifo_order_and_len():
    ch = Channel(4)
    for i in range(4):
        ch.put({"x": torch.tensor([i])})
    assert len(ch) == 4
    assert [ch.get(timeout=1)["x"].item() for _ in range(4)] == [0, 1, 2, 3]
    assert len(ch) == 0


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be an int >= 1"):
        Channel(0)


@pytest.mark.timeout(30)
def test_timeouts_raise_timeout_error():
    ch = Channel(1, name="t")
    with pytest.raises(TimeoutError, match="get\\(\\) waited .* empty"):
        ch.get(timeout=0.05)
    ch.put(1)
    with pytest.raises(TimeoutError, match="put\\(\\) waited .* full"):
        ch.put(2, timeout=0.05)


@pytest.mark.timeout(30)
def test_backpressure_blocks_producer_at_capacity():
    ch = Channel(2)
    ch.put(0)
    ch.put(1)
    t, box = _start(lambda: ch.put(2), "producer")
    _wait_until(lambda: ch.waiting_putters == 1)
    t.join(0.2)
    assert t.is_alive(), "put() returned although the channel was full"
    assert len(ch) == 2
    assert ch.get(timeout=1) == 0  # frees one slot: the producer must now finish
    _join(t)
    assert "error" not in box
    assert [ch.get(timeout=1), ch.get(timeout=1)] == [1, 2]


@pytest.mark.timeout(30)
def test_blocked_getter_wakes_on_put():
    ch = Channel(1)
    t, box = _start(lambda: ch.get(timeout=JOIN_S), "consumer")
    _wait_until(lambda: ch.waiting_getters == 1)
    ch.put("x")
    _join(t)
    assert box == {"result": "x"}


@pytest.mark.timeout(30)
def test_close_drains_then_raises():
    ch = Channel(4)
    ch.put(1)
    ch.put(2)
    ch.close()
    ch.close()  # idempotent
    assert ch.closed
    with pytest.raises(ChannelClosed, match="put\\(\\) after close"):
        ch.put(3)
    assert ch.get(timeout=1) == 1
    assert ch.get(timeout=1) == 2
    with pytest.raises(ChannelClosed, match="closed and drained"):
        ch.get(timeout=1)


@pytest.mark.timeout(30)
def test_close_wakes_blocked_getters():
    ch = Channel(1)
    getters = [_start(lambda: ch.get(), f"consumer-{i}") for i in range(3)]
    _wait_until(lambda: ch.waiting_getters == 3)
    ch.close()
    for t, box in getters:
        _join(t)
        assert isinstance(box.get("error"), ChannelClosed)


@pytest.mark.timeout(30)
def test_fail_wakes_blocked_getters_and_putters():
    empty, full = Channel(1, name="empty"), Channel(1, name="full")
    full.put("occupied")
    # no timeout on these waits: only fail() can end them
    getters = [_start(lambda: empty.get(), f"consumer-{i}") for i in range(3)]
    putters = [_start(lambda: full.put("more"), f"producer-{i}") for i in range(3)]
    _wait_until(lambda: empty.waiting_getters == 3 and full.waiting_putters == 3)
    boom = RuntimeError("target worker crashed")
    empty.fail(boom)
    full.fail(boom)
    for t, box in getters + putters:
        _join(t)
        err = box.get("error")
        assert isinstance(err, ChannelFailed), box
        assert err.error is boom and err.__cause__ is boom
        assert "target worker crashed" in str(err)


@pytest.mark.timeout(30)
def test_fail_drops_queued_items_and_is_not_downgraded():
    ch = Channel(4)
    ch.put(1)
    ch.fail(ValueError("bad batch"))
    ch.close()  # a later graceful close must not hide the failure
    with pytest.raises(ChannelFailed, match="bad batch"):
        ch.get(timeout=1)
    with pytest.raises(ChannelFailed, match="bad batch"):
        ch.put(2)
    assert len(ch) == 0
    with pytest.raises(TypeError, match="needs an exception"):
        ch.fail("not an exception")


@settings(max_examples=25, deadline=None)
@given(producers=st.integers(1, 4), consumers=st.integers(1, 4), per_producer=st.integers(0, 60),
       capacity=st.integers(1, 8))
@pytest.mark.timeout(120)
def test_many_producers_consumers_deliver_exactly_once(producers, consumers, per_producer,
                                                       capacity):
    ch = Channel(capacity)
    received = [[] for _ in range(consumers)]

    def produce(p):
        for i in range(per_producer):
            ch.put((p, i), timeout=JOIN_S)

    def consume(c):
        while True:
            try:
                received[c].append(ch.get(timeout=JOIN_S))
            except ChannelClosed:
                return

    prod = [_start(lambda p=p: produce(p), f"producer-{p}") for p in range(producers)]
    cons = [_start(lambda c=c: consume(c), f"consumer-{c}") for c in range(consumers)]
    for t, box in prod:
        _join(t)
        assert "error" not in box, box
    ch.close()
    for t, box in cons:
        _join(t)
        assert "error" not in box, box
    got = [item for r in received for item in r]
    assert sorted(got) == [(p, i) for p in range(producers) for i in range(per_producer)]
    # Each producer's items reach any one consumer in the order they were put.
    for r in received:
        for p in range(producers):
            seq = [i for q, i in r if q == p]
            assert seq == sorted(seq)


def test_cpu_items_pass_through_and_move():
    ch = Channel(2)
    batch = {"ids": torch.arange(4), "meta": [torch.ones(2), "tag"], "n": 3}
    ch.put(batch)
    assert ch.get(timeout=1) is batch
    ch.put(batch)
    out = ch.get(timeout=1, device="cpu")
    assert torch.equal(out["ids"], batch["ids"]) and out["meta"][1] == "tag" and out["n"] == 3


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_handoff_waits_on_event_without_host_sync():
    ch = Channel(2)
    producer_stream, consumer_stream = torch.cuda.Stream(), torch.cuda.Stream()

    def hand_over(sleep_cycles: int) -> Any:
        with torch.cuda.stream(producer_stream):
            x = torch.zeros(1 << 20, device="cuda")
            torch.cuda._sleep(sleep_cycles)
            x.fill_(7.0)
            ch.put({"x": x})
        del x
        with torch.cuda.stream(consumer_stream):
            return ch.get(timeout=5, device="cuda")

    # Once untimed: the first launch of a kernel may load its module (CUDA's lazy loading), and
    # that load waits for the work already on the device, which would look like a host sync.
    with torch.cuda.stream(consumer_stream):
        hand_over(1)["x"].sum().item()
    torch.cuda.synchronize()
    out = hand_over(1_000_000_000)  # keeps the producer stream busy for about 0.5 s
    # get() returned while the producer's work is still running: no host sync.
    assert not producer_stream.query()
    with torch.cuda.stream(consumer_stream):
        value = out["x"].sum().item()  # .item() waits for the current (consumer) stream only
    assert value == 7.0 * (1 << 20)


@pytest.mark.multi_gpu
@pytest.mark.timeout(60)
def test_cuda_handoff_across_devices():
    ch = Channel(2)
    src, dst = torch.device("cuda:0"), torch.device("cuda:1")
    producer_stream, consumer_stream = torch.cuda.Stream(src), torch.cuda.Stream(dst)
    torch.zeros(1, device=src) + torch.zeros(1, device=dst).to(src)  # contexts and P2P up
    torch.cuda.synchronize(src)
    torch.cuda.synchronize(dst)
    with torch.cuda.stream(producer_stream):
        x = torch.zeros(1 << 20, device=src)
        torch.cuda._sleep(1_000_000_000)
        x.fill_(3.0)
        ch.put({"x": x})
    del x
    with torch.cuda.device(dst):
        with torch.cuda.stream(consumer_stream):
            out = ch.get(timeout=5, device=dst)
            assert not producer_stream.query()
            assert out["x"].device == dst
            value = out["x"].sum().item()
    assert value == 3.0 * (1 << 20)


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_source_memory_not_reused_while_consumer_reads_it():
    # record_stream's job: on one device get() hands over the producer's own tensor
    # (no copy). When the consumer drops it, the allocator must not give its block to
    # the producer's next tensor before the consumer's (late) kernels have read it.
    ch = Channel(2)
    producer_stream, consumer_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    n = 1 << 20
    with torch.cuda.stream(producer_stream):
        x = torch.full((n,), 3.0, device="cuda")
        ch.put({"x": x})
    del x
    with torch.cuda.stream(consumer_stream):
        torch.cuda._sleep(1_000_000_000)  # the consumer's read runs late
        out = ch.get(timeout=5, device="cuda")
        z = out["x"] * 1.0
    del out  # the consumer drops the batch; its read above is still queued
    with torch.cuda.stream(producer_stream):
        y = torch.empty(n, device="cuda")
        y.fill_(-1.0)
    torch.cuda.synchronize()
    assert bool((z == 3.0).all())


@pytest.mark.gpu
@pytest.mark.timeout(60)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_handoff_on_one_stream_hands_the_item_over_as_is():
    ch = Channel(2)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()
    n = 1 << 20
    with torch.cuda.stream(stream):
        x = torch.zeros(n, device="cuda")
        torch.cuda._sleep(1_000_000_000)  # the producer's write runs late
        x.fill_(5.0)
        item = {"x": x}
        ch.put(item)
        out = ch.get(timeout=5, device="cuda")
        assert out is item and not stream.query()  # no copy, no host sync
        total = out["x"].sum()  # queued behind the write on the same stream
        mixed = {"x": x, "on_host": torch.ones(3)}
        ch.put(mixed)
        moved = ch.get(timeout=5, device="cuda")
        assert moved is not mixed and moved["on_host"].is_cuda  # the consumer asked for everything on the GPU
        value = total.item()  # on this stream: .item() waits for this stream's work only
    assert value == 5.0 * n
