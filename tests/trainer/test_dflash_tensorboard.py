"""--tensorboard: a run's event file, read back with TensorBoard's own reader, holds what its
metrics.jsonl holds, tau, and every worker's step time."""

import json

import pytest

from examples.dflash_trainer.train import train

from tests.helpers.tiny_run import tiny_config

pytestmark = pytest.mark.timeout(300)


def test_a_run_writes_its_scalars_and_each_workers_step_time(tiny_assets, tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    board = tmp_path / "tb"
    result = train(tiny_config(tiny_assets, tmp_path / "run", max_steps=20, eval_every=10, eval_prompts=2,
                               eval_max_new_tokens=8, targets=2, drafters=2, tensorboard=str(board)))
    events = event_accumulator.EventAccumulator(str(board), size_guidance={event_accumulator.SCALARS: 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in records if "loss" in r]
    assert [e.step for e in events.Scalars("train/loss")] == [r["step"] for r in logged] == [10, 20]
    for name in ("loss", "acc", "lr", "tokens_per_s"):
        assert [e.value for e in events.Scalars(f"train/{name}")] == pytest.approx([r[name] for r in logged], rel=1e-6)
    taus = [r["eval_tau"] for r in records if "eval_tau" in r]
    assert [e.value for e in events.Scalars("eval/tau")] == pytest.approx(taus) and len(taus) == 2
    assert {f"step_time_ms/{name}" for name in result.workers} <= tags and len(result.workers) == 4
    assert all(e.value > 0 for name in result.workers for e in events.Scalars(f"step_time_ms/{name}"))
