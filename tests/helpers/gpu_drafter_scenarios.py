"""The DFlash drafter's compiled forward and backward alone, in one placement, in a fresh process.

    python -m tests.helpers.gpu_drafter_scenarios PLACEMENT [--steps N] [--device cuda]
        [--backend inductor|aot_eager|eager]
        [--sdpa default|math] [--warmup-modes on|off] [--autograd-threads on|off]

The trainer's Trees mode crashes (SIGSEGV) on torch 2.14.1 in the first warm-up of a drafter's
compiled backward; whole-step and eager modes run. These placements tell where it comes from:
``main`` (no threadgraph at all), ``main-install`` (``install()``, main thread), ``thread`` (one
plain thread after ``install()``) and ``threads-3`` (three at once, as the trainer's drafters).
The step is the trainer's own (drafter.step.make_step_fn and make_forward_backward) on random
inputs of the trainer's default shapes. Prints one JSON object: each thread's first and last loss and
gradient norm, the same of the step run eagerly (not compiled) in the main thread afterwards, with each
thread's seed, and the cuDNN version this torch loaded. The switches take one suspect away each: ``--sdpa math``
the fused attention kernels, ``--warmup-modes off`` the dispatch modes Inductor's CUDA-graph warm-up
and recording enter (2.13+), ``--autograd-threads off`` autograd's device thread (backward then
runs on the calling thread).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import threading
import types

import torch

from examples.dflash_trainer.drafter.grads import FlatGrads
from examples.dflash_trainer.drafter.loss import anchors_from_scores
from examples.dflash_trainer.drafter.model import DFlashDrafter
from examples.dflash_trainer.drafter.step import METRIC_NAMES, make_forward_backward, make_step_fn

PLACEMENTS = ("main", "main-install", "thread", "threads-3")
# The trainer's defaults (config.TrainConfig) and a small Qwen3-style target.
BATCH, SEQ, BLOCK, ANCHORS, LAYERS, VOCAB = 4, 256, 8, 16, 2, 1024
TARGET = types.SimpleNamespace(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                               intermediate_size=512, rms_norm_eps=1e-6, rope_theta=1e6)


def drafter_steps(seed: int, steps: int, device: str, backend: str | None) -> tuple[list[float], list[float]]:
    """``steps`` compiled forward-backward calls of a freshly built drafter (``backend`` None: not
    compiled, the eager reference); the losses and the gradients' norms."""
    # Every random draw from a private generator: threads share torch's global one (and each Dynamo
    # compile rewinds it), and the eager reference must see the same weights and inputs as the thread.
    gen = torch.Generator().manual_seed(seed)
    bf16 = torch.device(device).type == "cuda"
    frozen = torch.bfloat16 if bf16 else torch.float32
    hidden = TARGET.hidden_size
    embed = torch.nn.Embedding(VOCAB, hidden, _weight=torch.randn(VOCAB, hidden, generator=gen))
    head = torch.nn.Linear(hidden, VOCAB, bias=False)
    with torch.no_grad():
        head.weight.copy_((torch.rand(VOCAB, hidden, generator=gen) * 2 - 1) / hidden ** 0.5)
    embed, head = (m.to(device, frozen).requires_grad_(False) for m in (embed, head))
    drafter = DFlashDrafter.from_target_config(TARGET, embed, head, LAYERS, LAYERS, generator=gen).to(device)
    grads = FlatGrads([p for p in drafter.parameters() if p.requires_grad], extras=len(METRIC_NAMES))
    step = make_step_fn(drafter, block_size=BLOCK, gamma=7.0, mask_token_id=VOCAB - 1,
                        autocast_dtype=torch.bfloat16 if bf16 else None)
    if backend is None:
        compiled = step
    else:
        compiled = torch.compile(step, backend=backend, **({"mode": "reduce-overhead"} if backend == "inductor" else {}))
    forward_backward = make_forward_backward(compiled, grads)
    ids = torch.randint(0, VOCAB - 1, (BATCH, SEQ), generator=gen).to(device)
    loss_mask = torch.ones(BATCH, SEQ, dtype=torch.long, device=device)
    features = torch.randn(BATCH, SEQ, LAYERS * hidden, generator=gen).to(device, frozen)
    anchors, keep = anchors_from_scores(loss_mask, ANCHORS, torch.rand(BATCH, SEQ, generator=gen).to(device))
    losses, norms = [], []
    with torch.autograd.set_multithreading_enabled(AUTOGRAD_THREADS[0]):
        for _ in range(steps):
            forward_backward(ids, loss_mask, features, anchors, keep)
            losses.append(float(grads.extras[0]))
            norms.append(float(torch.linalg.vector_norm(grads.grads.double())))
    return losses, norms


AUTOGRAD_THREADS = [True]  # --autograd-threads: whether backward runs on autograd's device thread


def take_away(sdpa: str, warmup_modes: str, autograd_threads: str) -> list[str]:
    """Apply the switches (see the module's doc); the suspects taken away."""
    gone = []
    if sdpa == "math":
        for backend in ("cudnn", "flash", "mem_efficient"):
            getattr(torch.backends.cuda, f"enable_{backend}_sdp")(False)
        gone.append("fused attention")
    if warmup_modes == "off":
        import torch._inductor.cudagraph_trees as trees

        for name in ("ControlFlowOpWarmupDispatchMode", "CUDAGraphCaptureControlFlowOpDispatchMode"):
            if hasattr(trees, name):
                setattr(trees, name, contextlib.nullcontext)
                gone.append(name)
    if autograd_threads == "off":
        AUTOGRAD_THREADS[0] = False
        gone.append("autograd device thread")
    return gone


def run(placement: str, steps: int, device: str, backend: str) -> dict:
    if placement != "main":
        import threadgraph

        threadgraph.install()
    if placement in ("main", "main-install"):
        results = {0: drafter_steps(0, steps, device, backend)}
    else:
        results = _in_threads(3 if placement == "threads-3" else 1, steps, device, backend)
    # the reference: the same seeds' steps, not compiled, in this thread once the others are done
    eager = [drafter_steps(i, steps, device, None) for i in sorted(results)]
    return {"placement": placement, "losses": [results[i][0] for i in sorted(results)],
            "grad_norms": [results[i][1] for i in sorted(results)],
            "eager": {"losses": [e[0] for e in eager], "grad_norms": [e[1] for e in eager]}}


def _in_threads(count: int, steps: int, device: str, backend: str) -> dict:
    """Seed -> drafter_steps of ``count`` plain threads at once, seeds 0, 1, ..."""
    results, errors = {}, {}

    def body(i: int) -> None:
        try:
            results[i] = drafter_steps(i, steps, device, backend)
        except BaseException as exc:  # reported in the result, and the run fails below
            errors[i] = f"{type(exc).__name__}: {exc}"
        finally:
            import threadgraph

            threadgraph.release_cudagraph_tls()

    threads = [threading.Thread(target=body, args=(i,), name=f"drafter-{i}") for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"drafter threads failed: {errors}")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("placement", choices=PLACEMENTS)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="inductor", choices=("inductor", "aot_eager", "eager"))
    parser.add_argument("--sdpa", default="default", choices=("default", "math"))
    parser.add_argument("--warmup-modes", default="on", choices=("on", "off"))
    parser.add_argument("--autograd-threads", default="on", choices=("on", "off"))
    args = parser.parse_args(argv)
    gone = take_away(args.sdpa, args.warmup_modes, args.autograd_threads)
    result = run(args.placement, args.steps, args.device, args.backend)
    result.update(torch=torch.__version__, cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None,
                  taken_away=gone)
    print(json.dumps(_first_and_last(result)))


def _first_and_last(value):
    """Each list of per-step numbers in ``value`` as its first and last (the whole run is too long to print)."""
    if isinstance(value, dict):
        return {k: _first_and_last(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], list):
        return [[round(x, 6) for x in (run[0], run[-1])] for run in value]
    return value


if __name__ == "__main__":
    main()
