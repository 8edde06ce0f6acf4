"""CPU smoke test of an installed threadgraph (CI runs it from outside the repository, on the wheel):

    python smoke.py --version VERSION

Checks that threadgraph is imported from this environment's installed packages (not an editable
install) and is VERSION; that install() replaces what its active patches name and uninstall() puts
back the very same objects; and that a function compiled with mode="reduce-overhead" gives the
eager result when called in a CompiledWorkerThread of a WorkerGroup and in a plain thread. Prints one line per check; exits 1
on the first failure."""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import json
import sys
import sysconfig
import threading
from pathlib import Path

import torch

import threadgraph

STEPS = 5


def say(message: str) -> None:
    print(f"smoke: {message}", flush=True)


def resolve(target: str):
    """The object a patch target names (``module:attribute.path``); a class's own attribute as stored
    in the class, not bound or unwrapped."""
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    *parents, last = path.split(".")
    for name in parents:
        obj = getattr(obj, name)
    return obj.__dict__[last] if inspect.isclass(obj) and last in obj.__dict__ else getattr(obj, last)


def check_version(expected: str) -> None:
    location = Path(threadgraph.__file__).resolve()
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    if site not in location.parents:
        raise AssertionError(f"threadgraph was imported from {location}, not from this environment's {site}")
    distribution = importlib.metadata.distribution("threadgraph")
    origin = json.loads(distribution.read_text("direct_url.json") or "{}")
    if origin.get("dir_info", {}).get("editable"):
        raise AssertionError(f"threadgraph is an editable install of {origin.get('url')}, not the wheel")
    if not threadgraph.__version__ == distribution.version == expected:
        raise AssertionError(f"versions differ: threadgraph.__version__ {threadgraph.__version__}, "
                             f"installed distribution {distribution.version}, wheel {expected}")
    say(f"threadgraph {threadgraph.__version__} imported from {location.parent} (installed, not editable; "
        f"the wheel's version) ... ok")


def model() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    x = torch.randn(8, 16)
    with torch.no_grad():
        return net, x, net(x)


class Worker(threadgraph.CompiledWorkerThread):
    """Calls a reduce-overhead function of the net on the CPU, STEPS times; keeps the last output."""

    def __init__(self, net: torch.nn.Module, x: torch.Tensor) -> None:
        super().__init__("cpu", max_steps=STEPS, warmup_steps=1)
        self.net, self.x, self.out = net, x, None

    def setup(self) -> None:
        self.fn = torch.compile(self.net, mode="reduce-overhead")

    def step(self) -> None:
        with torch.no_grad():
            self.out = self.fn(self.x).clone()


def check_worker(net: torch.nn.Module, x: torch.Tensor, expected: torch.Tensor) -> None:
    worker = Worker(net, x)
    with threadgraph.WorkerGroup([worker]) as group:
        group.join()  # waits for the steps and re-raises the first failure; leaving the block stops the group
    if worker.stats.steps != STEPS or not torch.allclose(worker.out, expected, atol=1e-5):
        raise AssertionError(f"the worker ran {worker.stats.steps} of {STEPS} steps; output matches eager: "
                             f"{worker.out is not None and torch.allclose(worker.out, expected, atol=1e-5)}")
    say(f"compiled function in a CompiledWorkerThread of a WorkerGroup: {worker.stats.steps} steps, "
        f"output equals eager ... ok")


def check_plain_thread(net: torch.nn.Module, x: torch.Tensor, expected: torch.Tensor) -> None:
    fn = torch.compile(net, mode="reduce-overhead")
    outputs: list[torch.Tensor] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with torch.no_grad():
                for _ in range(STEPS):
                    outputs.append(fn(x).clone())
        except BaseException as err:  # re-raised in the main thread below
            errors.append(err)
        finally:
            threadgraph.release_cudagraph_tls()

    thread = threading.Thread(target=run, name="smoke-plain-thread")
    thread.start()
    thread.join(timeout=600)
    if thread.is_alive():
        raise AssertionError("the plain thread did not finish its compiled calls within 600 s")
    if errors:
        raise errors[0]
    if len(outputs) != STEPS or not all(torch.allclose(out, expected, atol=1e-5) for out in outputs):
        raise AssertionError(f"the plain thread made {len(outputs)} of {STEPS} calls, not all equal to eager")
    say(f"compiled function in a plain thread: {STEPS} calls, outputs equal eager ... ok")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--version", required=True, help="the version of the wheel that was installed")
    args = parser.parse_args(argv)
    say(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}")
    check_version(args.version)

    if threadgraph.installed():
        raise AssertionError("threadgraph reports itself installed before install() was called")
    before = {p["name"]: {t: resolve(t) for t in p["targets"]} for p in threadgraph.patches() if p["applies"]}
    threadgraph.install()
    active = [p for p in threadgraph.patches() if p["active"]]
    unchanged = [t for p in active for t in p["targets"] if resolve(t) is before[p["name"]][t]]
    if not threadgraph.installed() or not active or unchanged:
        raise AssertionError(f"install(): installed() {threadgraph.installed()}, {len(active)} active patches, "
                             f"targets left unchanged: {unchanged}")
    say(f"install(): {len(active)} patches active, each of their {sum(len(p['targets']) for p in active)} "
        f"targets replaced ... ok")

    net, x, expected = model()
    check_worker(net, x, expected)
    check_plain_thread(net, x, expected)

    threadgraph.uninstall()
    not_restored = [t for targets in before.values() for t, original in targets.items() if resolve(t) is not original]
    if threadgraph.installed() or any(p["active"] for p in threadgraph.patches()) or not_restored:
        raise AssertionError(f"uninstall(): installed() {threadgraph.installed()}, not restored: {not_restored}")
    say(f"uninstall(): every original object of the {len(before)} applicable patches is back ... ok")
    say("all checks passed")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except AssertionError as failure:
        print(f"smoke: FAILED: {failure}", file=sys.stderr)
        sys.exit(1)
