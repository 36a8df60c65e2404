"""What a process owns while it reads tables, and what happens to it at fork and at exit.

Every open handle and native pool of the tables layer belongs to the process that opened it:

- **Decoding in flight.** Row groups are decoded by pyarrow on read-ahead threads (daemon threads, never
  joined). A decode still running when the interpreter exits runs native code while Arrow's and DuckDB's
  static objects are destroyed: ``terminate called without an active exception`` (exit 134). Each decode runs
  inside :func:`native_work`; at exit, before anything is closed, new decodes are refused and the running
  ones are waited for (at most :data:`EXIT_WAIT_S`: a read stuck in a hung mount is not waited for longer).
  The read-ahead's threads then get a second to end their calls (:func:`ucmagic._util.stop_pools_at_exit`):
  a thread that frees the batch it decoded while the interpreter is finalized aborts the process too.
- **Handles** (open Parquet files, memory maps, ``ds.rows``' decoded row groups): objects that hold them are
  registered with :func:`on_exit` (weakly) and closed, in order, after the decodes ended.
- **DuckDB** (filter evaluation): :func:`duckdb_cursor` hands out a cursor per thread on one database per
  process (and per file-access setting: the SQL sandbox is part of a database's settings); closed last at exit.

After ``fork`` the child owns none of its parent's: the registries start empty and the parent's DuckDB objects
are leaked in the child (destroying them there crashes it at exit: their threads are the parent's).
Objects holding handles check :func:`owner_pid` (or use :func:`process_local`) and reopen their own.
"""
from __future__ import annotations

import atexit
import contextlib
import os
import threading
import weakref
from typing import Any, Callable, Iterator

__all__ = ["native_work", "on_exit", "duckdb_cursor", "EXIT_WAIT_S", "Exiting", "owner_pid"]

EXIT_WAIT_S = 30.0
"""How long the exit waits for decodes still running (a decode takes well under a second; a hung read more)."""


class Exiting(BaseException):
    """A decode asked for while the interpreter exits (a BaseException: no handler of errors takes it)."""


class _State:
    """This process's registries (a fresh one in a forked child)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.cv = threading.Condition()
        self.running = 0
        self.exiting = False
        self.closers: "weakref.WeakKeyDictionary[Any, Callable[[Any], None]]" = weakref.WeakKeyDictionary()
        self.dbs: dict[Any, Any] = {}
        self.cursors: list[Any] = []
        self.local = threading.local()


_state = _State()


def _after_fork() -> None:
    """In a forked child: fresh registries. The parent's DuckDB objects are never used and never destroyed here:
    destroying an inherited database in a child ends it with SIGSEGV/SIGABRT at exit (its threads are the
    parent's), so each one gets a reference that is never given back."""
    global _state
    import ctypes

    for obj in [*_state.dbs.values(), *_state.cursors]:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
    _state = _State()


os.register_at_fork(after_in_child=_after_fork)


def owner_pid() -> int:
    """The pid of the process this module's registries belong to (the current process)."""
    return _state.pid


@contextlib.contextmanager
def native_work() -> Iterator[None]:
    """Around a decode (native code on any thread): counted, so that the exit waits for it; refused with
    :class:`Exiting` once the exit has begun."""
    st = _state
    with st.cv:
        if st.exiting:
            raise Exiting("the interpreter is exiting")
        st.running += 1
    try:
        yield
    finally:
        with st.cv:
            st.running -= 1
            st.cv.notify_all()


def on_exit(obj: Any, close: Callable[[Any], None]) -> None:
    """Call ``close(obj)`` at exit (after the decodes ended) if ``obj`` is still alive then (held weakly)."""
    with _state.cv:
        _state.closers[obj] = close


def duckdb_cursor(key: Any, configure: Callable[[Any], None]) -> Any:
    """This thread's DuckDB cursor on the process's database for ``key`` (a database per setting: ``configure``
    applies it once, when the database is made). Use it from this thread only; never close it."""
    st = _state
    cursors = getattr(st.local, "cursors", None)
    if cursors is None:
        cursors = st.local.cursors = {}
    cur = cursors.get(key)
    if cur is not None:
        return cur
    import duckdb

    with st.cv:
        db = st.dbs.get(key)
        if db is None:
            db = duckdb.connect()
            try:
                db.execute("SET threads TO 1")
                configure(db)
            except BaseException:
                db.close()
                raise
            st.dbs[key] = db
        cur = db.cursor()
        st.cursors.append(cur)
    cursors[key] = cur
    return cur


def _at_exit() -> None:
    st = _state
    if st.pid != os.getpid():  # an inherited handler in a child that exits normally: its own state is fresh
        return
    with st.cv:
        st.exiting = True
        st.cv.wait_for(lambda: st.running == 0, timeout=EXIT_WAIT_S)
        closers = list(st.closers.items())
        st.closers.clear()
    for obj, close in closers:
        with contextlib.suppress(Exception):
            close(obj)
    for cur in st.cursors:
        with contextlib.suppress(Exception):
            cur.close()
    for db in st.dbs.values():
        with contextlib.suppress(Exception):
            db.close()
    st.cursors.clear()
    st.dbs.clear()


atexit.register(_at_exit)
