"""Command line: ``python -m threadgraph doctor [--selftest] [--json]`` and ``--version``."""

from __future__ import annotations

import argparse
import json
import sys

from threadgraph._diagnostics.doctor import format_report, report
from threadgraph import __version__
from threadgraph._errors import SettingError
from threadgraph._device.gate import check_settings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="threadgraph", description="threadgraph: CUDA graphs in worker threads")
    parser.add_argument("--version", action="version", version=f"threadgraph {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="torch/CUDA versions, hazards present, patches; --selftest runs GPU checks")
    doctor.add_argument("--selftest", action="store_true", help="train and infer with reduce-overhead in worker threads on the GPU")
    doctor.add_argument("--json", action="store_true", help="print JSON instead of text")
    args = parser.parse_args(argv)
    try:
        check_settings()
    except SettingError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    info = report()
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
    return 0 if all(r.get("passed") for r in info.get("selftest", [])) else 1


def selftest_line(result: dict) -> str:
    """One selftest check as the text report prints it."""
    verdict = "PASS" if result.get("passed") else "FAIL"
    detail = (f"p50 {result['p50_ms']:.3f} ms, p90 {result['p90_ms']:.3f} ms, {result['captures']} captures"
              if result.get("p50_ms") is not None else str(result.get("error", "")))
    return f"selftest {verdict}: {result['check']}: {detail}"


if __name__ == "__main__":
    sys.exit(main())
