"""What the conformance cases read: tensors as short value lists, the calling thread's tree
manager and its counts, and the live blocks of CUDA graph memory pools. Every read is public
state a user's code or a debugging session can see; none of it names a thread."""

from __future__ import annotations

from typing import Any, Optional

import torch


def values(t: torch.Tensor, n: int = 4) -> list:
    """A tensor as its first ``n`` values (rounded) and its sum: enough to tell two results apart."""
    flat = t.detach().float().flatten().cpu()
    return [round(v, 4) for v in flat[:n].tolist()] + [round(float(flat.sum()), 3)]


def manager() -> Optional[Any]:
    """The calling thread's tree manager for its current CUDA device, or None."""
    trees = torch._inductor.cudagraph_trees
    return trees.get_container(torch.cuda.current_device()).tree_manager


def tree_shape() -> Optional[dict]:
    """The calling thread's trees: descendants under each root, graphs recorded, state, node kind."""
    m = manager()
    if m is None:
        return None
    roots = list(m.get_roots())
    node = m.current_node
    return {
        "root_descendants": sorted(r.num_descendants() for r in roots),
        "recorded": sum(1 + r.num_descendants() for r in roots),
        "state": m.path_state.name,
        "current": None if node is None else type(node).__name__,
        "checkpoints": m.debug_checkpointing_counter,
        "pending_backward": bool(m.running_forwards_with_pending_backwards),
    }


def live_blocks() -> int:
    """Allocated blocks in CUDA graph pools (any private pool) on the current device."""
    count = 0
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device", torch.cuda.current_device()) != torch.cuda.current_device():
            continue
        if tuple(segment["segment_pool_id"]) == (0, 0):
            continue
        count += sum(1 for block in segment["blocks"] if block["state"] == "active_allocated")
    return count


def rewind_generation() -> None:
    """Set Dynamo's process generation back by one, so the next compiled call joins the previous
    one's generation: what a function called inside another compiled function sees."""
    tracker = torch._dynamo.mutation_guard.GenerationTracker
    tracker.generation -= 1
