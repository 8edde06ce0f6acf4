"""Every ```python block of the docs runs, each in a fresh interpreter, on the CPU (CUDA hidden).

A block that needs a GPU is preceded by ``<!-- gpu -->`` (run only where torch sees a GPU, then
with it); a fragment that is not a program by itself by ``<!-- fragment -->`` (not run). A marker
may carry its reason: ``<!-- gpu: needs two GPUs -->``. Keep both rare: an example that runs is
one a reader can trust."""

import dataclasses
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"^<!--\s*(gpu|fragment)\b:?\s*(.*?)\s*-->$")


@dataclasses.dataclass
class Example:
    page: str
    line: int
    code: str
    marker: str = ""  # "", "gpu" or "fragment"
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def examples(text: str, page: str) -> list[Example]:
    found, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start = i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            previous = next((line.strip() for line in reversed(lines[:start]) if line.strip()), "")
            marked = MARKER.match(previous)
            found.append(Example(page, start + 1, "\n".join(body) + "\n",
                                 marked.group(1) if marked else "", marked.group(2) if marked else ""))
        i += 1
    return found


ALL = [example for page in PAGES for example in examples(page.read_text(encoding="utf-8"), page.relative_to(ROOT).as_posix())]


def test_the_docs_have_examples_and_few_are_marked():
    assert len(ALL) >= 5
    marked = [e.id for e in ALL if e.marker]
    assert len(marked) <= len(ALL) // 4, marked


def test_markers_are_read_with_their_reason():
    text = ("```python\nprint(1)\n```\n\n<!-- gpu: needs two GPUs -->\n```python\nprint(2)\n```\n"
            "<!-- fragment -->\n\n```python\nstep()\n```\n")
    found = [(e.line, e.marker, e.reason, e.code) for e in examples(text, "x.md")]
    assert found == [(1, "", "", "print(1)\n"), (6, "gpu", "needs two GPUs", "print(2)\n"), (11, "fragment", "", "step()\n")]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", ALL, ids=lambda e: e.id)
def test_the_example_runs(example, tmp_path):
    if example.marker == "fragment":
        pytest.skip(f"a fragment, not a program{': ' + example.reason if example.reason else ''}")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    if example.marker == "gpu":
        if not torch.cuda.is_available():
            pytest.skip(f"needs a CUDA GPU{': ' + example.reason if example.reason else ''}")
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""  # on the CPU, as a reader without a GPU runs it
    proc = subprocess.run([sys.executable, "-c", example.code], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=840)
    assert proc.returncode == 0, f"{example.id} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, f"{example.id}:\n{proc.stderr[-4000:]}"
