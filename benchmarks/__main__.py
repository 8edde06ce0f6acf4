"""One entry point for the benchmarks and the renderer of their results.

    python -m benchmarks --help               # every command, one line each
    python -m benchmarks NAME [ARGS ...]      # e.g. python -m benchmarks dflash-throughput --help

Each command runs a module of this package as ``__main__`` (``python -m benchmarks.<module>``), given
the command's first arguments. A new benchmark registers itself with one line in ``COMMANDS``: its
command name, its group, its module and any first arguments. The listing reads each module's
docstring without importing it, so ``--help`` never imports torch.
"""

from __future__ import annotations

import ast
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

# command -> (group, module, the arguments it is given first), in the order --help lists them
COMMANDS = {
    "step-time": ("measure", "replay_step_time", ()),
    "dflash-throughput": ("measure", "dflash_throughput", ()),
    "trainer-startup": ("measure", "trainer_startup", ()),
    "tau-reproducibility": ("measure", "tau_reproducibility", ()),
    "install-overhead": ("measure", "install_overhead", ()),
    "call-overhead": ("measure", "call_overhead", ()),
    "dflash-loss-memory": ("measure", "dflash_loss_memory", ()),
    "regenerate-throughput": ("measure", "regenerate_throughput", ()),
    "fence-overhead": ("measure", "fence_overhead", ()),
    "gil-profile": ("measure", "gil_profile", ()),
    "gpu-scenarios": ("collect", "gpu_scenarios_results", ("gpu-scenarios",)),
    "fence-matrix": ("collect", "gpu_scenarios_results", ("fence-matrix",)),
    "readme": ("render", "render", ("readme",)),
    "index": ("render", "render", ("index",)),
}
GROUPS = {
    "measure": "measure (writes <theme>_<gpu-or-cpu>_torch<version>_<date>.json to ./bench-out,\n"
               "or to --out-dir DIR; --out-dir benchmarks/results for a run to commit)",
    "collect": "collect (a results file from the records of a GPU test run, THREADGRAPH_GPU_LOG=DIR)",
    "render": "render (the pages' generated figures from benchmarks/results; --check exits 1 when stale)",
}
# A module serving two commands says what each does here; the others' first docstring sentence does.
SUMMARIES = {
    "gpu-scenarios": "The gpu-scenarios results file, from the records of a GPU test run.",
    "fence-matrix": "The fence-matrix results file, from the records of a GPU test run of the eager fence.",
    "readme": "Rewrite the generated figures of README.md, docs/ and the trainer's README.",
    "index": "Rewrite benchmarks/results/README.md: one row per headline of every results file.",
}


def summary(name: str) -> str:
    """What a command does: SUMMARIES, else the first sentence of its module's docstring."""
    if name in SUMMARIES:
        return SUMMARIES[name]
    doc = ast.get_docstring(ast.parse((HERE / f"{COMMANDS[name][1]}.py").read_text())) or ""
    first = " ".join(doc.split("\n\n")[0].replace("``", "").split())
    return first if len(first) <= 100 else first[:first.rfind(" ", 0, 99)] + " ..."


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: python -m benchmarks NAME [ARGS ...]   (python -m benchmarks NAME --help: a command's flags)"]
    for group, title in GROUPS.items():
        lines += ["", f"{title}:"]
        lines += [f"  {name:<{width}}  {summary(name)}" for name, (g, _, _) in COMMANDS.items() if g == group]
    lines += ["", "the conformance suite (GPU): python -m tests.conformance --help"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: no command named {name!r}; python -m benchmarks --help lists them: "
              f"{', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    _, module, first = COMMANDS[name]
    saved = sys.argv
    sys.argv = [f"python -m benchmarks {name}", *first, *rest]
    try:
        runpy.run_module(f"benchmarks.{module}", run_name="__main__")
    except SystemExit as stop:  # the module's own sys.exit(main()): its status is ours
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
