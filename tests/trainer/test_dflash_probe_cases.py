"""The trainer cases a fault probe found bad: a per-step allocation sized by --max-steps, an
interrupted first checkpoint that blocked the next run, a wrong byte offset for invalid UTF-8,
and a `latest` that is not a file."""

import json
import subprocess

import pytest
import torch

from examples.dflash_trainer.data.records import DataError, read_jsonl
from examples.dflash_trainer.drafter.step import make_update
from examples.dflash_trainer.pipeline import Pipeline
from examples.dflash_trainer.run import outdir
from examples.dflash_trainer.run.checkpoint import CheckpointError, latest_checkpoint
from examples.dflash_trainer.run.metrics import TrainingLog
from examples.dflash_trainer.train import train

from tests.helpers.tiny_run import tiny_config

pytestmark = pytest.mark.timeout(300)


def test_the_metrics_history_does_not_grow_with_max_steps(tiny_assets, tmp_path):
    short = Pipeline.build(tiny_config(tiny_assets, tmp_path / "a", max_steps=4000))
    huge = Pipeline.build(tiny_config(tiny_assets, tmp_path / "b", max_steps=2_000_000))
    cpu = torch.device("cpu")
    assert huge.replica(cpu).history.shape == short.replica(cpu).history.shape


def test_the_history_ring_wraps_and_the_log_reads_each_step_once(tmp_path):
    history = torch.zeros(4, 2)
    param = torch.nn.Parameter(torch.zeros(3))
    from examples.dflash_trainer.drafter.grads import FlatGrads, make_optimizer

    grads = FlatGrads([param], extras=1)
    update = make_update(grads, make_optimizer([param], lr=1e-3, weight_decay=0.0), history, max_norm=1.0,
                         first_step=0)
    records = []
    log = TrainingLog(metric_names=("loss",), start_step=0, tokens_per_step=1, lr_at=lambda s: 1.0, base_lr=1.0,
                      checkpoint_dir=tmp_path, metrics=None, progress=records.append)
    for step in range(1, 11):
        grads.zero_()
        grads.extras.fill_(float(step))
        update()
        if step % 3 == 0 or step == 10:
            log.flush(history, step)
    assert log.losses == [float(s) for s in range(1, 11)]
    with pytest.raises(RuntimeError, match="do not fit the 4 rows"):
        log.flush(history, 15)


def _interrupted_first_save(out):
    tmp = out / "checkpoints" / ".tmp_step_00000001"
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"\0" * 100)  # a kill -9 mid-write
    return tmp


def test_an_interrupted_first_save_neither_blocks_a_fresh_run_nor_misleads(tiny_assets, tmp_path):
    out = tmp_path / "run"
    leftover = _interrupted_first_save(out)
    outdir.prepare(tiny_config(tiny_assets, out), leader=True).release()  # a fresh run is not refused
    with pytest.raises(CheckpointError, match=r"saved no checkpoint \(its save .tmp_step_00000001 was interrupted"
                                              r".*drop --resume and pass --overwrite"):
        Pipeline.build(tiny_config(tiny_assets, out, resume=True))
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.0}) + "\n")
    with pytest.raises(outdir.OutDirError, match="holds the log of a run that saved no checkpoint"):
        outdir.prepare(tiny_config(tiny_assets, out), leader=True)
    (out / "metrics.jsonl").unlink()
    train(tiny_config(tiny_assets, out, max_steps=2))
    assert not leftover.exists() and latest_checkpoint(out / "checkpoints").name == "step_00000002"


def test_invalid_utf8_is_reported_at_its_true_line_and_byte_offset(tmp_path):
    good = json.dumps({"input_ids": [1, 2, 3], "loss_mask": [1, 1, 1]}) + "\n"
    path = tmp_path / "data.jsonl"
    before = good.encode() * 3000
    path.write_bytes(before + b'{"input_ids": [1], "x": "\xff"}\n' + good.encode())
    offset = len(before) + len(b'{"input_ids": [1], "x": "')
    with pytest.raises(DataError, match=rf"not UTF-8 text \(line 3001, byte {offset} of the file"):
        read_jsonl(path, tokenizer=None, seq_len=8, vocab_size=10)


def test_a_latest_that_is_a_directory_gets_advice_that_works(tmp_path, tiny_assets):
    out = tmp_path / "run"
    train(tiny_config(tiny_assets, out, max_steps=2, checkpoint_every=1))
    root = out / "checkpoints"
    (root / "latest").unlink()
    (root / "latest").mkdir()
    with pytest.raises(CheckpointError, match="latest is a directory, not the file") as err:
        latest_checkpoint(root)
    command = str(err.value).split("`")[1]  # the advice, in backquotes
    subprocess.run(command, shell=True, check=True)
    assert latest_checkpoint(root).name == "step_00000002"
