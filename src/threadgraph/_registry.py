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
from typing import Any, Callable

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
    wrapper: Callable[..., Any]
    applies: Callable[[], bool] = lambda: True
    read: str = "not recorded"  # releases whose source of the target was read
    run: str = "not recorded"  # releases the tests ran on (CPU, GPU with the machine)
    changes: str = "not recorded"  # what changed in the target between those releases

    def owner_and_attribute(self) -> tuple[Any, str]:
        module_path, _, qualname = self.target.partition(":")
        owner: Any = importlib.import_module(module_path)
        *parents, attribute = qualname.split(".")
        for parent in parents:
            owner = getattr(owner, parent)
        return owner, attribute


class Registry:
    def __init__(self, patches: list[Patch]) -> None:
        self._patches = {p.name: p for p in patches}
        self._originals: dict[str, tuple[Any, str, Any]] = {}
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
                owner, attribute = patch.owner_and_attribute()
                original = vars(owner)[attribute]
                if isinstance(original, PatchWrapper):
                    continue
                setattr(owner, attribute, PatchWrapper(original, patch.wrapper))
                self._originals[patch.name] = (owner, attribute, original)
                applied.append(patch.name)
                log.debug("threadgraph: patched %s (%s)", patch.target, patch.name)
        return applied

    def uninstall(self) -> list[str]:
        """Put every original back, in reverse order; returns the names removed."""
        removed = []
        with self._lock:
            self._excluded = frozenset()
            for name in reversed(list(self._originals)):
                owner, attribute, original = self._originals.pop(name)
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
