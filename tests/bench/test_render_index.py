"""python -m benchmarks index (benchmarks/render.py): the committed index is current, rows come
latest first, and a stale index, a file breaking the naming rule or a file breaking its theme's
schema fails --check."""

import json

import pytest

from benchmarks import render
from benchmarks import headlines
from benchmarks import results_schema as schema


def overhead(path, ratio):
    row = {"task": "train", "workers": 1, "fenced_p50_ms": ratio, "unfenced_p50_ms": 1.0, "ratio_fenced_over_unfenced": ratio}
    path.write_text(json.dumps({"rows": [row]}))


def index(*argv):
    return render.main(["index", *argv])


def test_the_committed_index_is_what_the_committed_json_gives():
    assert index("--check") == 0


def test_rows_come_latest_first_and_a_new_file_makes_the_index_stale(tmp_path, capsys):
    overhead(tmp_path / "fence-overhead_cpu_torch2.13.0_2026-01-02.json", 0.5)
    overhead(tmp_path / "fence-overhead_nvidia-h200_torch2.11.0_2026-03-01.json", 0.7)
    assert index("--results", str(tmp_path)) == 0
    rows = [line for line in (tmp_path / "README.md").read_text().splitlines() if line.startswith("| 2026")]
    assert [r.split(" | ")[0] for r in rows] == ["| 2026-03-01", "| 2026-01-02"]
    assert "fenced / unfenced 0.70" in rows[0] and "| nvidia-h200 | 2.11.0 |" in rows[0]
    assert index("--results", str(tmp_path), "--check") == 0
    overhead(tmp_path / "fence-overhead_cpu_torch2.13.0_2026-02-01.json", 0.9)
    capsys.readouterr()
    assert index("--results", str(tmp_path), "--check") == 1
    assert "stale; run python -m benchmarks index" in capsys.readouterr().err


def test_a_file_that_breaks_the_naming_rule_fails_the_check(tmp_path, capsys):
    overhead(tmp_path / "nvidia-h200_torch2.11.0_2026-03-01_fence-overhead.json", 0.7)
    assert index("--results", str(tmp_path), "--check") == 1
    assert "nvidia-h200_torch2.11.0_2026-03-01_fence-overhead.json" in capsys.readouterr().err


def test_a_file_that_breaks_its_schema_fails_the_check_naming_the_file_and_field(tmp_path, capsys):
    overhead(tmp_path / "fence-overhead_cpu_torch2.13.0_2026-01-02.json", 0.5)
    assert index("--results", str(tmp_path)) == 0
    bad = tmp_path / "fence-overhead_cpu_torch2.13.0_2026-01-03.json"
    bad.write_text(json.dumps({"rows": [{"task": "train", "workers": 1}]}))
    capsys.readouterr()
    assert index("--results", str(tmp_path), "--check") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and bad.name in err[0] and "rows[0].fenced_p50_ms" in err[0], err


def test_every_theme_has_headlines_and_an_unknown_theme_is_named():
    assert headlines.extractor("replay-dflash-gil") is headlines.replay
    assert headlines.extractor("dflash-throughput-0.6b-trees") is headlines.dflash_throughput
    assert set(headlines.EXTRACTORS) == set(schema.THEMES)
    with pytest.raises(KeyError, match="no results theme 'mystery'"):
        headlines.extractor("mystery")


@pytest.mark.parametrize("cache, label", [("empty", ""), ("the threaded cell's (a restart)", " (on the threaded cell's cache)")])
def test_a_dflash_sequential_startup_on_the_threaded_cells_cache_is_labelled(tmp_path, cache, label):
    cell = {"tokens_per_s": 2.0e5, "mode": "whole-step", "devices": ["cuda:0"]}
    data = {"shape": "8b", "graphs": "whole-step", "args": {"cuda_graphs": "whole-step"}, "threaded": dict(cell),
            "ratio": 0.94, "env": {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "date": "2026-12-01"},
            "sequential": {**cell, "inductor_cache": cache}, "startup_s_threaded": 94.0, "startup_s_sequential": 29.0}
    (tmp_path / "dflash-throughput-8b-whole-step_nvidia-h200_torch2.11.0_2026-12-01.json").write_text(json.dumps(data))
    assert index("--results", str(tmp_path)) == 0
    row = next(line for line in (tmp_path / "README.md").read_text().splitlines() if "dflash-throughput-8b" in line)
    assert f"startup 94 s threaded, 29 s sequential{label} |" in row


def test_a_dflash_run_whose_cell_failed_has_a_row_without_its_figures(tmp_path):
    data = {"shape": "8b", "graphs": "trees", "args": {}, "threaded": {"error": "exit 1: boom"}, "ratio": None,
            "sequential": {"tokens_per_s": 2.0e5, "mode": "trees"}, "env": {"gpu": None, "torch": "2.13.0", "date": "2026-12-01"}}
    (rows,) = headlines.dflash_throughput(data)
    assert rows[1].startswith("threaded - tokens/s, sequential 200k: -x")


def test_a_trainer_runs_startup_says_how_much_of_it_was_the_build():
    run = {"placement": "targets cuda:0, drafters cuda:0", "baseline": {"tau_random_init": 1.01, "tau_repeat_last_token": 1.11},
           "mode": "trees", "total_steps": 252, "eval": {"tau": 2.9}, "tokens_per_s_steady": 2.5e5,
           "startup_s": 117.8, "build_s": 57.0}
    (row,) = headlines.dflash_trainer({"recorded_by": "x", "Trees after X, empty Inductor cache": run})
    assert row[1].endswith("; 250k tokens/s; startup 118 s (57 s of it the build: load, assets)")
    del run["build_s"]
    (row,) = headlines.dflash_trainer({"recorded_by": "x", "Trees after X, empty Inductor cache": run})
    assert row[1].endswith("; startup 118 s")


def test_the_committed_results_hold_the_newest_file_per_theme_machine_and_torch():
    dates = {}
    for path in schema.RESULTS.glob("*.json"):
        name = schema.parse_name(path.name)
        dates.setdefault((name.theme, name.machine, name.torch), set()).add(path.name)
    kept = {key: sorted(names) for key, names in dates.items() if len(names) > 1}
    assert not kept, f"older runs belong in git history: {kept}"
