"""MetricsLogger (JSONL, flushed, thread-safe), TrainingLog (windows, divergence) and PhaseTimes."""

import json
import threading
from pathlib import Path

import pytest
import torch

from examples.dflash_trainer.run.metrics import MetricsLogger, PhaseTimes, TrainingDiverged, TrainingLog


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


def _log(start_step=0, records=None, checkpoint_dir=Path("ckpt")):
    return TrainingLog(metric_names=("loss",), start_step=start_step, tokens_per_step=100, lr_at=lambda step: 0.5 * step,
                       base_lr=1e-3, checkpoint_dir=checkpoint_dir, metrics=None,
                       progress=None if records is None else records.append)


def test_training_log_reads_the_history_in_windows_and_leaves_the_first_out_of_steady():
    history = torch.tensor([[float(i), 1.0] for i in range(1, 31)])  # [loss, grad_norm] of steps 1..30
    records = []
    log = _log(records=records)
    assert not log.due(9) and log.due(10)
    log.flush(history, 10)
    assert "tokens_per_s_steady" not in log.results()  # compilation and warmup
    log.flush(history, 25)
    results = log.results()
    assert results["losses"] == [float(i) for i in range(1, 26)]
    assert results["last"] == records[-1] and results["last"]["step"] == 25 and results["last"]["loss"] == 25.0
    assert results["last"]["lr"] == pytest.approx(12.0)  # lr_at(step - 1): the lr step 25 trained with
    assert results["tokens_per_s_steady"] > 0 and [r["step"] for r in records] == [10, 25]


def test_training_log_names_the_first_step_that_diverged():
    history = torch.tensor([[1.0, 1.0], [float("nan"), 1.0], [2.0, float("inf")]])
    log = _log(start_step=0)
    with pytest.raises(TrainingDiverged, match=r"step 2\b.*--lr.*0\.001"):
        log.flush(history, 3)


def test_a_diverged_run_advises_resuming_only_from_a_checkpoint_it_has(tmp_path):
    from examples.dflash_trainer.run.checkpoint import save_checkpoint

    saved = save_checkpoint(tmp_path / "ckpt", 1, torch.nn.Linear(2, 2), None, None)
    history = torch.tensor([[1.0, 1.0], [float("nan"), 1.0]])
    log = _log(start_step=0, checkpoint_dir=tmp_path / "ckpt")
    with pytest.raises(TrainingDiverged, match=rf"or --resume from {saved} \(no checkpoint is written after"):
        log.flush(history, 2)


def test_phase_times_split_each_step_and_skip_warmup(monkeypatch):
    clock = iter([0.0, 0.001, 0.004, 10.0, 10.002, 10.005, 20.0, 20.003, 20.004])
    monkeypatch.setattr("examples.dflash_trainer.run.metrics.time.perf_counter", lambda: next(clock))
    phases = PhaseTimes()
    for _ in range(3):
        phases.begin()
        phases.mark("a")
        phases.mark("b")
    assert phases.medians() == pytest.approx({"a": 2.0, "b": 3.0})
    assert phases.medians(skip=1) == pytest.approx({"a": 2.5, "b": 2.0})
    assert phases.medians(skip=3) == {}
