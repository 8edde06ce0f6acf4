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
])
def test_a_bad_part_is_one_line_and_exit_2(tmp_path, args, message):
    env = {**os.environ, "EVIDENCE_LOGS": str(tmp_path / "logs")}
    proc = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.count("\n") == 1 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "logs").exists()
