"""DFlash trainer runs, each in a fresh process: its startup, and tau reproducibility.

    python -m benchmarks trainer-startup [ARGS ...]        # python -m benchmarks.trainer_runs --mode startup
    python -m benchmarks tau-reproducibility [ARGS ...]    # python -m benchmarks.trainer_runs --mode tau

- ``startup`` (trainer_startup.py): the README's main job to its first steady step, each run on an
  empty Inductor cache (Trees, whole-step, then Trees again on Trees' cache, as a restart), with
  each worker's compile seconds and Dynamo's recompilations; ``dflash-trainer-startup`` results.
- ``tau`` (tau_reproducibility.py): fresh builds of the embedded default compared bit for bit,
  and the default trainer's tau with its baselines on some of them; ``dflash-tau-reproducibility``.

Every run goes through trainer_process.py (a fresh process, stopped at its timeout or when this
one is stopped) and every results file through results_schema.py.
"""

from __future__ import annotations

import importlib
import sys


MODES = {"startup": "trainer_startup", "tau": "tau_reproducibility"}
PROG = "python -m benchmarks.trainer_runs"


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
    return importlib.import_module(f".{MODES[mode]}", __package__).main(rest, prog=f"{PROG} --mode {mode}")


if __name__ == "__main__":
    sys.exit(main())
