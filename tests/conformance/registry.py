"""Every conformance case by name, and which need a GPU."""

from __future__ import annotations

from . import cases_compile, cases_trees

CPU_CASES = dict(cases_compile.CASES)
GPU_CASES = dict(cases_trees.CASES)
ALL = {**CPU_CASES, **GPU_CASES}
assert not set(CPU_CASES) & set(GPU_CASES), "a case name is used twice"
