"""Ordered read-ahead over a thread pool, with retries, backoff and a per-item timeout.

:func:`read_ahead` keeps up to ``depth`` calls of ``fn`` running and yields their results in input
order, so a single process saturates a high-latency volume while the consumer sees a plain,
ordered stream.
"""
from __future__ import annotations

import math
import os
import random
import threading
import time
from collections import deque
from concurrent.futures import Executor, Future
from functools import lru_cache
from typing import Any, Callable, Generator, Generic, Iterable, NamedTuple, TypeVar

from .._util import POLL_S, DaemonPool, RetryPolicy
from ..errors import CacheFullError, FetchTimeoutError, SourceChangedError

T = TypeVar("T")
R = TypeVar("R")

# Errors that another try will not fix (a source changed during its copy is deterministic: it surfaces at once).
DEFAULT_INFLIGHT = 128  # files in flight per rank, spread over its DataLoader workers
MIN_STREAM_DEPTH = 8  # ... at least this many per stream


def stream_depth(prefetch: int | None, num_workers: int) -> int:
    """Files in flight per stream of a file dataset: ``prefetch`` when set, else the rank's
    :data:`DEFAULT_INFLIGHT` spread over its ``num_workers`` streams (at least :data:`MIN_STREAM_DEPTH`).
    So, by default, more workers do not copy more files at once: the read-ahead is the rank's."""
    return int(prefetch) if prefetch else max(MIN_STREAM_DEPTH, DEFAULT_INFLIGHT // max(1, num_workers))


PERMANENT = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, CacheFullError,
             SourceChangedError)


def backoff_delays(retries: int, base: float = 0.01, cap: float = 2.0, jitter: float = 0.5,
                   rng: random.Random | None = None) -> list[float]:
    """Sleep before each retry: the first retry is immediate-ish, then exponential with jitter."""
    return RetryPolicy(retries, PERMANENT, base=base, cap=cap, jitter=jitter).delays(rng)


def with_retries(fn: Callable[[T], R], item: T, retries: int,
                 on_retry: Callable[[BaseException], None] | None = None) -> R:
    """Call ``fn(item)``, retrying transient failures ``retries`` times with exponential backoff.

    Inside a :func:`read_ahead` call, a retry does not start once the read-ahead was closed (the loop
    ended, broke off, failed or was interrupted): no new open reaches the volume for a loop that is gone."""
    tries = 0

    def attempt() -> R:
        nonlocal tries
        if tries:
            stop_if_closed()
        tries += 1
        return fn(item)

    return _policy(retries).call(attempt, on_retry)


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


class _Task(Generic[T, R]):
    """One call of a :func:`read_ahead`: a run of consecutive items (one unless the items' calls are
    quick, see :func:`batch_size`), their call on a pool thread (``posted``; not where ``fast`` gave
    the one item's result at once), the results as the call produces them, and the progress clock of
    the item running. The clock, the probe and ``at`` are written by the call's pool thread and read
    by the consumer's stall check, so they go under ``mu`` (shared by the tasks of one read-ahead);
    ``closed`` is set once the read-ahead is closed.

    The call's end is the task's own: ``done`` (and ``error``, what the call raised) are set by
    :func:`_run` on the pool thread, which then releases ``_signal``, a lock held from the post until
    then, that the consumer waits on in steps (:meth:`wait`). No ``Future`` per call: its condition
    variable, waiter and callbacks cost more than the rest of a quick call's hand-off."""

    __slots__ = ("items", "costs", "future", "results", "taken", "busy", "at", "_closed", "_mu", "_started",
                 "_probe", "_seen", "posted", "done", "error", "cancelled", "_signal")

    def __init__(self, items: list[T], costs: list[int], closed: threading.Event, mu: threading.Lock) -> None:
        self.items = items
        self.costs = costs
        self.future: Future[None] | None = None  # only where the pool is another Executor (to cancel it)
        self.posted = False  # a call on a pool thread runs (or will) for these items
        self.done = False  # the call ended: every result it produced is in ``results``, or ``error`` is set
        self.error: BaseException | None = None
        self.cancelled = False  # the read-ahead was closed before the call started: it does not run
        self._signal: threading.Lock | None = None
        self.results: list[R] = []  # in item order: the call appends (pool thread), the consumer reads
        self.taken = 0  # results the consumer has taken
        self.busy = 0.0  # seconds the call spent on its items (read once the call is done)
        self.at = 0  # the item the call is on
        self._closed = closed
        self._mu = mu
        self._started: float | None = None  # start, or the last time progress was seen
        self._probe: Callable[[], object] | None = None
        self._seen: object = None  # what the probe read at the last look (consumer thread only)

    def post(self, pool: Executor, fn: Callable[[T], R]) -> None:
        """Run ``fn`` over the items on ``pool`` (a :class:`DaemonPool` without a Future)."""
        self.posted = True
        self._signal = signal = threading.Lock()
        signal.acquire()
        post = getattr(pool, "post", None)
        if post is not None:
            post(_run, fn, self)
        else:
            self.future = pool.submit(_run, fn, self)

    def finish(self, error: BaseException | None) -> None:
        """The call ended (its pool thread), with ``error`` if it raised."""
        self.error = error
        self.done = True
        if self._signal is not None:
            self._signal.release()

    def wait(self, on_poll: Callable[[], None]) -> None:
        """Wait for the call to end, in steps of ``POLL_S`` (Ctrl-C is seen at once), calling
        ``on_poll()`` (which may raise to stop waiting) between steps (the consumer's thread)."""
        signal = self._signal
        while not self.done and signal is not None:
            if signal.acquire(timeout=POLL_S):
                signal.release()
                return
            on_poll()

    def cancel(self) -> None:
        """The read-ahead is closed: a call that has not started will not (one running goes on)."""
        self.cancelled = True
        if self.future is not None:
            self.future.cancel()

    def start(self, at: int | None = None) -> None:
        """The call starts its item ``at`` (default: the current one), or waits anew (its pool thread).
        A later item of a read-ahead closed meanwhile does not start: raises :class:`_Closed`."""
        if at and self._closed.is_set():
            raise _Closed()
        with self._mu:
            self._started = time.monotonic()
            if at is not None:
                self.at, self._probe = at, None

    def restart(self) -> None:
        """:func:`restart_timeout` from the call's pool thread: raises :class:`_Closed` once closed."""
        if self._closed.is_set():
            raise _Closed()
        self.start()

    def check_open(self) -> None:
        """Raises :class:`_Closed` once the read-ahead is closed (the call's pool thread)."""
        if self._closed.is_set():
            raise _Closed()

    def watch(self, probe: Callable[[], object] | None) -> None:
        """:func:`watch_progress` from the call's pool thread (one store, no lock: the stall check reads
        the old probe or the new one, either of them right; it runs twice per file filled)."""
        self._probe = probe

    def current(self) -> T:
        """The item the call is on (or was on when it failed)."""
        with self._mu:
            return self.items[self.at]

    def stalled(self, timeout: float) -> bool:
        """Whether the call's current item went ``timeout`` seconds without progress (the consumer's thread)."""
        now = time.monotonic()
        with self._mu:
            probe, started = self._probe, self._started
        if started is None:
            return False  # not started yet: queued behind other calls
        current = _read_probe(probe)  # outside the lock: a probe does I/O
        with self._mu:  # the clock as it is now: a restart meanwhile is kept
            since = self._started if self._started is not None else started
            expired, self._started = stall_check(now, since, timeout, self._seen, current)
        self._seen = current
        return expired


_current = threading.local()  # the task whose call runs on this pool thread (see _run)


def _run(fn: Callable[[T], R], task: _Task[T, R]) -> None:
    """A task's call, on a pool thread: ``fn`` of each of its items in turn, each result appended as it
    comes (an error ends the call: the read-ahead ends with it). :func:`restart_timeout` and
    :func:`watch_progress` find the task; a read-ahead closed meanwhile stops it between items."""
    clock = time.perf_counter
    t0 = clock()
    error: BaseException | None = None
    if task.cancelled:  # closed before it started: never reaches the volume
        task.finish(None)
        return
    _current.task = task
    try:
        for i, item in enumerate(task.items):
            task.start(i)
            task.results.append(fn(item))
    except _Closed:
        pass  # the read-ahead was closed: no one takes what this call left, and the error is dropped here
    except BaseException as exc:  # noqa: BLE001 - handed to the consumer through the task
        error = exc
    finally:
        task.busy = clock() - t0
        _current.task = None
        task.finish(error)
        # an error's traceback holds this frame: without these locals it holds neither the error nor the
        # task, so no cycle keeps the call's frames (the cache and dataset they name) until a collection
        del error, task, fn


def restart_timeout() -> None:
    """Called from inside a :func:`read_ahead` call that is waiting (e.g. for cache room, freed as
    the loop consumes): its per-item timeout counts from now, so a slow loop is not a hung mount.
    Once the read-ahead was closed (the loop ended, broke off or failed) it raises instead, so the
    wait ends and the call's thread is free: nothing waits on for a loop that is gone."""
    task: _Task[Any, Any] | None = getattr(_current, "task", None)
    if task is not None:
        task.restart()


def stop_if_closed() -> None:
    """Called from inside a :func:`read_ahead` call before it starts new work (a retry): raises once
    the read-ahead was closed, so the call ends there. Elsewhere (no read-ahead) it does nothing."""
    task: _Task[Any, Any] | None = getattr(_current, "task", None)
    if task is not None:
        task.check_open()


def watch_progress(probe: Callable[[], object] | None) -> None:
    """Called from inside a :func:`read_ahead` call: ``probe()`` returns something that changes while
    the call makes progress (e.g. the size of the file it writes), so its timeout counts only time
    without progress: a big file still copying never times out, a hung one does. ``None`` ends it."""
    task: _Task[Any, Any] | None = getattr(_current, "task", None)
    if task is not None:
        task.watch(probe)


def stall_check(now: float, since: float, timeout: float, seen: object, current: object) -> tuple[bool, float]:
    """``(timed out, new since)`` for a call last seen progressing at ``since`` whose progress probe
    read ``seen`` then and reads ``current`` now (None: no probe). Pure: no clock, no I/O."""
    if current is not None and current != seen:
        return False, now  # progress since the last look: the timeout starts over
    return now - since > timeout, since


def _read_probe(probe: Callable[[], object] | None) -> object:
    if probe is None:
        return None
    try:
        return probe()
    except OSError:
        return None


class Window(NamedTuple):
    """State of :func:`tune_window`: the calls kept in flight, and the change on trial."""

    size: int
    prev_size: int = 0  # size before the change on trial (0: none on trial; larger: a shrink, smaller: a growth)
    prev_rate: float = 0.0  # items/s measured at prev_size
    hold: int = 0  # periods to keep this size before trying another again
    down: bool = False  # the next trial shrinks the window (a growth did not pay, or a shrink cost nothing)


def tune_window(w: Window, rate: float, wait_share: float, *, floor: int, ceiling: int,
                gain: float = 1.1, loss: float = 0.95, idle: float = 0.05, rest: int = 4,
                busy: float = 0.0) -> Window:
    """The next read-ahead window after a period in which the consumer got ``rate`` items/s and
    spent ``wait_share`` of its time waiting on the head item (pure: no clock, no I/O).

    The consumer barely waited: it is the bottleneck, so fewer calls in flight will do (shrink by a
    quarter), but not fewer than twice ``busy``, the calls the volume keeps running at once (the
    caller's items/s times the volume's own seconds per item, Little's law). A consumer slower than
    a high-latency volume (decoding images: 145 items/s over 100 ms opens keep ~15 calls busy) so
    keeps the calls that hide the latency, where it used to shrink until it waited, grow back and
    shrink again (waiting in 41 of 150 periods of a model); quick fills (a local disk) keep few
    calls busy and still shrink to ``floor``. It waited: double the window, and keep the growth only
    if the rate rose by ``gain`` -- a high-latency volume gains from every extra call, a fast local
    disk (CPU-bound fills that serialise on the GIL) does not. A growth that did not pay goes back
    and then tries halving: a smaller window is kept while the rate stays within ``loss`` of what it
    was (fewer threads contending for the GIL do the same work: on 40,000 local files the window
    settles at 4-8 calls instead of 32), and one that cost rate goes back and rests ``rest`` periods
    before trying to grow again. Measured (old tree against new, interleaved, medians): 40,000 local
    files 17.6 -> 16.9 s, P20 3.44 -> 3.34 s, P100 4.11 -> 4.02 s, all within this VM's noise
    (docs/benchmarks.md).
    """
    if wait_share < idle:
        least = min(ceiling, max(floor, math.ceil(2 * busy)))
        return Window(max(min(least, w.size), w.size - max(1, w.size // 4)))
    if w.prev_size > w.size:  # a shrink on trial
        if rate < w.prev_rate * loss:
            return Window(w.prev_size, hold=rest)
        w = Window(w.size, down=True)  # as fast with fewer: try fewer still
    elif w.prev_size:  # a growth on trial
        if rate < w.prev_rate * gain:
            return Window(max(floor, w.prev_size), down=True)  # measured there once more, then halved
        w = Window(w.size)
    if w.hold:
        return Window(w.size, hold=w.hold - 1)
    if w.down:
        if w.size <= floor:
            return Window(floor, hold=rest)
        return Window(max(floor, w.size // 2), prev_size=w.size, prev_rate=rate)
    if w.size >= ceiling:
        return Window(ceiling)
    return Window(min(ceiling, w.size * 2), prev_size=w.size, prev_rate=rate)


START_WINDOW = 32
"""Calls a :func:`read_ahead` keeps in flight at first (``depth`` if smaller); :func:`tune_window` moves it.
A cold volume's latency is the common case: at 8 the first batch of 32 files from a volume with 100 ms
per open took 0.37-0.43 s (three doublings), at 32 it took 0.18-0.31 s, with no more CPU (at 64: 0.24-0.40 s
and more CPU); a fast local disk shrinks it within a few periods."""
FLOOR_WINDOW = 4
"""The fewest calls :func:`tune_window` keeps in flight (``depth`` if smaller), but see :data:`INLINE_FLOOR`."""
INLINE_FLOOR = 1
"""The fewest calls in flight where calls may run inline (a local disk): one call is best there, and
calls timed with fewer threads contending for the GIL show that items are quick (20,000 files of
1 KiB: 3.8-3.9 s at one call, 6.3-6.5 s at two, 10.4 s at four, where they never looked quick)."""
MIN_PERIOD = 8
"""Items yielded per tuning period at least (and at least the window)."""


def read_ahead(fn: Callable[[T], R], items: Iterable[T], *, depth: int = 32, timeout: float | None = 120.0,
               pool: Executor | None = None, describe: Callable[[T], str] = str,
               fast: Callable[[T], R | None] | None = None, cost: Callable[[T], int] | None = None,
               max_bytes: int | None = None, alive: Callable[[], bool] | None = None,
               inline: bool = False) -> Generator[R, None, None]:
    """Yield ``fn(item)`` for each item, in order, with up to ``depth`` items in flight.

    The calls in flight start at :data:`START_WINDOW` and follow :func:`tune_window`: more while
    the consumer waits and more calls raise the rate (a high-latency volume), fewer when it does not wait.
    A call takes one item, or a run of consecutive items when items are quick (see :func:`batch_size`).

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

    ``inline``: calls cannot hang (a local disk), so while items are quick (well under :data:`CALL_S`
    each) each is called on the consumer's own thread when it is needed: no hand-off at all (20,000
    local files of 1 KiB: 3.2-4.3 s, against 5.1-5.9 s in runs on a pool thread and 8.3-9.4 s one item
    per call). The timeout does not apply there; a slower item sends the next ones back to the pool.
    """
    depth = max(1, int(depth))
    ahead = _ReadAhead(fn, items, depth=depth, timeout=timeout, pool=pool or shared_pool(depth),
                       describe=describe, fast=fast, cost=cost, max_bytes=max_bytes, alive=alive, inline=inline)
    yield from ahead.results()


class _ReadAhead(Generic[T, R]):
    """One :func:`read_ahead` (see there for the parameters): the tasks submitted and not yet yielded,
    in input order, the bytes they hold, the adaptive window and the items per call. All of it is the
    consumer's; pool threads see only their :class:`_Task` (and never this object, so an abandoned
    call in a hung mount holds none of it)."""

    def __init__(self, fn: Callable[[T], R], items: Iterable[T], *, depth: int, timeout: float | None,
                 pool: Executor, describe: Callable[[T], str], fast: Callable[[T], R | None] | None,
                 cost: Callable[[T], int] | None, max_bytes: int | None, alive: Callable[[], bool] | None,
                 inline: bool = False) -> None:
        self._fn, self._items, self._pool, self._inline = fn, iter(items), pool, inline
        self._timeout, self._describe, self._alive = timeout, describe, alive
        self._fast, self._cost, self._max_bytes = fast, cost, max_bytes
        self._pending: deque[_Task[T, R]] = deque()
        self._queued = 0  # items of the pending tasks not yet yielded (at most ``depth``)
        self._held = 0  # cost of the items submitted and not yet yielded
        # an item taken that waits for the byte bound, or a hit found after a run: (item, cost, fast's result)
        self._peeked: list[tuple[T, int, R | None]] = []
        self._closed = threading.Event()  # the tasks' "closed" flag
        self._mu = threading.Lock()  # the tasks' clock lock
        # Adaptive concurrency: up to ``depth`` items in flight, in as many calls as make the consumer
        # faster, each call a run of items as long as quick items need (see batch_size).
        self._depth, self._floor = depth, min(depth, INLINE_FLOOR if inline else FLOOR_WINDOW)
        self._win = Window(min(depth, START_WINDOW))
        self._per_item: float | None = None  # seconds a call spends per item (moving average)
        # the least of them: the volume's own time per item (calls contending for the GIL take longer)
        self._least_item: float | None = None
        self._period_start = time.perf_counter()
        self._period_items = 0
        self._period_wait = 0.0

    def results(self) -> Generator[R, None, None]:
        """The results in input order; leaving (close, exception, break) shuts the read-ahead down."""
        try:
            self._fill()
            while True:
                if not self._pending:
                    got = self._next_item() if self._inline_now() else None
                    if got is not None:
                        yield self._call_inline(*got)
                        continue
                    self._fill()
                    if not self._pending:
                        return
                task = self._pending[0]  # stays in pending while waited for: an interrupt cancels it
                error = self._collect(task) if task.posted else None
                complete = error is None and (task.done or not task.posted)
                if complete and task.taken == len(task.items):
                    # its last result was handed out while the call was still ending (results are
                    # appended before the future completes): retire it now, else this loop spins on it
                    self._retire(self._pending.popleft())
                    self._fill()
                    continue
                ready = len(task.results)  # a call still running (or stalled) may append more
                while task.taken < ready:
                    i = task.taken
                    task.taken = i + 1
                    self._held -= task.costs[i]
                    self._queued -= 1
                    self._period_items += 1
                    if complete and i + 1 == len(task.items):
                        self._retire(self._pending.popleft())
                        self._fill()
                    yield task.results[i]
                if error is not None:  # after the results the call produced before it
                    raise error
        finally:
            self._shutdown()

    def _fill(self) -> None:
        """Submit calls until the window is full, ``depth`` items are in flight, the items run out or
        the byte bound is reached; none while the consumer calls them itself (see :meth:`_inline_now`)."""
        if self._inline_now():
            return
        while len(self._pending) < self._win.size and self._queued < self._depth and self._submit_next():
            pass

    def _next_item(self) -> tuple[T, int, R | None] | None:
        """The next item, its cost and (for one put back) ``fast``'s result, if any."""
        if self._peeked:
            return self._peeked.pop()
        for item in self._items:  # the next one, if any
            return item, (self._cost(item) if self._cost is not None else 0), None
        return None

    def _submit_next(self) -> bool:
        """Start the next call (a run of up to :func:`batch_size` items), or use ``fast``'s result for
        the next item; False if none goes now."""
        room = min(self._depth - self._queued, batch_size(self._per_item, self._win.size, self._depth))
        items: list[T] = []
        costs: list[int] = []
        while len(items) < room:
            got = self._next_item()
            if got is None:
                break
            item, c, done = got
            if self._max_bytes is not None and (self._pending or items) and self._held + c > self._max_bytes:
                self._peeked.append(got)  # over the byte bound: submitted once earlier items are yielded
                break
            if done is None and self._fast is not None:
                done = self._fast(item)
            if done is not None:  # a hit: no call, no thread hop
                if items:
                    self._peeked.append((item, c, done))  # it goes after the run taken so far
                    break
                self._held += c
                self._queued += 1
                hit: _Task[T, R] = _Task([item], [c], self._closed, self._mu)
                hit.results.append(done)
                self._pending.append(hit)
                return True
            self._held += c
            items.append(item)
            costs.append(c)
        if not items:
            return False
        self._queued += len(items)
        task: _Task[T, R] = _Task(items, costs, self._closed, self._mu)
        task.post(self._pool, self._fn)
        self._pending.append(task)
        return True

    def _collect(self, task: _Task[T, R]) -> BaseException | None:
        """Wait for the head task's call to end, or for results of a run it has not handed out yet
        (looked at every POLL_S: a later item of a run may wait for cache room that only the loop's
        consumption of the earlier ones frees). Returns the call's error, if it failed or stalled
        (raised once the results before it are yielded). The wait goes in timed steps, never one
        blocking wait: Ctrl-C, the alive check and the stall check act within POLL_S."""
        if not task.done and len(task.results) <= task.taken:
            t0 = time.perf_counter()
            try:
                task.wait(lambda: self._check(task))
            except FetchTimeoutError as exc:
                return exc
            except _ResultsReady:
                return None
            finally:
                self._period_wait += time.perf_counter() - t0
        return task.error if task.done else None

    def _check(self, task: _Task[T, R]) -> None:
        """Between two steps of a wait on ``task``: the main process, results of its run ready to
        hand out (:class:`_ResultsReady`) and the call's progress."""
        if len(task.results) > task.taken:
            raise _ResultsReady()
        if self._alive is not None and not self._alive():
            raise SystemExit("ucmagic: the DataLoader's main process is gone; this worker exits")
        if self._timeout and task.stalled(self._timeout):
            raise FetchTimeoutError(
                f"fetching {self._describe(task.current())} made no progress for {self._timeout:g} s; the "
                "volume may be hung. Check the mount, or raise timeout="
            ) from None

    def _inline_now(self) -> bool:
        """Whether the consumer calls the next item itself: allowed (``inline``) and items are quick
        (runs of more than one item would go to a pool thread): a hand-off then costs more than the
        call, and more threads only contend for the GIL. Slower items go back to pool threads."""
        return self._inline and batch_size(self._per_item, 1, self._depth) > 1

    def _call_inline(self, item: T, cost: int, done: R | None) -> R:
        """``fn(item)`` on the consumer's thread (a hit from ``fast`` as it is), timed like a call."""
        if done is None and self._fast is not None:
            done = self._fast(item)
        if done is None:
            task: _Task[T, R] = _Task([item], [cost], self._closed, self._mu)
            outer = getattr(_current, "task", None)
            _current.task = task  # restart_timeout and watch_progress find it, as on a pool thread
            t0 = time.perf_counter()
            try:
                task.start(0)
                done = self._fn(item)
            finally:
                _current.task = outer
                self._learn(time.perf_counter() - t0)
        self._period_items += 1
        self._tune()
        return done

    def _learn(self, per_item: float) -> None:
        """A call took ``per_item`` seconds per item: the moving average behind :func:`batch_size`, and
        the least time per item behind the calls :func:`tune_window` keeps busy."""
        self._per_item = per_item if self._per_item is None else 0.75 * self._per_item + 0.25 * per_item
        self._least_item = per_item if self._least_item is None else min(self._least_item, per_item)

    def _retire(self, task: _Task[T, R]) -> None:
        """``task``'s results were all taken: learn its time per item, and tune the window at the end
        of a period."""
        if task.posted:
            self._learn(task.busy / len(task.items))
        self._tune()

    def _tune(self) -> None:
        """At the end of a period, the next window (:func:`tune_window`)."""
        if self._period_items >= max(MIN_PERIOD, self._win.size) and self._depth > self._floor:
            now = time.perf_counter()
            span = max(now - self._period_start, 1e-9)
            rate = self._period_items / span
            busy = 0.0 if self._inline_now() else rate * (self._least_item or 0.0)  # calls pool threads run
            self._win = tune_window(self._win, rate, self._period_wait / span, floor=self._floor,
                                    ceiling=self._depth, busy=busy)
            self._period_start, self._period_items, self._period_wait = now, 0, 0.0

    def _shutdown(self) -> None:
        """Calls still waiting (for cache room) stop at their next look, a call on a run of items stops
        before its next one, calls not started never start. A call running (a read stuck in a hung
        mount) is not waited for."""
        self._closed.set()
        for task in self._pending:
            if task.posted:
                task.cancel()


class _ResultsReady(BaseException):
    """Ends a wait on a run whose earlier results are ready to hand out (see ``_ReadAhead._collect``); a
    BaseException, as :class:`_Closed`, so no handler of errors takes it."""


def batch_size(per_item: float | None, window: int, depth: int) -> int:
    """Items one read-ahead call takes in turn (pure): one while the time per item is unknown or long
    (a high-latency volume wants each item in its own call, all at once); as many as take about
    :data:`CALL_S` when items are quick (a local disk, where a thread hand-off per item cost more than
    the copy: 20,000 files of 1 KiB took 8-9 s in calls of one item, 2.4 s copied on the consumer's
    own thread), at most :data:`MAX_BATCH`, and no more than keep ``window`` calls within ``depth`` items."""
    if per_item is None or per_item * 2 >= CALL_S:
        return 1
    return max(1, min(int(CALL_S / max(per_item, 1e-7)), MAX_BATCH, depth // max(1, window)))


CALL_S = 0.002
"""Seconds of work a read-ahead call aims at when its items are quick (see :func:`batch_size`)."""
MAX_BATCH = 32
"""The most items one read-ahead call takes in turn."""
