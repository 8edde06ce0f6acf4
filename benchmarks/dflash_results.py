"""A cell's ``inductor_cache`` values under the module name ``dflash_throughput.py`` imports them
from; they are defined, with what they mean, in ``results_schema.py``."""

from __future__ import annotations

from results_schema import EMPTY, SHARED  # noqa: F401
