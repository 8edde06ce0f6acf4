"""One Inductor backend object per settings (hazard concurrent-first-compile, patch
``inductor_backend_per_settings``): what lets one worker's compiled code serve another worker's own
``torch.compile`` call on releases that guard cached code on the backend's identity.
"""

from __future__ import annotations

import threading
from typing import Any

_backends_lock = threading.Lock()
_backends: dict[type, list] = {}  # per wrapper class, one instance per distinct setting


def one_backend_per_settings(original: type) -> type:
    """``torch._TorchCompileInductorWrapper``, made to hand out one instance per settings.

    ``torch.compile(fn, mode=...)`` builds a new Inductor backend object on every call, and some
    releases (2.11) guard cached code on the backend's identity (BACKEND_MATCH, pytorch#168373):
    code one worker compiled is then never reused by another worker's own ``torch.compile``,
    turns or not. Equal settings (the wrapper's own ``__eq__``: mode, options, dynamic) now give
    back the first object built with them, already initialised, so the guard matches.
    """

    class InductorBackendPerSettings(original):  # type: ignore[misc, valid-type]
        def __new__(cls, *args: Any, **kwargs: Any) -> Any:
            probe = original.__new__(cls)
            original.__init__(probe, *args, **kwargs)
            with _backends_lock:
                known = _backends.setdefault(cls, [])
                for backend in known:
                    if backend == probe:
                        return backend
                known.append(probe)
            return probe

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass  # __new__ initialised it; running __init__ again would empty a shared config

    InductorBackendPerSettings.__name__ = InductorBackendPerSettings.__qualname__ = original.__name__
    InductorBackendPerSettings.__module__ = original.__module__
    return InductorBackendPerSettings
