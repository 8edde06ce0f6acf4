"""python -m benchmarks trainer-startup (benchmarks/trainer_startup.py): each run in a process of its own, on an empty Inductor cache (the
restart on the Trees run's), its --json line kept whole with Dynamo's recompilations counted; a
failed run is recorded and the others still run. A stand-in trainer prints what the real one would."""

import json
import sys
import textwrap

import pytest

from benchmarks import trainer_process
from benchmarks import trainer_startup

FAKE_TRAINER = textwrap.dedent("""
    import json, os, sys
    args = sys.argv[1:]
    graphs = args[args.index("--cuda-graphs") + 1]
    cache = os.environ["TORCHINDUCTOR_CACHE_DIR"]
    warm = os.path.isdir(cache)
    os.makedirs(cache, exist_ok=True)
    if os.environ.get("FAIL_GRAPHS") == graphs:
        sys.exit("error: the stand-in trainer was told to fail")
    if not warm and os.environ.get("TORCH_LOGS") == "recompiles":
        print("V1202 recompiles: [0/1] Recompiling function target_step in step.py:40", file=sys.stderr)
        print("V1202 recompiles: [0/1]     triggered by the following guard failure(s):", file=sys.stderr)
        print("V1202 recompiles: [0/1]     - 0/0: ___check_obj_id(L['self'].__call__)", file=sys.stderr)
    workers = {n: {"compile_s": 0.0 if warm else 2.0 * (n == "target-0"), "peer_compile_wait_s": 1.0}
               for n in ("target-0", "target-1", "drafter-0")}
    workers["drafter-0"].update(warmup_s=4.0, phases_warmup_s={"wait_batch": 2.5, "forward_backward": 1.25})
    print("progress on stdout that is not the result")
    result = {"startup_s": 3.0 if warm else 9.0, "build_s": 1.0, "workers": workers, "mode": graphs,
              "eval": {"tau": 2.5}, "tokens_per_s_steady": 1000.0, "args": args, "warm": warm,
              "baseline": {"tau_random_init": 1.0, "tau_repeat_last_token": 1.1}, "total_steps": 20,
              "placement": "targets cpu, drafters cpu",
              "target_report": {"versions": {"python": "3.11.7", "torch": "2.13.0+cpu"}}}
    if os.environ.get("SHORT"):  # too few steps for a steady window, no eval, a target given by path
        del result["eval"], result["tokens_per_s_steady"], result["target_report"]
    print(json.dumps(result))
""")


@pytest.fixture
def fake(tmp_path, monkeypatch):
    script = tmp_path / "trainer.py"
    script.write_text(FAKE_TRAINER)
    monkeypatch.setattr(trainer_process, "TRAINER", [sys.executable, str(script)])
    out = tmp_path / "out"
    return out


def _results(out):
    (path,) = out.glob("dflash-trainer-startup_*.json")
    return path, json.loads(path.read_text())


def test_each_run_starts_cold_but_the_restart_which_reuses_the_trees_cache(fake, capsys):
    assert trainer_startup.main(["--out-dir", str(fake), "--label", "after X", "--", "--max-steps", "20"]) == 0
    path, data = _results(fake)
    runs = trainer_startup.runs_of(data)
    assert list(runs) == ["Trees after X, empty Inductor cache", "whole-step after X, empty Inductor cache",
                          "Trees after X, restart on that cache"]
    assert [r["warm"] for r in runs.values()] == [False, False, True]
    assert [r["mode"] for r in runs.values()] == ["trees", "whole-step", "trees"]
    assert [r["recompiles"] for r in runs.values()] == [1, 1, 0]
    first = runs["Trees after X, empty Inductor cache"]
    assert first["recompile_records"][0].startswith("V1202 recompiles: [0/1] Recompiling function target_step")
    assert "___check_obj_id(L['self'].__call__)" in first["recompile_records"][0]
    assert first["args"][-2:] == ["--max-steps", "20"] and "--json" in first["args"]
    assert first["command"].startswith("python -m examples.dflash_trainer --out-dir ")
    assert data["env"]["torch"] and "trainer_startup.py" in data["recorded_by"]
    assert [p.name for p in fake.iterdir()] == [path.name]  # the JSON only
    printed = capsys.readouterr()
    assert "| Trees after X, restart on that cache: Trees, 20 steps, CPU | tau 2.50 " in printed.out  # its figures
    err = printed.err
    assert "[1] startup 9.0 s, 1 of 3 workers compiled, 1 recompiles, 1000 tokens/s steady" in err
    assert "[3] startup 3.0 s, 0 of 3 workers compiled, 0 recompiles" in err


def test_a_failed_run_is_recorded_and_the_others_still_run(fake, monkeypatch):
    monkeypatch.setenv("FAIL_GRAPHS", "whole-step")
    assert trainer_startup.main(["--out-dir", str(fake)]) == 1
    path, data = _results(fake)
    runs = trainer_startup.runs_of(data)
    assert runs["whole-step, empty Inductor cache"]["error"] == "exit 1: error: the stand-in trainer was told to fail"
    assert runs["Trees, restart on that cache"]["startup_s"] == 3.0


def test_a_run_too_short_for_a_steady_window_or_an_eval_is_reported_without_them(fake, monkeypatch, capsys):
    monkeypatch.setenv("SHORT", "1")
    assert trainer_startup.main(["--out-dir", str(fake), "--graphs", "whole-step"]) == 0
    path, data = _results(fake)
    assert list(trainer_startup.runs_of(data)) == ["whole-step, empty Inductor cache"]  # no Trees run: no restart
    assert "[1] startup 9.0 s, 1 of 3 workers compiled, 1 recompiles, - tokens/s steady" in capsys.readouterr().err
    (run,) = trainer_startup.runs_of(data).values()
    assert "eval" not in run and "tokens_per_s_steady" not in run and run["startup_s"] == 9.0


def test_append_adds_runs_and_replaces_those_of_the_same_name(fake, capsys):
    assert trainer_startup.main(["--out-dir", str(fake), "--graphs", "trees", "--no-restart", "--label", "before"]) == 0
    assert trainer_startup.main(["--out-dir", str(fake), "--graphs", "whole-step", "--label", "after", "--append"]) == 0
    _, data = _results(fake)
    assert list(trainer_startup.runs_of(data)) == ["Trees before, empty Inductor cache", "whole-step after, empty Inductor cache"]
    assert trainer_startup.main(["--out-dir", str(fake), "--graphs", "trees", "--no-restart", "--label", "before",
                                 "--append"]) == 0
    assert "replacing the earlier runs Trees before, empty Inductor cache" in capsys.readouterr().err
    assert len(trainer_startup.runs_of(_results(fake)[1])) == 2
    assert trainer_startup.main(["--out-dir", str(fake), "--graphs", "trees", "--no-restart"]) == 0  # no --append
    assert list(trainer_startup.runs_of(_results(fake)[1])) == ["Trees, empty Inductor cache"]


@pytest.mark.parametrize("argv, message", [
    (["--graphs", "trees,cudagraphs"], "--graphs cudagraphs: give one or more of trees, whole-step"),
    (["--", "--out-dir", "/tmp/x"], "--out-dir is this script's to set"),
    (["--", "--cuda-graphs=whole-step"], "--cuda-graphs=whole-step is this script's to set"),
])
def test_arguments_the_script_sets_itself_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        trainer_startup.parse_args(argv)
    assert message in capsys.readouterr().err
