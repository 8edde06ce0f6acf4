"""The conformance results file: one row per case, one column per placement."""

from __future__ import annotations

import datetime
import json
import platform
from pathlib import Path

import torch

from benchmarks.results_schema import neutral

from .placements import PLACEMENTS


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).lower().replace("nvidia ", "nvidia-").replace(" ", "-")
    return "cpu"


def results_path(directory: Path) -> Path:
    return directory / f"conformance_{machine()}_torch{torch.__version__.split('+')[0]}_{datetime.date.today()}.json"


def _cell(row: dict, placement: str) -> str:
    seen = row["observed"].get(placement, {})
    if "error" in seen and seen["error"].startswith("case process failed"):
        return "process failed"
    verdict = "same" if placement == "main" or not any(d.startswith(f"{placement}:") for d in row["differences"]) else "DIFFERS"
    outcome = "raised" if "error" in seen else "ran"
    return f"{outcome}, {verdict}" if placement != "main" else outcome


def render_markdown(rows: list[dict]) -> str:
    equal = sum(row["equal"] for row in rows)
    lines = [f"# Conformance: {equal} of {len(rows)} cases observe the same in every placement",
             "",
             f"torch {torch.__version__}, {machine()}, Python {platform.python_version()}, {datetime.date.today()}. "
             "Each case ran in each placement in a fresh process; `same` means the result, the error, "
             "the warnings and the CUDA-graph skip messages equal those of the main thread without threadgraph. "
             "Regenerate: `python -m tests.conformance --write benchmarks/results`.",
             "",
             "| case | " + " | ".join(PLACEMENTS) + " |",
             "|---|" + "---|" * len(PLACEMENTS)]
    for row in rows:
        lines.append(f"| `{row['case']}` | " + " | ".join(_cell(row, p) for p in PLACEMENTS) + " |")
    differing = [row for row in rows if not row["equal"]]
    if differing:
        lines += ["", "## Differences", ""]
        for row in differing:
            lines += [f"- `{row['case']}`: " + "; ".join(row["differences"])]
    return "\n".join(lines) + "\n"


def write_results(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"theme": "conformance", "torch": torch.__version__, "cuda": torch.version.cuda, "machine": machine(),
              "date": str(datetime.date.today()), "placements": list(PLACEMENTS),
              "equal": sum(row["equal"] for row in rows), "cases": len(rows),
              "rows": [{k: v for k, v in row.items() if k != "stderr_tail"} for row in rows]}
    path.write_text(json.dumps(neutral(record), indent=1, sort_keys=True) + "\n", encoding="utf-8")
    path.parent.joinpath(path.name[: -len(".json")] + ".md").write_text(neutral(render_markdown(rows)), encoding="utf-8")
