"""The packages' layout: no import cycles between a package's modules (imports inside functions
count: they only hide a cycle) and no module importing another module's private names."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"threadgraph": ROOT / "src" / "threadgraph", "examples.dflash_trainer": ROOT / "examples" / "dflash_trainer"}


def modules(package: Path) -> dict[str, Path]:
    """Dotted module name (relative to the package, '' for its __init__) -> file."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imports(name: str, path: Path, known: set[str], top: str) -> tuple[set[str], list[str]]:
    """The package modules that module ``name`` imports, and the private names it imports from them."""
    is_package = path.name == "__init__.py"
    here = name.split(".") if name else []
    base_parts = here if is_package else here[:-1]
    deps, private = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = base_parts[:len(base_parts) - (node.level - 1)] if node.level > 1 else base_parts
                target = ".".join([*base, *(node.module.split(".") if node.module else [])])
            elif node.module and (node.module == top or node.module.startswith(top + ".")):
                target = node.module[len(top) + 1:]
            else:
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}" if target else alias.name
                if sub in known:  # "from . import module"
                    deps.add(sub)
                else:
                    deps.add(target)
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        private.append(f"{name or '__init__'} imports {alias.name} from {target or top}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(top + "."):
                    deps.add(alias.name[len(top) + 1:])
    return {d for d in deps if d in known and d != name}, private


def graph(package: Path, top: str):
    found = modules(package)
    edges, private = {}, []
    for name, path in found.items():
        edges[name], own = imports(name, path, set(found), top)
        private += own
    return edges, private


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return found


@pytest.mark.parametrize("top", sorted(PACKAGES))
def test_no_import_cycles_and_no_private_imports(top):
    edges, private = graph(PACKAGES[top], top)
    # a package's __init__ re-exports its modules; a module importing the package itself is a cycle
    # only through __init__, which the edges above include
    assert not cycles(edges), cycles(edges)
    assert not private, private


def test_the_check_finds_a_cycle_and_a_private_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import thing\n")
    (package / "b.py").write_text("def f():\n    from .c import _hidden\n")
    (package / "c.py").write_text("from . import a\n_hidden = 1\n")
    edges, private = graph(package, "pkg")
    assert cycles(edges) == [["a", "b", "c", "a"]]
    assert private == ["b imports _hidden from c"]


def library_privates_used(paths, root=ROOT) -> list[str]:
    """Where code outside the library imports a private threadgraph module or name."""
    found = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module:
                parts = node.module.split(".")
                names = [a.name for a in node.names] if parts == ["threadgraph"] else []
                if parts[0] == "threadgraph" and any(p.startswith("_") for p in parts[1:] + names):
                    found.append(f"{path.relative_to(root)}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import):
                found += [f"{path.relative_to(root)}: import {a.name}" for a in node.names
                          if a.name.startswith("threadgraph._")]
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "threadgraph"
                  and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{path.relative_to(root)}: threadgraph.{node.attr}")
    return found


def test_the_example_and_benchmarks_use_only_the_librarys_public_api():
    users = [p for folder in ("examples", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(users) > 50
    assert not library_privates_used(users), library_privates_used(users)


def test_tests_outside_the_librarys_own_use_only_its_public_api():
    # tests/library tests the library from inside; every other test uses it as a user does.
    users = [p for folder in ("helpers", "conformance", "trainer", "bench")
             for p in sorted((ROOT / "tests" / folder).rglob("*.py"))]
    assert len(users) > 50
    assert not library_privates_used(users), library_privates_used(users)


def test_the_public_api_check_finds_a_private_import(tmp_path):
    (tmp_path / "x.py").write_text("from threadgraph import _stats, install\nimport threadgraph._device.gate\n")
    (tmp_path / "y.py").write_text("from threadgraph._device.fence import outside_captures\nfrom threadgraph import install\n"
                                   "names = threadgraph._patches.FENCE_PATCHES, threadgraph.__version__\n")
    found = library_privates_used([tmp_path / "x.py", tmp_path / "y.py"], root=tmp_path)
    assert sorted(found) == ["x.py: from threadgraph import _stats, install", "x.py: import threadgraph._device.gate",
                             "y.py: from threadgraph._device.fence import outside_captures", "y.py: threadgraph._patches"]


def test_the_trainers_top_level_reads_as_its_pipeline():
    # The data side (records, chat, cache, regeneration) and the run's control live in packages;
    # the top level keeps the pipeline's own stages, at most 15 modules.
    top = sorted(p.name for p in PACKAGES["examples.dflash_trainer"].glob("*.py"))
    assert len(top) <= 15, top
    packages = {p.name for p in PACKAGES["examples.dflash_trainer"].iterdir() if (p / "__init__.py").is_file()}
    assert {"data", "regenerate", "run", "drafter", "assets", "export"} <= packages
