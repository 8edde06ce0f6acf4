"""How long a run is and its learning rate at each step: linear warmup, then cosine to zero."""

from __future__ import annotations

import dataclasses
import math

from ..config import TrainConfig
from ..errors import InputError


def check_step_size(config: TrainConfig, num_samples: int, world: int) -> None:
    """Refuse an accumulation that makes one optimizer step more than a pass over the data: such a run looks
    like a hang (``--grad-accum 1000000``: thousands of passes before the first step), and trains each
    sample several times in one step."""
    round_ = config.batch_size * config.drafters * world  # one micro-batch of every drafter replica
    per_step = round_ * config.grad_accum
    if config.grad_accum == 1 or per_step <= num_samples:
        return
    most = max(1, num_samples // round_)
    procs = f" x {world} processes" if world > 1 else ""
    raise InputError(f"--grad-accum {config.grad_accum} makes one optimizer step take {per_step:,} samples (--batch-size "
                     f"{config.batch_size} x --drafters {config.drafters} x --grad-accum {config.grad_accum}{procs}), "
                     f"{per_step / num_samples:,.1f} passes over the {num_samples:,} samples of the data; pass "
                     f"--grad-accum {most} or less (at most one pass a step), or more data")


@dataclasses.dataclass(frozen=True)
class Schedule:
    total_steps: int  # optimizer steps of each drafter replica
    warmup_steps: int

    @classmethod
    def for_run(cls, config: TrainConfig, num_samples: int, world: int) -> Schedule:
        """``--max-steps``, else ``--epochs`` passes over the data, each step taking ``--grad-accum``
        batches per drafter replica of every process; warmup is ``--warmup-ratio`` of it (at least 1 step)."""
        per_step = config.batch_size * config.drafters * config.grad_accum * world
        steps = config.max_steps or max(1, num_samples // per_step) * config.epochs
        return cls.of(steps, config.warmup_ratio)

    @classmethod
    def of(cls, total_steps: int, warmup_ratio: float) -> Schedule:
        return cls(total_steps=total_steps, warmup_steps=max(1, round(warmup_ratio * total_steps)))

    def lr_factor(self, step: int) -> float:
        """The factor on the peak learning rate for optimizer step ``step`` (0-based); the
        torch.optim.lr_scheduler.LambdaLR of every replica that steps the weights calls it."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
