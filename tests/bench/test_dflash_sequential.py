"""dflash_throughput's sequential loop trains what the threads train, with the trainer's own step
code: on the tiny assets, three drafters sharing one device's weights, it trains to the threaded
trainer's per-step losses, bit for bit."""

import importlib
from pathlib import Path

import pytest

from examples.dflash_trainer.config import TrainConfig
from examples.dflash_trainer.drafter.replica import DrafterReplica
from examples.dflash_trainer.target_stage import TargetStage
from examples.dflash_trainer.train import train

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def tiny_config(assets, out_dir):
    # Three drafters on one device: their gradients averaged, the shared weights stepped once a
    # round by the first. Two targets: batches alternate between the shards.
    return TrainConfig(target=str(assets.target_dir), data=str(assets.train_jsonl), devices="cpu", seq_len=64,
                       block_size=8, num_anchors=4, batch_size=2, num_draft_layers=1, num_target_layers_used=1,
                       targets=2, drafters=3, max_steps=8, eval_every=0, checkpoint_every=0, out_dir=str(out_dir),
                       lr=3e-3)


def test_the_sequential_loop_trains_to_the_threaded_trainers_losses(tiny_assets, tmp_path, monkeypatch):
    threaded = train(tiny_config(tiny_assets, tmp_path / "threaded")).losses
    bench = importlib.import_module("benchmarks.dflash_sequential")
    calls = {"target": 0, "drafter": 0, "update": 0}
    stage_step, forward_backward, update = TargetStage.step, DrafterReplica.forward_backward, DrafterReplica.update

    def counted_stage_step(self, *args, **kwargs):
        calls["target"] += 1
        return stage_step(self, *args, **kwargs)

    def counted_forward_backward(self, *args, **kwargs):
        calls["drafter"] += 1
        return forward_backward(self, *args, **kwargs)

    def counted_update(self, *args, **kwargs):
        calls["update"] += 1
        return update(self, *args, **kwargs)

    monkeypatch.setattr(TargetStage, "step", counted_stage_step)
    monkeypatch.setattr(DrafterReplica, "forward_backward", counted_forward_backward)
    monkeypatch.setattr(DrafterReplica, "update", counted_update)
    # the order of the loop's device syncs and its timers' marks
    order = []
    sync_all, begin, finish = bench._sync_all, bench.common.StepTimer.begin, bench.common.StepTimer.finish
    monkeypatch.setattr(bench, "_sync_all", lambda devices: (order.append("sync"), sync_all(devices))[1])
    monkeypatch.setattr(bench.common.StepTimer, "begin", lambda self: (order.append("begin"), begin(self))[1])
    monkeypatch.setattr(bench.common.StepTimer, "finish", lambda self: (order.append("finish"), finish(self))[1])
    sequential = bench.run_sequential(tiny_config(tiny_assets, tmp_path / "sequential"), warmup_batches=6)

    assert len(threaded) == 8 and threaded[-1] < threaded[0]
    assert sequential["losses"] == threaded
    # every batch through the trainer's step functions; every replica counts each of the 8 steps
    assert calls == {"target": 24, "drafter": 24, "update": 24}
    # 8 rounds: 2 of warmup (6 batches), 4 timed, then 2 of the host probe, after the timed rounds:
    # its syncs, two a batch, all come once the timers have finished; the timed span's one sync ends it
    assert sequential["timed_batches"] == 12 and sequential["host_probe_rounds"] == 2
    timed = order[order.index("begin"):]
    last_finish = len(timed) - timed[::-1].index("finish")
    assert timed[last_finish:].count("sync") >= 2 * 3 * 2 and timed[1:timed.index("finish")] == ["sync"]
    # one window of the 4 timed rounds (windows are LOG_EVERY rounds long), the median of the windows
    assert len(sequential["windows_tokens_per_s"]) == 1
    assert sequential["tokens_per_s"] == sequential["windows_tokens_per_s"][0]


def test_the_gpu_bound_limit_takes_the_busiest_device_of_a_round_over_the_rounds_batches():
    throughput = importlib.import_module("benchmarks.dflash_throughput")
    cfg = TrainConfig(batch_size=4, seq_len=256)
    # drafters on cuda:0, cuda:1, cuda:0: a round is 3 batches; cuda:0 is busy 20 ms of it, cuda:1 12 ms
    sequential = {"tokens_per_s": 1.0, "gpu_ms_per_round_by_device": {"0": 20.0, "1": 12.0}, "batches_per_round": 3,
                  "devices": ["cuda:0", "cuda:1"], "training": "as threaded"}
    figures = throughput.headline(cfg, {"tokens_per_s": 1.0}, sequential, on_gpu=True)
    assert figures["gpu_ms_per_batch"] == pytest.approx(20.0 / 3)
    assert figures["gpu_bound_tokens_per_s"] == pytest.approx(3 * 1024 / 0.020)  # 3 batches in the busiest 20 ms
    # files of the earlier loop: each device's time for its one batch a round, times the devices
    older = {"tokens_per_s": 1.0, "gpu_ms_per_batch_by_device": {"0": 10.0, "1": 8.0}, "devices": ["cuda:0", "cuda:1"]}
    figures = throughput.headline(cfg, {"tokens_per_s": 1.0}, older, on_gpu=True)
    assert figures["gpu_bound_tokens_per_s"] == pytest.approx(2 * 1024 / 0.010)


@pytest.mark.parametrize("steps", [40, 50, 60, 100, 101, 200])
def test_a_profiled_threaded_run_keeps_its_first_steady_windows_apart_and_stops_before_the_drain(steps):
    throughput = importlib.import_module("benchmarks.dflash_throughput")
    windows = -(-steps // throughput.LOG_EVERY)  # the first holds warmup, the last the drain
    span = throughput.profile_span(steps)
    if windows - 2 <= throughput.MIN_CLEAN_WINDOWS:
        assert span is None
        return
    start, stop = span  # by windows logged: the profile starts after window start - 1, stops after stop - 1
    assert start - 1 >= throughput.MIN_CLEAN_WINDOWS and start - 1 >= (windows - 2) // 2
    assert start < stop == windows - 1


def test_the_threaded_cell_leaves_the_profiled_windows_out_of_its_steady_figure(tiny_assets, tmp_path, monkeypatch):
    throughput = importlib.import_module("benchmarks.dflash_throughput")
    import time

    class Window:  # a profile that costs nothing: when it started and ended, and where
        made = []

        def __init__(self, seconds):
            self.started_at = self.ended_at = None
            Window.made.append(self)

        def start(self):
            self.started_at = time.perf_counter()

        def stop(self):
            self.ended_at = time.perf_counter()

        def outcome(self):
            return {"figures": "of the window"}

    monkeypatch.setattr(throughput.common, "on_gpu", lambda: True)
    monkeypatch.setattr(throughput.thread_profile, "ThreadProfile", Window)
    cfg = tiny_config(tiny_assets, tmp_path / "threaded")
    cfg.max_steps = 60  # windows: warmup, 4 steady, the drain; the profile over the fourth steady one
    result = throughput.run_threaded(cfg, profile_s=3.0)

    (window,) = Window.made
    assert window.started_at is not None and window.ended_at is not None
    assert result["profiled_windows"] == [4] and result["steady_windows"] == 3  # as many as a ratio needs
    assert result["tokens_per_s"] == pytest.approx(sorted(result["windows_tokens_per_s"][1:4])[1])
    assert result["thread_profile"] == {"figures": "of the window"}

    # a profile that ran out of seconds at once: the windows after it stay out too
    monkeypatch.setattr(Window, "start", lambda self: setattr(self, "started_at", time.perf_counter())
                        or setattr(self, "ended_at", self.started_at))
    cfg.max_steps, cfg.out_dir = 70, str(tmp_path / "early")
    early = throughput.run_threaded(cfg, profile_s=3.0)  # steady windows 1-5, the profile from the end of 3
    assert early["profiled_windows"] == [4, 5] and early["steady_windows"] == 3

    cfg.max_steps, cfg.out_dir = 50, str(tmp_path / "short")
    Window.made.clear()
    short = throughput.run_threaded(cfg, profile_s=3.0)
    assert not Window.made and short["profiled_windows"] == [] and short["steady_windows"] == 3
    assert short["thread_profile"]["error"].startswith("not profiled: 50 steps give too few steady windows")


def test_the_sequential_loop_takes_the_median_of_whole_windows(tiny_assets, tmp_path):
    bench = importlib.import_module("benchmarks.dflash_sequential")
    cfg = tiny_config(tiny_assets, tmp_path / "sequential")
    cfg.max_steps = 36  # 2 warmup rounds, then 29 before the 5 probe rounds: 2 whole windows of 10
    sequential = bench.run_sequential(cfg, warmup_batches=6)
    windows = sequential["windows_tokens_per_s"]
    assert len(windows) == 2 and sequential["timed_batches"] == 20 * 3 and sequential["host_probe_rounds"] == 5
    assert sequential["tokens_per_s"] == pytest.approx(sum(windows) / 2)


@pytest.mark.parametrize("steps", ["10", "105"])
def test_the_throughput_benchmark_takes_whole_windows_of_steps(steps, capsys):
    throughput = importlib.import_module("benchmarks.dflash_throughput")
    with pytest.raises(SystemExit) as exited:
        throughput.parse_args(["--steps", steps])
    assert exited.value.code == 2
    assert "--steps must be a multiple of 10 above it, such as 100" in capsys.readouterr().err
