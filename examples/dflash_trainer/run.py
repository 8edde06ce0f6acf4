"""Everything the workers of one training process share: data, placement, schedule, hand-off,
and the leader's duties (metrics, evaluation, checkpoints) that drafter 0 performs."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from .checkpoint import latest_checkpoint, load_checkpoint, read_state, save_checkpoint
from .config import TrainConfig
from .data import SampleStream, TokenData, read_jsonl
from .eval import acceptance_length, repeat_last_token
from .metrics import MetricsLogger
from .placement import Placement
from .routing import GradientAverager, OrderedInbox
from .step import METRIC_NAMES, capture_graph, captures, compile_fn
from .target import TargetModel

log = logging.getLogger("dflash")
LOG_EVERY = 10
# Fields that must match between a checkpoint and the run resuming from it.
RESUME_KEYS = ("target", "data", "seq_len", "block_size", "num_anchors", "num_draft_layers", "num_target_layers_used",
               "batch_size", "drafters", "seed", "lr", "epochs", "max_steps")


class TrainingDiverged(FloatingPointError):
    """The loss or gradient norm became NaN or infinite."""


class Run:
    def __init__(self, config: TrainConfig, placement: Placement, *, target_dir: str, train_jsonl: str,
                 compiled: bool, progress: Optional[Callable[[dict], None]] = None) -> None:
        self.config, self.placement = config, placement
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self.target_dir = target_dir
        self.compiled = compiled
        self.progress = progress
        target_shape = TargetModel.shape_only(target_dir, num_feature_layers=config.num_feature_layers)
        self.target_config = target_shape.config
        self.tokenizer = target_shape.tokenizer
        self.mask_token_id = target_shape.mask_token_id
        self.data: TokenData = read_jsonl(train_jsonl, tokenizer=self.tokenizer, seq_len=config.seq_len,
                                          vocab_size=target_shape.vocab_size)
        self.eval_prompts: list[torch.Tensor] = []  # set by the entry point
        per_step = config.batch_size * config.drafters * self.world
        steps_per_epoch = max(1, len(self.data) // per_step)
        self.total_steps = config.max_steps or steps_per_epoch * config.epochs
        self.warmup_steps = max(1, round(config.warmup_ratio * self.total_steps))
        self.out_dir = Path(config.out_dir)
        self.checkpoint_dir = self.out_dir / "checkpoints"
        self.resume_path = self._resume_path()
        self.start_step = self._peek_step(self.resume_path) if self.resume_path else 0
        self.inboxes = [
            OrderedInbox(first_index=self.start_step * config.drafters + d, stride=config.drafters,
                         capacity=config.channel_capacity)
            for d in range(config.drafters)
        ]
        self.averager = GradientAverager(config.drafters)
        use_bf16 = config.bf16_on(placement.drafters[0].startswith("cuda"))
        self.autocast_dtype = torch.bfloat16 if use_bf16 else None
        self.target_dtype = torch.bfloat16 if use_bf16 else torch.float32
        self.metrics = MetricsLogger(self.out_dir / "metrics.jsonl") if self.rank == 0 else None
        self.results: dict[str, Any] = {"rank": self.rank, "world": self.world, "total_steps": self.total_steps,
                                        "start_step": self.start_step}
        # Setups build models, which sets process-global state (transformers sets torch's default
        # dtype while it builds one): threadgraph.WorkerGroup runs them one at a time, before any
        # step. Seeded draws from the global generator are not safe even so (every Dynamo compile
        # rewinds it): drafter init uses a private generator.
        self.eval_target: Optional[TargetModel] = None
        self._leader = None
        self._logged = self.start_step
        self._steady_tokens, self._steady_seconds = 0, 0.0
        self._last_log_time = time.perf_counter()

    # -- used by the workers --------------------------------------------------------------------
    def compile(self, fn: Callable) -> Callable:
        return compile_fn(fn, compiled=self.compiled, cuda_graphs=self.config.cuda_graphs)

    @property
    def captures(self) -> bool:
        return captures(compiled=self.compiled, cuda_graphs=self.config.cuda_graphs)

    def graph(self, fn: Callable) -> Callable:
        return capture_graph(fn, compiled=self.compiled, cuda_graphs=self.config.cuda_graphs)

    def load_target(self, device: torch.device) -> TargetModel:
        return TargetModel.from_pretrained(self.target_dir, num_feature_layers=self.config.num_feature_layers,
                                           dtype=self.target_dtype, device=device)

    def load_frozen_heads(self, device: torch.device):
        target = self.load_target(device)
        return target.embed_tokens, target.lm_head

    def sample_stream(self, shard: int, num_shards: int) -> SampleStream:
        return SampleStream(self.data, self.config.batch_size, seed=self.config.seed, shard=shard,
                            num_shards=num_shards, rank=self.rank, world_size=self.world)

    def anchor_seed(self, batch_index: int) -> int:
        return (self.config.seed * 1_000_003 + self.rank * 10_007 + batch_index) % 2**62

    def lr_lambda(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    def restore(self, drafter, optimizer, scheduler) -> None:
        if self.resume_path is not None:
            load_checkpoint(self.resume_path, drafter, optimizer, scheduler)

    def fail(self, error: BaseException) -> None:
        """Wake every worker blocked on the hand-off or the gradient barrier."""
        for inbox in self.inboxes:
            inbox.fail(error)
        self.averager.abort(error)

    # -- leader (drafter 0) -----------------------------------------------------------------------
    def leader_setup(self, worker) -> None:
        self._leader = worker
        if self.rank == 0 and self.config.eval_every and self.start_step == 0:
            self.results["baseline"] = self.evaluate(worker, baseline=True)

    def leader_after_step(self, worker, done: int) -> None:
        cfg = self.config
        last = done == self.total_steps
        leader = self.rank == 0
        due_eval = leader and cfg.eval_every and (done % cfg.eval_every == 0 or last)
        due_save = leader and ((cfg.checkpoint_every and done % cfg.checkpoint_every == 0) or last)
        if done - self._logged >= LOG_EVERY or last or due_eval or due_save:
            self._log(worker, done)
        if due_eval:
            self.results["eval"] = self.evaluate(worker)
            self._record({"step": done, **{f"eval_{k}": v for k, v in self.results["eval"].items() if k != "accepted_hist"}})
        if due_save:
            self.save(worker, done)
        if due_eval or due_save:  # tokens/s counts training, not evaluation or saving
            self._last_log_time = time.perf_counter()

    def _log(self, worker, done: int) -> None:
        rows = worker.history[self._logged:done].tolist()  # one host sync per LOG_EVERY steps
        now = time.perf_counter()
        for offset, row in enumerate(rows):
            step = self._logged + offset + 1
            if not all(math.isfinite(v) for v in row):
                raise TrainingDiverged(
                    f"step {step}: loss or gradient norm is not finite ({dict(zip(METRIC_NAMES + ('grad_norm',), row))}); "
                    f"lower --lr (now {self.config.lr}) or check the data; resume from {self.checkpoint_dir} if a checkpoint exists"
                )
        tokens = len(rows) * self.config.batch_size * self.config.seq_len * self.config.drafters * self.world
        tokens_per_s = tokens / max(now - self._last_log_time, 1e-9)
        last_row = dict(zip(METRIC_NAMES + ("grad_norm",), rows[-1]))
        record = {"step": done, **last_row, "lr": self.config.lr * self.lr_lambda(done - 1), "tokens_per_s": tokens_per_s}
        self.results["last"] = record
        if self._logged >= LOG_EVERY:  # the first interval holds compilation and warmup
            self._steady_tokens += tokens
            self._steady_seconds += now - self._last_log_time
            self.results["tokens_per_s_steady"] = self._steady_tokens / self._steady_seconds
        self.results.setdefault("losses", []).extend(r[0] for r in rows)
        self._record(record)
        self._logged, self._last_log_time = done, now

    def _record(self, record: dict) -> None:
        if self.metrics is not None:
            self.metrics.log(**record)
        if self.progress is not None:
            self.progress(record)

    def evaluate(self, worker, baseline: bool = False) -> dict:
        """Acceptance length tau of the drafter (and, for the baseline, of trivial proposers)."""
        if not self.eval_prompts:
            return {}
        cfg = self.config
        args = (self.eval_prompts, cfg.block_size, cfg.eval_max_new_tokens, self.mask_token_id)
        stops = [t for t in (self.tokenizer.eos_token_id,) if t is not None] if self.tokenizer is not None else []
        with torch.autocast(worker.device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None):
            result = acceptance_length(self.eval_target, worker.drafter, *args, stop_token_ids=stops)
            if baseline:
                repeat = acceptance_length(self.eval_target, repeat_last_token, *args, stop_token_ids=stops)
                return {"tau_random_init": result["tau"], "tau_repeat_last_token": repeat["tau"]}
        return {"tau": result["tau"], "steps": result["steps"], "accepted_hist": result["accepted_hist"]}

    def save(self, worker, done: int) -> Path:
        path = save_checkpoint(self.checkpoint_dir, done, worker.drafter, worker.optimizer, worker.scheduler,
                               {"step": done, "batches_consumed": done * self.config.drafters},
                               {"config": json.dumps(self.config.to_dict())})
        self.results["checkpoint"] = str(path)
        return path

    def save_on_interrupt(self) -> Optional[Path]:
        """After Ctrl-C: checkpoint what the leader completed (its step boundary is consistent)."""
        worker = self._leader
        if worker is None or self.rank != 0 or worker.step_index == self.start_step:
            return None
        return self.save(worker, worker.step_index)

    # -- resume -----------------------------------------------------------------------------------
    def _resume_path(self) -> Optional[Path]:
        if not self.config.resume:
            return None
        path = latest_checkpoint(self.checkpoint_dir)
        if path is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.checkpoint_dir}; run without --resume to start fresh")
        return path

    def _peek_step(self, path: Path) -> int:
        state = read_state(path)
        saved = json.loads(state.get("extra", {}).get("config", "{}"))
        mine = self.config.to_dict()
        differ = {k: (saved.get(k), mine[k]) for k in RESUME_KEYS if k in saved and saved[k] != mine[k]}
        if differ:
            raise ValueError(f"--resume: checkpoint {path} was written with different settings {differ} (saved, now); "
                             "resume with the same settings or use a new --out-dir")
        return int(state["step"])
