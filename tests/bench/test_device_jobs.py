"""tools/device_jobs.sh: jobs that outlive the call that started them, their waits and their files."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "device_jobs.sh"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a bash tool for the Linux GPU machine")


def jobs(tmp_path, *args, out=None):
    env = {**os.environ, "DEVICE_JOBS": str(tmp_path / "jobs")}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


def test_a_job_runs_from_a_snapshot_and_its_files_come_back(tmp_path):
    started = jobs(tmp_path, "start", "one", "--", "bash", "-c",
                   'test -f tools/device_jobs.sh && echo "in a copy" && echo made >"$OUT/made.txt"')
    assert started.returncode == 0, started.stderr
    waited = jobs(tmp_path, "wait", "30", "one")
    assert waited.returncode == 0, waited.stdout + waited.stderr
    assert "== one: exit 0" in waited.stdout and "in a copy" in waited.stdout
    assert not (tmp_path / "jobs" / "one" / "repo" / ".git").exists()
    out = tmp_path / "out"
    out.mkdir()
    collected = jobs(tmp_path, "collect", "one", out=out)
    assert collected.returncode == 0, collected.stderr
    assert (out / "one--made.txt").read_text() == "made\n"
    assert "in a copy" in (out / "one--log.txt").read_text()


def test_the_snapshot_leaves_release_pieces_and_venvs_out_but_takes_a_carried_py_spy_wheel(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    (repo / "tools" / "device_jobs.sh").write_text(SCRIPT.read_text())
    for piece in ("pyspy/py_spy-0.4.3-py2.py3-none-manylinux1_x86_64.whl", "torch2.15.0.part00"):
        (repo / ".device-torch" / piece).parent.mkdir(parents=True, exist_ok=True)
        (repo / ".device-torch" / piece).write_text("x")
    # CI's venvs live inside the clone; a snapshot of one filled CI's disk.
    (repo / ".venv-2.14" / "lib").mkdir(parents=True)
    (repo / ".venv-2.14" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (repo / ".venv-2.14" / "lib" / "torch_in_venv.so").write_text("x")
    (repo / "venv_named_source").mkdir()
    (repo / "venv_named_source" / "kept.py").write_text("x")
    env = {**os.environ, "DEVICE_JOBS": str(tmp_path / "jobs")}
    run = lambda *args: subprocess.run(["bash", str(repo / "tools" / "device_jobs.sh"), *args], capture_output=True,
                                       text=True, env=env, timeout=60)
    assert run("start", "ls", "--", "bash", "-c", "ls -aR").returncode == 0
    assert run("wait", "30", "ls").returncode == 0
    listed = (tmp_path / "jobs" / "ls" / "log").read_text()
    assert "py_spy-0.4.3" in listed and "torch2.15.0.part00" not in listed
    assert "kept.py" in listed and ".venv-2.14" not in listed and "torch_in_venv.so" not in listed


def test_wait_reports_a_failed_job_and_one_still_running(tmp_path):
    assert jobs(tmp_path, "start", "fails", "--", "bash", "-c", "exit 4").returncode == 0
    assert jobs(tmp_path, "start", "sleeps", "--", "sleep", "30").returncode == 0
    failed = jobs(tmp_path, "wait", "20", "fails")
    assert failed.returncode == 1 and "== fails: exit 4" in failed.stdout
    running = jobs(tmp_path, "wait", "1", "sleeps")
    assert running.returncode == 3 and "== sleeps: running" in running.stdout
    pid = int((tmp_path / "jobs" / "sleeps" / "pid").read_text())
    os.kill(pid, 15)


@pytest.mark.parametrize("args, message", [
    (("start", "a b", "--", "true"), "name the job in letters"),
    (("start", "x", "--torch", "0.0.1", "--", "true"), "torch 0.0.1 is not installed here"),
    (("start", "x", "true"), "usage:"),
    (("wait", "5", "nobody"), "no job named 'nobody'"),
    (("wait", "soon"), "wait takes the most seconds"),
    (("collect",), "\\$OUT, which is unset"),
])
def test_bad_calls_say_what_to_do_and_exit_2(tmp_path, args, message):
    done = jobs(tmp_path, *args)
    assert done.returncode == 2
    assert message.replace("\\", "") in done.stderr
