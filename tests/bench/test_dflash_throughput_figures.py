"""dflash-throughput's figures: no threaded / sequential ratio from fewer than three steady windows,
a pipeline above its GPU-bound limit flagged as impossible (in the results file and where the run
prints its figures), and a run the trainer refuses (its size check) writes no results file."""

import importlib
import json
from types import SimpleNamespace

import pytest

from benchmarks import headlines, results_schema

CFG = SimpleNamespace(batch_size=2, seq_len=1024)


def throughput():
    return importlib.import_module("benchmarks.dflash_throughput")


def cells(threaded_windows, sequential_windows, threaded=250_000.0, sequential=240_000.0, gpu_ms=10.0):
    """A threaded and a sequential cell as the cells write them, with that many steady windows."""
    t = {"tokens_per_s": threaded, "steady_windows": threaded_windows, "windows_tokens_per_s": [1.0] * (threaded_windows + 2)}
    s = {"tokens_per_s": sequential, "windows_tokens_per_s": [sequential] * sequential_windows,
         "gpu_ms_per_batch_by_device": {"0": gpu_ms}, "devices": ["cuda:0"], "host_ms_per_batch": 1.0,
         "compile_phases_s": {}, "training": results_schema.AS_THREADED}
    return t, s


def file_data(figures, t, s):
    """A results file's JSON around ``headline``'s figures, as main writes it."""
    return {"env": {"gpu": "NVIDIA H200"}, "args": {"cuda_graphs": "trees"}, "shape": "8b", "graphs": "trees",
            "threaded": t, "sequential": s, **figures}


@pytest.mark.parametrize("threaded_windows, sequential_windows", [(1, 8), (2, 8), (8, 1), (8, 2)])
def test_no_ratio_from_fewer_than_three_steady_windows_and_the_run_says_why(threaded_windows, sequential_windows):
    t, s = cells(threaded_windows, sequential_windows)
    figures = throughput().headline(CFG, t, s, on_gpu=True)
    assert figures["ratio"] is None
    short = "threaded" if threaded_windows < 3 else "sequential"
    count = min(threaded_windows, sequential_windows)
    assert figures["ratio_withheld"].startswith(f"no ratio: the {short} cell {count} steady window")
    assert "fewer than 3" in figures["ratio_withheld"] and "--steps 50" in figures["ratio_withheld"]
    ((_, figure),) = headlines.dflash_throughput(file_data(figures, t, s))
    assert ": -x (no ratio: " in figure


def test_three_steady_windows_on_each_side_give_the_ratio():
    t, s = cells(3, 3)
    figures = throughput().headline(CFG, t, s, on_gpu=True)
    assert figures["ratio_withheld"] is None and figures["ratio"] == pytest.approx(250 / 240)
    ((_, figure),) = headlines.dflash_throughput(file_data(figures, t, s))
    assert ": 1.04x" in figure and "no ratio" not in figure


def test_a_file_written_before_the_rule_renders_no_ratio_from_its_two_windows():
    """The committed runs of 40 steps hold a ratio over 2 steady windows: the pages show none."""
    t, s = cells(2, 0)
    del s["windows_tokens_per_s"]  # an older sequential cell, not timed in windows
    data = file_data({"ratio": 1.04, "tokens_per_s_threaded": 250_000.0, "gpu_bound_tokens_per_s": None}, t, s)
    ((_, figure),) = headlines.dflash_throughput(data)
    assert ": -x (no ratio: the threaded cell 2 steady windows, fewer than 3" in figure


def test_a_pipeline_above_its_gpu_bound_limit_is_flagged_in_the_file_and_the_printed_figures(tmp_path, capsys):
    # the 8B run of 20 steps: threaded 1.63x sequential, the sequential at 0.9 of the limit
    bound = CFG.batch_size * CFG.seq_len / 0.010
    t, s = cells(3, 3, threaded=1.63 * 0.9 * bound, sequential=0.9 * bound)
    figures = throughput().headline(CFG, t, s, on_gpu=True)
    assert figures["gpu_bound_tokens_per_s"] == pytest.approx(bound)
    assert list(figures["above_gpu_bound"]) == ["threaded"]
    assert figures["above_gpu_bound"]["threaded"] == pytest.approx(1.63 * 0.9)
    name = "dflash-throughput-8b-trees_nvidia-h200_torch2.11.0_2026-12-04.json"
    path = throughput().common.save(tmp_path / name, file_data(figures, t, s))
    assert json.loads(path.read_text())["above_gpu_bound"] == {"threaded": pytest.approx(1.467)}
    printed = capsys.readouterr().out
    assert "IMPOSSIBLE: threaded 1.47x the GPU-bound limit, a measurement error" in printed


def test_pipelines_within_the_limit_are_not_flagged():
    bound = CFG.batch_size * CFG.seq_len / 0.010
    t, s = cells(8, 8, threaded=0.95 * bound, sequential=0.96 * bound)
    figures = throughput().headline(CFG, t, s, on_gpu=True)
    assert figures["above_gpu_bound"] == {}
    ((_, figure),) = headlines.dflash_throughput(file_data(figures, t, s))
    assert "IMPOSSIBLE" not in figure


def test_a_run_the_trainers_size_check_refuses_writes_no_results_file(tmp_path, monkeypatch, capsys):
    module = throughput()
    refused = {"error": "exit 2: error: this run needs about 96.0 GiB on cuda:0 (weights 15.3, ...) but 79.1 GiB is free; "
                        "pass --batch-size 2 (now 8) with --grad-accum 4 to keep about 8 samples a step", "exit_code": 2}
    started = []
    monkeypatch.setattr(module.common, "exit_on_sigterm", lambda: None)
    monkeypatch.setattr(module, "make_config", lambda args, out_dir: SimpleNamespace(device_list=["cpu"]))
    monkeypatch.setattr(module, "memory_estimate_gib", lambda cfg: {"weights": 1.0})
    monkeypatch.setattr(module, "run_cell_subprocess", lambda args, name, cfg, cache: started.append(name) or dict(refused))
    out = tmp_path / "out"
    assert module.main(["--quick", "--out-dir", str(out)]) == 2
    assert started == ["threaded"]  # nothing measured after the refusal
    assert not out.exists() or list(out.iterdir()) == []
    assert "the threaded cell refused the run (exit 2: error: this run needs about 96.0 GiB" in capsys.readouterr().err


def test_a_cell_the_trainer_refuses_exits_2_with_its_one_line(tmp_path, monkeypatch, capsys):
    module = throughput()
    from examples.dflash_trainer.assets.sizes import TooLarge
    from examples.dflash_trainer.config import TrainConfig

    def refuse(cfg, profile_s=0.0):
        raise TooLarge("this run needs about 96.0 GiB on cuda:0 but 79.1 GiB is free; pass --batch-size 2")

    monkeypatch.setattr(module.common, "exit_on_sigterm", lambda: None)
    monkeypatch.setattr(module, "run_threaded", refuse)
    out = tmp_path / "cell.json"
    config = json.dumps(TrainConfig(devices="cpu").to_dict())
    assert module.main(["--quick", "--cell", "threaded", "--cell-config", config, "--cell-out", str(out)]) == 2
    assert not out.exists()
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: this run needs about 96.0 GiB on cuda:0 but 79.1 GiB is free; pass --batch-size 2")


def test_a_failed_cell_records_its_exit_status(tmp_path):
    from benchmarks import common

    result = common.run_cell([common.sys.executable, "-c", "import sys; print('error: refused', file=sys.stderr); "
                              "sys.exit(2)"], str(tmp_path / "cache"), 60)
    assert result == {"error": "exit 2: error: refused", "exit_code": 2}
