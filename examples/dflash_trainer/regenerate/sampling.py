"""The next token of each row: greedy, or sampled so that a record's tokens depend only on
``--seed``, its prompt index and its logits, never on the thread or batch that generated it.

Sampling is the Gumbel-max trick with counter-based noise: the noise of row r at step s over token
v is a hash of (seed, prompt index of r, s, v), so the same record draws the same noise in any
batch, and the whole selection is tensor arithmetic with no host sync (it runs inside a captured
decode step too). ``argmax(logits / T + Gumbel)`` samples softmax(logits / T) exactly; top-p keeps
the smallest set of tokens whose probability reaches ``top_p`` before the noise is added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed(value: int) -> int:
    """A 64-bit constant as the int64 torch holds it."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finaliser on int64 (multiplication wraps as in uint64)."""
    x = (x ^ _shift_right(x, 30)) * _signed(_MIX1)
    x = (x ^ _shift_right(x, 27)) * _signed(_MIX2)
    return x ^ _shift_right(x, 31)


def uniform_noise(seed: int, rows: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """(B, vocab) uniforms in (0, 1), each a function of (seed, rows[b], steps[b], token) alone."""
    token = torch.arange(vocab, device=rows.device, dtype=torch.int64)
    key = _mix(rows.to(torch.int64) * _signed(_GOLDEN) + _signed(seed * 0x2545F4914F6CDD1D))
    key = _mix(key ^ (steps.to(torch.int64) * _signed(_MIX1)))
    x = _mix(key[:, None] + token[None, :] * _signed(_GOLDEN))
    return (_shift_right(x, 40).to(torch.float32) + 0.5) / float(1 << 24)


@dataclass(frozen=True)
class Sampler:
    """How the next token is chosen: greedy when ``temperature`` is 0."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def __call__(self, logits: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """The next token of each row of ``logits`` (B, V); ``rows`` are the rows' prompt indices and
        ``steps`` the tokens each row generated so far."""
        if self.greedy:
            return logits.argmax(dim=-1)
        scores = logits.float() / self.temperature
        if self.top_p < 1:
            ordered, order = scores.sort(dim=-1, descending=True, stable=True)
            before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)  # mass above each token
            dropped = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before >= self.top_p)
            scores = scores.masked_fill(dropped, float("-inf"))
        gumbel = -torch.log(-torch.log(uniform_noise(self.seed, rows, steps, scores.shape[-1])))
        return (scores + gumbel).argmax(dim=-1)


class RowsLogitsProcessor:
    """A ``Sampler`` as a transformers logits processor for ``generate(do_sample=False)``: the chosen
    token gets every other token's score pushed to -inf, so generate's greedy pick takes it. ``rows``
    are the batch rows' prompt indices; a row's step is the tokens it generated past ``prompt_len``."""

    def __init__(self, sampler: Sampler, rows: torch.Tensor, prompt_len: int) -> None:
        self.sampler, self.rows, self.prompt_len = sampler, rows, prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        steps = torch.full_like(self.rows, input_ids.shape[1] - self.prompt_len)
        chosen = self.sampler(scores, self.rows, steps)
        return torch.full_like(scores, float("-inf")).scatter(-1, chosen[:, None], 0.0)
