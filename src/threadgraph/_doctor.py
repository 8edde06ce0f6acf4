"""``python -m threadgraph doctor``: what this torch has, which hazards apply, which patches run."""

from __future__ import annotations

import platform
import threading

import torch

from . import _compat
from ._patches import patches


def report() -> dict:
    cuda = torch.cuda.is_available()
    foreign = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "hazards": _compat.hazards(),
        "patches": patches(),
        "other_threads": foreign,
    }


def format_report(info: dict) -> str:
    lines = [
        f"python {info['python']}, torch {info['torch']} (CUDA build: {info['cuda_build']})",
        f"GPUs: {', '.join(info['gpus']) if info['gpus'] else 'none visible'}",
        "",
        "hazards (by feature detection):",
    ]
    lines += [f"  [{'x' if present else ' '}] {name}" for name, present in info["hazards"].items()]
    lines += ["", "patches (install() applies those marked 'applies'):"]
    width = max((len(p["name"]) for p in info["patches"]), default=0)
    for p in info["patches"]:
        state = "active" if p["active"] else ("applies" if p["applies"] else "not needed")
        lines.append(f"  {p['name']:<{width}} {state:<10} {p['target']}")
    if info["other_threads"]:
        lines += [
            "",
            "warning: threads threadgraph does not manage are running: " + ", ".join(info["other_threads"]),
            "  CUDA work they do is not ordered against captures; keep it out of capture windows.",
        ]
    return "\n".join(lines)
