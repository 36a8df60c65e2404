"""The lease: protection from eviction of what a loop may still open, and the consumption channel.

Three parts, one job each:

- :class:`ConsumptionChannel`: a shared-memory structure in which a loader (``ucmagic.DataLoader``)
  reports, per worker stream, how many items the training loop has finished with, and which
  iteration the streams belong to. Its layout is named (:class:`ChannelLayout`); a stream reads its
  slot through a :class:`StreamConsumption`.
- :func:`lease_span`: the pure rule of what a stream's record covers (tested exhaustively in
  ``tests/test_lease.py``): every item handed out and not consumed, plus the items looked up or
  filled ahead, never fewer.
- :class:`LeaseRecord` (one protection record: a set of entry names, written only when it changes)
  and :class:`StreamLease` (a stream's span of positions over its record, released as the loop
  consumes). Shard chunk readers hold a :class:`LeaseRecord` directly.

Call order of a :class:`StreamLease` (one per stream and iteration)::

    lease = StreamLease(record, items, quantum=..., window=..., chunk=..., consumption=..., sizer=...)
    lease.cover(pos)        # before position ``pos`` is looked up or filled (the record names it)
    lease.handed(pos)       # just before ``pos`` is handed out (releases what the loop consumed)
    lease.may_exceed(pos)   # asked by a fill waiting for room: is the loop blocked on ``pos``?
    lease.finish(abandoned=...)   # the iteration ended: keep only what is handed out and not consumed

Call order of :class:`StreamLeases` (one per dataset object; a DataLoader worker's copy makes its own):
``leases.open(items, owner, slot, policy=..., consumption=..., quantum=..., depth=...)`` per stream and
iteration, sized for the budget and the live streams (:class:`BudgetTooSmallError` there, at the first item).

Call order of the channel: the loader calls ``reset(streams)`` per iteration, ``channel[s] = n`` per
batch, ``retire()`` when the loop leaves; each stream reads ``channel.reader(slot)`` once per iteration.
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import threading
import time
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Protocol, Sequence

from .._shared import SharedInts
from ..dist import dist_info, local_world_size
from ..errors import BudgetTooSmallError
from .cache import FileCache
from .cache_layout import serial
from .windows import LiveSizing, Sizing, WindowPolicy

RESIZE_S = 1.0  # how often a stream re-reads the budget and the streams sharing the cache
MIN_COVER = 16  # items a stream's record covers ahead at least (unless a shared budget asks fewer)
REFRESH_S = 0.01  # how often a stream's refresher releases what the loop consumed
UNBUDGETED_STEP = 512
"""Items released at a time without a budget (only the free-disk floor evicts then, so holding a few
hundred consumed items longer is cheap): a protection record write per 512 items handed out, the
length of a warm run (a step of 64 was 3,125 writes in a warm epoch of 200,000 files, 0.2-0.3 s)."""


class ChannelLayout(NamedTuple):
    """Where things are in a consumption channel's shared ints: ``streams`` slots of consumed items
    (one per DataLoader worker; more workers share slots, and a worker past them reads no reports),
    then the ``tracked`` flag (a loader reports) and the ``generation`` (the loader's iteration count)."""

    streams: int = 64

    @property
    def tracked(self) -> int:
        return self.streams

    @property
    def generation(self) -> int:
        return self.streams + 1

    @property
    def size(self) -> int:
        return self.streams + 2


LAYOUT = ChannelLayout()
MAX_STREAMS = LAYOUT.streams


class ConsumptionChannel:
    """A loader's reports of consumed items per worker stream, in shared memory every worker sees.

    A pickled channel (a DataLoader worker's copy of its dataset) shares the same memory."""

    def __init__(self, arr: SharedInts | None = None, layout: ChannelLayout = LAYOUT) -> None:
        self._a = arr if arr is not None else SharedInts(layout.size)
        self.layout = layout
        self._generation = layout.generation  # kept: retire() runs at interpreter exit too

    def reset(self, streams: int) -> None:
        """A new iteration with ``streams`` worker streams: nothing consumed yet, reports on.

        Streams of the iteration before (persistent workers still finishing the batches torch
        prefetched after a ``break``) become stale: they read everything as consumed, so their
        protection ends and their fills never wait for room the loop will not free.
        """
        a, lay = self._a, self.layout
        a[lay.generation] = a[lay.generation] + 1
        for i in range(lay.streams):
            a[i] = 0
        a[lay.tracked] = 1

    def retire(self) -> None:
        """The loop left the current iteration (``break``, an error, Ctrl-C) or its workers are being
        stopped: its streams become stale as at :meth:`reset`, so their fills stop waiting for room
        that no consumption will free (a worker blocked there would hold up torch's shutdown)."""
        g = self._generation
        self._a[g] = self._a[g] + 1

    def __setitem__(self, stream: int, items: int) -> None:
        """The loop has finished with the first ``items`` items of worker stream ``stream``."""
        if stream < self.layout.streams:
            self._a[stream] = items

    def reader(self, slot: int) -> StreamConsumption:
        """Stream ``slot``'s view, bound to the iteration under way now."""
        if slot >= self.layout.streams:
            return StreamConsumption(self._a, self.layout, None, 0)
        return StreamConsumption(self._a, self.layout, slot, self._a[self.layout.generation])


class StreamConsumption:
    """One stream's reading of its channel slot (see :meth:`ConsumptionChannel.reader`)."""

    def __init__(self, arr: SharedInts, layout: ChannelLayout, slot: int | None, generation: int) -> None:
        self._a, self._layout, self._slot, self._gen = arr, layout, slot, generation

    def consumed(self) -> int | None:
        """Items the loop has finished with; None without reports (no loader reports, or no slot)."""
        slot, a = self._slot, self._a
        if slot is None or not a[self._layout.tracked]:
            return None
        return a[slot]

    def retired(self) -> bool:
        """Whether the loader's loop left the iteration this stream belongs to (all it handed out
        counts as consumed)."""
        return self._slot is not None and bool(self._a[self._layout.tracked]) \
            and self._a[self._layout.generation] != self._gen


NO_REPORTS = StreamConsumption(SharedInts(LAYOUT.size), LAYOUT, None, 0)
"""The consumption of a stream nobody reports for (a plain loop, torch's DataLoader)."""


# ---------------------------------------------------------------- the pure rule


@dataclass(frozen=True)
class Cursor:
    """Where a stream stands: ``n`` items, the record covers ``[lo, hi)``, ``ahead`` positions were
    looked up or scheduled, ``yielded`` handed out, ``finished``: the iteration ended."""

    n: int
    lo: int = 0
    hi: int = 0
    ahead: int = 0
    yielded: int = 0
    finished: bool = False


def released(yielded: int, consumed: int | None, window: int, *, retired: bool = False) -> int:
    """Items of a stream that no longer need protection: those the loop reported consumed (all handed
    out once its loop ``retired``), else all but the last ``window`` handed out."""
    if retired:
        return yielded
    if consumed is None:
        return max(0, yielded - window)
    return min(yielded, consumed)


def lease_span(cursor: Cursor, consumed: int | None, sizing: Sizing, *, chunk: int, want: int | None = None,
               retired: bool = False) -> tuple[int, int]:
    """The span ``[lo, hi)`` a stream's record covers next (pure).

    ``want``: a position about to be looked up or filled (covered, with ``chunk`` more ahead, when the
    record does not cover it yet). Without it the span only shrinks: the start moves past what the loop
    consumed (:func:`released` with ``sizing.window``), the end back to ``chunk`` past what was handed
    out or looked up (a smaller ``chunk``: the budget's share shrank), or to what was handed out once
    ``finished``. Always: the start never moves back, every handed-out item not released stays covered,
    and the end never passes ``n``.
    """
    lo = max(cursor.lo, released(cursor.yielded, consumed, sizing.window, retired=retired))
    if cursor.finished:
        hi = min(cursor.hi, cursor.yielded)
    elif want is not None and want >= cursor.hi:
        hi = min(cursor.n, want + chunk)
    else:
        hi = min(cursor.hi, max(lo, cursor.ahead, cursor.yielded) + chunk)
    return lo, max(lo, hi)


# ---------------------------------------------------------------- the record and the stream's lease


_writers: "weakref.WeakValueDictionary[str, LeaseRecord]" = weakref.WeakValueDictionary()  # path: its writer now


class LeaseRecord:
    """One protection record of ``cache`` (``prot/<owner>@<writer>.<slot>.rec``): the entry names a
    loop may still open. Written only when its names change; a record that cannot grow on a full
    cache disk keeps its old names and raises :class:`~ucmagic.errors.CacheFullError`. A new record of the same
    path (the stream's next iteration) takes it over: the last one stops, and its drop no longer touches the file."""

    def __init__(self, cache: FileCache, owner: str, slot: int | str) -> None:
        self.cache = cache
        self.path = cache.records.record_path(owner, slot)
        self._named: tuple[str, ...] | None = None
        self._mu = threading.Lock()
        self._stop = threading.Event()
        last = _writers.get(self.path)
        if last is not None:  # the stream's last iteration here (its refresher may still run): it stops now, after
            last.stop()  # a write or drop under way, so it never drops this record nor closes its descriptor
        _writers[self.path] = self

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def wait_stopped(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for :meth:`stop` (or :meth:`drop`); whether it came."""
        return self._stop.wait(seconds)

    def write(self, names: Sequence[str]) -> None:
        """Name exactly ``names`` (no write when they are the ones named already; none once stopped)."""
        key = tuple(names)
        with self._mu:
            if self.stopped or key == self._named:
                return
            try:
                self.cache.records.write_record(self.path, key)
            except OSError as exc:  # the record could not grow (the old one stays whole): a full cache disk
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self.cache.budget_keeper.disk_full(sum(len(n) + 1 for n in key)) from exc
                raise
            self._named = key

    def drop(self) -> None:
        """Name nothing: the record goes, and writes stop. Once stopped, nothing: the path is the next iteration's
        record now (or went with its dataset), and dropping it would unlink that record and close its descriptor
        under its writer (EBADF in a DataLoader worker starting its next epoch)."""
        with self._mu:
            if self._stop.is_set():
                return
            self._stop.set()
            self._named = None
            self.cache.records.drop_record(self.path)

    def clear(self) -> None:
        """Name nothing for now: the record goes; a later :meth:`write` makes it again."""
        with self._mu:
            self._named = None
            self.cache.records.drop_record(self.path)

    def stop(self) -> None:
        """Write no more (the stream's next iteration writes it, or its dataset is gone); the file stays."""
        with self._mu:
            self._stop.set()


class Sizer(Protocol):
    """The sizing of a stream's protection now (None: no budget); see :class:`~ucmagic.files.windows.LiveSizing`."""

    def __call__(self) -> Sizing | None: ...


class Names(Protocol):
    """A stream's items as cache entry names (:class:`~ucmagic.files.stream_items.StreamItems`)."""

    def __len__(self) -> int: ...

    def names(self, lo: int, hi: int) -> list[str]: ...


class StreamLease:
    """Protection of one (rank, worker) stream's items: its record names the entries from the first
    one the loop has not consumed to the last one looked up or scheduled for read-ahead
    (:func:`lease_span`). Consumption comes from the loader's channel or, without it, from a window
    of the last ``window`` items handed out. See the module for the call order."""

    def __init__(self, record: LeaseRecord, items: Names, *, quantum: int, window: int, chunk: int,
                 consumption: StreamConsumption = NO_REPORTS, sizer: Sizer | None = None,
                 sizing: Sizing | None = None, budgeted: bool = False) -> None:
        self.record = record
        self.items = items
        self.sizer = sizer
        self._sized_at = time.monotonic()
        self.budgeted = budgeted  # fills honour a cache_limit (this process's or another's)
        self.quantum = max(1, quantum)
        self._chunk = max(1, chunk)  # items covered ahead at a time unless a shared budget asks fewer
        self.window, self.chunk = max(1, window), self._chunk
        self.release: int | None = None  # handed-out items past the window released at a time
        self.read_ahead_bytes: int | None = None
        self.resized = threading.Event()  # the read-ahead's byte bound changed: its lane restarts
        self.consumption = consumption
        self.n = len(items)
        self.lo = self.hi = 0  # the record covers positions [lo, hi)
        self.ahead = 0  # positions looked up or scheduled for read-ahead so far (hi covers them)
        self.yielded = 0  # positions handed out (skipped ones included)
        self.finished = False
        self.skipped = 0
        self._mu = threading.Lock()
        self._refreshing = False
        _active[record.path] = self
        if sizing is not None:
            self._apply(sizing)
            self.resized.clear()

    @property
    def cursor(self) -> Cursor:
        """Where the stream stands now (for :func:`lease_span`)."""
        return Cursor(self.n, self.lo, self.hi, self.ahead, self.yielded, self.finished)

    def looked_up(self, pos: int) -> None:
        """Positions before ``pos`` were looked up (a warm run): they need no cover from now on."""
        self.ahead = pos

    def _sizing(self) -> Sizing:
        return Sizing(self.window, 0, self.chunk, self.release)

    def _span(self, want: int | None = None) -> None:
        """Move the span to :func:`lease_span`'s (under ``_mu``)."""
        self.lo, self.hi = lease_span(self.cursor, self._consumed(), self._sizing(), chunk=self.chunk, want=want,
                                      retired=self.consumption.retired())

    def _write(self) -> None:
        self.record.write(self.items.names(self.lo, self.hi))

    def _consumed(self) -> int | None:
        return self.consumption.consumed()

    def cover(self, pos: int) -> None:
        """Make sure the record names position ``pos`` before it is looked up or filled."""
        if pos >= self.ahead:
            self.ahead = pos + 1
        if pos < self.hi:
            return
        with self._mu:
            self._span(want=pos)
            self._write()

    def handed(self, pos: int) -> None:
        """Position ``pos`` is about to be handed out."""
        self.yielded = pos + 1
        if pos % self.quantum == 0:
            self.refresh()

    def resize(self) -> None:
        """Follow the budget and the streams sharing it, at most every :data:`RESIZE_S`: another
        process's streams joining the cache shrink the window (what it protected beyond the new
        window is released by the next refresh), their leaving lets it grow back."""
        if self.sizer is None:
            return
        now = time.monotonic()
        with self._mu:
            if now - self._sized_at < RESIZE_S:
                return
            self._sized_at = now
        try:
            sizing = self.sizer()
        except OSError:
            return
        self.budgeted = sizing is not None
        if sizing is not None:
            self._apply(sizing)
            self.start_refresher()

    def _apply(self, sizing: Sizing) -> None:
        self.window = max(1, sizing.window)
        self.release = sizing.release
        self.chunk = self._chunk if sizing.cover is None else max(1, min(self._chunk, sizing.cover))
        with self._mu:  # covered fewer ahead now: what was covered beyond it goes from the record
            if not self.finished:  # (a window past the stream's end: only the end of the span moves)
                _, hi = lease_span(self.cursor, None, Sizing(self.n + 1, 0), chunk=self.chunk)
                if hi < self.hi:
                    self.hi = hi
                    self._write()
        if sizing.read_ahead_bytes != self.read_ahead_bytes:
            self.read_ahead_bytes = sizing.read_ahead_bytes
            self.resized.set()

    def refresh(self) -> None:
        """Release what the loop has consumed since the last write."""
        self.resize()
        consumed, retired = self._consumed(), self.consumption.retired()
        done = released(self.yielded, consumed, self.window, retired=retired)
        # exact with consumption reports under a budget; else release in steps (each write costs
        # syscalls; without a budget only the free-disk floor evicts, so holding longer is cheap: UNBUDGETED_STEP)
        # an ended stream's refresher ends with its loop
        exact = consumed is not None and (self.budgeted or self.finished)
        # a window sized to fit a budget is released in its sizing's steps (a quarter of it where there is room)
        release = self.window // 4 if self.release is None else self.release
        step = self.quantum if exact else max(self.quantum, release, 1 if self.budgeted else UNBUDGETED_STEP)
        if done - self.lo >= step or (exact and done > self.lo and done >= self.yielded):
            with self._mu:
                if self.record.stopped and self.finished:
                    return
                if done > self.lo:
                    self.lo = done
                    if self.finished and self.lo >= self.hi:
                        self.record.drop()
                    else:
                        self._write()

    def retired(self) -> bool:
        """Whether the loader's loop left the iteration this stream belongs to."""
        return self.consumption.retired()

    def may_exceed(self, pos: int) -> bool:
        """True when the loop is (or will next be) blocked on position ``pos``: its fill may exceed the budget."""
        if self.consumption.retired():  # the loop left: its fills never wait for room it will not free
            return True
        c = self._consumed()
        base = self.yielded if c is None else c + self.skipped
        return pos < base + self.quantum

    def stop(self) -> None:
        """Write this stream's record no more (its next iteration has started, or its dataset is gone)."""
        with self._mu:  # a write under way ends first, and none starts after (writes happen under _mu)
            self.record.stop()

    def start_refresher(self) -> None:
        """Release consumed items every :data:`REFRESH_S`, also after the stream ended (the loop still
        holds its last batches), until all are consumed or this stream starts its next iteration."""
        with self._mu:  # asked from the loop, the refresher and fill threads (resize)
            if self._refreshing or self.record.stopped:
                return
            self._refreshing = True

        def loop() -> None:
            while not self.record.wait_stopped(REFRESH_S):
                with contextlib.suppress(OSError):
                    self.refresh()

        threading.Thread(target=loop, name="ucmagic-protect", daemon=True).start()

    def finish(self, *, abandoned: bool = False) -> None:
        """End of the stream's iteration (exhausted, or failed: the loop still opens what was handed out before
        the error reaches it): keep only what was handed out and not yet consumed. An iteration left by
        ``break`` or ``close()`` (``abandoned``) keeps nothing: no consumption will be reported for it any more,
        so nothing would ever release its items."""
        with self._mu:
            self.finished = True
            if abandoned:
                self.lo = self.hi = 0
                self.record.drop()
                return
            self._span()
            if self.hi > self.lo:
                self._write()
            else:
                self.record.drop()
                return
        if self._consumed() is not None:
            self.start_refresher()
        else:
            self.record.stop()


_active: "weakref.WeakValueDictionary[str, StreamLease]" = weakref.WeakValueDictionary()  # no lifeline


def drop_records(cache: FileCache, paths: set[str], pid: int) -> None:
    """A dataset object is gone: the protection records it wrote in process ``pid`` go too."""
    if os.getpid() == pid:  # a forked child inherits the finaliser: only the writing process drops them
        for path in list(paths):
            lease = _active.get(path)
            if lease is not None:  # its refresher may outlive the dataset: it stops, then the record goes
                lease.stop()
            cache.records.drop_record(path)



class StreamLeases:
    """The stream leases of one dataset object in one process: their records carry the object's number
    here, and go with the object (garbage collection; at exit the owner's records go with it). See the
    module for the call order."""

    def __init__(self, cache: FileCache) -> None:
        self.cache = cache
        self._pid = self._serial = 0
        self._paths: set[str] = set()

    def __getstate__(self) -> dict[str, object]:
        return {"cache": self.cache}  # per process

    def __setstate__(self, st: dict[str, object]) -> None:
        self.__init__(st["cache"])  # type: ignore[misc]

    def _number(self) -> int:
        """This object's number in this process (a DataLoader worker's copy gets its own)."""
        pid = os.getpid()
        if self._pid != pid:
            self._serial, self._pid = serial(), pid
            self._paths = set()
            # on garbage collection only: at exit the owner's records go with it (release_at_exit), and
            # a DataLoader worker's stay while its loop still holds the last batches it handed out
            weakref.finalize(self, drop_records, self.cache, self._paths, pid).atexit = False
        return self._serial

    def read_ahead_bytes(self, streams: int) -> int:
        """Bytes one stream may hold in flight: its share of the budget, else of the free disk above the floor."""
        cache = self.cache
        if cache.limit is not None:
            cap = cache.limit
        else:
            du = shutil.disk_usage(cache.root)
            cap = du.free - int(du.total * cache.min_free)
        return max(1, cap // max(1, streams))

    def open(self, items: Names, owner: str, slot: int, *, policy: WindowPolicy, consumption: StreamConsumption,
             quantum: int, depth: int) -> StreamLease:
        """The :class:`StreamLease` protecting ``items`` for stream ``slot`` on behalf of ``owner``, sized
        for the budget and the live streams (:class:`BudgetTooSmallError` here, at the first item, where
        this process's share is too small)."""
        cache = self.cache
        _, world, _, _, _, nworkers = dist_info()
        keeper = cache.budget_keeper
        budget = keeper.budget()
        streams, reported = nworkers * local_world_size(world), consumption.consumed() is not None
        # one record per stream of this dataset object: another dataset iterated in the same process
        # (a validation loop, two datasets zipped) keeps its own
        record = LeaseRecord(cache, owner, f"{slot}-{self._number()}")
        self._paths.add(record.path)
        record.write([])  # this stream counts among the live ones before it sizes itself

        def size(b: int | None) -> Sizing:
            return policy.protection(b, streams, reported, cache.records.live_streams(),
                                     unbudgeted_bytes=self.read_ahead_bytes(streams))

        try:
            try:
                sizing = size(budget)
            except BudgetTooSmallError as exc:
                # refused by a budget another dataset set (this one set none, or a larger one): sized again
                # under the budget in force once datasets on their way out are gone, and refused then
                # naming it as theirs; this dataset's own budget is refused at once
                if budget is None or (cache.limit is not None and budget >= cache.limit):
                    raise
                budget = keeper.settled(budget)
                try:
                    sizing = size(budget)
                except BudgetTooSmallError:
                    raise BudgetTooSmallError(
                        f"{exc} -- the budget in force is {keeper.budget_name(budget or 0)}; raise that "
                        "dataset's cache_limit, or let it go (del it, end its process) first") from None
        except BudgetTooSmallError:
            record.drop()
            raise
        lease = StreamLease(record, items, quantum=quantum, window=sizing.window, chunk=max(MIN_COVER, depth),
                            consumption=consumption, budgeted=budget is not None,
                            sizer=LiveSizing(policy, cache, streams, reported), sizing=sizing)
        if budget is not None:
            lease.start_refresher()
        return lease
