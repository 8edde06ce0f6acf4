"""Attention for the step decoder: grouped-query attention over the static KV cache that reads each
key and value once.

transformers' SDPA path repeats every key/value head for its query heads (``repeat_kv``) whenever a
mask is given, which copies the whole static cache twice a layer and step; here the query heads of
one key/value head are stacked instead, so a decoding step reads the cache once, as its bandwidth
bound assumes. Registered with transformers' ``AttentionInterface`` under ``NAME``; the step decoder
passes its own 4-D boolean masks, so transformers builds none for it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

NAME = "dflash_grouped"


def grouped_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Optional[torch.Tensor], scaling: Optional[float] = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query (B, H, Q, D), key and value (B, Hkv, K, D), attention_mask (B, 1, Q, K) boolean (True:
    attend); returns (B, Q, H, D) as transformers' attention functions do."""
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    scale = dim ** -0.5 if scaling is None else scaling
    stacked = query.reshape(batch, kv_heads, group * q_len, dim)  # query head h reads key head h // group
    scores = torch.matmul(stacked, key.transpose(-1, -2)).float() * scale
    scores = scores.view(batch, kv_heads, group, q_len, -1)
    if attention_mask is not None:
        scores = scores.masked_fill(~attention_mask[:, :, None, :, : scores.shape[-1]], float("-inf"))
    probs = scores.softmax(dim=-1).to(value.dtype).view(batch, kv_heads, group * q_len, -1)
    out = torch.matmul(probs, value).view(batch, heads, q_len, dim)
    return out.transpose(1, 2).contiguous(), None


def use_grouped_attention(model: Any) -> None:
    """Register the attention and make ``model`` use it (every module reads its config's choice)."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, grouped_attention)
    model.config._attn_implementation = NAME
    text = model.config.get_text_config(decoder=True)
    if text is not model.config:
        text._attn_implementation = NAME
