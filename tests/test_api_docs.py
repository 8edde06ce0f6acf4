"""The API reference: every public name (``threadgraph.__all__``) and every public method or property
of a public class has a docstring of its own, and docs/api.md renders each public name once."""

import inspect
import re
import types
from pathlib import Path

import threadgraph

ROOT = Path(__file__).resolve().parents[1]
RENDERED = re.compile(r"^::: threadgraph\.(\w+)\s*$", re.MULTILINE)


def _own_doc(obj) -> str:
    if inspect.isclass(obj):
        return obj.__dict__.get("__doc__") or ""  # not a base class's (inspect.getdoc would inherit it)
    return obj.__doc__ or ""


def _members(cls: type):
    """(name, function or property) of each public method or property that a class of the same
    package defines on ``cls``'s MRO; data attributes and what other packages define are left out."""
    package = cls.__module__.split(".")[0]
    seen = set()
    for klass in cls.__mro__:
        if klass.__module__.split(".")[0] != package:
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(value, (staticmethod, classmethod)):
                value = value.__func__
            if inspect.isfunction(value) or isinstance(value, property):
                yield name, value


def undocumented(module: types.ModuleType) -> list[str]:
    """The public names of ``module``, and ``Class.member`` of their public methods and properties,
    that have no docstring of their own."""
    missing = []
    for name in module.__all__:
        obj = getattr(module, name)
        if not _own_doc(obj).strip():
            missing.append(name)
        if inspect.isclass(obj):
            missing += [f"{name}.{member}" for member, value in _members(obj) if not (value.__doc__ or "").strip()]
    return missing


def test_every_public_name_and_public_method_has_a_docstring():
    assert undocumented(threadgraph) == []


def test_the_docstring_check_finds_what_lacks_one():
    module = types.ModuleType("fakepkg")

    class Base:
        """Documented."""

        def inherited(self):
            pass

    class Documented(Base):
        """Documented."""

        def method(self):
            """Documented."""

        @property
        def value(self):
            return 1

        @staticmethod
        def helper():
            pass

        def _private(self):
            pass

        limit = 3

    class Bare(Exception):
        pass

    def function():
        pass

    for obj in (Base, Documented, Bare, function):
        obj.__module__ = "fakepkg.inner"
    module.__all__ = ["Documented", "Bare", "function"]
    module.Documented, module.Bare, module.function = Documented, Bare, function
    assert undocumented(module) == ["Documented.value", "Documented.helper", "Documented.inherited", "Bare", "function"]


def test_the_api_reference_renders_every_public_name_once():
    rendered = RENDERED.findall((ROOT / "docs" / "api.md").read_text(encoding="utf-8"))
    assert sorted(rendered) == sorted(threadgraph.__all__)
    assert len(rendered) == len(set(rendered)) == 25
