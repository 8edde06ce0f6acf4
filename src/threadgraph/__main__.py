"""Command line: ``python -m threadgraph doctor [--selftest] [--json]``, ``--version`` and
``python -m threadgraph fingerprints [--torch-root DIR] [--write]`` (a verified release's record)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from threadgraph import __version__
from threadgraph._diagnostics.doctor import format_report, report
from threadgraph._errors import SettingError
from threadgraph._patches import check_settings


def main(argv: list[str] | None = None) -> int:
    try:
        return _command(argv)
    except BrokenPipeError:
        # Whoever read the output stopped reading (``threadgraph doctor | head``): end quietly, as
        # ``cat`` does, with nothing more written to the closed pipe at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _command(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(prog="threadgraph", description="threadgraph: CUDA graphs in worker threads")
    parser.add_argument("--version", action="version", version=f"threadgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="torch/CUDA versions, hazards present, patches; --selftest runs GPU checks")
    doctor.add_argument("--selftest", action="store_true", help="train and infer with reduce-overhead in worker threads on the GPU")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    prints = sub.add_parser("fingerprints", help="record a torch release's fingerprints (the verified releases' data)")
    prints.add_argument("--torch-root", metavar="DIR", help="read a torch source tree (DIR/torch/*.py, an unpacked "
                        "wheel) instead of the installed torch: fingerprints only, no feature detections")
    prints.add_argument("--write", action="store_true", help="add the record to threadgraph's fingerprints.json")
    args = parser.parse_args(argv)
    try:
        check_settings()
    except SettingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    if args.command == "fingerprints":
        return record_fingerprints(args.torch_root, args.write)

    try:
        info = report()
    except SettingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if args.selftest and not info["cuda_available"]:
        message = "threadgraph doctor --selftest needs a CUDA GPU; this machine has none (torch sees no GPU). Run it on a GPU machine."
        print(json.dumps(info | {"selftest": message}) if args.json else format_report(info) + "\n\n" + message)
        return 2
    if args.selftest:
        from threadgraph._diagnostics.selftest import run_all

        info["selftest"] = run_all()
    if args.json:
        print(json.dumps(info, default=str))
    else:
        print(format_report(info))
        for result in info.get("selftest", []):
            print(selftest_line(result))
    if info["strict"] and info["verification"]["differences"]:
        return 1
    return 0 if all(r.get("passed") for r in info.get("selftest", [])) else 1


def record_fingerprints(torch_root: str | None, write: bool) -> int:
    """``threadgraph fingerprints``: the installed torch's record (or a source tree's), printed or added."""
    from threadgraph._patches import PATCHES, fingerprint, verify

    if torch_root is not None:
        tree = fingerprint.SourceTree(Path(torch_root))
        try:
            version = tree.version()
        except (OSError, ValueError) as exc:
            print(f"threadgraph fingerprints: {torch_root} holds no torch source tree ({exc}); pass the folder "
                  "that holds torch/ (an unpacked wheel: unzip -q torch-*.whl 'torch/*.py' -d DIR)", file=sys.stderr)
            return 2
        record = verify.record_source(PATCHES, tree)
    else:
        import torch

        version = torch.__version__.split("+")[0]
        print(f"recording torch {version}: fingerprints and checks ...", file=sys.stderr, flush=True)
        record = verify.record_live(PATCHES)
    symbols = record["symbols"]
    print(f"torch {version}: {len(symbols)} symbols ({sum(v is not None for v in symbols.values())} with Python "
          f"source), {len(record.get('checks', {}))} check outcomes; {record['recorded_from']}")
    if write:
        data = fingerprint.load()
        data["releases"][version] = record
        print(f"wrote {fingerprint.write(data)}")
    else:
        print(json.dumps(record, indent=1))
    return 0


def selftest_line(result: dict) -> str:
    """One selftest check as the text report prints it."""
    verdict = "PASS" if result.get("passed") else "FAIL"
    detail = (f"p50 {result['p50_ms']:.3f} ms, p90 {result['p90_ms']:.3f} ms, {result['captures']} captures"
              if result.get("p50_ms") is not None else str(result.get("error", "")))
    return f"selftest {verdict}: {result['check']}: {detail}"


if __name__ == "__main__":
    sys.exit(main())
