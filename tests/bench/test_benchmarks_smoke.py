"""The benchmark scripts run end to end in their CPU reduced form (numbers are not checked).

Both scripts start together, each in its own subprocess (each uses one intra-op thread per
process), to stay within CI time on two cores.
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def _require_trainer():
    """Fail the calling test when the DFlash benchmarks cannot import the trainer they measure."""
    try:
        for name in ("examples.dflash_trainer.train", "examples.dflash_trainer.assets.assets", "transformers", "tokenizers"):
            importlib.import_module(name)
    except Exception as exc:
        pytest.fail(f"the DFlash benchmarks cannot import their trainer modules: {type(exc).__name__}: {exc}")


def _env():
    path = [str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), CUDA_VISIBLE_DEVICES="", TOKENIZERS_PARALLELISM="false")


def _start(module, out_dir, *extra):
    return subprocess.Popen([sys.executable, "-m", f"benchmarks.{module}", "--quick", *extra, "--out-dir", str(out_dir)],
                            cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both scripts, started at once; each test waits for its own."""
    base = tmp_path_factory.mktemp("bench")
    procs = {"replay": (_start("replay_step_time", base / "replay"), base / "replay"),
             # A random-init target of the tiny shape on the tiny assets' tokenizer: the --target-shape path.
             # With the processes pipeline: 2 gloo ranks under torchrun.
             "dflash": (_start("dflash_throughput", base / "dflash", "--target-shape", "tiny", "--processes", "2"),
                        base / "dflash")}
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _finish(proc, timeout=240):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"{proc.args[2]} did not finish in {timeout} s:\n{err[-3000:]}")
    assert proc.returncode == 0, f"{proc.args[2]} exited {proc.returncode}:\n{err[-3000:]}"
    return out


def _one(out_dir, pattern):
    found = sorted(out_dir.glob(pattern))
    assert len(found) == 1, f"expected one {pattern} in {out_dir}, found {[p.name for p in found]}"
    return found[0]


def test_replay_step_time_quick(runs):
    proc, out_dir = runs["replay"]
    stdout = _finish(proc)
    assert "| configuration | figure |" in stdout and "| train, eager | 1 worker thread " in stdout  # render.figures
    rows = json.loads(_one(out_dir, "replay-small_cpu_torch*_????-??-??.json").read_text())["rows"]
    assert not [r for r in rows if r.get("error")], rows
    measured = [r for r in rows if r.get("p50_ms") is not None]
    for task in ("train", "infer"):
        assert {r["mode"] for r in measured if r["task"] == task} >= {"eager", "compile"}
        assert {r["placement"] for r in measured if r["task"] == task} >= {"main", "worker", "shared"}
    assert "workers on one CPU" in stdout and "GPU" not in stdout  # a CPU run's figures name its device
    assert [p.suffix for p in out_dir.iterdir()] == [".json"]  # the JSON is the whole record: no per-run report


def test_dflash_throughput_quick(runs):
    _require_trainer()
    procs = runs
    proc, out_dir = procs["dflash"]
    stdout = _finish(proc)
    data = json.loads(_one(out_dir, "dflash-throughput-tiny-eager_cpu_torch*.json").read_text())
    assert (data["shape"], data["graphs"]) == ("tiny", "eager") and data["target_params"] > 0
    for name in ("threaded", "sequential"):
        assert "error" not in data[name], data[name]
        assert data[name]["tokens_per_s"] > 0
    windows = data["threaded"]["windows_tokens_per_s"]
    assert len(windows) == 3 and data["threaded"]["steady_windows"] == 1
    assert data["threaded"]["thread_profile"] is None and data["threaded"]["profiled_windows"] == []  # GPU only
    assert data["tokens_per_s_threaded"] == windows[1] and data["tokens_per_s_last_window_threaded"] == windows[-1]
    # --quick's 30 steps leave one steady window: too few for a ratio, and the run says so
    assert data["ratio"] is None and data["ratio_withheld"].startswith("no ratio: the threaded cell 1 steady window")
    assert 0 < data["startup_s_threaded"] < data["seconds"] and 0 < data["startup_s_sequential"] < data["seconds"]
    seq = data["sequential"]
    assert data["host_gil_ms_per_batch"] > 0 and seq["host_probe_rounds"] == 5
    assert seq["host_probe_batches"] == 5 * seq["batches_per_round"] == 5 * data["config"]["drafters"]
    assert data["gpu_bound_tokens_per_s"] is None and "no CUDA" in data["gpu_bound_reason"]
    assert data["projected_gpus_per_process"] is None and data["ratio_threaded_to_gpu_bound"] is None
    # peak memory: each cell's own process (its resident set on a CPU), beside the trainer's estimate
    for name in ("threaded", "sequential"):
        assert list(data[name]["peak_memory_gib"]) == ["cpu"]
        assert data[f"peak_memory_gib_{name}"] == data[name]["peak_memory_gib"]["cpu"] > 0.05
    parts = data["memory_estimate_gib_by_part"]
    assert set(parts) == {"weights", "drafter_training", "target_forward", "hand_off", "drafter_step"}
    assert data["memory_estimate_gib"] == pytest.approx(sum(parts.values())) and parts["weights"] > 0
    assert "| tiny target, eager, 1 CPU | threaded " in stdout and ": -x (no ratio: the threaded cell 1 steady" in stdout
    assert [p.suffix for p in out_dir.iterdir()] == [".json"]
    ranks = data["processes"]
    assert "error" not in ranks and ranks["processes"] == 2 and ranks["devices"] == ["cpu", "cpu"], ranks
    assert ranks["timed_batches"] + ranks["warmup_batches"] == data["config"]["max_steps"] * data["config"]["drafters"]
    # the ranks train on different batches, so only the gradient average over them keeps their weights equal
    assert ranks["ranks_weights_max_diff"] == 0.0 and ranks["tokens_per_s"] > 0
    assert data["ratio_threaded_to_processes"] is None  # withheld with the ratio


def test_the_written_results_hold_no_absolute_path(runs):
    """The target's cache, the trainer's out-dir and the like are written relative to the repository
    or as their last part (results_schema.write)."""
    from benchmarks.results_schema import ABSOLUTE_PATH

    for proc, out_dir in runs.values():
        _finish(proc)
        written = [p for p in out_dir.iterdir() if p.suffix == ".json"]
        assert written
        assert {p.name: ABSOLUTE_PATH.findall(p.read_text()) for p in written} == {p.name: [] for p in written}


def test_a_run_without_out_dir_writes_to_the_scratch_folder(tmp_path, monkeypatch):
    from benchmarks import common

    monkeypatch.chdir(tmp_path)
    assert common.results_dir(None).resolve() == tmp_path / "bench-out" and (tmp_path / "bench-out").is_dir()
    assert common.results_dir(str(tmp_path / "mine")) == tmp_path / "mine"


def test_gil_profile_quick(runs, tmp_path):
    _require_trainer()
    procs = runs
    for proc, _ in procs.values():  # after the other two: two cores
        proc.wait(timeout=300)
    cmd = [sys.executable, "-m", "benchmarks.gil_profile", "--quick", "--steps", "200", "--start-step", "30",
           "--seconds", "3", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    if proc.returncode != 0 and any(s in proc.stderr.lower() for s in ("permission denied", "operation not permitted", "py-spy not found")):
        pytest.skip(f"py-spy cannot sample here: {proc.stderr.strip().splitlines()[-1][:200]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(_one(tmp_path, "gil-profile_cpu_torch*.json").read_text())
    assert 0 < data["gil_busy"] <= 1.05
    where = {(r["thread"], r["stage"].rsplit(".", 1)[-1]) for r in data["stages"]}  # py-spy may add the class
    assert ("drafter", "forward_backward") in where and ("target", "forward") in where, where
    assert _one(tmp_path, "gil-profile_cpu_torch*_gil.txt").stat().st_size > 0


def test_replay_step_time_keeps_measured_cells_when_interrupted(tmp_path, monkeypatch):
    """A timeout (SIGTERM -> SystemExit) mid-run writes the cells already measured, marked interrupted."""
    replay = importlib.import_module("benchmarks.replay_step_time")
    calls = []

    def fake_cell(args, mode, key, label, workers, task):
        if calls:
            raise SystemExit(143)
        calls.append(key)
        return {"task": task, "placement": key, "configuration": label, "mode": mode, "workers": workers,
                "p50_ms": 1.0, "p90_ms": 2.0, "steps_per_s": 1000.0}

    monkeypatch.setattr(replay, "run_cell_subprocess", fake_cell)
    monkeypatch.setattr(replay.common, "on_gpu", lambda: False)
    with pytest.raises(SystemExit):
        replay.main(["--tasks", "train", "--modes", "eager", "--out-dir", str(tmp_path)])
    data = json.loads(_one(tmp_path, "*.json").read_text())
    assert data["interrupted"] is True
    assert [(r["placement"], r["p50_ms"]) for r in data["rows"]] == [("main", 1.0)]


def test_replay_step_time_gil_profile(runs, tmp_path):
    """--gil-profile records the thread cells with py-spy: GIL-busy and the frames and files holding the GIL."""
    for proc, _ in runs.values():  # after the other scripts: two cores
        proc.wait(timeout=300)
    cmd = [sys.executable, "-m", "benchmarks.replay_step_time", "--quick", "--tasks", "train", "--modes",
           "eager", "--placements", "main,worker", "--gil-profile", "2", "--out-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    if any(s in proc.stderr.lower() for s in ("permission denied", "operation not permitted", "needs py-spy")):
        pytest.skip(f"py-spy cannot sample here: {proc.stderr.strip().splitlines()[-1][:200]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["placement"]: r for r in json.loads(_one(tmp_path, "replay-small-gil_cpu_torch*.json").read_text())["rows"]}
    assert "gil_busy" not in rows["main"]  # the main thread alone is not recorded
    worker = rows["worker"]
    assert not worker.get("error"), worker
    assert 0 < worker["gil_busy"] <= 1.05 and worker["gil_samples"] > 0, worker
    shares = [share for _, share in worker["gil_files"]]  # the commonest files' shares of the GIL samples
    assert worker["gil_leaves"] and shares == sorted(shares, reverse=True) and all(0 < s <= 1 for s in shares)
    assert sum(shares) <= 1 + 1e-9, shares
    assert f"GIL busy {worker['gil_busy']:.0%}" in proc.stdout  # the figures it prints: the index's words


def test_replay_step_time_merges_rows_of_an_earlier_day(tmp_path, monkeypatch):
    """--merge-from keeps the earlier file's cells not measured again, each row with its own date."""
    replay = importlib.import_module("benchmarks.replay_step_time")

    def row(placement, mode, p50, **extra):
        return {"task": "train", "placement": placement, "configuration": placement, "mode": mode, "workers": 1,
                "p50_ms": p50, "steps_per_s": 1e3 / p50, **extra}

    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps({"env": {"date": "2000-01-01"}, "rows": [row("main", "eager", 9.0),
                                                                           row("worker", "eager", 8.0)]}))
    monkeypatch.setattr(replay, "run_cell_subprocess", lambda args, mode, key, label, workers, task: row(key, mode, 1.0))
    monkeypatch.setattr(replay.common, "on_gpu", lambda: False)
    replay.main(["--tasks", "train", "--modes", "eager", "--placements", "main", "--merge-from", str(earlier),
                 "--out-dir", str(tmp_path / "out")])
    rows = json.loads(_one(tmp_path / "out", "*.json").read_text())["rows"]
    today = replay.common.environment()["date"]
    assert [(r["placement"], r["p50_ms"], r["date"]) for r in rows] == [("main", 1.0, today), ("worker", 8.0, "2000-01-01")]
    with pytest.raises(SystemExit):  # argparse's error: no such file
        replay.main(["--merge-from", str(tmp_path / "missing.json"), "--out-dir", str(tmp_path / "out")])
    earlier.write_text("{not json")
    with pytest.raises(SystemExit, match="not a replay_step_time results JSON"):
        replay.main(["--tasks", "train", "--modes", "eager", "--placements", "main", "--merge-from", str(earlier),
                     "--out-dir", str(tmp_path / "out")])


def test_pyspy_summaries_from_raw_recordings(tmp_path):
    """GIL-busy = GIL samples / the busiest thread's wall samples; shares by innermost frame and file."""
    pyspy = importlib.import_module("benchmarks.pyspy")
    gil = tmp_path / "gil.txt"
    gil.write_text("thread (0x1): bench-0;run (threading.py:10);step (/r/b/replay.py:5) 30\n"
                   "thread (0x2): bench-1;run (threading.py:10);call (/tmp/torchinductor_u/x/abcdefghij.py:7) 10\n")
    wall = tmp_path / "wall.txt"
    wall.write_text("thread (0x1): bench-0;run (threading.py:10) 80\nthread (0x2): bench-1;run (threading.py:10) 79\n")
    samples = pyspy.read_samples(gil)
    assert samples[0] == ("bench-0", ["run (threading.py:10)", "step (/r/b/replay.py:5)"], 30)
    assert pyspy.gil_busy(samples, pyspy.read_samples(wall)) == (0.5, 40, 80)
    assert pyspy.top_shares(samples, lambda f: pyspy.frame_file(f[-1]), 5) == [("b/replay.py", 0.75),
                                                                                ("inductor-generated abcdefgh", 0.25)]
    assert pyspy.gil_busy([], []) == (None, 0, 0)


def test_gil_profile_keys_samples_by_what_the_worker_step_called():
    _require_trainer()
    gil_profile = importlib.import_module("benchmarks.gil_profile")
    outer = ["_bootstrap (/usr/lib/threading.py:1002)", "run (/r/src/threadgraph/_workers/worker.py:150)",
             "_loop (/r/src/threadgraph/_workers/worker.py:185)", "DrafterWorker.step (/r/examples/dflash_trainer/workers.py:70)"]
    # The optimizer's step() inside the replica's update is not the worker's step.
    assert gil_profile.step_stage(outer + ["DrafterReplica.update (/r/replica.py:60)", "step (/t/adamw.py:9)"]) \
        == "DrafterReplica.update"
    assert gil_profile.step_stage(outer[:3] + ["step (workers.py:41)", "forward (target_stage.py:28)"]) == "forward"
    # Through the trainer's step functions, to the component's method they called.
    train_step = "DrafterReplica.train_step (/r/replica.py:70)"
    update = ["DrafterReplica.update (/r/replica.py:60)", "step (/t/adamw.py:9)"]
    assert gil_profile.step_stage(outer + [train_step] + update) == "DrafterReplica.update"
    assert gil_profile.step_stage(outer + [train_step, "GradientAverager.average (/r/routing.py:99)"]) \
        == "GradientAverager.average"
    assert gil_profile.step_stage(outer + [train_step]) == "DrafterReplica.train_step"
    assert gil_profile.step_stage(outer[:3] + ["step (workers.py:45)", "step (target_stage.py:30)",
                                               "forward (target_stage.py:44)"]) == "forward"
    assert gil_profile.step_stage(outer) == "(step itself)"
    assert gil_profile.step_stage(outer[:3]) == "(outside step) _loop"


@pytest.mark.parametrize("script, argv, message", [
    ("replay_step_time", ["--modes", "eager,bogus"], "unknown modes ['bogus']"),
    ("replay_step_time", ["--placements", "per_gpu"], "unknown placements ['per_gpu']"),
    ("replay_step_time", ["--gil-profile", "-1"], "seconds >= 0"),
    ("dflash_throughput", ["--devices", "cuda:7"], "--devices cuda:7"),
    ("dflash_throughput", ["--devices", "tpu"], "--devices tpu"),
])
def test_benchmark_bad_arguments_fail_before_any_work(script, argv, message, capsys, monkeypatch):
    if script == "dflash_throughput":
        _require_trainer()
    module = importlib.import_module(f"benchmarks.{script}")
    monkeypatch.setattr(module.common, "on_gpu", lambda: False)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_info:
        module.parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_dflash_throughput_refuses_a_processes_pipeline_of_one_rank():
    proc = subprocess.run([sys.executable, "-m", "benchmarks.dflash_throughput", "--quick", "--processes", "1"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--processes 1: give one process per device of --devices cpu, at least 2 (on a CPU" in proc.stderr, proc.stderr


def test_dflash_throughput_refuses_a_shape_with_no_room_to_build(tmp_path, capsys, monkeypatch):
    _require_trainer()
    module = importlib.import_module("benchmarks.dflash_throughput")
    from examples.dflash_trainer.assets import shapes

    monkeypatch.setenv("THREADGRAPH_CACHE", str(tmp_path / "cache"))  # nothing built there yet
    monkeypatch.setattr(shapes.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 0})())
    assert module.main(["--quick", "--target-shape", "tiny", "--out-dir", str(tmp_path / "out")]) == 2
    assert "error: target shape tiny: its 0.0 GiB of weights do not fit on the disk of" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_call_overhead_quick(tmp_path, monkeypatch, clean_patches):
    from benchmarks import call_overhead

    # Two patches keep it to four compiled copies: no patches, both, each alone.
    monkeypatch.setattr(call_overhead, "applying", lambda: ["first_call_in_turn", "worker_generation_bump"])
    assert call_overhead.main(["--reps", "2", "--calls", "40", "--out-dir", str(tmp_path)]) == 0
    data = json.loads(next(tmp_path.glob("call-overhead_*.json")).read_text())
    rows = {row["variant"]: row for row in data["rows"]}
    assert set(rows) == {"none", "all", "only first_call_in_turn", "only worker_generation_bump"}
    assert rows["none"]["over_none_us"] == 0 and rows["none"]["ratio_to_none"] == 1
    assert all(row["per_call_us"] > 0 for row in rows.values())
