"""One entry point for the benchmarks and the renderers of their results.

    python -m benchmarks --help               # every command, one line each
    python -m benchmarks NAME [ARGS ...]      # e.g. python -m benchmarks dflash-throughput --help

Each command is a script of this folder run as its own ``__main__`` (the scripts stay runnable
as ``python benchmarks/<script>.py``, which is what the subprocess-based ones launch). The
listing reads each script's docstring without importing it, so ``--help`` never imports torch.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# command name -> script, grouped as --help lists them. The other modules are the scripts' parts;
# of those, only dflash_processes.py runs as a script, a child that dflash_throughput.py launches.
MEASURE = {
    "step-time": "replay_step_time.py",
    "dflash-throughput": "dflash_throughput.py",
    "dflash-ab": "dflash_ab.py",
    "trainer-startup": "trainer_startup.py",
    "tau-reproducibility": "tau_reproducibility.py",
    "install-overhead": "install_overhead.py",
    "fence-overhead": "fence_overhead.py",
    "fence-matrix": "fence_matrix.py",
    "gil-profile": "gil_profile.py",
}
RENDER = {
    "readme": "readme_tables.py",
    "index": "results_index.py",
    "dflash-report": "dflash_report.py",
    "gpu-scenarios": "gpu_scenarios_results.py",
}
COMMANDS = {**MEASURE, **RENDER}
CHILD_SCRIPTS = {"dflash_processes.py"}


def summary(script: str) -> str:
    """The first sentence of the script's docstring, read without importing the script."""
    doc = ast.get_docstring(ast.parse((HERE / script).read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].replace("``", "").split())
    return first if len(first) <= 100 else first[:first.rfind(" ", 0, 99)] + " ..."


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m benchmarks NAME [ARGS ...]   (python -m benchmarks NAME --help for a command's flags)",
             "", "measure (writes benchmarks/results/<theme>_<machine>_torch<version>_<date>.json and .md):"]
    lines += [f"  {name:<{width}}  {summary(script)}" for name, script in MEASURE.items()]
    lines += ["", "render (rewrites files from the committed results):"]
    lines += [f"  {name:<{width}}  {summary(script)}" for name, script in RENDER.items()]
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
    script = HERE / COMMANDS[name]
    saved = sys.argv
    sys.argv = [str(script), *rest]
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
