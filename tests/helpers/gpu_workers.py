"""What the GPU scenarios run: the MLP training and inference workers, their references, and
how results are compared. Model: 24 x [Linear 512, GELU, LayerNorm], batch 16 (the
launch-bound model of the H200 measurements), float32 so results compare tightly."""

from __future__ import annotations

import time

import torch

import threadgraph
from benchmarks.small_model import allow_recompiles, mlp
from threadgraph import CompiledWorkerThread, WorkerGroup

WIDTH, DEPTH, BATCH = 512, 24, 16


def checksum(out: torch.Tensor) -> torch.Tensor:
    """A fixed random projection: LayerNorm outputs sum to ~0, so a plain sum would compare nothing."""
    proj = _projections.get(out.device)
    if proj is None:
        g = torch.Generator().manual_seed(4242)
        proj = _projections[out.device] = torch.randn(out.shape[-1], generator=g, dtype=torch.float64).to(out.device)
    return (out.double() * proj).sum()


_projections: dict = {}


def make_model(seed: int, device) -> torch.nn.Module:
    allow_recompiles()  # every worker compiles the same code: Dynamo counts each as a recompile
    return mlp(seed, device, WIDTH, DEPTH)


def make_data(seed: int, steps: int, device, batch: int = BATCH):
    g = torch.Generator().manual_seed(1000 + seed)
    xs = torch.randn(steps, batch, WIDTH, generator=g)
    ys = torch.randn(steps, batch, WIDTH, generator=g)
    return xs.to(device), ys.to(device)


class Trainer(CompiledWorkerThread):
    """Trains one MLP; keeps every loss on the device until the end."""

    def __init__(self, device, seed, steps, mode="reduce-overhead", switch_shape_at=None, **kw):
        super().__init__(device, max_steps=steps, warmup_steps=min(5, steps), **kw)
        self.seed, self.steps, self.mode, self.switch_shape_at = seed, steps, mode, switch_shape_at

    def setup(self):
        self.model = make_model(self.seed, self.device)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        model = self.model

        def loss_fn(x, y):
            return torch.nn.functional.mse_loss(model(x), y)

        if self.mode.startswith("whole-step"):
            opt = self.opt
            # whole-step-compiled: Inductor kernels (default mode, no Trees) inside the one graph
            inner = torch.compile(loss_fn) if self.mode == "whole-step-compiled" else loss_fn

            def train_step(x, y):
                loss = inner(x, y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=False)  # gradients stay static buffers of the graph
                return loss.detach()

            self.graph_step = threadgraph.capture_step(train_step)
        self.loss_fn = loss_fn if self.mode == "eager" or self.mode.startswith("whole-step") else torch.compile(loss_fn, mode=self.mode)
        self.xs, self.ys = make_data(self.seed, self.steps, self.device)
        if self.switch_shape_at is not None:  # a second input shape arrives mid-run
            self.xs2, self.ys2 = make_data(self.seed, self.steps, self.device, batch=BATCH * 2)
        self.losses = torch.zeros(self.steps, device=self.device)

    def step(self):
        i = self.stats.steps
        x, y = self.xs[i], self.ys[i]
        if self.switch_shape_at is not None and i >= self.switch_shape_at:
            x, y = self.xs2[i], self.ys2[i]
        if self.mode.startswith("whole-step"):
            self.losses[i] = self.graph_step(x, y)
            return
        loss = self.loss_fn(x, y)
        self.losses[i] = loss.detach()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def params(self):
        return torch.cat([p.detach().flatten() for p in self.model.parameters()]).cpu()

    def result(self):
        return {
            "name": self.name,
            "device": str(self.device),
            "losses": self.losses.cpu().tolist(),
            "p50_ms": self.stats.p50_ms,
            "p90_ms": self.stats.p90_ms,
            "warmup_s": round(self.stats.warmup_seconds, 2),
            "captures": self.stats.captures,
        }


class Inferer(CompiledWorkerThread):
    def __init__(self, device, seed, steps, **kw):
        super().__init__(device, max_steps=steps, warmup_steps=min(5, steps), **kw)
        self.seed, self.steps = seed, steps

    def setup(self):
        self.model = make_model(self.seed, self.device).eval()
        self.fn = torch.compile(self.model, mode="reduce-overhead")
        self.xs, _ = make_data(self.seed, self.steps, self.device)
        self.sums = torch.zeros(self.steps, device=self.device)

    def step(self):
        with torch.no_grad():
            out = self.fn(self.xs[self.stats.steps])
        self.sums[self.stats.steps] = checksum(out)

    def result(self):
        return {"name": self.name, "sums": self.sums.cpu().tolist(), "p50_ms": self.stats.p50_ms,
                "captures": self.stats.captures}


def run_group(workers, timeout=540):
    started = time.perf_counter()
    group = WorkerGroup(workers)
    group.start()
    group.join(timeout)
    return time.perf_counter() - started


def cudagraph_skips() -> int:
    from torch._dynamo.utils import counters

    return int(sum(counters["inductor"].get(k, 0) for k in counters["inductor"] if "cudagraph_skips" in k))


def main_thread_reference(seed, steps):
    """The same training on the main thread, reduce-overhead, as the reference."""
    model = make_model(seed, "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fn = torch.compile(lambda x, y: torch.nn.functional.mse_loss(model(x), y), mode="reduce-overhead")
    xs, ys = make_data(seed, steps, "cuda")
    losses = []
    for i in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        loss = fn(xs[i], ys[i])
        losses.append(loss.detach().clone())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return torch.stack(losses).cpu().tolist()


def throughput(workers, seconds):
    steps = sum(w.stats.steps - w.stats.warmup_steps for w in workers)
    return steps / seconds if seconds else None


def steady_seconds(workers):
    """Wall time of the steady state, from per-step times (max over workers of p50 * steps)."""
    return max(w.stats.p50_ms * (w.stats.steps - w.stats.warmup_steps) for w in workers) / 1e3


def close(a, b) -> bool:
    return bool(torch.allclose(torch.as_tensor(a), torch.as_tensor(b), rtol=1e-4, atol=1e-6))


def divergence(a, b) -> dict:
    """Where two loss curves part: first step off by more than the tolerance, and the worst gap."""
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    bad = ~torch.isclose(a, b, rtol=1e-4, atol=1e-6)
    first = int(bad.nonzero()[0]) if bad.any() else None
    return {"first_bad_step": first, "max_abs_diff": float((a - b).abs().max()), "max_rel_diff": float(((a - b).abs() / b.abs().clamp(min=1e-12)).max())}


def manual_floor(steps: int) -> float:
    """The GPU floor of the step: main thread, whole step captured by hand, replayed (p50 ms)."""
    model = make_model(0, "cuda")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    xs, ys = make_data(0, 1, "cuda")
    sx, sy = xs[0].clone(), ys[0].clone()

    def train_step():
        loss = torch.nn.functional.mse_loss(model(sx), sy)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    times = []
    for _ in range(steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        sx.copy_(xs[0], non_blocking=True)
        sy.copy_(ys[0], non_blocking=True)
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
