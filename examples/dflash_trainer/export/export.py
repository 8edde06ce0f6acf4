"""Export a trainer checkpoint as a drafter that serving stacks read.

    python -m examples.dflash_trainer.export --checkpoint DIR --format zlab|speculators --out OUT

`DIR` is a run's out_dir, its `checkpoints/` folder (the `latest` step is taken) or one
`step_*` directory, of a finished or an interrupted run. The target the drafter was trained
against comes from the run config saved in the checkpoint (`--target DIR` overrides it, and is
needed when that path does not exist on this machine); its layer ids, the block size and the
mask token are recorded in the exported config. `--verifier NAME_OR_PATH` names the target as the
serving machine loads it (a hub id such as `Qwen/Qwen3-8B`): the speculators config's verifier, and
the model of the serving commands the export prints, which use the run's own block size.

Formats (see EXPORT.md):
- `zlab`: the z-lab DFlash checkpoint (SGLang, the published `z-lab/*-DFlash*` drafters): a
  Qwen3 `config.json` with `block_size`, `dflash_config`, `num_target_layers`, and the draft
  body `layers.*`, `fc`, `hidden_norm`, `norm`; embedding and LM head come from the target.
- `speculators`: `DFlashSpeculatorConfig` + `DFlashDraftModel` weights (vLLM); written by
  `export_speculators.py` without needing the `speculators` package.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import torch

from ..run.checkpoint import CheckpointError
from .export_speculators import write_speculators
from .source import ExportError, Source, read_source
from .zlab import last_layer_warning, write_zlab

FORMATS = ("zlab", "speculators")
# float32 is what the trainer holds (lossless); bfloat16 halves the files.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def export(checkpoint: str | Path, fmt: str, out: str | Path, target: str | Path | None = None,
           dtype: str = "float32", verifier: str | None = None) -> tuple[Path, list[str]]:
    """Write `checkpoint` as `fmt` under `out`, weights in `dtype`; returns (out, warnings)."""
    out, warnings, _ = export_source(checkpoint, fmt, out, target, dtype, verifier)
    return out, warnings


def export_source(checkpoint: str | Path, fmt: str, out: str | Path, target: str | Path | None = None,
                  dtype: str = "float32", verifier: str | None = None) -> tuple[Path, list[str], Source]:
    """`export`, and the Source it read (the run's block size and target, for the serving commands)."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r} is not one of {list(FORMATS)}")
    if dtype not in DTYPES:
        raise ExportError(f"--dtype {dtype!r} is not one of {list(DTYPES)}")
    if verifier is not None and not verifier.strip():
        raise ExportError("--verifier is empty; pass the target's hub id (e.g. Qwen/Qwen3-8B) or its path")
    src = read_source(checkpoint, target)
    src.weights = {k: v.to(DTYPES[dtype]) for k, v in src.weights.items()}
    warnings = [w for w in (last_layer_warning(src),) if w]
    if fmt == "zlab":
        return write_zlab(src, out), warnings, src
    return write_speculators(src, out, verifier), warnings, src


def serving_commands(fmt: str, out: Path, block_size: int, verifier: str) -> list[str]:
    """The commands that serve the export (EXPORT.md), with the run's own block size: a block drafts
    block_size - 1 tokens after its anchor."""
    model, drafter = shlex.quote(verifier), shlex.quote(str(out))
    if fmt == "speculators":  # vLLM reads the verifier and the block size from the drafter's config.json
        return [f"vllm serve {drafter}"]
    spec = json.dumps({"method": "dflash", "model": str(out), "num_speculative_tokens": block_size - 1})
    return [f"vllm serve {model} --speculative-config {shlex.quote(spec)}",
            f"python -m sglang.launch_server --model-path {model} --speculative-algorithm DFLASH "
            f"--speculative-draft-model-path {drafter} --speculative-num-draft-tokens {block_size}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.dflash_trainer.export",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True,
                        help="run out_dir, its checkpoints/ folder, or a step_* directory")
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--out", required=True, help="new directory for the exported drafter")
    parser.add_argument("--target", default=None,
                        help="the target model directory, when the one saved in the checkpoint's "
                             "run config does not exist here")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="weight dtype of the export: float32 as trained (lossless), bfloat16 or float16 "
                             "(half the size) (default: float32)")
    parser.add_argument("--verifier", metavar="NAME_OR_PATH", default=None,
                        help="the target as the serving machine loads it, a hub id (e.g. Qwen/Qwen3-8B) or a path: "
                             "speculators_config.verifier.name_or_path of --format speculators, and the model of "
                             "the serving commands printed (default: the target directory the run trained against)")
    args = parser.parse_args(argv)
    try:
        out, warnings, src = export_source(args.checkpoint, args.format, args.out, args.target, args.dtype,
                                           args.verifier)
    except (ValueError, CheckpointError, FileNotFoundError) as err:  # ExportError is a ValueError
        print(f"error: {err}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(f"wrote {args.format} drafter to {out}")
    print(f"serve it (block size {src.block_size}: {src.block_size - 1} draft tokens a step; EXPORT.md):")
    for command in serving_commands(args.format, out, src.block_size, args.verifier or str(src.target_dir)):
        print(f"  {command}")
    return 0

