"""RunControl: when a run stops (a signal in setup, a request at a step boundary, the votes of every
process) and what train() raises then. Signals are raised in this process, on the main thread where
pytest runs the tests and where the control installs its handlers."""

import signal

import pytest
import torch

from examples.dflash_trainer.run.control import Interrupted, RunControl


def test_alone_the_request_decides_and_a_fresh_run_does_not_stop():
    control = RunControl()
    assert not control.should_stop() and control.vote() == 0.0
    control.requested.set()
    assert control.should_stop() and control.vote() == 1.0


def test_across_processes_the_summed_votes_decide_on_every_rank():
    asked = RunControl()
    asked.requested.set()
    asked.agree(torch.zeros(1))  # no rank had asked at the last average: not yet
    assert not asked.should_stop()
    other = RunControl()
    other.agree(torch.ones(1))  # another rank asked
    assert other.should_stop()


@pytest.fixture
def unhandled_signals_fail():
    """A signal no RunControl handles fails the test instead of ending pytest."""
    def unhandled(signum, frame):
        raise AssertionError(f"{signal.Signals(signum).name} reached the handler outside RunControl")

    previous = {sig: signal.signal(sig, unhandled) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def test_a_signal_during_setup_interrupts_at_once_and_a_second_one_forces(unhandled_signals_fail):
    with RunControl() as control:
        with pytest.raises(Interrupted) as first:
            signal.raise_signal(signal.SIGTERM)
        assert (first.value.signum, first.value.checkpoint, first.value.forced) == (signal.SIGTERM, None, False)
        with pytest.raises(Interrupted) as second:
            signal.raise_signal(signal.SIGINT)
    assert (second.value.signum, second.value.forced) == (signal.SIGTERM, True)  # the first signal names the stop
    assert control.signum == signal.SIGTERM


def test_a_signal_while_stepping_asks_for_a_stop_at_the_next_boundary_once(unhandled_signals_fail):
    with RunControl() as control:
        control.began_stepping()
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGTERM)  # torchrun sends both: the second is ignored
    assert control.requested.is_set() and control.signum == signal.SIGINT


def test_leaving_the_control_puts_the_previous_handlers_back(unhandled_signals_fail):
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with RunControl():
        assert all(signal.getsignal(sig) is not handler for sig, handler in before.items())
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_stopping_after_a_step_runs_the_callbacks_and_names_the_step():
    control, calls = RunControl(), []
    control.on_stop(lambda: calls.append("workers"))
    control.on_stop(lambda: calls.append("hand-off"))
    control.stop_after(7)
    assert calls == ["workers", "hand-off"] and control.stopped_at == 7
    stopped = control.stopped(None)
    assert isinstance(stopped, KeyboardInterrupt) and (stopped.step, stopped.signum) == (7, signal.SIGTERM)
    assert control.interrupted(None).signum == signal.SIGINT
