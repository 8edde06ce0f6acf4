"""The step decoder: a decoding loop of our own over a static KV cache in which each row writes at
its own slot, so a row that ended takes the next prompt while the others go on.

Each token of the whole batch is one call of one function of fixed shapes with no host sync (the
forward of one token per row and the choice of the next); on a GPU it is captured whole with
``threadgraph.capture_step``, so a token of the batch is one graph replay; eager on a CPU. Every
``SYNC_EVERY`` tokens (sooner when a row reaches its token limit) the host reads the new tokens,
hands out the rows that ended, and prefills the next prompts into the free rows once at least a
quarter of them are free (each prefill is one uncaptured forward).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

import threadgraph

from .attention import use_grouped_attention
from .decode import Advanced, Batch, Decoder, cache_keyword, cut

SYNC_EVERY = 16  # tokens between looks at the rows from the host (one sync each)


class RowCache:
    """A KV cache of ``rows`` x ``capacity`` slots a layer, filled by transformers' attention layers
    through ``update``. A decoding step writes each row's key and value at that row's slot in
    ``write``; a prefill of the rows in ``filling`` writes their (left-padded) prompts at slots
    [0, width) and attends to them alone."""

    def __init__(self, rows: int, capacity: int) -> None:
        self.rows, self.capacity = rows, capacity
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.write: Optional[torch.Tensor] = None
        self.filling: Optional[torch.Tensor] = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx not in self.keys:  # made by the first prefill: its dtype, device and heads
            rows, slots = self.rows, self.capacity
            self.keys[layer_idx] = key_states.new_zeros((rows, key_states.shape[1], slots, key_states.shape[3]))
            self.values[layer_idx] = value_states.new_zeros((rows, value_states.shape[1], slots,
                                                             value_states.shape[3]))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self.filling is not None:
            width = key_states.shape[2]
            keys[:, :, :width].index_copy_(0, self.filling, key_states)
            values[:, :, :width].index_copy_(0, self.filling, value_states)
            return key_states, value_states
        assert self.write is not None, "a decoding step needs each row's slot"
        slot = self.write.view(-1, 1, 1, 1)
        keys.scatter_(2, slot.expand(-1, keys.shape[1], 1, keys.shape[3]), key_states)
        values.scatter_(2, slot.expand(-1, values.shape[1], 1, values.shape[3]), value_states)
        return keys, values


@dataclass
class _Row:
    index: int  # the prompt's
    limit: int  # the most new tokens it may take
    tokens: list[int] = field(default_factory=list)
    counted: int = 0  # of its kept tokens, those already reported


class StepDecoder(Decoder):
    """Our own loop; each token of the batch one captured graph on a GPU; finished rows refilled."""

    def setup(self) -> None:
        text = self.model.config.get_text_config(decoder=True)
        kinds = getattr(text, "layer_types", None)
        windowed = (any(kind != "full_attention" for kind in kinds) if kinds is not None
                    else getattr(text, "sliding_window", None) is not None)
        if windowed:
            raise ValueError("--decode step takes targets whose layers all attend to the full context; this one "
                             "has sliding-window layers: use --decode generate")
        use_grouped_attention(self.model)  # reads the cache once a step (attention.py)
        rows, device = self.batch_size, self.device
        self.cache = RowCache(rows, self.max_cache_len)
        self.cache_keyword = cache_keyword(self.model)
        self.slots = torch.arange(self.max_cache_len, device=device)
        # Per row, on the device: the last token, the first slot it sees (after its left padding), the
        # slot it writes next, its prompt length, its prompt's index, the tokens it generated, live or not.
        self.last, self.first, self.write, self.base, self.prompt, self.steps, self.active = (
            torch.zeros(rows, dtype=torch.long, device=device) for _ in range(7))
        self.recent = torch.zeros((rows, SYNC_EVERY), dtype=torch.long, device=device)
        self.live: list[Optional[_Row]] = [None] * rows
        self.queued: collections.deque[tuple[int, tuple[int, ...], int]] = collections.deque()
        self.refilled = 0  # rows given a prompt while others were mid-response
        step: Callable[..., torch.Tensor] = self._step
        if self.accelerated:
            step = threadgraph.capture_step(self._step, warmup_steps=2)
        self.step = step

    def _step(self, last: torch.Tensor, first: torch.Tensor, write: torch.Tensor, base: torch.Tensor,
              prompt: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        # The mask is given whole (4-D boolean), so transformers builds none and nothing in the step
        # reads a value back to the host: the step captures as one graph. A row with no prompt yet
        # (base and steps 0) feeds position 0.
        self.cache.write = write
        seen = (self.slots >= first[:, None]) & (self.slots <= write[:, None])
        out = self.model(input_ids=last[:, None], attention_mask=seen[:, None, None, :],
                         position_ids=(base + steps - 1).clamp(min=0)[:, None], use_cache=True, logits_to_keep=1,
                         **{self.cache_keyword: self.cache})
        return self.sampler(out.logits[:, -1], prompt, steps)

    def advance(self, take: Callable[[], Optional[Batch]]) -> Optional[Advanced]:
        with torch.no_grad():  # not inference_mode: the cache's tensors stay ordinary ones, which capture reuses
            self._refill(take)
            if not any(self.live):
                return None
            live = [row for row in self.live if row is not None]
            count = min(SYNC_EVERY, min(row.limit - len(row.tokens) for row in live))
            for j in range(count):
                nxt = self.step(self.last, self.first, self.write, self.base, self.prompt, self.steps)
                self.recent[:, j].copy_(nxt)
                self.last.copy_(nxt)
                self.write.add_(self.active)  # on the device: no host-to-device copy, so no sync, per token
                self.steps.add_(self.active)
            return self._collect(count)

    def _refill(self, take: Callable[[], Optional[Batch]]) -> None:
        free = [r for r, row in enumerate(self.live) if row is None]
        if not free or len(free) < max(1, self.batch_size // 4):
            return
        while len(self.queued) < len(free):
            batch = take()
            if batch is None:
                break
            self.queued.extend(zip(batch.rows, batch.ids, itertools.repeat(batch.max_new)))
        group = [self.queued.popleft() for _ in range(min(len(free), len(self.queued)))]
        if not group:
            return
        rows = free[:len(group)]
        tokens, prompt_mask, indices = self._left_padded(Batch(tuple(i for i, _, _ in group),
                                                               tuple(ids for _, ids, _ in group), 0), len(group))
        width = tokens.shape[1]
        # A row of limit L writes slots width .. width + L - 2 while it runs, and keeps rewriting
        # width + L - 1 once it ended until it is refilled: width + L slots, exactly.
        if width + max(limit for _, _, limit in group) > self.max_cache_len:
            raise RuntimeError(f"step decoder: a prompt of {width} tokens and its token limit do not fit the "
                               f"cache's {self.max_cache_len} slots a row (sized by the longest prompt and the limit)")
        lengths = prompt_mask.sum(dim=1)
        first = width - lengths
        # (rows, width, width): a token sees its row's tokens up to itself; a left-padding token sees
        # itself only, so no row of scores is all masked (that would put NaN in the cache).
        slots = torch.arange(width, device=self.device)
        here = slots[:, None]
        mask = ((slots >= first[:, None, None]) | (slots == here)) & (slots <= here)
        where = torch.tensor(rows, device=self.device)
        self.cache.filling = where
        try:
            logits = self.model(input_ids=tokens, attention_mask=mask[:, None],
                                position_ids=(prompt_mask.cumsum(dim=1) - 1).clamp(min=0), use_cache=True,
                                logits_to_keep=1, **{self.cache_keyword: self.cache}).logits[:, -1]
        finally:
            self.cache.filling = None
        chosen = self.sampler(logits, indices, torch.zeros_like(indices))
        others = any(row is not None for row in self.live)
        for name, value in (("last", chosen), ("first", first), ("write", torch.full_like(first, width)),
                            ("base", lengths), ("prompt", indices), ("steps", torch.ones_like(first)),
                            ("active", torch.ones_like(first))):
            getattr(self, name).index_copy_(0, where, value.to(torch.long))
        for r, (index, _, limit), token in zip(rows, group, chosen.tolist()):
            self.live[r] = _Row(index, limit, [token])
        self.refilled += len(group) if others else 0

    def _collect(self, count: int) -> Advanced:
        new = self.recent[:, :count].tolist()
        finished, tokens = [], 0
        for r, row in enumerate(self.live):
            if row is None:
                continue
            row.tokens.extend(new[r])
            result = cut(row.tokens, self.stops, row.limit)
            tokens += len(result.tokens) - row.counted
            row.counted = len(result.tokens)
            if result.stopped or len(row.tokens) >= row.limit:
                finished.append((row.index, result))
                self.live[r] = None
                self.active[r] = 0
        return Advanced(finished, tokens)
