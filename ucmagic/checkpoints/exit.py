"""Asynchronous saves pending at interpreter exit: the exit waits for them and reports those that are lost.

The wait runs among ``threading``'s exit hooks (registered through :mod:`ucmagic._torch_compat`, the
one owner of private runtime hooks), before ``concurrent.futures`` stops accepting work. A save that
cannot complete makes the process exit with status 1; Ctrl-C during the wait abandons the saves and
exits with status 130.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from concurrent.futures import Future as CFuture
from concurrent.futures import wait as futures_wait
from typing import Any

from .. import _torch_compat as compat
from .._util import error_line
from ..errors import CheckpointSupersededError

NEVER_STARTED_S = 30.0  # an async save whose thread never called the writer this long after staging is lost


class PendingSave:
    """One asynchronous save: what it writes, its completion future, the thread that runs it.

    ``cancel`` stops its uploads at their next 8 MB (set when Ctrl-C abandons the save at exit).
    """

    def __init__(self, what: str, fut: CFuture[Any]) -> None:
        self.what = what
        self.fut = fut
        self.thread: threading.Thread | None = None
        self.cancel = threading.Event()
        self.since = time.monotonic()
        self.watch_thread = False
        self.pid = os.getpid()  # a forked child (a DataLoader worker) does not own its parent's saves

    def stopped(self) -> str | None:
        """Why this save can no longer complete its future, or None while it still may."""
        if not self.watch_thread:
            return None
        if self.thread is not None:
            alive = self.thread.is_alive()
            return None if alive else "the save stopped before committing (another rank or torch failed)"
        if time.monotonic() - self.since > NEVER_STARTED_S:
            return "the save never started after its state was copied"
        return None

    def finished_before_exit(self) -> bool:
        """The save's thread ended before the exit began without completing the future (torch or another
        rank failed it): its error went to torch's future, which the caller could wait for; it was not pending."""
        return self.watch_thread and self.thread is not None and not self.thread.is_alive()

    def waiting_at_exit(self) -> bool:
        """This process must wait for the save before it exits."""
        return not self.fut.done() and self.pid == os.getpid() and not self.finished_before_exit()

    def outcome(self) -> BaseException | None:
        """Wait until the save completes or cannot any more; its error (None when saved, cancelled, or
        superseded: a newer save into the same directory holds the state then)."""
        why = None
        while not self.fut.done() and why is None:
            futures_wait([self.fut], timeout=0.2)
            why = None if self.fut.done() else self.stopped()
        if self.fut.cancelled():
            return None
        err = self.fut.exception() if self.fut.done() else RuntimeError(why)
        return None if isinstance(err, CheckpointSupersededError) else err

    def saved(self) -> bool:
        return self.fut.done() and not self.fut.cancelled() and self.fut.exception() is None


_pending: list[PendingSave] = []
_pending_mu = threading.Lock()
_exit_hook_installed = False


def track_pending_save(what: str, fut: CFuture[Any], *, writer: bool = False) -> PendingSave:
    """Make interpreter exit wait for ``fut`` (an asynchronous save of ``what``) and report if it fails.

    The wait runs among ``threading``'s exit hooks, before ``concurrent.futures`` stops accepting
    work, so the save can still use thread pools; one line on stderr says what is waited for.
    ``writer=True``: ``fut`` is a writer's own, completed from torch's save thread (which the writer
    records), so a thread that ends, or never starts, without completing it means the save is lost;
    otherwise ``fut`` follows another future that always completes.
    """
    global _exit_hook_installed
    entry = PendingSave(what, fut)
    entry.watch_thread = writer
    with _pending_mu:
        _pending.append(entry)
        if not _exit_hook_installed:
            compat.register_early_exit_hook(_finish_pending_saves)
            _exit_hook_installed = True
    fut.add_done_callback(lambda _f: _untrack(entry))
    return entry


def _untrack(entry: PendingSave) -> None:
    with _pending_mu:
        if entry in _pending:
            _pending.remove(entry)


def _finish_pending_saves() -> None:
    with _pending_mu:
        waiting = [p for p in _pending if p.waiting_at_exit()]
    if not waiting:
        return
    paths = sorted({p.what for p in waiting})
    print(f"ucmagic: waiting for {len(paths)} checkpoint save(s) to finish before exit (Ctrl-C abandons "
          f"them): {', '.join(paths)}", file=sys.stderr, flush=True)
    try:
        lost = [(p, err) for p in waiting if (err := p.outcome()) is not None]
    except KeyboardInterrupt:
        _abandon(waiting)
        return
    if lost:
        _exit_lost(lost)


def _exit_lost(lost: list[tuple[PendingSave, BaseException]]) -> None:
    """Report each lost save (once per directory) and exit with status 1."""
    for p, err in {p.what: (p, err) for p, err in lost}.values():
        print(f"ucmagic: checkpoint NOT saved: {p.what}: {error_line(err)}", file=sys.stderr)
    print("ucmagic: exiting with status 1 because a checkpoint save was lost", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(1)


def _abandon(waiting: list[PendingSave]) -> None:
    """Ctrl-C while waiting at exit: stop the saves' uploads, let them mark their directories failed, exit 130."""
    for p in waiting:
        p.cancel.set()
    deadline = time.monotonic() + 10
    with contextlib.suppress(KeyboardInterrupt):
        for p in waiting:
            while not p.fut.done() and p.stopped() is None and time.monotonic() < deadline:
                futures_wait([p.fut], timeout=0.1)
    for what in sorted({p.what for p in waiting if not p.saved()}):  # once per directory
        print(f"ucmagic: checkpoint NOT saved: {what}: interrupted (Ctrl-C); the directory is not "
              "loadable until a new save into it commits", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(130)
