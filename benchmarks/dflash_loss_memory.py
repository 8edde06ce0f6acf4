"""Peak memory of the DFlash drafter loss at Qwen3's vocabulary, dense and chunked, on the CPU.

The trainer's memory estimate of a whole drafter step is set beside its measured peak too.

Each measurement runs in a fresh Python process (``--child``), so one does not inherit another's
allocations: the child builds its inputs, reads its resident set size (``/proc/self/status``), runs
the loss (or the drafter step) forward and backward once, and reports the peak resident size after it
(``VmHWM``, reset just before the work through ``/proc/self/clear_refs``) minus the resident size before
it: the bytes the work added at its peak. glibc is told to hand every
allocation of 64 KiB or more straight back to the system (``MALLOC_MMAP_THRESHOLD_``), so the
resident size follows the live tensors rather than the allocator's free lists.

- loss: hidden states ``[tokens, hidden]`` through a frozen LM head ``[vocab, hidden]`` (float32),
  the dense ``dflash_loss`` of the full logits against ``dflash_head_loss`` (drafter/chunked_ce.py);
- step: the trainer's drafter step (``make_step_fn`` and a backward) at a scaled shape with the full
  vocabulary, against ``assets.sizes.drafter_step_bytes`` for that shape.

    python -m benchmarks dflash-loss-memory --out-dir benchmarks/results
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from types import SimpleNamespace

from . import common

QWEN3_VOCAB = 151_936
THEME = "dflash-loss-memory"
# The scaled drafter step: the paper's block size and gamma, fewer anchors, a narrow drafter, Qwen3's vocabulary.
STEP_SHAPE = dict(hidden=256, heads=4, kv_heads=2, head_dim=64, intermediate=768, layers=2, feature_layers=2,
                  batch=2, seq_len=512, anchors=64, block_size=16)


def _status_bytes(field: str) -> int:
    """A ``/proc/self/status`` size (``VmRSS``: resident now; ``VmHWM``: its peak), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}: this measurement needs Linux")


def _measure(work) -> int:
    """Bytes ``work()`` added to the process at its peak, above the resident size before it: the peak
    resident size is reset first (``/proc/self/clear_refs``), so the setup's own peak cannot hide it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current resident size
    before = _status_bytes("VmRSS")
    work()
    return _status_bytes("VmHWM") - before


def _child_loss(mode: str, tokens: int, hidden: int, vocab: int, chunk: int) -> dict:
    import torch
    import torch.nn.functional as F

    from examples.dflash_trainer.drafter.loss import dflash_head_loss, dflash_loss

    g = torch.Generator().manual_seed(0)
    h = torch.empty(tokens, hidden).normal_(generator=g).requires_grad_(True)
    head = torch.empty(vocab, hidden).normal_(0, 0.02, generator=g)
    labels = torch.randint(0, vocab, (tokens,), generator=g)
    weights = torch.rand(tokens, generator=g)

    def work():
        if mode == "dense":
            loss, _ = dflash_loss(F.linear(h, head)[None], labels[None], weights[None])
        else:
            loss, _, _ = dflash_head_loss(h[None], head, labels[None], weights[None], chunk_tokens=chunk)
        loss.backward()

    return {"peak_bytes": _measure(work)}


def _step_config(shape: dict, chunk: int):
    from examples.dflash_trainer.config import TrainConfig

    return TrainConfig(seq_len=shape["seq_len"], block_size=shape["block_size"], num_anchors=shape["anchors"],
                       num_draft_layers=shape["layers"], num_target_layers_used=shape["feature_layers"],
                       batch_size=shape["batch"], loss_chunk_tokens=chunk, drafters=1, targets=1)


def _model_config(shape: dict, vocab: int) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=shape["hidden"], num_attention_heads=shape["heads"],
                           num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                           intermediate_size=shape["intermediate"], vocab_size=vocab, num_hidden_layers=8)


def _child_step(shape: dict, vocab: int, chunk: int) -> dict:
    import torch

    from examples.dflash_trainer.assets import sizes
    from examples.dflash_trainer.drafter.grads import FlatGrads
    from examples.dflash_trainer.drafter.loss import sample_anchors
    from examples.dflash_trainer.drafter.model import DFlashDrafter
    from examples.dflash_trainer.drafter.step import make_step_fn

    g = torch.Generator().manual_seed(0)
    hidden, n = shape["hidden"], shape["feature_layers"]
    embed = torch.nn.Embedding(vocab, hidden, _weight=torch.empty(vocab, hidden).normal_(0, 0.02, generator=g))
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.normal_(0, 0.02, generator=g)
    embed.requires_grad_(False), head.requires_grad_(False)
    drafter = DFlashDrafter(hidden_size=hidden, num_heads=shape["heads"], num_kv_heads=shape["kv_heads"],
                            head_dim=shape["head_dim"], intermediate_size=shape["intermediate"],
                            num_layers=shape["layers"], num_feature_layers=n, rms_norm_eps=1e-6, rope_theta=1e6,
                            embed_tokens=embed, lm_head=head, generator=g)
    FlatGrads([p for p in drafter.parameters() if p.requires_grad], extras=4)  # the replica's gradients, set up front
    b, s = shape["batch"], shape["seq_len"]
    ids = torch.randint(0, vocab - 1, (b, s), generator=g)
    loss_mask = torch.ones(b, s)
    features = torch.empty(b, s, n * hidden).normal_(generator=g)
    anchors, keep = sample_anchors(loss_mask, shape["anchors"], g)
    step = make_step_fn(drafter, block_size=shape["block_size"], gamma=7.0, mask_token_id=vocab - 1,
                        autocast_dtype=None, loss_chunk_tokens=chunk)

    def work():
        loss, _ = step(ids, loss_mask, features, anchors, keep)
        loss.backward()

    measured = _measure(work)
    parts = sizes.drafter_step_bytes(_step_config(shape, chunk), _model_config(shape, vocab), 4)
    return {"peak_bytes": measured, "estimate_bytes": sum(parts.values()), "estimate_by_part": parts}


def _run_child(args: list[str]) -> dict:
    env = dict(common.child_env(), MALLOC_MMAP_THRESHOLD_="65536")
    done = subprocess.run([*common.module_command("dflash_loss_memory"), "--child", *args], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the measuring child {args} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks dflash-loss-memory", description=__doc__.split("\n\n")[0])
    common.add_out_dir(parser)
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    parser.add_argument("--tokens", type=int, default=2048, help="drafter outputs of the loss measurement")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunk", type=int, default=None, help="--loss-chunk-tokens (default: the trainer's)")
    parser.add_argument("--skip-step", action="store_true", help="measure the loss only")
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        result = (_child_loss(rest[0], *map(int, rest[1:])) if kind == "loss"
                  else _child_step(json.loads(rest[0]), int(rest[1]), int(rest[2])))
        print(json.dumps(result))
        return 0
    from examples.dflash_trainer.drafter.chunked_ce import DEFAULT_CHUNK_TOKENS

    chunk = args.chunk or DEFAULT_CHUNK_TOKENS
    sizes_args = [str(args.tokens), str(args.hidden), str(args.vocab), str(chunk)]
    print(f"loss at vocabulary {args.vocab}, {args.tokens} outputs, hidden {args.hidden}, float32; each in a fresh process",
          flush=True)
    dense = _run_child(["loss", "dense", *sizes_args])["peak_bytes"]
    print(f"  dense   peak {dense / 2**20:9.1f} MiB  ({dense / (args.tokens * args.vocab * 4):.2f} float32 copies of "
          f"the [tokens, vocab] logits)", flush=True)
    chunked = _run_child(["loss", "chunked", *sizes_args])["peak_bytes"]
    print(f"  chunked peak {chunked / 2**20:9.1f} MiB  ({chunk} outputs a chunk); chunked / dense = {chunked / dense:.3f}",
          flush=True)
    results = {"vocab": args.vocab, "tokens": args.tokens, "hidden": args.hidden, "chunk_tokens": chunk,
               "dtype": "float32", "dense_peak_bytes": dense, "chunked_peak_bytes": chunked,
               "chunked_over_dense": round(chunked / dense, 4),
               "method": "fresh process per measurement; peak resident size (VmHWM, reset through procfs clear_refs "
                         "just before the work) minus the resident size before it; MALLOC_MMAP_THRESHOLD_=65536"}
    if not args.skip_step:
        step = _run_child(["step", json.dumps(STEP_SHAPE), str(args.vocab), str(chunk)])
        ratio = step["estimate_bytes"] / step["peak_bytes"]
        print(f"drafter step {STEP_SHAPE}, vocabulary {args.vocab}: measured peak {step['peak_bytes'] / 2**20:.1f} MiB, "
              f"the trainer's estimate {step['estimate_bytes'] / 2**20:.1f} MiB (estimate / measured = {ratio:.3f})")
        results["step"] = {"shape": STEP_SHAPE, "measured_peak_bytes": step["peak_bytes"],
                           "estimate_bytes": step["estimate_bytes"], "estimate_by_part": step["estimate_by_part"],
                           "estimate_over_measured": round(ratio, 4)}
    results["env"] = common.environment()
    results["command"] = "python -m benchmarks dflash-loss-memory" + (f" --vocab {args.vocab}" if args.vocab != QWEN3_VOCAB else "")
    common.save(common.results_dir(args.out_dir) / f"{common.results_stem(results['env'], THEME)}.json", results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
