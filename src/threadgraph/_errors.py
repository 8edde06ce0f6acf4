"""Exceptions and the warning category of threadgraph."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("threadgraph")


def _rebuild(cls: type, args: tuple) -> BaseException:
    # BaseException.__new__ sets ``args`` without calling __init__, whose keyword-only
    # attributes come back through __setstate__ (the instance dict).
    return cls.__new__(cls, *args)


class ThreadgraphError(RuntimeError):
    """Base class of threadgraph's errors. Pickle and copy keep the message and every attribute
    (multiprocessing and concurrent.futures pickle exceptions), whatever a subclass's __init__ takes."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args), self.__dict__


class SettingError(ThreadgraphError, ValueError):
    """An environment variable threadgraph reads holds a bad value; the message names it and the fix."""


class UsageError(ThreadgraphError, ValueError):
    """A call threadgraph cannot serve as made: a bad argument (a device, a step count, a patch
    name) or a worker or group used out of order (added after its group started, a group started
    twice or joined before it started). Also a ``ValueError``, and, as every ThreadgraphError, a
    ``RuntimeError``; an argument of the wrong type is also a ``TypeError``. The message says what
    to do."""


class ArgumentTypeError(UsageError, TypeError):
    """A UsageError for an argument of the wrong type (also a ``TypeError``)."""


class JoinTimeout(ThreadgraphError, TimeoutError):
    """``join(timeout)`` of a worker or a group ran out with a worker still running; the message
    names it and what it is doing. The worker is left running: ``stop()`` asks it to end."""

    def __reduce__(self) -> tuple[Any, ...]:
        # TimeoutError's instances are laid out as OSError's, which only its own __new__ makes
        return type(self), self.args, self.__dict__


class UnsupportedTorchError(ThreadgraphError):
    """This torch lacks a symbol threadgraph needs; the message names it."""


class ThreadgraphWarning(UserWarning):
    """Warnings issued by threadgraph (messages start with ``threadgraph:``)."""


class WorkerError(ThreadgraphError):
    """A worker thread failed; raised from ``join()`` with the worker's exception as cause.

    Attributes:
        thread_name: The failed worker's thread name.
        device: Its device (``"cuda:0"``, ``"cpu"``), or None when it had none yet.
    """

    def __init__(self, message: str, *, thread_name: str, device: str | None) -> None:
        super().__init__(message)
        self.thread_name = thread_name
        self.device = device


class GateTimeout(ThreadgraphError):
    """A wait on the device gate lasted longer than ``THREADGRAPH_GATE_TIMEOUT``; the message says who holds it.

    threadgraph logs every thread's stack with it, so a stuck wait says where it is.

    Attributes:
        thread_name: The thread that waited.
        device: The device whose gate it waited for.
    """

    def __init__(self, message: str, *, thread_name: str, device: str) -> None:
        super().__init__(message)
        self.thread_name = thread_name
        self.device = device


class CaptureConflictError(ThreadgraphError):
    """Eager CUDA work that threadgraph does not order ran into another thread's capture.

    The message names the op, the thread that was capturing and the fix; the CUDA error is the
    cause.

    Attributes:
        device: The device of the capture.
        capturing_thread: The thread that was capturing, or None when none is known.
        op: The operation that ran into the capture.
    """

    def __init__(self, message: str, *, device: str, capturing_thread: str | None, op: str) -> None:
        super().__init__(message)
        self.device = device
        self.capturing_thread = capturing_thread
        self.op = op


class GroupStopped(ThreadgraphError):
    """Raised in a worker blocked on its group's ``queue()`` when the group stops or fails; the
    worker then ends quietly (it is stopping), and ``join()`` raises the first failure, if any."""


def add_note(error: BaseException, note: str) -> None:
    """Add ``note`` to ``error`` (Python 3.11+); on 3.10, which has no notes, log it."""
    if hasattr(error, "add_note"):
        error.add_note(note)
    else:
        log.error("threadgraph: %s", note)
