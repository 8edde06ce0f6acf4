"""What the figures of a ``dflash_throughput`` results JSON compare with, decided in one place for
the report that writes them and for ``readme_tables.py`` and ``results_index.py`` that read them
(no torch import: those two read JSON only)."""

from __future__ import annotations

EMPTY, SHARED = "empty", "the threaded cell's (a restart)"  # a cell's ``inductor_cache``: what it started on
# What the threaded 5 target + 3 drafter pipeline was aimed to reach in tokens/s over the sequential
# colocated loop (benchmarks/README.md, Targets).
TARGET_RATIO = 1.5
RESTART = "on the threaded cell's cache"  # how a sequential startup that is not a first run's is labelled


def inductor_cache(cell: dict) -> str:
    """The Inductor cache a cell started on, also for files from before per-cell caches (which came
    with ``compile_phases_s``), whose sequential cell ran on the threaded cell's cache."""
    return cell.get("inductor_cache", EMPTY if "compile_phases_s" in cell else SHARED)


def startup_comparable(sequential: dict) -> bool:
    """Whether the sequential cell's startup is a first run's, as the threaded cell's always is: it
    started on an empty Inductor cache of its own (``inductor_cache``). Files from before per-cell
    caches ran it on the threaded cell's cache."""
    return inductor_cache(sequential) == EMPTY
