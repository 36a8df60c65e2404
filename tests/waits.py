"""Waiting in tests without depending on the machine's speed (issue 53).

A test waits on an event, a condition or a file appearing, never on a sleep being long enough or one
thread being ahead of another. Where it must bound a wait (a hang would otherwise stall the suite), the
bound is :data:`PATIENCE`: far beyond what a loaded 2-core machine needs, so only a hang reaches it.
Timed checks (a promise in seconds) go behind ``pytest --full``. A test of a timeout inside ucmagic
drives the module's clock with :class:`JumpClock` instead of waiting it out.
"""
from __future__ import annotations

import time
import types
from typing import Callable

PATIENCE = 120.0
"""Seconds a test waits for something that happens at once on a quiet machine: only a hang gets there."""


def wait_until(cond: Callable[[], object], what: str, *, timeout: float = PATIENCE, alive: Callable[[], bool] | None
               = None, step: float = 0.01) -> None:
    """Return once ``cond()`` is true; fail naming ``what`` after ``timeout`` seconds, or at once when
    ``alive()`` (e.g. a child process still running) turns false first."""
    end = time.monotonic() + timeout
    while not cond():
        if alive is not None and not alive():
            if cond():
                return
            raise AssertionError(f"{what}: the process it waited on ended first")
        if time.monotonic() > end:
            raise AssertionError(f"{what}: not after {timeout:g} s")
        time.sleep(step)


class JumpClock:
    """A stand-in for a module's ``time`` whose ``monotonic()`` jumps ``by`` seconds ahead once ``when()``
    is true (and stays ahead): a timeout inside ucmagic then fires exactly when the test has set up the
    state it is about, however slow the machine. Everything else is the real ``time`` module.

    With ``again`` it jumps ``by`` more at every read after that: a timeout whose clock starts over at the
    first look (a progress probe read for the first time) still fires at the next look.

    ``monkeypatch.setattr(module, "time", JumpClock(when, by=3600))``."""

    def __init__(self, when: Callable[[], bool], by: float = 3600.0, again: bool = False) -> None:
        self._when, self._by, self._again = when, by, again
        self._jumps = 0
        self._real = time

    def monotonic(self) -> float:
        if (self._again or not self._jumps) and self._when():
            self._jumps += 1
        return self._real.monotonic() + self._by * self._jumps

    def __getattr__(self, name: str) -> object:
        return getattr(self._real, name)


def module_with(**attrs: object) -> types.SimpleNamespace:
    """A namespace standing in for a module, e.g. a ``time`` whose ``time()`` the test sets."""
    return types.SimpleNamespace(**attrs)
