"""Batched decoding of one request thread: a batch of prompts in, each row's new tokens out.

Three decoders, one per ``--decode`` choice:

- ``generate``: transformers' ``generate()`` on the left-padded batch; on a GPU with a static KV
  cache of the thread's own and the decoding step compiled with ``mode="reduce-overhead"``
  (CUDAGraph Trees, which threadgraph makes work in threads), eager on a CPU.
- ``step``: a decoding loop of our own over a static KV cache whose step (the forward of one token
  per row and the choice of the next) is one function of fixed shapes with no host sync; on a GPU it
  is captured whole with ``threadgraph.capture_step``, so each token of the whole batch is one
  graph replay; eager on a CPU.
- ``continuous``: transformers' continuous batching (``ContinuousBatchingManager``: a paged KV
  cache, finished rows refilled every step, its own CUDA graphs), one manager per request thread.

Every decoder returns, for each row, the tokens up to and including its stop token (or all of
them when it never stopped), so the records do not depend on the decoder, the thread or the batch
beyond floating-point differences.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

import threadgraph

from .attention import use_grouped_attention
from .sampling import RowsLogitsProcessor, Sampler

log = logging.getLogger("dflash")

DECODERS = ("generate", "step", "continuous")
SYNC_EVERY = 16  # step decoder: tokens between looks at whether every row has stopped (one host sync each)


@dataclass(frozen=True)
class Batch:
    rows: tuple[int, ...]  # prompt indices
    ids: tuple[tuple[int, ...], ...]  # their prompt tokens
    max_new: int  # the most new tokens any row may take


@dataclass(frozen=True)
class Generated:
    tokens: list[int]  # up to and including the stop token
    stopped: bool  # False: cut by the token limit before its end of turn


def cache_keyword(model: Any) -> str:
    """The keyword a model takes its KV cache object by: ``cache`` where its ``forward`` takes one so
    (recent transformers 5 releases), else ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def cut(row: list[int], stops: frozenset[int], limit: int) -> Generated:
    row = row[:limit]
    end = next((i for i, t in enumerate(row) if t in stops), None)
    return Generated(row, False) if end is None else Generated(row[:end + 1], True)


class Decoder:
    """One request thread's decoder; ``setup`` runs in that thread before its first batch."""

    def __init__(self, model: Any, *, stops: frozenset[int], pad_id: int, sampler: Sampler, batch_size: int,
                 max_cache_len: int, device: torch.device, accelerated: bool) -> None:
        self.model, self.stops, self.pad_id, self.sampler = model, stops, pad_id, sampler
        self.batch_size, self.max_cache_len, self.device, self.accelerated = batch_size, max_cache_len, device, accelerated

    def setup(self) -> None:
        pass

    def run(self, batch: Batch) -> list[Generated]:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def _left_padded(self, batch: Batch, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Token ids and attention mask (rows, L), left-padded, and the rows' prompt indices; rows past
        the batch's repeat its first one (fixed shapes for graphs) and are dropped afterwards."""
        ids = list(batch.ids) + [batch.ids[0]] * (rows - len(batch.ids))
        width = max(len(r) for r in ids)
        tokens = torch.full((rows, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((rows, width), dtype=torch.long)
        for i, r in enumerate(ids):
            tokens[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        indices = torch.tensor(list(batch.rows) + [batch.rows[0]] * (rows - len(batch.rows)))
        return tokens.to(self.device), mask.to(self.device), indices.to(self.device)

    def _new_cache(self) -> Any:
        from transformers import StaticCache

        config = self.model.config.get_text_config(decoder=True)
        return StaticCache(config=config, max_cache_len=self.max_cache_len)


class GenerateDecoder(Decoder):
    """transformers' ``generate()`` at batch B; compiled (reduce-overhead) on a GPU."""

    def setup(self) -> None:
        if self.accelerated:  # built in this thread, one worker at a time (the group's setup turn)
            from transformers import CompileConfig

            self.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=False)
            self.model.get_compiled_call(self.compile_config)
            # The thread's own cache, reset and reused by every batch: its tensors keep their addresses,
            # so the recorded graphs replay instead of recording again for a new cache.
            self.cache = self._new_cache()
            self.cache_keyword = cache_keyword(self.model)

    def run(self, batch: Batch) -> list[Generated]:
        rows = self.batch_size if self.accelerated else len(batch.rows)
        tokens, mask, indices = self._left_padded(batch, rows)
        kwargs: dict[str, Any] = {"max_new_tokens": batch.max_new, "min_new_tokens": 0, "do_sample": False,
                                  "pad_token_id": self.pad_id, "eos_token_id": sorted(self.stops)}
        if not self.sampler.greedy:
            kwargs["logits_processor"] = [RowsLogitsProcessor(self.sampler, indices, tokens.shape[1])]
        with torch.inference_mode():  # the cache's tensors were made in it: reset them in it too
            if self.accelerated:
                self.cache.reset()
                kwargs[self.cache_keyword] = self.cache
                kwargs["compile_config"] = self.compile_config
            out = self.model.generate(tokens, attention_mask=mask, **kwargs)
        new = out[:len(batch.rows), tokens.shape[1]:].tolist()
        return [cut(r, self.stops, batch.max_new) for r in new]


class StepDecoder(Decoder):
    """Our own loop over a static KV cache; each token of the batch one captured graph on a GPU."""

    def setup(self) -> None:
        use_grouped_attention(self.model)  # reads the static cache once a step (attention.py)
        self.cache = self._new_cache()
        self.cache_keyword = cache_keyword(self.model)
        self.slots = torch.arange(self.max_cache_len, device=self.device)
        step: Callable[..., torch.Tensor] = self._step
        if self.accelerated:
            step = threadgraph.capture_step(self._step, warmup_steps=2)
        self.step = step

    def _step(self, tokens: torch.Tensor, first: torch.Tensor, positions: torch.Tensor, cache_position: torch.Tensor,
              rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        # The attention mask as the model's 4-D boolean one (rows, 1, 1, cache): each row sees its own
        # tokens up to this one. Given whole, transformers builds none, so nothing in the step reads a
        # value back to the host and the step captures as one graph.
        seen = (self.slots >= first) & (self.slots <= cache_position)
        out = self.model(input_ids=tokens, attention_mask=seen[:, None, None, :], position_ids=positions,
                         cache_position=cache_position, use_cache=True, logits_to_keep=1,
                         **{self.cache_keyword: self.cache})
        return self.sampler(out.logits[:, -1], rows, steps)

    def run(self, batch: Batch) -> list[Generated]:
        rows = self.batch_size  # always: the cache is sized by its first batch
        tokens, prompt_mask, indices = self._left_padded(batch, rows)
        width = tokens.shape[1]
        first = (width - prompt_mask.sum(dim=1, keepdim=True))  # each row's first slot (after its left padding)
        base = width - first  # each row's first generated position
        out = torch.empty((rows, batch.max_new), dtype=torch.long, device=self.device)
        with torch.no_grad():  # not inference_mode: the cache's tensors stay ordinary ones, which capture reuses
            self.cache.reset()
            # (rows, width, cache): a token sees its row's tokens up to itself; a left-padding token sees
            # itself only, so no row of scores is all masked (that would put NaN in the cache).
            positions = torch.arange(width, device=self.device)
            slots, here = self.slots, positions[:, None]
            prefill_mask = ((slots >= first[:, :, None]) | (slots == here)) & (slots <= here)
            logits = self.model(input_ids=tokens, attention_mask=prefill_mask[:, None],
                                position_ids=(prompt_mask.cumsum(dim=1) - 1).clamp(min=0),
                                cache_position=positions, use_cache=True,
                                logits_to_keep=1, **{self.cache_keyword: self.cache}).logits[:, -1]
            steps = torch.zeros(rows, dtype=torch.long, device=self.device)
            out[:, 0] = self.sampler(logits, indices, steps)
            done = 1
            stops = torch.tensor(sorted(self.stops), device=self.device)
            while done < batch.max_new:
                if done % SYNC_EVERY == 0 and bool(torch.isin(out[:, :done], stops).any(dim=1).all()):
                    break
                steps.fill_(done)  # on the device: no host-to-device copy, so no sync, per token
                nxt = self.step(out[:, done - 1:done], first, base + steps[:, None] - 1, steps[:1] + (width - 1),
                                indices, steps)
                out[:, done].copy_(nxt)
                done += 1
        return [cut(r, self.stops, done) for r in out[:len(batch.rows), :done].tolist()]


class ContinuousDecoder(Decoder):
    """transformers' continuous batching: one manager per request thread, fed a window of prompts."""

    def setup(self) -> None:
        from transformers import GenerationConfig

        if not self.sampler.greedy:
            raise ValueError("continuous batching samples with its own random state: use --decode step or generate "
                             "for sampled records reproducible per --seed")
        config = GenerationConfig(do_sample=False, eos_token_id=sorted(self.stops), pad_token_id=self.pad_id,
                                  max_new_tokens=self.max_cache_len)
        batching = continuous_batching_config(self.batch_size, self.max_cache_len)
        self.manager = self.model.init_continuous_batching(generation_config=config,
                                                           continuous_batching_config=batching)
        if self.accelerated:
            self.manager.warmup()  # captures its graphs here, in the request thread
        self.manager.start()

    def run(self, batch: Batch) -> list[Generated]:
        ids = {}
        for row, prompt in zip(batch.rows, batch.ids):
            ids[self.manager.add_request(list(prompt), request_id=f"row{row}", max_new_tokens=batch.max_new)] = row
        results: dict[int, list[int]] = {}
        while len(results) < len(ids):
            result = self.manager.get_result(timeout=1)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError(f"continuous batching stopped with {len(ids) - len(results)} of "
                                       f"{len(ids)} requests unanswered")
                continue
            if getattr(result, "error", None):
                raise RuntimeError(f"continuous batching failed request {result.request_id}: {result.error}")
            if result.is_finished():
                results[ids[result.request_id]] = list(result.generated_tokens)
        return [cut(results[row], self.stops, batch.max_new) for row in batch.rows]

    def close(self) -> None:
        manager = getattr(self, "manager", None)
        if manager is not None:
            manager.stop(block=True)


def continuous_batching_config(batch_size: int, max_len: int) -> Any:
    """transformers' continuous batching sized for ``batch_size`` rows of at most ``max_len`` tokens:
    a paged cache that holds every row at its longest (pages of transformers' default 256 tokens)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    pages_per_row = -(-max_len // 256) + 1
    return ContinuousBatchingConfig(num_blocks=batch_size * pages_per_row, max_batch_tokens=max(batch_size, max_len),
                                    max_requests_per_batch=batch_size)


def decoder_class(name: str) -> type[Decoder]:
    return {"generate": GenerateDecoder, "step": StepDecoder, "continuous": ContinuousDecoder}[name]
