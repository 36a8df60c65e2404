"""One iteration of one (rank, worker) stream: its items, their lease and the filler, in two lanes.

Built from parts with no reference back to the dataset that made it (:class:`EpochParts`): the
stream's :class:`~ucmagic.files.stream_items.StreamItems`, its
:class:`~ucmagic.files.lease.StreamLease`, the :class:`~ucmagic.files.filler.CacheFiller` (whose
cache, counters and skip policy it uses) and, for ``validate="lazy"``, the
:class:`~ucmagic.files.filler.SourceChecks`.

Call order (one per iteration, on the loop's thread)::

    stream = EpochStream(parts, main=..., depth=..., timeout=...)
    for path in stream.run(): ...       # every position's path, in order (files to skip are left out)
    stream.handed                       # items handed out so far (the main process's state_dict)
    stream.end(abandoned=...)           # once: counters, the lease's end, the skipped-files warning

:class:`Retired` ends ``run()`` when ``ucmagic.DataLoader``'s loop left the iteration.
"""
from __future__ import annotations

import os
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Callable, Generator, Iterator

from .. import telemetry
from .._util import release_free_heap
from ..errors import SourceChangedError
from .cache import SeenEntries
from .fetch import read_ahead, restart_timeout
from .filler import CacheFiller, SourceChecks
from .lease import StreamLease
from .listing import forget_listing
from .stream_items import STREAM_CHUNK, StreamItems
from .volume import FileEntry, Volume

WARM_STREAK = 64  # consecutive cache hits after which iteration switches to whole runs of lookups
COLD_MISSES = 8  # consecutive misses of lookups on the loop thread after which they are only probes
COLD_PROBE_EVERY = 16  # ... of every 16th item, until hits come back
SKIPPED_NAMED = 3  # skipped files named in an epoch's warning (the rest are counted)


class Retired(BaseException):
    """Ends a stream whose ucmagic.DataLoader loop left the iteration (:meth:`StreamLease.retired`); a
    BaseException, so no handler of errors takes it."""


@dataclass
class EpochParts:
    """What an :class:`EpochStream` is built from: the stream's ``items``, their ``lease``, the
    ``filler`` (its cache, counters and skip policy), the ``volume`` (names in messages; whether it is
    a local disk), the dataset's cache ``space``, the entries this process found (``seen``) and, for
    ``validate="lazy"``, the source ``checks``."""

    items: StreamItems
    lease: StreamLease
    filler: CacheFiller
    volume: Volume
    space: str
    seen: SeenEntries
    checks: SourceChecks | None = None


class EpochStream:
    """One iteration of one (rank, worker) stream, in two lanes that take turns.

    The **warm lane** looks a run of positions up on the loop thread at once and hands out the hits
    (a warm cache: no read-ahead, no per-item calls); a run that misses hands over to the
    **read-ahead lane**, which fills positions through :func:`read_ahead` (hits still served on the
    loop thread by :meth:`hit`) until a streak of :data:`WARM_STREAK` hits hands back. Both hand
    out through :meth:`_handing`. Fills run on pool threads: what they share with the loop thread
    (``misses``, ``probed``, ``timing``) is read and written under ``_mu``.
    """

    def __init__(self, parts: EpochParts, *, main: bool, depth: int, timeout: float | None) -> None:
        self.items, self.lease, self.filler = parts.items, parts.lease, parts.filler
        self.volume, self.space, self.depth, self.timeout = parts.volume, parts.space, depth, timeout
        self.cache, self.n = parts.filler.cache, len(parts.items)
        counters = parts.filler.counters
        if counters is None:
            from ..telemetry import SharedCounters

            counters = SharedCounters()
        self.counters = counters
        self.seen = parts.seen  # the cache entries this process found (warm lookups)
        self.checks = parts.checks  # validate="lazy": the files checked against the volume
        self.checked = None if parts.checks is None else parts.checks.checked
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

    @property
    def handed(self) -> int:
        """Items handed out so far (skipped ones included)."""
        return self.lease.yielded

    def run(self) -> Iterator[str]:
        """Every position's path, from a warm run first (a second epoch, a restart find the cache warm)."""
        warm = True
        while self.pos < self.n:
            warm = yield from (self._warm_lane() if warm else self._read_ahead_lane())

    def end(self, *, abandoned: bool) -> None:
        """Counters, protection and the skipped-files warning once the iteration ends."""
        self.flush()
        self.lease.finish(abandoned=abandoned)
        release_free_heap()
        if self.skipped:
            total = self.lease.skipped
            more = f" and {total - len(self.skipped)} more" if total > len(self.skipped) else ""
            warnings.warn(f"ucmagic: skipped {total} file(s) this epoch: {'; '.join(self.skipped)}{more} "
                          "(counted in stats()['errors'])", stacklevel=3)

    # ---------------------------------------------------------------- hand-out bookkeeping

    def _handing(self, pos: int) -> None:
        """Bookkeeping of position ``pos`` just before it is handed out (both lanes)."""
        self.lease.handed(pos)

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
        lease = self.lease
        quantum, a, pos = lease.quantum, 0, self.pos
        while a < len(paths):
            b = min(len(paths), a + quantum - pos % quantum)
            self.count(b - a - self._unclaim(pos, pos + b - a), b - a, flush=True)
            telemetry.record_items(idx[a:b], True, each, sizes[a:b])
            for path in paths[a:b]:
                if pos % quantum:
                    lease.yielded = pos + 1  # _handing(pos) within a batch, without its two calls per item
                else:
                    self._handing(pos)  # a batch's first item: what the loop consumed is released
                pos = self.pos = pos + 1
                yield path
            a = b
        self.lease.looked_up(self.pos)  # looked up beyond the run's hits: those need no cover now
        return whole

    def _warm_run(self, pos: int) -> tuple[list[str], list[int], list[int], float, bool]:
        """Cache hits from ``pos`` on, looked up as one run on this thread: ``(paths, indices,
        sizes, seconds each, whole run hit)``."""
        items, checked, lease = self.items, self.checked, self.lease
        end = min(self.n, pos + lease.chunk, (pos // items.chunk + 1) * items.chunk)
        lease.cover(end - 1)  # protected before they are looked up, as in the read-ahead
        at, idx, names, sizes, stamps = items.run(pos, end)
        if checked is not None and checked.prefix(at) < len(at):
            self._check_ahead(pos)
            cut = checked.prefix(at)
            at, idx, names, sizes, stamps = at[:cut], idx[:cut], names[:cut], sizes[:cut], stamps[:cut]
        t0 = time.perf_counter()
        paths = self.cache.lookup_run(names, sizes, stamps, at, self.seen)
        return paths, idx, sizes, (time.perf_counter() - t0) / max(1, len(paths)), len(paths) == end - pos

    def _check_ahead(self, pos: int) -> None:
        """``validate="lazy"``: check the files from ``pos`` to the end of its chunk at once."""
        if self.checks is None:
            return
        items = self.items
        end = min(len(items), (pos // items.chunk + 1) * items.chunk)
        self.checks.ahead([(items.index(p), items.entry(p)) for p in range(pos, end)])

    # ---------------------------------------------------------------- the read-ahead lane

    def _read_ahead_lane(self) -> Generator[str, None, bool]:
        """Hand out positions through :func:`read_ahead` until the end, a streak of
        :data:`WARM_STREAK` hits (True: back to warm runs) or a new byte bound for the read-ahead
        (False: the lane starts again with it)."""
        lease, streak = self.lease, 0
        lease.resized.clear()  # the read-ahead's byte bound is taken now: a change restarts it
        ahead = read_ahead(self.get, self._scheduled(self.pos), depth=self.depth, timeout=self.timeout,
                           describe=self.describe, fast=self.hit, cost=self.items.size,
                           max_bytes=lease.read_ahead_bytes, alive=self.alive, inline=self.volume.local_disk)
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
                if lease.resized.is_set():
                    return False
            return False
        finally:
            ahead.close()  # calls not started are cancelled; started fills still land in the cache
            with self._mu:
                self.timing.clear()  # what was found ahead is looked up again by the warm run
                self.probed.clear()

    def _scheduled(self, start: int) -> Iterator[int]:
        for pos in range(start, self.n):
            self.lease.cover(pos)
            yield pos

    def _delivering(self, pos: int, got: str | BaseException) -> bool | None:
        """Bookkeeping of the read-ahead's result for ``pos``: whether it was a hit, None if skipped."""
        self._handing(pos)
        if pos % STREAM_CHUNK == STREAM_CHUNK - 1:
            release_free_heap()
        with self._mu:
            hit, fetch_s, count = self.timing.pop(pos, (True, 0.0, False))
            if pos in self.claimed:  # counted by a fill call (this lane's, or one a lane left behind)
                self.claimed.discard(pos)
                count = False
        if isinstance(got, BaseException):
            self.lease.skipped += 1
            self.counters.add(errors=1)
            if len(self.skipped) < SKIPPED_NAMED:
                self.skipped.append(f"{self.describe(pos)}: {got}")
            return None
        self.count(count, 1, flush=(pos + 1) % self.lease.quantum == 0)  # exact once the loop holds a batch
        telemetry.record_item(self.items.index(pos), hit, fetch_s, self.items.entry(pos).size)
        return hit

    def describe(self, pos: int) -> str:
        return self.volume.display(self.items.entry(pos).path)

    def alive(self) -> bool:
        """Asked by the read-ahead at each step of a wait (the loop's thread): False when this worker's main
        process is gone; raises :class:`Retired` when ucmagic.DataLoader's loop left this iteration
        (Ctrl-C, ``break``, an error, its workers shut down), so a worker waiting on a fill stuck in a
        hung mount goes back to torch's loop and stops there, instead of torch waiting 5 s per worker."""
        if self.lease.retired():
            raise Retired()
        return self.parent is None or os.getppid() == self.parent

    def on_wait(self) -> None:
        """Called while a fill waits for room: a worker whose main process is gone leaves."""
        if self.parent is not None and os.getppid() != self.parent:
            raise SystemExit("ucmagic: the DataLoader's main process is gone; this worker exits")
        restart_timeout()
        self.lease.refresh()

    def hit(self, pos: int) -> str | None:
        """``pos`` looked up on the loop thread (no hop): its path, or None (a miss, not looked up
        on a cold run, or a changed file that :meth:`get` reports)."""
        items, checked = self.items, self.checked
        if self.misses >= COLD_MISSES and pos % COLD_PROBE_EVERY:
            return None
        if checked is not None and items.index(pos) not in checked:
            self._check_ahead(pos)  # first use of a reused listing's files: check a chunk at once
            if items.index(pos) not in checked:
                return None
        key, suffix = items.key_at(pos)
        t0 = time.perf_counter()
        path = self.cache.lookup(key, suffix, items.size(pos), rel=items.rel_at(pos), space=self.space)
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
        lease = self.lease
        with self._mu:
            looked_up = pos in self.probed or (self.misses >= COLD_MISSES and self.cache.limit is None)
            first = pos not in self.claimed  # else a call a lane left behind counted it already
            self.claimed.add(pos)
        t0 = time.perf_counter()
        e, key, suffix, file, index = self.items.fill_info(pos)
        got, fetched = self._fill(pos, e, key, suffix, may_exceed=lambda: lease.may_exceed(pos), looked_up=looked_up,
                                  count_hit=first)
        if isinstance(got, BaseException):
            return got
        if fetched and got == self.cache.layout.entries + os.sep + file:
            # the next epoch's warm run need not look it up (unless it went beside another version:
            # warm runs look at the first place only)
            self.seen.filled(index)
        with self._mu:
            self.probed.discard(pos)
            self.timing[pos] = (not fetched, time.perf_counter() - t0, False)  # the filler counted it
        return got

    def _fill(self, pos: int, e: FileEntry, key: str, suffix: str, *, may_exceed: Callable[[], bool],
              looked_up: bool, count_hit: bool) -> tuple[str | BaseException, bool]:
        """Position ``pos`` (its entry ``e``, cache ``key`` and ``suffix``) filled: ``(path, copied now)``,
        checked against the volume where ``validate="lazy"`` asks; ``(error, False)`` for a file to skip."""
        items = self.items
        try:
            path, fetched = self.filler.fill_file(self.volume, e, key, suffix, rel=e.path, space=self.space,
                                                  may_exceed=may_exceed, on_wait=self.on_wait,
                                                  looked_up=looked_up, count_hit=count_hit)
            if self.checks is not None:
                self.checks.check(items.index(pos), e, fetched)
        except Exception as exc:
            if isinstance(exc, SourceChangedError):  # the node's listing is stale: the next dataset re-lists
                forget_listing(items.listing)
            if self.filler.skippable(exc):
                return exc, False
            raise
        return path, fetched
