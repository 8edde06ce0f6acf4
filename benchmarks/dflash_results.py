"""What the figures of a ``dflash_throughput`` results JSON compare with, decided in one place for
the report that writes them and for ``readme_tables.py`` and ``results_index.py`` that read them
(no torch import: those two read JSON only)."""

from __future__ import annotations

RESTART = "on the threaded cell's cache"  # how a sequential startup that is not a first run's is labelled


def startup_comparable(sequential: dict) -> bool:
    """Whether the sequential cell's startup is a first run's, as the threaded cell's always is: it
    started on an empty Inductor cache of its own (``inductor_cache``). Files from before per-cell
    caches, which came with ``compile_phases_s``, ran it on the threaded cell's cache."""
    default = "empty" if "compile_phases_s" in sequential else None
    return sequential.get("inductor_cache", default) == "empty"
