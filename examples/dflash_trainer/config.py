"""The one validated configuration of the DFlash example trainer.

Defaults are small so a whole run (embedded tiny target, embedded data) finishes in minutes on a
CPU; the paper's values are noted next to each field where they differ.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .assets.shapes import SHAPES
from .data.chat import REASONING
from .drafter.chunked_ce import DEFAULT_CHUNK_TOKENS

# Paper's loss decay per block size (DFlash section 4): w_k = exp(-(k-1)/gamma).
_DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
_COMPILE_MODES = ("auto", "eager", "reduce-overhead")
_DTYPES = ("auto", "float32", "bfloat16")
_CUDA_GRAPHS = ("trees", "whole-step")
_TARGET_SHAPES = tuple(SHAPES)
# --preset NAME: settings a flag group stands for; a flag given explicitly beside it wins.
PRESETS = {
    # The DFlash paper's drafter (section 4): 5 layers, block 16 (its gamma, 7, follows), 512 anchors,
    # max length 3072.
    "paper": dict(num_draft_layers=5, block_size=16, num_anchors=512, seq_len=3072),
}
CHOICES = {"compile": _COMPILE_MODES, "dtype": _DTYPES, "cuda_graphs": _CUDA_GRAPHS,
           "target_shape": _TARGET_SHAPES, "reasoning": REASONING}  # for the CLI
DATA_GROUP = "data and logs"  # the CLI's group of the fields in it


@dataclass
class TrainConfig:
    target: str | None = None  # local HF model dir; None = the embedded tiny default target
    # A random-init Qwen3 target of a published shape (shapes.SHAPES) on the embedded tokenizer and
    # data, built and cached locally: for throughput work only (tau means nothing with random weights).
    target_shape: str | None = None
    data: str | None = None  # JSONL path; None = the embedded default data
    out_dir: str = "runs/dflash"
    targets: int = 5  # target worker threads (producers of features)
    drafters: int = 3  # drafter worker threads (consumers, one optimiser step each)
    devices: str | None = None  # "cuda:0,cuda:1" or "cpu"; None = the entry point picks
    seq_len: int = 256  # paper: 3072
    block_size: int = 8  # paper: 16
    num_anchors: int = 16  # paper: 512
    num_draft_layers: int = 2  # paper: 5
    num_target_layers_used: int | None = None  # None = num_draft_layers (the paper's n)
    gamma: float | None = None  # None = paper value for block_size (see gamma_value)
    batch_size: int = 4  # samples per drafter step
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    epochs: int = 6  # paper: 6
    max_steps: int | None = None  # None = as many steps as `epochs` takes
    eval_every: int = 50  # 0 disables periodic eval
    eval_prompts: int = 8
    eval_max_new_tokens: int = 64
    checkpoint_every: int = 100  # 0 disables periodic checkpoints
    # Save no checkpoint at all, not even after the last step or on Ctrl-C: for runs whose weights
    # are not wanted (benchmarks, smoke runs); --out-dir need not hold one then.
    no_checkpoints: bool = False
    # Compile the target and drafter steps first in two helper processes (run/warmers.py), which fill
    # Inductor's caches while this one builds; the workers then load the compiled code. Only where
    # steps compile, in one process (not under torchrun).
    compile_warmers: bool = False
    # The workers wait for their warmer at their first step, so this bounds that wait; inf: no limit.
    compile_warmer_timeout_s: float = dataclasses.field(default=300.0, metadata={"help": (
        "with --compile-warmers: seconds from a warmer's start until it is stopped and the workers that wait "
        "for it compile themselves")})
    resume: bool = False
    overwrite: bool = False  # a fresh run into an --out-dir that holds a run deletes that run
    seed: int = 0
    compile: str = "auto"  # auto = reduce-overhead on CUDA, eager on CPU (policy.ExecutionPolicy)
    # With reduce-overhead: "trees" = CUDAGraph Trees per compiled region; "whole-step" = the
    # target step, the drafter's forward + backward and its clip + AdamW update each captured as
    # one CUDA graph per worker (threadgraph.capture_step; Inductor kernels inside); only the
    # gradient averaging between them stays eager, so far fewer Python ops per step hold the GIL.
    cuda_graphs: str = "trees"
    dtype: str = "auto"  # auto = bfloat16 on CUDA, float32 on CPU
    channel_capacity: int = 4
    # How long a thread may hold the GIL while others wait (sys.setswitchinterval); None = Python's
    # (5 ms). A knob for experiments: the GIL is handed over at every eager op anyway.
    gil_switch_interval_ms: float | None = None
    # Under torchrun: how long a rank waits for the others at a gradient average (or a setup
    # barrier) before the job fails naming the ranks that stopped making progress (NCCL and gloo).
    collective_timeout_s: float = 600.0

    # ---- training at the paper's scale: the loss, accumulation, held-out evaluation, a start ----
    # The loss through the target's LM head takes this many drafter outputs at a time, so the
    # [tokens, vocab] logits are never whole (drafter/chunked_ce.py).
    loss_chunk_tokens: int = dataclasses.field(default=DEFAULT_CHUNK_TOKENS, metadata={"help": (
        "drafter outputs the loss takes through the LM head at a time (its logits are never held whole)")})
    grad_accum: int = dataclasses.field(default=1, metadata={"help": (
        "micro-batches of --batch-size per drafter step: trains like an N-times larger batch")})
    eval_data: str | None = dataclasses.field(default=None, metadata={"help": (
        "JSONL of held-out samples for tau (input_ids, and loss_mask marking the response); without it "
        "the embedded eval prompts, or with --data a fixed split of it that training never reads")})
    init_from: str | None = dataclasses.field(default=None, metadata={"help": (
        "start from a DFlash drafter checkpoint directory in the z-lab or speculators format, of this "
        "run's architecture")})
    # Data and run logs: chat reasoning, the token cache, TensorBoard (the CLI's "data and logs" group).
    reasoning: str = dataclasses.field(default="train", metadata={"group": DATA_GROUP, "help": (
        "reasoning (<think> blocks) of assistant turns: train on it, keep it as context only, or drop it")})
    data_cache: str | None = dataclasses.field(default=None, metadata={"group": DATA_GROUP, "help": (
        "directory of the tokenized-data cache, keyed by tokenizer, data and settings (None: dflash-data in "
        "the threadgraph cache)")})
    no_data_cache: bool = dataclasses.field(default=False, metadata={"group": DATA_GROUP, "help": (
        "tokenize --data at every start, reading and writing no cache")})
    tensorboard: str | None = dataclasses.field(default=None, metadata={"group": DATA_GROUP, "help": (
        "write TensorBoard events (loss, accuracy, tau, learning rate, tokens/s, each worker's step time) to DIR")})

    def __post_init__(self) -> None:
        for name in ("targets", "drafters", "seq_len", "num_anchors", "num_draft_layers",
                     "batch_size", "epochs", "eval_prompts", "eval_max_new_tokens",
                     "channel_capacity"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("eval_every", "checkpoint_every", "seed"):
            _check_int(name, getattr(self, name), minimum=0)
        # Block size 1 has no draft token to train: every output would be the anchor itself.
        _check_int("block_size", self.block_size, minimum=2)
        if self.seq_len < 2:  # an anchor needs a position after it to predict
            raise ValueError(f"--seq-len {self.seq_len} leaves no position for an anchor (it needs at least 2); "
                             f"raise --seq-len")
        if self.num_anchors > self.seq_len - 1:  # every step computes num_anchors * block_size tokens
            raise ValueError(f"--num-anchors {self.num_anchors} exceeds the --seq-len {self.seq_len} - 1 positions an "
                             f"anchor can take (the rest would be padding, computed at full cost); lower --num-anchors "
                             f"to at most {self.seq_len - 1} or raise --seq-len")
        if self.block_size > self.seq_len:
            raise ValueError(f"block_size={self.block_size} exceeds seq_len={self.seq_len}: every block would be mostly "
                             f"padding; lower --block-size or raise --seq-len")
        if self.num_target_layers_used is not None:
            _check_int("num_target_layers_used", self.num_target_layers_used, minimum=1)
        if self.max_steps is not None:
            _check_int("max_steps", self.max_steps, minimum=1)
        _check_float("lr", self.lr, low=0.0, low_open=True)
        _check_float("warmup_ratio", self.warmup_ratio, low=0.0, high=1.0)
        _check_float("grad_clip", self.grad_clip, low=0.0, low_open=True, finite=False)  # inf: no clipping
        _check_float("weight_decay", self.weight_decay, low=0.0)
        if self.gil_switch_interval_ms is not None:
            _check_float("gil_switch_interval_ms", self.gil_switch_interval_ms, low=0.0, high=1000.0, low_open=True)
        if self.gamma is not None:
            _check_float("gamma", self.gamma, low=0.0, low_open=True)
        self.gamma_value  # raises now, not mid-run, if block_size has no default gamma
        _check_choice("compile", self.compile, _COMPILE_MODES)
        _check_choice("dtype", self.dtype, _DTYPES)
        _check_choice("cuda_graphs", self.cuda_graphs, _CUDA_GRAPHS)
        if self.target_shape is not None:
            _check_choice("target_shape", self.target_shape, _TARGET_SHAPES)
            if self.target is not None:
                raise ValueError("--target-shape and --target are mutually exclusive: --target-shape builds a "
                                 "random-init target of that shape, --target loads yours; pass one")
        for name in ("resume", "overwrite"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite contradict each other: --resume continues the run in --out-dir, "
                             "--overwrite deletes it; pass one")
        _check_float("collective_timeout_s", self.collective_timeout_s, low=0.0, low_open=True, finite=False)
        _check_float("compile_warmer_timeout_s", self.compile_warmer_timeout_s, low=0.0, low_open=True,
                     finite=False)
        for name in ("target", "data", "devices"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")
        if not isinstance(self.out_dir, str) or not self.out_dir.strip():
            raise ValueError(f"out_dir must be a non-empty path, got {self.out_dir!r}")
        self.device_list  # validates the comma list
        self._check_scale_settings()
        self._check_data_and_logs()

    def _check_scale_settings(self) -> None:
        for name in ("loss_chunk_tokens", "grad_accum"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_paths(self, ("eval_data", "init_from"))

    def _check_data_and_logs(self) -> None:
        _check_choice("reasoning", self.reasoning, REASONING)
        if not isinstance(self.no_data_cache, bool):
            raise ValueError(f"no_data_cache must be true or false, got {self.no_data_cache!r}")
        _check_paths(self, ("data_cache", "tensorboard"))

    @property
    def num_feature_layers(self) -> int:
        """The paper's n: how many target layers feed the drafter."""
        if self.num_target_layers_used is None:
            return self.num_draft_layers
        return self.num_target_layers_used

    @property
    def gamma_value(self) -> float:
        if self.gamma is not None:
            return float(self.gamma)
        if self.block_size not in _DEFAULT_GAMMA:
            raise ValueError(
                f"no default loss decay gamma for --block-size {self.block_size} (the paper gives "
                f"{_DEFAULT_GAMMA}); pass --gamma (half the block size is a fair start: --gamma {self.block_size / 2:g})"
            )
        return _DEFAULT_GAMMA[self.block_size]

    @property
    def switch_interval_s(self) -> float | None:
        """The GIL switch interval to run with, in seconds; None = leave Python's."""
        return None if self.gil_switch_interval_ms is None else self.gil_switch_interval_ms / 1000

    @property
    def device_list(self) -> list[str]:
        """`devices` split on commas; empty when None (the entry point picks)."""
        if self.devices is None:
            return []
        items = [d.strip() for d in self.devices.split(",")]
        if any(not d for d in items):
            raise ValueError(
                f"devices={self.devices!r} has an empty entry; write e.g. 'cuda:0,cuda:1' or 'cpu'"
            )
        return items

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown TrainConfig keys {unknown}; valid keys are {sorted(known)}"
            )
        return cls(**values)


def _check_int(name: str, value: Any, *, minimum: int) -> None:
    # bool is an int subclass; `epochs=True` is almost certainly a mistake.
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: Any, *, low: float, high: float | None = None,
                 low_open: bool = False, finite: bool = True) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value != value:
        raise ValueError(f"{name} must be a number, got {value!r}")
    if finite and not math.isfinite(value):  # an infinite lr or decay diverges at the first step
        raise ValueError(f"{name} must be finite, got {value}")
    too_low = value <= low if low_open else value < low
    if too_low or (high is not None and value >= high):
        bound = f"> {low}" if low_open else f">= {low}"
        if high is not None:
            bound += f" and < {high}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def apply_preset(values: dict[str, Any], preset: str | None, explicit: set[str]) -> dict[str, Any]:
    """``values`` (TrainConfig keyword arguments) with ``preset``'s settings, except those in ``explicit``."""
    if preset is None:
        return values
    if preset not in PRESETS:
        raise ValueError(f"--preset must be one of {sorted(PRESETS)}, got {preset!r}")
    return {**values, **{k: v for k, v in PRESETS[preset].items() if k not in explicit}}


def _check_paths(config: TrainConfig, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{name} must be a non-empty path or None, got {value!r}")
