"""Every public name has a docstring, and so has every public method, property and attribute of
the public classes: the API reference is built from them (Google style: ``Args:``,
``Returns:``, ``Raises:``, ``Attributes:``)."""

import ast
import dataclasses
import inspect
import re
import textwrap

import pytest

import threadgraph


def _public_classes():
    return [getattr(threadgraph, n) for n in threadgraph.__all__ if inspect.isclass(getattr(threadgraph, n))]


def _instance_attributes(cls) -> set[str]:
    """Public attributes a class sets on its instances: dataclass fields and ``self.x = ...`` in ``__init__``."""
    if dataclasses.is_dataclass(cls):
        return {f.name for f in dataclasses.fields(cls) if not f.name.startswith("_")}
    init = cls.__dict__.get("__init__")
    if init is None:
        return set()
    tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    return {target.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
            and target.value.id == "self" and not target.attr.startswith("_")}


def _documented_attributes(cls) -> set[str]:
    doc = inspect.cleandoc(cls.__dict__.get("__doc__") or "")
    section = re.search(r"^Attributes:\n((?:(?:    .*)?\n?)*)", doc, re.M)
    return set(re.findall(r"^    (\w+):", section.group(1), re.M)) if section else set()


@pytest.mark.parametrize("name", threadgraph.__all__)
def test_every_public_name_has_a_docstring(name):
    obj = getattr(threadgraph, name)
    doc = obj.__dict__.get("__doc__") if inspect.isclass(obj) else obj.__doc__
    assert doc and doc.strip(), name


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_every_public_method_and_property_has_a_docstring(cls):
    missing = []
    for name, member in vars(cls).items():
        if name.startswith("_") and name != "__call__":
            continue
        if isinstance(member, (staticmethod, classmethod)):
            member = member.__func__
        if callable(member) or isinstance(member, property):
            if not (member.__doc__ or "").strip():
                missing.append(name)
    assert missing == [], f"{cls.__name__}: {missing}"


@pytest.mark.parametrize("cls", _public_classes(), ids=lambda c: c.__name__)
def test_every_public_attribute_is_in_the_class_docstrings_attributes(cls):
    assert _instance_attributes(cls) <= _documented_attributes(cls), cls.__name__


def test_the_attribute_check_reads_init_and_the_attributes_section():
    class Example:
        """An example.

        Attributes:
            shown: Documented.
        """

        def __init__(self):
            self.shown = 1
            self.hidden = 2
            self._private = 3

    assert _instance_attributes(Example) == {"shown", "hidden"}
    assert _documented_attributes(Example) == {"shown"}


def _raised(doc: str) -> list[str]:
    """The exception names a docstring's ``Raises:`` section lists."""
    section = re.search(r"^Raises:\n((?:(?:    .*)?\n?)*)", inspect.cleandoc(doc or ""), re.M)
    return re.findall(r"^    (\w+):", section.group(1), re.M) if section else []


def _public_docstrings():
    for name in threadgraph.__all__:
        obj = getattr(threadgraph, name)
        yield name, obj.__doc__
        if inspect.isclass(obj):
            for member_name, member in vars(obj).items():
                if callable(member) and (not member_name.startswith("_") or member_name == "__init__"):
                    yield f"{name}.{member_name}", member.__doc__


def test_every_raises_section_lists_threadgraph_errors_only():
    # "Every error threadgraph raises is a ThreadgraphError" (usage.md): what a Raises: section
    # lists is one, by a name the package exports.
    listed = {(where, error) for where, doc in _public_docstrings() for error in _raised(doc)}
    assert len(listed) > 10
    wrong = sorted((where, error) for where, error in listed
                   if not (error in threadgraph.__all__ and issubclass(getattr(threadgraph, error), threadgraph.ThreadgraphError)))
    assert wrong == []


def test_the_raises_check_reads_the_section():
    doc = """Do it.

    Raises:
        ValueError: A bad value.
            More about it.
        threadgraph_error: Not a name it takes apart.
    """
    assert _raised(doc) == ["ValueError", "threadgraph_error"]
