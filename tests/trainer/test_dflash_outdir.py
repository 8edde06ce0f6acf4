"""The run directory keeps what is in it: --overwrite deletes only the trainer's files and only once
the inputs are checked, one run at a time holds a directory, a run that failed before its first
step blocks nothing, a resume onto other data of the same size is refused while the same target
spelled another way resumes, and a second stop signal during a slow setup stops without waiting."""

import json
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from examples.dflash_trainer.run.checkpoint import ResumeMismatch
from examples.dflash_trainer.errors import MissingInput
from examples.dflash_trainer.run.outdir import OutDirError, RunLock
from examples.dflash_trainer.train import train

from tests.helpers.tiny_run import tiny_cli, tiny_config

ROOT = Path(__file__).resolve().parents[2]


def config(assets, out, **overrides):
    return tiny_config(assets, out, **{"max_steps": 2, "checkpoint_every": 2, **overrides})


@pytest.fixture
def finished(tiny_assets, tmp_path):
    out = tmp_path / "run"
    train(config(tiny_assets, out))
    return out


def test_overwrite_with_a_bad_input_deletes_nothing(tiny_assets, finished):
    weights = finished / "checkpoints" / "step_00000002" / "model.safetensors"
    before, log = weights.read_bytes(), (finished / "metrics.jsonl").read_text()
    with pytest.raises(MissingInput, match="target directory /no/such/target does not exist"):
        train(config(tiny_assets, finished, overwrite=True, target="/no/such/target"))
    assert weights.read_bytes() == before and (finished / "metrics.jsonl").read_text() == log


def test_overwrite_deletes_what_the_trainer_wrote_and_nothing_else(tiny_assets, finished):
    theirs = finished / "checkpoints" / "llama_finetune.bin"
    theirs.write_bytes(b"someone's weights")
    (finished / "notes.txt").write_text("keep me")
    train(config(tiny_assets, finished, overwrite=True, seed=1, max_steps=4, checkpoint_every=4))
    assert theirs.read_bytes() == b"someone's weights" and (finished / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in (finished / "checkpoints").iterdir()) == ["latest", "llama_finetune.bin", "step_00000004"]
    steps = [json.loads(line)["step"] for line in (finished / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(steps) and len(steps) == len(set(steps)) and steps[-1] == 4


def test_a_directory_another_run_holds_is_refused_until_it_ends(tiny_assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    other = RunLock(out).acquire()  # what a run in another process holds while it trains
    try:
        with pytest.raises(OutDirError, match=r"is in use by another run \(pid \d+\); wait for it to end"):
            train(config(tiny_assets, out))
        assert not (out / "metrics.jsonl").exists() and not (out / "checkpoints").exists()
    finally:
        other.release()
    assert train(config(tiny_assets, out)).total_steps == 2


def test_a_run_that_failed_before_its_first_step_blocks_nothing(tiny_assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("")  # what a run that failed in setup leaves
    assert train(config(tiny_assets, out)).total_steps == 2


def test_a_log_without_a_checkpoint_says_overwrite_not_resume(tiny_assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    with pytest.raises(OutDirError, match=r"metrics\.jsonl.*--overwrite"):
        train(config(tiny_assets, out))


def test_a_file_where_the_checkpoints_go_is_refused_before_any_step(tiny_assets, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoints").write_text("not a directory")
    with pytest.raises(OutDirError, match="checkpoints"):
        train(config(tiny_assets, out))
    assert not (out / "metrics.jsonl").exists()


def test_a_resume_onto_other_data_of_the_same_size_is_refused(tiny_assets, tmp_path):
    data, out = tmp_path / "train.jsonl", tmp_path / "run"
    lines = tiny_assets.train_jsonl.read_text().splitlines()
    data.write_text("\n".join(lines) + "\n")
    train(config(tiny_assets, out, data=str(data), max_steps=4))
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    data.write_text("\n".join(lines[1:] + lines[:1]) + "\n")  # the same samples, another order
    with pytest.raises(ResumeMismatch, match=r"other settings: the data's contents '[0-9a-f]{16}' when saved, '[0-9a-f]{16}' now"):
        train(config(tiny_assets, out, data=str(data), max_steps=4, resume=True))
    data.write_text("\n".join(lines) + "\n")
    target = tiny_assets.target_dir
    spelled = f"{target}/../{target.name}/"
    assert train(config(tiny_assets, out, data=str(data), target=spelled, max_steps=4, resume=True)).start_step == 2


def test_a_worker_that_fails_after_a_checkpoint_names_itself_and_the_checkpoint(tiny_assets, tmp_path, monkeypatch,
                                                                               capsys):
    import threading

    from examples.dflash_trainer import __main__ as cli
    from examples.dflash_trainer.drafter import replica

    real, calls = replica.DrafterReplica.forward_backward, []

    def forward_backward(self, batch, *args, **kwargs):
        if threading.current_thread().name == "drafter-1":
            calls.append(1)
            if len(calls) == 4:  # after the step-2 checkpoint
                raise RuntimeError("injected failure")
        return real(self, batch, *args, **kwargs)

    monkeypatch.setattr(replica.DrafterReplica, "forward_backward", forward_backward)
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr
    out = tmp_path / "run"
    args = tiny_cli(tiny_assets, out, "--max-steps", "8", "--checkpoint-every", "2")
    assert cli.main(args) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"error: drafter-1 failed: RuntimeError: injected failure; the last checkpoint is "
                    f"{out / 'checkpoints' / 'step_00000002'}: fix the cause and continue with --resume "
                    f"(--debug prints the traceback)"), last


def test_a_disk_without_room_for_a_checkpoint_is_refused_before_training(tiny_assets, tmp_path, monkeypatch, caplog):
    from collections import namedtuple

    from examples.dflash_trainer.assets import sizes
    from examples.dflash_trainer.target import TargetModel

    cfg = config(tiny_assets, tmp_path / "run", max_steps=4, checkpoint_every=1)
    shape = TargetModel.shape_only(tiny_assets.target_dir, num_feature_layers=cfg.num_feature_layers)
    one = sizes.trainable_drafter_params(cfg, shape.config, sum(p.numel() for p in shape.model.parameters())) \
        * sizes.CHECKPOINT_BYTES
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sizes.shutil, "disk_usage", lambda path: usage(10 * one, 9 * one, one // 2))
    with pytest.raises(sizes.TooLarge, match=r"[\d.]+ [KMG]iB.*--out-dir.*[\d.]+ [KMG]iB"):
        train(cfg)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    monkeypatch.setattr(sizes.shutil, "disk_usage", lambda path: usage(10 * one, 8 * one, 2 * one))
    with caplog.at_level("WARNING", logger="dflash"):
        train(cfg)  # room for two of its five checkpoints: it runs, warned
    assert "the run's 5 checkpoints need about" in caplog.text


SLOW_SETUP = textwrap.dedent("""
    import pathlib, sys, threading, time
    import threadgraph
    from examples.dflash_trainer import target, __main__ as cli
    def say(line):  # to the test, which reads stderr as it comes
        print(line, file=sys.stderr, flush=True)
    def load(self, device):  # a target that takes a minute to load
        say("test: a worker loads its target")
        time.sleep(60)
        pathlib.Path(sys.argv[1]).touch()  # only if the process waited for the whole load
    target.TargetSource.load = load
    plain_join, said = threading.Thread.join, []
    def join(self, timeout=None):  # inside WorkerGroup.join's wait, where a signal stops the workers
        if not said and isinstance(self, threadgraph.CompiledWorkerThread) \
                and threading.current_thread() is threading.main_thread():
            said.append(True)
            say("test: the main thread waits on the workers")
        return plain_join(self, timeout)
    threading.Thread.join = join
    sys.exit(cli.main(sys.argv[2:]))
""")


class _Lines:
    """A process's stderr read line by line as it comes, in a thread; ``wait_for`` a line."""

    def __init__(self, stream) -> None:
        self.lines, self._cond = [], threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self.lines.append(None)  # the end of the stream
            self._cond.notify_all()

    def wait_for(self, text: str, count: int = 1, timeout: float = 120) -> None:
        def seen():
            return self.lines[-1:] == [None] or sum(text in line for line in self.lines if line) >= count
        with self._cond:
            assert self._cond.wait_for(seen, timeout), f"no {text!r} in {timeout} s"
            assert sum(text in line for line in self.lines if line) >= count, \
                f"the process ended before {count} {text!r}:\n" + "\n".join(filter(None, self.lines[-40:]))

    def all(self) -> str:
        self._thread.join(120)
        return "\n".join(filter(None, self.lines))


def test_a_second_signal_during_a_slow_setup_stops_without_waiting(tiny_assets, tmp_path):
    out = tmp_path / "run"
    args = tiny_cli(tiny_assets, out, "--max-steps", "2")
    loaded = tmp_path / "loaded"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_SETUP, str(loaded), *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    stderr = _Lines(proc.stderr)
    # The first signal once a worker is inside its load and the main thread waits on the workers (a
    # signal while it starts them stops at once); the second once the first has been handled and the
    # process waits for its workers to stop, saying that another signal stops the wait.
    stderr.wait_for("test: a worker loads its target")
    stderr.wait_for("test: the main thread waits on the workers")
    proc.send_signal(signal.SIGTERM)
    stderr.wait_for("SIGTERM during setup")
    stderr.wait_for("press Ctrl-C again to stop waiting")
    proc.send_signal(signal.SIGTERM)
    proc.wait(120)
    err = stderr.all()
    assert not loaded.exists(), "the second signal waited for the minute-long load:\n" + err[-3000:]
    assert proc.returncode == 143, err[-3000:]
    during_setup = [line for line in err.splitlines() if "SIGTERM during setup" in line]
    assert len(during_setup) == 2 and "without waiting" in during_setup[1], err[-3000:]  # the second one forces
    last = err.strip().splitlines()[-1]
    assert "SIGTERM" in last and "no checkpoint" in last, last
