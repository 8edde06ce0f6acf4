"""A lock-guarded registry of named, reversible patches built on wrapt.

wrapt has no "unpatch" and wraps twice if asked twice; this registry keeps
``(owner, attribute, original)`` so ``install`` is idempotent and ``uninstall`` puts the exact
original object back (``vars(owner)[attribute] is original``).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import threading
import types
from typing import Any, Callable, Iterable, Optional

import wrapt

from threadgraph import _compat
from threadgraph._errors import ArgumentTypeError, UsageError

log = logging.getLogger("threadgraph")


class PatchWrapper(wrapt.FunctionWrapper):
    """Marks a wrapper as threadgraph's, so a second install never wraps it again."""


@dataclasses.dataclass(frozen=True)
class Patch:
    """One named replacement of a torch symbol; its record (releases, evidence) is in docs/patches.md."""

    name: str
    target: str  # "module.path:Owner.attribute" or "module.path:attribute"
    hazard: str  # why: the entry of docs/hazards.md it addresses (``_diagnostics.hazards.HAZARDS``)
    wrapper: Optional[Callable[..., Any]]  # a wrapt wrapper (wrapped, instance, args, kwargs)
    applies: Callable[[], bool] = lambda: True
    # Further targets, listed when the patch is installed (they can depend on the torch at hand).
    more_targets: Callable[[], list[str]] = lambda: []
    # Instead of a wrapt proxy, the object that replaces the original (for callables Dynamo must
    # inline, which it cannot do through a proxy): ``replace(original) -> replacement``.
    replace: Optional[Callable[[Any], Any]] = None
    # Torch symbols the patch relies on besides its targets ("module:Owner.attribute"): install()
    # checks them, as it checks the targets, against the verified releases (``verify``).
    assumes: tuple = ()
    # Run by uninstall once the targets are restored: what the patch changed beyond them (torch objects
    # its wrappers changed as they ran) is put back.
    undo: Optional[Callable[[], None]] = None

    def targets(self) -> list[str]:
        return [self.target, *self.more_targets()]

    def owner_and_attribute(self, target: Optional[str] = None) -> tuple[Any, str]:
        module_path, _, qualname = (target or self.target).partition(":")
        owner: Any = importlib.import_module(module_path)
        *parents, attribute = qualname.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, attribute

    def missing(self) -> list[str]:
        """The targets this torch lacks, as dotted symbols (``module.Owner.attribute``)."""
        missing = []
        for target in self.targets():
            try:
                owner, attribute = self.owner_and_attribute(target)
                present = hasattr(owner, attribute)
            except (ImportError, AttributeError):
                present = False
            if not present:
                missing.append(target.replace(":", "."))
        return missing

    def replacement_for(self, original: Any) -> Any:
        if self.replace is not None:
            return self.replace(original)
        return PatchWrapper(original, self.wrapper)


_ABSENT = object()  # the attribute was inherited, not set on the owner: uninstall deletes it


def patch_names(names: Optional[Iterable[str]], argument: str) -> frozenset:
    """``names`` as a set of patch names; one string is one name, not its characters."""
    if names is None:
        return frozenset()
    if isinstance(names, str):
        return frozenset({names})
    try:
        names = frozenset(names)
    except TypeError:
        raise ArgumentTypeError(f"threadgraph: {argument} takes a patch name or a list of them, got {names!r}") from None
    wrong = sorted(repr(n) for n in names if not isinstance(n, str))
    if wrong:
        raise ArgumentTypeError(f"threadgraph: {argument} takes patch names (strings), got {', '.join(wrong)}")
    return names


_SWAPPED_IN: set = set()  # the function bodies (code objects) threadgraph swapped in; they cannot be marked


def _is_threadgraphs(value: Any) -> bool:
    if isinstance(value, types.CodeType):  # a function's body swapped in (the function keeps its identity)
        return value in _SWAPPED_IN
    return isinstance(value, PatchWrapper) or hasattr(value, "__threadgraph_original__")


def _held_by_type(owner: Any, attribute: str) -> bool:
    """Whether ``attribute`` is a slot of the owner's type (a function's ``__code__``): set back, never deleted."""
    return inspect.isdatadescriptor(getattr(type(owner), attribute, None))


class Registry:
    def __init__(self, patches: list[Patch]) -> None:
        self._patches = {p.name: p for p in patches}
        self._originals: dict[str, list[tuple[Any, str, Any]]] = {}
        self._excluded: frozenset = frozenset()  # stays left out until uninstall()
        self._lock = threading.RLock()

    def check_known(self, names: frozenset, source: str = "") -> None:
        """Raise UsageError (a ValueError) for names that are no patch's; ``source`` says where they came from."""
        unknown = sorted(set(names) - set(self._patches))
        if unknown:
            raise UsageError(f"threadgraph: no patch named {unknown}{source}; known: {sorted(self._patches)}")

    def missing(self, exclude: Iterable[str] = ()) -> dict[str, list[str]]:
        """Symbol -> the patches that need it, for each target a patch ``install`` would apply lacks."""
        exclude = patch_names(exclude, "exclude")
        with self._lock:
            pending = [p for p in self._patches.values()
                       if p.name not in self._originals and p.name not in self._excluded | exclude and p.applies()]
        missing: dict[str, list[str]] = {}
        for patch in pending:
            for symbol in patch.missing():
                missing.setdefault(symbol, []).append(patch.name)
        return missing

    def install(self, exclude: Iterable[str] = (), also_missing: Optional[dict[str, list[str]]] = None) -> list[str]:
        """Apply every patch whose condition holds; returns the names newly applied.

        Raises one UnsupportedTorchError, with nothing replaced, when a target is missing or
        ``also_missing`` names symbols (symbol -> who needs it) the caller found missing."""
        exclude = patch_names(exclude, "exclude")
        self.check_known(exclude)
        with self._lock:
            missing = {symbol: list(users) for symbol, users in (also_missing or {}).items()}
            for symbol, users in self.missing(exclude).items():
                missing.setdefault(symbol, []).extend(users)
            if missing:
                raise _compat.unsupported_torch(missing)
            excluded = self._excluded | exclude
            applied: list[str] = []
            try:
                for patch in self._patches.values():
                    if patch.name in self._originals or patch.name in excluded or not patch.applies():
                        continue
                    replaced: list[tuple[Any, str, Any]] = []
                    # Registered before the first replacement, so a failure part-way undoes it too.
                    self._originals[patch.name] = replaced
                    applied.append(patch.name)
                    for target in patch.targets():
                        owner, attribute = patch.owner_and_attribute(target)
                        original = vars(owner).get(attribute, _ABSENT)
                        if original is _ABSENT and _held_by_type(owner, attribute):
                            original = getattr(owner, attribute)
                        # Wrap what the owner holds (a descriptor stays one); an inherited attribute is
                        # wrapped as it is looked up and set on the owner, shadowing the base's.
                        current = getattr(owner, attribute) if original is _ABSENT else original
                        if _is_threadgraphs(current):
                            continue
                        replacement = patch.replacement_for(current)
                        if isinstance(replacement, types.CodeType):
                            _SWAPPED_IN.add(replacement)
                        setattr(owner, attribute, replacement)
                        replaced.append((owner, attribute, original))
                        log.debug("threadgraph: patched %s (%s)", target, patch.name)
                    if not replaced:
                        del self._originals[patch.name]
                        applied.pop()
            except BaseException:
                self._restore(applied)
                raise
            self._excluded = excluded
        return applied

    def _restore(self, names: list[str]) -> None:
        for name in reversed(names):
            for owner, attribute, original in reversed(self._originals.pop(name)):
                if original is _ABSENT:
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, original)
            undo = self._patches[name].undo
            if undo is not None:
                undo()
            log.debug("threadgraph: restored %s", self._patches[name].target)

    def uninstall(self, names: Optional[Iterable[str]] = None) -> list[str]:
        """Put the originals back (of ``names`` only, if given), in reverse order; returns the names removed.

        A full uninstall also forgets what ``install(exclude=...)`` left out."""
        only = None if names is None else patch_names(names, "uninstall")
        with self._lock:
            if only is None:
                self._excluded = frozenset()
            removed = [name for name in reversed(list(self._originals)) if only is None or name in only]
            self._restore(removed[::-1])
        return removed

    def describe(self) -> list[dict[str, Any]]:
        rows = []
        with self._lock:
            for p in self._patches.values():
                condition = p.applies()
                missing = p.missing() if condition else []
                rows.append({
                    "name": p.name,
                    "target": p.target,
                    "targets": p.targets(),
                    "hazard": p.hazard,
                    # A patch whose condition holds but whose target this torch lacks does not apply.
                    "applies": condition and not missing,
                    "missing": missing,
                    "active": p.name in self._originals,
                })
        return rows
