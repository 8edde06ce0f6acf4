"""Regeneration's generated tokens/s for threads x batch size x decoding path, beside the bound.

    python -m benchmarks regenerate-throughput                       # the Qwen3-0.6B shape on a GPU
    python -m benchmarks regenerate-throughput --cells step:1:64,step:2:32 --prompts 256
    python -m benchmarks regenerate-throughput --reduced             # the CPU form CI runs

Each cell (``decode:threads:batch``) is one ``regenerate()`` over the same prompts in a fresh process
with an empty Inductor cache: ``generate``, ``step`` and ``continuous`` are the command's
``--decode`` choices (regenerate/decode.py), ``generate_batch`` is transformers' own
``generate_batch()`` alone on the main thread, the call a user would otherwise make. A cell reports
its startup (load, compile, capture and every thread's first decoder call: a batch, or the step
decoder's first tokens) apart from its steady state (the calls begun after that), generated
tokens/s and prompts/s there, and the memory-bandwidth bound of its decoding: rows in flight /
(weight bytes + the KV-cache bytes of the rows' mean context, read once a step) x the bandwidth
a device-to-device copy reaches on the machine. A figure above its bound is flagged as a
measurement error. The target is a random-init Qwen3 of a
published shape with the real 151,936-token vocabulary (assets/shapes.py): its responses are noise
and mostly run to ``--max-new-tokens``, which is what a throughput figure wants (and so the step
decoder's refill of rows that ended early plays no part here).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from . import common
from . import results_schema

THEME = "regenerate-throughput"
GPU_CELLS = "generate_batch:1:64,generate:1:64,continuous:1:64,step:1:64,step:2:32,step:4:16,step:1:128,step:2:64"
CPU_CELLS = "generate_batch:1:4,generate:1:1,generate:1:4,generate:2:2,step:1:4,step:2:2,continuous:1:4"
DECODES = ("generate", "step", "continuous", "generate_batch")
WORDS = ("def", "return", "self", "import", "class", "value", "for", "in", "range", "if", "else", "print")


def parse_args(argv=None, prog=None):
    p = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reduced", action="store_true",
                   help="the CPU form: the tiny shape, few prompts and tokens, small batches")
    p.add_argument("--target-shape", help="a shape of assets/shapes.py; default: 0.6b (tiny with --reduced)")
    p.add_argument("--cells", help=f"decode:threads:batch,... (decode one of {', '.join(DECODES)}); default: "
                                   f"{GPU_CELLS} ({CPU_CELLS} with --reduced)")
    p.add_argument("--prompts", type=int, help="prompts a cell generates for; default: 512 (16 with --reduced)")
    p.add_argument("--max-new-tokens", type=int, help="default: 128 (8 with --reduced)")
    p.add_argument("--timeout", type=int, default=600, help="seconds one cell may take (default %(default)s)")
    common.add_out_dir(p)
    p.add_argument("--cell", nargs=6, metavar=("DECODE", "THREADS", "BATCH", "TARGET", "PROMPTS_FILE", "MAX_NEW"),
                   help=argparse.SUPPRESS)  # one cell, in the driver's child process; then its output path
    p.add_argument("cell_out", nargs="?", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.cell:
        return args
    args.target_shape = args.target_shape or ("tiny" if args.reduced else "0.6b")
    args.prompts = args.prompts or (16 if args.reduced else 512)
    args.max_new_tokens = args.max_new_tokens or (8 if args.reduced else 128)
    try:
        args.cells = [_cell(c) for c in (args.cells or (CPU_CELLS if args.reduced else GPU_CELLS)).split(",") if c]
    except ValueError as err:
        p.error(str(err))
    if args.prompts < 1 or args.max_new_tokens < 1:
        p.error("--prompts and --max-new-tokens must be at least 1")
    return args


def _cell(text: str) -> tuple[str, int, int]:
    parts = text.strip().split(":")
    if len(parts) != 3 or parts[0] not in DECODES or not all(p.isdigit() and int(p) > 0 for p in parts[1:]):
        raise ValueError(f"--cells: {text!r} is not decode:threads:batch with decode one of {', '.join(DECODES)} "
                         f"and positive counts")
    return parts[0], int(parts[1]), int(parts[2])


def prompts_file(path: Path, count: int) -> Path:
    """``count`` code-like prompts of 20 to ~200 words, the same for every cell."""
    lines = []
    for i in range(count):
        words = [WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(20 + (i * 37) % 180)]
        lines.append(json.dumps({"prompt": f"# task {i}\n" + " ".join(words)}))
    path.write_text("\n".join(lines) + "\n")
    return path


# -- one cell, in a fresh process -------------------------------------------------------------------

def copy_bandwidth(device: str) -> float:
    """Bytes/s a device-to-device copy of 1 GiB (256 MiB on a CPU) moves, read and write counted."""
    import torch

    size = (1 << 30) if device.startswith("cuda") else (1 << 28)
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        common.sync()
        began = time.perf_counter()
        dst.copy_(src)
        common.sync()
        best = min(best, time.perf_counter() - began)
    return 2 * size / best


def decode_bound(model, rows: int, mean_context: float, bandwidth: float) -> dict:
    """The memory-bandwidth bound of one decoding step of ``rows`` rows: every weight read once (the
    embedding only as the tied LM head, or its rows when untied) and each row's KV cache over its mean
    context read once."""
    config = model.config.get_text_config(decoder=True)
    element = next(model.parameters()).element_size()
    tied = getattr(model.config, "tie_word_embeddings", False)
    params = sum(p.numel() for p in model.parameters()) - (0 if tied else model.get_input_embeddings().weight.numel())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * element
    step_bytes = params * element + rows * mean_context * kv_per_token
    return {"weight_bytes": params * element, "kv_bytes_per_token": kv_per_token, "step_bytes": step_bytes,
            "bound_tokens_per_s": rows * bandwidth / step_bytes}


def run_cell(decode: str, threads: int, batch: int, target: str, prompts: str, max_new: int) -> dict:
    import torch

    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    began = time.perf_counter()
    if decode == "generate_batch":
        counts = _generate_batch(target, prompts, max_new, batch, device)
    else:
        from examples.dflash_trainer.regenerate.run import regenerate

        with tempfile.TemporaryDirectory() as tmp:
            counts = regenerate(target, prompts, str(Path(tmp, "out.jsonl")), threads=threads, devices=[device],
                                progress=False, max_new_tokens=max_new, batch_size=batch, decode=decode)
    took = time.perf_counter() - began
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):  # sizes only
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target, local_files_only=True),
                                                 dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)
    made = max(counts["generated"], 1)
    mean_context = counts["prompt_tokens"] / made + counts["tokens"] / made / 2
    bandwidth = copy_bandwidth(device)
    bound = decode_bound(model, threads * batch, mean_context, bandwidth)
    steady = counts.get("steady_tokens_per_s")
    row = {"decode": decode, "threads": threads, "batch": batch, "rows_in_flight": threads * batch, **counts,
           "took_s": took, "mean_context": mean_context, "copy_bandwidth_gb_s": bandwidth / 1e9, **bound,
           "fraction_of_bound": steady / bound["bound_tokens_per_s"] if steady else None,
           "peak_memory_gib": common.peak_memory_gib([device]).get(device) if device.startswith("cuda") else None}
    if steady and steady > bound["bound_tokens_per_s"]:
        row["above_bound"] = "steady tokens/s above the memory-bandwidth bound: a measurement error"
    if steady:
        row["steady_prompts_per_s"] = steady / max(counts["tokens"] / made, 1)
    return row


def _generate_batch(target: str, prompts: str, max_new: int, batch: int, device: str) -> dict:
    """transformers' generate_batch() on all the prompts, with its token timestamps: startup until
    the first batch's rows each had a token, steady from then to the last token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from examples.dflash_trainer.regenerate.decode import continuous_batching_config
    from examples.dflash_trainer.regenerate.io import read_prompts
    from examples.dflash_trainer.regenerate.run import render, stop_tokens

    began = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True,
                                                 dtype=torch.bfloat16 if device.startswith("cuda") else torch.float32)
    model.to(device)
    ids = [render(tokenizer, p, "keep") for p in read_prompts(prompts)]
    stops = sorted(stop_tokens(tokenizer))
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new, eos_token_id=stops,
                              pad_token_id=tokenizer.pad_token_id)
    longest = max(len(i) for i in ids) + max_new
    batching = continuous_batching_config(batch, longest)
    with torch.inference_mode():
        out = model.generate_batch(ids, generation_config=config, continuous_batching_config=batching,
                                   record_timestamps=True)
    done = [r for r in out.values() if not getattr(r, "error", None) and r.timestamps]
    if len(done) < len(ids):
        failed = [r.error for r in out.values() if getattr(r, "error", None)]
        raise RuntimeError(f"generate_batch answered {len(done)} of {len(ids)} prompts with timed tokens ({len(out)} "
                           f"results, {len(failed)} with an error{': ' + str(failed[0])[:200] if failed else ''})")
    stamps = sorted(t for r in done for t in r.timestamps)
    # Steady: from the first token that came after every row of the first batch had one (the manager
    # warmed up and its batch full) to the last token.
    firsts = sorted(r.timestamps[0] for r in done)
    startup_end = firsts[min(batch, len(firsts)) - 1]
    steady_tokens = sum(1 for t in stamps if t > startup_end)
    startup = startup_end - began
    steady_s = stamps[-1] - startup_end
    tokens = len(stamps)
    return {"records": len(ids), "generated": len(done), "tokens": tokens, "startup_s": startup,
            "steady_tokens": steady_tokens, "steady_s": steady_s,
            "steady_tokens_per_s": steady_tokens / steady_s if steady_s > 0 else None,
            "prompt_tokens": sum(len(i) for i in ids)}


# -- the driver -------------------------------------------------------------------------------------

def build_target(shape: str) -> str:
    """The shape's target on the tiny default assets' tokenizer, both built once in the asset cache."""
    from examples.dflash_trainer.assets.assets import BuildSpec, default_assets
    from examples.dflash_trainer.assets.shapes import shape_target

    return str(shape_target(shape, default_assets(spec=BuildSpec.tiny())).dir)


RECORDED_BY = ("benchmarks/regenerate_throughput.py (python -m benchmarks regenerate-throughput): each row one "
               "cell in a fresh process with an empty Inductor cache; tokens/s over the decoder calls begun after "
               "every thread's first one ended; bound_tokens_per_s = rows_in_flight x copy bandwidth / step_bytes")


def main(argv=None, prog=None) -> int:
    common.exit_on_sigterm()
    args = parse_args(argv, prog)
    if args.cell:
        decode, threads, batch, target, prompts, max_new = args.cell
        row = run_cell(decode, int(threads), int(batch), target, prompts, int(max_new))
        common.finish_cell(args.cell_out, row)
        return 0
    env = common.environment()
    rows = []
    data = {"recorded_by": RECORDED_BY, "env": env, "shape": args.target_shape,
            "args": {"prompts": args.prompts, "max_new_tokens": args.max_new_tokens}, "rows": rows}
    path = common.results_dir(args.out_dir) / f"{results_schema.stem(env, THEME)}.json"
    with tempfile.TemporaryDirectory(prefix="regenerate-throughput-") as tmp:
        print(f"building the {args.target_shape} target (cached after the first run)", file=sys.stderr, flush=True)
        target = build_target(args.target_shape)
        prompts = prompts_file(Path(tmp, "prompts.jsonl"), args.prompts)
        for i, (decode, threads, batch) in enumerate(args.cells, 1):
            print(f"[{i}/{len(args.cells)}] {decode}, {threads} thread(s) x batch {batch}", file=sys.stderr, flush=True)
            row = common.run_cell([*common.module_command("regenerate_throughput"), "--cell", decode, str(threads),
                                   str(batch), target, str(prompts), str(args.max_new_tokens)], "", args.timeout)
            rows.append({"decode": decode, "threads": threads, "batch": batch, **row})
            print(f"[{i}/{len(args.cells)}] {describe(rows[-1])}", file=sys.stderr, flush=True)
            if i < len(args.cells):
                results_schema.write(path, data)  # the cells so far, should the run be stopped
    common.save(path, data)
    return 1 if any("error" in row for row in rows) else 0


def describe(row: dict) -> str:
    if "error" in row:
        return f"failed: {row['error']}"
    steady = row.get("steady_tokens_per_s")
    fraction = row.get("fraction_of_bound")
    return (f"startup {row['startup_s']:.1f} s, steady {'-' if steady is None else f'{steady:,.0f}'} tokens/s "
            f"(bound {row['bound_tokens_per_s']:,.0f}, {'-' if fraction is None else f'{fraction:.0%}'})"
            + (f"; {row['above_bound']}" if "above_bound" in row else ""))


if __name__ == "__main__":
    sys.exit(main())
