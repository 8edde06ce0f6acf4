"""benchmarks/doctor_selftest.py: a doctor's selftest, printed as text or JSON, becomes a results
file named by GPU, torch and date; a report without a GPU's selftest is refused with exit 2."""

import importlib
import json
import sys
from pathlib import Path

import pytest

from threadgraph.__main__ import selftest_line

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as the script runs
selftest = importlib.import_module("doctor_selftest")
headlines = importlib.import_module("headlines")

TRAIN = {"check": "train in a worker thread, reduce-overhead", "passed": True, "p50_ms": 1.392, "p90_ms": 1.643,
         "captures": 3}
BROKEN = {"check": "infer", "passed": False, "error": "RuntimeError: capture failed"}


def text_report(*checks) -> str:
    return "\n".join(["python 3.12.3, torch 2.15.0+cu132 (CUDA build: 13.2)", "GPUs: NVIDIA H200", "",
                      "hazards ([x] present): ...", *map(selftest_line, checks)]) + "\n"


def test_a_text_report_becomes_the_days_file_with_each_check(tmp_path, capsys):
    report = tmp_path / "selftest.log"
    report.write_text(text_report(TRAIN))
    assert selftest.main(["--report", str(report), "--date", "2026-12-04", "--out-dir", str(tmp_path)]) == 0
    path = tmp_path / "doctor-selftest_nvidia-h200_torch2.15.0_2026-12-04.json"
    data = json.loads(path.read_text())
    assert (data["torch_build"], data["cuda_build"], data["gpus"]) == ("2.15.0+cu132", "13.2", ["NVIDIA H200"])
    assert data["checks"] == [TRAIN]
    assert "| PASS | train in a worker thread, reduce-overhead | 1.392 | 1.643 | 3 |" in path.with_suffix(".md").read_text()
    assert headlines.doctor_selftest(data) == [("doctor --selftest: train in a worker thread, reduce-overhead",
                                                "PASS, step p50 1.392 ms")]
    assert "| PASS | train in a worker thread, reduce-overhead | 1.392 |" in capsys.readouterr().out


def test_a_failed_check_is_kept_and_the_exit_status_says_so(tmp_path):
    report = tmp_path / "doctor.json"
    report.write_text(json.dumps({"python": "3.12.3", "torch": "2.14.1+cu130", "cuda_build": "13.0",
                                  "gpus": ["NVIDIA H200"], "selftest": [TRAIN, BROKEN]}))
    assert selftest.main(["--report", str(report), "--date", "2026-12-03", "--out-dir", str(tmp_path)]) == 1
    data = json.loads((tmp_path / "doctor-selftest_nvidia-h200_torch2.14.1_2026-12-03.json").read_text())
    assert data["checks"][1] == {"check": "infer", "passed": False, "error": "RuntimeError: capture failed"}


def test_the_text_and_json_forms_of_one_report_record_the_same(tmp_path):
    info = {"python": "3.12.3", "torch": "2.15.0+cu132", "cuda_build": "13.2", "gpus": ["NVIDIA H200"],
            "selftest": [TRAIN]}
    assert selftest.record(selftest.parse(json.dumps(info)), "2026-12-04") \
        == selftest.record(selftest.parse(text_report(TRAIN)), "2026-12-04")
    failed = info | {"selftest": [TRAIN, BROKEN]}
    assert selftest.record(selftest.parse(json.dumps(failed)), "2026-12-04") \
        == selftest.record(selftest.parse(text_report(TRAIN, BROKEN)), "2026-12-04")


@pytest.mark.parametrize("text, message", [
    ("python 3.12.3, torch 2.15.0+cpu (CUDA build: None)\n\nthreadgraph doctor --selftest needs a CUDA GPU\n",
     "no 'python X, torch Y (CUDA build: Z)' line and 'selftest PASS|FAIL: ...' lines"),
    (json.dumps({"torch": "2.15.0+cpu", "gpus": [], "selftest": "threadgraph doctor --selftest needs a CUDA GPU"}),
     "a doctor JSON report without a GPU's selftest"),
    (json.dumps({"torch": "2.15.0+cu132", "gpus": ["NVIDIA H200"], "selftest": []}),
     "a doctor JSON report without a GPU's selftest"),
])
def test_a_report_without_a_gpus_selftest_is_refused_with_exit_2(tmp_path, capsys, text, message):
    report = tmp_path / "report"
    report.write_text(text)
    assert selftest.main(["--report", str(report), "--out-dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.glob("doctor-selftest_*"))


def test_a_missing_report_or_a_bad_date_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        selftest.main(["--report", str(tmp_path / "absent.log")])
    assert exc.value.code == 2 and "no such file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        selftest.main(["--date", "4 Dec"])
    assert exc.value.code == 2 and "give it as YYYY-MM-DD" in capsys.readouterr().err
