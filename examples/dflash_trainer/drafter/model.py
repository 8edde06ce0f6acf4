"""The DFlash drafter: a few non-causal Qwen3-style layers conditioned on target features.

Shapes are static for a given (batch, context length, number of queries), so the training step
can be captured in a CUDA graph. Inference loops live in `eval.py`, not here.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def target_layer_ids(num_target_layers: int, n: int) -> list[int]:
    """Pick `n` target layers spread evenly from the 2nd to the 3rd-from-last (DFlash paper).

    Read them as HF `hidden_states[id + 1]` (index 0 is the embedding output).
    """
    if n < 1:
        raise ValueError(f"need at least one target feature layer, got n={n}")
    if n == 1:
        if num_target_layers < 2:
            raise ValueError(
                f"target has {num_target_layers} layer(s) but layer 1 is needed for n=1; "
                f"use a target with at least 2 layers"
            )
        return [1]
    # Distinct ids from 1 to L-3 need L-4 >= n-1.
    if num_target_layers < n + 3:
        raise ValueError(
            f"cannot spread n={n} feature layers over a {num_target_layers}-layer target "
            f"(layers 1..L-3 must hold n distinct ids, so L >= n+3 = {n + 3}); "
            f"lower num_target_layers_used or use a deeper target"
        )
    span = num_target_layers - 4
    return [round(1 + i * span / (n - 1)) for i in range(n)]


class RMSNorm(nn.Module):
    """Qwen3's RMSNorm: statistics in float32 so bf16 training matches the target's numerics."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE computed from explicit positions: queries and keys sit at different positions here."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        # Not persistent: it is derived from the config, so checkpoints hold only weights.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate `x` [B, heads, T, D] by `positions` [B, T]."""
        freqs = positions[:, None, :, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        xf = x.float()
        return (xf * emb.cos() + _rotate_half(xf) * emb.sin()).to(x.dtype)


class DraftAttention(nn.Module):
    """Non-causal attention; keys/values are [context features ; block tokens] (KV injection)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA)"
            )
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.q_norm = RMSNorm(head_dim, eps)
        self.k_norm = RMSNorm(head_dim, eps)

    def forward(self, x: torch.Tensor, context: torch.Tensor, rotary: Rotary,
                q_pos: torch.Tensor, kv_pos: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, q_len, _ = x.shape
        kv_in = torch.cat([context, x], dim=1)  # context skips the input norm; W_k/W_v shared
        kv_len = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, q_len, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(kv_in).view(b, kv_len, self.num_kv_heads, self.head_dim))
        v = self.v_proj(kv_in).view(b, kv_len, self.num_kv_heads, self.head_dim)
        q = rotary(q.transpose(1, 2), q_pos)
        k = rotary(k.transpose(1, 2), kv_pos)
        v = v.transpose(1, 2)
        # Explicit head repeat instead of enable_gqa: the masked memory-efficient kernel lacks GQA.
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DraftMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, eps: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = DraftAttention(hidden_size, num_heads, num_kv_heads, head_dim, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = DraftMLP(hidden_size, intermediate_size)

    def forward(self, x: torch.Tensor, context: torch.Tensor, rotary: Rotary, q_pos: torch.Tensor,
                kv_pos: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, rotary, q_pos, kv_pos, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """Block-diffusion drafter reading the target's frozen embeddings, features and lm_head.

    The target's `embed_tokens` and `lm_head` are held in a plain tuple, not registered, so they
    are neither parameters (the optimiser never sees them) nor in `state_dict()` (checkpoints hold
    only the drafter's own weights). They stay on the target's device; `.to()` does not move them.
    """

    def __init__(self, *, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 intermediate_size: int, num_layers: int, num_feature_layers: int,
                 rms_norm_eps: float, rope_theta: float, embed_tokens: nn.Embedding,
                 lm_head: nn.Linear, init_std: float = 0.02,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if num_layers < 1 or num_feature_layers < 1:
            raise ValueError(
                f"num_layers={num_layers} and num_feature_layers={num_feature_layers} must be >= 1"
            )
        if embed_tokens.embedding_dim != hidden_size or lm_head.in_features != hidden_size:
            raise ValueError(
                f"target embed_tokens/lm_head width ({embed_tokens.embedding_dim}, "
                f"{lm_head.in_features}) must equal the drafter hidden_size={hidden_size}; build "
                f"the drafter with DFlashDrafter.from_target_config"
            )
        self.arch = dict(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         head_dim=head_dim, intermediate_size=intermediate_size,
                         num_layers=num_layers, num_feature_layers=num_feature_layers,
                         rms_norm_eps=rms_norm_eps, rope_theta=rope_theta)
        self._frozen = (embed_tokens, lm_head)
        self.fc = nn.Linear(num_feature_layers * hidden_size, hidden_size, bias=False)  # W_c
        self.hidden_norm = RMSNorm(hidden_size, rms_norm_eps)
        self.layers = nn.ModuleList(
            DraftLayer(hidden_size, num_heads, num_kv_heads, head_dim, intermediate_size,
                       rms_norm_eps)
            for _ in range(num_layers)
        )
        self.norm = RMSNorm(hidden_size, rms_norm_eps)
        self.rotary = Rotary(head_dim, rope_theta)
        # Paper: random init. A private generator keeps replicas identical while other threads
        # compile: each Dynamo compile rewinds torch's global generator (hazard global-rng-rewind).
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, init_std, generator=generator)

    @classmethod
    def from_target_config(cls, hf_config: Any, embed_tokens: nn.Embedding, lm_head: nn.Linear,
                           num_layers: int, n: int, generator: torch.Generator | None = None) -> DFlashDrafter:
        """Copy widths, heads, eps and RoPE base from a HF Qwen3/Llama config."""
        try:
            hidden = hf_config.hidden_size
            heads = hf_config.num_attention_heads
            intermediate = hf_config.intermediate_size
        except AttributeError as err:
            raise ValueError(
                f"target config {type(hf_config).__name__} lacks {err.name!r}; only Qwen3/Llama-"
                f"style configs (hidden_size, num_attention_heads, intermediate_size) are supported"
            ) from None
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        rope = getattr(hf_config, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(hf_config, "rope_theta", None) or 10000.0)
        return cls(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   intermediate_size=intermediate, num_layers=num_layers, num_feature_layers=n,
                   rms_norm_eps=getattr(hf_config, "rms_norm_eps", 1e-6), rope_theta=float(theta),
                   embed_tokens=embed_tokens, lm_head=lm_head, generator=generator)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._frozen[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._frozen[1]

    def forward(self, block_ids: torch.Tensor, features: torch.Tensor, q_pos: torch.Tensor,
                ctx_pos: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """block_ids [B,Q], features [B,C,n*H], q_pos [B,Q], ctx_pos [B,C],
        attn_mask [B,Q,C+Q] bool (True = may attend; None = all visible) -> logits [B,Q,V]."""
        hidden = self.hidden(block_ids, features, q_pos, ctx_pos, attn_mask)
        return self.lm_head(hidden.to(self.lm_head.weight.dtype))

    def hidden(self, block_ids: torch.Tensor, features: torch.Tensor, q_pos: torch.Tensor,
               ctx_pos: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        """forward() up to the LM head: the last hidden states [B,Q,H] (training takes the loss
        through the head a chunk at a time, drafter.chunked_ce)."""
        dtype = self.fc.weight.dtype
        x = self.embed_tokens(block_ids).to(dtype)
        context = self.hidden_norm(self.fc(features.to(dtype)))
        kv_pos = torch.cat([ctx_pos, q_pos], dim=1)
        mask = None
        if attn_mask is not None:
            mask = _see_self(attn_mask)[:, None]  # broadcast over heads
        for layer in self.layers:
            x = layer(x, context, self.rotary, q_pos, kv_pos, mask)
        return self.norm(x)


def _see_self(mask: torch.Tensor) -> torch.Tensor:
    """Let every query see its own key.

    Padded blocks (keep=False) see nothing under the DFlash mask, and softmax over an all-masked
    row is NaN, which would poison the loss (0 * NaN) and the gradients. Kept queries already see
    their whole block, so this changes nothing for them.
    """
    q_len, kv_len = mask.shape[-2], mask.shape[-1]
    own = torch.arange(q_len, device=mask.device)[:, None] + (kv_len - q_len)
    diagonal = own == torch.arange(kv_len, device=mask.device)[None, :]
    return mask | diagonal
