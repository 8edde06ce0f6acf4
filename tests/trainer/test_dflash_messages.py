"""The trainer's one-line refusals say what to do, and what they advise is accepted."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def trainer(*argv):
    return subprocess.run([sys.executable, "-m", "examples.dflash_trainer", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("argv, says", [
    (["--seq-len", "1", "--num-anchors", "1"], "error: --seq-len 1 leaves no position for an anchor (it needs at least "
                                               "2); raise --seq-len"),
    (["--seq-len", "8", "--num-anchors", "9"], "lower --num-anchors to at most 7 or raise --seq-len"),
    (["--block-size", "2"], "pass --gamma (half the block size is a fair start: --gamma 1)"),
    (["--data", "/dev/zero", "--max-steps", "1"], "data file /dev/zero is not a regular file (a device or a pipe)"),
])
def test_a_bad_flag_gets_one_line_that_says_what_to_do_and_exit_2(tmp_path, argv, says):
    proc = trainer(*argv, "--out-dir", str(tmp_path / "run"), "--devices", "cpu")
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and says in last, proc.stderr


def test_the_advice_for_a_log_only_directory_under_resume_is_the_one_a_fresh_run_asks_for(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    resumed = trainer("--out-dir", str(out), "--devices", "cpu", "--resume")
    assert resumed.returncode == 2 and "drop --resume and add --overwrite" in resumed.stderr, resumed.stderr
    fresh = trainer("--out-dir", str(out), "--devices", "cpu")  # without the --overwrite it advised
    assert fresh.returncode == 2 and "pass --overwrite to start over there" in fresh.stderr, fresh.stderr
