"""Captures that end without ``capture_end``, and captures made through ``torch.accelerator.Graph``.

The patch ``capture_begin_exclusive`` takes the device gate exclusively when a capture begins, and
``capture_end_exclusive`` gives it back when ``CUDAGraph.capture_end`` returns or raises. Two ways
around that pair:

- ``torch.cuda.graph.__enter__`` that fails after the capture began (a capture-start hook, the
  annotation set-up of 2.15) ends the capture with ``capture_end_pre()`` alone and raises, so
  ``capture_end`` never runs and the gate would stay held by a thread that is no longer capturing.
  ``enter_gives_gate_back`` (patch ``capture_failure_gives_gate_back``) gives it back there.
- ``torch.accelerator.Graph`` (2.13+) captures through its own ``capture_begin`` /
  ``capture_end``; the patches ``accelerator_capture_begin_exclusive`` and
  ``accelerator_capture_end_exclusive`` put the same gate around them.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("threadgraph")

GATE_ATTRIBUTE = "_threadgraph_capture_gate"  # where capture_begin_exclusive leaves the gate it took


def give_gate_back(graph: Any) -> bool:
    """Release the gate a capture of ``graph`` took, if it still holds one; returns whether it did."""
    gate = getattr(graph, GATE_ATTRIBUTE, None)
    if gate is None:
        return False
    setattr(graph, GATE_ATTRIBUTE, None)
    gate.release_exclusive()
    return True


def enter_gives_gate_back(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.cuda.graph.__enter__``: where it raises after its capture began, the capture's gate
    is given back before the error propagates (upstream ended the capture without ``capture_end``)."""
    try:
        return wrapped(*args, **kwargs)
    except BaseException:
        graph = getattr(instance, "cuda_graph", None)
        if graph is not None and give_gate_back(graph):
            log.debug("threadgraph: a capture failed to begin; its device gate was given back")
        raise

