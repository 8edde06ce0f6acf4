"""Per-worker generations (hazard global-generation): the wrappers that keep CUDAGraph Trees'
mark-step and generation counters per worker, as upstream keeps them for the process.

A worker's mark-step counter is its own; its generation is the process counter as the worker's
own thread last moved it. Both live in the worker's ``WorkerState``, in torch's C++ stash, so its
backward on autograd's device thread reads them too. The patches that apply these are in
``_patches.PATCHES``.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from threadgraph import _compat
from threadgraph._patches import verify
from threadgraph._device.tls import bound, current_worker, worker_for_current_thread


def worker_mark_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    state = worker_for_current_thread()
    if state is None:
        return wrapped(*args, **kwargs)
    # Counts down, like upstream, to stay distinct from the generation counter.
    state.mark_step_counter -= 1
    return None


def worker_curr_generation(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    state = current_worker()
    return wrapped(*args, **kwargs) if state is None else state.current_generation()


def worker_user_mark_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    state = current_worker()
    return wrapped(*args, **kwargs) if state is None else state.mark_step_counter != 0


def take_generation() -> None:
    # The worker's generation is the process counter as its own thread last moved it: another
    # thread's compiled calls move the counter but not this worker's generation, and a user who
    # sets the counter back (upstream's tests do) is seen on the worker's next entry, as upstream.
    state = worker_for_current_thread()
    if state is not None:
        state.generation = _compat.process_generation()


BUMP_TARGET = "torch._dynamo.eval_frame:install_generation_tagging_init"


def _verified_body(original: Callable[[], None]) -> bool:
    """Whether ``original`` has the body of a verified release (its fingerprint is recorded): there,
    once it has set ``nn.Module``'s generation tagging up, a call only moves the counter by one."""
    return verify.has_verified_code(BUMP_TARGET, original)


def worker_generation_bump(original: Callable[[], None]) -> Callable[[], None]:
    """``Patch.replace`` of ``install_generation_tagging_init``, which Dynamo calls on every entry
    into a compiled frame: a plain function, not a wrapt proxy (which costs about 1 us a call there).
    With a verified release's body, it calls the original once (the tagging set-up) and from then on
    moves the counter itself, a Python frame less a call; any other body it calls every time. A
    thread bound to its worker reads it from a thread-local; the others ask the stash."""
    tracker = _compat.generation_tracker()
    verified = _verified_body(original)
    set_up = [False]

    def install_generation_tagging_init() -> None:
        if set_up[0]:
            tracker.generation += 1
        else:
            original()
            set_up[0] = verified
        state = bound.state
        if state is None:
            state = worker_for_current_thread()
            if state is None:
                return
        state.generation = tracker.generation

    install_generation_tagging_init.__threadgraph_original__ = original  # type: ignore[attr-defined]
    install_generation_tagging_init.__wrapped__ = original  # type: ignore[attr-defined]
    return install_generation_tagging_init


def generation_taken_on_entry() -> Callable[[], None]:
    # An enter hook of a Dynamo context: runs after the context's own on_enter; returns its exit.
    take_generation()
    return no_exit


def no_exit() -> None:
    return None


def worker_run_only_generation(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    # torch._dynamo.run(fn) runs cached code through RunOnlyContext, whose on_enter moves the
    # process counter itself (install_generation_tagging_init is not called there).
    result = wrapped(*args, **kwargs)
    instance.enter_exit_hooks.append(generation_taken_on_entry)
    return result


def worker_mark_step_reset(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    # Upstream zeroes the process's mark-step counter unless the calling thread has no tree state
    # (it returns early there); the calling worker's counter follows the same rule.
    had_trees = torch._C._is_key_in_tls("tree_manager_containers")
    result = wrapped(*args, **kwargs)
    state = current_worker()
    if state is not None and had_trees:
        state.mark_step_counter = 0
    return result
