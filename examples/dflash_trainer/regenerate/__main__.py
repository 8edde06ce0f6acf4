"""``python -m examples.dflash_trainer.regenerate --target T --data prompts.jsonl --out out.jsonl``:
the target's own responses to a prompt set, the data a DFlash drafter learns from.

Several request threads (threadgraph ``CompiledWorkerThread``s in a ``WorkerGroup``) share one copy of
the target per device and each runs its ``generate()`` on one prompt at a time: on a GPU with a static
KV cache of its own, transformers compiling the decoding step with ``mode="reduce-overhead"`` (CUDA
graphs, which threadgraph makes work in threads); on a CPU eagerly. Greedy by default, sampled with
``--temperature``; reasoning kept as the target writes it, or dropped (``enable_thinking=False`` for
templates that know it, and any ``<think>`` block cut from the response).

The output is appended record by record (regenerate.io), so a killed run, started again with the same
command, continues: no record is lost or written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import logging
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch

import threadgraph

from ..data.chat import THINK_CLOSE, THINK_OPEN
from ..errors import InputError, report_failure
from .io import Output, Prompt, read_prompts

log = logging.getLogger("dflash")


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    reasoning: str = "keep"  # or "drop"
    compiled: bool = False  # reduce-overhead decoding (CUDA only)
    max_cache_len: int = 0  # the static KV cache's length when compiled: the longest prompt + max_new_tokens


def render(tokenizer: Any, prompt: Prompt, reasoning: str) -> list[int]:
    """The prompt's tokens as the target sees it: its chat template with the assistant turn opened
    (thinking off with ``drop``), or "role: content" lines as the trainer renders a template-less one."""
    messages = list(prompt.messages)
    if getattr(tokenizer, "chat_template", None):
        extra = {"enable_thinking": False} if reasoning == "drop" else {}
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    else:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "
    return tokenizer.encode(text, add_special_tokens=False)


def response_text(tokenizer: Any, ids: list[int], reasoning: str) -> str:
    """The generated tokens up to the end of the turn, as text; with ``drop``, no think block."""
    stops = {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    text = tokenizer.decode(ids[:end], skip_special_tokens=False)
    if reasoning == "drop" and THINK_CLOSE in text:
        text = text.split(THINK_CLOSE, 1)[1].lstrip("\n")
    elif reasoning == "drop" and text.lstrip().startswith(THINK_OPEN):  # cut off inside its thinking
        text = ""
    return text


def cache_keyword(model: Any) -> str:
    """The keyword ``generate()`` takes a KV cache object by: ``cache`` where the model's ``forward``
    takes one so (recent transformers 5 releases), else ``past_key_values``; an unknown keyword
    fails ``generate()``'s argument check."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class Progress:
    """Records done and generated tokens/s, on a tqdm bar (stderr)."""

    def __init__(self, total: int, done: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="rec", desc="regenerate", dynamic_ncols=True)
        self._lock = threading.Lock()
        self.tokens, self._began = 0, time.perf_counter()

    def add(self, tokens: int) -> None:
        with self._lock:
            self.tokens += tokens
            self.bar.update(1)
            self.bar.set_postfix(tok_s=f"{self.tokens / max(time.perf_counter() - self._began, 1e-9):.0f}")

    def close(self) -> None:
        self.bar.close()


class RequestWorker(threadgraph.CompiledWorkerThread):
    """One request thread: takes prompt indices from ``work`` until it is empty, generates each
    response with the shared target of its device and writes the record."""

    def __init__(self, index: int, device: str, *, model: Any, tokenizer: Any, prompts: list[Prompt],
                 work: "queue.Queue[int]", output: Output, settings: Settings, progress: Optional[Progress]) -> None:
        super().__init__(device, name=f"request{index}", warmup_steps=1)
        self.model, self.tokenizer, self.prompts, self.work = model, tokenizer, prompts, work
        self.output, self.settings, self.progress = output, settings, progress
        self.generated = 0

    def setup(self) -> None:
        if self.settings.compiled:  # built here, one worker at a time (the group's setup turn), not raced
            from transformers import CompileConfig, StaticCache

            self.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=False)
            self.model.get_compiled_call(self.compile_config)
            # This thread's own KV cache, reset and reused by every request: its tensors keep their
            # addresses, so the recorded graphs replay instead of recording again for a new cache.
            config = self.model.config.get_text_config(decoder=True)
            self.cache = StaticCache(config=config, max_cache_len=self.settings.max_cache_len)
            self.cache_keyword = cache_keyword(self.model)

    def step(self) -> None:
        try:
            index = self.work.get_nowait()
        except queue.Empty:
            self.stop()
            return
        prompt = self.prompts[index]
        ids = torch.tensor([render(self.tokenizer, prompt, self.settings.reasoning)], device=self.device)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), **self._generate_kwargs())
        new = out[0, ids.shape[1]:].tolist()
        text = response_text(self.tokenizer, new, self.settings.reasoning)
        self.output.write(prompt.record(text, len(new)))
        self.generated += len(new)
        if self.progress is not None:
            self.progress.add(len(new))

    def _generate_kwargs(self) -> dict:
        s = self.settings
        kwargs: dict[str, Any] = {"max_new_tokens": s.max_new_tokens, "pad_token_id": self.tokenizer.pad_token_id
                                  if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id}
        kwargs.update({"do_sample": True, "temperature": s.temperature, "top_p": s.top_p} if s.temperature > 0
                      else {"do_sample": False})
        if s.compiled:  # the thread's own cache (one the model kept would be shared by the threads)
            self.cache.reset()
            kwargs[self.cache_keyword] = self.cache
            kwargs["compile_config"] = self.compile_config
        return kwargs


def regenerate(target: str, data: str, out: str, *, threads: int = 4, devices: Optional[list[str]] = None,
               compile: str = "auto", progress: bool = True, **settings: Any) -> dict:
    """Generate the missing records of ``out``; returns counts (done before, generated now, total)."""
    from ..target import TargetModel

    prompts = read_prompts(data)
    output = Output(out, prompts)
    pending = [p.index for p in prompts if p.index not in output.done]
    before = len(output.done)
    if not pending:
        output.close()
        return {"records": len(prompts), "before": before, "generated": 0, "tokens": 0}
    devices = devices or ([f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"])
    on_cuda = all(d.startswith("cuda") for d in devices)
    if compile == "reduce-overhead" and not on_cuda:
        raise InputError(f"--compile reduce-overhead needs CUDA devices (got {','.join(devices)}); use --compile "
                         f"eager or auto on a CPU")
    compiled = compile == "reduce-overhead" or (compile == "auto" and on_cuda)
    models = {d: TargetModel.from_pretrained(target, num_feature_layers=1, device=d,
                                             dtype=torch.bfloat16 if d.startswith("cuda") else None) for d in devices}
    tokenizer = next(iter(models.values())).tokenizer
    config = Settings(compiled=compiled, **settings)
    longest = max(len(render(tokenizer, prompts[i], config.reasoning)) for i in pending)
    config = dataclasses.replace(config, max_cache_len=longest + config.max_new_tokens)
    work: "queue.Queue[int]" = queue.Queue()
    for index in pending:
        work.put(index)
    bar = Progress(len(prompts), before) if progress else None
    workers = [RequestWorker(i, devices[i % len(devices)], model=models[devices[i % len(devices)]].model,
                             tokenizer=tokenizer, prompts=prompts, work=work, output=output, settings=config,
                             progress=bar) for i in range(threads)]
    log.info("regenerate: %d of %d prompts to go, %d request threads on %s (%s)", len(pending), len(prompts), threads,
             ",".join(devices), "reduce-overhead decoding" if compiled else "eager")
    try:
        group = threadgraph.WorkerGroup(workers)
        group.start()
        group.join()
    finally:
        output.close()
        if bar is not None:
            bar.close()
    return {"records": len(prompts), "before": before, "generated": len(output.done) - before,
            "tokens": sum(w.generated for w in workers)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m examples.dflash_trainer.regenerate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="the target: a local HF model directory (model and tokenizer)")
    p.add_argument("--data", required=True, help="the prompts: JSONL of {\"prompt\": str} or {\"messages\": [...]}")
    p.add_argument("--out", required=True, help="the output JSONL; an existing one is continued (resume)")
    p.add_argument("--threads", type=int, default=4, help="request threads; default: 4")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the most tokens of a response; default: 256")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); above: sampled")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling with --temperature; default: 1.0")
    p.add_argument("--reasoning", choices=("keep", "drop"), default="keep",
                   help="keep the target's <think> reasoning in the responses, or drop it (thinking off where the "
                        "chat template has the switch); default: keep")
    p.add_argument("--devices", help="e.g. cuda:0,cuda:1 or cpu; default: every GPU, else the CPU")
    p.add_argument("--compile", choices=("auto", "eager", "reduce-overhead"), default="auto",
                   help="auto: reduce-overhead decoding on CUDA, eager on a CPU")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--debug", action="store_true", help="on an error, print the full traceback too")
    return p


def _checked(args: argparse.Namespace) -> None:
    if args.threads < 1:
        raise InputError(f"--threads must be at least 1, got {args.threads}")
    if args.max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if not args.temperature >= 0:
        raise InputError(f"--temperature must be 0 (greedy) or above, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise InputError(f"--top-p must be in (0, 1], got {args.top_p}")


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", datefmt="%H:%M:%S")
    devices = [d.strip() for d in args.devices.split(",")] if args.devices else None
    try:
        _checked(args)
        counts = regenerate(args.target, args.data, args.out, threads=args.threads, devices=devices,
                            compile=args.compile, progress=not args.no_progress, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p, reasoning=args.reasoning)
    except KeyboardInterrupt:
        print(f"stopped: the records generated so far are in {args.out}; run the same command again to continue",
              file=sys.stderr)
        return 130
    except Exception as err:
        return report_failure(err, "; the records written so far are kept: run the same command again to continue",
                              args.debug)
    print(f"regenerate: {counts['records']} records in {args.out} ({counts['before']} there before, "
          f"{counts['generated']} generated now, {counts['tokens']} tokens)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
