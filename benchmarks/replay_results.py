"""The results file of ``replay_step_time.py``: its rows in order, their ratios to the main thread,
and merging with an earlier run's (``--append``, ``--merge-from``)."""

from __future__ import annotations

import json
import time
from pathlib import Path

from . import common
from .replay_work import MODES

PLACEMENTS = ("main", "worker", "per-gpu", "shared", "procs-per-gpu", "procs-shared")


def merge_previous(path: Path, rows: list[dict]) -> list[dict]:
    """--append / --merge-from: keep the rows of an earlier run that this run did not measure again
    (each row says the date it was measured)."""
    if not path.exists():
        return rows
    try:
        previous = json.loads(path.read_text())
        prev_rows = [dict(r, date=r.get("date", previous["env"]["date"])) for r in previous["rows"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"cannot merge with {path}: not a replay_step_time results JSON ({type(exc).__name__}: {exc})")
    fresh = {(r["task"], r["placement"], r["mode"]) for r in rows}
    fresh_modes = {(r["task"], r["mode"]) for r in rows if r["placement"] == "-"}
    return [r for r in prev_rows
            if (r["task"], r["placement"], r["mode"]) not in fresh and (r["task"], r["mode"]) not in fresh_modes] + rows


def in_order(rows: list[dict]) -> list[dict]:
    """Rows by mode, then placement, as MODES and PLACEMENTS list them."""
    order = {p: i for i, p in enumerate((*PLACEMENTS, "-"))}
    return sorted(rows, key=lambda r: (MODES.index(r["mode"]), order.get(r["placement"], 99)))


def add_ratios(rows: list[dict]) -> None:
    main = {(r["task"], r["mode"]): r.get("p50_ms") for r in rows if r["placement"] == "main"}
    for r in rows:
        ref = main.get((r["task"], r["mode"]))
        r["ratio_vs_main"] = r["p50_ms"] / ref if ref and r.get("p50_ms") else None


def write_results(args, env: dict, rows: list[dict], started: float, interrupted: bool) -> None:
    out = common.results_dir(args.out_dir)
    stem = common.results_stem(env, "replay-" + args.model + ("-gil" if args.gil_profile else ""))
    rows = [dict(r, date=env["date"]) for r in rows]
    if args.merge_from or args.append:
        rows = merge_previous(Path(args.merge_from) if args.merge_from else out / f"{stem}.json", rows)
    rows = in_order(rows)
    add_ratios(rows)
    common.save(out / f"{stem}.json", {"benchmark": "replay_step_time", "env": env, "args": vars(args),
                                       "seconds": round(time.perf_counter() - started, 1),
                                       "interrupted": interrupted, "rows": rows})
