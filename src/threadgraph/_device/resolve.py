"""What a worker or a step timer takes as its device: a name, an index or a ``torch.device``,
checked once into a ``torch.device`` that exists on this machine."""

from __future__ import annotations

from typing import Union

import torch

from threadgraph._errors import ThreadgraphError, UsageError

DeviceLike = Union[str, int, torch.device, None]


def resolve_device(device: DeviceLike) -> torch.device:
    """A validated torch.device; CUDA devices must exist. ``None`` means cuda:0, or cpu without CUDA.

    Raises:
        UsageError: A device that is not ``cpu`` or ``cuda[:N]``, or a GPU index this machine lacks.
        ThreadgraphError: A CUDA device asked for where torch sees no GPU.
    """
    if device is None:
        return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    try:
        resolved = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    except (RuntimeError, TypeError) as exc:
        raise UsageError(f"threadgraph: bad device {device!r}: {exc}; use 'cpu', 'cuda' or 'cuda:N'") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ThreadgraphError(
                f"threadgraph: device {device!r} asks for CUDA, but this torch sees no GPU "
                f"(torch {torch.__version__}, CUDA build: {torch.version.cuda}); use device='cpu' or run on a GPU machine"
            )
        index = 0 if resolved.index is None else resolved.index
        if index >= torch.cuda.device_count():
            raise UsageError(
                f"threadgraph: device {device!r} does not exist; this machine has "
                f"{torch.cuda.device_count()} GPU(s) (cuda:0 .. cuda:{torch.cuda.device_count() - 1})"
            )
        resolved = torch.device("cuda", index)
    elif resolved.type != "cpu":
        raise UsageError(f"threadgraph: device type {resolved.type!r} is not supported; use 'cpu' or 'cuda:N'")
    return resolved
