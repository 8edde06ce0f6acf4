"""benchmarks/results_schema.py: every committed results file loads and holds no absolute path; a
file that breaks its theme's fields or disagrees with its own name is refused with one error naming
the file and the field, on reading and before writing; the header of a file without one comes from
its name; what is written holds no absolute path of the machine."""

import json
from pathlib import Path

import pytest

from benchmarks import results_schema as schema

ENV = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "date": "2026-12-01", "cpus": 16}
GIL = {"env": ENV, "args": {"devices": "cuda:0"}, "gil_busy": 0.5, "tokens_per_s_steady": 1.0e5}
GIL_NAME = "gil-profile_nvidia-h200_torch2.11.0_2026-12-01.json"
ROOT = Path(__file__).resolve().parents[2]


def test_every_committed_results_file_loads_with_its_header():
    files = sorted(schema.RESULTS.glob("*.json"))
    loaded = schema.load_folder(schema.RESULTS)
    assert len(loaded) == len(files) > 10
    assert {r.name for r in loaded} == {p.name for p in files}
    assert not schema.misnamed(schema.RESULTS)


def test_a_file_without_an_env_gets_its_header_from_its_name(tmp_path):
    path = tmp_path / "gpu-scenarios_nvidia-h200_torch2.11.0_2026-12-02.json"
    path.write_text(json.dumps({"suite (00:06 UTC)": {"many_workers_8_steps_200": {"error": "x"}}}))
    loaded = schema.load(path)
    assert (loaded.theme, loaded.machine, loaded.torch, loaded.date) == ("gpu-scenarios", "nvidia-h200", "2.11.0", "2026-12-02")
    assert loaded.env == {"machine": "nvidia-h200", "torch": "2.11.0", "date": "2026-12-02"}


@pytest.mark.parametrize("change, field", [
    (lambda d: d.pop("args"), "args"),
    (lambda d: d.update(gil_busy="half"), "gil_busy"),
    (lambda d: d.update(gil_busy=True), "gil_busy"),
    (lambda d: d["env"].update(date="2026-12-02"), "env.date"),
    (lambda d: d["env"].update(torch="2.12.0"), "env.torch"),
    (lambda d: d["env"].update(gpu="NVIDIA A100"), "env.gpu"),
])
def test_a_broken_file_is_one_error_naming_the_file_and_the_field(tmp_path, change, field):
    data = json.loads(json.dumps(GIL))
    change(data)
    path = tmp_path / GIL_NAME
    path.write_text(json.dumps(data))
    with pytest.raises(schema.ResultsError) as error:
        schema.load(path)
    assert error.value.file == GIL_NAME and error.value.field == field
    assert str(error.value).startswith(f"{GIL_NAME}: {field}: ")


def test_entries_of_a_list_and_the_runs_of_a_trainer_file_are_checked(tmp_path):
    rows = tmp_path / "replay-small_cpu_torch2.13.0_2026-12-01.json"
    rows.write_text(json.dumps({"env": {"gpu": None, "torch": "2.13.0", "date": "2026-12-01"}, "rows": [{"task": "train"}]}))
    with pytest.raises(schema.ResultsError, match=r"rows\[0\]\.placement: missing"):
        schema.load(rows)
    startup = tmp_path / "dflash-trainer-startup_cpu_torch2.13.0_2026-12-01.json"
    startup.write_text(json.dumps({"Trees, empty Inductor cache": {"eval": {"tau": 2.0}, "mode": "trees"}}))
    with pytest.raises(schema.ResultsError, match=r"Trees, empty Inductor cache\.baseline: missing"):
        schema.load(startup)


@pytest.mark.parametrize("name, text, field", [
    ("mystery_cpu_torch2.13.0_2026-12-01.json", "{}", "theme"),
    ("conformance_cpu_torch2.13.0_2026-12-01.json", "[1, 2]", "(top level)"),
    ("conformance_cpu_torch2.13.0_2026-12-01.json", "{not json", "(file)"),
    ("conformance_cpu_2026-12-01.json", "{}", "name"),
])
def test_an_unknown_theme_a_non_object_or_a_misnamed_file_is_refused(tmp_path, name, text, field):
    (tmp_path / name).write_text(text)
    with pytest.raises(schema.ResultsError) as error:
        schema.load(tmp_path / name)
    assert error.value.field == field


def test_write_checks_before_writing_and_writes_what_load_reads(tmp_path):
    path = tmp_path / GIL_NAME
    with pytest.raises(schema.ResultsError, match="args: missing"):
        schema.write(path, {k: v for k, v in GIL.items() if k != "args"})
    assert not path.exists()
    schema.write(path, GIL)
    assert schema.load(path).data == GIL and path.read_text().endswith("}\n")
    assert [p.name for p in tmp_path.iterdir()] == [GIL_NAME]  # the JSON only: no per-run report
    assert schema.stem(ENV, "gil-profile") + ".json" == GIL_NAME


def absolute_paths(text: str) -> list[str]:
    return [found.group(0) for found in schema.ABSOLUTE_PATH.finditer(text)]


def test_no_committed_results_file_holds_an_absolute_path():
    files = [p for p in schema.RESULTS.iterdir() if p.suffix in (".json", ".md")]
    assert len(files) > 30
    found = {p.name: absolute_paths(p.read_text()) for p in files}
    assert {name: paths for name, paths in found.items() if paths} == {}


def test_the_absolute_path_detector_finds_paths_and_leaves_links_ratios_and_relative_paths():
    text = ('cache "/var/cache/x", File "/usr/lib/python3.12/threading.py", /tmp/run-1 and \'/opt/me\' '
            'but not https://github.com/pytorch/pytorch/issues/123177, ../benchmarks/results/a.json, tokens/s, '
            'a / b, 3/4 or benchmarks/README.md')
    assert absolute_paths(text) == ["/var/cache/x", "/usr/lib/python3.12/threading.py", "/tmp/run-1", "/opt/me"]


def test_write_makes_paths_inside_the_repository_relative_and_cuts_others_to_their_last_part(tmp_path, monkeypatch):
    monkeypatch.setenv("THREADGRAPH_CACHE", str(ROOT / ".tgcache"))  # a cache kept in the checkout
    data = dict(GIL, args={"devices": "cuda:0", "target": str(ROOT / ".tgcache" / "shape-8b"),
                           "python": str(ROOT / ".venv" / "bin" / "python"), "script": str(ROOT / "benchmarks" / "x.py"),
                           "out_dir": "/var/runs/run-1", "root": str(ROOT)})  # a folder outside the repository
    path = schema.write(tmp_path / GIL_NAME, data)
    assert schema.load(path).data["args"] == {"devices": "cuda:0", "target": "<cache>/shape-8b", "python": "python",
                                              "script": "benchmarks/x.py", "out_dir": "run-1", "root": "."}
    assert schema.neutral(f"# report\n\ntarget: {ROOT / 'examples' / 'x.py'}\n") == "# report\n\ntarget: examples/x.py\n"
    assert absolute_paths(path.read_text()) == [] and data["args"]["out_dir"] == "/var/runs/run-1"  # data kept


def test_recency_orders_by_date_then_gpu_over_cpu_then_torch_version():
    names = ["replay-small_nvidia-h200_torch2.11.0_2026-11-30.json", "replay-small_cpu_torch2.13.0_2026-11-30.json",
             "replay-small_nvidia-h200_torch2.9.1_2026-11-30.json", "replay-small_cpu_torch2.13.0_2026-12-01.json"]
    assert sorted(names, key=schema.recency) == [names[1], names[2], names[0], names[3]]


def test_newest_takes_the_newest_file_of_exactly_that_theme(tmp_path):
    for name in ("conformance_cpu_torch2.13.0_2026-12-01.json", "conformance_nvidia-h200_torch2.11.0_2026-12-01.json",
                 "conformance-extra_cpu_torch2.13.0_2026-12-09.json"):
        (tmp_path / name).write_text(json.dumps({"placements": [], "cases": 0, "equal": 0, "rows": []}))
    runs = schema.load_folder(tmp_path)
    assert schema.newest(runs, "conformance").name == "conformance_nvidia-h200_torch2.11.0_2026-12-01.json"
    assert schema.newest(runs, "fence-matrix") is None


@pytest.mark.parametrize("header, field", [({"gpu": "nvidia-a100"}, "gpu"), ({"machine": "cpu"}, "machine"),
                                           ({"torch": "2.12.0"}, "torch"), ({"gpu": "NVIDIA H200", "torch": "2.11.0+cu130"}, None)])
def test_a_file_without_an_env_is_checked_against_the_header_it_holds_at_the_top(tmp_path, header, field):
    path = tmp_path / "fence-overhead_nvidia-h200_torch2.11.0_2026-12-01.json"
    path.write_text(json.dumps({**header, "rows": []}))
    if field is None:
        assert schema.load(path).machine == "nvidia-h200"
        return
    with pytest.raises(schema.ResultsError) as error:
        schema.load(path)
    assert error.value.field == field
