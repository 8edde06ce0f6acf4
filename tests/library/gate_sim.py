"""Stand-ins for the gate's participants that the gate and fence tests share: a monitor of who is
inside shared work and exclusive sections, autograd's per-device thread, Dynamo's compile lock."""

import itertools
import queue
import threading
import time

from threadgraph._device.gate import gate_for

COMPILE_LOCK = threading.RLock()  # stands for Dynamo's process-wide compile_lock
_names = itertools.count()


def fresh_gate(prefix: str, timeout: float):
    """A gate of a device no other test uses (released() and the fence see it, as any device's)."""
    gate = gate_for(f"{prefix}{next(_names)}:0")
    gate.timeout = timeout
    return gate


class Monitor:
    """Counts who is inside shared work and exclusive sections; records any overlap."""

    def __init__(self):
        self.lock = threading.Lock()
        self.shared = 0
        self.exclusive = 0
        self.violations = []

    def enter(self, kind):
        with self.lock:
            if kind == "exclusive":
                self.exclusive += 1
                if self.shared or self.exclusive > 1:
                    self.violations.append(("exclusive while", self.shared, self.exclusive))
            else:
                self.shared += 1
                if self.exclusive:
                    self.violations.append(("work during exclusive", self.shared, self.exclusive))

    def leave(self, kind):
        with self.lock:
            if kind == "exclusive":
                self.exclusive -= 1
            else:
                self.shared -= 1


class DeviceThread:
    """Autograd's per-device thread: runs every worker's backward, one after another."""

    def __init__(self, gate, monitor):
        self.gate, self.monitor = gate, monitor
        self.jobs = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while True:
            job = self.jobs.get()
            if job is None:
                return
            captures, compiles, done = job
            try:
                if compiles:  # a lazy backward compile: Dynamo's lock, no slots, then its captures
                    with COMPILE_LOCK:
                        time.sleep(0.001)
                for _ in range(captures):  # a capture inside backward takes the gate exclusively
                    with self.gate.exclusive():
                        self.monitor.enter("exclusive")
                        self.monitor.leave("exclusive")
                done.put(None)
            except BaseException as exc:
                done.put(exc)

    def backward(self, captures, compiles=False):
        done = queue.Queue()
        self.jobs.put((captures, compiles, done))
        return done

    def close(self):
        self.jobs.put(None)
        self.thread.join(30)
