"""The trainer's one-line refusals say what to do, and what they advise is accepted."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def trainer(*argv):
    return subprocess.run([sys.executable, "-m", "examples.dflash_trainer", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("argv, names", [
    (["--seq-len", "1", "--num-anchors", "1"], ["--seq-len", "2"]),  # the flag to raise, and its least value
    (["--seq-len", "8", "--num-anchors", "9"], ["--num-anchors", "7", "--seq-len"]),  # 7: the most anchors 8 allows
    (["--block-size", "2"], ["--gamma 1"]),  # the flag it needs, with a value that fits the block size
    (["--data", "/dev/zero", "--max-steps", "1"], ["/dev/zero"]),
])
def test_a_bad_flag_gets_one_line_that_says_what_to_do_and_exit_2(tmp_path, argv, names):
    proc = trainer(*argv, "--out-dir", str(tmp_path / "run"), "--devices", "cpu")
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and all(name in last for name in names), proc.stderr


def test_the_advice_for_a_log_only_directory_under_resume_is_the_one_a_fresh_run_asks_for(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    resumed = trainer("--out-dir", str(out), "--devices", "cpu", "--resume")
    advice = resumed.stderr.strip().splitlines()[-1]
    assert resumed.returncode == 2 and "--resume" in advice and "--overwrite" in advice, resumed.stderr
    fresh = trainer("--out-dir", str(out), "--devices", "cpu")  # without the --overwrite it advised
    assert fresh.returncode == 2 and "--overwrite" in fresh.stderr.strip().splitlines()[-1], fresh.stderr
