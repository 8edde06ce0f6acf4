"""The eager fence: eager CUDA work in any thread waits while another thread captures.

While a thread records a CUDA graph, the device is in a state other threads' eager work breaks
(hazard ``device-wide-capture``, docs/hazards.md):

- the device's default CUDA generator is in capture mode for every capture, whether or not the
  graph draws random numbers, and rejects any increment from outside it: an eager ``torch.rand``
  in another thread raises "Offset increment outside graph capture encountered unexpectedly";
- a device synchronisation (``torch.cuda.synchronize()``) from another thread is not permitted
  while a stream of the device captures, and it invalidates the capture too.

Measured on an H200 (torch 2.11, the fence matrix of ``tests/library/test_gpu_fence.py``), the
rest of everyday eager work is safe during another thread's capture and is left alone: stream and
event synchronisation, host reads (``.item()``, ``.cpu()``, ``.tolist()``, ``.numpy()``, ``nonzero``,
printing), allocation and free, and ``torch.cuda.empty_cache()``. CUDAGraph Trees and
``capture_step`` capture with ``capture_error_mode="thread_local"``, which is what keeps those
legal in other threads.

The fence wraps the Python entry points of that work (and the ATen RNG overloads that compiled
code calls, such as Inductor's seed draw ``aten.randint.low_out``) so each call runs inside
``_gate.fenced(device)``: a shared slot of the op's device, held for that op alone. Capture
paths hold the device's gate exclusively, so a fenced op waits until the capture ends, and a
capture waits until the fenced ops in flight have returned.

Invariant: no fenced op runs on a device while another thread holds that device's gate
exclusively. Why it cannot deadlock (``_gate`` has the proof for the gate itself):

- a fenced op waits only while its thread holds nothing: a thread that holds the op's device
  shared runs at once (its slot already keeps captures out), one that holds other devices gives
  those slots up first, and one inside an exclusive section (its own warm-up or capture, also on
  autograd's device thread during a backward capture) runs at once. So a waiting fenced op is
  never a holder anyone waits for;
- an exclusive section waits only for shared holders, and a fenced op holds its slot only for
  the op itself, which waits for nothing but the GPU;
- Dynamo's compile lock: a compile may run fenced ops while holding the lock (max-autotune draws
  random inputs and synchronises). Such an op waits for a capture, and no capture waits for the
  compile lock: exclusive sections run compiled code, they do not compile, and workers queued on
  the lock hold no slots (``gate_release_in_compile``).

What it costs: nothing on the replay path (replays call none of these); on the eager path, for
an op on a CUDA device, one lock acquire and release. Ops on the CPU pass straight through.
Inside a Dynamo trace the wrappers call the original at once, so compiled graphs are unchanged.

What it does not cover: RNG and synchronisation reached from C++ without these entry points
(custom extensions, ``torch._C`` called directly). Wrap such work in
``threadgraph.outside_captures(device)``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import os
import time
import traceback
import types
from typing import Any, Callable, Iterator, Optional

import torch

from threadgraph import _torch_calls
from threadgraph._errors import CaptureConflictError
from threadgraph._device.gate import fenced, gate_for
from threadgraph._device.tls import current_worker

# Python entry points that draw from a CUDA generator: (owner module path, attribute).
RNG_FUNCTIONS = {
    "torch": ("rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal",
              "bernoulli", "multinomial", "poisson", "binomial", "dropout", "alpha_dropout", "feature_dropout",
              "feature_alpha_dropout", "native_dropout", "rrelu"),
    "torch.nn.functional": ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout",
                            "feature_alpha_dropout", "rrelu"),
}
RNG_TENSOR_METHODS = ("uniform_", "normal_", "bernoulli_", "bernoulli", "exponential_", "random_", "geometric_",
                      "log_normal_", "cauchy_", "multinomial")
# ATen packets whose overloads compiled code and decompositions call through torch.ops.
RNG_ATEN_PACKETS = ("rand", "rand_like", "randn", "randn_like", "randint", "randint_like", "randperm", "normal",
                    "normal_", "uniform", "uniform_", "bernoulli", "bernoulli_", "exponential", "exponential_",
                    "random", "random_", "geometric_", "log_normal_", "cauchy_", "multinomial", "native_dropout",
                    "poisson", "binomial", "_standard_gamma", "rrelu_with_noise", "_fused_dropout")


def _device_index(device: Any) -> Optional[int]:
    """The CUDA ordinal a ``device=`` argument names, or None for any other device."""
    if isinstance(device, torch.device):
        if device.type != "cuda":
            return None
        return torch.cuda.current_device() if device.index is None else device.index
    if isinstance(device, str):
        return _device_index(torch.device(device)) if device.startswith("cuda") else None
    if isinstance(device, int) and not isinstance(device, bool):
        return device  # torch reads a bare int as a CUDA ordinal
    return None


def _tensor_index(value: Any) -> Optional[int]:
    # Only real tensors: fake and functional tensors (subclasses) are a trace, not device work.
    if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:
        return value.get_device() if value.is_cuda else None
    return None


def op_device(args: tuple, kwargs: dict) -> Optional[int]:
    """The CUDA ordinal an RNG call works on: ``device=``, else its first tensor, else the default device."""
    if "device" in kwargs and kwargs["device"] is not None:
        return _device_index(kwargs["device"])
    for value in args:
        if isinstance(value, torch.Tensor):
            return _tensor_index(value)
    for value in kwargs.values():
        if isinstance(value, torch.Tensor):
            return _tensor_index(value)
    return _device_index(_torch_calls.default_device())


def _fence_on(index: Optional[int]) -> contextlib.AbstractContextManager:
    return contextlib.nullcontext() if index is None else fenced(f"cuda:{index}")


# One wrapper per (original, rule) for the life of the process: a second install() puts the same
# object back, and TorchScript's builtin table (keyed by id) never sees a freed wrapper's id.
_wrappers: dict[tuple[int, Any], Callable] = {}
_wrapped_originals: list[Callable] = []  # keeps the ids in ``_wrappers`` from being reused


def fenced_function(original: Callable, where: Callable[[tuple, dict], Optional[int]] = op_device) -> Callable:
    """A plain function (not a proxy, so Dynamo inlines it) that runs ``original`` inside the fence."""
    key = (id(original), where)
    if key not in _wrappers:
        _wrapped_originals.append(original)
        _wrappers[key] = _make_fenced(original, where)
        _torch_calls.alias_torchscript_builtin(original, _wrappers[key])
    return _wrappers[key]


def _make_fenced(original: Callable, where: Callable[[tuple, dict], Optional[int]]) -> Callable:
    # Under a fake mode (a compile's make_fx trace) an op on tensors is traced, not run: waiting for
    # another thread's capture there would stall the compile, and a capturing thread that waits
    # for that compile's trace (fx_trace_window) would wait for a thread that waits for it. A
    # device synchronize is real under any mode.
    faking = _torch_calls.in_fake_mode if where is op_device else (lambda: False)
    is_tracing, fence = _torch_calls.is_dynamo_compiling, fenced  # closure cells, not globals: see below

    def fenced_call(*args: Any, **kwargs: Any) -> Any:
        # Dynamo folds is_tracing() to True and traces the original, unchanged.
        if is_tracing() or faking():
            return original(*args, **kwargs)
        index = where(args, kwargs)
        if index is None:  # not CUDA work: nothing to order
            return original(*args, **kwargs)
        with fence(f"cuda:{index}"):
            return original(*args, **kwargs)

    if inspect.isfunction(original):
        # TorchScript compiles a Python function from its source (found through __wrapped__) but
        # resolves its names in the wrapper's globals: give the wrapper the original's.
        fenced_call = types.FunctionType(fenced_call.__code__, original.__globals__, original.__name__,
                                         fenced_call.__defaults__, fenced_call.__closure__)
    functools.update_wrapper(fenced_call, original)
    fenced_call.__threadgraph_original__ = original
    return fenced_call


class FencedOp:
    """The fence around an ATen overload's ``_op`` (what ``OpOverload.__call__`` calls), hashing as
    the original does.

    ``OpOverload.__hash__`` is ``hash(self._op)``, and Inductor's lowering table, the
    decomposition tables and the fallback sets are dicts and sets keyed by overloads: a
    replacement that hashed as itself would hide every entry made before ``install()`` (Inductor
    then finds no lowering for ``aten.rand.default`` under ``fallback_random``) and every entry
    made under it after ``uninstall()``. So the replacement is an object whose hash is the
    original's, and overloads hash the same whether or not the fence is in place.
    """


    def __init__(self, original: Callable) -> None:
        self._call = _make_fenced(original, op_device)
        self.__threadgraph_original__ = self.__wrapped__ = original
        self.__name__ = getattr(original, "__name__", "op")
        self.__qualname__ = getattr(original, "__qualname__", self.__name__)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __hash__(self) -> int:
        return hash(self.__threadgraph_original__)

    def __eq__(self, other: Any) -> bool:
        return other is self or other is self.__threadgraph_original__

    def __repr__(self) -> str:
        return f"<threadgraph fence around {self.__threadgraph_original__!r}>"


_fenced_ops: dict[int, FencedOp] = {}


def fenced_op(original: Callable) -> FencedOp:
    """The one :class:`FencedOp` of ``original`` for the life of the process (as ``fenced_function``)."""
    if id(original) not in _fenced_ops:
        _wrapped_originals.append(original)
        _fenced_ops[id(original)] = FencedOp(original)
    return _fenced_ops[id(original)]


def _current_or(device: Any) -> Optional[int]:
    if device is None:
        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    return _device_index(device if not isinstance(device, int) else torch.device("cuda", device))


def synchronize_device(args: tuple, kwargs: dict) -> Optional[int]:
    """``torch.cuda.synchronize(device=None)``: the device it names, else the current one."""
    return _current_or(args[0] if args else kwargs.get("device"))


def fenced_synchronize(original: Callable) -> Callable:
    return fenced_function(original, synchronize_device)


def aten_rng_targets() -> list[str]:
    """``torch:ops.aten.<packet>.<overload>._op`` for every RNG overload this torch has."""
    targets = []
    for name in RNG_ATEN_PACKETS:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            targets.append(f"torch:ops.aten.{name}.{'default' if overload == '' else overload}._op")
    return targets


def rng_function_targets() -> list[str]:
    targets = []
    for module_path, names in RNG_FUNCTIONS.items():
        module = _torch_calls.import_module(module_path)
        targets += [f"{module_path}:{name}" for name in names if callable(getattr(module, name, None))]
    targets += [f"torch:Tensor.{name}" for name in RNG_TENSOR_METHODS if hasattr(torch.Tensor, name)]
    return targets


@contextlib.contextmanager
def outside_captures(device: Any = None) -> Iterator[None]:
    """A context manager: run a block of eager CUDA work outside every capture on a device.

    For work the fence does not see (C++ extensions, ``torch._C`` called directly): it waits
    while another thread warms up or records on the device, and holds captures off until the
    block ends. Keep the block short and free of waits on other threads. On a CPU device it
    does nothing.

    Args:
        device: The device (``"cuda:0"``, a ``torch.device``, an index); None: the current one.
    """
    with _fence_on(_current_or(device)):
        yield


def capture_begin_exclusive(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """``CUDAGraph.capture_begin``: take the device exclusively until ``capture_end`` (any capture,
    also one a user makes by hand, is then ordered against fenced work and other captures)."""
    gate = gate_for(f"cuda:{torch.cuda.current_device()}")
    gate.acquire_exclusive()
    try:
        result = wrapped(*args, **kwargs)
    except BaseException:
        gate.release_exclusive()
        raise
    instance._threadgraph_capture_gate = gate
    instance._threadgraph_capture_began = time.perf_counter()
    return result


def capture_end_exclusive(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    gate = getattr(instance, "_threadgraph_capture_gate", None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        if gate is not None:
            instance._threadgraph_capture_gate = None
            gate.release_exclusive()
            _count_capture(time.perf_counter() - instance._threadgraph_capture_began)


def _count_capture(seconds: float) -> None:
    # A capture of the calling worker's own (capture_step, a hand capture). Trees record through
    # their manager, whose record_function counts them instead; its captures begin inside it.
    state = current_worker()
    if state is not None and not state.recording:
        state.captures += 1
        state.capture_seconds += seconds


# What the CUDA errors of a capture conflict say, and what kind of work each one means.
_BYSTANDER_SIGNS = {
    "Offset increment outside graph capture": "a random-number draw on the device's default CUDA generator",
    "operation not permitted when stream is capturing": "a device-wide synchronisation",
}
_CAPTURE_BROKEN_SIGN = "operation failed due to a previous error during capture"
_LIBRARY_DIRS = (os.path.dirname(torch.__file__), os.path.dirname(__file__))


def _innermost_user_line(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith(_LIBRARY_DIRS)]
    if not frames:
        return "an op inside torch"
    f = frames[-1]
    return f"{(f.line or '').strip() or f.name} ({os.path.basename(f.filename)}:{f.lineno})"


def explain_broken_capture(exc: BaseException, device: Any) -> Optional[CaptureConflictError]:
    """For a capture path: a clear error if another thread's work broke this capture, else None."""
    return explain_capture_conflict(exc, device) if _CAPTURE_BROKEN_SIGN in str(exc) else None


def clear_capture_conflict(exc: BaseException, device: Any) -> BaseException:
    """A worker's failure as it is reported: the CUDA error of a capture conflict, explained (the
    original as cause); anything else, or anything on the CPU, as it is."""
    if torch.device(device).type != "cuda":
        return exc
    clear = explain_capture_conflict(exc, device)
    if clear is None:
        return exc
    clear.__cause__ = exc
    return clear


def explain_capture_conflict(exc: BaseException, device: Any) -> Optional[CaptureConflictError]:
    """A clear error for a CUDA error that another thread's capture caused, or None if it is not one."""
    text = str(exc)
    device_name = str(device)
    holder = gate_for(device_name).last_exclusive
    for sign, kind in _BYSTANDER_SIGNS.items():
        if sign in text:
            op = _innermost_user_line(exc)
            return CaptureConflictError(
                f"threadgraph: {op} is {kind} that ran while thread {holder!r} captured a CUDA graph on "
                f"{device_name}, and threadgraph's fence did not see it (it orders torch's Python entry points "
                "only). Wrap that work in `with threadgraph.outside_captures():`, or call it through torch's "
                "public functions after threadgraph.install()",
                device=device_name, capturing_thread=holder, op=op)
    if _CAPTURE_BROKEN_SIGN in text:
        return CaptureConflictError(
            f"threadgraph: a CUDA graph capture on {device_name} was broken by CUDA work of another thread that "
            "threadgraph does not order (a device synchronisation or a capture made outside torch.cuda.graph). "
            "Wrap such work in `with threadgraph.outside_captures():`; the process's CUDA state may now be "
            "unusable, so restart it",
            device=device_name, capturing_thread=holder, op="a capture")
    return None
