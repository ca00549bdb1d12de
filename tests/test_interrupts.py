"""Signals that interrupt a run (docs/modules.md#interruptspy): a section a Ctrl-C or SIGTERM interrupts only once
it is done, each signal reaching the handler it would have reached, in the order the signals came."""

from __future__ import annotations

import os
import signal

import pytest

from agentnb.interrupts import Terminated, held_interrupts, sigterm_interrupts


def test_a_ctrl_c_inside_a_held_section_is_raised_once_it_ends() -> None:
    done = []
    with pytest.raises(KeyboardInterrupt), held_interrupts():
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)  # twice: raised once
        for _ in range(1000):  # many chances for a signal to be handled
            done.append(1)
        done.append("whole")
    assert done[-1] == "whole"
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigterm_inside_a_held_section_reaches_the_handler_around_it() -> None:
    with pytest.raises(Terminated) as raised, sigterm_interrupts(), held_interrupts():
        os.kill(os.getpid(), signal.SIGTERM)
        assert sum(range(1000)) == 499500  # still here
    assert raised.value.code == 128 + signal.SIGTERM


def test_a_held_section_with_no_signal_changes_nothing() -> None:
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    with held_interrupts():
        pass
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
