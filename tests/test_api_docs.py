"""The API reference (docs/api.md, built by `mkdocs build --strict`) renders every public name of
threadgraph once; that each of them has a docstring is tests/library/test_docstrings.py's check."""

import re
from pathlib import Path

import threadgraph

ROOT = Path(__file__).resolve().parents[1]
RENDERED = re.compile(r"^::: (\S+)\s*$", re.MULTILINE)


def rendered_names(page: str) -> list[str]:
    """The names a page renders with mkdocstrings (``::: threadgraph.NAME`` lines), in order."""
    return RENDERED.findall(page)


def test_the_api_reference_renders_every_public_name_once():
    names = rendered_names((ROOT / "docs" / "api.md").read_text(encoding="utf-8"))
    assert sorted(names) == sorted(f"threadgraph.{name}" for name in threadgraph.__all__)
    assert len(names) == len(set(names))


def test_rendered_names_reads_only_whole_mkdocstrings_lines():
    page = "# API\n\n::: threadgraph.install\n\nSee `::: threadgraph.inline` and\n::: threadgraph.WorkerGroup  \n:::x\n"
    assert rendered_names(page) == ["threadgraph.install", "threadgraph.WorkerGroup"]
