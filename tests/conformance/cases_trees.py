"""Conformance cases that need a CUDA GPU: CUDAGraph Trees' own behaviour, one class each.

Each case builds its own functions and inputs, seeds what it draws, and returns plain data:
whatever differs between placements is a difference a user would see.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch._inductor.config as inductor_config

from .observe import live_blocks, manager, rewind_generation, tree_shape, values

TREES = "reduce-overhead"
REPO = f"{Path(__file__).resolve().parents[2]}/"  # upstream's messages name our frames' files: relative in results


def _rand(*shape: int, grad: bool = False) -> torch.Tensor:
    return torch.rand(*shape, device="cuda", requires_grad=grad)


def recording_counts() -> dict:
    """Warm-up, record, replay per input shape: how many graphs, under how many roots."""
    cube = torch.compile(lambda x: x * x * x, mode=TREES)
    seen = {}
    for shape in ((4, 4), (6, 6)):
        torch.manual_seed(0)
        for call in range(3):
            out = cube(_rand(*shape))
            seen[f"{shape[0]}x{shape[1]} call {call}"] = tree_shape()
        seen[f"{shape[0]}x{shape[1]} out"] = values(out)
    return seen


def modes_in_order() -> dict:
    """The manager's state and node kind after each call, and the pool blocks a live output holds."""
    add = torch.compile(lambda x: x + x, mode=TREES)
    steps = []
    for _ in range(4):
        out = add(torch.ones(8, device="cuda"))
        steps.append({**tree_shape(), "live_blocks": live_blocks()})
        del out
        steps.append({"after_del_live_blocks": live_blocks()})
    return {"steps": steps}


def checkpoint_accounting() -> dict:
    """A second function recorded in the first one's generation forces a checkpoint of the pool."""
    square = torch.compile(lambda x: x @ x, mode=TREES)
    pair = torch.compile(lambda x: (x[0], x @ x), mode=TREES)
    torch.manual_seed(0)
    for _ in range(3):
        square(_rand(16, 16))
    record = {"checkpoints_before": tree_shape()["checkpoints"]}
    for turn in range(2):
        out = square(_rand(16, 16))
        rewind_generation()
        alias, out2 = pair(out)
        del alias
        record[f"turn {turn}"] = [live_blocks(), tree_shape()["checkpoints"]]
        del out
        record[f"turn {turn} out dropped"] = live_blocks()
        record[f"turn {turn} value"] = values(out2)
        del out2
        record[f"turn {turn} all dropped"] = live_blocks()
    record["trees"] = tree_shape()
    return record


def pending_backward_and_mark_step() -> dict:
    """Forwards whose backward never runs, then an explicit step boundary."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8, device="cuda")
    step = torch.compile(lambda x: layer(x).relu(), mode=TREES)
    record = {}
    for call in range(3):
        out = step(_rand(4, 8, grad=True))
        record[f"forward only {call}"] = tree_shape()
    torch.compiler.cudagraph_mark_step_begin()
    out = step(_rand(4, 8, grad=True))
    out.sum().backward()
    record["after mark step and backward"] = tree_shape()
    record["grad"] = values(layer.weight.grad)
    return record


def overwritten_output() -> dict:
    """Outputs of a warm-up and of a recording, read after a later step ran the function again, raise
    with upstream's message; the newest output reads fine."""
    double = torch.compile(lambda x: x * 2, mode=TREES)
    x = torch.ones(4, device="cuda")
    outs = []
    for _ in range(3):
        torch.compiler.cudagraph_mark_step_begin()
        outs.append(double(x))
    read = []
    for out in outs:
        try:
            read.append(values(out + 1))
        except RuntimeError as exc:
            read.append(str(exc).splitlines()[0].replace(REPO, ""))
    return {"reads": read}


def _without_partitions() -> object:
    # Graph partitioning (where this torch has it) graphs the CUDA part of a graph and runs the
    # rest outside; without it a whole graph is skipped, with a message saying why.
    if hasattr(inductor_config, "graph_partition"):
        return inductor_config.patch(graph_partition=False)
    return contextlib.nullcontext()


def mutated_input_skip() -> dict:
    """A function that mutates its input is not graphed, and says why."""
    bump = torch.compile(lambda x: x.add_(1), mode=TREES)
    x = torch.zeros(4, device="cuda")
    for _ in range(3):
        bump(x)
    return {"value": values(x), "trees": tree_shape()}


def cpu_input_skip() -> dict:
    """A CPU tensor among the inputs: graphed in parts where partitions exist, skipped whole without."""
    record = {}
    for name, context in (("default", contextlib.nullcontext()), ("no partitions", _without_partitions())):
        torch._dynamo.reset()
        with context:
            mixed = torch.compile(lambda x, y: (x + 1, y + 2), mode=TREES)
            outs = [mixed(torch.ones(4, device="cuda"), torch.ones(4)) for _ in range(3)][-1]
        record[name] = {"values": [values(o) for o in outs], "trees": tree_shape()}
    return record


@inductor_config.patch("triton.cudagraph_skip_dynamic_graphs", True)
def dynamic_shape_skip() -> dict:
    """With dynamic shapes skipped (a decorator's config patch), a dynamic graph is not graphed."""
    record = {}
    for name, context in (("default", contextlib.nullcontext()), ("no partitions", _without_partitions())):
        torch._dynamo.reset()
        with context:
            add = torch.compile(lambda x, y: x + y, mode=TREES, dynamic=True)
            for n in (5, 7, 9):
                out = add(torch.ones(n, device="cuda"), torch.ones(n, device="cuda"))
        record[name] = {"value": values(out), "trees": tree_shape()}
    return record


def _rng_runs() -> dict:
    draw = torch.compile(lambda: torch.rand(32, device="cuda") + torch.randn(32, device="cuda"), mode=TREES)
    torch.manual_seed(0)
    first = [draw().clone() for _ in range(3)]
    torch.manual_seed(0)
    again = [draw().clone() for _ in range(3)]
    return {"reseeded_runs_equal": all(torch.equal(a, b) for a, b in zip(first, again)),
            "runs_differ": not torch.equal(first[0], first[1]), "values": values(first[2])}


def rng_trees() -> dict:
    """Random draws in graphed code: reproducible under a seed, different each call."""
    return _rng_runs()


@inductor_config.patch("fallback_random", True)
def rng_trees_fallback_random() -> dict:
    """The same with ``fallback_random`` set by a decorator: the compiled draws are eager's."""
    record = _rng_runs()
    torch.manual_seed(0)
    eager = torch.rand(32, device="cuda") + torch.randn(32, device="cuda")
    record["eager_values"] = values(eager)
    return record


def dynamo_run_frozen() -> dict:
    """``torch._dynamo.run`` replays cached code without compiling or recording anew."""
    square = torch.compile(lambda x: x @ x, mode=TREES)
    torch.manual_seed(0)
    for _ in range(3):
        square(_rand(10, 10))
    record = {"compiled": tree_shape()}
    frozen = torch._dynamo.run(square)
    for _ in range(3):
        out = frozen(_rand(10, 10))
    record["frozen"] = tree_shape()
    record["next_graph_id"] = manager().new_graph_id().id
    record["value"] = values(out)
    return record


def reset_cleanup() -> dict:
    """``torch._dynamo.reset()`` and ``torch.compiler.reset()`` drop the thread's trees."""
    record = {}
    for name, reset in (("dynamo", torch._dynamo.reset), ("compiler", torch.compiler.reset)):
        add = torch.compile(lambda x: x + 3, mode=TREES)
        for _ in range(3):
            out = add(torch.ones(4, device="cuda"))
        record[f"{name} before"] = [manager() is not None, live_blocks()]
        del out
        reset()
        record[f"{name} after"] = [manager() is None, live_blocks()]
    return record


def parameter_and_output_aliases() -> dict:
    """Outputs that are a parameter, a view of it, and a view of another output."""

    class Aliases(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.arange(16.0, device="cuda").reshape(4, 4))

        def forward(self, x):
            y = self.weight + x
            return self.weight, self.weight[0], y, y[1]

    module = Aliases()
    run = torch.compile(module, mode=TREES)
    for _ in range(3):
        outs = run(torch.ones(4, 4, device="cuda"))
    return {
        "is_parameter": outs[0] is module.weight or outs[0].data_ptr() == module.weight.data_ptr(),
        "view_of_parameter": outs[1].data_ptr() == module.weight.data_ptr(),
        "view_of_output": outs[3].untyped_storage().data_ptr() == outs[2].untyped_storage().data_ptr(),
        "values": [values(o) for o in outs],
        "live_weakrefs": len(list(manager().current_node.path_live_weakrefs())),
    }


def amp_cache() -> dict:
    """Autocast does not cache casts of graph outputs: a changed output gives a changed product."""
    add = torch.compile(lambda x: x + x, mode=TREES)
    torch.manual_seed(0)
    for _ in range(3):
        out = add(torch.rand(4, 4, device="cuda", requires_grad=True))
    other = torch.rand(4, 4, device="cuda")
    with torch.autocast("cuda"):
        before = out @ other
        out.detach().zero_()
        after = out @ other
    return {"product_changed": not torch.equal(before, after), "after": values(after)}


def static_inputs() -> dict:
    """Parameters are static inputs: replaced parameters re-record, a changed input batch does not."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 8, device="cuda")
    run = torch.compile(layer, mode=TREES)
    for _ in range(3):
        run(_rand(2, 8))
    record = {"first": tree_shape()}
    with torch.no_grad():
        layer.weight = torch.nn.Parameter(layer.weight.detach().clone() * 2)
    for _ in range(3):
        out = run(_rand(2, 8))
    record["after new parameter"] = tree_shape()
    record["value"] = values(out)
    return record


def side_stream() -> dict:
    """Calls from a side stream see their own inputs and give eager's outputs."""
    chain = torch.compile(lambda x: (x @ x).tanh() @ x, mode=TREES)
    torch.manual_seed(0)
    x = _rand(256, 256)
    expected = (x @ x).tanh() @ x
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        outs = [chain(x) for _ in range(3)]
        result = outs[-1] + 0
    torch.cuda.current_stream().wait_stream(stream)
    return {"matches_eager": torch.allclose(result, expected, rtol=1e-3, atol=1e-3), "trees": tree_shape()}


def config_patches_in_place() -> dict:
    """Config patches as a decorator and as a context manager where the code runs."""

    @inductor_config.patch("triton.cudagraph_trees", False)
    def without_trees() -> list:
        add = torch.compile(lambda x: x + 5, mode=TREES)
        return [values(add(torch.ones(4, device="cuda"))) for _ in range(3)]

    record = {"decorated": without_trees(), "decorated_trees": tree_shape()}
    torch._dynamo.reset()
    with inductor_config.patch({"triton.cudagraphs": False}):
        add = torch.compile(lambda x: x + 6, mode=TREES)
        record["context"] = [values(add(torch.ones(4, device="cuda"))) for _ in range(3)]
    record["context_trees"] = tree_shape()
    return record


CASES = {f.__name__: f for f in (
    recording_counts, modes_in_order, checkpoint_accounting, pending_backward_and_mark_step, overwritten_output,
    mutated_input_skip, cpu_input_skip, dynamic_shape_skip, rng_trees, rng_trees_fallback_random,
    dynamo_run_frozen, reset_cleanup, parameter_and_output_aliases, amp_cache, static_inputs, side_stream,
    config_patches_in_place,
)}
