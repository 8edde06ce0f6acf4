"""RunResult.to_json() is the --json line that GPU tests and benchmarks parse: its keys and order."""

from examples.dflash_trainer.run.result import RunResult, WorkerResult

WORKER = WorkerResult(device="cpu", p50_ms=1.5, p90_ms=None, setup_s=0.1, first_step_at_s=0.2, warmup_s=0.3,
                      compile_s=0.0, capture_s=0.0, peer_compile_wait_s=0.0, captures=0, steps=4,
                      phases_p50_ms={"forward": 1.0})
FIXED = dict(rank=0, world=1, total_steps=4, start_step=0, placement="p", mode="eager", gil_switch_interval_ms=5.0,
             target_report=None, startup_s=1.0, build_s=0.5, workers={"target-0": WORKER}, out_dir="out")


def test_a_full_result_has_every_key_in_the_order_of_the_json_line():
    result = RunResult(**FIXED, last={"step": 4, "loss": 1.0}, losses=[2.0, 1.0], tokens_per_s_steady=10.0,
                       baseline={"tau_random_init": 1.0}, eval={"tau": 1.5}, checkpoint="ckpt",
                       compile_warmers={"target": {"outcome": "done", "seconds": 3.0}},
                       compile_caches={"fxgraph_cache_hit": 2, "fxgraph_cache_miss": 0})
    assert list(result.to_json()) == ["rank", "world", "total_steps", "start_step", "last", "losses",
                                      "tokens_per_s_steady", "baseline", "eval", "checkpoint", "placement", "mode",
                                      "gil_switch_interval_ms", "target_report", "startup_s", "build_s", "workers",
                                      "out_dir", "compile_warmers", "compile_caches"]
    assert result.to_json()["workers"]["target-0"] == {
        "device": "cpu", "p50_ms": 1.5, "p90_ms": None, "setup_s": 0.1, "first_step_at_s": 0.2, "warmup_s": 0.3,
        "compile_s": 0.0, "capture_s": 0.0, "peer_compile_wait_s": 0.0, "captures": 0, "steps": 4,
        "phases_p50_ms": {"forward": 1.0}, "phases_warmup_s": {}}


def test_values_a_run_does_not_have_are_left_out_but_the_target_report_is_null():
    json_line = RunResult(**FIXED).to_json()
    assert not {"last", "losses", "tokens_per_s_steady", "baseline", "eval", "checkpoint", "compile_warmers",
                "compile_caches"} & set(json_line)
    assert json_line["target_report"] is None
