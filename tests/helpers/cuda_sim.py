"""CPU stand-ins for the CUDA objects a hand-off or a captured step uses, so that their logic runs
on a machine without a GPU: tensors that say they are on a CUDA device, and streams and events that
log what is asked of them, in order, instead of doing it. Installed on ``torch.cuda`` with pytest's
monkeypatch (``install``); each thread has its own current stream per device, as on a GPU."""

from __future__ import annotations

import threading

import torch


class FakeCudaTensor(torch.Tensor):
    """A CPU tensor that reports ``device`` (a CUDA one) and logs ``record_stream`` and ``to``."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # ops give plain CPU tensors

    @staticmethod
    def __new__(cls, data: torch.Tensor, device: str, log: list):
        t = torch.Tensor._make_subclass(cls, data)
        t._sim_device, t._sim_log = torch.device(device), log
        return t

    @property
    def device(self) -> torch.device:
        return self._sim_device

    @property
    def is_cuda(self) -> bool:
        return self._sim_device.type == "cuda"

    def record_stream(self, stream: "FakeStream") -> None:
        self._sim_log.append(("record_stream", self.name_in_log, stream.name))

    def to(self, device, non_blocking: bool = False, **kwargs):
        device = torch.device(device)
        self._sim_log.append(("to", self.name_in_log, str(device), non_blocking))
        data = self.as_subclass(torch.Tensor).clone()
        return data if device.type == "cpu" else FakeCudaTensor(data, str(device), self._sim_log)

    name_in_log = "tensor"


class FakeStream:
    def __init__(self, device, name: str, log: list) -> None:
        self.device, self.name, self._log = torch.device(device), name, log

    def wait_event(self, event: "FakeEvent") -> None:
        self._log.append(("wait_event", self.name, event.name))

    def wait_stream(self, other: "FakeStream") -> None:
        self._log.append(("wait_stream", self.name, other.name))

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class CudaSim:
    """The log of every stream and event operation, the streams each thread has current, and the
    events made. ``use(stream)`` makes ``stream`` this thread's current one on its device."""

    def __init__(self) -> None:
        self.log: list = []
        self._current = threading.local()
        self._defaults: dict = {}
        self.events: list = []

    def tensor(self, data: torch.Tensor, device: str = "cuda:0", name: str = "tensor") -> FakeCudaTensor:
        t = FakeCudaTensor(data, device, self.log)
        t.name_in_log = name
        return t

    def stream(self, device, name: str) -> FakeStream:
        return FakeStream(device, name, self.log)

    def use(self, stream: FakeStream) -> None:
        if not hasattr(self._current, "streams"):
            self._current.streams = {}
        self._current.streams[stream.device] = stream

    def current_stream(self, device=None) -> FakeStream:
        device = torch.device("cuda", 0) if device is None else torch.device(device)
        if device.index is None:
            device = torch.device("cuda", 0)
        streams = getattr(self._current, "streams", {})
        if device not in streams:  # every thread's default stream of a device is the same one
            streams[device] = self._defaults.setdefault(device, FakeStream(device, f"default:{device.index}", self.log))
            self._current.streams = streams
        return streams[device]

    def install(self, monkeypatch) -> "CudaSim":
        sim = self

        class FakeEvent:
            def __init__(self, *args, **kwargs) -> None:
                self.name = f"event{len(sim.events)}"
                sim.events.append(self)

            def record(self, stream: FakeStream) -> None:
                sim.log.append(("record", self.name, stream.name))

        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
        monkeypatch.setattr(torch.cuda, "current_stream", self.current_stream)
        return self
