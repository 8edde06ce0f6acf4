import json
import os
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
    hazards = {h["name"]: h for h in info["hazards"]}
    assert hazards["tls-assert"]["status"] in {"present", "absent"}  # detected, not assumed
    assert hazards["device-wide-capture"]["status"] == "assumed"
    assert hazards["global-generation"]["patches"] == [
        "worker_mark_step", "worker_generation", "worker_user_mark_step", "worker_generation_bump",
        "worker_run_only_generation", "worker_mark_step_reset"]
    assert info["newer_than_verified"] is False


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


def test_doctor_warns_once_on_a_torch_newer_than_the_newest_verified(monkeypatch):
    from threadgraph import _compat
    from threadgraph._diagnostics.doctor import format_report, report

    monkeypatch.setattr(torch, "__version__", "2.16.0.dev20270101+cu140")
    info = report()
    assert info["newer_than_verified"] is True
    warnings = [line for line in format_report(info).splitlines() if "newer than the newest release" in line]
    assert warnings == [
        "warning: torch 2.16.0.dev20270101+cu140 is newer than the newest release threadgraph was verified on "
        f"({'.'.join(map(str, _compat.NEWEST_VERIFIED))}); its patches may miss changed code: run the test suite"
    ]


@pytest.mark.parametrize("version, newer", [
    ("2.15.0+cu132", False), ("2.15.0", False), ("2.13.0+cpu", False), ("2.15.1", True),
    ("2.16.0a0+git1234", True), ("3.0.0", True), ("2.1.2", False),
])
def test_newer_than_verified_compares_the_release_numbers(version, newer):
    from threadgraph import _compat

    assert _compat.NEWEST_VERIFIED == (2, 15, 0)
    assert _compat.newer_than_verified(version) is newer


def test_a_failed_selftest_check_reports_its_last_stderr_line_as_text(monkeypatch):
    from threadgraph._diagnostics import selftest as _selftest

    outcomes = iter([subprocess.CompletedProcess([], 1, "", "Traceback ...\nRuntimeError: capture failed\n"),
                     subprocess.CompletedProcess([], -9, "", "")])
    monkeypatch.setattr(_selftest.subprocess, "run", lambda *a, **k: next(outcomes))
    assert _selftest.run_all() == [
        {"check": "train", "passed": False, "error": "RuntimeError: capture failed"},
        {"check": "infer", "passed": False, "error": "its process exited with -9 and wrote nothing on stderr"},
    ]


def test_doctor_into_a_pipe_nobody_reads_ends_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before doctor writes a line (``threadgraph doctor | head``)
    try:
        proc = subprocess.run([sys.executable, "-m", "threadgraph", "doctor"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=300)
    finally:
        os.close(write_end)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
