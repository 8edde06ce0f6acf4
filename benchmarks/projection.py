"""A paper projection of the seed topology (5 target + 3 drafter workers, one GPU each, in one
process; and 8 such nodes under torchrun) from the one-GPU DFlash throughput measurements.

The model, first order: per batch the pipeline needs ``g`` ms of kernels (``gpu_ms_per_batch``) and
``h`` ms of host work holding the GIL (``host_gil_ms_per_batch``), both measured by the sequential
loop on one GPU. G GPUs kept busy by one process need G * h ms of GIL every g ms, so the GIL
saturates at g / h GPUs; one process per GPU has a GIL each. Rendered into docs/projection.md by
``python -m benchmarks readme``.
"""

from __future__ import annotations

from typing import Callable, Sequence

SEED_GPUS = 8  # 5 target + 3 drafter workers, one GPU each


def _shares(feedable: float) -> tuple[float, float]:
    """The share of the GPU-bound figure on SEED_GPUS GPUs: one process of threads, one process per GPU."""
    return min(1.0, feedable / SEED_GPUS), min(1.0, feedable)


def _verdict(feedable: float) -> str:
    threads, processes = _shares(feedable)
    if feedable >= 2 * SEED_GPUS:
        return "threads match one process per GPU (the GIL at most half busy)"
    if feedable >= SEED_GPUS:
        return "threads match one process per GPU, with the GIL over half busy"
    return f"the GIL saturates first: threads reach {threads / processes:.2f} of one process per GPU"


def section(runs: Sequence, link: Callable) -> str:
    """The projection table from ``runs`` (the newest dflash-throughput results per shape and graphs
    mode, as benchmarks.render.newest_runs gives them); ``link(results)`` is a results file's link."""
    rows = [r for r in runs if r.data.get("gpu_ms_per_batch") and r.data.get("host_gil_ms_per_batch")]
    if not rows:
        return "No dflash-throughput results with GPU and GIL times per batch committed yet (`python -m benchmarks dflash-throughput`)."
    lines = [f"| target | graphs | g: kernels ms per batch | h: GIL-held host ms per batch | GPUs one process feeds (g / h) "
             f"| one node, {SEED_GPUS} GPUs: share of GPU-bound, threads / one process per GPU | measured on one GPU: threaded, sequential (share of "
             f"GPU-bound) | results |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        d = r.data
        g, h = d["gpu_ms_per_batch"], d["host_gil_ms_per_batch"]
        feedable = g / h
        measured = ", ".join(f"{d[k]:.2f}" if d.get(k) is not None else "-"
                             for k in ("ratio_threaded_to_gpu_bound", "ratio_sequential_to_gpu_bound"))
        threads, processes = _shares(feedable)
        lines.append(f"| {d['shape']} | {d['graphs']} | {g:.2f} | {h:.2f} | {feedable:.1f} | {threads:.2f} / {processes:.2f}: "
                     f"{_verdict(feedable)} | {measured} | {link(r)} |")
    return "\n".join(lines)
