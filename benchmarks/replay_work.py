"""What one cell of ``replay_step_time.py`` steps: the workloads (the small launch-bound MLP, the
DFlash drafter's training step on static random inputs) and the step each mode makes of them."""

from __future__ import annotations

import dataclasses
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from . import common

MODES = ("eager", "compile", "reduce-overhead", "whole-step")
CPU_MODES = ("eager", "compile")
TASKS = ("train", "infer")
_BUILD_LOCK = threading.Lock()


@dataclasses.dataclass
class Work:
    module: torch.nn.Module
    train_fn: Callable  # (*train_inputs) -> loss, or (loss, ...)
    train_inputs: tuple
    infer_fn: Callable  # (*infer_inputs) -> outputs
    infer_inputs: tuple
    make_opt: Callable[[bool], torch.optim.Optimizer]  # capturable -> optimizer


def small_work(device: torch.device, seed: int) -> Work:
    width, depth = (common.WIDTH, common.DEPTH) if device.type == "cuda" else (common.CPU_WIDTH, common.CPU_DEPTH)
    model = common.small_model(seed, device, width, depth)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(common.BATCH, width, generator=g).to(device, dtype)
    y = torch.randn(common.BATCH, width, generator=g).to(device, dtype)
    return Work(model, lambda x, y: F.mse_loss(model(x), y), (x, y), lambda x: model(x), (x,),
                lambda capturable: torch.optim.SGD(model.parameters(), lr=1e-3))


DFLASH_SIZES = {  # the drafter training step of examples/dflash_trainer, static random inputs
    "cuda": dict(hidden=1024, heads=8, kv_heads=4, head_dim=128, intermediate=3072, vocab=32000, layers=8,
                 batch=4, seq=512, anchors=32, block=16),
    "cpu": dict(hidden=128, heads=4, kv_heads=2, head_dim=32, intermediate=256, vocab=1024, layers=8,
                batch=2, seq=64, anchors=4, block=8),
}


def _qwen3_config(s: dict):
    kw = dict(hidden_size=s["hidden"], num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
              head_dim=s["head_dim"], intermediate_size=s["intermediate"], vocab_size=s["vocab"],
              num_hidden_layers=s["layers"])
    try:
        from transformers import Qwen3Config

        return Qwen3Config(**kw)
    except ImportError:  # from_target_config only reads attributes
        return __import__("types").SimpleNamespace(rms_norm_eps=1e-6, rope_theta=1e6, **kw)


def dflash_work(device: torch.device, seed: int) -> Work:
    from examples.dflash_trainer.config import TrainConfig
    from examples.dflash_trainer.drafter.loss import sample_anchors
    from examples.dflash_trainer.drafter.model import DFlashDrafter
    from examples.dflash_trainer.drafter.step import make_step_fn

    common.allow_recompiles()
    s = DFLASH_SIZES[device.type]
    cfg = TrainConfig(block_size=s["block"], num_anchors=s["anchors"], seq_len=s["seq"], batch_size=s["batch"])
    n, cuda = cfg.num_feature_layers, device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    with _BUILD_LOCK:  # one model at a time; weights only need to be sane, the cell measures time
        torch.manual_seed(seed)
        embed = torch.nn.Embedding(s["vocab"], s["hidden"])
        lm_head = torch.nn.Linear(s["hidden"], s["vocab"], bias=False)
        drafter = DFlashDrafter.from_target_config(_qwen3_config(s), embed, lm_head, cfg.num_draft_layers, n,
                                                   generator=torch.Generator().manual_seed(seed))
    embed.to(device, dtype).requires_grad_(False)  # Module.to is in place: the drafter sees the moved ones
    lm_head.to(device, dtype).requires_grad_(False)
    drafter.to(device)
    g = torch.Generator().manual_seed(1000 + seed)
    ids = torch.randint(0, s["vocab"] - 1, (s["batch"], s["seq"]), generator=g)
    loss_mask = torch.ones_like(ids)
    features = torch.randn(s["batch"], s["seq"], n * s["hidden"], generator=g).to(dtype)
    anchors, keep = sample_anchors(loss_mask, s["anchors"], g)
    inputs = tuple(t.to(device) for t in (ids, loss_mask, features, anchors, keep))
    fn = make_step_fn(drafter, block_size=s["block"], gamma=cfg.gamma_value, mask_token_id=s["vocab"] - 1,
                      autocast_dtype=torch.bfloat16 if cuda else None)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def make_opt(capturable: bool) -> torch.optim.Optimizer:
        return torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), capturable=capturable and cuda)

    return Work(drafter, fn, inputs, fn, inputs, make_opt)


def _loss(out):
    return out[0] if isinstance(out, tuple) else out


def make_step(mode: str, task: str, work: Work, whole_step_inner: str = "eager") -> Callable[[], object]:
    """A no-argument step on static inputs; built in the thread that will run it."""
    compile_mode = {"compile": None, "reduce-overhead": "reduce-overhead"}.get(mode)
    if task == "infer":
        work.module.eval()
        infer_fn, inputs = work.infer_fn, work.infer_inputs

        def forward(*args):
            with torch.no_grad():
                return infer_fn(*args)

        if mode == "whole-step":
            import threadgraph

            inner = torch.compile(forward) if whole_step_inner == "compile" else forward
            graph = threadgraph.capture_step(inner)
            return lambda: graph(*inputs)
        fn = forward if mode == "eager" else torch.compile(forward, mode=compile_mode)
        return lambda: fn(*inputs)

    train_fn, inputs = work.train_fn, work.train_inputs
    opt = work.make_opt(mode == "whole-step")
    if mode == "whole-step":
        import threadgraph

        inner = torch.compile(train_fn) if whole_step_inner == "compile" else train_fn

        def train_step(*args):
            loss = _loss(inner(*args))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            return loss.detach()

        graph = threadgraph.capture_step(train_step)
        return lambda: graph(*inputs)
    fn = train_fn if mode == "eager" else torch.compile(train_fn, mode=compile_mode)

    def step():
        loss = _loss(fn(*inputs))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


@dataclasses.dataclass
class Plan:
    model: str
    mode: str
    task: str
    warmup: int
    steps: int
    profile: int  # steps of the GPU-busy window after the timed steps (0 = none)
    whole_step_inner: str

    def build(self, device: torch.device, seed: int) -> Callable[[], object]:
        work = (dflash_work if self.model == "dflash" else small_work)(device, seed)
        return make_step(self.mode, self.task, work, self.whole_step_inner)
