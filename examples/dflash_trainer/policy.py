"""How the run's steps execute, decided once from the config and the devices.

Three modes: ``eager``; ``reduce-overhead`` (each compiled region runs as CUDAGraph Trees); and
``whole-step`` (each worker step is captured as one CUDA graph by threadgraph.capture_step, with
Inductor kernels inside and the optimizer's learning rate a device tensor). Components ask the
policy, never the config, how to compile, whether to capture and which dtypes to use.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

import threadgraph

from .config import TrainConfig
from .errors import InputError

MODES = ("eager", "reduce-overhead", "whole-step")


@dataclasses.dataclass(frozen=True)
class ExecutionPolicy:
    mode: str
    bf16: bool

    @classmethod
    def resolve(cls, config: TrainConfig, devices: list[str]) -> ExecutionPolicy:
        """``--compile auto`` compiles on CUDA only, ``--dtype auto`` is bfloat16 on CUDA only;
        CUDA graphs asked for on a CPU are an error, not a silent fallback."""
        on_cuda = devices[0].startswith("cuda")
        if config.compile == "reduce-overhead" and not on_cuda:
            raise InputError("--compile reduce-overhead needs CUDA devices (CUDA graphs); use --compile eager on a CPU")
        compiled = config.compile == "reduce-overhead" or (config.compile == "auto" and on_cuda)
        if config.cuda_graphs == "whole-step" and not compiled:
            raise InputError("--cuda-graphs whole-step needs CUDA devices and --compile auto or reduce-overhead")
        mode = "eager" if not compiled else ("whole-step" if config.cuda_graphs == "whole-step" else "reduce-overhead")
        bf16 = config.dtype == "bfloat16" or (config.dtype == "auto" and on_cuda)
        return cls(mode=mode, bf16=bf16)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {list(MODES)}, got {self.mode!r}")

    @property
    def compiles(self) -> bool:
        """Whether steps are compiled (so a first call costs a compile)."""
        return self.mode != "eager"

    @property
    def captures(self) -> bool:
        """Whether worker steps are captured whole, optimizer included (its lr a device tensor)."""
        return self.mode == "whole-step"

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        """The drafter step's autocast dtype; None runs it in float32."""
        return torch.bfloat16 if self.bf16 else None

    @property
    def target_dtype(self) -> torch.dtype:
        """The dtype the frozen target (and the drafter's borrowed embedding and head) load in."""
        return torch.bfloat16 if self.bf16 else torch.float32

    def compile(self, fn: Callable) -> Callable:
        """``fn`` as a step runs it: eager, compiled with CUDAGraph Trees, or, for whole-step
        graphs, compiled without Trees (graph() around it records the kernels)."""
        if not self.compiles:
            return fn
        if self.mode == "whole-step":
            return torch.compile(fn)
        return torch.compile(fn, mode="reduce-overhead")

    def graph(self, fn: Callable) -> Callable:
        """With whole-step graphs, ``fn`` replayed as one CUDA graph per worker; else ``fn``."""
        return threadgraph.capture_step(fn) if self.captures else fn
