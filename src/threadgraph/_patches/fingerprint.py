"""Fingerprints of the torch code threadgraph patches or relies on, and the file that records them.

A fingerprint is a short hash of a definition's syntax tree: the ``def``/``class``/assignment parsed
with ``ast``, without positions, comments, layout or docstrings, and without the fields newer
Pythons added, so it is the same on every Python from 3.10 on that reads the same source. It is computed two
ways that agree: from a live object (``inspect.getsource``; a function another library replaced
shows its own source) and from a torch source tree without importing it (``SourceTree``: the
``.py`` files of an unpacked wheel), following ``from x import name`` and base classes of the same
module. A symbol defined outside Python source (a C function) has the fingerprint None.

``fingerprints.json`` holds, per verified torch release, every target's fingerprint and, where it
was recorded from an installed torch, the outcome of each feature detection and assumption check
(``verify``). ``python -m threadgraph fingerprints --write`` adds the installed torch's record.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib
import inspect
import json
from pathlib import Path
from typing import Any, Optional

DATA = Path(__file__).with_name("fingerprints.json")
FORMAT = 1


def load() -> dict:
    """The recorded releases: ``{"format": 1, "releases": {version: record}}``."""
    try:
        data = json.loads(DATA.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"format": FORMAT, "releases": {}}
    return data


def write(data: dict) -> Path:
    releases = dict(sorted(data["releases"].items(), key=lambda item: release_key(item[0])))
    DATA.write_text(json.dumps({"format": FORMAT, "releases": releases}, indent=1, sort_keys=False) + "\n",
                    encoding="utf-8")
    return DATA


def release_key(version: str) -> tuple[int, ...]:
    """``"2.15.0"`` -> ``(2, 15, 0)``: the order of recorded releases."""
    return tuple(int(part) for part in version.split("."))


def _strip_docstrings(node: ast.AST) -> ast.AST:
    for child in ast.walk(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.body:
            first = child.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):
                child.body = child.body[1:] or [ast.Pass()]
    return node


# Fields newer Pythons added with empty defaults (3.12's type parameters) or that only say how a
# source spelt something: left out, so every Python from 3.10 on gives one fingerprint.
_VERSION_FIELDS = frozenset({"type_params", "type_comment", "kind"})


def _canonical(value: Any) -> Any:
    if isinstance(value, ast.AST):
        fields = [(name, _canonical(getattr(value, name, None))) for name in value._fields
                  if name not in _VERSION_FIELDS and getattr(value, name, None) not in (None, [])]
        return (type(value).__name__, fields)
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    return repr(value)


def of_node(node: ast.AST) -> str:
    """The fingerprint of one parsed definition: its syntax tree without positions or docstrings."""
    text = repr(_canonical(_strip_docstrings(node)))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def of_source(source: str) -> str:
    """The fingerprint of a definition's source text (``inspect.getsource`` of a function or class)."""
    if source[:1] in (" ", "\t"):
        # A method's text, indented: parsed as the body of a block, not dedented, which would change
        # the text of its multi-line string literals.
        return of_node(ast.parse("if True:\n" + source).body[0].body[0])
    return of_node(ast.parse(source).body[0])


def _original(obj: Any) -> Any:
    """What threadgraph's replacement of ``obj`` replaced, if it is one (else ``obj``)."""
    for _ in range(8):
        try:  # not getattr: torch.ops makes up a namespace for any name asked of it
            inner = object.__getattribute__(obj, "__threadgraph_original__")
        except AttributeError:
            inner = None
        if inner is None and type(obj).__name__ == "PatchWrapper":
            inner = obj.__wrapped__
        if inner is None:
            return obj
        obj = inner
    return obj


def resolve(target: str) -> Any:
    """The object a target (``module:Owner.attribute``) names, as torch holds it unpatched by threadgraph.
    Raises ImportError or AttributeError where it is missing."""
    module_path, _, qualname = target.partition(":")
    obj: Any = importlib.import_module(module_path)
    for part in qualname.split("."):
        obj = _original(getattr(obj, part))
    return obj


def live(target: str) -> Optional[str]:
    """The fingerprint of a target in the running torch; None where it has no Python source."""
    module_path, _, qualname = target.partition(":")
    if qualname.endswith(".__code__"):
        target = target[: -len(".__code__")]
    obj = resolve(target)
    function = getattr(obj, "__func__", obj)
    if inspect.isfunction(function) or inspect.isclass(function):
        try:
            return of_source(inspect.getsource(function))
        except (OSError, TypeError, SyntaxError, IndexError):
            pass
    module = importlib.import_module(module_path)
    source_file = getattr(module, "__file__", None)
    if not source_file:
        return None
    root = Path(source_file).parents[len(module_path.split(".")) - (0 if source_file.endswith("__init__.py") else 1)]
    return _tree(root).fingerprint(target)


@functools.lru_cache(maxsize=4)
def _tree(root: Path) -> "SourceTree":
    return SourceTree(root)


class SourceTree:
    """Fingerprints read from a tree holding ``torch/`` (an installed torch's parent, or an unpacked
    wheel) without importing it."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._parsed: dict[str, Optional[ast.Module]] = {}
        self._packages: set[str] = set()  # modules that are a package's __init__

    def version(self) -> str:
        """The tree's torch release (``torch/version.py``), local tag dropped."""
        tree = ast.parse((self.root / "torch" / "version.py").read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, (ast.Assign, ast.AnnAssign)):
                names = [t.id for t in getattr(node, "targets", [getattr(node, "target", None)]) if isinstance(t, ast.Name)]
                if "__version__" in names and isinstance(node.value, ast.Constant):
                    return str(node.value.value).split("+")[0]
        raise ValueError(f"no __version__ in {self.root / 'torch' / 'version.py'}")

    def module(self, module_path: str) -> Optional[ast.Module]:
        if module_path not in self._parsed:
            base = self.root.joinpath(*module_path.split("."))
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.is_file():
                    self._parsed[module_path] = ast.parse(path.read_text(encoding="utf-8"))
                    if path.name == "__init__.py":
                        self._packages.add(module_path)
                    break
            else:
                self._parsed[module_path] = None
        return self._parsed[module_path]

    def fingerprint(self, target: str) -> Optional[str]:
        module_path, _, qualname = target.partition(":")
        if qualname.endswith(".__code__"):
            qualname = qualname[: -len(".__code__")]
        found = self.find(module_path, qualname.split("."))
        return None if found is None else of_node(found)

    def find(self, module_path: str, parts: list[str], depth: int = 0) -> Optional[ast.AST]:
        tree = self.module(module_path)
        if tree is None or depth > 8:
            return None
        node = self._binding(tree.body, parts[0], module_path, depth)
        if isinstance(node, tuple):  # bound by an import: look there
            return self.find(node[0], [node[1], *parts[1:]], depth + 1)
        for part in parts[1:]:
            if not isinstance(node, ast.ClassDef):
                return None
            node = self._member(tree, node, part)
        return node

    def _binding(self, body: list, name: str, module_path: str, depth: int) -> Any:
        found: Any = None
        for node in body:  # the last binding wins, as at import
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
                found = node
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    found = node
            elif isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        found = (_absolute(module_path, module_path in self._packages, node), alias.name)
        return found

    def _member(self, tree: ast.Module, cls: ast.ClassDef, name: str, depth: int = 0) -> Optional[ast.AST]:
        found = self._binding(cls.body, name, "", depth)
        if found is not None and not isinstance(found, tuple):
            return found
        for base in cls.bases:  # inherited from a class of the same module
            if isinstance(base, ast.Name) and depth < 8:
                parent = self._binding(tree.body, base.id, "", depth)
                if isinstance(parent, ast.ClassDef):
                    member = self._member(tree, parent, name, depth + 1)
                    if member is not None:
                        return member
        return None


def _absolute(module_path: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The module a ``from ... import`` in ``module_path`` reads (a package's ``__init__`` is its own base)."""
    if not node.level:
        return node.module or ""
    package = module_path.split(".")
    base = package[: len(package) - node.level + (1 if is_package else 0)]
    return ".".join(base + ([node.module] if node.module else []))
