"""``python -m threadgraph doctor --selftest``: reduce-overhead training and inference in worker
threads, each check in a fresh process, compared with the same work on the main thread."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from threadgraph._workers.group import WorkerGroup
from threadgraph._workers.worker import CompiledWorkerThread

WIDTH, DEPTH, BATCH, STEPS = 256, 8, 16, 60


def _model(device: str) -> torch.nn.Module:
    """DEPTH x [Linear, GELU, LayerNorm], the same weights in every thread: they are drawn from a
    private generator (a compile in another thread rewinds torch's global one, hazard global-rng-rewind)."""
    model = torch.nn.Sequential(*[m for _ in range(DEPTH)
                                  for m in (torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.LayerNorm(WIDTH))])
    g = torch.Generator().manual_seed(0)
    bound = WIDTH ** -0.5
    with torch.no_grad():
        for linear in model[::3]:
            linear.weight.uniform_(-bound, bound, generator=g)
            linear.bias.uniform_(-bound, bound, generator=g)
    return model.to(device)


def _data(device: str):
    g = torch.Generator().manual_seed(7)
    return torch.randn(STEPS, BATCH, WIDTH, generator=g).to(device), torch.randn(STEPS, BATCH, WIDTH, generator=g).to(device)


def _train(model, xs, ys, step_fn_holder):
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fn = torch.compile(lambda x, y: torch.nn.functional.mse_loss(model(x), y), mode="reduce-overhead")
    losses = torch.zeros(STEPS, device=xs.device)

    def step(i):
        loss = fn(xs[i], ys[i])
        losses[i] = loss.detach()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step_fn_holder.append(step)
    return losses


class _Worker(CompiledWorkerThread):
    def __init__(self, kind: str) -> None:
        super().__init__("cuda:0", name=f"selftest-{kind}", max_steps=STEPS, warmup_steps=5)
        self.kind = kind

    def setup(self) -> None:
        self.xs, self.ys = _data("cuda")
        model = _model("cuda")
        if self.kind == "train":
            holder: list = []
            self.out = _train(model, self.xs, self.ys, holder)
            self.run_step = holder[0]
        else:
            fn = torch.compile(model.eval(), mode="reduce-overhead")
            self.out = torch.zeros(STEPS, BATCH, WIDTH, device="cuda")

            def run_step(i):
                with torch.no_grad():
                    self.out[i] = fn(self.xs[i])

            self.run_step = run_step

    def step(self) -> None:
        self.run_step(self.stats.steps)


def _reference(kind: str) -> torch.Tensor:
    xs, ys = _data("cuda")
    model = _model("cuda")
    if kind == "train":
        holder: list = []
        losses = _train(model, xs, ys, holder)
        for i in range(STEPS):
            torch.compiler.cudagraph_mark_step_begin()
            holder[0](i)
        return losses
    with torch.no_grad():
        return torch.stack([model.eval()(xs[i]) for i in range(STEPS)])


def check(kind: str) -> dict:
    """Run one check in this process; returns a JSON-able verdict."""
    from threadgraph._patches import install

    # Before anything compiles: a graph compiled before install() keeps upstream's binding to
    # the compiling thread's tree manager (the reference below compiles the same code).
    install()
    reference = _reference(kind)
    worker = _Worker(kind)
    WorkerGroup([worker]).start().join(600)
    tol = dict(rtol=1e-4, atol=1e-6) if kind == "train" else dict(rtol=1e-3, atol=1e-3)
    ok = bool(torch.allclose(worker.out, reference, **tol))
    return {
        "check": f"{kind} in a worker thread, reduce-overhead",
        "passed": ok and worker.stats.captures > 0,
        "matches_main_thread": ok,
        "captures": worker.stats.captures,
        "p50_ms": worker.stats.p50_ms,
        "p90_ms": worker.stats.p90_ms,
        "warmup_s": round(worker.stats.warmup_seconds, 2),
    }


def run_all() -> list[dict]:
    results = []
    for kind in ("train", "infer"):
        proc = subprocess.run([sys.executable, "-m", __name__, kind], capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            lines = proc.stderr.strip().splitlines()
            error = lines[-1] if lines else f"its process exited with {proc.returncode} and wrote nothing on stderr"
            results.append({"check": kind, "passed": False, "error": error})
        else:
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


if __name__ == "__main__":
    print(json.dumps(check(sys.argv[1])))
