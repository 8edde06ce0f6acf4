"""benchmarks/gpu_scenarios_results.py: the GPU tests' scenario records (tests/helpers/gpu_process.py, with
THREADGRAPH_GPU_LOG) become a phase of the day's gpu-scenarios results file and its index
headlines; failures are kept, not dropped; a folder of no records or of two runs is refused."""

import json
import os
from pathlib import Path

import pytest
import torch

from tests.helpers import gpu_process
from benchmarks import gpu_scenarios_results as collector
from benchmarks import headlines

NOON = 1764590400  # 2025-12-01 12:00 UTC
MANY = {"together_steps_per_s": 1600.0, "eager_steps_per_s": 150.0, "losses_allclose": [True] * 8,
        "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "seconds": 40.0}


def record(folder: Path, tag: str, args: list, rc: int = 0, result=None, when: float = NOON, machine=None) -> None:
    path = folder / f"{tag}.json"
    path.write_text(json.dumps({"tag": tag, "args": args, "rc": rc, "seconds": 3.0, "result": result,
                                "last_stderr_line": None if rc == 0 else "RuntimeError: capture failed",
                                **({"machine": machine} if machine else {})}))
    os.utime(path, (when, when))


def suite(folder: Path) -> Path:
    folder.mkdir()
    record(folder, "many_workers_8_steps_200", ["-m", "tests.helpers.gpu_scenarios", "many", "--workers", "8", "--steps", "200"],
           result=MANY)
    record(folder, "whole_step_steps_200", ["-m", "tests.helpers.gpu_scenarios", "whole_step", "--steps", "200"], rc=1)
    record(folder, "repro_123177_threads_32", ["-m", "tests.library.gpu_fence_scenarios", "repro_123177", "--threads", "32"],
           result={"gpu": "NVIDIA H200", "torch": "2.12.0"})  # the fence's own benchmark keeps these
    (folder / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="tests.library.test_gpu" name="test_many"/>'
        '<testcase classname="tests.library.test_gpu" name="test_whole_step"><failure message="exit 1&#10;  Loading weights"/></testcase>'
        '</testsuite></testsuites>')
    return folder


def test_run_json_keeps_a_record_of_each_run_beside_its_log(tmp_path, monkeypatch):
    monkeypatch.setenv("THREADGRAPH_GPU_LOG", str(tmp_path))
    assert gpu_process.run_json("ok", ["-c", "print('{\"gpu\": \"G\"}')"]) == {"gpu": "G"}
    with pytest.raises(AssertionError, match=r"bad exited 3 \(without printing its result\)"):
        gpu_process.run_json("bad", ["-c", "import sys; sys.stderr.write('boom\\n'); sys.exit(3)"])
    ok, bad = (json.loads((tmp_path / f"{tag}.json").read_text()) for tag in ("ok", "bad"))
    assert (ok["rc"], ok["result"], ok["args"]) == (0, {"gpu": "G"}, ["-c", "print('{\"gpu\": \"G\"}')"])
    assert (bad["rc"], bad["result"], bad["last_stderr_line"]) == (3, None, "boom")
    assert (tmp_path / "bad.log").read_text().startswith("rc=3 ")


def test_a_run_becomes_a_phase_of_its_days_file_with_failures_and_test_outcomes(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    path = collector.collect(suite(tmp_path / "log"), "suite", out)
    assert path.name == "gpu-scenarios_nvidia-h200_torch2.11.0_2025-12-01.json"
    data = json.loads(path.read_text())
    assert list(data) == ["suite (12:00 UTC)"]
    phase = data["suite (12:00 UTC)"]
    assert sorted(phase) == ["many_workers_8_steps_200", "pytest_outcomes", "whole_step_steps_200"]
    assert phase["many_workers_8_steps_200"] == MANY
    assert phase["whole_step_steps_200"] == {"error": "exit 1: RuntimeError: capture failed", "seconds": 3.0}
    assert phase["pytest_outcomes"] == {"tests.library.test_gpu::test_many": "passed",
                                        "tests.library.test_gpu::test_whole_step": "failure: exit 1 Loading weights"}
    assert headlines.gpu_scenarios(data) == [
        ("8 training workers on one GPU, 200 steps (suite)", "1600 steps/s against 150 for eager threads; 8 of 8 equal to alone"),
        ("one worker, step p50 (suite)", "failed: exit 1: RuntimeError: capture failed")]
    assert [p.name for p in out.iterdir()] == [path.name]  # the JSON only


def test_a_second_run_adds_a_phase_and_a_label_it_has_is_refused(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    log = suite(tmp_path / "log")
    collector.collect(log, "suite", out)
    with pytest.raises(SystemExit, match="already has a phase 'suite': give another --label"):
        collector.collect(log, "suite", out)
    path = collector.collect(log, "recheck", out)
    assert list(json.loads(path.read_text())) == ["suite (12:00 UTC)", "recheck (12:00 UTC)"]


def test_folders_of_no_records_corrupt_records_or_two_runs_are_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(collector.NoRecords, match="no records of tests.helpers.gpu_scenarios or examples.dflash_trainer runs"):
        collector.collect(empty, "suite", tmp_path)
    two = suite(tmp_path / "two")
    other = dict(MANY, torch="2.12.0+cu130")
    record(two, "many_workers_3_steps_200", ["-m", "tests.helpers.gpu_scenarios", "many", "--workers", "3"], result=other)
    with pytest.raises(SystemExit, match="the records name 2 GPU / torch pairs"):
        collector.collect(two, "suite", tmp_path)
    (two / "broken.json").write_text("{")
    with pytest.raises(SystemExit, match="broken.json: not a scenario record"):
        collector.collect(two, "suite", tmp_path)
    with pytest.raises(SystemExit) as exit_:
        collector.main([str(tmp_path / "missing")])
    assert exit_.value.code == 2 and "no such folder" in capsys.readouterr().err


TRAINER_RUN = {"mode": "whole-step", "placement": "targets on cuda:0", "total_steps": 30, "losses": [7.4, 3.66],
               "tokens_per_s_steady": 900000.0, "startup_s": 50.0, "build_s": 10.0, "workers": {"target-0": {}},
               "target_report": {"versions": {"torch": "2.14.1+cu130", "python": "3.12.3"}, "bytes": {}}}


def test_a_trainer_record_without_its_machine_is_refused_and_a_run_keeps_its_main_figures(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    args = ["-m", "examples.dflash_trainer", "--cuda-graphs", "whole-step"]
    record(log, "dflash_modes_whole-step", args, result=TRAINER_RUN)
    record(log, "dflash_modes_trees", ["-m", "examples.dflash_trainer", "--cuda-graphs", "trees"], rc=1)
    with pytest.raises(SystemExit, match="dflash_modes_whole-step: a trainer run whose record names no GPU"):
        collector.collect(log, "modes", tmp_path)
    record(log, "dflash_modes_whole-step", args, result=TRAINER_RUN, machine={"torch": "2.14.1+cu130", "gpu": "NVIDIA H200"})
    path = collector.collect(log, "modes", tmp_path)
    assert path.name == "gpu-scenarios_nvidia-h200_torch2.14.1_2025-12-01.json"
    phase = json.loads(path.read_text())["modes (12:00 UTC)"]
    assert phase["dflash_modes_whole-step"] == {
        "mode": "whole-step", "placement": "targets on cuda:0", "total_steps": 30, "losses": [7.4, 3.66],
        "tokens_per_s_steady": 900000.0, "startup_s": 50.0, "build_s": 10.0, "seconds": 3.0,
        "versions": {"torch": "2.14.1+cu130", "python": "3.12.3"}}
    assert phase["dflash_modes_trees"]["error"] == "exit 1: RuntimeError: capture failed"


def test_a_trainer_record_names_its_machine_and_a_run_without_a_steady_figure_keeps_none(tmp_path):
    log = tmp_path / "log"
    log.mkdir()
    short = {k: v for k, v in TRAINER_RUN.items() if k != "tokens_per_s_steady"}  # the trainer leaves it out
    record(log, "dflash_short", ["-m", "examples.dflash_trainer"], result=short,
           machine={"torch": "2.15.0+cu132", "gpu": "NVIDIA H200"})
    path = collector.collect(log, "short", tmp_path)
    assert path.name == "gpu-scenarios_nvidia-h200_torch2.15.0_2025-12-01.json"
    run = json.loads(path.read_text())["short (12:00 UTC)"]["dflash_short"]
    assert run["tokens_per_s_steady"] is None and run["losses"] == [7.4, 3.66] and run["startup_s"] == 50.0


def test_run_json_records_the_machine_and_the_trainers_error_line(tmp_path, monkeypatch):
    monkeypatch.setenv("THREADGRAPH_GPU_LOG", str(tmp_path))
    script = "import sys; sys.stderr.write('error: target-4 failed: X\\n  pass fallback\\n'); sys.exit(1)"
    with pytest.raises(AssertionError):
        gpu_process.run_json("trainer", ["-c", script])
    written = json.loads((tmp_path / "trainer.json").read_text())
    assert written["last_stderr_line"] == "error: target-4 failed: X"
    assert written["machine"]["torch"] == torch.__version__


def test_an_interrupted_run_says_so_and_its_empty_cases_are_no_tests(tmp_path):
    log = suite(tmp_path / "log")
    (log / "junit.xml").write_text(
        '<testsuites><testsuite errors="1"><testcase classname="tests.library.test_gpu" name="test_many"/>'
        '<testcase time="0.000" /><testcase time="0.000" />'
        '<testcase classname="pytest" name="internal"><error message="internal error">KeyboardInterrupt</error></testcase>'
        '</testsuite></testsuites>')
    out = tmp_path / "results"
    out.mkdir()
    path = collector.collect(log, "suite", out)
    phase = json.loads(path.read_text())["suite (12:00 UTC)"]
    assert phase["pytest_outcomes"] == {"tests.library.test_gpu::test_many": "passed",
                                        "pytest::internal": "error: internal error"}
    complete = json.loads(collector.collect(suite(tmp_path / "log2"), "recheck", out).read_text())
    assert [collector.INTERRUPTED in phase[collector.OUTCOMES] for phase in complete.values()] == [True, False]


def test_a_run_interrupted_without_xdist_leaves_only_nameless_cases_and_says_so_too(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="tests.library.test_gpu" name="test_many"/>'
                     '<testcase time="0.0"/></testsuite></testsuites>')
    assert collector.outcomes(junit) == {"tests.library.test_gpu::test_many": "passed",
                                         "pytest::internal": "error: the run was interrupted (a test case without a name)"}
