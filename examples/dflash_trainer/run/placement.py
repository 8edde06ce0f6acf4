"""Which device each worker gets.

With at least targets + drafters devices every worker has its own. With fewer, drafters take
devices 0, 1, ... and targets continue round-robin after them, so a drafter shares its GPU
with as few workers as possible (drafters do forward + backward + optimizer; targets only
forward). Example, 5 targets + 3 drafters on 2 GPUs: drafters on 0,1,0; targets on 1,0,1,0,1.
"""

from __future__ import annotations

import dataclasses

import torch

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class Placement:
    targets: tuple[str, ...]
    drafters: tuple[str, ...]

    @property
    def owners(self) -> list[int]:
        """The drafters that step their device's shared weights (drafter.replica.SharedDrafterWeights):
        the first drafter on each device (device names are canonical: available_devices)."""
        return [i for i, d in enumerate(self.drafters) if self.drafters.index(d) == i]

    def describe(self) -> str:
        return f"targets on {', '.join(self.targets)}; drafters on {', '.join(self.drafters)}"


def available_devices(requested: list[str]) -> list[str]:
    """The devices to use: the requested list, or all visible GPUs, or the CPU. One name a device
    ('cpu', 'cuda:N'), so that workers on one device compare equal by name ('cpu:0' is 'cpu',
    'cuda' the current GPU)."""
    if not requested:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [f"cuda:{i}" for i in range(count)] or ["cpu"]
    for device in requested:
        try:
            kind = torch.device(device).type
        except RuntimeError:
            raise InputError(f"--devices entry {device!r} is not a device; write e.g. 'cpu' or 'cuda:0,cuda:1'") from None
        if kind == "cuda" and not torch.cuda.is_available():
            raise InputError(f"--devices asks for {device}, but torch sees no GPU; use --devices cpu")
        if kind == "cuda" and (torch.device(device).index or 0) >= torch.cuda.device_count():
            raise InputError(f"--devices asks for {device}; this machine has {torch.cuda.device_count()} GPU(s)")
        if kind not in ("cuda", "cpu"):
            raise InputError(f"--devices entry {device!r} is neither cpu nor cuda:N")
    return [canonical_device(device) for device in requested]


def canonical_device(device: str) -> str:
    """The one name of ``device``: 'cpu', or 'cuda:N' (a bare 'cuda' is the current GPU)."""
    parsed = torch.device(device)
    if parsed.type == "cpu":
        return "cpu"
    return f"cuda:{torch.cuda.current_device() if parsed.index is None else parsed.index}"


def place(targets: int, drafters: int, devices: list[str]) -> Placement:
    order = [devices[i % len(devices)] for i in range(targets + drafters)]
    return Placement(targets=tuple(order[drafters:]), drafters=tuple(order[:drafters]))
