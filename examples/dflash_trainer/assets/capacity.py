"""How much memory and disk there is, and byte counts written for people: shared by the run's
size checks (``sizes``), the shape builds (``shapes``) and the checkpoint's disk-room refusal."""

from __future__ import annotations

import os
from typing import Optional

import torch

GiB = 1 << 30


def human_bytes(n: float) -> str:
    """A byte count for people: GiB, MiB, KiB or bytes, whichever shows it without rounding to 0."""
    for unit, size in (("GiB", GiB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} bytes"


def free_bytes(device: str) -> Optional[int]:
    """Free memory of a device (host: MemAvailable), or None when unknown."""
    if device.startswith("cuda"):
        try:
            return torch.cuda.mem_get_info(torch.device(device))[0]
        except Exception:
            return None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
