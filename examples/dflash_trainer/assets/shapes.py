"""Random-init Qwen3-layout targets of published sizes, for throughput work (``--target-shape``).

The embedded default target has 1.7M parameters: it gives the GPU about 0.3 ms of work per batch,
so it measures launch and GIL overheads only. A target of a published Qwen3 shape gives the GPU the
work of a real target. Its weights are random (a fixed seed from a private ``torch.Generator``), so
an acceptance length measured against it means nothing. Its embedding and LM head have Qwen3's
151,936 rows (``QWEN3_VOCAB``), so the LM head and the drafter's loss through it weigh what they weigh
in a real run; its tokenizer is the embedded default's, so the embedded ``train.jsonl`` (token ids below
2000) drives it, and the DFlash mask token is the first row past that tokenizer.

Built once and cached beside the default assets, as an ordinary HF directory (``config.json``,
safetensors, sharded above ``MAX_SHARD``, tokenizer files) that ``--target DIR`` also loads::

    <root>/dflash-shape-<name>-vocab151936-on-<assets dir name>/
        config.json, model*.safetensors, tokenizer files, shape_report.json
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .assets import (DefaultAssets, default_cache_root, exclusive_lock, remove_leftovers, swap_into_place,
                     writable_cache_root)
from ..errors import EXIT_BAD_INPUT, BadInput
from .capacity import GiB, free_bytes

__all__ = ["SHAPES", "QWEN3_VOCAB", "RANDOM_WEIGHTS_WARNING", "NoRoomToBuild", "TargetShape", "qwen3_config",
           "shape_num_params", "shape_target"]

logger = logging.getLogger(__name__)

SEED = 0
QWEN3_VOCAB = 151_936  # rows of every published Qwen3's embedding and LM head
MAX_SHARD = "5GB"  # the 4b and larger targets are saved in shards of at most this
INIT_STD = 0.02  # Qwen3's initializer_range: what HF's own init draws Linear and Embedding weights with
_REPORT = "shape_report.json"
RANDOM_WEIGHTS_WARNING = ("the target has random weights (--target-shape): acceptance length tau and the "
                          "baselines mean nothing in this run; use it for throughput only")


class NoRoomToBuild(BadInput):
    """A shape's weights do not fit on the build device or on the cache's disk."""


@dataclass(frozen=True)
class TargetShape:
    """The sizes of one Qwen3 layout (everything but the vocabulary: QWEN3_VOCAB rows for all)."""

    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 40960
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6


# The published Qwen3 configurations (Hugging Face Qwen/Qwen3-*/config.json); `tiny` is for tests.
SHAPES = {
    "tiny": TargetShape(64, 2, 128, 2, 1, 32, tie_word_embeddings=True, max_position_embeddings=4096),
    "0.6b": TargetShape(1024, 28, 3072, 16, 8, 128, tie_word_embeddings=True),
    "1.7b": TargetShape(2048, 28, 6144, 16, 8, 128, tie_word_embeddings=True),
    "4b": TargetShape(2560, 36, 9728, 32, 8, 128, tie_word_embeddings=True),
    "8b": TargetShape(4096, 36, 12288, 32, 8, 128, tie_word_embeddings=False),
    "14b": TargetShape(5120, 40, 17408, 40, 8, 128, tie_word_embeddings=False),
    "32b": TargetShape(5120, 64, 25600, 64, 8, 128, tie_word_embeddings=False),
}


def qwen3_config(name: str, vocab: dict | None = None):
    """The ``Qwen3Config`` of shape ``name``: Qwen3's 151,936-row vocabulary, and the embedded
    tokenizer's ``bos_token_id``, ``eos_token_id``, ``pad_token_id`` from ``vocab`` (None: sizes only)."""
    from transformers import Qwen3Config

    if name not in SHAPES:
        raise ValueError(f"unknown target shape {name!r}; choose one of {sorted(SHAPES)}")
    return Qwen3Config(**dataclasses.asdict(SHAPES[name]), **(vocab or {}), vocab_size=QWEN3_VOCAB, dtype="bfloat16")


def shape_num_params(name: str) -> tuple[Any, int]:
    """(config, parameter count) of shape ``name``, from a model on the meta device: no memory, no build."""
    from transformers import Qwen3ForCausalLM

    config = qwen3_config(name)
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    return config, sum(p.numel() for p in model.parameters())


@dataclass(frozen=True)
class ShapeTarget:
    """A built shape target: ``dir`` loads with ``from_pretrained``; ``report`` says what it is."""

    dir: Path
    report: dict


def shape_target(name: str, assets: DefaultAssets, cache_dir: str | os.PathLike[str] | None = None,
                 device: str | None = None) -> ShapeTarget:
    """The random-init target of shape ``name`` on ``assets``' tokenizer, built first if missing.

    ``cache_dir`` replaces the default cache root. ``device``: where the weights are drawn (default
    cuda when available, which builds the 8b in seconds, else cpu); the draws differ by device, so
    the report records it. Concurrent callers build once (a lock file, as for the default assets)."""
    if name not in SHAPES:
        raise ValueError(f"unknown target shape {name!r}; choose one of {sorted(SHAPES)}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    dirname = f"dflash-shape-{name}-vocab{QWEN3_VOCAB}-on-{assets.root.name}"
    final = root / dirname
    if _complete(final):
        return ShapeTarget(final, json.loads((final / _REPORT).read_text()))
    writable_cache_root(root, cache_dir)
    with exclusive_lock(root / f".{dirname}.lock"):
        if not _complete(final):
            remove_leftovers(root, dirname)
            tmp = root / f".{dirname}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                _build(name, assets, tmp, device or ("cuda" if torch.cuda.is_available() else "cpu"))
                swap_into_place(tmp, final)
                if torch.cuda.is_available():  # the build's weights are garbage now: give their memory back
                    torch.cuda.empty_cache()
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    return ShapeTarget(final, json.loads((final / _REPORT).read_text()))


def _complete(path: Path) -> bool:
    weights = (path / "model.safetensors").is_file() or (path / "model.safetensors.index.json").is_file()
    return weights and all((path / f).is_file() for f in ("config.json", "tokenizer.json", _REPORT))


def _build(name: str, assets: DefaultAssets, out: Path, device: str) -> None:
    from transformers import AutoConfig, AutoTokenizer, Qwen3ForCausalLM

    t0 = time.perf_counter()
    embedded = AutoConfig.from_pretrained(str(assets.target_dir), local_files_only=True)
    vocab = {k: getattr(embedded, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = qwen3_config(name, vocab)
    vocab["vocab_size"] = QWEN3_VOCAB
    # Built on the meta device, then given bfloat16 storage on `device`: no float32 copy, and no
    # change to torch's process-global default dtype (hazard global-default-dtype).
    with torch.device("meta"):
        model = Qwen3ForCausalLM(config)
    model = model.to(dtype=torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())  # a tied weight appears once
    _check_room(name, sum(p.numel() * p.element_size() for p in model.parameters()), out, device)
    model = model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied parameters separate storage
    params = dict(model.named_parameters())
    logger.info("target shape %s: drawing %.2fB random parameters on %s (seed %d)", name, total / 1e9, device, SEED)
    gen = torch.Generator(device=device).manual_seed(SEED)  # private: no other thread's draws move it
    done, next_log = 0, 0.1
    with torch.no_grad():
        for pname, p in params.items():
            if p.dim() == 1:  # Qwen3 has no biases: every vector is an RMSNorm weight, initialised to one
                p.fill_(1.0)
            else:
                p.normal_(0.0, INIT_STD, generator=gen)
            done += p.numel()
            if done / total >= next_log:
                logger.info("target shape %s: %3.0f%% of the weights drawn (%.1f s)", name, 100 * done / total,
                            time.perf_counter() - t0)
                next_log += 0.1
    logger.info("target shape %s: saving to %s", name, out)
    model.save_pretrained(out, safe_serialization=True, max_shard_size=MAX_SHARD)
    AutoTokenizer.from_pretrained(str(assets.target_dir), local_files_only=True).save_pretrained(out)
    report = {"shape": name, **dataclasses.asdict(SHAPES[name]), **vocab, "num_parameters": total,
              "dtype": "bfloat16", "seed": SEED, "init": f"normal(0, {INIT_STD}) matrices, ones for norms",
              "built_on": device, "tokenizer_from": str(assets.target_dir), "random_weights": True,
              "warning": RANDOM_WEIGHTS_WARNING, "torch": torch.__version__,
              "build_s": round(time.perf_counter() - t0, 1)}
    (out / _REPORT).write_text(json.dumps(report, indent=1) + "\n")
    logger.info("target shape %s: built in %.1f s", name, report["build_s"])


def _check_room(name: str, weight_bytes: int, out: Path, device: str) -> None:
    """Refuse a build that cannot finish, before it draws anything: its bfloat16 weights are held
    once on ``device`` and written once to the cache's disk (the 32b: 58 GiB of each)."""
    disk = shutil.disk_usage(out).free
    if weight_bytes > disk:
        raise NoRoomToBuild(f"target shape {name}: its {weight_bytes / GiB:.1f} GiB of weights do not fit on the disk "
                            f"of {out.parent} ({disk / GiB:.1f} GiB free); point THREADGRAPH_CACHE at a larger disk "
                            f"or pick a smaller shape")
    free = free_bytes(device)
    if free is not None and weight_bytes > free:
        raise NoRoomToBuild(f"target shape {name}: drawing its {weight_bytes / GiB:.1f} GiB of weights needs that much "
                            f"free memory on {device} ({free / GiB:.1f} GiB free); build it on a larger device or "
                            f"pick a smaller shape")


def main(argv: list[str] | None = None) -> int:
    """``python -m examples.dflash_trainer.assets.shapes NAME...``: build (or find) shape targets ahead of a run."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m examples.dflash_trainer.assets.shapes", description=main.__doc__)
    parser.add_argument("names", nargs="+", choices=sorted(SHAPES), metavar="NAME", help=f"one of {sorted(SHAPES)}")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    from .assets import default_assets

    try:
        assets = default_assets()
    except BadInput as err:  # THREADGRAPH_CACHE is not a writable directory
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    for name in args.names:
        print(f"target shape {name}: building it if it is not cached", flush=True)
        try:
            built = shape_target(name, assets)
        except BadInput as err:  # NoRoomToBuild, or a cache directory that cannot be written
            print(f"error: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
        print(f"target shape {name}: {built.dir} ({built.report['num_parameters'] / 1e9:.2f}B parameters)")
    print(f"WARNING: {RANDOM_WEIGHTS_WARNING}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
