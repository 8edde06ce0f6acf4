"""Issue 21: the trainer never loses or silently corrupts a run. One test per failure found by the
fault probe (out-dir safety, stop signals, verified checkpoints, clear errors, size guards).

In-process tests share one tiny finished run (copied per test); the few subprocess tests (a stop
signal, torchrun) are small and carry timeouts."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from examples.dflash_trainer import __main__ as cli
from examples.dflash_trainer.run.checkpoint import CheckpointError, ResumeMismatch, RunFinished
from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.errors import EXIT_BAD_INPUT
from examples.dflash_trainer.run.outdir import OutDirError
from examples.dflash_trainer.train import train

from tests.helpers import tiny_run
from tests.helpers.tiny_run import tiny_cli as cli_args

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4  # the shared run: checkpoints at steps 2 and 4


def tiny_config(assets, out_dir, **overrides):
    """The trainer tests' tiny config, with this file's run length and checkpoints at steps 2 and 4."""
    return tiny_run.tiny_config(assets, out_dir, **{"max_steps": STEPS, "checkpoint_every": 2, **overrides})


@pytest.fixture(scope="module")
def finished_run(tiny_assets, tmp_path_factory):
    out = tmp_path_factory.mktemp("finished")
    result = train(tiny_config(tiny_assets, out))
    return out, result.losses


@pytest.fixture
def run_copy(finished_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(finished_run[0], out)
    return out


@pytest.fixture
def quiet_cli(monkeypatch):
    monkeypatch.setattr(cli.faulthandler, "register", lambda *args, **kwargs: None)  # needs a real stderr


def resumable(out):
    """As if the run had been stopped after its step-2 checkpoint."""
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    return out


# -- 1. data loss ------------------------------------------------------------------------------

def test_a_fresh_run_into_a_run_directory_is_refused_and_overwrite_replaces_it(tiny_assets, run_copy):
    before = (run_copy / "checkpoints" / "step_00000004" / "model.safetensors").read_bytes()
    with pytest.raises(OutDirError, match=r"already holds a run .*--resume.*new --out-dir.*--overwrite"):
        train(tiny_config(tiny_assets, run_copy, seed=1))
    assert (run_copy / "checkpoints" / "step_00000004" / "model.safetensors").read_bytes() == before
    train(tiny_config(tiny_assets, run_copy, seed=1, max_steps=2, overwrite=True))
    assert sorted(p.name for p in (run_copy / "checkpoints").iterdir()) == ["latest", "step_00000002"]


def test_resume_cuts_metrics_back_to_the_checkpoint_so_runs_never_mix(tiny_assets, run_copy):
    metrics = run_copy / "metrics.jsonl"
    with metrics.open("a") as f:  # what a killed run leaves after its last checkpoint
        f.write(json.dumps({"step": 3, "loss": 123.0}) + "\n" + '{"step": 4, "lo')
    train(tiny_config(tiny_assets, resumable(run_copy), resume=True))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert all(r.get("loss") != 123.0 for r in records)
    losses = [r["step"] for r in records if "loss" in r]
    assert losses == sorted(losses) and len(losses) == len(set(losses))


def test_every_checkpoint_write_is_fsynced_before_its_rename(tiny_assets, tmp_path, monkeypatch):
    from examples.dflash_trainer.run import checkpoint

    events, opened = [], {}
    real_open, real_fsync, real_replace = os.open, os.fsync, os.replace

    def open_(path, flags, *args, **kwargs):
        fd = real_open(path, flags, *args, **kwargs)
        opened[fd] = Path(path).name
        return fd

    # at the OS calls themselves: whatever helper makes them, the file's fsync precedes its rename
    monkeypatch.setattr(checkpoint.os, "open", open_)
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: (events.append(("fsync", opened.get(fd))), real_fsync(fd)))
    monkeypatch.setattr(checkpoint.os, "replace", lambda a, b: (events.append(("rename", Path(b).name)), real_replace(a, b)))
    train(tiny_config(tiny_assets, tmp_path, max_steps=2))
    names = list(events)
    assert names.index(("fsync", "state.pt")) < names.index(("rename", "step_00000002"))
    assert names.index(("fsync", ".latest.tmp")) < names.index(("rename", "latest"))


# -- 3. silent wrong state on resume -----------------------------------------------------------

def test_resume_with_another_worker_topology_is_refused(tiny_assets, run_copy):
    with pytest.raises(ResumeMismatch, match=r"other settings: --targets 5 when saved, 3 now"):
        train(tiny_config(tiny_assets, resumable(run_copy), resume=True, targets=3))


def test_a_state_file_copied_from_another_step_is_refused(tiny_assets, run_copy):
    ckpt = run_copy / "checkpoints"
    shutil.copy(ckpt / "step_00000004" / "state.pt", ckpt / "step_00000002" / "state.pt")
    with pytest.raises(CheckpointError, match=r"step_00000002/state\.pt.*step_00000004"):
        train(tiny_config(tiny_assets, resumable(run_copy), resume=True))


def test_finite_garbage_in_the_weights_is_refused_naming_the_nearest_good_checkpoint(tiny_assets, run_copy):
    weights = run_copy / "checkpoints" / "step_00000004" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)  # zeros: finite, loadable, wrong
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step_00000004/model\.safetensors.*step_00000002"):
        train(tiny_config(tiny_assets, run_copy, max_steps=6, resume=True))


def test_resuming_a_finished_run_says_so_and_exits_0(tiny_assets, run_copy, quiet_cli, capsys):
    with pytest.raises(RunFinished, match="already finished"):
        train(tiny_config(tiny_assets, run_copy, resume=True))
    assert cli.main(cli_args(tiny_assets, run_copy, "--max-steps", str(STEPS), "--checkpoint-every", "2",
                             "--resume")) == 0
    assert "already finished: " in capsys.readouterr().err


# -- 4. errors that name the file and the fix --------------------------------------------------

@pytest.mark.parametrize("damage, match", [
    ("truncate_state", r"step_00000004/state\.pt is corrupt: \d+ bytes.*nearest good checkpoint is .*step_00000002"),
    ("garbage_latest", r"latest is garbled.*nearest good checkpoint is .*step_00000004"),
    ("empty_latest", r"latest is empty.*nearest good checkpoint is .*step_00000004"),
    ("delete_latest", r"latest is missing but .* holds step directories.*nearest good checkpoint is .*step_00000004"),
])
def test_damaged_checkpoints_give_one_line_naming_the_file_and_the_fix(tiny_assets, run_copy, quiet_cli, capsys,
                                                                      damage, match):
    ckpt = run_copy / "checkpoints"
    if damage == "truncate_state":
        state = ckpt / "step_00000004" / "state.pt"
        state.write_bytes(state.read_bytes()[:100])
    elif damage == "garbage_latest":
        (ckpt / "latest").write_bytes(b"\xff\xfe\x00garbage")
    elif damage == "empty_latest":
        (ckpt / "latest").write_text("")
    else:
        (ckpt / "latest").unlink()
    code = cli.main(cli_args(tiny_assets, run_copy, "--max-steps", "6", "--checkpoint-every", "2", "--resume"))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT
    assert err[-1].startswith("error: ")
    assert re.search(match, err[-1]), err[-1]


def test_bad_input_found_late_exits_2_with_one_line(tiny_assets, tmp_path, quiet_cli, capsys):
    binary = tmp_path / "data.bin"
    binary.write_bytes(bytes(range(255, -1, -1)) * 4)  # invalid UTF-8 from its first byte
    as_file = tmp_path / "a_file"
    as_file.write_text("x")
    cases = [
        (["--data", str(binary)], r"data file .*data\.bin is not UTF-8 text"),
        (["--target", str(tmp_path / "nowhere")], r"target directory .*nowhere does not exist"),
        (["--compile", "reduce-overhead"], r"--compile reduce-overhead needs CUDA devices"),
        (["--devices", "foo"], r"--devices entry 'foo' is not a device"),
        (["--out-dir", str(as_file)], r"--out-dir .*a_file is a file, not a directory"),
    ]
    for extra, match in cases:
        args = cli_args(tiny_assets, tmp_path / "out", "--max-steps", "2") + extra
        assert cli.main(args) == EXIT_BAD_INPUT, extra
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert re.search(match, last), last
        assert "Traceback" not in last


def test_an_unwritable_out_dir_is_one_clear_line(tiny_assets, tmp_path):
    if os.geteuid() == 0:  # root writes through any mode bits, but not into /proc
        locked = Path("/proc/self")
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
    with pytest.raises(OutDirError, match="is not writable"):
        train(tiny_config(tiny_assets, locked / "run"))


def test_a_non_finite_loss_right_after_resume_blames_the_checkpoint(tiny_assets, run_copy, monkeypatch):
    from examples.dflash_trainer import target as target_module

    real = target_module.TargetModel.features
    monkeypatch.setattr(target_module.TargetModel, "features", lambda self, *a, **k: real(self, *a, **k) * float("nan"))
    with pytest.raises(Exception, match=r"resuming from step 2"):
        train(tiny_config(tiny_assets, resumable(run_copy), resume=True))


# -- 5. sizes ----------------------------------------------------------------------------------

def test_more_anchors_than_positions_is_refused_up_front():
    with pytest.raises(ValueError, match=r"--num-anchors 1000 .*--seq-len 96"):
        TrainConfig(num_anchors=1000, seq_len=96)


def test_a_batch_that_cannot_fit_is_refused_before_any_worker_starts(tiny_assets, tmp_path, monkeypatch):
    from examples.dflash_trainer.assets import sizes

    monkeypatch.setattr(sizes, "free_bytes", lambda device: 8 * sizes.GiB)  # what this CI machine has, say
    with pytest.raises(sizes.TooLarge, match=r"\d+\.\d GiB on cpu.* 8\.0 GiB.*pass --batch-size \d+ \(now 4000\)"):
        train(tiny_config(tiny_assets, tmp_path, batch_size=4000, seq_len=96, num_anchors=16))
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_run_refuses_an_out_dir_without_room_for_its_checkpoint_unless_it_saves_none(tiny_assets, tmp_path, monkeypatch):
    from collections import namedtuple

    from examples.dflash_trainer.assets import sizes

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(sizes.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 1000, 1000))  # 1000 B free
    with pytest.raises(sizes.TooLarge, match=r"a checkpoint of this drafter needs about .* has 1000 bytes free; free some space, pass an --out-dir on a larger disk, or --no-checkpoints"):
        train(tiny_config(tiny_assets, tmp_path / "saves", max_steps=2))
    result = train(tiny_config(tiny_assets, tmp_path / "saves-none", max_steps=2, no_checkpoints=True))
    assert len(result.losses) == 2
    assert not (tmp_path / "saves-none" / "checkpoints").exists() or not any((tmp_path / "saves-none" / "checkpoints").iterdir())


def test_the_memory_estimate_grows_linearly_with_the_batch():
    """Every per-sample part scales with the batch; the estimate against a measured peak is
    test_dflash_paper.py's (and the dflash-loss-memory benchmark's)."""
    from types import SimpleNamespace

    from examples.dflash_trainer.assets import sizes

    model = SimpleNamespace(hidden_size=128, vocab_size=2048, num_hidden_layers=6, intermediate_size=384,
                            num_attention_heads=4)
    at = {b: sum(sizes.estimate_bytes(TrainConfig(batch_size=b, seq_len=96), model, 3_000_000, 4).values())
          for b in (16, 32, 64)}
    assert at[32] - at[16] > 0
    assert (at[64] - at[32]) == pytest.approx(2 * (at[32] - at[16]), rel=0.01)


# -- 2. stops that save nothing or hang (subprocesses: few and small) -------------------------

def _wait_for(path: Path, proc, timeout=240):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not path.exists() and proc.poll() is None:
        time.sleep(0.1)  # polling a file another process writes
    assert path.exists(), proc.communicate(timeout=5)[1][-3000:] if proc.poll() is not None else "timed out"


SIGNAL_STEPS = 30


@pytest.fixture(scope="module")
def uninterrupted(tiny_assets, tmp_path_factory):
    return train(tiny_config(tiny_assets, tmp_path_factory.mktemp("full"), max_steps=SIGNAL_STEPS,
                             checkpoint_every=0)).losses


@pytest.mark.parametrize("signals, code", [((signal.SIGTERM,), 143), ((signal.SIGINT, signal.SIGTERM), 130)],
                         ids=["sigterm", "sigint+sigterm-at-once"])
def test_a_stop_signal_saves_at_the_next_step_and_resumes_bit_identically(tiny_assets, tmp_path, uninterrupted,
                                                                         signals, code):
    steps, full = SIGNAL_STEPS, uninterrupted
    out = tmp_path / "stopped"
    args = [sys.executable, "-m", "examples.dflash_trainer",
            *cli_args(tiny_assets, out, "--max-steps", str(steps), "--checkpoint-every", "2")]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / "checkpoints" / "latest", proc)
    for sig in signals:  # torchrun's agent sends SIGINT and SIGTERM within a millisecond
        proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-3000:]
    latest = (out / "checkpoints" / "latest").read_text().strip()
    saved = int(latest.split("_")[1])
    assert str(out / "checkpoints" / latest) in err and "--resume" in err, err[-3000:]
    assert 2 <= saved < steps
    resumed = train(tiny_config(tiny_assets, out, max_steps=steps, checkpoint_every=2, resume=True))
    assert resumed.start_step == saved
    assert resumed.losses == full[saved:]  # bit-identical


def test_sigterm_during_setup_exits_143_saying_nothing_was_saved(tiny_assets, tmp_path, quiet_cli, capsys, monkeypatch):
    from examples.dflash_trainer import pipeline

    def build(config):  # the signal arrives while the pipeline is being built
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("the SIGTERM handler did not stop the run")

    monkeypatch.setattr(pipeline.Pipeline, "build", staticmethod(build))
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(cli_args(tiny_assets, tmp_path, "--max-steps", "2")) == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "SIGTERM" in last and "no checkpoint" in last, last
    assert signal.getsignal(signal.SIGTERM) is before  # the handlers are the process's again


def _rank_pids(agent_pid: int) -> dict:
    """{rank: pid} of the worker processes a torchrun agent started."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid != agent_pid:
                continue
            env = dict(kv.split("=", 1) for kv in (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in kv)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            out[int(env["RANK"])] = int(entry.name)
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the ranks' pids in /proc")
@pytest.mark.timeout(480)  # a job the collective timeout does not end
def test_a_suspended_torchrun_rank_fails_the_job_naming_it_within_the_timeout(tiny_assets, tmp_path):
    timeout = 8
    logs = tmp_path / "logs"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--redirects", "3", "--log-dir", str(logs), "-m", "examples.dflash_trainer",
           *cli_args(tiny_assets, tmp_path / "out", "--max-steps", "100000", "--checkpoint-every", "2",
                     "--collective-timeout-s", str(timeout))]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = None
    try:
        _wait_for(tmp_path / "out" / "checkpoints" / "latest", proc)
        ranks = _rank_pids(proc.pid)
        assert sorted(ranks) == [0, 1], ranks
        stopped = ranks[1]
        os.kill(stopped, signal.SIGSTOP)
        # Rank 0 ends on its own (the collective timeout); no bound on when: the test's timeout
        # catches a hang, and a wall-clock bound would fail on a busy machine by chance.
        while True:
            try:
                os.kill(ranks[0], 0)
            except ProcessLookupError:
                break
            if Path(f"/proc/{ranks[0]}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
            time.sleep(0.2)  # polling another process's state: nothing to wait on
        os.kill(stopped, signal.SIGKILL)
        proc.communicate(timeout=120)
        rank0 = "".join(p.read_text() for p in logs.rglob("*") if p.is_file() and "/0/" in str(p))
        assert "rank 1 stopped making progress" in rank0, rank0[-3000:]
        assert proc.returncode != 0
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)


@pytest.mark.skipif(not hasattr(os, "killpg"), reason="sends Ctrl-C to a process group")
def test_ctrl_c_to_a_torchrun_job_saves_one_checkpoint_at_a_step_every_rank_agrees_on(tiny_assets, tmp_path):
    logs = tmp_path / "logs"
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--redirects", "3", "--log-dir", str(logs), "-m", "examples.dflash_trainer",
           *cli_args(tiny_assets, out, "--max-steps", "100000", "--checkpoint-every", "2")]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _wait_for(out / "checkpoints" / "latest", proc)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the agent and every rank get it
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    text = {rank: "".join(p.read_text() for p in logs.rglob("*") if p.is_file() and f"/{rank}/" in str(p))
            for rank in (0, 1)}
    latest = (out / "checkpoints" / "latest").read_text().strip()
    step = int(latest.split("_")[1])
    assert f"checkpoint saved to {out / 'checkpoints' / latest}" in text[0], text[0][-3000:]
    assert f"after step {step}; rank 0 saves the checkpoint" in text[1], text[1][-3000:]


def test_a_stop_with_no_checkpoints_says_none_was_saved(tiny_assets, tmp_path, quiet_cli, capsys, monkeypatch):
    from examples.dflash_trainer.lead import Lead

    after_step = Lead.after_step

    def signalled_after_step(self, replica):  # SIGTERM while step 2 runs: the run stops after it
        if replica.step == 1:
            signal.raise_signal(signal.SIGTERM)
        after_step(self, replica)

    monkeypatch.setattr(Lead, "after_step", signalled_after_step)
    out = tmp_path / "run"
    assert cli.main(cli_args(tiny_assets, out, "--max-steps", "6", "--checkpoint-every", "1", "--no-checkpoints")) == 143
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"stopped by SIGTERM after step \d: no checkpoint saved \(--no-checkpoints\)", last), last
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())
