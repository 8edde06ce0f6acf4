"""The DFlash trainer as a workload of the device gate: its 8 workers on one device gate on a CPU.

It lives beside the library's tests because it reaches into the gate (private) to simulate what
CUDAGraph Trees does on a GPU."""

import torch

from examples.dflash_trainer.train import train
from tests.helpers.tiny_run import tiny_config


def _trees_like_backend():
    """aot_autograd whose compiled forward and backward take the device gate exclusively on their
    first two calls, from inside execution, as CUDAGraph Trees' warmup and record do on a GPU."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    from threadgraph._device.gate import gate_for

    def compiler(gm, example_inputs):
        calls = [0]

        def run(*args):
            calls[0] += 1
            if calls[0] <= 2:
                with gate_for("cpu").exclusive():
                    return gm(*args)
            return gm(*args)

        return make_boxed_func(run)

    return aot_autograd(fw_compiler=compiler, bw_compiler=compiler)


def test_compiled_gated_pipeline_finishes_like_the_eager_one(tiny_assets, tmp_path, monkeypatch):
    """The one-GPU layout on a CPU: all 8 workers share one device gate, compile concurrently
    (Dynamo's compile lock, FX tracing, lazy backward compiles) and capture-like sections take the
    gate inside compiled calls. On an H200 this layout stalled behind queued compiles."""
    import threadgraph
    from examples.dflash_trainer.policy import ExecutionPolicy
    from threadgraph._workers import worker as _worker
    from threadgraph._device.gate import gate_for

    backend = _trees_like_backend()
    monkeypatch.setattr(_worker.CompiledWorkerThread, "gate", lambda self: gate_for(str(self.device)).shared())
    monkeypatch.setattr(ExecutionPolicy, "compile", lambda self, fn: torch.compile(fn, backend=backend))
    monkeypatch.setattr(gate_for("cpu"), "timeout", 120)
    torch._dynamo.reset()
    threadgraph.install()
    try:
        gated = train(tiny_config(tiny_assets, tmp_path / "gated", max_steps=8)).losses
    finally:
        torch._dynamo.reset()
    eager = train(tiny_config(tiny_assets, tmp_path / "eager", max_steps=8)).losses
    assert torch.allclose(torch.tensor(gated), torch.tensor(eager), rtol=1e-4, atol=1e-5), (gated, eager)
    assert gate_for("cpu").holders() == {"exclusive": None, "shared": [], "exclusive_waiting": 0}
