"""RunControl: when a run stops (a signal in setup, a request at a step boundary, the votes of every
process) and what train() raises then. The signal handler is called directly, as the interpreter
would on the main thread."""

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


def test_a_signal_during_setup_interrupts_at_once_and_a_second_one_forces():
    control = RunControl()
    with pytest.raises(Interrupted) as first:
        control._handle(signal.SIGTERM, None)
    assert (first.value.signum, first.value.checkpoint, first.value.forced) == (signal.SIGTERM, None, False)
    with pytest.raises(Interrupted) as second:
        control._handle(signal.SIGINT, None)
    assert (second.value.signum, second.value.forced) == (signal.SIGTERM, True)  # the first signal names the stop


def test_a_signal_while_stepping_asks_for_a_stop_at_the_next_boundary_once():
    control = RunControl()
    control.began_stepping()
    control._handle(signal.SIGINT, None)
    control._handle(signal.SIGTERM, None)  # torchrun sends both: the second is ignored
    assert control.requested.is_set() and control.signum == signal.SIGINT


def test_stopping_after_a_step_runs_the_callbacks_and_names_the_step():
    control, calls = RunControl(), []
    control.on_stop(lambda: calls.append("workers"))
    control.on_stop(lambda: calls.append("hand-off"))
    control.stop_after(7)
    assert calls == ["workers", "hand-off"] and control.stopped_at == 7
    stopped = control.stopped(None)
    assert isinstance(stopped, KeyboardInterrupt) and (stopped.step, stopped.signum) == (7, signal.SIGTERM)
    assert control.interrupted(None).signum == signal.SIGINT
