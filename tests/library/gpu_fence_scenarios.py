"""GPU scenarios for the eager fence, each meant to run in a fresh process.

    python -m tests.library.gpu_fence_scenarios repro_123177 [--threads 32] [--variant fenced|unfenced]
    python -m tests.library.gpu_fence_scenarios matrix --ops rng|compiled_rng|sync|host|memory --kind train|infer
                                              [--variant fenced|unfenced]

Every scenario prints one JSON object as its last line. ``tests/library/test_gpu_fence.py`` runs them in
subprocesses and asserts on the results; ``--variant unfenced`` leaves the fence's patches out
(every other patch stays), which shows what the fence is for. It lives beside the library's tests
because it watches the library's own state: the device gate's holders and each thread's captures.
"""

from __future__ import annotations

import argparse
import io
import json
import threading
import time
from collections import defaultdict

import torch
import torch.nn.functional as F

import threadgraph
from threadgraph._device.gate import gate_for
from threadgraph._patches import FENCE_PATCHES
from threadgraph._device.tls import current_worker


def _install(variant: str) -> None:
    threadgraph.install(exclude=FENCE_PATCHES if variant == "unfenced" else frozenset())


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"


# -- pytorch#123177's repro, as a user writes it --------------------------------------------------


def repro_123177(args) -> dict:
    """32 plain threads draw inputs with torch.rand and call one max-autotune function 3 times.

    The threads start together and draw fresh inputs before every call, so some draws meet other
    threads' recordings (drawn once, at the start, they mostly end before the first capture)."""
    _install(args.variant)
    fn = torch.compile(lambda x, y: x.sin() + y.cos(), mode="max-autotune")
    results = {}
    start = threading.Barrier(args.threads)

    def body(i: int) -> None:
        try:
            start.wait(60)
            equal = []
            for _ in range(3):  # warm-up, record, replay
                x = torch.rand(2, 3, device="cuda")
                y = torch.rand(2, 3, device="cuda")
                equal.append(bool(torch.allclose(fn(x, y), x.sin() + y.cos())))
            worker = current_worker()
            results[i] = {"equal": equal, "captures": worker.captures if worker else 0,
                          "warmups": worker.warmups if worker else 0}
        except BaseException as exc:
            results[i] = {"error": _first_line(exc)}

    threads = [threading.Thread(target=body, args=(i,), name=f"user-thread-{i}") for i in range(args.threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    errors = {i: r["error"] for i, r in results.items() if "error" in r}
    return {
        "threads": args.threads,
        "finished": len(results),
        "errors": errors,
        "all_equal": all(all(r["equal"]) for r in results.values() if "equal" in r),
        "captures": sorted(r.get("captures", 0) for r in results.values()),
        "warmups": sorted(r.get("warmups", 0) for r in results.values()),
        "not_recorded": {i: r for i, r in results.items() if r.get("captures") == 0},
        "inductor_counters": {k: v for k, v in _inductor_counters().items() if "cudagraph" in k},
    }


def _inductor_counters() -> dict:
    from torch._dynamo.utils import counters

    return dict(counters["inductor"])


# -- the matrix: a bystander thread's op class while workers warm up and record --------------------

WIDTH, DEPTH, STEPS, SHAPES = 256, 4, 32, (8, 16, 24, 32)  # a new shape (a recompile and a record) every 8 steps


def _model(seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(DEPTH):
        linear = torch.nn.Linear(WIDTH, WIDTH)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(WIDTH, WIDTH, generator=g) / WIDTH ** 0.5)
            linear.bias.zero_()
        layers += [linear, torch.nn.GELU()]
    return torch.nn.Sequential(*layers)


def _batches(seed: int, device) -> list:
    g = torch.Generator().manual_seed(100 + seed)
    out = []
    for step in range(STEPS):
        batch = SHAPES[step * len(SHAPES) // STEPS]
        out.append((torch.randn(batch, WIDTH, generator=g).to(device), torch.randn(batch, WIDTH, generator=g).to(device)))
    return out


def _step(model, opt, fn, x, y, kind):
    if kind == "infer":
        with torch.no_grad():
            return fn(x).double().sum().detach().clone()
    loss = fn(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach().clone()


class Worker(threadgraph.CompiledWorkerThread):
    def __init__(self, seed: int, kind: str):
        super().__init__("cuda:0", name=f"{kind}-worker-{seed}", max_steps=STEPS, warmup_steps=1)
        self.seed, self.kind, self.outputs = seed, kind, []

    def setup(self):
        self.model = _model(self.seed).to(self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-2)
        body = self.model if self.kind == "infer" else (lambda x, y: F.mse_loss(self.model(x), y))
        self.fn = torch.compile(body, mode="reduce-overhead", dynamic=False)
        self.batches = _batches(self.seed, self.device)

    def step(self):
        x, y = self.batches[self.stats.steps]
        self.outputs.append(_step(self.model, self.opt, self.fn, x, y, self.kind))


def _reference(seed: int, kind: str) -> list:
    model = _model(seed).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    fn = model if kind == "infer" else (lambda x, y: F.mse_loss(model(x), y))
    return [_step(model, opt, fn, x, y, kind).item() for x, y in _batches(seed, "cuda")]


def _check(condition: bool) -> None:
    if not condition:
        raise AssertionError("wrong result")


def _rng_ops() -> dict:
    def in_unit(t):
        _check(bool(((t >= 0) & (t < 1)).all()))

    return {
        "torch.rand": lambda: in_unit(torch.rand(4096, device="cuda")),
        "torch.randn": lambda: _check(torch.randn(4096, device="cuda").isfinite().all().item()),
        "torch.randint": lambda: _check(bool((torch.randint(0, 7, (4096,), device="cuda") < 7).all())),
        "torch.randperm": lambda: _check(torch.randperm(512, device="cuda").sort().values.equal(torch.arange(512, device="cuda"))),
        "torch.normal": lambda: _check(torch.normal(torch.zeros(64, device="cuda"), 1.0).isfinite().all().item()),
        "torch.bernoulli": lambda: _check(torch.bernoulli(torch.full((64,), 0.5, device="cuda")).le(1).all().item()),
        "torch.multinomial": lambda: _check(bool((torch.multinomial(torch.ones(16, device="cuda"), 4) < 16).all())),
        "Tensor.uniform_": lambda: in_unit(torch.empty(4096, device="cuda").uniform_()),
        "Tensor.normal_": lambda: _check(torch.empty(64, device="cuda").normal_().isfinite().all().item()),
        "Tensor.bernoulli_": lambda: _check(torch.empty(64, device="cuda").bernoulli_(0.5).le(1).all().item()),
        "Tensor.exponential_": lambda: _check(torch.empty(64, device="cuda").exponential_().ge(0).all().item()),
        "Tensor.random_": lambda: _check(torch.empty(64, device="cuda").random_(0, 5).lt(5).all().item()),
        "F.dropout": lambda: _check(F.dropout(torch.ones(64, device="cuda"), 0.5, training=True).le(2).all().item()),
        "nn.Dropout": lambda: _check(torch.nn.Dropout(0.5)(torch.ones(64, device="cuda")).le(2).all().item()),
    }


def _compiled_rng_ops() -> dict:
    fn = torch.compile(lambda x: F.dropout(x, 0.5, training=True) + torch.rand_like(x))  # default mode: uncaptured
    fn(torch.ones(64, device="cuda"))  # compile here, before the workers start
    return {"compiled dropout + rand_like": lambda: _check(bool(fn(torch.ones(64, device="cuda")).le(3).all()))}


def _sync_ops() -> dict:
    stream = torch.cuda.Stream()

    def on_stream():
        with torch.cuda.stream(stream):
            torch.ones(1024, device="cuda").mul_(2)
        stream.synchronize()

    def event():
        e = torch.cuda.Event()
        torch.ones(1024, device="cuda").mul_(2)
        e.record()
        e.synchronize()

    return {"torch.cuda.synchronize": torch.cuda.synchronize, "Stream.synchronize": on_stream, "Event.synchronize": event}


def _host_ops() -> dict:
    t = torch.arange(6, device="cuda", dtype=torch.float32)
    return {
        ".item()": lambda: _check(t.sum().item() == 15.0),
        ".cpu()": lambda: _check(t.cpu().tolist() == [0, 1, 2, 3, 4, 5]),
        ".tolist()": lambda: _check(t.tolist() == [0, 1, 2, 3, 4, 5]),
        ".numpy()": lambda: _check(t.cpu().numpy().sum() == 15.0),
        "nonzero": lambda: _check(t.nonzero().shape == (5, 1)),
        "print(tensor)": lambda: _check("5." in _printed(t)),
    }


def _printed(t) -> str:
    buffer = io.StringIO()
    print(t, file=buffer)
    return buffer.getvalue()


def _memory_ops() -> dict:
    sizes = iter(range(10**9))

    def alloc_free():
        n = (1 + next(sizes) % 7) * (8 << 20)  # new sizes keep the allocator asking the driver
        block = torch.empty(n, dtype=torch.uint8, device="cuda")
        block.fill_(1)
        del block

    return {"alloc/free": alloc_free, "torch.cuda.empty_cache": torch.cuda.empty_cache}


OP_CLASSES = {"rng": _rng_ops, "compiled_rng": _compiled_rng_ops, "sync": _sync_ops, "host": _host_ops, "memory": _memory_ops}


def matrix(args) -> dict:
    _install(args.variant)
    torch.cuda.init()
    ops = OP_CLASSES[args.ops]()
    references = {seed: _reference(seed, args.kind) for seed in range(3)}
    gate = gate_for("cuda:0")
    stats = defaultdict(lambda: {"calls": 0, "during_capture": 0, "errors": 0, "first_error": None})
    workers = [Worker(seed, args.kind) for seed in range(3)]
    done = threading.Event()

    def bystander():
        while not done.is_set():
            for name, op in ops.items():
                entry = stats[name]
                entry["calls"] += 1
                entry["during_capture"] += gate.holders()["exclusive"] is not None
                try:
                    op()
                except BaseException as exc:
                    entry["errors"] += 1
                    entry["first_error"] = entry["first_error"] or _first_line(exc)

    thread = threading.Thread(target=bystander, name="bystander")
    started = time.perf_counter()
    thread.start()
    group_error = None
    try:
        with threadgraph.WorkerGroup(workers) as group:
            group.join()
    except BaseException as exc:
        group_error = _first_line(exc.__cause__ or exc)  # the worker's own error, not WorkerError's wrapper
    done.set()
    thread.join(60)
    equal = []
    for worker in workers:
        outputs = [o.item() for o in worker.outputs]
        equal.append(len(outputs) == STEPS and torch.allclose(torch.tensor(outputs, dtype=torch.float64),
                                                              torch.tensor(references[worker.seed], dtype=torch.float64),
                                                              rtol=1e-4, atol=1e-5))
    try:
        torch.rand(8, device="cuda")
        rng_after = "ok"
    except BaseException as exc:
        rng_after = _first_line(exc)
    return {
        "ops": args.ops, "kind": args.kind, "variant": args.variant, "seconds": round(time.perf_counter() - started, 1),
        "ops_stats": dict(stats), "group_error": group_error, "workers_equal_reference": equal,
        "captures": [w.stats.captures for w in workers], "rng_in_main_thread_after": rng_after,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("scenario", choices=("repro_123177", "matrix"))
    p.add_argument("--threads", type=int, default=32)
    p.add_argument("--variant", choices=("fenced", "unfenced"), default="fenced")
    p.add_argument("--ops", choices=tuple(OP_CLASSES), default="rng")
    p.add_argument("--kind", choices=("train", "infer"), default="train")
    args = p.parse_args(argv)
    result = {"repro_123177": repro_123177, "matrix": matrix}[args.scenario](args)
    result["torch"] = torch.__version__
    result["gpu"] = torch.cuda.get_device_name(0)  # with torch: which results file the run's record belongs to
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
