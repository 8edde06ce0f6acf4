"""threadgraph: torch.compile(mode="reduce-overhead") in Python worker threads.

Public API (everything else is private and may change):

- ``ensure_cudagraph_tls()`` / ``release_cudagraph_tls()``: give the calling thread its CUDAGraph
  Trees state; drop it before the thread ends.
- ``install()`` / ``uninstall()`` / ``patched()``: the global shim for plain threads (``patched()``
  for a block); ``installed()`` says whether it is in place.
- ``patches()``: which patches exist, what they fix, which are active.
- ``CompiledWorkerThread`` / ``WorkerGroup``: a worker lifecycle with fail-fast groups;
  ``WorkerGroup.queue()`` wakes its blocked workers (``GroupStopped``) when the group fails.
- ``check_settings()``: raise ``SettingError`` for a bad value of a ``THREADGRAPH_*`` variable the
  library reads.
- ``released()``: give up the device gate's slots around a blocking wait.
- ``outside_captures()``: run a block of eager CUDA work the fence does not see outside captures.
- ``capture_step()``: a whole training step replayed as one CUDA graph.
- ``StepStats`` / ``StepTimer``: what a worker measured; the step timer it uses (CUDA events read
  without host syncs), for timing a loop of one's own the same way.
"""

from importlib.metadata import PackageNotFoundError, version as _distribution_version

from threadgraph._device.fence import outside_captures
from threadgraph._device.gate import released
from threadgraph._device.tls import ensure_cudagraph_tls, release_cudagraph_tls
from threadgraph._errors import (CaptureConflictError, GateTimeout, GroupStopped, JoinTimeout, SettingError,
                                 ThreadgraphError, ThreadgraphWarning, UnsupportedTorchError, UsageError, WorkerError)
from threadgraph._patches import check_settings, install, installed, patched, patches, uninstall
from threadgraph._workers.group import WorkerGroup
from threadgraph._workers.stats import StepStats, StepTimer
from threadgraph._workers.wholestep import CaptureError, StepGraph, capture_step
from threadgraph._workers.worker import CompiledWorkerThread

try:
    __version__ = _distribution_version("threadgraph")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = [
    "CaptureConflictError",
    "CaptureError",
    "SettingError",
    "check_settings",
    "StepGraph",
    "capture_step",
    "CompiledWorkerThread",
    "GateTimeout",
    "JoinTimeout",
    "StepStats",
    "StepTimer",
    "ThreadgraphError",
    "ThreadgraphWarning",
    "UnsupportedTorchError",
    "UsageError",
    "WorkerError",
    "WorkerGroup",
    "GroupStopped",
    "ensure_cudagraph_tls",
    "install",
    "installed",
    "patched",
    "outside_captures",
    "patches",
    "release_cudagraph_tls",
    "released",
    "uninstall",
]
