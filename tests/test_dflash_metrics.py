"""MetricsLogger (JSONL, flushed, thread-safe) and Throughput (windowed tokens/s)."""

import json
import threading

import pytest
import torch

from examples.dflash_trainer.metrics import MetricsLogger, PhaseTimes, Throughput


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_line_is_flushed_json(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = MetricsLogger(path)
    log.log(1, loss=2.5, tau=3.0, tokens_per_s=1000.0, lr=6e-4)
    # Readable before close: a crashed run keeps every line written so far.
    (rec,) = _read(path)
    assert rec["step"] == 1 and rec["loss"] == 2.5 and rec["lr"] == 6e-4
    assert {"time", "elapsed_s"} <= rec.keys()
    log.log(2, loss=torch.tensor(1.25), bad=float("nan"), big=float("inf"))
    log.close()
    rec = _read(path)[1]
    assert rec["loss"] == 1.25 and rec["bad"] == "NaN" and rec["big"] == "Infinity"
    assert float(rec["bad"]) != float(rec["bad"])  # float() reads it back as NaN


def test_appends_to_existing_file(tmp_path):
    path = tmp_path / "m.jsonl"
    with MetricsLogger(path) as log:
        log.log(1, loss=1.0)
    with MetricsLogger(path) as log:
        log.log(2, loss=0.5)
    assert [r["step"] for r in _read(path)] == [1, 2]


def test_reserved_fields_and_closed_logger_error(tmp_path):
    log = MetricsLogger(tmp_path / "m.jsonl")
    with pytest.raises(ValueError, match="set by the logger itself"):
        log.log(1, time=3.0)
    log.close()
    with pytest.raises(ValueError, match="is closed"):
        log.log(2, loss=1.0)


@pytest.mark.timeout(30)
def test_thread_safe_lines_never_interleave(tmp_path):
    path = tmp_path / "m.jsonl"
    log = MetricsLogger(path)
    payload = "x" * 2000  # long lines make a torn write visible

    def worker(w):
        for i in range(200):
            log.log(i, worker=w, payload=payload)

    threads = [threading.Thread(target=worker, args=(w,), name=f"w{w}") for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
        assert not t.is_alive()
    log.close()
    recs = _read(path)
    assert len(recs) == 800
    assert sorted((r["worker"], r["step"]) for r in recs) == [(w, i) for w in range(4)
                                                               for i in range(200)]


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_throughput_rate_over_window():
    clock = _Clock()
    tp = Throughput(window_s=10.0, clock=clock)
    assert tp.rate() == 0.0
    for _ in range(5):
        clock.t += 1.0
        tp.add(100)
    assert tp.total == 500
    assert tp.rate() == pytest.approx(100.0)
    # A faster phase: once the window has moved past the slow phase, only it counts.
    for _ in range(20):
        clock.t += 1.0
        tp.add(1000)
    assert tp.rate() == pytest.approx(1000.0)
    clock.t += 100.0  # idle: the rate decays to zero
    assert tp.rate() == 0.0
    assert tp.total == 20_500


@pytest.mark.timeout(30)
def test_throughput_counts_from_threads():
    tp = Throughput()
    threads = [threading.Thread(target=lambda: [tp.add(3) for _ in range(1000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
        assert not t.is_alive()
    assert tp.total == 12_000


def test_throughput_window_must_be_positive():
    with pytest.raises(ValueError, match="window_s must be > 0"):
        Throughput(window_s=0)


def test_phase_times_split_each_step_and_skip_warmup(monkeypatch):
    clock = iter([0.0, 0.001, 0.004, 10.0, 10.002, 10.005, 20.0, 20.003, 20.004])
    monkeypatch.setattr("examples.dflash_trainer.metrics.time.perf_counter", lambda: next(clock))
    phases = PhaseTimes()
    for _ in range(3):
        phases.begin()
        phases.mark("a")
        phases.mark("b")
    assert phases.medians() == pytest.approx({"a": 2.0, "b": 3.0})
    assert phases.medians(skip=1) == pytest.approx({"a": 2.5, "b": 2.0})
    assert phases.medians(skip=3) == {}
