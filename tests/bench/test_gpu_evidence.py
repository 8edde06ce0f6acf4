"""tools/gpu_evidence.sh: a part that is not one, or the tests part without its list, is one line and
exit 2, and leaves no log folder behind."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_evidence.sh"

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="a bash tool for the Linux GPU machine")


@pytest.mark.parametrize("args, message", [
    ([], "error: name a part: check, suite, slow, tests, conformance"),
    (["bogus"], "error: unknown part 'bogus'; name one of check, suite"),
    (["or"], "error: unknown part 'or'"),
    (["tests"], "error: name a file of test node ids, one a line (python -m benchmarks gpu-scenarios --unreached"),
    (["tests", "/no/such/list"], "; /no/such/list is missing or empty"),
    (["tests", "relative/list"], "; {cwd}/relative/list is missing or empty"),  # from where it was called
])
def test_a_bad_part_is_one_line_and_exit_2(tmp_path, args, message):
    env = {**os.environ, "EVIDENCE_LOGS": str(tmp_path / "logs")}
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and message.format(cwd=tmp_path) in proc.stderr, proc.stderr
    assert not (tmp_path / "logs").exists()


def test_the_gil_part_without_py_spy_or_its_wheel_says_how_to_get_it(tmp_path):
    repo = tmp_path / "repo"  # a copy of the script alone: no .device-torch/pyspy wheel beside it
    (repo / "tools").mkdir(parents=True)
    (repo / "tools" / "gpu_evidence.sh").write_text(SCRIPT.read_text())
    shims = tmp_path / "bin"  # a python3 with no py-spy beside it, and no py-spy on PATH
    shims.mkdir()
    (shims / "python3").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    (shims / "python3").chmod(0o755)
    env = {**os.environ, "EVIDENCE_LOGS": str(tmp_path / "logs"), "PATH": f"{shims}:/usr/bin:/bin"}
    assert subprocess.run(["bash", "-c", "command -v py-spy"], env=env).returncode == 1, "a py-spy on /usr/bin or /bin"
    proc = subprocess.run(["bash", str(repo / "tools" / "gpu_evidence.sh"), "gil"], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 2, proc
    assert proc.stderr.strip() == ("error: py-spy is not installed here: pip install py-spy, or carry its wheel "
                                   "in .device-torch/pyspy/")
    assert not (tmp_path / "logs").exists()
