"""The launch-bound model of the hazard notes, depth x [Linear, GELU, LayerNorm], shared by the
benchmarks and the GPU scenarios (``tests/helpers/gpu_scenarios.py``)."""

from __future__ import annotations

import torch


def allow_recompiles() -> None:
    """Every thread compiles the same code for its own model, and Dynamo counts those compiles as
    recompiles of one function: raise its limits. Dynamo config is per thread from torch 2.12
    (hazard per-thread-config), so call this in every thread that compiles, before it compiles."""
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)
    if hasattr(torch._dynamo.config, "accumulated_recompile_limit"):
        torch._dynamo.config.accumulated_recompile_limit = 4096


def mlp(seed: int, device, width: int, depth: int, dtype=None) -> torch.nn.Module:
    """depth x [Linear, GELU, LayerNorm], with nn.Linear's default distribution.

    Initialised from a private generator, never torch's global one: every Dynamo compile saves
    the global RNG state when it starts and restores it when it ends, so a compile in another
    thread rewinds seeded global draws half-way through (hazard global-rng-rewind)."""
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(depth):
        linear = torch.nn.Linear(width, width, device="meta")
        bound = 1.0 / width**0.5
        linear.weight = torch.nn.Parameter(torch.empty(width, width).uniform_(-bound, bound, generator=g))
        linear.bias = torch.nn.Parameter(torch.empty(width).uniform_(-bound, bound, generator=g))
        layers += [linear, torch.nn.GELU(), torch.nn.LayerNorm(width)]
    return torch.nn.Sequential(*layers).to(device=device, dtype=dtype)
