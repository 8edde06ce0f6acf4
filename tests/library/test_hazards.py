"""The hazards: one name per hazard, used by every patch, doctor, docs/patches.md and docs/hazards.md
(which describes each one, and which the library's list must match)."""

import pathlib
import re
import subprocess
import sys

import pytest

import threadgraph
from threadgraph import _compat
from threadgraph._diagnostics import hazards as _hazards
from threadgraph._patches import PATCHES

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A path out of the repository into the project's notes, or a hazard by number.
OUTSIDE_OR_NUMBERED = re.compile(r"\.\./shared/|[a-z]+-threading-hazards|\bhazards? \d+\b")
VERIFIED_LINK = re.compile(r"^https://github\.com/pytorch/pytorch/(issues|pull)/\d+$")


def _sections(page: str) -> list[str]:
    return re.findall(r"^## ([a-z-]+)$", page, re.M)


def test_docs_describe_exactly_the_hazards_the_library_lists_in_its_order():
    page = (ROOT / "docs" / "hazards.md").read_text(encoding="utf-8")
    assert _sections(page) == _hazards.names()
    table = [m for m in re.findall(r"^\| \[`([a-z-]+)`\]\(#\1\) \|", page, re.M)]
    assert table == _hazards.names()


def test_the_docs_say_how_each_hazard_is_known_as_the_library_decides_it():
    page = (ROOT / "docs" / "hazards.md").read_text(encoding="utf-8")
    for name, section in zip(_sections(page), re.split(r"^## [a-z-]+$", page, flags=re.M)[1:]):
        known = re.search(r"^- How it is known: (\w+)", section, re.M)
        assert known is not None, name
        expected = "assumed" if _hazards.get(name).detect is None else "detected"
        assert known.group(1) == expected, (name, known.group(1))


def test_the_docs_list_each_hazards_patches():
    page = (ROOT / "docs" / "hazards.md").read_text(encoding="utf-8")
    for name, section in zip(_sections(page), re.split(r"^## [a-z-]+$", page, flags=re.M)[1:]):
        listed = re.search(r"^- Patches: (.*)\.$", section, re.M).group(1)
        expected = [p.name for p in PATCHES if p.hazard == name]
        assert re.findall(r"`(\w+)`", listed) == expected, name


def test_names_are_unique_stable_slugs():
    names = _hazards.names()
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-z]+(-[a-z]+)+", name) for name in names), names


def test_every_patch_names_a_listed_hazard():
    for patch in PATCHES:
        assert patch.hazard in _hazards.names(), (patch.name, patch.hazard)


def test_upstream_references_in_the_docs_are_links_or_pytorch_numbers():
    page = (ROOT / "docs" / "hazards.md").read_text(encoding="utf-8")
    for line in re.findall(r"^- Upstream: (.*)\.$", page, re.M):
        if line != "none known":
            assert all(VERIFIED_LINK.match(url) for url in re.findall(r"<([^>]+)>", line)), line
            assert re.fullmatch(r"<[^>]+>(, <[^>]+>)*", line), line


def test_detected_hazards_answer_and_assumed_ones_say_so():
    for hazard in _hazards.HAZARDS:
        if hazard.detect is None:
            assert hazard.status() == "assumed", hazard.name
        else:
            assert hazard.status() in {"present", "absent"}, hazard.name


def test_unknown_names_are_rejected_with_the_known_ones():
    with pytest.raises(KeyError, match="no hazard named 'global generation'; known: .*global-generation"):
        _hazards.get("global generation")


def test_the_patch_table_names_each_patchs_hazard_and_the_readme_and_table_link_the_catalogue():
    table = (ROOT / "docs" / "patches.md").read_text(encoding="utf-8")
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    for patch in PATCHES:
        row = next((r for r in rows if f"`{patch.name}`" in r), None)
        assert row is not None, f"docs/patches.md's patch table lacks {patch.name}"
        assert f"`{patch.hazard}`" in row, (patch.name, row)
    assert "](hazards.md)" in table
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "](docs/hazards.md)" in readme and "](docs/patches.md)" in readme


def test_the_library_its_tests_and_docs_name_hazards_only_from_the_catalogue():
    # No numbered hazards and no notes outside the repository.
    paths = [ROOT / "README.md", ROOT / "pyproject.toml", ROOT / ".ci" / "run"]
    for folder in ("src", "tests", "docs"):
        paths += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in {".py", ".md", ".sh"} and ".egg-info" not in str(p))
    offenders = []
    for path in paths:
        if path.is_file():
            text = path.read_text(encoding="utf-8", errors="replace")
            if OUTSIDE_OR_NUMBERED.search(text):
                offenders.append(str(path.relative_to(ROOT)))
    assert offenders == []


def test_patches_report_name_targets_and_hazard():
    for record in threadgraph.patches():
        assert {"name", "target", "targets", "hazard", "applies", "missing", "active"} <= set(record)
        assert record["hazard"] in _hazards.names()


def test_every_patch_has_a_record_in_the_docs():
    records = (ROOT / "docs" / "patches.md").read_text(encoding="utf-8").split("## Each patch's record", 1)[1]
    recorded = set(re.findall(r"`(\w+)`", "\n".join(re.findall(r"^- (.*?):", records, re.M))))
    assert {p.name for p in PATCHES} <= recorded


@pytest.mark.parametrize("contents, expected", [
    (b"\x7fELF...Offset increment outside graph capture encountered unexpectedly.\x00...", True),
    (b"\x7fELF...offset_intragraph_ % 4 == 0 INTERNAL ASSERT FAILED\x00...", False),
])
def test_the_generator_capture_check_is_read_from_the_cuda_library(tmp_path, contents, expected):
    library = tmp_path / "libtorch_cuda.so"
    library.write_bytes(contents)
    assert _compat.generator_rejects_draws_beside_captures(library) is expected


def test_a_cpu_build_has_no_generator_capture_check(monkeypatch):
    monkeypatch.setattr(_compat, "cuda_library", lambda: None)
    _compat.generator_rejects_draws_beside_captures.cache_clear()
    try:
        assert _compat.generator_rejects_draws_beside_captures() is None
    finally:
        _compat.generator_rejects_draws_beside_captures.cache_clear()
