"""Whole-step graphs: one worker's entire training step (forward, loss, backward, optimizer,
gradient zeroing) captured as ONE CUDA graph and replayed.

CUDAGraph Trees replays per compiled region and keeps Python bookkeeping per call, under the
GIL; a replayed whole step costs one ``cudaGraphLaunch`` (the binding releases the GIL) plus
one op for the input copies. Warmup and capture run on the step's own stream; the capture
records into its own private memory pool while holding the device gate exclusively, so no other
worker's CUDA work overlaps it (hazard device-wide-capture). Warmup is ordinary device work and holds only the
caller's shared slot, so a long first compile does not stop the other workers on the device.
Backward inside the capture runs on autograd's device thread; the capture is stream-based, so
those kernels are recorded too.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Optional

import torch

from threadgraph._torch_calls import copy_all_
from threadgraph._errors import ThreadgraphError, ThreadgraphWarning, UsageError
from threadgraph._patches.fx_window import windows_held_off
from threadgraph._device.gate import gate_for

log = logging.getLogger("threadgraph")

FALLBACKS = ("raise", "uncaptured")


class CaptureError(ThreadgraphError):
    """The step could not be captured as one CUDA graph; the message names the cause."""


_HINTS = (
    ("operation not permitted when stream is capturing", "a host synchronisation (e.g. .item(), .cpu(), print of a tensor, torch.cuda.synchronize) or a data-dependent shape (nonzero, boolean indexing)"),
    ("cudaErrorStreamCaptureUnsupported", "a host synchronisation or an unsupported CUDA call"),
    ("Offset increment outside graph capture", "random numbers drawn by another thread during capture"),
    ("capturable", "an optimizer that is not capturable: pass capturable=True (Adam, AdamW) or use SGD"),
)


def _explain(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    for needle, hint in _HINTS:
        if needle in text:
            return f"{text}\n  likely cause: {hint}"
    return text


class StepGraph:
    """A step function replayed as one CUDA graph. Build it with :func:`capture_step`.

    Call it as the step function itself: ``step(*tensors)`` returns what the function returns
    (after the capture: the same static tensors, overwritten by each call).

    Attributes:
        fn: The step function.
        warmup_steps: Calls run uncaptured before the capture.
        fallback: ``"raise"`` or ``"uncaptured"`` (see :func:`capture_step`).
        calls: Calls so far.
        graph: The captured ``torch.cuda.CUDAGraph``, or None before the capture (or without one).
        uncaptured_reason: Why the step runs uncaptured (``fallback="uncaptured"``), or None.
    """

    def __init__(self, fn: Callable[..., Any], *, warmup_steps: int = 3, fallback: str = "raise") -> None:
        if fallback not in FALLBACKS:
            raise UsageError(f"threadgraph: fallback must be one of {FALLBACKS}, got {fallback!r}")
        if warmup_steps < 1:
            raise UsageError("threadgraph: capture_step needs warmup_steps >= 1 (optimizer state and "
                             "compiled kernels must exist before capture)")
        self.fn = fn
        self.warmup_steps = warmup_steps
        self.fallback = fallback
        self.calls = 0
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.uncaptured_reason: Optional[str] = None
        self._static_inputs: Optional[tuple] = None
        self._static_output: Any = None
        self._stream: Optional[torch.cuda.Stream] = None
        self._device: Optional[torch.device] = None

    @property
    def captured(self) -> bool:
        """Whether the step was captured and now replays."""
        return self.graph is not None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        """Run one step: a warmup call, the capture, or a replay with ``inputs`` copied in.

        Raises:
            CaptureError: The step cannot be captured (no GPU, CPU inputs, a failed capture) and
                ``fallback`` is ``"raise"``, or the inputs do not fit the capture (not tensors,
                on several devices, another count, shape or dtype than captured).
        """
        self.calls += 1
        if self.uncaptured_reason is not None:
            return self.fn(*inputs)
        if self.graph is not None:
            return self._replay(inputs)
        self._check_inputs(inputs)
        if self.uncaptured_reason is not None:  # no GPU, or CPU inputs, with fallback="uncaptured"
            return self.fn(*inputs)
        if self.calls <= self.warmup_steps:  # ordinary device work (and compiles): no exclusivity,
            return self._warmup(inputs)      # so other workers keep running while this one warms up
        # No FX trace may start in another thread meanwhile: it would make the step miss its
        # compiled code and compile inside the capture (hazard global-fx-patcher).
        with windows_held_off(), gate_for(str(self._device)).exclusive():
            return self._capture(inputs)

    # -- phases ---------------------------------------------------------------------------
    def _check_inputs(self, inputs: tuple) -> None:
        devices = {t.device for t in inputs if isinstance(t, torch.Tensor)}
        bad = [type(t).__name__ for t in inputs if not isinstance(t, torch.Tensor)]
        if bad:
            raise CaptureError(f"threadgraph: capture_step inputs must be tensors (copied into static buffers); got {bad}. "
                               "Close over other values in the step function instead")
        if not torch.cuda.is_available():  # before the inputs' devices: without a GPU, moving them cannot help
            self._not_capturable(
                f"threadgraph: capture_step needs a CUDA GPU (a whole step is captured as a CUDA graph), but torch "
                f"{torch.__version__} sees none (CUDA build: {torch.version.cuda}). Run it on a GPU machine"
            )
            return
        if len(devices) > 1:
            raise CaptureError(f"threadgraph: capture_step inputs must all be on one CUDA device; got {sorted(map(str, devices))}. "
                               "Move them with .to(device) first")
        if any(d.type != "cuda" for d in devices):
            self._not_capturable(f"threadgraph: capture_step inputs must be on a CUDA device; got {devices.pop()}. "
                                 "Move them with .to(device) first (CPU tensors cannot be captured)")
            return
        device = devices.pop() if devices else torch.device("cuda", torch.cuda.current_device())
        if self._device is None:
            self._device = device
            self._stream = torch.cuda.Stream(device)
        elif device != self._device:
            raise CaptureError(f"threadgraph: this step graph lives on {self._device}, but got inputs on {device}")

    def _not_capturable(self, message: str, cause: Optional[BaseException] = None) -> None:
        """Raise CaptureError, or with ``fallback="uncaptured"`` log, warn and run uncaptured from now on."""
        if self.fallback == "raise":
            raise CaptureError(message + "\n  pass fallback='uncaptured' to run it uncaptured instead") from cause
        self.uncaptured_reason = message
        log.warning("%s; running it uncaptured from now on", message)
        warnings.warn(message, ThreadgraphWarning, stacklevel=4)

    def _on_side_stream(self, fn: Callable[[], Any]) -> Any:
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            out = fn()
        torch.cuda.current_stream().wait_stream(self._stream)
        return out

    def _warmup(self, inputs: tuple) -> Any:
        # Warm up on the side stream, as torch.cuda.graphs recommends: lazy state (optimizer
        # moments, cuBLAS workspaces, compiled kernels, AccumulateGrad streams) is created here.
        return self._on_side_stream(lambda: self.fn(*inputs))

    def _capture(self, inputs: tuple) -> Any:
        self._static_inputs = tuple(t.clone() for t in inputs)
        graph = torch.cuda.CUDAGraph()
        try:
            torch.cuda.synchronize(self._device)  # safe: we hold the device exclusively
            with torch.cuda.graph(graph, stream=self._stream, capture_error_mode="thread_local"):
                self._static_output = self.fn(*self._static_inputs)
        except Exception as exc:
            self._static_inputs = self._static_output = None
            self._not_capturable(f"threadgraph: the step could not be captured as one CUDA graph: {_explain(exc)}", exc)
            return self.fn(*inputs)
        self.graph = graph
        log.debug("threadgraph: captured a whole step on %s", self._device)
        return self._replay(inputs)

    def _replay(self, inputs: tuple) -> Any:
        if len(inputs) != len(self._static_inputs):
            raise CaptureError(f"threadgraph: the step was captured with {len(self._static_inputs)} inputs, got {len(inputs)}")
        for static, new in zip(self._static_inputs, inputs):
            if static.shape != new.shape or static.dtype != new.dtype:
                raise CaptureError(
                    f"threadgraph: a captured step has fixed input shapes; got {tuple(new.shape)} {new.dtype}, "
                    f"captured {tuple(static.shape)} {static.dtype}. Pad inputs to one shape, or build one step graph per shape"
                )
        copy_all_(self._static_inputs, inputs)
        self.graph.replay()
        return self._static_output


def capture_step(fn: Callable[..., Any], *, warmup_steps: int = 3, fallback: str = "raise") -> StepGraph:
    """Turn a whole training step into one replayed CUDA graph.

    ``fn(*tensors)`` must be capturable: fixed shapes, no host syncs (``.item()``), CUDA tensors
    only, a capturable optimizer (SGD; Adam/AdamW with ``capturable=True``), gradients zeroed with
    ``zero_grad(set_to_none=False)``, learning-rate schedules as device tensors. Compiled regions
    inside must not use CUDAGraph Trees (use ``torch.compile`` default mode). The first
    ``warmup_steps`` calls run uncaptured; the next one captures; later ones copy the inputs into
    static buffers and replay. Outputs are static tensors, overwritten by the next call: clone
    what you keep.

    Args:
        fn: The step function; its arguments are tensors, copied into static buffers each call.
        warmup_steps: Calls to run uncaptured before the capture (at least 1: optimizer state
            and compiled kernels must exist before it).
        fallback: What to do with a step that cannot be captured (the capture fails, there is no
            GPU, or the inputs are on the CPU): ``"raise"`` raises :class:`CaptureError`;
            ``"uncaptured"`` logs and warns once, then runs the step uncaptured from then on.

    Returns:
        The :class:`StepGraph` to call instead of ``fn``.

    Raises:
        UsageError: ``fallback`` or ``warmup_steps`` is not one the function takes (also a ValueError).
    """
    return StepGraph(fn, warmup_steps=warmup_steps, fallback=fallback)
