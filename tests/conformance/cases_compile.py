"""Conformance cases that run on a CPU too: what torch.compile does around CUDAGraph Trees
(config patches, RNG lowering, cached-code runs, resets, skip messages), on the current device.
"""

from __future__ import annotations

import torch
import torch._dynamo.config as dynamo_config
import torch._inductor.config as inductor_config

from .observe import values


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


class CountingBackend:
    """A Dynamo backend that counts its compiles and runs the graph as traced."""

    def __init__(self) -> None:
        self.compiles = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.compiles += 1
        return gm.forward


@inductor_config.patch({"fallback_random": True, "implicit_fallbacks": False})
def rng_fallback_random_decorated() -> dict:
    """``fallback_random`` from a decorator, no implicit fallbacks: compiled draws equal eager's."""
    draw = torch.compile(lambda: torch.rand([20], device=_device()), mode="reduce-overhead")
    torch.manual_seed(0)
    compiled = [draw().clone() for _ in range(3)]
    torch.manual_seed(0)
    eager = [torch.rand([20], device=_device()) for _ in range(3)]
    return {"equal_to_eager": all(torch.equal(c, e) for c, e in zip(compiled, eager)),
            "values": values(compiled[2])}


def rng_inductor_random() -> dict:
    """Inductor's own random numbers: reseeding repeats them, successive calls differ."""
    draw = torch.compile(lambda x: x + torch.rand_like(x))
    x = torch.zeros(64, device=_device())
    torch.manual_seed(0)
    first = [draw(x).clone() for _ in range(2)]
    torch.manual_seed(0)
    again = [draw(x).clone() for _ in range(2)]
    return {"reseeded_equal": all(torch.equal(a, b) for a, b in zip(first, again)),
            "calls_differ": not torch.equal(first[0], first[1])}


def config_context_managers() -> dict:
    """Dynamo and Inductor config patched with context managers where the code runs."""
    record = {}
    for automatic in (True, False):
        backend = CountingBackend()
        scale = torch.compile(lambda x: x * 3, backend=backend)
        with dynamo_config.patch(automatic_dynamic_shapes=automatic):
            for n in (3, 4, 5, 6):
                scale(torch.ones(n))
        record[f"automatic_dynamic_shapes={automatic} compiles"] = backend.compiles
        torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True):
        record["inside"] = inductor_config.fallback_random
    record["outside"] = inductor_config.fallback_random
    return record


def dynamo_run_cached_code() -> dict:
    """``torch._dynamo.run`` uses what was compiled and compiles nothing new."""
    backend = CountingBackend()
    double = torch.compile(lambda x: x * 2 + 1, backend=backend)
    double(torch.ones(4))
    frozen = torch._dynamo.run(double)
    outs = [values(frozen(torch.full((4,), float(i)))) for i in range(3)]
    unseen = values(frozen(torch.ones(7, 7)))  # no cached code for it: runs uncompiled
    return {"compiles": backend.compiles, "outs": outs, "unseen_shape": unseen}


def resets_recompile() -> dict:
    """After ``torch._dynamo.reset()`` or ``torch.compiler.reset()`` the same call compiles again."""
    record = {}
    for name, reset in (("dynamo", torch._dynamo.reset), ("compiler", torch.compiler.reset)):
        backend = CountingBackend()
        add = torch.compile(lambda x: x + 1, backend=backend)
        add(torch.ones(3))
        add(torch.ones(3))
        reset()
        add(torch.ones(3))
        record[name] = backend.compiles
    return record


def cpu_tensors_skip_cudagraphs() -> dict:
    """reduce-overhead on CPU tensors runs without CUDA graphs and says why."""
    cube = torch.compile(lambda x: x * x * x, mode="reduce-overhead")
    out = [cube(torch.full((4,), 2.0)) for _ in range(3)][-1]
    return {"value": values(out)}


CASES = {f.__name__: f for f in (
    rng_fallback_random_decorated, rng_inductor_random, config_context_managers, dynamo_run_cached_code,
    resets_recompile, cpu_tensors_skip_cudagraphs,
)}
