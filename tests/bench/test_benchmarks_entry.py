"""python -m benchmarks: one entry point that lists and runs every benchmark and renderer."""

import ast
import re
import subprocess
import sys
from pathlib import Path

from benchmarks.__main__ import COMMANDS, GROUPS

ROOT = Path(__file__).resolve().parents[2]
# modules run as a script that are no command: the children their benchmark starts
CHILDREN = {"dflash_processes"}


def entry(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def runs_as_script(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def test_every_script_of_the_package_is_a_command_or_a_named_child():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__main__.py" and runs_as_script(p)}
    named = {module for _, module, _ in COMMANDS.values()} | CHILDREN
    assert scripts == named, scripts ^ named
    assert {group for group, _, _ in COMMANDS.values()} == set(GROUPS)


def test_no_file_of_the_benchmarks_or_their_tests_edits_sys_path():
    files = [*(ROOT / "benchmarks").glob("*.py"), *(ROOT / "tests" / "bench").glob("*.py")]
    edits = [f.name for f in files if re.search(r"sys\.path\.(insert|append)|sys\.path\s*\+?=", f.read_text())]
    assert edits == []


def test_help_lists_every_command_with_its_summary_and_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.argv = ['x', '--help']\n"
                           "try: runpy.run_module('benchmarks', run_name='__main__')\n"
                           "except SystemExit: pass\n"
                           "print('torch imported' if 'torch' in sys.modules else 'torch not imported')"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(COMMANDS), listed
    assert re.search(r"^  step-time +Per-thread step time", done.stdout, re.M)
    assert "./bench-out" in done.stdout and "--out-dir benchmarks/results" in done.stdout
    assert done.stdout.rstrip().endswith("torch not imported")


def test_an_unknown_name_is_one_line_with_exit_2():
    done = entry("replay")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: no command named 'replay'; python -m benchmarks --help lists them: " + ", ".join(COMMANDS)]


def test_a_command_runs_its_module_with_the_arguments_and_returns_its_status():
    for name in ("index", "readme"):
        ok = entry(name, "--check")
        assert ok.returncode == 0, ok.stderr
        bad = entry(name, "--no-such-flag")
        assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr, bad.stderr


def test_a_command_is_its_module_run_as_a_script():
    _, module, first = COMMANDS["tau-reproducibility"]
    through_name = entry("tau-reproducibility", "--caches", "one")
    through_module = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *first, "--caches", "one"], cwd=ROOT,
                                    capture_output=True, text=True, timeout=120)
    assert through_name.returncode == through_module.returncode == 2, through_name.stderr
    assert "--caches needs at least two different directories" in through_name.stderr
    assert through_name.stderr.splitlines()[-1].startswith("python -m benchmarks tau-reproducibility: error: ")
    assert through_name.stderr.split(": error: ")[-1] == through_module.stderr.split(": error: ")[-1]


def commands_table() -> set:
    """The command names benchmarks/README.md's table of commands lists (a cell may name two, or a
    command with its argument: `gpu-scenarios DIR`)."""
    text = (ROOT / "benchmarks" / "README.md").read_text()
    table = text.split("## The commands", 1)[1].split("\n\n", 2)[1]
    names = set()
    for line in table.splitlines()[2:]:
        first = line.split("|")[1]
        names |= {code.split()[0] for code in re.findall(r"`([^`]+)`", first)}
    return names


def test_the_readmes_table_names_every_command_help_lists():
    done = entry("--help")
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(COMMANDS)
    assert commands_table() == listed, {"missing from the table": listed - commands_table(),
                                        "not a command": commands_table() - listed}
