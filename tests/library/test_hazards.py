"""The hazard catalogue: one name per hazard, used by every patch, doctor, docs/patches.md and
docs/hazards.md (rendered from the catalogue; the committed page must be the rendered one)."""

import pathlib
import re
import subprocess
import sys

import pytest

import threadgraph
from threadgraph import _compat
from threadgraph._diagnostics import hazards as _hazards
from threadgraph._diagnostics import hazards_page as _hazards_page
from threadgraph._patches import PATCHES

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A path out of the repository into the project's notes, or a hazard by number.
OUTSIDE_OR_NUMBERED = re.compile(r"\.\./shared/|[a-z]+-threading-hazards|\bhazards? \d+\b")
VERIFIED_LINK = re.compile(r"^https://github\.com/pytorch/pytorch/(issues|pull)/\d+$")


def test_the_committed_page_is_the_rendered_catalogue():
    committed = (ROOT / "docs" / "hazards.md").read_text(encoding="utf-8")
    assert committed == _hazards_page.markdown(), "run: python -m threadgraph hazards --write docs/hazards.md"


def test_the_command_writes_the_page(tmp_path):
    out = tmp_path / "hazards.md"
    proc = subprocess.run([sys.executable, "-m", "threadgraph", "hazards", "--write", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert out.read_text(encoding="utf-8") == _hazards_page.markdown()


def test_names_are_unique_stable_slugs():
    names = _hazards.names()
    assert len(names) == len(set(names))
    assert all(re.fullmatch(r"[a-z]+(-[a-z]+)+", name) for name in names), names


def test_every_patch_names_a_catalogued_hazard_and_documents_what_was_read_and_run():
    for patch in PATCHES:
        assert patch.hazard in _hazards.names(), (patch.name, patch.hazard)
        for field in ("read", "run", "changes", "upstream"):
            assert getattr(patch, field) not in ("", "not recorded", "-"), (patch.name, field)


def test_upstream_references_are_links_or_say_none_known():
    for hazard in _hazards.HAZARDS:
        assert all(VERIFIED_LINK.match(url) for url in hazard.upstream), hazard.name
    for patch in PATCHES:
        assert patch.upstream == "none known" or re.search(r"pytorch/pytorch#\d+", patch.upstream), patch.name


def test_detected_hazards_answer_and_assumed_ones_say_so():
    for hazard in _hazards.HAZARDS:
        if hazard.detect is None:
            assert hazard.status() == "assumed" and hazard.detection.startswith("assumed"), hazard.name
        else:
            assert hazard.status() in {"present", "absent"} and hazard.detection.startswith("detected"), hazard.name


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


def test_patches_report_their_records():
    for record in threadgraph.patches():
        assert {"hazard", "read", "run", "changes", "upstream"} <= set(record)


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
