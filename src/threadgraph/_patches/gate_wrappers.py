"""Where a worker takes and gives back its device gate slot inside torch (hazards
device-wide-capture, global-compile-lock, autograd-device-thread): the wrappers of the ``gate_*``
patches in ``_patches.PATCHES``. Trees' manager set-up, warm-ups, recordings and pool checkpoints
run exclusive on their device; a compile and autograd's backward give the slot back, since both
wait on things (the compile lock, autograd's device threads) that other workers' slots may hold up.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable

from threadgraph._patches import capture_lock as _capture_lock

from threadgraph._device import fence as _fence

from threadgraph._patches import first_call as _first_call

from threadgraph._patches import fx_window as _fx_window
from threadgraph._device.gate import gate_for, released
from threadgraph._device.tls import current_worker, doing


def _device_of(instance: Any, args: tuple, kwargs: dict) -> str:
    index = getattr(instance, "device_index", None)
    if index is None:  # __init__: the device index is the first argument
        index = args[0] if args else kwargs["device_index"]
    return f"cuda:{index}"


_ACTIVITY = {"warmups": "warming up CUDA graphs", "captures": "recording CUDA graphs"}


def exclusive(counter: str | None, capture_lock_first: bool = False) -> Callable:
    """``capture_lock_first``: for a call that takes torch's capture lock inside (the manager's
    set-up), take it before the gate, the order every warm-up and recording has (capture-lock-order)."""
    def wrapper(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
        device = _device_of(instance, args, kwargs)
        state = current_worker()
        lock = _capture_lock.taken_first() if capture_lock_first else contextlib.nullcontext()
        with lock, gate_for(device).exclusive(), doing(state, _ACTIVITY.get(counter, "preparing CUDA graphs")):
            started = time.perf_counter()
            recording = counter == "captures" and state is not None and not state.recording
            if counter and state is not None:
                setattr(state, counter, getattr(state, counter) + 1)
            if recording:
                state.recording = True
            try:
                return wrapped(*args, **kwargs)
            except RuntimeError as exc:
                clear = _fence.explain_broken_capture(exc, device)
                if clear is None:
                    raise
                raise clear from exc
            finally:
                if recording:
                    state.recording = False
                    state.capture_seconds += time.perf_counter() - started

    return wrapper


def release_slots(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    with released():
        return wrapped(*args, **kwargs)


def compile_frame(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    # Dynamo's frame callback: it takes the compile lock only on a cache miss, so the slots go
    # first (hazard global-compile-lock); the time is the worker's compile time.
    state = current_worker()
    frame = args[0] if args else None
    code = getattr(frame, "f_code", None)
    _first_call.note_compile()  # also for a call run uncompiled: it must not settle its code's turns
    # A miss during another thread's FX trace (its patched nn.Module.__call__ fails guards) waits
    # for it, then runs uncompiled once where cached code fits now (hazard global-fx-patcher).
    uncompiled = _fx_window.instead_of_compiling(instance, frame)
    if uncompiled is not None:
        return uncompiled
    started = time.perf_counter()  # after the wait, which counts as waiting for a peer
    with released(), _fx_window.hold_lifted(), doing(state, f"compiling {getattr(code, 'co_name', 'a frame')}"):
        try:
            return wrapped(*args, **kwargs)
        finally:
            if state is not None:
                state.compile_seconds += time.perf_counter() - started
