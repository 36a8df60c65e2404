"""UCVolumeDataset: stream files of a slow volume through the persistent local cache."""
from __future__ import annotations

import contextlib
import errno
import gc
import os
import shutil
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Sequence

import numpy as np

from torch.utils.data import IterableDataset, get_worker_info

from . import plan
from .. import telemetry
from .._util import DEFAULT_RETRIES, is_integer, path_under
from .cache import FileCache, SeenEntries
from .cache_layout import (cache_key, cache_keys, cache_root, entry_files, map_relpath, safe_suffix, serial,
                           space_of, unmap_relpath, version_stamp)
from .locks import process_tag
from .protection import release_at_exit
from ..errors import NotAnEntryError
from ..dist import dist_info, local_world_size
from .epochs import EpochTracking, StateSchema, refuse_split_twice
from ..errors import (BudgetTooSmallError, FetchError, InvalidArgumentError,
                     SourceChangedError)
from .fetch import read_ahead, restart_timeout, shared_pool
from .filler import CacheFiller, SkipPolicy
from .listing import VALIDATE_MODES, Listing, forget_listing, open_listing
from ..progress import Progress
from .._shared import SharedBits, SharedInts
from ..telemetry import SharedCounters, percentiles
from .volume import FileEntry, Volume, copy_error, open_volume
from .windows import DEFAULT_LEASE_ITEMS, LiveSizing, Sizing, WindowPolicy

STATE_VERSION = 2  # 2: the array-free epoch order (plan.ORDER_VERSION 2)
STREAM_CHUNK = 512  # items of a stream decoded from the listing at once (~450 B each while kept)
STREAM_CHUNKS_KEPT = 8  # decoded chunks kept per stream (read-ahead and protection stay within them)
DEFAULT_INFLIGHT = 128  # files in flight per rank, spread over its DataLoader workers
WARM_STREAK = 64  # consecutive cache hits after which iteration switches to whole runs of lookups
RESIZE_S = 1.0  # how often a stream re-reads the budget and the streams sharing the cache


COLD_MISSES = 8  # consecutive misses of lookups on the loop thread after which they are only probes
COLD_PROBE_EVERY = 16  # ... of every 16th item, until hits come back
MIN_COVER = 16  # items a stream's record covers ahead at least (unless a shared budget asks fewer)
OTHER_BUDGET_GRACE_S = 3.0  # a budget too small set by another dataset is re-read this long before it is refused
SKIPPED_NAMED = 3  # skipped files named in an epoch's warning (the rest are counted)
CHECKED_HERE = 16  # validate="lazy": files checked on the calling thread before timing decides on threads
MAX_STREAMS = 64  # DataLoader workers whose consumption ucmagic.DataLoader reports (more share slots)
_TRACKED = MAX_STREAMS  # index of the "ucmagic.DataLoader reports consumption" flag in the channel
_GENERATION = MAX_STREAMS + 1  # index of the loader's iteration count: a stream of an earlier one is stale
STALE_CONSUMED = 1 << 62  # what a stale stream reads as consumed: all it handed out (nothing stays protected)


def check_seed(seed: Any) -> int:
    """``seed`` as an int: an int, or an integral value (numpy integers); anything else is an error
    naming ``seed`` (``"x"``, ``1.5``, ``True`` are rejected, never converted or truncated)."""
    if not is_integer(seed):
        raise InvalidArgumentError(f"seed must be an integer, got {seed!r} ({type(seed).__name__}): "
                                   "pass an int such as seed=0")
    return int(seed)


def _source_missing(exc: BaseException) -> bool:
    """True when a fetch failed because the source file is gone (deleted after the listing)."""
    return isinstance(exc, FetchError) and isinstance(exc.__cause__, FileNotFoundError)


def _takes_expect(volume: Volume) -> bool:
    """True when ``volume.copy_to`` accepts ``expect=`` (user subclasses written before it may not)."""
    cls = type(volume)
    known = _EXPECT.get(cls)
    if known is None:
        import inspect

        try:
            params = inspect.signature(volume.copy_to).parameters
            known = "expect" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            known = False
        _EXPECT[cls] = known
    return known


_EXPECT: dict[type, bool] = {}


def _release_free_heap() -> None:
    """Hand memory freed by the fetch threads back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Each thread allocates from its own glibc arena; what a stream frees there stays mapped (and
    counted in the process's own memory) until trimmed, so without this a worker's memory grows
    with the number of items it fetched (measured: bench/listing.py, docs/scaling.md).
    """
    trim = _TRIM[0]
    if trim is None:
        trim = lambda: None  # noqa: E731 - the no-op
        if sys.platform.startswith("linux"):
            import ctypes

            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL("libc.so.6").malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                trim = lambda: fn(0)  # noqa: E731
        _TRIM[0] = trim
    trim()


_TRIM: list[Callable[[], Any] | None] = [None]

CHECK_THREADS = 16  # threads of one process's validate="lazy" checks (their own pool: a hit waits on them)
FAST_CHECK_S = 50e-6  # a check (one stat) faster than this: the rest of the chunk is checked on the calling thread


@dataclass(frozen=True)
class SourceFile:
    """Where a cached file came from (:meth:`UCVolumeDataset.source_of`)."""

    source: str  # the file in the volume, as ucmagic displays it (a local path or a URI)
    rel: str  # its path relative to the dataset's root (what the cached path ends with)
    size: int  # bytes, as listed
    mtime: float  # modification time (seconds since the epoch), as listed


class CheckedFiles(SharedBits):
    """One bit per file of a listing: "its size and mtime were checked against the volume", in
    shared memory seen by every DataLoader worker (n/8 bytes). Lost updates (two processes setting
    bits of one byte at once) only cause a second check. A plain pickle forgets the checks."""

    checked_prefix = SharedBits.prefix  # how many of ``indices``, from the first, are checked

    def _snapshot(self) -> tuple[int, bytes]:
        return self.n, b""  # a copy (a saved dataset) checks again


class ConsumptionChannel:
    """A loader's side of a UCVolumeDataset's consumption counters (see ``consumption_channel``)."""

    def __init__(self, arr: SharedInts) -> None:
        self._a = arr

    def reset(self, streams: int) -> None:
        """A new iteration with ``streams`` worker streams: nothing consumed yet, reports on.

        Streams of the iteration before (persistent workers still finishing the batches torch
        prefetched after a ``break``) become stale: they read everything as consumed, so their
        protection ends and their fills never wait for room the loop will not free.
        """
        self._a[_GENERATION] = self._a[_GENERATION] + 1
        for i in range(MAX_STREAMS):
            self._a[i] = 0
        self._a[_TRACKED] = 1

    _generation = _GENERATION  # a class attribute: retire() runs at interpreter exit too, after module globals went

    def retire(self) -> None:
        """The loop left the current iteration (``break``, an error, Ctrl-C) or its workers are being
        stopped: its streams become stale as at :meth:`reset`, so their fills stop waiting for room
        that no consumption will free (a worker blocked there would hold up torch's shutdown)."""
        g = self._generation
        self._a[g] = self._a[g] + 1

    def __setitem__(self, stream: int, items: int) -> None:
        if stream < MAX_STREAMS:
            self._a[stream] = items


class _Stream:
    """Protection of one (rank, worker) stream's items: an on-disk record listing the entries from
    the first one the loop has not consumed to the last one scheduled for read-ahead.

    Consumption comes from ucmagic.DataLoader's channel (items the loop has finished with) or,
    without it, from a window of the last ``window`` items handed out.
    """

    def __init__(self, cache: FileCache, owner: str, slot: int | str, items: "StreamItems", *, quantum: int,
                 window: int, chunk: int, consumed: Callable[[], int | None], budgeted: bool = False,
                 sizer: Callable[[], Sizing | None] | None = None, sizing: Sizing | None = None) -> None:
        self.cache = cache
        self.sizer = sizer  # the protection for now (None: no budget), asked every RESIZE_S (see resize)
        self._sized_at = time.monotonic()
        self.budgeted = budgeted  # fills honour a cache_limit (this process's or another's)
        self.path = cache.record_path(owner, slot)
        self.items = items
        self.quantum = max(1, quantum)
        self._chunk = max(1, chunk)  # items covered ahead at a time unless a shared budget asks fewer
        self.window, self.chunk = max(1, window), self._chunk
        self.release: int | None = None  # handed-out items past the window released at a time (None: window // 4)
        self.read_ahead_bytes: int | None = None
        self.resized = threading.Event()  # the read-ahead's byte bound changed: its lane restarts
        self.consumed = consumed
        self.lo = self.hi = 0  # the record covers positions [lo, hi)
        self.ahead = 0  # positions looked up or scheduled for read-ahead so far (hi covers them)
        self.yielded = 0  # positions handed out (skipped ones included)
        self.skipped = 0
        self.finished = False
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._refreshing = False
        old = _active_streams.get(self.path)
        if old is not None:  # this process's previous iteration of the same stream: it stops writing
            old.stop()
        _active_streams[self.path] = self
        if sizing is not None:
            self._apply(budgeted, sizing)
            self.resized.clear()

    def _write(self) -> None:
        if not self._stop.is_set():  # stopped (its dataset is gone, or its next iteration began): no more
            names = self.items.names(self.lo, self.hi)
            try:
                self.cache.write_record(self.path, names)
            except OSError as exc:  # the record could not grow (the old one stays whole): a full cache disk
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise self.cache.disk_full(sum(len(n) + 1 for n in names)) from exc
                raise

    def _done(self) -> int:
        c = self.consumed()
        if c is None:
            return max(0, self.yielded - self.window)
        return min(self.yielded, c)

    def cover(self, pos: int) -> None:
        """Make sure the record names position ``pos`` before it is looked up or filled."""
        if pos >= self.ahead:
            self.ahead = pos + 1
        if pos < self.hi:
            return
        with self._mu:
            self.lo = max(self.lo, self._done())
            self.hi = min(len(self.items), pos + self.chunk)
            self._write()

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
        self._apply(sizing is not None, sizing)
        if sizing is not None:
            self.start_refresher()

    def _apply(self, budgeted: bool, sizing: Sizing | None) -> None:
        self.budgeted = budgeted
        if sizing is None:  # no budget (any more): the window stays as it is
            return
        self.window = max(1, sizing.window)
        self.release = sizing.release
        self.chunk = self._chunk if sizing.cover is None else max(1, min(self._chunk, sizing.cover))
        with self._mu:  # covered fewer ahead now: what was covered beyond it goes from the record
            hi = min(self.hi, max(self.lo, self.ahead, self.yielded) + self.chunk)
            if hi < self.hi and not self.finished:
                self.hi = hi
                self._write()
        if sizing.read_ahead_bytes != self.read_ahead_bytes:
            self.read_ahead_bytes = sizing.read_ahead_bytes
            self.resized.set()

    def refresh(self) -> None:
        """Release what the loop has consumed since the last write."""
        self.resize()
        c = self.consumed()
        done = max(0, self.yielded - self.window) if c is None else min(self.yielded, c)
        # exact with consumption reports under a budget; else release in steps (each write costs
        # syscalls; without a budget only the free-disk floor evicts, so holding a little longer is cheap)
        exact = c is not None and (self.budgeted or self.finished)  # an ended stream's refresher ends with its loop
        # a window sized to fit a budget is released in its sizing's steps (a quarter of it where there is room)
        release = self.window // 4 if self.release is None else self.release
        step = self.quantum if exact else max(self.quantum, release, 1 if self.budgeted else 64)
        if done - self.lo >= step or (exact and done > self.lo and done >= self.yielded):
            with self._mu:
                if self._stop.is_set() and self.finished:
                    return
                if done > self.lo:
                    self.lo = done
                    if self.finished and self.lo >= self.hi:
                        self.cache.drop_record(self.path)
                        self._stop.set()
                    else:
                        self._write()

    def retired(self) -> bool:
        """Whether ucmagic.DataLoader's loop left the iteration this stream belongs to."""
        return self.consumed() == STALE_CONSUMED

    def may_exceed(self, pos: int) -> bool:
        """True when the loop is (or will next be) blocked on position ``pos``: its fill may exceed the budget."""
        c = self.consumed()
        base = self.yielded if c is None else c + self.skipped
        return pos < base + self.quantum

    def stop(self) -> None:
        """Write this stream's record no more (its next iteration has started, or its dataset is gone)."""
        with self._mu:  # a write under way ends first, and none starts after (writes happen under _mu)
            self._stop.set()

    def start_refresher(self) -> None:
        """Release consumed items every 10 ms, also after the stream ended (the loop still holds its
        last batches), until all are consumed or this stream starts its next iteration."""
        with self._mu:  # asked from the loop, the refresher and fill threads (resize)
            if self._refreshing or self._stop.is_set():
                return
            self._refreshing = True

        def loop() -> None:
            while not self._stop.wait(0.01):
                with contextlib.suppress(OSError):
                    self.refresh()

        threading.Thread(target=loop, name="ucmagic-protect", daemon=True).start()

    def finish(self, *, abandoned: bool = False) -> None:
        """End of the stream's iteration: keep only what was handed out and not yet consumed. An
        iteration left by an exception, ``break`` or ``close()`` (``abandoned``) keeps nothing: no
        consumption will be reported for it any more, so nothing would ever release its items."""
        with self._mu:
            self.finished = True
            if abandoned:
                self.lo = self.hi = 0
                self.cache.drop_record(self.path)
                self._stop.set()
                return
            self.lo = max(self.lo, self._done())
            self.hi = min(self.hi, self.yielded)
            if self.hi > self.lo:
                self._write()
            else:
                self.cache.drop_record(self.path)
                self._stop.set()
                return
        if self.consumed() is not None:
            self.start_refresher()
        else:
            self._stop.set()


_active_streams: "weakref.WeakValueDictionary[str, _Stream]" = weakref.WeakValueDictionary()  # no lifeline


class _Retired(BaseException):
    """Ends a stream whose ucmagic.DataLoader loop left the iteration (:meth:`_Stream.retired`); a
    BaseException, so no handler of errors takes it."""


def _drop_records(cache: FileCache, paths: set[str], pid: int) -> None:
    """A dataset object is gone: the protection records it wrote in process ``pid`` go too."""
    if os.getpid() == pid:  # a forked child inherits the finaliser: only the writing process drops them
        for path in list(paths):
            stream = _active_streams.get(path)
            if stream is not None:  # its refresher may outlive the dataset: it stops, then the record goes
                stream.stop()
            cache.drop_record(path)


_live_iterations: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _close_at_exit(it: Iterator[str]) -> None:
    """Close ``it`` at interpreter exit if it is still alive then (a loop left mid-epoch): its
    cleanup runs while modules are intact (no "Exception ignored ... TypeError" at exit) and its
    read-ahead stops."""
    if not _live_iterations:
        import atexit

        atexit.unregister(_close_live_iterations)
        atexit.register(_close_live_iterations)
    _live_iterations.add(it)


def _close_live_iterations() -> None:
    for it in list(_live_iterations):
        with contextlib.suppress(Exception):
            it.close()


class _Chunk:
    """One decoded chunk of a stream: listing indices, cache keys, relative paths, entry files (for
    lookups and protection records), version stamps and sizes; the :class:`FileEntry` objects only
    once asked for (a warm run never needs them)."""

    __slots__ = ("idx", "arr", "keys", "rels", "files", "stamps", "sizes", "entries")

    def __init__(self, arr: np.ndarray, keys: list[tuple[str, str]], sizes: list[int], rels: list[str],
                 space: str, plain: bool = False) -> None:
        self.arr = arr
        self.idx: list[int] = arr.tolist()
        self.keys = keys
        self.rels = rels
        self.files = entry_files(space, rels, plain=plain)
        self.stamps = [version_stamp(k) for k, _ in keys]
        self.sizes = sizes
        self.entries: list[FileEntry] | None = None


class StreamItems:
    """One stream's items in delivery order, decoded from the listing a chunk at a time.

    ``order(positions)`` maps epoch positions to listing indices (e.g. :func:`plan.order_at`);
    ``ranges`` are the stream's epoch positions (:func:`plan.stream_positions`). Only the last
    :data:`STREAM_CHUNKS_KEPT` chunks are held; an older one is recomputed when asked for again, so
    memory does not grow with the stream. Thread-safe.
    """

    def __init__(self, listing: Listing, ranges: Sequence[plan.Range], order: Callable[[np.ndarray], np.ndarray],
                 keys: Callable[[np.ndarray], list[tuple[str, str]]], space: str,
                 chunk: int = STREAM_CHUNK) -> None:
        self.listing = listing
        self.space = space
        self.ranges = list(ranges)
        self.order = order
        self.keys = keys
        self.chunk = max(1, int(chunk))
        self._len = plan.ranges_len(self.ranges)
        self._kept: OrderedDict[int, _Chunk] = OrderedDict()
        self._last: tuple[int, Any] = (-1, None)
        self._mu = threading.Lock()

    def __len__(self) -> int:
        return self._len

    def indices_chunks(self) -> Iterator[np.ndarray]:
        """Listing indices of the whole stream, in order, one chunk at a time."""
        for a in range(0, self._len, self.chunk):
            yield self.order(plan.positions(plan.take(self.ranges, a, min(a + self.chunk, self._len))))

    def _at(self, c: int) -> _Chunk:
        last = self._last
        if last[0] == c:  # the chunk asked for last (several lookups per item): no lock, no reordering
            chunk: _Chunk = last[1]
            return chunk
        got = self._at_kept(c)
        self._last = (c, got)
        return got

    def _at_kept(self, c: int) -> _Chunk:
        with self._mu:
            got = self._kept.get(c)
            if got is not None:
                self._kept.move_to_end(c)
                return got
        a = c * self.chunk
        idx = self.order(plan.positions(plan.take(self.ranges, a, min(a + self.chunk, self._len))))
        got = _Chunk(idx, self.keys(idx), self.listing.sizes[idx].tolist(), self.listing.paths(idx),
                     self.space, self.listing.all_plain(idx))
        with self._mu:
            self._kept[c] = got
            while len(self._kept) > STREAM_CHUNKS_KEPT:
                self._kept.popitem(last=False)
        return got

    def index(self, pos: int) -> int:
        return self._at(pos // self.chunk).idx[pos % self.chunk]

    def entry(self, pos: int) -> FileEntry:
        got = self._at(pos // self.chunk)
        entries = got.entries
        if entries is None:  # decoded once per chunk (two threads at once: the same list twice)
            entries = got.entries = [FileEntry(r, s, m) for r, s, m in
                                     zip(got.rels, got.sizes, self.listing.mtimes[got.arr].tolist())]
        return entries[pos % self.chunk]

    def size(self, pos: int) -> int:
        return self._at(pos // self.chunk).sizes[pos % self.chunk]

    def key_at(self, pos: int) -> tuple[str, str]:
        return self._at(pos // self.chunk).keys[pos % self.chunk]

    def file_at(self, pos: int) -> str:
        """The entry file (under the cache's ``files/``) of position ``pos``, at its first place."""
        return self._at(pos // self.chunk).files[pos % self.chunk]

    def rel_at(self, pos: int) -> str:
        """The relative path (in the volume) of position ``pos``."""
        return self._at(pos // self.chunk).rels[pos % self.chunk]

    def run(self, lo: int, hi: int) -> tuple[np.ndarray, list[int], list[str], list[int], list[int]]:
        """Listing indices (as an array, for vectorised tests, and as a list), cache entry files
        (:func:`ucmagic.files.cache_layout.entry_file`), sizes and version stamps of positions
        ``[lo, hi)`` (within one chunk)."""
        c = lo // self.chunk
        a, b = lo - c * self.chunk, hi - c * self.chunk
        got = self._at(c)
        return got.arr[a:b], got.idx[a:b], got.files[a:b], got.sizes[a:b], got.stamps[a:b]

    def names(self, lo: int, hi: int) -> list[str]:
        """Cache entry names (:func:`.cache_layout.entry_file`) of positions ``[lo, hi)`` (for protection records)."""
        out: list[str] = []
        pos = lo
        while pos < hi:
            c = pos // self.chunk
            end = min(hi, (c + 1) * self.chunk)
            out.extend(self._at(c).files[pos - c * self.chunk:end - c * self.chunk])
            pos = end
        return out


_FetchItem = Callable[..., "tuple[str | BaseException, bool]"]  # UCVolumeDataset._fetch_item


class _EpochStream:
    """One iteration of one (rank, worker) stream, in two lanes that take turns.

    The **warm lane** looks a run of positions up on the loop thread at once and hands out the hits
    (a warm cache: no read-ahead, no per-item calls); a run that misses hands over to the
    **read-ahead lane**, which fills positions through :func:`read_ahead` (hits still served on the
    loop thread by :meth:`hit`) until a streak of :data:`WARM_STREAK` hits hands back. Both hand
    out through :meth:`_handing`. Fills run on pool threads: what they share with the loop thread
    (``misses``, ``probed``, ``timing``) is read and written under ``_mu``.
    """

    def __init__(self, ds: UCVolumeDataset, items: StreamItems, stream: _Stream, *, main: bool, depth: int,
                 seen: SeenEntries, checked: CheckedFiles | None, fetch_item: _FetchItem,
                 check_ahead: Callable[[StreamItems, int], None], on_handed: Callable[[int], None] | None) -> None:
        self.ds, self.items, self.stream, self.depth = ds, items, stream, depth
        self.cache, self.counters, self.n = ds.cache, ds.counters, len(items)
        self.seen = seen  # the cache entries this process found (warm lookups)
        self.checked = checked  # validate="lazy": the files checked against the volume
        self.fetch_item, self.check_ahead = fetch_item, check_ahead  # the dataset's own fill and lazy check
        self.on_handed = on_handed  # told how many items were handed out (the main process: state_dict)
        self.parent = None if main else os.getppid()  # a worker's waits end when its main process is gone
        self.pos = 0  # the next position to hand out
        self._mu = threading.Lock()
        self.misses = 0  # consecutive misses of lookups on the loop thread (a cold cache: probes only)
        self.probed: set[int] = set()  # looked up here and missed: the fill need not look again
        # pos -> (hit, fetch seconds, a hit found here that the shared counters have yet to count)
        self.timing: dict[int, tuple[bool, float, bool]] = {}
        # positions a fill call has counted (a miss or a hit) and that are not handed out yet: a
        # read-ahead lane that ends leaves calls behind, whose positions are handed out later by a
        # warm run or another lane, and must not be counted again there
        self.claimed: set[int] = set()
        self.hits = self.delivered = 0  # loop thread only: added to the shared counters per batch
        self.skipped: list[str] = []  # the first SKIPPED_NAMED skipped files, for the warning

    def run(self) -> Iterator[str]:
        """Every position's path, from a warm run first (a second epoch, a restart find the cache warm)."""
        warm = True
        while self.pos < self.n:
            warm = yield from (self._warm_lane() if warm else self._read_ahead_lane())

    def end(self, *, abandoned: bool) -> None:
        """Counters, protection and the skipped-files warning once the iteration ends."""
        self.flush()
        self.stream.finish(abandoned=abandoned)
        _release_free_heap()
        if self.skipped:
            total = self.stream.skipped
            more = f" and {total - len(self.skipped)} more" if total > len(self.skipped) else ""
            warnings.warn(f"ucmagic: skipped {total} file(s) this epoch: {'; '.join(self.skipped)}{more} "
                          "(counted in stats()['errors'])", stacklevel=3)

    # ---------------------------------------------------------------- hand-out bookkeeping

    def _handing(self, pos: int) -> None:
        """Bookkeeping of position ``pos`` just before it is handed out (both lanes)."""
        self.stream.yielded = pos + 1
        if self.on_handed is not None:
            self.on_handed(pos + 1)
        if pos % self.stream.quantum == 0:
            self.stream.refresh()

    def count(self, hits: int, delivered: int, *, flush: bool) -> None:
        self.hits += hits
        self.delivered += delivered
        if flush:
            self.flush()

    def _unclaim(self, start: int, end: int) -> int:
        """Forget the claims of positions ``start``-``end`` (about to be handed out); how many there were."""
        if not self.claimed:
            return 0
        with self._mu:
            gone = [p for p in self.claimed if start <= p < end]
            self.claimed.difference_update(gone)
        return len(gone)

    def flush(self) -> None:
        """Add this thread's hits and deliveries to the shared counters."""
        self.counters.add(hits=self.hits, delivered=self.delivered)
        self.hits = self.delivered = 0

    # ---------------------------------------------------------------- the warm lane

    def _warm_lane(self) -> Generator[str, None, bool]:
        """Hand out one warm run's hits; True when the whole run hit (stay warm). Counted per piece,
        not per item (a warm epoch's cost is this loop): a piece ends at a batch boundary, so counters
        and fetch records are exact once the loop holds a whole batch."""
        paths, idx, sizes, each, whole = self._warm_run(self.pos)
        quantum, a, pos = self.stream.quantum, 0, self.pos
        while a < len(paths):
            b = min(len(paths), a + quantum - pos % quantum)
            self.count(b - a - self._unclaim(pos, pos + b - a), b - a, flush=True)
            telemetry.record_items(idx[a:b], True, each, sizes[a:b])
            for path in paths[a:b]:
                self._handing(pos)
                pos = self.pos = pos + 1
                yield path
            a = b
        self.stream.ahead = self.pos  # looked up beyond the run's hits: those need no cover now
        return whole

    def _warm_run(self, pos: int) -> tuple[list[str], list[int], list[int], float, bool]:
        """Cache hits from ``pos`` on, looked up as one run on this thread: ``(paths, indices,
        sizes, seconds each, whole run hit)``."""
        items, checked, stream = self.items, self.checked, self.stream
        end = min(self.n, pos + stream.chunk, (pos // items.chunk + 1) * items.chunk)
        stream.cover(end - 1)  # protected before they are looked up, as in the read-ahead
        at, idx, names, sizes, stamps = items.run(pos, end)
        if checked is not None and checked.checked_prefix(at) < len(at):
            self.check_ahead(items, pos)
            cut = checked.checked_prefix(at)
            at, idx, names, sizes, stamps = at[:cut], idx[:cut], names[:cut], sizes[:cut], stamps[:cut]
        t0 = time.perf_counter()
        paths = self.cache.lookup_run(names, sizes, stamps, at, self.seen)
        return paths, idx, sizes, (time.perf_counter() - t0) / max(1, len(paths)), len(paths) == end - pos

    # ---------------------------------------------------------------- the read-ahead lane

    def _read_ahead_lane(self) -> Generator[str, None, bool]:
        """Hand out positions through :func:`read_ahead` until the end, a streak of
        :data:`WARM_STREAK` hits (True: back to warm runs) or a new byte bound for the read-ahead
        (False: the lane starts again with it)."""
        stream, streak = self.stream, 0
        stream.resized.clear()  # the read-ahead's byte bound is taken now: a change restarts it
        ahead = read_ahead(self.get, self._scheduled(self.pos), depth=self.depth, timeout=self.ds.timeout,
                           describe=self.describe, fast=self.hit, cost=self.items.size,
                           max_bytes=stream.read_ahead_bytes, alive=self.alive, inline=self.ds.volume.local_disk)
        try:
            for got in ahead:
                pos = self.pos
                self.pos = pos + 1
                hit = self._delivering(pos, got)
                if hit is None or isinstance(got, BaseException):  # skipped
                    streak = 0
                    continue
                yield got
                streak = streak + 1 if hit else 0
                if streak >= WARM_STREAK:
                    return True
                if stream.resized.is_set():
                    return False
            return False
        finally:
            ahead.close()  # calls not started are cancelled; started fills still land in the cache
            with self._mu:
                self.timing.clear()  # what was found ahead is looked up again by the warm run
                self.probed.clear()

    def _scheduled(self, start: int) -> Iterator[int]:
        for pos in range(start, self.n):
            self.stream.cover(pos)
            yield pos

    def _delivering(self, pos: int, got: str | BaseException) -> bool | None:
        """Bookkeeping of the read-ahead's result for ``pos``: whether it was a hit, None if skipped."""
        self._handing(pos)
        if pos % STREAM_CHUNK == STREAM_CHUNK - 1:
            _release_free_heap()
        with self._mu:
            hit, fetch_s, count = self.timing.pop(pos, (True, 0.0, False))
            if pos in self.claimed:  # counted by a fill call (this lane's, or one a lane left behind)
                self.claimed.discard(pos)
                count = False
        if isinstance(got, BaseException):
            self.stream.skipped += 1
            self.counters.add(errors=1)
            if len(self.skipped) < SKIPPED_NAMED:
                self.skipped.append(f"{self.describe(pos)}: {got}")
            return None
        self.count(count, 1, flush=(pos + 1) % self.stream.quantum == 0)  # exact once the loop holds a batch
        telemetry.record_item(self.items.index(pos), hit, fetch_s, self.items.entry(pos).size)
        return hit

    def describe(self, pos: int) -> str:
        return self.ds.volume.display(self.items.entry(pos).path)

    def alive(self) -> bool:
        """Asked by the read-ahead at each step of a wait (the loop's thread): False when this worker's main
        process is gone; raises :class:`_Retired` when ucmagic.DataLoader's loop left this iteration
        (Ctrl-C, ``break``, an error, its workers shut down), so a worker waiting on a fill stuck in a
        hung mount goes back to torch's loop and stops there, instead of torch waiting 5 s per worker."""
        if self.stream.retired():
            raise _Retired()
        return self.parent is None or os.getppid() == self.parent

    def on_wait(self) -> None:
        """Called while a fill waits for room: a worker whose main process is gone leaves."""
        if self.parent is not None and os.getppid() != self.parent:
            raise SystemExit("ucmagic: the DataLoader's main process is gone; this worker exits")
        restart_timeout()
        self.stream.refresh()

    def hit(self, pos: int) -> str | None:
        """``pos`` looked up on the loop thread (no hop): its path, or None (a miss, not looked up
        on a cold run, or a changed file that :meth:`get` reports)."""
        items, checked = self.items, self.checked
        if self.misses >= COLD_MISSES and pos % COLD_PROBE_EVERY:
            return None
        if checked is not None and items.index(pos) not in checked:
            self.check_ahead(items, pos)  # first use of a reused listing's files: check a chunk at once
            if items.index(pos) not in checked:
                return None
        key, suffix = items.key_at(pos)
        t0 = time.perf_counter()
        path = self.cache.lookup(key, suffix, items.size(pos), rel=items.rel_at(pos), space=self.ds.space)
        with self._mu:
            if path is not None:
                self.timing[pos] = (True, time.perf_counter() - t0, True)  # counted when delivered
                self.misses = 0
            else:
                self.misses += 1
                self.probed.add(pos)
        return path

    def get(self, pos: int) -> str | BaseException:
        """Fill ``pos`` (a read-ahead call, on a pool thread): its path, or the error of a file to skip."""
        stream = self.stream
        with self._mu:
            looked_up = pos in self.probed or (self.misses >= COLD_MISSES and self.cache.limit is None)
            first = pos not in self.claimed  # else a call a lane left behind counted it already
            self.claimed.add(pos)
        t0 = time.perf_counter()
        got, fetched = self.fetch_item(self.items, pos, may_exceed=lambda: stream.may_exceed(pos),
                                       on_wait=self.on_wait, looked_up=looked_up, count_hit=first)
        if isinstance(got, BaseException):
            return got
        if fetched and got == self.cache.layout.entries + os.sep + self.items.file_at(pos):
            # the next epoch's warm run need not look it up (unless it went beside another version:
            # warm runs look at the first place only)
            self.seen.filled(self.items.index(pos))
        with self._mu:
            self.probed.discard(pos)
            self.timing[pos] = (not fetched, time.perf_counter() - t0, False)  # _fetch counted it
        return got


class UCVolumeDataset(EpochTracking, IterableDataset[str]):
    """An IterableDataset yielding the local path of a cached copy of each file under ``path``.

    Drop-in for ``databricks.air.data.UCVolumeDataset(path)``. Files are listed once (recursively,
    sorted, with size and mtime), copied to a persistent machine-wide cache on first use, and
    fetched ahead of the training loop by a thread pool in each iterating process. With
    ``torch.distributed`` and/or DataLoader workers, each (rank, worker) gets its own slice with no
    overlap and no gap; every rank gets the same number of items. The path yielded is the cache
    entry's own, ``<cache_dir>/files/<dataset id>/<the file's path relative to path>`` (folder names
    and extension kept; unsafe names escaped: docs/cache.md): stable across epochs and processes, new
    for a rewritten file, readable until a budget evicts it. :meth:`source_of` maps it back.

    Args:
        path: directory, ``/Volumes/<catalog>/<schema>/<volume>/...``, or fsspec URL.
        pattern: glob over relative paths (``"**/*.jpg"``; no ``/`` means "file name at any depth").
        cache_dir: cache directory (default ``$UCMAGIC_CACHE_DIR`` or ``~/.cache/ucmagic``).
        cache_limit: budget of the whole cache directory in bytes or as a string (``"50GB"``); fills wait
            for room the loop frees (docs/cache.md). Default: keep 10% of the disk free. With
            ``ucmagic.DataLoader`` (also over a wrapper dataset) exactly the items the loop has not
            consumed are protected; otherwise each stream protects a window of the last items it handed
            out sized to fit a third of its share of the budget (64 to ``lease_items`` files; all
            ``lease_items`` where you set it, e.g. to torch's queue, ``(prefetch_factor + 1) * batch_size``),
            so a small budget slows the loop down; one that cannot hold that least window per stream
            raises :class:`BudgetTooSmallError` at the first item, naming the size needed. The smallest
            ``cache_limit`` of any live process using the cache directory bounds this one's fills too,
            and the windows of every live process's streams share it; none goes below its least window
            (files a loop may still open are not evicted to keep the budget).
        shuffle: ``False``, ``True`` (per-epoch seeded permutation; node-affine on several nodes),
            ``"global"`` (always one global permutation) or ``"node"`` (each node keeps its slice of
            the files across epochs and shuffles within it, so its cache stays hot).
        reshuffle_every: with node-affine shuffling, rotate the slices between nodes every N epochs.
        seed: shuffle seed; the order of epoch ``e`` depends only on ``(seed, e)``.
        partition: ``"pad"`` (wrap around so ranks are equal) or ``"drop"`` (drop the remainder).
        prefetch: files in flight per iterating process (default: 128 per rank, split over workers).
        retries: retries of a failing copy, with exponential backoff capped at 2 s (default 14: a volume
            failing 1 open in 3 still delivers; a file that never copies fails after ~22 s).
        timeout: seconds a started file copy may go without writing a byte before the epoch fails
            (a big file that is still copying never times out; a hung open does).
        on_error: ``"raise"`` (default) or ``"skip"`` (count in ``stats()["errors"]`` and go on; one
            summary warning per epoch and stream) for files that fail.
        on_missing: a file deleted from the volume after the listing was taken and not in the cache:
            ``"raise"`` (default: :class:`FetchError` naming it) or ``"skip"`` (count it in
            ``stats()["errors"]`` and go on). ``on_error="skip"`` skips such files too. The listing
            is a snapshot: a file changed since then is served as listed while cached; a new
            dataset object re-validates the listing and fetches the new version (its size/mtime
            give a new key).
        storage_options: passed to fsspec for URLs.
        min_free: fraction of the cache disk always kept free.
        relist: list the volume again even if this node holds a valid listing (docs/scaling.md).
        validate: how a listing this node wrote earlier is checked before reuse, one of
            :data:`ucmagic.files.listing.VALIDATE_MODES` (their meanings: that module's doc and
            docs/scaling.md). Default ``"lazy"``: directory mtimes up front, each file's size and
            mtime when it is first fetched (a file rewritten in place raises
            :class:`SourceChangedError` instead of being served from its old cached copy).
        listing_progress: called with the number of files found so far while listing (from one second
            in); default: a line on stderr.
        follow_symlinks: a symlinked file in the tree is read only when it points inside ``path``
            (``"inside"``, the default), always (``"all"``: a tree you trust) or never (``"none"``).
            One pointing outside raises :class:`UnsafeSourceError` naming it, or with ``on_error="skip"``
            is left out with one warning. Symlinked folders are never walked (docs/reliability.md).
    """

    kind = "UCVolumeDataset"
    # version 1: before the array-free order (unshuffled only); states from before kinds have none
    state_schema = StateSchema(kind, STATE_VERSION, "files", older=(1,))

    def __init__(self, path: Any, *, pattern: str | None = None, cache_dir: str | None = None,
                 cache_limit: int | str | None = None, shuffle: bool | str = False, seed: int = 0,
                 partition: str = "pad", prefetch: int | None = None, retries: int = DEFAULT_RETRIES,
                 timeout: float | None = 120.0, on_error: str = "raise", on_missing: str = "raise",
                 storage_options: dict[str, Any] | None = None, min_free: float = 0.10,
                 reshuffle_every: int | None = None, relist: bool = False, validate: str = "lazy",
                 listing_progress: Callable[[int], None] | None = None,
                 follow_symlinks: str = "inside") -> None:
        if not isinstance(path, (str, os.PathLike, Volume)):
            raise InvalidArgumentError(f"path must be a directory, a /Volumes/... path or a URL (a str or a "
                                       f"path-like), got {path!r}")
        if pattern is not None and not isinstance(pattern, str):
            raise InvalidArgumentError(f"pattern must be a glob string such as '**/*.jpg', or None, got {pattern!r}")
        if partition not in plan.PARTITION_MODES:
            raise InvalidArgumentError(f"partition must be one of {plan.PARTITION_MODES}, got {partition!r}")
        if shuffle not in (False, True, "global", "node"):
            raise InvalidArgumentError(f"shuffle must be False, True, 'global' or 'node', got {shuffle!r}")
        if on_error not in ("raise", "skip"):
            raise InvalidArgumentError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if on_missing not in ("raise", "skip"):
            raise InvalidArgumentError(f"on_missing must be 'raise' or 'skip', got {on_missing!r}")
        if validate not in VALIDATE_MODES:
            raise InvalidArgumentError(f"validate must be one of {VALIDATE_MODES}, got {validate!r}")
        if follow_symlinks not in ("inside", "all", "none"):
            raise InvalidArgumentError(f"follow_symlinks must be 'inside', 'all' or 'none', got {follow_symlinks!r}")
        seed = check_seed(seed)  # every argument is checked before the listing, which may take minutes
        self.path = os.fspath(path) if not isinstance(path, Volume) else path.uri
        self.pattern = pattern
        self.volume: Volume = open_volume(path, storage_options)
        self.space = space_of(self.volume.uri)  # the folder of its entries under the cache's files/
        if on_error == "skip":
            self.volume.unreadable = "skip"  # an unreadable directory is left out of the listing, with a warning
        self.volume.follow_symlinks = follow_symlinks  # a link out of the tree: UnsafeSourceError, or skip + warn
        self.volume.outside_links = "warn" if on_error == "skip" else "raise"
        root = cache_root(cache_dir)
        inside = path_under(root, self.volume.local_root) if self.volume.local_root else None
        if inside == ".":  # refused before the cache makes its folders there
            raise InvalidArgumentError(f"cache_dir {root} is the dataset's own directory: set cache_dir= (or "
                                       "$UCMAGIC_CACHE_DIR) to a directory of its own, outside the data")
        self.cache = FileCache(cache_dir, cache_limit, min_free)
        if inside:  # the cache lies inside the data: its copies (and listings) are not data
            self.volume.skip_dirs = self.volume.skip_dirs | {inside}
        bar: list[Progress] = []

        listing_started = time.monotonic()

        def shown(count: int) -> None:
            if not bar:  # the first call comes after a second of listing: show the time since it began
                bar.append(Progress(desc=f"listing {self.volume.display()}", mode="text"))
                bar[0].start = listing_started
            bar[0].set(count)

        opened_at = time.time()
        try:
            self.listing: Listing = open_listing(self.volume, pattern, self.cache.root, relist=relist,
                                                 validate=validate,
                                                 progress=listing_progress or shown)
        finally:
            if bar:
                bar[0].close()
        # "lazy": a reused listing's files are checked when first fetched (a fresh one is current;
        # volumes without directory mtimes were re-listed and compared by open_listing already)
        lazy = validate == "lazy" and self.volume.keeps_dir_mtimes and self.listing.listed_at < opened_at
        self._checked = CheckedFiles(len(self.listing)) if lazy else None
        self.fingerprint = self.listing.fingerprint
        self.shuffle = shuffle
        self.reshuffle_every = int(reshuffle_every) if reshuffle_every else None
        self.seed = seed
        self.partition = partition
        self.prefetch = prefetch
        self.retries = int(retries)
        self.timeout = timeout
        self.on_error = on_error
        self.on_missing = on_missing
        self.batch_quantum = 1  # set by ucmagic.DataLoader to its batch size
        # Without ucmagic.DataLoader's consumption reports, the last lease_items items each stream
        # handed out stay protected (enough for torch's prefetch queue plus the batch in use); under
        # a budget at least 64, or all of them where lease_items was set (docs/cache.md)
        self._lease_items, self._lease_set = DEFAULT_LEASE_ITEMS, False
        self._init_epochs()
        self._counters = SharedCounters()
        self.filler = CacheFiller(self.cache, retries=self.retries, counters=self._counters,
                                  skip=SkipPolicy(on_error, on_missing))
        self._consumed = SharedInts(MAX_STREAMS + 2)  # items the loop finished, per worker stream
        self._resume: dict[str, Any] | None = None
        self._delivered_main = 0
        self._epoch_main = 0
        self._owner = ""  # the consuming process (set when pickled for DataLoader workers)
        self._seen: SeenEntries | None = None  # the cache entries this process found (warm lookups)
        self._record_pid = self._record_serial = 0  # see _record_id
        self._record_paths: set[str] = set()
        self.cache.reap()  # protection and temp files left by dead processes go at once

    # ------------------------------------------------------------ basics

    @property
    def lease_items(self) -> int:
        """Handed-out items each stream keeps protected where the loop's consumption is not
        reported (torch's DataLoader, a plain loop): default 1024, at least 64 under a budget. A value
        you set, e.g. ``(prefetch_factor + 1) * batch_size`` for torch's loader, is kept under any
        budget (one that cannot hold it is a :class:`BudgetTooSmallError` at the first item)."""
        return self._lease_items

    @lease_items.setter
    def lease_items(self, n: int) -> None:
        self._lease_items, self._lease_set = int(n), True

    def configure(self, *, batch_quantum: int, lease_items: int) -> None:
        super().configure(batch_quantum=batch_quantum, lease_items=lease_items)
        self._lease_set = False  # the loader's choice (it reports consumption), not a least window

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()  # the listing pickles as its file path
        st["_seen"] = None  # per process
        if get_worker_info() is None:
            st["_owner"] = process_tag()  # workers protect items for the process that will consume them
        return st

    def __len__(self) -> int:
        """Items this rank delivers in the coming epoch (the remainder after a resume)."""
        world = dist_info().world
        r = self._resume
        todo = r["remaining"] if r is not None and r["epoch"] == self.epoch else len(self.listing)
        return plan.per_rank(todo, world, self.partition)

    def __repr__(self) -> str:
        return (f"UCVolumeDataset({self.volume.display()!r}, files={len(self.listing)}, "
                f"cache_dir={self.cache.root!r}, shuffle={self.shuffle!r})")

    @property
    def total_bytes(self) -> int:
        return self.listing.total_bytes

    # ------------------------------------------------------------ plan

    def _order(self, epoch: int, world: int, shuffle: bool | str, lws: int) -> Callable[[np.ndarray], np.ndarray]:
        """The epoch order as a function of positions (plan.order_at: no n-element array)."""
        n = len(self.listing)
        blocks = plan.node_blocks(n, world, lws, self.partition) if shuffle == "node" else None
        seed, every = self.seed, self.reshuffle_every

        def order(positions: np.ndarray) -> np.ndarray:
            return plan.order_at(n, positions, seed=seed, epoch=epoch, shuffle=shuffle, blocks=blocks,
                                 reshuffle_every=every)

        return order

    def epoch_plan(self, epoch: int) -> tuple[list[plan.Range], Any]:
        """(pool, order) for ``epoch``: the resumed remainder if a state was loaded for it."""
        world = dist_info().world
        r = self._resume
        if r is not None and r["epoch"] == epoch:
            order = self._order(epoch, r["order_world"], r["shuffle"], r["order_local_world"])
            return [tuple(x) for x in r["pool"]], order
        shuffle = self._shuffle_mode(world)
        return [(0, len(self.listing))], self._order(epoch, world, shuffle, local_world_size(world))

    def stream_items(self, epoch: int | None = None) -> StreamItems:
        """The calling (rank, worker) stream's items this epoch, in order, decoded chunk by chunk."""
        rank, world, _, _, worker, nworkers = dist_info()
        pool, order = self.epoch_plan(self.epoch if epoch is None else epoch)
        pos = plan.stream_positions(pool, world, rank, nworkers, worker, self.partition, self.batch_quantum)
        return StreamItems(self.listing, pos, order, self._chunk_keys, self.space)

    def _chunk_keys(self, idx: np.ndarray) -> list[tuple[str, str]]:
        """``(cache key, suffix)`` of a chunk of files: the keys stored in the node listing (the
        suffix stays empty: an entry keeps the file's relative path, extension included)."""
        if self.listing.volume_uri != self.volume.uri:  # keys depend on the URI the listing was built under
            return cache_keys(self.volume.uri, self.listing.entries(idx))
        return [(k, "") for k in self.listing.keys(idx)]

    # ------------------------------------------------------------ fetching

    def _inflight(self) -> int:
        if self.prefetch:
            return int(self.prefetch)
        nworkers = dist_info().num_workers
        return max(8, DEFAULT_INFLIGHT // max(1, nworkers))

    def _key(self, e: FileEntry) -> tuple[str, str]:
        return cache_key(self.volume.uri, e.path, e.size, e.mtime), safe_suffix(e.path)

    def _fetch(self, e: FileEntry, key: tuple[str, str] | None = None, *, may_exceed: Callable[[], bool] | None = None,
               on_wait: Callable[[], None] | None = None, looked_up: bool = False,
               count_hit: bool = True) -> tuple[str, bool]:
        """``(cached path, copied now)`` for ``e``: a hit, or one (single-flight) copy from the volume
        (:meth:`CacheFiller.fill_file`). Counted in the stats as a miss or (unless not ``count_hit``) a hit."""
        key_, suffix = key or self._key(e)
        return self.filler.fill_file(self.volume, e, key_, suffix, rel=e.path, space=self.space, may_exceed=may_exceed,
                                     on_wait=on_wait, looked_up=looked_up, count_hit=count_hit)

    def _fetch_item(self, items: StreamItems, pos: int, *, may_exceed: Callable[[], bool],
                    on_wait: Callable[[], None], looked_up: bool,
                    count_hit: bool = True) -> tuple[str | BaseException, bool]:
        """Position ``pos`` of ``items`` filled (a read-ahead call): ``(path, copied now)``, checked
        against the volume where ``validate="lazy"`` asks; ``(error, False)`` for a file to skip."""
        e = items.entry(pos)
        try:
            path, fetched = self._fetch(e, items.key_at(pos), may_exceed=may_exceed, on_wait=on_wait,
                                        looked_up=looked_up, count_hit=count_hit)
            if self._checked is not None:
                self._check_source(items.index(pos), e, fetched)
        except Exception as exc:
            if isinstance(exc, SourceChangedError):  # the node's listing is stale: the next dataset re-lists
                forget_listing(self.listing)
            if self._skippable(exc):
                return exc, False
            raise
        return path, fetched

    def _check_source(self, index: int, e: FileEntry, copied: bool) -> None:
        """``validate="lazy"``: before file ``index`` of a reused listing is first served, make sure
        the volume still holds the version listed (a file rewritten in place keeps its directory's
        mtime). A copy made just now was checked by ``copy_to``; a cache hit costs one ``stat``."""
        checked = self._checked
        if checked is None or index in checked:
            return
        if not (copied and _takes_expect(self.volume)):
            try:
                now = self.volume.stat(e.path)
            except FileNotFoundError as exc:
                raise copy_error(self.volume, e.path, exc) from exc
            if (now.size, now.mtime) != (e.size, e.mtime):
                forget_listing(self.listing)
                raise SourceChangedError(
                    f"{self.volume.display(e.path)} changed after this node's listing was taken (listed "
                    f"{e.size} bytes, mtime {e.mtime:.6f}; now {now.size} bytes, mtime {now.mtime:.6f}; "
                    "rewritten in place): its cached copy of the listed version was not served. The listing "
                    "is marked stale: create the dataset again to list the files again")
        checked.add(index)

    def _check_ahead(self, items: StreamItems, pos: int) -> None:
        """``validate="lazy"``: check the unchecked files from ``pos`` to the end of its chunk at once,
        on :data:`CHECK_THREADS` threads (on the calling thread where a check takes under
        :data:`FAST_CHECK_S`), so that warm hits keep being served without a thread hop.
        Files that changed stay unchecked (:meth:`_check_source` reports them)."""
        checked = self._checked
        if checked is None:
            return
        end = min(len(items), (pos // items.chunk + 1) * items.chunk)
        todo = [(i, e) for i, e in ((items.index(p), items.entry(p)) for p in range(pos, end)) if i not in checked]
        volume = self.volume

        def same(part: list[tuple[int, FileEntry]]) -> None:
            for i, e in part:
                try:
                    now = volume.stat(e.path)
                except OSError:
                    continue
                if (now.size, now.mtime) == (e.size, e.mtime):
                    checked.add(i)

        t0 = time.perf_counter()
        same(todo[:CHECKED_HERE])  # timed on this thread: a local disk answers in microseconds, and
        todo = todo[CHECKED_HERE:]  # threads contending for the GIL would cost more than they overlap
        if not todo:
            return
        if time.perf_counter() - t0 < FAST_CHECK_S * CHECKED_HERE:
            same(todo)
            return
        step = max(CHECKED_HERE, -(-len(todo) // CHECK_THREADS))
        list(shared_pool(CHECK_THREADS, "check").map(same, [todo[a:a + step] for a in range(0, len(todo), step)]))

    def _skippable(self, exc: BaseException) -> bool:
        return self.filler.skippable(exc)

    def _consumption(self, slot: int) -> Callable[[], int | None]:
        """Items of stream ``slot`` the loop has finished with (ucmagic.DataLoader), else None."""
        chan = self._consumed
        i = slot
        if i >= MAX_STREAMS:
            return lambda: None
        generation = chan[_GENERATION]  # the loader's iteration this stream belongs to

        def consumed() -> int | None:
            if not chan[_TRACKED]:
                return None
            return chan[i] if chan[_GENERATION] == generation else STALE_CONSUMED

        return consumed

    @property
    def counters(self) -> SharedCounters:
        """Cache counters shared with the workers: hits, misses, bytes fetched, retries, errors."""
        return self._counters

    def consumption_channel(self) -> "ConsumptionChannel":
        """Where a loader reports, per worker stream, how many items the training loop has finished
        with (shared memory, seen by every worker). Used by ucmagic.DataLoader."""
        return ConsumptionChannel(self._consumed)

    def window_policy(self) -> WindowPolicy:
        """The rules that size this dataset's protection windows and read-ahead (see :mod:`.windows`)."""
        n = len(self.listing)
        typical = max(1, -(-self.listing.total_bytes // n)) if n else 1
        return WindowPolicy(self.lease_items, typical, n, least_window=self.lease_items if self._lease_set else None,
                            largest=int(self.listing.sizes.max()) if n else 0)

    def _read_ahead_bytes(self, streams: int) -> int:

        """Bytes one stream may hold in flight: its share of the budget, else of the free disk above the floor."""
        if self.cache.limit is not None:
            cap = self.cache.limit
        else:
            du = shutil.disk_usage(self.cache.root)
            cap = du.free - int(du.total * self.cache.min_free)
        return max(1, cap // max(1, streams))

    def __iter__(self) -> Iterator[str]:
        it = self._iterate()
        _close_at_exit(it)
        return telemetry.fetch_timed(it)  # timed when a user's wrapper iterates it (the loader's stage times)

    def _iterate(self) -> Iterator[str]:
        main = get_worker_info() is None
        depth = self._inflight()
        items, stream = self._open_stream(main, depth)
        if self._seen is None:
            self._seen = self.cache.seen_entries(len(self.listing))
        lanes = _EpochStream(self, items, stream, main=main, depth=depth, seen=self._seen, checked=self._checked,
                             fetch_item=self._fetch_item, check_ahead=self._check_ahead,
                             on_handed=self._handed_out if main else None)
        abandoned = True  # until the stream is exhausted: an exception, break or close() leaves it
        try:
            yield from lanes.run()
            abandoned = False  # exhausted: the loop may still hold (and report) its last batches
        except _Retired:
            pass  # ucmagic.DataLoader's loop left this iteration: nothing more is wanted of this stream
        finally:
            lanes.end(abandoned=abandoned)

    def _handed_out(self, n: int) -> None:
        self._delivered_main = n  # what state_dict() reports (single-process iteration)

    def _open_stream(self, main: bool, depth: int) -> tuple[StreamItems, _Stream]:
        """This (rank, worker) stream's items this epoch and their protection (begins the epoch in
        the main process; a worker follows the epoch its main process began)."""
        info = get_worker_info()
        refuse_split_twice(self.kind)  # Accelerate re-splitting what is split per rank already
        cache = self.cache
        if main:
            self.begin_epoch()
            epoch = self.epoch
            owner = process_tag()
            release_at_exit(cache, owner)
        else:
            if not os.path.isdir(cache.layout.locks):  # the cache directory was removed by hand: made again
                cache.layout.ensure()  # (the main process's first write, a protection record, does it there)
            epoch = self._worker_epoch(os.path.join(cache.root, "locks", f"epoch-{self._epoch_id}.lock"))
            owner = self._owner or process_tag(os.getppid())
        cache.drop_records(owner)  # records of this owner's exited workers: an earlier iteration's
        items = self.stream_items(epoch)
        if main:
            self._epoch_main, self._delivered_main = epoch, 0
        return items, self._protected(items, owner, 0 if info is None else info.id, depth)

    def _protected(self, items: StreamItems, owner: str, slot: int, depth: int) -> _Stream:
        """The :class:`_Stream` protecting ``items``, sized for the budget and the live streams
        (:class:`BudgetTooSmallError` here, at the first item, where this process's share is too small)."""
        cache = self.cache
        _, world, _, _, _, nworkers = dist_info()
        budget = cache.budget()
        consumed = self._consumption(slot)
        streams, reported = nworkers * local_world_size(world), consumed() is not None
        # one record per stream of this dataset object: another dataset iterated in the same process
        # (a validation loop, two datasets zipped) keeps its own
        rslot = f"{slot}-{self._record_id()}"
        record = cache.record_path(owner, rslot)
        self._record_paths.add(record)
        cache.write_record(record, [])  # this stream counts among the live ones before it sizes itself
        policy = self.window_policy()

        def size(b: int | None) -> Sizing:
            return policy.protection(b, streams, reported, cache.live_streams(),
                                     unbudgeted_bytes=self._read_ahead_bytes(streams))

        try:
            sizing, budget = self._sized(size, budget)
        except BudgetTooSmallError:
            cache.drop_record(record)
            raise
        stream = _Stream(cache, owner, rslot, items, quantum=self.batch_quantum, window=sizing.window,
                         chunk=max(MIN_COVER, depth), consumed=consumed, budgeted=budget is not None,
                         sizer=LiveSizing(policy, cache, streams, reported), sizing=sizing)
        if budget is not None:
            stream.start_refresher()
        return stream

    def _record_id(self) -> int:
        """This dataset object's number in this process (its protection records carry it; a
        DataLoader worker's copy gets its own). Its records in this process go with the object."""
        pid = os.getpid()
        if self._record_pid != pid:
            self._record_serial, self._record_pid = serial(), pid
            self._record_paths = set()
            # on garbage collection only: at exit the owner's records go with it (release_at_exit), and
            # a DataLoader worker's stay while its loop still holds the last batches it handed out
            weakref.finalize(self, _drop_records, self.cache, self._record_paths, pid).atexit = False
        return self._record_serial

    def _sized(self, size: Callable[[int | None], Sizing], budget: int | None) -> tuple[Sizing, int | None]:
        """``(size(budget), budget)``. Refused by a budget another dataset set (this one set none, or a
        larger one), sized again under the budget in force once datasets on their way out are gone,
        and refused then naming it as theirs; this dataset's own budget is refused at once."""
        try:
            return size(budget), budget
        except BudgetTooSmallError as exc:
            cache = self.cache
            if budget is None or (cache.limit is not None and budget >= cache.limit):
                raise
            budget = self._other_budget_settled(budget)
            try:
                return size(budget), budget
            except BudgetTooSmallError:
                raise BudgetTooSmallError(
                    f"{exc} -- the budget in force is {cache.budget_name(budget or 0)}; raise that dataset's "
                    "cache_limit, or let it go (del it, end its process) first") from None

    def _other_budget_settled(self, budget: int) -> int | None:
        """The budget in force once datasets on their way out are gone: a dataset just interrupted
        (Ctrl-C, an error) keeps its cache_limit record while a fill of it is still running, or
        until a collection frees it from a reference cycle. Re-read for up to OTHER_BUDGET_GRACE_S."""
        gc.collect()
        deadline = time.monotonic() + OTHER_BUDGET_GRACE_S
        now = self.cache.budget(fresh=True)
        while now is not None and now <= budget and time.monotonic() < deadline:
            time.sleep(0.1)
            now = self.cache.budget(fresh=True)
        return now

    # ------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """What the training loop received so far in this epoch (single-process iteration).

        With DataLoader workers or several ranks use ``ucmagic.DataLoader.state_dict()``, which
        knows what reached the loop. The state is small and JSON-serialisable.
        """
        world = dist_info().world
        if world > 1:
            raise RuntimeError("UCVolumeDataset.state_dict() sees one rank only: use ucmagic.DataLoader.state_dict()")
        return self.make_state(self._epoch_main, [self._delivered_main], world=1, num_workers=1)

    def make_state(self, epoch: int, delivered: list[int], *, world: int, num_workers: int) -> dict[str, Any]:
        """Resume state after stream ``s`` delivered ``delivered[s]`` items of ``epoch``."""
        return self._planned_state(epoch, self.epoch_plan(epoch)[0], delivered, world=world, num_workers=num_workers,
                                   fingerprint=self.fingerprint, count=len(self.listing),
                                   order_version=plan.ORDER_VERSION)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration delivers exactly the files not yet delivered in the saved epoch.

        Works with a different world size or number of workers. Raises ListingChangedError when the
        files under the path changed since the state was saved, ResumeOrderError when the state was
        saved under another epoch order (an older ucmagic).
        """
        plan.check_order_version(state)
        self.state_schema.check(state, fingerprint=self.fingerprint, count=len(self.listing),
                                what=f"the files under {self.volume.display()}")
        self._resume_from(state)

    # ------------------------------------------------------------ cache management

    def warm(self, background: bool = True, *, threads: int | None = None) -> Future[int]:
        """Copy every file of the listing into the cache. Returns a Future (already done when
        ``background=False``) whose result is the number of files fetched from the volume."""
        fut: Future[int] = Future()
        depth = threads or DEFAULT_INFLIGHT

        def run() -> None:
            before = self._counters.totals()["misses"]
            try:
                for _ in read_ahead(self._fetch, self.listing.iter_entries(), depth=depth, timeout=self.timeout):
                    pass
                fut.set_result(self._counters.totals()["misses"] - before)
            except BaseException as exc:  # noqa: BLE001 - surfaces through fut.result()
                fut.set_exception(exc)

        if background:
            threading.Thread(target=run, name="ucmagic-warm", daemon=True).start()
        else:
            run()
            fut.result()
        return fut

    def _cached_paths(self) -> Iterator[tuple[str, int]]:
        """(path, bytes) of each file of the listing that is in the cache, in listing order."""
        for e in self.listing.iter_entries(STREAM_CHUNK):  # small chunks: a short-lived per-file transient
            p = self.cache.lookup(*self._key(e), e.size, rel=e.path, space=self.space, touch=False)
            if p is not None:
                yield p, e.size
        _release_free_heap()

    def describe_item(self, index: int) -> tuple[str, int]:
        """``(display path, bytes)`` of file ``index`` of the listing (for fetch records)."""
        e = self.listing.entry(index)
        return self.volume.display(e.path), e.size

    def source_of(self, path: str | os.PathLike[str]) -> SourceFile:
        """The source file whose cached copy is ``path`` (a path this dataset yielded): its display
        path or URI in the volume, relative path, size and mtime as listed.

        Works on the path alone where it can (an evicted entry's path still answers); a file at the
        first place of its name is checked to be the listed version. Raises
        :class:`~ucmagic.errors.NotAnEntryError` for a path that is not one of this dataset's files
        in its cache (another dataset's entry, a version no longer listed, any other path).
        """
        given = os.path.abspath(os.fspath(path))
        files = os.path.join(self.cache.root, "files") + os.sep
        top, _, inner = given[len(files):].partition(os.sep) if given.startswith(files) else ("", "", "")
        space, _, version = top.partition("~")
        index = None
        if space == self.space and inner:
            inner = inner.replace(os.sep, "/")
            rel = unmap_relpath(inner)
            index = self.listing.find(rel) if rel is not None else self._find_mapped(inner)
        if index is not None:
            e = self.listing.entry(index)
            key, _ = self._chunk_keys(np.array([index]))[0]
            if (key[:16] == version if version else self._holds_version(given, key)) \
                    and map_relpath(e.path) == inner:
                return SourceFile(self.volume.display(e.path), e.path, e.size, e.mtime)
        raise NotAnEntryError(
            f"{given} is not a cached file of {self.volume.display()} (those are under {files}{self.space}/<relative "
            "path>): pass a path this dataset yielded, from its current listing")

    def _find_mapped(self, mapped: str) -> int | None:
        """The listing index of the file whose entry path :func:`map_relpath` hashed to ``mapped``."""
        for i in self.listing.unplain_indices():
            if map_relpath(self.listing.entry(int(i)).path) == mapped:
                return int(i)
        return None

    def _holds_version(self, path: str, key: str) -> bool:
        """Whether the entry file ``path`` (at its first place) is the version of ``key``, or is gone
        (a path alone then answers)."""
        try:
            os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return True
        return self.cache.claims(path, key)

    def clear_cache(self) -> int:
        """Remove this dataset's files from the cache, plus protection records of dead processes and
        abandoned temp files (other datasets' entries stay, and so do files that a running loop of
        another process has not consumed yet). Returns the number of entries removed."""
        self.cache.reap()
        return self.cache.remove_unprotected(p for p, _ in self._cached_paths())

    def stats(self) -> dict[str, Any]:
        """Files/bytes cached of the total, hits, misses, bytes fetched, retries, errors, fetch latency,
        and every byte under ``cache_dir``: this dataset's entries, other entries, protection records
        and temp files (``cache_*`` keys; they add up to ``cache_total_bytes``)."""
        n_cached = mine = 0
        for _, size in self._cached_paths():
            n_cached += 1
            mine += size
        u = self.cache.usage()
        t = self._counters.totals()
        lat = self._counters.latencies()
        pct = percentiles(lat)
        lookups = t["hits"] + t["misses"]
        return {
            "files": len(self.listing), "bytes": self.total_bytes,
            "files_cached": n_cached, "bytes_cached": mine,
            "hits": t["hits"], "misses": t["misses"],
            "hit_rate": (t["hits"] / lookups) if lookups else 0.0,
            "bytes_fetched": t["bytes_fetched"], "retries": t["retries"], "errors": t["errors"],
            "delivered": t["delivered"],
            "fetch_p50_s": pct["p50"], "fetch_p90_s": pct["p90"], "fetch_p99_s": pct["p99"],
            "cache_dir": self.cache.root, "epoch": self.epoch,
            "cache_total_bytes": u.total_bytes, "cache_other_entries_bytes": u.bytes - mine,
            "cache_protected_bytes": u.protected_bytes, "cache_records_bytes": u.records_bytes,
            "cache_tmp_bytes": u.tmp_bytes, "cache_misc_bytes": u.other_bytes,
            "cache_limit": self.cache.limit,
        }

