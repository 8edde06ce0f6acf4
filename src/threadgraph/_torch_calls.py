"""Calls into torch's internals that threadgraph's wrappers make while they run, each made the way
the running release allows: the default device, TorchScript's builtin table, Dynamo's cached trace
rules, whether Dynamo traces or a fake mode is active, a batched copy.

Like ``_compat`` (the feature detections that decide which patches apply), nothing here looks at
``torch.__version__``; each call asks torch for what it has.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable

import torch


def import_module(module_path: str) -> ModuleType:
    return importlib.import_module(module_path)


_CPU = torch.device("cpu")
_mode_stack_depth = getattr(torch._C, "_len_torch_function_stack", None)


def default_device() -> torch.device:
    """Where factory functions put tensors when no device is given (``torch.set_default_device``, 2.3+).

    ``torch.get_default_device()`` costs microseconds; a default device other than the CPU is
    always a torch-function mode on the stack, so an empty stack answers at once."""
    getter = getattr(torch, "get_default_device", None)
    if getter is None or (_mode_stack_depth is not None and _mode_stack_depth() == 0):
        return _CPU
    return getter()


def alias_torchscript_builtin(original: Any, replacement: Any) -> None:
    """Let TorchScript resolve ``replacement`` as the builtin op ``original`` is, where it is one.

    TorchScript looks builtins up by object identity, so a wrapper of ``torch.rand`` would
    otherwise fail to script. The caller keeps ``replacement`` alive for the process's lifetime:
    the table is keyed by ``id``, and a freed id could be reused by another object."""
    builtins = sys.modules.get("torch.jit._builtins") or importlib.import_module("torch.jit._builtins")
    find, register = getattr(builtins, "_find_builtin", None), getattr(builtins, "_register_builtin", None)
    if find is None or register is None:
        return
    name = find(original)
    if name is not None:
        register(replacement, name)


def refresh_dynamo_rules() -> None:
    """Make Dynamo look torch's functions up again after patches replaced or restored some.

    Dynamo caches a map from torch's function objects to how it traces them; built while the
    fence's wrappers were in place, it no longer knows the restored originals (and graph-breaks
    on them), and the other way round. Nothing to do before Dynamo is imported."""
    trace_rules = sys.modules.get("torch._dynamo.trace_rules")
    clear = getattr(trace_rules, "clear_lru_cache", None)
    if clear is not None:
        clear()


def _find_dynamo_compiling() -> Any:
    compiler = getattr(torch, "compiler", None)
    check = getattr(compiler, "is_dynamo_compiling", None)
    return check if check is not None else importlib.import_module("torch._dynamo").is_compiling


# Dynamo folds this predicate to True while it traces, so code guarded by it traces unchanged.
is_dynamo_compiling = _find_dynamo_compiling()


def _find_fake_mode_check() -> Callable[[], bool]:
    key = getattr(getattr(torch._C, "_TorchDispatchModeKey", None), "FAKE", None)
    get_mode = getattr(torch._C, "_get_dispatch_mode", None)
    excluded = getattr(torch._C, "_dispatch_tls_is_dispatch_key_excluded", None)
    python_key = getattr(getattr(torch._C, "DispatchKey", None), "Python", None)
    if key is None or get_mode is None or excluded is None or python_key is None:
        return lambda: False  # unknown: every op counts as device work
    return lambda: get_mode(key) is not None and not excluded(python_key)


# Whether the calling thread's ops reach a FakeTensorMode (the dispatch mode stack is per thread):
# they then run on fake tensors and do no device work (AOTAutograd's make_fx trace). Not under
# ``no_dispatch()``, which Inductor's passes use to run real kernels while a fake mode is active.
in_fake_mode = _find_fake_mode_check()


def copy_all_(destinations: tuple, sources: tuple) -> None:
    """``d.copy_(s, non_blocking=True)`` for each pair, as one op where torch has ``_foreach_copy_``:
    every op releases and retakes the GIL, which costs a hand-off when other threads are busy."""
    foreach_copy = getattr(torch, "_foreach_copy_", None)
    if foreach_copy is not None and destinations:
        foreach_copy(list(destinations), list(sources), non_blocking=True)
        return
    for destination, source in zip(destinations, sources):
        destination.copy_(source, non_blocking=True)
