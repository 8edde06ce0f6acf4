"""python -m benchmarks trainer-runs --mode ab (benchmarks/dflash_ab.py): source trees run in
turns, each run's figures listed in the order they ran."""

import importlib
import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
dflash_ab = importlib.import_module("dflash_ab")
headlines = importlib.import_module("headlines")

# A stand-in for a tree's dflash_throughput.py: writes a results file whose figures say which tree
# ran, in which turn, with which arguments and Inductor cache; tree "broken" fails, tree "half" has
# a failed sequential cell (its figures None, as dflash_throughput writes them).
FAKE_BENCH = textwrap.dedent("""
    import json, os, sys
    from pathlib import Path
    out = Path(sys.argv[sys.argv.index("--out-dir") + 1])
    tree = Path(__file__).resolve().parents[1].name  # the tree of this stand-in
    if tree == "broken":
        sys.exit(3)
    log = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]).parent / "turns.txt"
    turn = len(log.read_text().splitlines()) if log.exists() else 0
    log.write_text((log.read_text() if log.exists() else "") + tree + "\\n")
    out.mkdir(parents=True)
    data = {"shape": "default", "graphs": "whole-step", "env": {"gpu": None, "torch": "2.13.0", "cpus": 2, "date": "2026-12-01"},
            "tokens_per_s_threaded": 1000.0 * (turn + 1), "tokens_per_s_sequential": 2000.0, "ratio": (turn + 1) / 2,
            "host_gil_ms_per_batch": 0.5 + turn, "gpu_ms_per_batch": None,
            "args_seen": sys.argv[1:], "cache": os.environ["TORCHINDUCTOR_CACHE_DIR"], "variant": os.environ.get("AB_VARIANT")}
    if tree == "half":
        data.update(tokens_per_s_sequential=None, ratio=None, host_gil_ms_per_batch=None)
    (out / "dflash-throughput-default-whole-step_cpu_torch2.13.0_2026-12-01.json").write_text(json.dumps(data))
""")


def _tree(root: Path, name: str) -> Path:
    (root / name / "benchmarks").mkdir(parents=True)
    (root / name / "benchmarks" / "dflash_throughput.py").write_text(FAKE_BENCH)
    return root / name


def test_trees_run_in_turns_and_the_summary_keeps_their_order(tmp_path, capsys):
    a, b = _tree(tmp_path, "a"), _tree(tmp_path, "b")
    work, out = tmp_path / "work", tmp_path / "out"
    argv = ["--tree", f"a={a}", "--tree", f"b={b}", "--reps", "2", "--work", str(work), "--out-dir", str(out),
            "--", "--cuda-graphs", "whole-step"]
    assert dflash_ab.main(argv) == 0
    assert (work / "turns.txt").read_text().split() == ["a", "b", "a", "b"]
    summary = json.loads((out / "dflash-ab-default-whole-step_cpu_torch2.13.0_2026-12-01.json").read_text())
    assert [r["run"] for r in summary["runs"]] == ["a-1", "b-1", "a-2", "b-2"]
    assert [r["tokens_per_s_threaded"] for r in summary["runs"]] == [1000.0, 2000.0, 3000.0, 4000.0]
    assert summary["trees"]["a"]["tokens_per_s_threaded_min"] == 1000.0 and summary["trees"]["a"]["tokens_per_s_threaded_max"] == 3000.0
    assert summary["trees"]["b"]["host_gil_ms_per_batch_max"] == 3.5 and summary["trees"]["b"]["runs"] == 2
    seen = json.loads(next((work / "b-2").glob("*.json")).read_text())
    assert seen["args_seen"] == ["--out-dir", str(work / "b-2"), "--cuda-graphs", "whole-step"]
    assert seen["cache"] == str(work / "inductor-cache-b")
    assert "| a-2 | a | 3000 | 2000 | 1.50 | 2.500 | - | - |" in capsys.readouterr().out
    rows = headlines.dflash_ab(summary)
    assert rows[0] == ("default target, whole-step: tree a, 2 runs",
                       "threaded 1 - 3k tokens/s, sequential 2k; sequential host 0.50 - 2.50 ms/batch")
    again = tmp_path / "again"
    assert dflash_ab.main(["--summarize", str(work), "--out-dir", str(again)]) == 0
    assert (again / "dflash-ab-default-whole-step_cpu_torch2.13.0_2026-12-01.json").read_text() == json.dumps(summary, indent=1) + "\n"


def test_a_second_invocation_on_one_work_adds_its_turns_and_keeps_the_earlier_ones(tmp_path, capsys):
    a, b = _tree(tmp_path, "a"), _tree(tmp_path, "b")
    work, out = tmp_path / "work", tmp_path / "out"
    common = ["--reps", "1", "--work", str(work), "--out-dir", str(out), "--", "--cuda-graphs", "whole-step"]
    assert dflash_ab.main(["--tree", f"a={a}", "--tree", f"b={b}", *common]) == 0
    assert dflash_ab.main(["--tree", f"b={b}", "--tree", f"a={a}", *common]) == 0  # the other order, as a second call
    assert "2 earlier runs; these turns follow them" in capsys.readouterr().err
    assert (work / "turns.txt").read_text().split() == ["a", "b", "b", "a"]
    summary = json.loads((out / "dflash-ab-default-whole-step_cpu_torch2.13.0_2026-12-01.json").read_text())
    assert [r["run"] for r in summary["runs"]] == ["a-1", "b-1", "b-2", "a-2"]
    assert [r["tokens_per_s_threaded"] for r in summary["runs"]] == [1000.0, 2000.0, 3000.0, 4000.0]
    assert summary["trees"]["a"]["runs"] == 2 and summary["work"] == str(work)
    with pytest.raises(SystemExit, match="holds an A/B of dflash_throughput.py --cuda-graphs whole-step, not of "
                                         "--cuda-graphs trees; give another --work"):
        dflash_ab.main(["--tree", f"a={a}", "--tree", f"b={b}", *common[:-1], "trees"])
    c = _tree(tmp_path / "c", "a")
    with pytest.raises(SystemExit, match=f"tree a was {a} in its earlier runs, not {c}"):
        dflash_ab.main(["--tree", f"a={c}", "--tree", f"b={b}", *common])
    assert (work / "turns.txt").read_text().split() == ["a", "b", "b", "a"]  # refused before any run


def test_a_results_file_is_not_replaced_by_another_work_s_summary(tmp_path):
    a, b = _tree(tmp_path, "a"), _tree(tmp_path, "b")
    out = tmp_path / "out"
    first = ["--tree", f"a={a}", "--tree", f"b={b}", "--reps", "1", "--out-dir", str(out)]
    assert dflash_ab.main([*first, "--work", str(tmp_path / "w1")]) == 0
    path = out / "dflash-ab-default-whole-step_cpu_torch2.13.0_2026-12-01.json"
    kept = path.read_text()
    with pytest.raises(SystemExit, match=f"holds another A/B's runs \\(its --work was {tmp_path / 'w1'}\\); add turns"):
        dflash_ab.main([*first, "--work", str(tmp_path / "w2")])
    assert path.read_text() == kept
    assert dflash_ab.main(["--summarize", str(tmp_path / "w1"), "--out-dir", str(out)]) == 0  # the same runs again
    assert path.read_text() == kept


def test_a_work_dir_without_results_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="no runs.json, so not a folder this script ran in"):
        dflash_ab.main(["--summarize", str(tmp_path)])
    broken = _tree(tmp_path, "broken")
    other = _tree(tmp_path / "x", "broken")
    with pytest.raises(SystemExit, match="no run measured both cells"):
        dflash_ab.main(["--tree", f"one={broken}", "--tree", f"two={other}", "--reps", "1", "--work", str(tmp_path / "w"),
                        "--out-dir", str(tmp_path / "out")])


TREE = str(ROOT)


@pytest.mark.parametrize("argv, message", [
    (["--tree", f"a={TREE}"], "give at least two --tree NAME=DIR"),
    (["--tree", f"a={TREE}", "--tree", "b"], "--tree b: give NAME=DIR"),
    (["--tree", f"a={TREE}", "--tree", "b=/nonexistent"], "/nonexistent has no benchmarks/dflash_throughput.py"),
    (["--tree", f"a-1={TREE}", "--tree", f"b={TREE}"], "a name without '-'"),
    (["--tree", f"a={TREE}", "--tree", f"a={TREE}"], "a second tree named a"),
    (["--tree", f"a={TREE}", "--tree", f"b={TREE}", "--reps", "0"], "--reps 0: give 1 or more"),
    (["--tree", f"a={TREE}", "--tree", f"b={TREE}", "--tree-arg", "c=--x"], "--tree-arg c=--x: give NAME=ARG for a tree"),
    (["--tree", f"a={TREE}", "--tree", f"b={TREE}", "--tree-env", "a=NOVALUE"], "--tree-env a=NOVALUE: give NAME=VAR=VALUE"),
    (["--tree", f"a={TREE}", "--tree", f"b={TREE}", "--", "--out-dir", "x"], "--out-dir is this script's"),
])
def test_bad_arguments_are_refused_before_any_run(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        dflash_ab.parse_args(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_one_trees_own_arguments_and_variables_reach_it_alone(tmp_path):
    a, b = _tree(tmp_path, "a"), _tree(tmp_path, "b")
    work = tmp_path / "work"
    argv = ["--tree", f"a={a}", "--tree", f"b={b}", "--reps", "1", "--work", str(work), "--out-dir", str(tmp_path / "out"),
            "--tree-arg", "b=--inductor-cache=shared", "--tree-env", "b=AB_VARIANT=compile_threads_1"]
    assert dflash_ab.main(argv) == 0
    seen = {t: json.loads(next((work / f"{t}-1").glob("*.json")).read_text()) for t in "ab"}
    assert seen["a"]["args_seen"] == ["--out-dir", str(work / "a-1")] and seen["a"]["variant"] is None
    assert seen["b"]["args_seen"] == ["--out-dir", str(work / "b-1"), "--inductor-cache=shared"]
    assert seen["b"]["variant"] == "compile_threads_1"
    runs = json.loads((work / "runs.json").read_text())["runs"]
    assert runs[1]["extra_args"] == ["--inductor-cache=shared"] and runs[1]["extra_env"] == "AB_VARIANT=compile_threads_1"
    assert "extra_args" not in runs[0]


def test_a_run_with_a_failed_cell_or_an_older_runs_files_does_not_count(tmp_path, capsys):
    a, half, broken = _tree(tmp_path, "a"), _tree(tmp_path, "half"), _tree(tmp_path, "broken")
    work = tmp_path / "work"
    stale = work / "broken-1"
    stale.mkdir(parents=True)  # what an earlier invocation left: the failing run must not show it
    (stale / "dflash-throughput-default-whole-step_cpu_torch2.13.0_2026-11-30.json").write_text(json.dumps(
        {"tokens_per_s_threaded": 1.0, "tokens_per_s_sequential": 1.0, "ratio": 1.0, "host_gil_ms_per_batch": 1.0}))
    argv = ["--tree", f"a={a}", "--tree", f"half={half}", "--tree", f"broken={broken}", "--reps", "1",
            "--work", str(work), "--out-dir", str(tmp_path / "out")]
    assert dflash_ab.main(argv) == 0
    out = capsys.readouterr().out
    assert "| half-1 | half | a cell failed (no figures) |" in out and "| broken-1 | broken | failed (rc 3) |" in out
    summary = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    assert list(summary["trees"]) == ["a"]


def test_a_run_past_its_timeout_or_its_parent_leaving_is_stopped():
    import subprocess

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    proc = subprocess.Popen(sleeper)
    assert dflash_ab.common.wait_or_stop(proc, 0.5) is None and proc.poll() is not None
    proc = subprocess.Popen(sleeper)
    real, calls = proc.communicate, []

    def communicate(timeout=None):
        calls.append(timeout)
        if len(calls) == 1:
            raise SystemExit(143)  # what exit_on_sigterm raises while the parent waits
        return real(timeout=timeout)

    proc.communicate = communicate
    with pytest.raises(SystemExit):
        dflash_ab.common.wait_or_stop(proc, 30)
    assert proc.poll() is not None and calls == [30, 60]
