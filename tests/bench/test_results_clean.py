"""The committed results files speak of the run, not of the machine or the people that made it: no
machine name, no path into a folder of the checkout that was private to one machine (a cache, a
virtual environment), no notes about how a day went; and the writer produces none of these."""

import json
import re
from pathlib import Path

import pytest

from benchmarks import results_schema as schema

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for p in schema.RESULTS.iterdir() if p.suffix in (".json", ".md") and p.name != schema.INDEX)
# a path through a hidden folder, not ./ or ../: .tgcache/..., .venv/lib/...
HIDDEN_FOLDER = re.compile(r"(?<![\w/.~<>-])\.[A-Za-z][\w-]*/")
# a repository file named in a note
REPO_PATH = re.compile(r"(?<![\w/.-])((?:tests|benchmarks|examples|src|docs|\.ci)/[\w/.-]*\.(?:py|sh|md|json|toml|txt))")
NOTE_KEYS = ("note", "notes", "recorded_by")
# the words of a work log, not of a measurement
NARRATION = re.compile(r"\b(session|today|yesterday|we|I|here)\b")


def walk(value, where=""):
    """(where, key, value) of every entry of JSON data."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield where, key, item
            yield from walk(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from walk(item, f"{where}[{i}]")


def test_there_are_results_files_to_check():
    assert len([p for p in FILES if p.suffix == ".json"]) > 30


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_no_results_file_goes_through_a_hidden_folder(path):
    assert HIDDEN_FOLDER.findall(path.read_text()) == []


@pytest.mark.parametrize("path", [p for p in FILES if p.suffix == ".json"], ids=lambda p: p.name)
def test_no_results_file_names_its_machine(path):
    data = json.loads(path.read_text())
    named = [f"{where}.{key}" for where, key, _ in walk(data) if key in schema.PRIVATE_ENV]
    assert named == []


@pytest.mark.parametrize("path", [p for p in FILES if p.suffix == ".json"], ids=lambda p: p.name)
def test_notes_describe_the_run_and_cite_files_that_exist(path):
    data = json.loads(path.read_text())
    notes = [(f"{where}.{key}", item) for where, key, item in walk(data) if key in NOTE_KEYS and isinstance(item, str)]
    for where, text in notes:
        assert NARRATION.findall(text) == [], (where, text)
        missing = [p for p in REPO_PATH.findall(text) if not (ROOT / p).exists()]
        assert missing == [], (where, missing)
        commands = re.findall(r"python -m benchmarks ([\w-]+)", text)
        from benchmarks.__main__ import COMMANDS
        assert [c for c in commands if c not in COMMANDS] == [], (where, commands)


def test_the_writer_drops_the_machine_name_and_writes_the_cache_as_cache(tmp_path, monkeypatch):
    cache = tmp_path / "somewhere" / "threadgraph"
    monkeypatch.setenv("THREADGRAPH_CACHE", str(cache))
    data = {"env": {"gpu": None, "torch": "2.13.0", "date": "2026-12-05", "host": "vm", "hostname": "box-7"},
            "vocab": 10, "dense_peak_bytes": 2, "chunked_peak_bytes": 1,
            "target": str(cache / "dflash-shape-8b-on-dflash-default-v1"), "data": str(cache / "dflash-default-v1" / "train.jsonl")}
    path = schema.write(tmp_path / "dflash-loss-memory_cpu_torch2.13.0_2026-12-05.json", data)
    written = json.loads(path.read_text())
    assert written["env"] == {"gpu": None, "torch": "2.13.0", "date": "2026-12-05"}
    assert written["target"] == "<cache>/dflash-shape-8b-on-dflash-default-v1"
    assert written["data"] == "<cache>/dflash-default-v1/train.jsonl"
    assert HIDDEN_FOLDER.findall(path.read_text()) == [] and schema.ABSOLUTE_PATH.findall(path.read_text()) == []


@pytest.mark.parametrize("env", [{"THREADGRAPH_CACHE": "/data/tg"}, {"XDG_CACHE_HOME": "/data/xdg"}, {}])
def test_the_writers_cache_is_the_one_the_assets_use(env, monkeypatch):
    from examples.dflash_trainer.assets.assets import default_cache_root

    for name in ("THREADGRAPH_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert schema.cache_root() == default_cache_root()


def test_the_environment_of_a_run_names_no_machine():
    from benchmarks import common

    assert not set(common.environment()) & set(schema.PRIVATE_ENV)
