"""DFlash trainer runs, each in a fresh process: its startup, an A/B of source trees, tau reproducibility.

    python -m benchmarks trainer-runs --mode startup [ARGS ...]   # alias: trainer-startup
    python -m benchmarks trainer-runs --mode ab [ARGS ...]        # alias: dflash-ab
    python -m benchmarks trainer-runs --mode tau [ARGS ...]       # alias: tau-reproducibility
    python -m benchmarks trainer-runs --mode MODE --help          # the mode's own flags

- ``startup`` (trainer_startup.py): the README's main job to its first steady step, each run on an
  empty Inductor cache (Trees, whole-step, then Trees again on Trees' cache, as a restart), with
  each worker's compile seconds and Dynamo's recompilations; ``dflash-trainer-startup`` results.
- ``ab`` (dflash_ab.py): ``dflash_throughput.py`` of two or more source trees on one machine in
  turns (A, B, A, B), every run listed with the sequential loop's host ms per batch beside it:
  whether a change is slower or the machine was; ``dflash-ab-<target>-<graphs>`` results.
- ``tau`` (tau_reproducibility.py): fresh builds of the embedded default compared bit for bit,
  and the default trainer's tau with its baselines on some of them; ``dflash-tau-reproducibility``.

Every run goes through trainer_process.py (a fresh process, stopped at its timeout or when this
one is stopped) and every results file through results_schema.py.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODES = {"startup": "trainer_startup", "ab": "dflash_ab", "tau": "tau_reproducibility"}
PROG = "python -m benchmarks trainer-runs"


def split_mode(argv: list) -> tuple:
    """(mode, the mode's arguments) from ``--mode NAME ...`` or ``--mode=NAME ...``; (None, argv) without one."""
    if argv[:1] == ["--mode"] and len(argv) > 1:
        return argv[1], argv[2:]
    if argv[:1] and argv[0].startswith("--mode="):
        return argv[0].split("=", 1)[1], argv[1:]
    return None, argv


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode, rest = split_mode(argv)
    if mode is None:
        if argv[:1] in (["-h"], ["--help"]):
            print(f"usage: {PROG} --mode {{{','.join(MODES)}}} [ARGS ...]\n\n{__doc__}")
            return 0
        print(f"usage: {PROG} --mode {{{','.join(MODES)}}} [ARGS ...]\nerror: give --mode first, one of "
              f"{', '.join(MODES)}", file=sys.stderr)
        return 2
    if mode not in MODES:
        print(f"usage: {PROG} --mode {{{','.join(MODES)}}} [ARGS ...]\nerror: --mode {mode}: give one of "
              f"{', '.join(MODES)}", file=sys.stderr)
        return 2
    return importlib.import_module(MODES[mode]).main(rest, prog=f"{PROG} --mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
