"""The hazards ``doctor`` lists: each one's name (an entry of docs/hazards.md, which describes it)
and how this torch is tested for it. A hazard without a detection is assumed present."""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from threadgraph import _compat


@dataclasses.dataclass(frozen=True)
class Hazard:
    name: str
    detect: Optional[Callable[[], bool]] = None  # None: not detectable, assumed present

    def status(self) -> str:
        """``present`` or ``absent`` (detected), or ``assumed`` (no detection)."""
        if self.detect is None:
            return "assumed"
        return "present" if self.detect() else "absent"


HAZARDS: tuple[Hazard, ...] = (
    Hazard("tls-assert", _compat.get_obj_asserts),
    Hazard("global-generation", _compat.generation_counters_are_global),
    Hazard("device-wide-capture"),
    Hazard("capture-lock-order", _compat.has_graph_capture_lock),
    Hazard("autograd-device-thread"),
    Hazard("global-compile-lock", _compat.has_global_compile_lock),
    Hazard("concurrent-first-compile"),
    Hazard("stash-steals-reference", lambda: not _compat.stash_takes_reference()),
    Hazard("stash-released-at-thread-exit", _compat.thread_exit_during_finalization_aborts),
    Hazard("per-thread-device"),
    Hazard("per-thread-config"),
    Hazard("shared-cudagraphify-state"),
    Hazard("global-fx-tracing-flag", _compat.fx_tracing_flag_is_global),
    Hazard("global-compile-session-flag", _compat.compile_session_flag_is_global),
    Hazard("global-fx-patcher", _compat.fx_patcher_is_global),
    Hazard("global-rng-rewind"),
    Hazard("global-default-dtype"),
    Hazard("overload-hash", _compat.overloads_hash_their_op),
    Hazard("dynamo-wrapper-chain", _compat.dynamo_checks_wrapper_ids),
)

_BY_NAME = {hazard.name: hazard for hazard in HAZARDS}


def get(name: str) -> Hazard:
    """The hazard called ``name``; a ``KeyError`` lists the known names."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise KeyError(f"threadgraph: no hazard named {name!r}; known: {sorted(_BY_NAME)}") from None


def names() -> list[str]:
    return [hazard.name for hazard in HAZARDS]


def report() -> list[dict]:
    """Every hazard with its status on this torch and the patches that address it."""
    from threadgraph._patches import PATCHES

    return [
        {
            "name": hazard.name,
            "status": hazard.status(),
            "patches": [p.name for p in PATCHES if p.hazard == hazard.name],
        }
        for hazard in HAZARDS
    ]
