"""Ordered read-ahead over a thread pool, with retries, backoff and a per-item timeout.

:func:`read_ahead` keeps up to ``depth`` calls of ``fn`` running and yields their results in input
order, so a single process saturates a high-latency volume while the consumer sees a plain,
ordered stream.
"""
from __future__ import annotations

import os
import random
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future
from concurrent.futures import wait as wait_futures
from functools import lru_cache
from typing import Any, Callable, Generator, Iterable, NamedTuple, TypeVar

from .._util import POLL_S, DaemonPool, RetryPolicy
from ..errors import CacheFullError, FetchTimeoutError, SourceChangedError

T = TypeVar("T")
R = TypeVar("R")

# Errors that another try will not fix (a source changed during its copy is deterministic: it surfaces at once).
PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, CacheFullError,
             SourceChangedError)


def backoff_delays(retries: int, base: float = 0.01, cap: float = 2.0, jitter: float = 0.5,
                   rng: random.Random | None = None) -> list[float]:
    """Sleep before each retry: the first retry is immediate-ish, then exponential with jitter."""
    return RetryPolicy(retries, PERMANENT, base=base, cap=cap, jitter=jitter).delays(rng)


def with_retries(fn: Callable[[T], R], item: T, retries: int,
                 on_retry: Callable[[BaseException], None] | None = None) -> R:
    """Call ``fn(item)``, retrying transient failures ``retries`` times with exponential backoff."""
    return _policy(retries).call(lambda: fn(item), on_retry)


@lru_cache(maxsize=32)
def _policy(retries: int) -> RetryPolicy:
    return RetryPolicy(retries, PERMANENT)  # built once per count: a fill calls with_retries per file


_pools: dict[tuple[int, str], DaemonPool] = {}
_pools_mu = threading.Lock()


def shared_pool(threads: int, name: str = "fetch") -> DaemonPool:
    """The process's pool of I/O threads called ``name`` (recreated after fork; sized by the largest
    request). Separate names keep short calls from queueing behind a full read-ahead. Daemon threads,
    never joined: a read stuck in a hung mount does not keep the interpreter from exiting."""
    with _pools_mu:
        key = (os.getpid(), name)
        pool = _pools.get(key)
        if pool is None or pool.max_workers < threads:
            if pool is not None:
                pool.shutdown(wait=False)
            pool = DaemonPool(threads, f"ucmagic-{name}")
            for stale in [k for k in _pools if k[0] != key[0]]:  # a forked child's copies of the parent's
                del _pools[stale]
            _pools[key] = pool
        return pool


class _Closed(BaseException):
    """Raised inside a call whose :func:`read_ahead` was closed (the loop left, or failed) while the
    call waited: it stops waiting. A BaseException, so no retry loop takes it for a failure."""


class _Task:
    __slots__ = ("future", "started", "item", "cost", "result", "probe", "seen", "gone")

    def __init__(self, item: Any, cost: int = 0, gone: list[bool] | None = None) -> None:
        self.gone = gone if gone is not None else [False]  # shared by a read_ahead's tasks: it was closed
        self.item = item
        self.cost = cost
        self.started: float | None = None  # start, or the last time progress was seen
        self.future: Future | None = None
        self.result: Any = None
        self.probe: Callable[[], Any] | None = None
        self.seen: Any = None


_current = threading.local()


def restart_timeout() -> None:
    """Called from inside a :func:`read_ahead` call that is waiting (e.g. for cache room, freed as
    the loop consumes): its per-item timeout counts from now, so a slow loop is not a hung mount.
    Once the read-ahead was closed (the loop ended, broke off or failed) it raises instead, so the
    wait ends and the call's thread is free: nothing waits on for a loop that is gone."""
    task = getattr(_current, "task", None)
    if task is not None:
        if task.gone[0]:
            raise _Closed()
        task.started = time.monotonic()


def watch_progress(probe: Callable[[], Any] | None) -> None:
    """Called from inside a :func:`read_ahead` call: ``probe()`` returns something that changes while
    the call makes progress (e.g. the size of the file it writes), so its timeout counts only time
    without progress: a big file still copying never times out, a hung one does. ``None`` ends it."""
    task = getattr(_current, "task", None)
    if task is not None:
        task.probe = probe


def stall_check(now: float, since: float, timeout: float, seen: Any, current: Any) -> tuple[bool, float]:
    """``(timed out, new since)`` for a call last seen progressing at ``since`` whose progress probe
    read ``seen`` then and reads ``current`` now (None: no probe). Pure: no clock, no I/O."""
    if current is not None and current != seen:
        return False, now  # progress since the last look: the timeout starts over
    return now - since > timeout, since


def _probe(task: _Task) -> Any:
    if task.probe is None:
        return None
    try:
        return task.probe()
    except OSError:
        return None


class Window(NamedTuple):
    """State of :func:`tune_window`: the calls kept in flight, and the last growth on trial."""

    size: int
    prev_size: int = 0  # size before the growth on trial (0: none on trial)
    prev_rate: float = 0.0  # items/s measured at prev_size
    hold: int = 0  # periods to keep this size before trying a larger one again


def tune_window(w: Window, rate: float, wait_share: float, *, floor: int, ceiling: int,
                gain: float = 1.1, idle: float = 0.05, rest: int = 4) -> Window:
    """The next read-ahead window after a period in which the consumer got ``rate`` items/s and
    spent ``wait_share`` of its time waiting on the head item (pure: no clock, no I/O).

    The consumer barely waited: it is the bottleneck, so fewer calls in flight will do (shrink by a
    quarter). It waited: double the window, and keep the growth only if the rate rose by ``gain``
    -- a high-latency volume gains from every extra call, a fast local disk (CPU-bound fills that
    serialise on the GIL) does not, and goes back and rests ``rest`` periods before trying again.
    """
    if wait_share < idle:
        return Window(max(floor, w.size - max(1, w.size // 4)))
    if w.prev_size and rate < w.prev_rate * gain:
        return Window(max(floor, w.prev_size), hold=rest)
    if w.hold:
        return Window(w.size, hold=w.hold - 1)
    if w.size >= ceiling:
        return Window(ceiling)
    return Window(min(ceiling, w.size * 2), prev_size=w.size, prev_rate=rate)


def read_ahead(fn: Callable[[T], R], items: Iterable[T], *, depth: int = 32, timeout: float | None = 120.0,
               pool: Executor | None = None, describe: Callable[[T], str] = str,
               fast: Callable[[T], R | None] | None = None, cost: Callable[[T], int] | None = None,
               max_bytes: int | None = None, alive: Callable[[], bool] | None = None) -> Generator[R, None, None]:
    """Yield ``fn(item)`` for each item, in order, with up to ``depth`` calls in flight.

    The calls in flight start at 8 and follow :func:`tune_window`: more while the consumer waits
    and more calls raise the rate (a high-latency volume), fewer when it does not wait.

    With ``cost`` and ``max_bytes``, items submitted and not yet yielded also add up to at most
    ``max_bytes`` (the first one always goes), so big files cannot overrun a budget or a disk.

    ``timeout`` bounds the time each call, once started, goes without progress (see
    :func:`watch_progress`; a call that reports none is bounded as a whole): a hung mount raises
    :class:`FetchTimeoutError` naming the item instead of hanging training. Closing the generator
    cancels calls that have not started, and calls still waiting (see :func:`restart_timeout`) stop.
    The consumer waits in steps of ``POLL_S``, so Ctrl-C interrupts it at once. ``fast(item)``, when
    given, is tried first on the calling thread; a result other than None is used as is (a cache
    hit needs no thread hop). ``alive()``, when given, is asked at each step of a wait: False (a
    DataLoader worker whose main process is gone) ends the wait with SystemExit.
    """
    depth = max(1, int(depth))
    pool = pool or shared_pool(depth)
    it = iter(items)
    pending: deque[_Task] = deque()
    gone = [False]

    inflight = 0
    peeked: list[T] = []
    # Adaptive concurrency: up to ``depth`` calls, but only as many as make the consumer faster.
    floor = min(depth, 4)
    win = Window(min(depth, 8))
    period_start = time.perf_counter()
    period_items = 0
    period_wait = 0.0

    def run(task: _Task) -> R:
        task.started = time.monotonic()
        _current.task = task
        try:
            return fn(task.item)
        finally:
            _current.task = None

    def submit() -> bool:
        nonlocal inflight
        for item in (peeked.pop(),) if peeked else it:
            c = cost(item) if cost is not None else 0
            if max_bytes is not None and pending and inflight + c > max_bytes:
                peeked.append(item)  # over the byte bound: submit it once earlier items are yielded
                return False
            inflight += c
            task = _Task(item, c, gone)
            done = fast(item) if fast is not None else None
            if done is not None:
                task.result = done  # a hit: no Future, no thread hop
            else:
                task.future = pool.submit(run, task)
            pending.append(task)
            return True
        return False

    try:
        while len(pending) < win.size and submit():
            pass
        while pending:
            task = pending[0]
            result = task.result
            fut = task.future
            if fut is not None:
                if not fut.done():
                    t0 = time.perf_counter()
                    # timed steps, never one blocking wait: Ctrl-C and the stall check act within POLL_S
                    while not wait_futures((fut,), timeout=POLL_S).done:
                        if alive is not None and not alive():
                            raise SystemExit("ucmagic: the DataLoader's main process is gone; this worker exits")
                        if not timeout or task.started is None:
                            continue
                        now, current = time.monotonic(), _probe(task)
                        expired, task.started = stall_check(now, task.started, timeout, task.seen, current)
                        task.seen = current
                        if expired:
                            raise FetchTimeoutError(
                                f"fetching {describe(task.item)} made no progress for {timeout:g} s; the "
                                "volume may be hung. Check the mount, or raise timeout="
                            ) from None
                    period_wait += time.perf_counter() - t0
                result = fut.result()
            pending.popleft()
            inflight -= task.cost
            period_items += 1
            if period_items >= max(8, win.size) and depth > floor:
                now = time.perf_counter()
                span = max(now - period_start, 1e-9)
                win = tune_window(win, period_items / span, period_wait / span, floor=floor, ceiling=depth)
                period_start, period_items, period_wait = now, 0, 0.0
            while len(pending) < win.size and submit():
                pass
            yield result
    finally:
        gone[0] = True  # calls still waiting (for cache room) stop at their next look
        for task in pending:
            if task.future is not None:
                task.future.cancel()
