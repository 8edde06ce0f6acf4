"""A regeneration run: the prompts cut into batches, request threads decoding them, the records
written in prompt-index order.

Prompts are taken in windows of index order; within a window they are sorted by length and cut
into batches of ``--batch-size`` (rows of similar length pad little). Request threads (threadgraph
``CompiledWorkerThread``s in one ``WorkerGroup``, sharing one copy of the target per device) take
batches from one queue (the step decoder takes the rows of a batch into the slots of rows that
ended); the output holds a finished record back until every index before it is written.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

import threadgraph

from ..data.chat import THINK_CLOSE, THINK_OPEN
from ..errors import InputError
from .decode import DECODERS, Batch, ContinuousDecoder, Decoder, GenerateDecoder
from .io import Output, Prompt, read_prompts
from .sampling import Sampler
from .step import StepDecoder

log = logging.getLogger("dflash")

WINDOW_BATCHES = 4  # batches per thread in one window of prompts


@dataclass(frozen=True)
class Settings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int = 0
    reasoning: str = "keep"  # or "drop"
    batch_size: int = 8
    decode: str = "auto"  # a decoder of decode.DECODERS; auto: generate (the fastest measured, README)


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


def stop_tokens(tokenizer: Any) -> frozenset[int]:
    """The tokens that end a response: the tokenizer's end of sequence and padding."""
    return frozenset(t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None)


def response_text(tokenizer: Any, ids: list[int], reasoning: str) -> str:
    """The generated tokens up to the end of the turn, as text; with ``drop``, no think block."""
    stops = stop_tokens(tokenizer)
    end = next((i for i, t in enumerate(ids) if t in stops), len(ids))
    text = tokenizer.decode(ids[:end], skip_special_tokens=False)
    if reasoning == "drop" and THINK_CLOSE in text:
        text = text.split(THINK_CLOSE, 1)[1].lstrip("\n")
    elif reasoning == "drop" and text.lstrip().startswith(THINK_OPEN):  # cut off inside its thinking
        text = ""
    return text


def batches(pending: list[int], lengths: dict[int, int], batch_size: int, window: int,
            positions: int, max_new_tokens: int) -> Iterator[Batch]:
    """``pending`` indices in windows of ``window``, each sorted by prompt length and cut into
    batches; a row may take new tokens up to the target's ``positions``, and only rows of one such
    limit share a batch, so no row is cut shorter by a longer one beside it."""
    def limit(i: int) -> int:
        return min(max_new_tokens, positions - lengths[i])

    for start in range(0, len(pending), window):
        part = sorted(pending[start:start + window], key=lambda i: (lengths[i], i))
        for max_new, same in itertools.groupby(part, key=limit):  # limits fall as lengths rise: runs
            same = list(same)
            for b in range(0, len(same), batch_size):
                yield Batch(tuple(same[b:b + batch_size]), (), max_new)


class Progress:
    """Records done and generated tokens/s, on a tqdm bar (stderr)."""

    def __init__(self, total: int, done: int) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, initial=done, unit="rec", desc="regenerate", dynamic_ncols=True)
        self._lock = threading.Lock()
        self.tokens, self._began = 0, time.perf_counter()

    def add(self, records: int, tokens: int) -> None:
        with self._lock:
            self.tokens += tokens
            self.bar.update(records)
            self.bar.set_postfix(tok_s=f"{self.tokens / max(time.perf_counter() - self._began, 1e-9):.0f}")

    def close(self) -> None:
        self.bar.close()


class RequestWorker(threadgraph.CompiledWorkerThread):
    """One request thread: its own decoder, over the shared target of its device, takes batches from
    ``work`` until it is empty; the thread hands each finished row's record to the output."""

    def __init__(self, index: int, device: str, *, decoder: Decoder, tokenizer: Any, prompts: list[Prompt],
                 ids: dict[int, list[int]], work: "queue.Queue[Batch]", output: Output, reasoning: str,
                 progress: Optional[Progress]) -> None:
        super().__init__(device, name=f"request{index}", warmup_steps=1)
        self.decoder, self.tokenizer, self.prompts, self.ids, self.work = decoder, tokenizer, prompts, ids, work
        self.output, self.reasoning, self.progress = output, reasoning, progress
        self.generated = self.written = self.truncated = 0
        self.rounds: list[tuple[float, float, int]] = []  # (began, ended, tokens) of each decoder call

    def setup(self) -> None:
        self.decoder.setup()

    def teardown(self) -> None:
        self.decoder.close()

    def step(self) -> None:
        began = time.perf_counter()
        advanced = self.decoder.advance(self._take)
        if advanced is None:
            self.stop()
            return
        self.rounds.append((began, time.perf_counter(), advanced.tokens))
        for index, result in advanced.finished:
            text = response_text(self.tokenizer, result.tokens, self.reasoning)
            self.output.put(self.prompts[index].record(text, len(result.tokens), truncated=not result.stopped))
            self.truncated += not result.stopped
        self.generated += advanced.tokens
        self.written += len(advanced.finished)
        if self.progress is not None:
            self.progress.add(len(advanced.finished), advanced.tokens)

    def _take(self) -> Optional[Batch]:
        try:
            batch = self.work.get_nowait()
        except queue.Empty:
            return None
        return Batch(batch.rows, tuple(tuple(self.ids[i]) for i in batch.rows), batch.max_new)


def decoder_class(name: str) -> type[Decoder]:
    return {"generate": GenerateDecoder, "step": StepDecoder, "continuous": ContinuousDecoder}[name]


def resolve_decode(decode: str) -> str:
    if decode == "auto":  # the fastest in the committed GPU measurement (benchmarks regenerate-throughput)
        return "generate"
    if decode not in DECODERS:
        raise InputError(f"--decode must be auto or one of {', '.join(DECODERS)}, got {decode!r}")
    return decode


def regenerate(target: str, data: str, out: str, *, threads: int = 4, devices: Optional[list[str]] = None,
               progress: bool = True, **settings: Any) -> dict:
    """Generate the missing records of ``out``; returns counts (done before, generated now, skipped,
    truncated, total) and timings (startup: until every thread's first decoder call ended; steady tokens/s
    after)."""
    began = time.perf_counter()
    config = Settings(**settings)
    prompts = read_prompts(data)
    output = Output(out, prompts, data)
    try:
        return _run(target, prompts, output, config, threads, devices, progress, began, out)
    finally:
        output.close()


def _run(target: str, prompts: list[Prompt], output: Output, config: Settings, threads: int,
         devices: Optional[list[str]], progress: bool, began: float, out: str) -> dict:
    from ..target import TargetModel

    pending = [p.index for p in prompts if p.index not in output.done]
    counts = {"records": len(prompts), "before": len(output.done), "generated": 0, "tokens": 0, "prompt_tokens": 0,
              "skipped": 0, "truncated": 0}
    if not pending:
        return counts
    devices = devices or ([f"cuda:{i}" for i in range(torch.cuda.device_count())] or ["cpu"])
    decode = resolve_decode(config.decode)
    models = {d: TargetModel.from_pretrained(target, num_feature_layers=1, device=d,
                                             dtype=torch.bfloat16 if d.startswith("cuda") else None) for d in devices}
    first = next(iter(models.values()))
    tokenizer = first.tokenizer
    positions = int(getattr(first.config.get_text_config(decoder=True), "max_position_embeddings", 0) or 1 << 30)
    ids = {i: render(tokenizer, prompts[i], config.reasoning) for i in pending}
    too_long = [i for i in pending if len(ids[i]) >= positions]
    for i in too_long:
        output.skip(i)
    if too_long:
        log.warning("regenerate: %d prompt(s) skipped, longer than the target's %d positions (first: index %d); "
                    "they get no record", len(too_long), positions, too_long[0])
    pending = [i for i in pending if i not in set(too_long)]
    counts["skipped"] = len(too_long)
    if not pending:
        return counts
    lengths = {i: len(ids[i]) for i in pending}
    counts["prompt_tokens"] = sum(lengths.values())
    longest = max(lengths.values()) + config.max_new_tokens
    # generate's cache slots are positions; the step decoder's rows hold a left-padded prompt and its limit
    max_cache_len = longest if decode == "step" else min(longest, positions)
    work: "queue.Queue[Batch]" = queue.Queue()
    for batch in batches(pending, lengths, config.batch_size, config.batch_size * threads * WINDOW_BATCHES,
                         positions, config.max_new_tokens):
        work.put(batch)
    sampler = Sampler(config.temperature, config.top_p, config.seed)
    stops = stop_tokens(tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    bar = Progress(len(prompts), counts["before"] + len(too_long)) if progress else None
    workers = []
    for i in range(threads):
        device = devices[i % len(devices)]
        decoder = decoder_class(decode)(models[device].model, stops=stops, pad_id=pad_id, sampler=sampler,
                                        batch_size=config.batch_size, max_cache_len=max_cache_len,
                                        device=torch.device(device), accelerated=device.startswith("cuda"))
        workers.append(RequestWorker(i, device, decoder=decoder, tokenizer=tokenizer, prompts=prompts, ids=ids,
                                     work=work, output=output, reasoning=config.reasoning, progress=bar))
    log.info("regenerate: %d of %d prompts to go, %d request thread(s) on %s, batches of %d, decoding: %s",
             len(pending), len(prompts), threads, ",".join(devices), config.batch_size, decode)
    try:
        group = threadgraph.WorkerGroup(workers)
        group.start()
        group.join()
    finally:
        if bar is not None:
            bar.close()
    counts.update(generated=len(output.done) - counts["before"], tokens=sum(w.generated for w in workers),
                  truncated=sum(w.truncated for w in workers), decode=decode, **_timings(workers, began))
    log.info("regenerate: %d records written to %s (%d truncated by the token limit, %d skipped)",
             counts["generated"], out, counts["truncated"], counts["skipped"])
    return counts


def _timings(workers: list[RequestWorker], began: float) -> dict:
    """Startup: from the call until the last thread's first decoder call ended (load, compile, capture and
    one batch, or the step decoder's first tokens, each); steady: the tokens of the calls begun after that,
    over the time until the last one ended."""
    firsts = [w.rounds[0][1] for w in workers if w.rounds]
    if not firsts:
        return {"startup_s": None, "steady_tokens": 0, "steady_s": 0.0, "steady_tokens_per_s": None}
    startup_end = max(firsts)
    steady = [b for w in workers for b in w.rounds if b[0] >= startup_end]
    tokens = sum(n for _, _, n in steady)
    span = max((end for _, end, _ in steady), default=startup_end) - startup_end
    return {"startup_s": startup_end - began, "steady_tokens": tokens, "steady_s": span,
            "steady_tokens_per_s": tokens / span if tokens and span > 0 else None}
