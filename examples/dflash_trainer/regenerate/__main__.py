"""``python -m examples.dflash_trainer.regenerate --target T --data prompts.jsonl --out out.jsonl``:
the target's own responses to a prompt set, the data a DFlash drafter learns from.

Request threads (threadgraph ``CompiledWorkerThread``s) share one copy of the target per device and
each decodes a batch of prompts at once (``--batch-size``, prompts of similar length together).
``--decode`` picks how (regenerate/decode.py): ``generate`` (the default: transformers' ``generate()``,
compiled with ``reduce-overhead`` on a GPU, eager on a CPU), ``step`` (a static-KV-cache decoding step
captured whole as one CUDA graph per token for the whole batch) or ``continuous`` (transformers'
continuous batching, greedy only); the trainer's README gives each one's measured speed. Greedy by default;
sampled with ``--temperature``, reproducibly per record with ``--seed`` whatever thread or batch
took it. Reasoning kept as the target writes it, or dropped (``enable_thinking=False`` for templates
that know it, and any ``<think>`` block cut from the response).

Records are written in prompt-index order, one run at a time per ``--out``; a killed run, started
again with the same command, continues: no record is lost or written twice. A response the token
limit cut says ``"truncated": true``; a prompt longer than the target's positions is skipped and
counted.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys
import threading
from typing import Optional

from ..errors import InputError, report_failure
from .decode import DECODERS
from .run import RequestWorker, regenerate


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.dflash_trainer.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target: a local HF model directory (model and tokenizer)")
    p.add_argument("--data", required=True, help="the prompts: JSONL of {\"prompt\": str} or {\"messages\": [...]}")
    p.add_argument("--out", required=True, help="the output JSONL; an existing one is continued (resume)")
    p.add_argument("--threads", type=int, default=1,
                   help="request threads, spread over --devices; default: 1 (one thread's batch already fills a GPU)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="prompts each thread decodes at once; default: 64 on a GPU, 8 on a CPU")
    p.add_argument("--decode", choices=("auto", *DECODERS), default="auto",
                   help="how a batch is decoded: generate (transformers' generate, reduce-overhead on a GPU, eager "
                        "on a CPU), step (a captured static-cache step) or continuous (transformers' continuous "
                        "batching); auto (default): generate, the fastest measured")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens of a response; default: 256")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above: sampled")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature; default: 1.0")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed: a record's draws depend on it and its "
                                                        "prompt index alone; default: 0")
    p.add_argument("--reasoning", choices=("keep", "drop"), default="keep",
                   help="keep the target's <think> reasoning in the responses, or drop it (thinking off where the "
                        "chat template has the switch); default: keep")
    p.add_argument("--devices", help="e.g. cuda:0,cuda:1 or cpu; default: every GPU, else the CPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="on an error, print the full traceback too")
    return p


def _checked(args: argparse.Namespace) -> None:
    if args.threads < 1:
        raise InputError(f"--threads must be at least 1, got {args.threads}")
    if args.batch_size is not None and args.batch_size < 1:
        raise InputError(f"--batch-size must be at least 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not (args.temperature >= 0 and math.isfinite(args.temperature)):
        raise InputError(f"--temperature must be 0 (greedy) or a finite number above, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise InputError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.decode == "continuous" and args.temperature > 0:
        raise InputError("--decode continuous is greedy only (its sampling is not reproducible per record); "
                         "use --decode step or generate with --temperature")


def _devices(spec: Optional[str]) -> Optional[list[str]]:
    """``--devices`` as a list, each one a device this machine has; None: the default."""
    if not spec:
        return None
    import torch

    devices = [d.strip() for d in spec.split(",")]
    for d in devices:
        try:
            device = torch.device(d)
        except RuntimeError:
            device = None
        if device is None or device.type not in ("cpu", "cuda"):
            raise InputError(f"--devices {spec!r}: {d!r} is not a cpu or cuda device; pass e.g. cuda:0,cuda:1 or cpu")
        if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
            have = torch.cuda.device_count()
            raise InputError(f"--devices {spec!r}: {d} is not here ({have or 'no'} CUDA GPU(s) visible); pass "
                             + (f"cuda:0 to cuda:{have - 1} or cpu" if have else "cpu"))
    return devices


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    try:
        _checked(args)
        devices = _devices(args.devices)
        import torch

        on_cuda = all(d.startswith("cuda") for d in devices) if devices else torch.cuda.is_available()
        batch_size = args.batch_size or (64 if on_cuda else 8)
        counts = regenerate(args.target, args.data, args.out, threads=args.threads, devices=devices,
                            progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            reasoning=args.reasoning, batch_size=batch_size, decode=args.decode)
    except KeyboardInterrupt:
        print(f"stopped: the records generated so far are in {args.out}; run the same command again to continue",
              file=sys.stderr)
        if any(isinstance(t, RequestWorker) for t in threading.enumerate()):  # not is_alive(): an interrupted
            # join can leave a running thread reporting itself stopped. A second Ctrl-C left request threads
            # running: the interpreter's exit would stop them mid-step (torch aborts the process then). End
            # now: each record written is whole and on disk (a torn last one is cut by the next run).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(130)
        return 130
    except Exception as err:
        return report_failure(err, "; the records written so far are kept: run the same command again to continue",
                              args.debug)
    print(f"regenerate: {counts['before'] + counts['generated']} records in {args.out} for {counts['records']} "
          f"prompts ({counts['before']} there before, "
          f"{counts['generated']} generated now, {counts['tokens']} tokens, {counts['truncated']} truncated by "
          f"--max-new-tokens, {counts['skipped']} skipped as longer than the target's positions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
