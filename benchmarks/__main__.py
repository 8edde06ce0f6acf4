"""One entry point for the benchmarks and the renderers of their results.

    python -m benchmarks --help               # every command, one line each
    python -m benchmarks NAME [ARGS ...]      # e.g. python -m benchmarks dflash-throughput --help

Each command is a script of this folder run as its own ``__main__``, given the command's first
arguments (``readme`` and ``index`` are ``render.py readme|index``; an alias such as
``trainer-startup`` is ``trainer-runs --mode startup``). The scripts stay runnable as
``python benchmarks/<script>.py``, which is what the subprocess-based ones launch. The listing
reads each script's docstring without importing it, so ``--help`` never imports torch.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# command name -> (script, the arguments it is given first), grouped as --help lists them. The other
# modules are the scripts' parts; of those, only dflash_processes.py runs as a script, a child that
# dflash_throughput.py launches.
MEASURE = {
    "step-time": ("replay_step_time.py", ()),
    "dflash-throughput": ("dflash_throughput.py", ()),
    "trainer-runs": ("trainer_runs.py", ()),
    "install-overhead": ("install_overhead.py", ()),
    "fence-overhead": ("fence_overhead.py", ()),
    "gil-profile": ("gil_profile.py", ()),
    "dflash-loss-memory": ("dflash_loss_memory.py", ()),
}
RENDER = {
    "readme": ("render.py", ("readme",)),
    "index": ("render.py", ("index",)),
    "dflash-report": ("dflash_report.py", ()),
    "gpu-scenarios": ("gpu_scenarios_results.py", ()),
    "doctor-selftest": ("doctor_selftest.py", ()),
    "fence-matrix": ("fence_matrix.py", ()),
}
# Names that run a mode of another command, as short as what they stand for.
ALIASES = {
    "trainer-startup": ("trainer_runs.py", ("--mode", "startup")),
    "dflash-ab": ("trainer_runs.py", ("--mode", "ab")),
    "tau-reproducibility": ("trainer_runs.py", ("--mode", "tau")),
}
COMMANDS = {**MEASURE, **RENDER, **ALIASES}
CHILD_SCRIPTS = {"dflash_processes.py"}
# One script serving two commands says what each does here; the others' first docstring sentence does.
SUMMARIES = {
    "readme": "Rewrite the generated results of README.md, docs/results.md and examples/dflash_trainer/README.md.",
    "index": "Write benchmarks/results/README.md: one row per headline of every results JSON, latest first.",
}


def summary(name: str) -> str:
    """What a command does: SUMMARIES, else the first sentence of its script's docstring, read
    without importing the script."""
    if name in SUMMARIES:
        return SUMMARIES[name]
    doc = ast.get_docstring(ast.parse((HERE / COMMANDS[name][0]).read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].replace("``", "").split())
    return first if len(first) <= 100 else first[:first.rfind(" ", 0, 99)] + " ..."


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m benchmarks NAME [ARGS ...]   (python -m benchmarks NAME --help for a command's flags)",
             "", "measure (writes benchmarks/results/<theme>_<machine>_torch<version>_<date>.json and .md):"]
    lines += [f"  {name:<{width}}  {summary(name)}" for name in MEASURE]
    lines += ["", "render (rewrites files from the committed results, or from a GPU test run's records):"]
    lines += [f"  {name:<{width}}  {summary(name)}" for name in RENDER]
    lines += ["", "aliases:"]
    plain = {script: name for name, (script, args) in {**MEASURE, **RENDER}.items() if not args}
    lines += [f"  {name:<{width}}  python -m benchmarks {plain[script]} {' '.join(args)}"
              for name, (script, args) in ALIASES.items()]
    lines += ["", "the conformance suite (GPU): python -m tests.conformance --help"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: no benchmark named {name!r}; python -m benchmarks --help lists them: "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    script, first = COMMANDS[name]
    script = HERE / script
    saved = sys.argv
    sys.argv = [str(script), *first, *rest]
    # a script imports its sibling modules by name, as when it runs as python benchmarks/<script>.py
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as stop:  # the script's own sys.exit(main()): its status is ours
        code = stop.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


if __name__ == "__main__":
    sys.exit(main())
