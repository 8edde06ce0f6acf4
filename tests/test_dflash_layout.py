"""The trainer's module layout, read from its source with ``ast`` (nothing is imported): no import
cycle between its modules, and no module takes another module's private (``_``-prefixed) name.

An import inside a function counts like one at the top: a cycle hidden in a function is still two
modules that need each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = "examples.dflash_trainer"
ROOT = Path(__file__).resolve().parent.parent / "examples" / "dflash_trainer"


def module_names(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root``, by dotted name (a package is its ``__init__``)."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join([PACKAGE, *parts])] = path
    return names


def _imports(path: Path, name: str, is_package: bool) -> list[tuple[str, list[str], int]]:
    """(imported module, imported names, line) of every import in the file, relative ones resolved."""
    here = name.split(".") if is_package else name.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = here[:len(here) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.append((module, [alias.name for alias in node.names], node.lineno))
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """For each module of the package, the modules of the package it imports."""
    modules = module_names(root)
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for module, names, _line in _imports(path, name, path.name == "__init__.py"):
            submodules = {f"{module}.{n}" for n in names} & modules.keys()
            graph[name] |= submodules
            if module in modules and (not names or len(submodules) < len(names)):
                graph[name].add(module)  # a name defined in that module (or its __init__)
        graph[name].discard(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def private_imports(root: Path) -> list[str]:
    """``module:line imports _name from other`` for every private name taken from another module."""
    found = []
    for name, path in module_names(root).items():
        for module, names, line in _imports(path, name, path.name == "__init__.py"):
            for imported in names:
                if imported.startswith("_") and not imported.startswith("__") and module != name:
                    found.append(f"{name}:{line} imports {imported} from {module}")
    return found


def test_the_trainer_modules_import_each_other_without_a_cycle():
    graph = import_graph(ROOT)
    assert len(graph) > 20 and f"{PACKAGE}.config" in graph[f"{PACKAGE}.train"]  # the graph was read
    assert cycles(graph) == []


def test_no_trainer_module_imports_a_private_name_of_another():
    assert private_imports(ROOT) == []


def test_the_checks_see_a_cycle_and_a_private_import(tmp_path):
    pkg = tmp_path / "dflash_trainer"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub.b import B\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import _helper\n")
    (pkg / "c.py").write_text("from . import a\nfrom .sub import b\n")
    assert cycles(import_graph(pkg)) == [[f"{PACKAGE}.a", f"{PACKAGE}.sub.b"]]
    assert private_imports(pkg) == [f"{PACKAGE}.sub.b:2 imports _helper from {PACKAGE}.a"]
