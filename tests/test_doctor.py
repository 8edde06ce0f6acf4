import json
import subprocess
import sys

import pytest
import torch


def doctor(*args):
    return subprocess.run([sys.executable, "-m", "threadgraph", "doctor", *args], capture_output=True, text=True, timeout=300)


def test_doctor_reports_versions_hazards_and_patches():
    proc = doctor("--json")
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout)
    assert info["torch"] == torch.__version__
    names = {p["name"] for p in info["patches"]}
    assert {"lazy_tls", "worker_generation", "worker_cudagraphify", "gate_record"} <= names
    assert any("tls_assert" in h for h in info["hazards"])


def test_doctor_text_output_names_every_patch():
    proc = doctor()
    assert proc.returncode == 0
    assert "worker_mark_step" in proc.stdout and "hazards" in proc.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_selftest_without_gpu_says_so_and_exits_2():
    proc = doctor("--selftest")
    assert proc.returncode == 2
    assert "needs a CUDA GPU" in proc.stdout


def test_selftest_flag_is_documented():
    assert "--selftest" in doctor("--help").stdout
