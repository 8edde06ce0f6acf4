"""python -m benchmarks readme (benchmarks/render.py): the generated sections of README.md,
docs/results.md and the trainer's README are a function of the committed
results, and a GPU claim takes GPU runs only (a CPU run never reaches it); the README stays one
screen, keeps .ci/run's test command, and every relative link of the pages points to a file that
exists."""

import json
import re
import shutil
from pathlib import Path

import pytest

from benchmarks import render

ROOT = Path(__file__).resolve().parents[2]


def render_readme(argv):
    """python -m benchmarks readme ARGV."""
    return render.main(["readme", *argv])


def _result(results, shape, graphs, date, tokens_threaded, gpu="NVIDIA H200", sequential_cache=None, torch="2.11.0",
            devices="cuda:0", alike=True):
    data = {"shape": shape, "graphs": graphs, "env": {"date": date, "gpu": gpu, "torch": torch},
            "args": {"devices": devices, "cuda_graphs": graphs},
            "threaded": {"tokens_per_s": tokens_threaded},
            "tokens_per_s_threaded": tokens_threaded, "tokens_per_s_sequential": 250_000.0, "ratio": tokens_threaded / 250e3,
            "gpu_bound_tokens_per_s": 260_000.0, "ratio_threaded_to_gpu_bound": tokens_threaded / 260e3,
            "ratio_sequential_to_gpu_bound": 250 / 260, "startup_s_threaded": 41.0, "startup_s_sequential": 20.5, "startup_ratio": 2.0,
            "host_gil_ms_per_batch": 2.5, "projected_gpus_per_process": 6.6, "target_params": 442_564_608}
    data["sequential"] = {"compile_phases_s": {}} if sequential_cache is None else {"inductor_cache": sequential_cache}
    data["sequential"]["tokens_per_s"] = 250_000.0
    if alike:  # trained and timed as the threads are: a median of windows
        data["sequential"].update(windows_tokens_per_s=[250_000.0] * 3, training="as threaded")  # enough for a ratio
    name = f"dflash-throughput-{shape}-{graphs}_nvidia-h200_torch{torch}_{date}.json"
    (results / name).write_text(json.dumps(data))
    return name


BUILD_REPORT = {"spec": {"num_layers": 6, "hidden_size": 128, "train_steps": 500}, "tokenizer_vocab": 2000,
                "num_parameters": 1_705_984, "heldout_loss_before": 7.6535, "heldout_loss_after": 4.2834,
                "data": {"num_samples": 512, "num_eval_prompts": 16}}


def _readme(tmp_path):
    """A repository root holding every page with its markers; returns docs/results.md (the tables)."""
    root = tmp_path / "root"
    (root / "docs").mkdir(parents=True)
    (root / "examples" / "dflash_trainer").mkdir(parents=True)
    (root / "README.md").write_text("# x\n\n<!-- readme-headlines:begin -->\n<!-- readme-headlines:end -->\n")
    (root / "examples" / "dflash_trainer" / "README.md").write_text(
        "# t\n\n<!-- dflash-measured:begin -->\nold\n<!-- dflash-measured:end -->\n"
        "<!-- regenerate-default:begin -->\nold\n<!-- regenerate-default:end -->\n")
    path = root / "docs" / "results.md"
    path.write_text("# x\n\nbefore\n\n<!-- dflash-table:begin -->\nold\n<!-- dflash-table:end -->\n\n"
                    "<!-- results-headlines:begin -->\n<!-- results-headlines:end -->\n\nafter\n")
    return path


def _argv(results, readme):
    return ["--results", str(results), "--root", str(readme.parent.parent)]


def test_table_is_rendered_deterministically_from_the_newest_run_per_shape_and_mode(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    _result(results, "0.6b", "trees", "2026-11-30", 100_000.0)
    newest = _result(results, "0.6b", "trees", "2026-12-01", 240_000.0)
    toy = _result(results, "default", "whole-step", "2026-12-01", 700_000.0)
    unlike = _result(results, "8b", "trees", "2026-12-01", 30_000.0, alike=False)
    readme = _readme(tmp_path)
    argv = _argv(results, readme)
    assert render_readme(argv) == 0
    first = readme.read_text()
    assert render_readme(argv) == 0 and readme.read_text() == first
    table = first.split("<!-- dflash-table:begin -->")[1].split("<!-- dflash-table:end -->")[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 3
    assert "| default target, whole-step, 1 GPU |" in rows[0] and toy in rows[0]  # the toy first
    assert newest in rows[1] and "| 0.6b target, Trees, 1 GPU |" in rows[1]
    assert ("threaded 240k tokens/s, sequential 250k: 0.96x; GPU-bound limit 260k; "
            "startup 41 s threaded, 20 s sequential |") in rows[1]
    assert unlike in rows[2] and "0.12x (a sequential loop of more optimizer work, the two sides not timed alike)" in rows[2]
    assert first.startswith("# x\n\nbefore\n\n") and first.endswith("\n\nafter\n")
    assert render_readme(argv + ["--check"]) == 0


def test_check_fails_on_a_stale_readme_and_no_results_is_valid(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    readme = _readme(tmp_path)
    argv = _argv(results, readme)
    assert render_readme(argv + ["--check"]) == 1  # "old" is not what no results give
    render_readme(argv)
    assert "No GPU `dflash-throughput` results" in readme.read_text() and render_readme(argv + ["--check"]) == 0
    _result(results, "8b", "whole-step", "2026-12-02", 300_000.0)
    assert render_readme(argv + ["--check"]) == 1
    assert readme.read_text().count("No GPU `dflash-throughput` results") == 1  # --check never writes


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
    assert render_readme(_argv(results, readme)) == 0
    row = next(line for line in readme.read_text().splitlines() if "8b target" in line)
    assert "startup 41 s threaded, 20 s sequential (on the threaded cell's cache) |" in row


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
    assert render_readme(_argv(results, readme)) == 0
    section = readme.read_text().split("<!-- results-headlines:begin -->")[1].split("<!-- results-headlines:end -->")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == 2, rows
    assert "| fence-overhead | train, 3 workers | fenced / unfenced 0.97 (6.20 / 6.40 ms) |" in rows[0]
    assert "fence-overhead_nvidia-h200_torch2.11.0_2026-12-01.json" in rows[0]
    assert "1614 steps/s against 546 for eager threads; 8 of 8 equal to alone" in rows[1]


def test_the_committed_readme_is_what_the_committed_results_give():
    assert render_readme(["--check"]) == 0


def test_rows_go_embedded_targets_first_then_published_shapes_by_size(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    for shape in ("14b", "8b", "default", "0.6b", "32b"):
        _result(results, shape, "whole-step", "2026-12-01", 100_000.0)
    _result(results, "8b", "trees", "2026-12-01", 100_000.0)
    order = [(run.data["shape"], run.data["graphs"]) for run in render.newest_runs(results)]
    assert order == [("default", "whole-step"), ("0.6b", "whole-step"), ("8b", "trees"), ("8b", "whole-step"),
                     ("14b", "whole-step"), ("32b", "whole-step")]


def _tau_results(results, taus=(2.31, 2.31), build_s=(690.0, 1100.0), python="3.11.7", transformers="5.24.0"):
    runs = [{"tau": t, "tau_random_init": 1.01, "tau_repeat_last_token": 1.006, "steps": 252} for t in taus]
    report = dict(BUILD_REPORT, versions={"python": python, "transformers": transformers, "torch": "2.13.0+cpu"})
    (results / "dflash-tau-reproducibility_cpu_torch2.13.0_2026-12-01.json").write_text(json.dumps(
        {"env": {"date": "2026-12-01", "gpu": None, "cpus": 2, "torch": "2.13.0+cpu", "python": python},
         "bit_identical": True, "differing_files": [], "tau": {"min": min(taus), "max": max(taus)},
         "builds": [{"run": run, "report": report, "build_s": s} for run, s in zip(runs, build_s)]}))


def _links(page: Path) -> list[str]:
    """The relative link targets of a Markdown page (external links and in-page anchors left out)."""
    targets = re.findall(r"\]\(([^)\s]+)\)", page.read_text(encoding="utf-8"))
    return [t for t in targets if not re.match(r"[a-z]+:", t) and not t.startswith("#")]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """Each relative link of ``page`` whose file does not exist, or whose #anchor is no heading of it."""
    broken = []
    for link in _links(page):
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve()
        if not target.exists():
            broken.append(link)
        elif anchor and target.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", target.read_text(encoding="utf-8"), flags=re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(link)
    return broken


def _pages():
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples" / "dflash_trainer").glob("*.md"))]


def test_every_relative_link_of_the_readme_and_the_docs_points_to_an_existing_file():
    pages = _pages()
    assert len(pages) >= 8 and all(p.exists() for p in pages)
    assert {p.name: broken_links(p) for p in pages} == {p.name: [] for p in pages}
    assert sum(len(_links(p)) for p in pages) > 50  # the check reads links at all


def test_the_link_check_finds_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "usage.md").write_text("# Usage\n\n## Plain threads\n")
    page = tmp_path / "README.md"
    page.write_text("[a](docs/usage.md) [b](docs/usage.md#plain-threads) [c](docs/gone.md) [d](docs/usage.md#nope) "
                    "[e](https://example.com/x) [f](#here)\n")
    assert broken_links(page) == ["docs/gone.md", "docs/usage.md#nope"]


def test_the_readme_is_one_screen_and_holds_ci_runs_test_command_verbatim():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.split()) <= 900
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    marker = next(i for i, line in enumerate(ci) if "the README's test command, verbatim" in line)
    command = ci[marker + 1].strip().split(" 2>&1")[0]  # what .ci/run adds after it: its log
    assert command.startswith("pip install") and command in [line.strip() for line in readme.splitlines()]
    assert "python -m examples.dflash_trainer" in [line.strip().split(" && ")[-1] for line in readme.splitlines()]


def _root_with_results(tmp_path):
    page = _readme(tmp_path)
    root = page.parent.parent
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True)
    return root, results


def test_tau_and_the_build_time_are_given_as_ranges_with_what_they_depend_on(tmp_path):
    root, results = _root_with_results(tmp_path)
    _tau_results(results, taus=(2.31, 2.62), build_s=(462.0, 660.0), python="3.11.7", transformers="5.24.0")
    startup = {"env": {"gpu": "NVIDIA H200", "python": "3.12.3", "torch": "2.11.0+cu130"}}
    for i, (tau, python, build) in enumerate(((2.95, "3.11.7", 17.0), (2.92, "3.11.7", 15.0), (2.08, "3.12.3", 57.0))):
        startup[f"run {i}"] = {"eval": {"tau": tau}, "build_s": build, "startup_s": 100.0, "placement": "targets on cuda:0",
                               "baseline": {"tau_random_init": 1.01, "tau_repeat_last_token": 1.1}, "mode": "whole-step",
                               "total_steps": 252, "tokens_per_s_steady": 6e5,
                               "target_report": {"versions": {"python": python, "transformers": "5.17.0"}}}
    (results / "dflash-trainer-startup_nvidia-h200_torch2.11.0_2026-12-02.json").write_text(json.dumps(startup))
    argv = ["--results", str(results), "--root", str(root)]
    assert render_readme(argv + ["--check"]) == 1  # the trainer README's "old"
    assert render_readme(argv) == 0 and render_readme(argv + ["--check"]) == 0
    text = (root / "examples" / "dflash_trainer" / "README.md").read_text()
    lines = text.split("<!-- dflash-measured:begin -->")[1].split("<!-- dflash-measured:end -->")[0].strip().splitlines()
    cpu_tau, build, *gpu = lines
    assert "CPU (float32): 2.31 - 2.62 over 2 runs" in cpu_tau and "Python 3.11.7, transformers 5.24.0" in cpu_tau
    assert "7.7 - 11.0 min per build over 2 builds" in build
    assert "GPU (bfloat16): 2.92 - 2.95 over 2 runs" in gpu[0] and "target built with Python 3.11.7" in gpu[0]
    assert "GPU (bfloat16): 2.08 over 1 runs" in gpu[1] and "target built with Python 3.12.3" in gpu[1]
    assert "15 - 57 s" in gpu[2]
    assert "](../../benchmarks/results/dflash-tau-reproducibility_cpu_torch2.13.0_2026-12-01.json)" in cpu_tau


def _fence_matrix(results, torch, date, unfenced_errors):
    run = {"threads": 32, "finished": 32, "all_equal": True}
    repro = {"fenced": [dict(run, errors={})] * 20,
             "unfenced": [dict(run, errors={"t1": "Offset increment"} if e else {}) for e in unfenced_errors]}
    name = f"fence-matrix_nvidia-h200_torch{torch}_{date}.json"
    (results / name).write_text(json.dumps({"cells": [], "repro": repro}))
    return name


def test_the_repro_headline_quotes_the_newest_torch_where_it_raised_and_says_where_it_does_not(tmp_path):
    root, results = _root_with_results(tmp_path)
    raised = _fence_matrix(results, "2.11.0", "2026-12-01", [True, True, False])
    line = render.readme_headlines(results)
    assert "ran clean in 20 of 20 runs with threadgraph and raised in 2 of 3 without it (torch 2.11.0;" in line
    assert raised in line and "either" not in line
    _fence_matrix(results, "2.14.1", "2026-12-04", [False, False, False])
    line = next(x for x in render.readme_headlines(results).splitlines() if "123177" in x)
    assert raised in line and line.endswith("; on torch 2.14.1 it does not raise without threadgraph either.")


def _replay(results, name, gpu, steps):
    """A replay-dflash file: {mode: (one worker's steps/s, two workers' one per GPU)}."""
    rows = []
    for mode, (alone, together) in steps.items():
        rows.append({"task": "train", "placement": "worker", "mode": mode, "workers": 1, "p50_ms": 1e3 / alone,
                     "steps_per_s": alone})
        if together is not None:
            rows.append({"task": "train", "placement": "per-gpu", "mode": mode, "workers": 2, "p50_ms": 2e3 / together,
                         "steps_per_s": together})
        rows.append({"task": "train", "placement": "shared", "mode": mode, "workers": 3, "p50_ms": 3e3 / alone,
                     "steps_per_s": alone})
    torch, date = name.split("_torch")[1].split("_")
    env = {"gpu": gpu, "gpus": 2 if gpu else 0, "torch": torch, "date": date.removesuffix(".json")}
    (results / name).write_text(json.dumps({"env": env, "rows": rows}))
    return name


def test_the_scaling_headline_says_which_graphs_mode_scales_across_gpus(tmp_path):
    root, results = _root_with_results(tmp_path)
    name = _replay(results, "replay-dflash_nvidia-h200_torch2.11.0_2026-11-30.json", "NVIDIA H200",
                   {"whole-step": (176.0, 352.0), "reduce-overhead": (367.0, 379.0)})
    line = next(x for x in render.readme_headlines(results).splitlines() if "Across GPUs" in x)
    assert line.startswith("- **Across GPUs, whole-step graphs scale and CUDAGraph Trees do not scale**: 2 worker threads")
    assert "352 steps/s with whole-step graphs (`capture_step`) against one worker's 176, and 379 with CUDAGraph Trees " \
           "against one worker's 367" in line and name in line
    _replay(results, "replay-dflash_nvidia-h200_torch2.11.0_2026-12-01.json", "NVIDIA H200",
            {"whole-step": (176.0, 300.0), "reduce-overhead": (367.0, 700.0)})
    line = next(x for x in render.readme_headlines(results).splitlines() if "Across GPUs" in x)
    assert line.startswith("- **Across GPUs, whole-step graphs do not scale and CUDAGraph Trees scale**")


def _as_cpu_run(results, name, theme=None, **top):
    """A copy of the GPU results file ``name`` as a newer CPU run of ``theme`` (default: its own)."""
    data = json.loads((results / name).read_text())
    date = "2027-01-01"
    if isinstance(data.get("env"), dict):
        data["env"].update(gpu=None, gpus=0, torch="2.13.0+cpu", date=date)
    for key in ("gpu", "machine"):
        data.pop(key, None)
    data.update({k: v for k, v in (("torch", "2.13.0"), ("date", date)) if k in data}, **top)
    cpu = f"{theme or name.split('_')[0]}_cpu_torch2.13.0_{date}.json"
    (results / cpu).write_text(json.dumps(data))
    return cpu


def _copy_repository_pages(root):
    for page in render.PAGES:
        (root / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, root / page)


def test_a_cpu_run_never_reaches_a_gpu_headline_or_a_gpu_row(tmp_path):
    root = tmp_path / "root"
    results = root / "benchmarks" / "results"
    shutil.copytree(ROOT / "benchmarks" / "results", results)
    _copy_repository_pages(root)
    argv = ["--results", str(results), "--root", str(root)]
    assert render_readme(argv + ["--check"]) == 0  # the committed pages, from the committed results
    before = {page: (root / page).read_text() for page in render.PAGES}
    throughput = next(p.name for p in sorted(results.glob("dflash-throughput-0.6b-trees_*.json")))
    added = [_as_cpu_run(results, throughput, "dflash-throughput-tiny-assets-eager", shape="tiny-assets", graphs="eager",
                         ratio=0.55, tokens_per_s_threaded=5500.0, tokens_per_s_sequential=10000.0),
             _replay(results, "replay-dflash_cpu_torch2.13.0_2027-01-01.json", None,
                     {"whole-step": (10.0, 40.0), "reduce-overhead": (10.0, 5.0)})]
    for theme in ("conformance", "fence-matrix", "fence-overhead", "install-overhead", "dflash-trainer-startup"):
        added.append(_as_cpu_run(results, next(p.name for p in sorted(results.glob(f"{theme}_*.json")))))
    assert render.main(["index", "--results", str(results)]) == 0
    index = (results / "README.md").read_text()
    assert all(name in index for name in added)  # the index lists every file with its machine
    cpu_replay = [row for row in index.splitlines() if "replay-dflash_cpu" in row]
    assert cpu_replay and all("on one CPU" in row and "GPU" not in row.split(" | ")[3] for row in cpu_replay)
    assert render_readme(argv) == 0
    after = {page: (root / page).read_text() for page in render.PAGES}
    assert after == before  # no page moved: every section of them speaks of GPUs, or labels its CPU run
    assert "0.55" not in after["README.md"] and "_cpu_" not in after["README.md"]
    results_page = after["docs/results.md"]
    assert not [name for name in added if name in results_page]
