"""Acceptance length tau by greedy speculative decoding (DFlash paper, temperature 0).

The target keeps a KV cache of the accepted tokens: each step it reads only the block it verifies,
then the cache drops the rejected tokens (``kv_cache=False`` re-reads the whole prefix instead, the
same tokens and tau). The drafter reads all context features at each step, as at inference. Each step
drafts [last, MASK, ...], the target verifies the block in one forward, the matching prefix is
accepted plus the target's own next token, and tau = mean(accepted + 1) over steps.
"""

from __future__ import annotations

import json
from typing import Callable, Optional, Sequence

import torch
from torch import nn

from .data.records import TokenData
from .errors import InputError
from .target import TargetModel

# propose(tokens [T], context_features [T-1, n*H], block_size) -> draft tokens [block_size-1]
Proposer = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def dflash_proposer(drafter: nn.Module, mask_token_id: int) -> Proposer:
    """Greedy proposals of a DFlash drafter: argmax of outputs 1..Bs-1 of [last, MASK...]."""
    device = next(drafter.parameters()).device

    def propose(tokens: torch.Tensor, context: torch.Tensor, block_size: int) -> torch.Tensor:
        start = tokens.shape[0] - 1  # position of the last token, the block's anchor
        block = torch.full((1, block_size), mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = tokens[-1]
        q_pos = torch.arange(start, start + block_size, device=device)[None]
        ctx_pos = torch.arange(context.shape[0], device=device)[None]
        # No mask: at inference the block sees all context (all before the anchor) and itself.
        logits = drafter(block, context[None].to(device), q_pos, ctx_pos, None)
        return logits[0, 1:].argmax(-1)

    return propose


def repeat_last_token(tokens: torch.Tensor, context: torch.Tensor,
                      block_size: int) -> torch.Tensor:
    """Baseline proposal: the last token, block_size-1 times."""
    return tokens[-1].repeat(block_size - 1)


@torch.no_grad()
def acceptance_length(target: TargetModel, drafter: nn.Module | Proposer,
                      prompts: Sequence[torch.Tensor], block_size: int, max_new_tokens: int,
                      mask_token_id: int, stop_token_ids: Sequence[int] = (), kv_cache: bool = True) -> dict:
    """Greedy speculative decoding of each prompt (1-D id tensors); returns
    {"tau", "steps", "tokens", "accepted_hist"}, where accepted_hist[j] counts steps that
    accepted j drafted tokens. Every step verifies a full block, so the last one may run past
    max_new_tokens; a stop token ends the prompt after the step that produced it."""
    if block_size < 2 or max_new_tokens < 1 or not prompts:
        raise ValueError(f"need block_size >= 2, max_new_tokens >= 1 and at least one prompt; got "
                         f"block_size={block_size}, max_new_tokens={max_new_tokens}, "
                         f"{len(prompts)} prompts")
    was_training = isinstance(drafter, nn.Module) and drafter.training
    if isinstance(drafter, nn.Module):
        propose = dflash_proposer(drafter.eval(), mask_token_id)
    else:
        propose = drafter
    hist = [0] * block_size
    tokens_out = 0
    try:
        for prompt in prompts:
            tokens_out += _decode(target, propose, prompt, block_size, max_new_tokens,
                                  set(stop_token_ids), hist, kv_cache)
    finally:
        if was_training:
            drafter.train()
    steps = sum(hist)
    tau = sum((j + 1) * c for j, c in enumerate(hist)) / max(steps, 1)
    return {"tau": max(tau, 1.0), "steps": steps, "tokens": tokens_out, "accepted_hist": hist}


def _accepted(draft: torch.Tensor, posterior: torch.Tensor, stop: set[int], hist: list[int]) -> torch.Tensor:
    """The tokens one verification adds: the draft's prefix the target agrees with, then the target's own
    next token, cut after a stop token; counts the accepted length in ``hist``."""
    accepted = int((draft == posterior[:-1]).long().cumprod(0).sum())
    hist[accepted] += 1
    new = torch.cat([draft[:accepted], posterior[accepted:accepted + 1]])
    if stop:
        hits = [i for i, t in enumerate(new.tolist()) if t in stop]
        new = new[:hits[0] + 1] if hits else new
    return new


def _decode(target: TargetModel, propose: Proposer, prompt: torch.Tensor, block_size: int,
            max_new_tokens: int, stop: set[int], hist: list[int], kv_cache: bool = True) -> int:
    """Generate for one prompt, adding each step's accepted count to `hist`; returns tokens made."""
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"each prompt must be a non-empty 1-D id tensor, got shape "
                         f"{tuple(prompt.shape)}")
    seq = prompt.to(target.device).long()
    if kv_cache:
        return _decode_cached(target, propose, seq, block_size, max_new_tokens, stop, hist)
    logits, features = target.logits_and_features(seq[None])
    seq = torch.cat([seq, logits[0, -1].argmax()[None]])  # prefill gives the first token
    context = features[0]  # features of every token except the newest
    produced = 1
    while produced < max_new_tokens and int(seq[-1]) not in stop:
        start = seq.shape[0] - 1
        draft = propose(seq, context, block_size).to(seq.device).long()
        logits, features = target.logits_and_features(torch.cat([seq, draft])[None])
        posterior = logits[0, start:start + block_size].argmax(-1)  # target's choice per slot
        new = _accepted(draft, posterior, stop, hist)
        seq = torch.cat([seq, new])
        produced += new.shape[0]
        # Features up to the last accepted draft token are exact (causal target, same prefix).
        context = features[0, :seq.shape[0] - 1]
    return produced


def _decode_cached(target: TargetModel, propose: Proposer, seq: torch.Tensor, block_size: int,
                   max_new_tokens: int, stop: set[int], hist: list[int]) -> int:
    """_decode() with the target's KV cache: the cache holds every token but the newest."""
    logits, context, cache = target.cached_logits_and_features(seq[None])
    seq = torch.cat([seq, logits[0, -1].argmax()[None]])
    context = context[0]
    produced = 1
    while produced < max_new_tokens and int(seq[-1]) not in stop:
        draft = propose(seq, context, block_size).to(seq.device).long()
        logits, features, cache = target.cached_logits_and_features(torch.cat([seq[-1:], draft])[None], cache)
        posterior = logits[0].argmax(-1)  # the target's choice after each token of [last, draft]
        new = _accepted(draft, posterior, stop, hist)
        seq = torch.cat([seq, new])
        produced += new.shape[0]
        # The block's first len(new) tokens are the old newest token and the accepted drafts: now known.
        context = torch.cat([context, features[0, :new.shape[0]]])
        rejected = block_size - new.shape[0]  # the cache holds start + block_size tokens
        if rejected:
            cache.crop(-rejected)  # transformers' crop: a negative count removes that many from the end
    return produced


EVAL_SPLIT_SEED = 50_050  # the fixed split of --data: the same samples are held out whatever --seed is


def prompts_of(data: TokenData, count: int) -> list[torch.Tensor]:
    """The prompt parts (the tokens before the first response token) of the first ``count`` samples
    of ``data`` that have one."""
    prompts = []
    for ids, mask in zip(data.ids, data.loss_mask):
        first_response = int(mask.nonzero()[0]) if mask.any() else ids.shape[0]
        if first_response > 0:
            prompts.append(ids[:first_response].long())
        if len(prompts) == count:
            break
    return prompts


def split_held_out(data: TokenData, count: int) -> tuple[TokenData, TokenData]:
    """(training, held out): ``count`` samples drawn with a fixed seed (EVAL_SPLIT_SEED) are held out
    for evaluation and removed from the training data, which keeps its order."""
    if len(data) <= count:
        raise InputError(f"the data has {len(data)} samples, too few to hold {count} out for evaluation and train "
                         f"on the rest; lower --eval-prompts or pass --eval-data FILE")
    held = torch.zeros(len(data), dtype=torch.bool)
    held[torch.randperm(len(data), generator=torch.Generator().manual_seed(EVAL_SPLIT_SEED))[:count]] = True
    train, out = ~held, held
    return (TokenData(data.ids[train], data.loss_mask[train], data.skipped),
            TokenData(data.ids[out], data.loss_mask[out], 0))


def read_prompts(eval_jsonl: str, count: int) -> list[torch.Tensor]:
    """The first ``count`` prompts of an eval file of ``{"input_ids": [...]}`` lines (the embedded default's)."""
    with open(eval_jsonl) as f:
        return [torch.tensor(json.loads(line)["input_ids"]) for line in f if line.strip()][:count]


class Evaluator:
    """Acceptance length tau of a training drafter on held-out prompts, verified by the frozen
    target on the drafter's device (eager and read-only, so it may be the target stages' own)."""

    def __init__(self, target: TargetModel, prompts: list[torch.Tensor], *, block_size: int,
                 max_new_tokens: int, autocast_dtype: Optional[torch.dtype]) -> None:
        self.target = target
        self.device, self.prompts, self.autocast_dtype = target.device, prompts, autocast_dtype
        self._args = (block_size, max_new_tokens, self.target.mask_token_id)
        tokenizer = self.target.tokenizer
        self._stops = [t for t in (tokenizer.eos_token_id,) if t is not None] if tokenizer is not None else []

    def __call__(self, drafter: nn.Module) -> dict:
        """{"tau", "steps", "accepted_hist", "prompts", "tokens"} of ``drafter``: tau, and the number of
        held-out prompts and of generated tokens it rests on; empty without prompts."""
        if not self.prompts:
            return {}
        result = self._tau(drafter)
        return {"tau": result["tau"], "steps": result["steps"], "accepted_hist": result["accepted_hist"],
                "prompts": len(self.prompts), "tokens": result["tokens"]}

    def baselines(self, drafter: nn.Module) -> dict:
        """tau of the untrained drafter and of repeating the last token: what training must beat."""
        if not self.prompts:
            return {}
        return {"tau_random_init": self._tau(drafter)["tau"], "tau_repeat_last_token": self._tau(repeat_last_token)["tau"]}

    def _tau(self, proposer: nn.Module | Proposer) -> dict:
        dtype = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=dtype, enabled=dtype is not None):
            return acceptance_length(self.target, proposer, self.prompts, *self._args, stop_token_ids=self._stops)
