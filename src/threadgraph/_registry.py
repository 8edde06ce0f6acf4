"""A lock-guarded registry of named, reversible patches built on wrapt.

wrapt has no "unpatch" and wraps twice if asked twice; this registry keeps
``(owner, attribute, original)`` so ``install`` is idempotent and ``uninstall`` puts the exact
original object back (``vars(owner)[attribute] is original``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
from typing import Any, Callable, Optional

import wrapt

log = logging.getLogger("threadgraph")


class PatchWrapper(wrapt.FunctionWrapper):
    """Marks a wrapper as threadgraph's, so a second install never wraps it again."""


@dataclasses.dataclass(frozen=True)
class Patch:
    name: str
    target: str  # "module.path:Owner.attribute" or "module.path:attribute"
    hazard: str  # a name from the hazard catalogue (``_hazards.HAZARDS``)
    releases: str  # torch releases it applies to
    removable_when: str
    upstream: str  # verified upstream issues / pull requests, or "none known"
    wrapper: Optional[Callable[..., Any]]  # a wrapt wrapper (wrapped, instance, args, kwargs)
    applies: Callable[[], bool] = lambda: True
    read: str = "not recorded"  # releases whose source of the target was read
    run: str = "not recorded"  # releases the tests ran on (CPU, GPU with the machine)
    changes: str = "not recorded"  # what changed in the target between those releases
    # Further targets, listed when the patch is installed (they can depend on the torch at hand).
    more_targets: Callable[[], list[str]] = lambda: []
    # Instead of a wrapt proxy, the object that replaces the original (for callables Dynamo must
    # inline, which it cannot do through a proxy): ``replace(original) -> replacement``.
    replace: Optional[Callable[[Any], Any]] = None

    def targets(self) -> list[str]:
        return [self.target, *self.more_targets()]

    def owner_and_attribute(self, target: Optional[str] = None) -> tuple[Any, str]:
        module_path, _, qualname = (target or self.target).partition(":")
        owner: Any = importlib.import_module(module_path)
        *parents, attribute = qualname.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, attribute

    def replacement_for(self, original: Any) -> Any:
        if self.replace is not None:
            return self.replace(original)
        return PatchWrapper(original, self.wrapper)


_ABSENT = object()  # the attribute was inherited, not set on the owner: uninstall deletes it


def _is_threadgraphs(value: Any) -> bool:
    return isinstance(value, PatchWrapper) or hasattr(value, "__threadgraph_original__")


class Registry:
    def __init__(self, patches: list[Patch]) -> None:
        self._patches = {p.name: p for p in patches}
        self._originals: dict[str, list[tuple[Any, str, Any]]] = {}
        self._excluded: frozenset = frozenset()  # stays left out until uninstall()
        self._lock = threading.RLock()

    def install(self, exclude: frozenset = frozenset()) -> list[str]:
        """Apply every patch whose condition holds; returns the names newly applied."""
        unknown = set(exclude) - set(self._patches)
        if unknown:
            raise ValueError(f"threadgraph: no patch named {sorted(unknown)}; known: {sorted(self._patches)}")
        applied = []
        with self._lock:
            self._excluded |= frozenset(exclude)
            for patch in self._patches.values():
                if patch.name in self._originals or patch.name in self._excluded or not patch.applies():
                    continue
                replaced = []
                for target in patch.targets():
                    owner, attribute = patch.owner_and_attribute(target)
                    original = vars(owner).get(attribute, _ABSENT)
                    # Wrap what the owner holds (a descriptor stays one); an inherited attribute is
                    # wrapped as it is looked up and set on the owner, shadowing the base's.
                    current = getattr(owner, attribute) if original is _ABSENT else original
                    if _is_threadgraphs(current):
                        continue
                    setattr(owner, attribute, patch.replacement_for(current))
                    replaced.append((owner, attribute, original))
                    log.debug("threadgraph: patched %s (%s)", target, patch.name)
                if replaced:
                    self._originals[patch.name] = replaced
                    applied.append(patch.name)
        return applied

    def uninstall(self, names: Optional[frozenset] = None) -> list[str]:
        """Put the originals back (of ``names`` only, if given), in reverse order; returns the names removed.

        A full uninstall also forgets what ``install(exclude=...)`` left out."""
        removed = []
        with self._lock:
            if names is None:
                self._excluded = frozenset()
            for name in reversed(list(self._originals)):
                if names is not None and name not in names:
                    continue
                for owner, attribute, original in reversed(self._originals.pop(name)):
                    if original is _ABSENT:
                        delattr(owner, attribute)
                    else:
                        setattr(owner, attribute, original)
                removed.append(name)
                log.debug("threadgraph: restored %s", self._patches[name].target)
        return removed

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            return [
                {
                    "name": p.name,
                    "target": p.target,
                    "targets": p.targets(),
                    "hazard": p.hazard,
                    "releases": p.releases,
                    "removable_when": p.removable_when,
                    "upstream": p.upstream,
                    "read": p.read,
                    "run": p.run,
                    "changes": p.changes,
                    "applies": p.applies(),
                    "active": p.name in self._originals,
                }
                for p in self._patches.values()
            ]
