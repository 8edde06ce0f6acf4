"""benchmarks/results_index.py: the committed index is current, rows come latest first, and a
stale index or a file breaking the naming rule fails --check."""

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as the script runs
results_index = importlib.import_module("results_index")


def overhead(path, ratio):
    row = {"task": "train", "workers": 1, "fenced_p50_ms": ratio, "unfenced_p50_ms": 1.0, "ratio_fenced_over_unfenced": ratio}
    path.write_text(json.dumps({"rows": [row]}))


def test_the_committed_index_is_what_the_committed_json_gives():
    assert results_index.main(["--check"]) == 0


def test_rows_come_latest_first_and_a_new_file_makes_the_index_stale(tmp_path, capsys):
    overhead(tmp_path / "fence-overhead_cpu_torch2.13.0_2026-01-02.json", 0.5)
    overhead(tmp_path / "fence-overhead_nvidia-h200_torch2.11.0_2026-03-01.json", 0.7)
    assert results_index.main(["--results", str(tmp_path)]) == 0
    rows = [line for line in (tmp_path / "README.md").read_text().splitlines() if line.startswith("| 2026")]
    assert [r.split(" | ")[0] for r in rows] == ["| 2026-03-01", "| 2026-01-02"]
    assert "fenced / unfenced 0.70" in rows[0] and "| nvidia-h200 | 2.11.0 |" in rows[0]
    assert results_index.main(["--results", str(tmp_path), "--check"]) == 0
    overhead(tmp_path / "fence-overhead_cpu_torch2.13.0_2026-02-01.json", 0.9)
    capsys.readouterr()
    assert results_index.main(["--results", str(tmp_path), "--check"]) == 1
    assert "README.md is stale" in capsys.readouterr().err


def test_a_file_that_breaks_the_naming_rule_fails_the_check(tmp_path, capsys):
    overhead(tmp_path / "nvidia-h200_torch2.11.0_2026-03-01_fence-overhead.json", 0.7)
    assert results_index.main(["--results", str(tmp_path), "--check"]) == 1
    assert "nvidia-h200_torch2.11.0_2026-03-01_fence-overhead.json" in capsys.readouterr().err


def test_a_theme_without_an_extractor_is_named():
    assert results_index.extractor("replay-dflash-gil") is results_index.replay
    assert results_index.extractor("dflash-throughput-0.6b-trees") is results_index.dflash_throughput
    with pytest.raises(ValueError, match="no headline extractor for theme 'mystery'"):
        results_index.extractor("mystery")


@pytest.mark.parametrize("cache, label", [("empty", ""), ("the threaded cell's (a restart)", " (on the threaded cell's cache)")])
def test_a_dflash_sequential_startup_on_the_threaded_cells_cache_is_labelled(tmp_path, cache, label):
    cell = {"tokens_per_s": 2.0e5, "mode": "whole-step", "devices": ["cuda:0"]}
    data = {"shape": "8b", "args": {"cuda_graphs": "whole-step"}, "threaded": dict(cell), "ratio": 0.94,
            "sequential": {**cell, "inductor_cache": cache}, "startup_s_threaded": 94.0, "startup_s_sequential": 29.0}
    (tmp_path / "dflash-throughput-8b-whole-step_nvidia-h200_torch2.11.0_2026-12-01.json").write_text(json.dumps(data))
    assert results_index.main(["--results", str(tmp_path)]) == 0
    row = next(line for line in (tmp_path / "README.md").read_text().splitlines() if "dflash-throughput-8b" in line)
    assert f"startup 94 s threaded, 29 s sequential{label} |" in row


def test_recency_orders_by_date_then_gpu_over_cpu_then_torch_version():
    names = ["replay-small_nvidia-h200_torch2.11.0_2026-11-30.json", "replay-small_cpu_torch2.13.0_2026-11-30.json",
             "replay-small_nvidia-h200_torch2.9.1_2026-11-30.json", "replay-small_cpu_torch2.13.0_2026-12-01.json"]
    assert sorted(names, key=results_index.recency) == [names[1], names[2], names[0], names[3]]


def test_a_trainer_runs_startup_says_how_much_of_it_was_the_build():
    run = {"placement": "targets cuda:0, drafters cuda:0", "baseline": {"tau_random_init": 1.01, "tau_repeat_last_token": 1.11},
           "mode": "trees", "total_steps": 252, "eval": {"tau": 2.9}, "tokens_per_s_steady": 2.5e5,
           "startup_s": 117.8, "build_s": 57.0}
    (row,) = results_index.dflash_trainer({"recorded_by": "x", "Trees after X, empty Inductor cache": run})
    assert row[1].endswith("; 250k tokens/s; startup 118 s (57 s of it the build: load, assets)")
    del run["build_s"]
    (row,) = results_index.dflash_trainer({"recorded_by": "x", "Trees after X, empty Inductor cache": run})
    assert row[1].endswith("; startup 118 s")


def test_the_committed_results_hold_the_newest_file_per_theme_machine_and_torch():
    folder = Path(results_index.__file__).resolve().parent / "results"
    dates = {}
    for path in folder.glob("*.json"):
        name = results_index.NAME.match(path.name)
        dates.setdefault((name["theme"], name["hardware"], name["torch"]), set()).add(path.name)
    kept = {key: sorted(names) for key, names in dates.items() if len(names) > 1}
    assert not kept, f"older runs belong in git history: {kept}"
