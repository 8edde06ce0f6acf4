"""Identical workers compile once (hazard concurrent-first-compile, patch first_call_in_turn)."""

import contextlib
import gc
import inspect
import logging
import sys
import threading
import weakref

import pytest
import torch
from torch._dynamo.utils import counters

import threadgraph
from threadgraph import CompiledWorkerThread, WorkerGroup
from threadgraph._patches import first_call as _first_call

WORKERS = 3


class Block(torch.nn.Module):
    def __init__(self, seed):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)  # not the global RNG (hazard global-rng-rewind)
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 16)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).tanh()


class Trainer(CompiledWorkerThread):
    """Workers of one kind: each its own module and optimizer, compiled with ``torch.compile``."""

    def __init__(self, index, backend):
        super().__init__("cpu", name=f"trainer-{index}", max_steps=4, warmup_steps=1)
        self.index, self.backend, self.losses = index, backend, []

    def setup(self):
        self.model = Block(self.index)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.fn = torch.compile(self.model, backend=self.backend)
        self.x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 + self.index))

    def step(self):
        loss = self.fn(self.x).square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.losses.append(loss.item())


def _run_group(backend):
    torch._dynamo.reset()
    _first_call.forget()
    counters.clear()
    workers = [Trainer(i, backend) for i in range(WORKERS)]
    with WorkerGroup(workers) as group:  # steps begin together, after every setup: concurrent first calls
        group.join()
    return workers, counters["frames"]["total"]


@pytest.fixture
def patches(clean_patches):
    threadgraph.install()
    yield
    _first_call.forget()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_identical_workers_compile_once_with_the_losses_of_separate_compiles(patches, backend, monkeypatch):
    together, frames = _run_group(backend)
    assert frames == 1, f"{frames} Dynamo frame compilations for {WORKERS} identical workers"
    _leave_out_the_patch(monkeypatch)
    apart, frames_apart = _run_group(backend)
    assert frames_apart > 1
    for w, ref in zip(together, apart):
        assert w.losses == pytest.approx(ref.losses, rel=1e-6, abs=1e-7), w.name
    # each worker's own model: different seeds, different losses
    assert together[0].losses != pytest.approx(together[1].losses)


def _leave_out_the_patch(monkeypatch):
    # Workers install() when constructed: leave the patch out there too.
    monkeypatch.setenv("THREADGRAPH_EXCLUDE_PATCHES", "first_call_in_turn")
    threadgraph.uninstall(["first_call_in_turn"])


class WarmsUpOnce(Block):
    """Sets an attribute on its first forward, as some models do: the second call recompiles."""

    def __init__(self, seed):
        super().__init__(seed)
        self.scale = 1.0

    def forward(self, x):
        out = super().forward(x) * self.scale
        self.scale = 0.5
        return out


def test_a_model_that_recompiles_on_its_second_call_compiles_twice_for_all_workers(patches, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "Block", WarmsUpOnce)
    workers, frames = _run_group("aot_eager")
    assert frames == 2, f"{frames} Dynamo frame compilations; expected one per guard state"
    assert all(len(w.losses) == 4 for w in workers)


def test_without_the_patch_concurrent_first_calls_compile_once_per_worker(patches, monkeypatch):
    _leave_out_the_patch(monkeypatch)
    _, frames = _run_group("inductor")  # an Inductor compile is long enough for every worker to miss
    assert frames == WORKERS


def test_the_compiling_worker_reports_compile_time_and_the_others_their_wait(patches):
    workers, _ = _run_group("inductor")
    compiled = [w for w in workers if w.stats.compile_seconds > 0]
    assert len(compiled) == 1, [w.stats.summary() for w in workers]
    waited = [w for w in workers if w is not compiled[0]]
    assert all(w.stats.turn_wait_seconds > 0 and w.stats.compile_seconds == 0 for w in waited), \
        [w.stats.summary() for w in workers]
    assert "compile" in compiled[0].stats.summary() and "waiting for a peer's compile" in waited[0].stats.summary()
    assert all(w.activity[0] == "finished" for w in workers)
    assert all(0 < w.stats.setup_seconds <= w.stats.steps_began_at <= w.stats.warmup_seconds for w in workers), \
        [w.stats.summary() for w in workers]


def _slow_first_call(release: threading.Event, calls: list, entered: threading.Event):
    """A function whose first call sets ``entered``, waits for ``release`` and fails."""
    def fn(x):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            entered.set()
            assert release.wait(10), "the test never released the first call"
            raise ValueError("first call failed")
        return x + 1
    return fn


def _signal_waits_for_the_turn(monkeypatch) -> threading.Event:
    """An event set when a thread starts waiting for another's turn (it gives its slots up first)."""
    waiting, released = threading.Event(), _first_call.released

    @contextlib.contextmanager
    def observed():
        waiting.set()
        with released():
            yield

    monkeypatch.setattr(_first_call, "released", observed)
    return waiting


@pytest.mark.timeout(60)
def test_a_failed_first_call_leaves_the_turn_to_the_next_caller(patches, monkeypatch):
    release, calls, entered = threading.Event(), [], threading.Event()
    waiting = _signal_waits_for_the_turn(monkeypatch)
    compiled = _first_call.in_turn(_slow_first_call(release, calls, entered), key=("test-failed",), name="fn")
    errors, results = [], []

    def call():
        try:
            results.append(compiled(1))
        except ValueError as exc:
            errors.append(str(exc))

    first = threading.Thread(target=call, name="first")
    first.start()
    assert entered.wait(10), "the first call never began"
    second = threading.Thread(target=call, name="second")
    second.start()
    assert waiting.wait(10), "the second caller never waited for the turn"
    assert calls == ["first"]  # the second waits for the turn the first holds
    release.set()
    first.join(10)
    second.join(10)
    assert not first.is_alive() and not second.is_alive()
    assert errors == ["first call failed"] and results == [2] and calls == ["first", "second"]


@pytest.mark.timeout(60)
def test_a_turn_held_too_long_is_given_up_with_a_warning(patches, monkeypatch, caplog):
    monkeypatch.setattr(_first_call, "DEFAULT_TIMEOUT_S", 0.05)
    release, calls, entered = threading.Event(), [], threading.Event()
    compiled = _first_call.in_turn(_slow_first_call(release, calls, entered), key=("test-timeout",), name="slow_fn")
    outcome = []  # what the holder's call did: an assertion in its thread would only be a warning

    def hold():
        try:
            outcome.append(("returned", compiled(1)))
        except BaseException as exc:  # asserted below, in the test's thread
            outcome.append(("raised", exc))

    first = threading.Thread(target=hold, name="holder")
    first.start()
    assert entered.wait(10), "the first call never began"
    with caplog.at_level(logging.WARNING, logger="threadgraph"):
        assert compiled(1) == 2  # did not wait for the holder
    release.set()
    first.join(10)
    assert not first.is_alive()
    assert len(outcome) == 1 and outcome[0][0] == "raised", outcome
    assert isinstance(outcome[0][1], ValueError) and str(outcome[0][1]) == "first call failed", outcome
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "holder" in warned[0] and "slow_fn" in warned[0], warned  # who, and which call


def _context_of(compiled):
    """The Dynamo context whose ``compile_wrapper`` ``compiled`` is."""
    return inspect.getclosurevars(compiled).nonlocals["self"]


def _turn_hooks(context):
    return [h for h in context.enter_exit_hooks if isinstance(h, _first_call._TurnHook)]


def test_torch_compile_returns_its_own_function_and_compiled_functions_nest(patches):
    double = lambda x: x * 2  # noqa: E731
    inner = torch.compile(double, backend="eager")
    assert inner.__wrapped__ is double  # torch's own wrapper: the turn is its context's enter hook
    assert len(_turn_hooks(_context_of(inner))) == 1
    outer = torch.compile(lambda x: inner(x) + 1, backend="eager")
    counters.clear()
    assert torch.equal(outer(torch.ones(3)), torch.full((3,), 3.0))
    assert not counters["graph_break"], dict(counters["graph_break"])


def _frames_of_a_call(fn, *args):
    """The files of the Python frames one call of ``fn`` runs."""
    files = []

    def profile(frame, event, arg):
        if event == "call":
            files.append(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        fn(*args)
    finally:
        sys.setprofile(None)
    return files


def test_once_its_code_settled_a_call_runs_no_turn_code_and_forget_takes_turns_again(patches):
    plus = lambda x: x + 1  # noqa: E731
    compiled = torch.compile(plus, backend="eager")
    context, x = _context_of(compiled), torch.ones(2)
    assert _first_call.__file__ in _frames_of_a_call(compiled, x)  # the first call compiles in its turn
    compiled(x)  # a second call that compiled nothing: the code settles
    assert _turn_hooks(context) == []
    assert _first_call.__file__ not in _frames_of_a_call(compiled, x)
    _first_call.forget()
    assert len(_turn_hooks(context)) == 1


def test_a_context_that_compiles_two_functions_gives_each_its_own_turn(patches):
    context = torch._dynamo.optimize("eager")
    first, second = (lambda x: x + 1), (lambda x: x - 1)  # noqa: E731
    compiled_first, compiled_second = context(first), context(second)
    assert compiled_first.__wrapped__ is first and compiled_second.__wrapped__ is second
    assert len(_turn_hooks(context)) == 1  # one hook, for both
    x = torch.zeros(2)
    for _ in range(3):
        assert torch.equal(compiled_second(x), x - 1)
    assert _first_call.turn_key(second) in _first_call._done
    assert _first_call.turn_key(first) not in _first_call._done and _first_call.turn_key(first) not in _first_call._turns
    assert len(_turn_hooks(context)) == 1  # the first function has not settled: the hook stays
    for _ in range(2):
        assert torch.equal(compiled_first(x), x + 1)
    assert _first_call.turn_key(first) in _first_call._done and _turn_hooks(context) == []


def test_uninstall_leaves_torch_compile_and_its_contexts_as_they_were(patches):
    before = torch.compile(lambda x: x * 3, backend="eager")
    assert len(_turn_hooks(_context_of(before))) == 1
    threadgraph.uninstall(["first_call_in_turn"])
    assert _turn_hooks(_context_of(before)) == []
    identity = lambda x: x  # noqa: E731
    fn = torch.compile(identity, backend="eager")
    assert fn.__wrapped__ is identity and _turn_hooks(_context_of(fn)) == []


def test_a_compiled_call_that_raises_gives_its_turn_back_and_settles_nothing(patches):
    def step(x, fail):
        if fail:
            raise ValueError("first call failed")
        return x + 1

    compiled, key = torch.compile(step, backend="eager"), _first_call.turn_key(step)
    for _ in range(2):
        with pytest.raises(ValueError, match="first call failed"):
            compiled(torch.ones(2), True)
        assert not _first_call._turns[key].lock.locked() and key not in _first_call._done
    compiled(torch.ones(2), False)
    compiled(torch.ones(2), False)
    assert key in _first_call._done


class _Context:
    """Stands for a Dynamo context: its list of enter hooks."""

    def __init__(self):
        self.enter_exit_hooks = []
        self.fullgraph = self.export = False


def _call_through_hooks(context, body):
    """What compile_wrapper does around a call: every enter hook, the call, every exit in a finally."""
    exits = [enter() for enter in context.enter_exit_hooks]
    try:
        return body()
    finally:
        for leave in exits:
            leave()


def test_through_the_hook_a_failed_call_settles_nothing_and_gives_the_turn_back(patches):
    context, key = _Context(), ("test-hook-failed",)
    _first_call._arm(context, key, "fn")

    def fail():
        raise ValueError("first call failed")

    for _ in range(3):
        with pytest.raises(ValueError, match="first call failed"):
            _call_through_hooks(context, fail)
        assert not _first_call._turns[key].lock.locked()
    assert key not in _first_call._done and len(_turn_hooks(context)) == 1
    try:
        raise KeyError("handled by the caller")
    except KeyError as handled:
        def raise_it_again():
            raise handled

        for _ in range(2):  # the exception being handled, raised again by the call: the call failed
            with pytest.raises(KeyError):
                _call_through_hooks(context, raise_it_again)
    assert key not in _first_call._done
    try:
        raise KeyError("handled by the caller")
    except KeyError:  # calls made while the caller handles an exception of its own still count
        _call_through_hooks(context, lambda: 1)
        _call_through_hooks(context, lambda: 1)
    assert key in _first_call._done
    _call_through_hooks(context, lambda: 1)
    assert _turn_hooks(context) == []


def test_a_fullgraph_call_that_compiled_no_frame_gives_its_turn_back(patches):
    def doubled(x):
        return x * 2

    torch._dynamo.eval_frame.skip_code(doubled.__code__)  # Dynamo never compiles it: no compiled frame
    compiled = torch.compile(doubled, backend="eager", fullgraph=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="found no compiled frames"):
            compiled(torch.ones(2))
        assert not _first_call._turns[_first_call.turn_key(doubled)].lock.locked()
    eval_frame = torch._dynamo.eval_frame
    with pytest.MonkeyPatch.context() as patch:  # the patch's second target as torch has it
        patch.setattr(eval_frame, "get_skip_reasons", eval_frame.get_skip_reasons.__wrapped__)
        with pytest.raises(RuntimeError, match="found no compiled frames"):
            compiled(torch.ones(2))
    turn = _first_call._turns[_first_call.turn_key(doubled)]
    assert turn.lock.locked()  # without it the failed call keeps its turn
    turn.holder = turn.holder_ident = None
    turn.lock.release()


def test_torch_compile_calls_with_equal_settings_share_one_backend_object(patches):
    build = torch._TorchCompileInductorWrapper
    a, b = build("reduce-overhead", None, False), build("reduce-overhead", None, False)
    assert a is b and a.config.get("triton.cudagraphs") is True  # initialised once, not emptied again
    assert build(None, None, False) is not a and isinstance(a, build)
    threadgraph.uninstall(["inductor_backend_per_settings"])
    assert torch._TorchCompileInductorWrapper("reduce-overhead", None, False) is not a


def test_a_context_nothing_uses_any_more_is_not_kept_alive(patches):
    compiled = torch.compile(lambda x: x + 2, backend="eager")
    compiled(torch.ones(2))
    context = weakref.ref(_context_of(compiled))
    assert len(_first_call._armed) >= 1 and context() in _first_call._armed
    del compiled
    gc.collect()
    assert context() is None
