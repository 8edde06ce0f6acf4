"""Acceptance length tau by greedy speculative decoding (DFlash paper, temperature 0).

Simple, not fast: no KV cache, the target re-reads the whole prefix at every step. Each step
drafts [last, MASK, ...], the target verifies the block in one forward, the matching prefix is
accepted plus the target's own next token, and tau = mean(accepted + 1) over steps.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from torch import nn

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
                      mask_token_id: int, stop_token_ids: Sequence[int] = ()) -> dict:
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
                                  set(stop_token_ids), hist)
    finally:
        if was_training:
            drafter.train()
    steps = sum(hist)
    tau = sum((j + 1) * c for j, c in enumerate(hist)) / max(steps, 1)
    return {"tau": max(tau, 1.0), "steps": steps, "tokens": tokens_out, "accepted_hist": hist}


def _decode(target: TargetModel, propose: Proposer, prompt: torch.Tensor, block_size: int,
            max_new_tokens: int, stop: set[int], hist: list[int]) -> int:
    """Generate for one prompt, adding each step's accepted count to `hist`; returns tokens made."""
    if prompt.dim() != 1 or prompt.numel() == 0:
        raise ValueError(f"each prompt must be a non-empty 1-D id tensor, got shape "
                         f"{tuple(prompt.shape)}")
    seq = prompt.to(target.device).long()
    logits, features = target.logits_and_features(seq[None])
    seq = torch.cat([seq, logits[0, -1].argmax()[None]])  # prefill gives the first token
    context = features[0]  # features of every token except the newest
    produced = 1
    while produced < max_new_tokens and int(seq[-1]) not in stop:
        start = seq.shape[0] - 1
        draft = propose(seq, context, block_size).to(seq.device).long()
        logits, features = target.logits_and_features(torch.cat([seq, draft])[None])
        posterior = logits[0, start:start + block_size].argmax(-1)  # target's choice per slot
        accepted = int((draft == posterior[:-1]).long().cumprod(0).sum())
        hist[accepted] += 1
        new = torch.cat([draft[:accepted], posterior[accepted:accepted + 1]])
        if stop:
            hits = [i for i, t in enumerate(new.tolist()) if t in stop]
            new = new[:hits[0] + 1] if hits else new
        seq = torch.cat([seq, new])
        produced += new.shape[0]
        # Features up to the last accepted draft token are exact (causal target, same prefix).
        context = features[0, :seq.shape[0] - 1]
    return produced
