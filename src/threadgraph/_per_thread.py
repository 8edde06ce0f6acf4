"""Per-thread counters read on hot paths.

A ``threading.local`` subclass with a class default answers a thread that never set the value
from the class, while ``getattr(local, name, 0)`` on a plain ``threading.local`` raises and
catches an AttributeError first (about 300 ns against 50 on CPython 3.11). The counters below are
read on every ``is_compiling()``, FX-tracing check and gate entry of every thread.
"""

from __future__ import annotations

import threading


class ThreadCount(threading.local):
    """An int each thread sees its own copy of; 0 until the thread changes it."""

    value = 0
