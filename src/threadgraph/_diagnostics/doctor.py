"""``python -m threadgraph doctor``: what this torch has, which hazards apply, which patches run."""

from __future__ import annotations

import dataclasses
import platform
import threading

import torch

import threadgraph
from threadgraph import _compat

from threadgraph._diagnostics import hazards as _hazards
from threadgraph._errors import UnsupportedTorchError
from threadgraph._patches import PATCHES as _PATCHES, patches
from threadgraph._patches import verify as _verify

_STATUS = {"present": "[x]", "absent": "[ ]", "assumed": "[?]"}


def report() -> dict:
    cuda = torch.cuda.is_available()
    foreign = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    try:
        hazards, hazards_error = _hazards.report(), None
    except UnsupportedTorchError as exc:  # the detection needs a symbol this torch lacks: say so, go on
        hazards, hazards_error = [], str(exc)
    rows = patches()
    strict = _verify.strict()
    version, verified, found = _verify.differences(_PATCHES)
    verification = {"reference": version, "verified": verified,
                    "differences": [dataclasses.asdict(d) for d in found],
                    "status": _verify.statuses(rows, found, version)}
    return {
        "threadgraph": threadgraph.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_build": torch.version.cuda,
        "cuda_available": cuda,
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else [],
        "newest_verified_torch": ".".join(map(str, _compat.NEWEST_VERIFIED)),
        "newer_than_verified": _compat.newer_than_verified(),
        "hazards": hazards,
        "hazards_error": hazards_error,
        "patches": rows,
        "verification": verification,
        "strict": strict,
        "missing_symbols": sorted(_compat.missing_required()),
        "other_threads": foreign,
    }


def format_report(info: dict) -> str:
    lines = [f"threadgraph {info['threadgraph']}, python {info['python']}, torch {info['torch']} (CUDA build: {info['cuda_build']})"]
    if info["newer_than_verified"]:
        lines.append(
            f"warning: torch {info['torch']} is newer than the newest release threadgraph was verified on "
            f"({info['newest_verified_torch']}); its patches may miss changed code: run the test suite"
        )
    patch_lacks = sorted({s for p in info["patches"] for s in p["missing"]})
    if info["missing_symbols"] or patch_lacks:
        lines.append(
            f"error: torch {info['torch']} lacks {', '.join(info['missing_symbols'] + patch_lacks)}; install() refuses "
            "to patch anything on it" + (" (the patches marked 'n/a' below need them)" if patch_lacks else "")
        )
    lines += [
        f"GPUs: {', '.join(info['gpus']) if info['gpus'] else 'none visible'}",
        "",
        "hazards ([x] present, [ ] absent: feature-detected; [?] assumed present, not detectable; docs/hazards.md):",
    ]
    width = max((len(h["name"]) for h in info["hazards"]), default=0)
    for h in info["hazards"]:
        addressed = f"patches: {', '.join(h['patches'])}" if h["patches"] else "no patch"
        lines.append(f"  {_STATUS[h['status']]} {h['name']:<{width}}  {addressed}")
    if info["hazards_error"]:
        lines.append(f"  cannot detect them: {info['hazards_error']}")
    check = info["verification"]
    if check["reference"] is None:
        lines += ["", "error: no verified release is recorded (threadgraph's fingerprints.json is missing)"]
    else:
        against = ("this release's own record (a verified release)" if check["verified"] else
                   f"torch {check['reference']}, the newest verified release before this one (this one is not verified)")
        lines += ["", f"patches, checked against {against}; {len(check['differences'])} difference(s)"
                      + (f" ({_verify.STRICT_ENV}=1: install() refuses)" if info["strict"] and check["differences"] else "")
                      + ":"]
    width = max((len(p["name"]) for p in info["patches"]), default=0)
    for p in info["patches"]:
        lines.append(f"  {p['name']:<{width}} {check['status'].get(p['name'], '?')}")
    if info["other_threads"]:
        lines += [
            "",
            "note: threads threadgraph does not manage are running: " + ", ".join(info["other_threads"]),
            "  after install(), their RNG draws and device syncs through torch's API wait for captures; other",
            "  CUDA work reached from C++ belongs in `with threadgraph.outside_captures():`.",
        ]
    return "\n".join(lines)

