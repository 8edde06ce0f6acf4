"""benchmarks/readme_tables.py: the README's DFlash table is a function of the committed results."""

import importlib
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
readme_tables = importlib.import_module("readme_tables")


def _result(results, shape, graphs, date, tokens_threaded, gpu="NVIDIA H200", sequential_cache=None):
    data = {"shape": shape, "graphs": graphs, "env": {"date": date, "gpu": gpu, "torch": "2.11.0"},
            "tokens_per_s_threaded": tokens_threaded, "tokens_per_s_sequential": 250_000.0, "ratio": tokens_threaded / 250e3,
            "gpu_bound_tokens_per_s": 260_000.0, "ratio_threaded_to_gpu_bound": tokens_threaded / 260e3,
            "ratio_sequential_to_gpu_bound": 250 / 260, "startup_s_threaded": 41.0, "startup_s_sequential": 20.5, "startup_ratio": 2.0,
            "host_gil_ms_per_batch": 2.5, "projected_gpus_per_process": 6.6, "target_params": 442_564_608}
    data["sequential"] = {"compile_phases_s": {}} if sequential_cache is None else {"inductor_cache": sequential_cache}
    name = f"dflash-throughput-{shape}-{graphs}_nvidia-h200_torch2.11.0_{date}.json"
    (results / name).write_text(json.dumps(data))
    return name


BUILD_REPORT = {"spec": {"num_layers": 6, "hidden_size": 128, "train_steps": 500}, "tokenizer_vocab": 2000,
                "num_parameters": 1_705_984, "heldout_loss_before": 7.6535, "heldout_loss_after": 4.2834,
                "data": {"num_samples": 512, "num_eval_prompts": 16}}


def _readme(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("# x\n\nbefore\n\n<!-- dflash-table:begin -->\nold\n<!-- dflash-table:end -->\n\n"
                    "<!-- dflash-tau:begin -->\n<!-- dflash-tau:end -->\n\n"
                    "<!-- results-headlines:begin -->\n<!-- results-headlines:end -->\n\nafter\n")
    return path


def test_table_is_rendered_deterministically_from_the_newest_run_per_shape_and_mode(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _result(results, "0.6b", "trees", "2026-11-30", 100_000.0)
    newest = _result(results, "0.6b", "trees", "2026-12-01", 240_000.0)
    toy = _result(results, "default", "whole-step", "2026-12-01", 700_000.0)
    readme = _readme(tmp_path)
    argv = ["--results", str(results), "--readme", str(readme)]
    assert readme_tables.main(argv) == 0
    first = readme.read_text()
    assert readme_tables.main(argv) == 0 and readme.read_text() == first
    table = first.split("<!-- dflash-table:begin -->")[1].split("<!-- dflash-table:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 2
    assert "launch-bound smoke case" in rows[0] and toy in rows[0]  # the toy first, labelled
    assert newest in rows[1] and "240k" in rows[1] and "0.96" in rows[1] and "Qwen3-0.6B shape" in rows[1]
    assert "| 41.0 | 20.5 | 2.00 |" in rows[1]  # startup threaded, sequential, and their ratio
    assert first.startswith("# x\n\nbefore\n\n") and first.endswith("\n\nafter\n")
    assert "No tau reproducibility results yet" in first
    assert readme_tables.main(argv + ["--check"]) == 0
    run = {"tau": 2.45, "tau_random_init": 1.01, "tau_repeat_last_token": 1.12, "steps": 256}
    (results / "dflash-tau-reproducibility_cpu_torch2.13.0_2026-12-01.json").write_text(json.dumps(
        {"env": {"date": "2026-12-01", "gpu": None, "cpus": 2, "torch": "2.13.0"}, "bit_identical": True,
         "differing_files": [], "tau": {"min": 2.45, "max": 2.45},
         "builds": [{"run": run, "report": BUILD_REPORT}, {"run": run}, {"run": None}]}))
    assert readme_tables.main(argv + ["--check"]) == 1
    readme_tables.main(argv)
    tau = readme.read_text().split("<!-- dflash-tau:begin -->")[1]
    assert "3 fresh builds" in tau and "bit-identical" in tau and "tau 2.450" in tau and "1.010" in tau and "1.120" in tau
    assert ("a 1.71M-parameter Qwen3 target (6 layers, hidden 128, vocabulary 2000) trained on Python's standard "
            "library source for 500 steps (held-out loss 7.65 -> 4.28 nats), 512 training samples") in tau


def test_check_fails_on_a_stale_readme_and_no_results_is_valid(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    readme = _readme(tmp_path)
    argv = ["--results", str(results), "--readme", str(readme)]
    assert readme_tables.main(argv + ["--check"]) == 1  # "old" is not what no results give
    readme_tables.main(argv)
    assert "No results yet" in readme.read_text() and readme_tables.main(argv + ["--check"]) == 0
    _result(results, "8b", "whole-step", "2026-12-02", 300_000.0)
    assert readme_tables.main(argv + ["--check"]) == 1
    assert readme.read_text().count("No results yet") == 1  # --check never writes


@pytest.mark.parametrize("cache", ["the threaded cell's (a restart)", "unrecorded (a file from before per-cell caches)"])
def test_a_sequential_startup_on_the_threaded_cells_cache_is_marked_and_given_no_ratio(tmp_path, cache):
    results = tmp_path / "results"
    results.mkdir()
    name = _result(results, "8b", "whole-step", "2026-12-01", 28_000.0, sequential_cache=cache)
    if cache.startswith("unrecorded"):
        data = json.loads((results / name).read_text())
        data["sequential"] = {}
        (results / name).write_text(json.dumps(data))
    readme = _readme(tmp_path)
    assert readme_tables.main(["--results", str(results), "--readme", str(readme)]) == 0
    row = next(line for line in readme.read_text().splitlines() if "Qwen3-8B shape" in line)
    assert "| 41.0 | 20.5 (on the threaded cell's cache) | - (not comparable) |" in row


def test_other_headlines_come_from_each_themes_newest_file_and_a_scenarios_last_phase(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for date, ratio in (("2026-11-30", 0.5), ("2026-12-01", 0.97)):
        row = {"task": "train", "workers": 3, "fenced_p50_ms": 6.2, "unfenced_p50_ms": 6.4, "ratio_fenced_over_unfenced": ratio}
        (results / f"fence-overhead_nvidia-h200_torch2.11.0_{date}.json").write_text(json.dumps({"rows": [row]}))
    many = {"together_steps_per_s": 1407.0, "eager_steps_per_s": 546.0, "losses_allclose": [True] * 7 + [False]}
    fixed = dict(many, together_steps_per_s=1614.0, losses_allclose=[True] * 8)
    (results / "gpu-scenarios_nvidia-h200_torch2.11.0_2026-11-29.json").write_text(json.dumps(
        {"lanes (before the fixes)": {"many_workers_8_steps_1000": many}, "recheck": {"many_workers_8_steps_1000": fixed}}))
    readme = _readme(tmp_path)
    assert readme_tables.main(["--results", str(results), "--readme", str(readme)]) == 0
    section = readme.read_text().split("<!-- results-headlines:begin -->")[1].split("<!-- results-headlines:end -->")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 2, rows
    assert "| fence-overhead | train, 3 workers | fenced / unfenced 0.97 (6.20 / 6.40 ms) |" in rows[0]
    assert "fence-overhead_nvidia-h200_torch2.11.0_2026-12-01.json" in rows[0]
    assert "1614 steps/s against 546 for eager threads; 8 of 8 equal to alone" in rows[1]


def test_the_committed_readme_is_what_the_committed_results_give():
    assert readme_tables.main(["--check"]) == 0


def test_rows_go_embedded_targets_first_then_published_shapes_by_size(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for shape in ("14b", "8b", "default", "0.6b", "32b"):
        _result(results, shape, "whole-step", "2026-12-01", 100_000.0)
    _result(results, "8b", "trees", "2026-12-01", 100_000.0)
    order = [(data["shape"], data["graphs"]) for data, _ in readme_tables.newest_runs(results)]
    assert order == [("default", "whole-step"), ("0.6b", "whole-step"), ("8b", "trees"), ("8b", "whole-step"),
                     ("14b", "whole-step"), ("32b", "whole-step")]


def test_the_peak_memory_column_sets_the_measured_peak_beside_the_estimate(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    measured = _result(results, "32b", "trees", "2026-12-01", 7_500.0)
    data = json.loads((results / measured).read_text())
    (results / measured).write_text(json.dumps({**data, "peak_memory_gib_threaded": 134.47, "memory_estimate_gib": 109.2}))
    _result(results, "14b", "trees", "2026-12-01", 16_000.0)  # written before peaks were recorded
    readme = _readme(tmp_path)
    assert readme_tables.main(["--results", str(results), "--readme", str(readme)]) == 0
    rows = {line.split(" | ")[0]: line for line in readme.read_text().splitlines() if "shape, random init" in line}
    assert "| 6.6 | 134 (109) | [" in rows["| Qwen3-32B shape, random init (0.44B params)"]
    assert "| 6.6 | - (not recorded) | [" in rows["| Qwen3-14B shape, random init (0.44B params)"]
