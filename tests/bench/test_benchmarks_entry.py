"""python -m benchmarks: one entry point that lists and runs every benchmark and renderer."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.__main__ import ALIASES, CHILD_SCRIPTS, COMMANDS  # noqa: E402


def entry(*args):
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def runs_as_script(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) for node in tree.body)


def test_every_script_of_the_folder_is_a_command_or_a_named_child():
    scripts = {p.name for p in (ROOT / "benchmarks").glob("*.py") if p.name != "__main__.py" and runs_as_script(p)}
    named = {script for script, _ in COMMANDS.values()} | CHILD_SCRIPTS
    assert scripts == named, scripts ^ named


def test_help_lists_every_command_with_its_summary_and_imports_no_torch():
    done = subprocess.run([sys.executable, "-c", "import sys, runpy; sys.argv = ['x', '--help']\n"
                           "try: runpy.run_module('benchmarks', run_name='__main__')\n"
                           "except SystemExit: pass\n"
                           "print('torch imported' if 'torch' in sys.modules else 'torch not imported')"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    listed = {line.split()[0] for line in done.stdout.splitlines() if line.startswith("  ")}
    assert listed == set(COMMANDS), listed
    assert "step-time            Per-thread step time" in done.stdout
    assert done.stdout.rstrip().endswith("torch not imported")


def test_an_unknown_name_is_one_line_with_exit_2():
    done = entry("replay")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: no benchmark named 'replay'; python -m benchmarks --help lists them: " + ", ".join(COMMANDS)]


def test_a_command_runs_its_script_with_the_arguments_and_returns_its_status():
    for name in ("index", "readme"):
        ok = entry(name, "--check")
        assert ok.returncode == 0, ok.stderr
        bad = entry(name, "--no-such-flag")
        assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr, bad.stderr


def test_an_alias_runs_its_mode_and_says_nothing_more():
    for alias, (script, first) in ALIASES.items():
        assert script == "trainer_runs.py" and first[0] == "--mode"
        through_alias, through_mode = entry(alias, "--help"), entry("trainer-runs", *first, "--help")
        assert through_alias.returncode == through_mode.returncode == 0, through_alias.stderr
        assert (through_alias.stdout, through_alias.stderr) == (through_mode.stdout, through_mode.stderr)
        assert f"--mode {first[1]}" in through_alias.stdout
    refused = entry("trainer-runs", "--mode", "nope")
    assert refused.returncode == 2 and "--mode nope" in refused.stderr
