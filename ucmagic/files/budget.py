"""The budget of a cache directory and its eviction.

The budget fills honour is the smallest ``cache_limit`` of any live process using the directory
(each records its own in ``locks/limit.<process>.<n>.<bytes>``). With a budget, fills wait for room
instead of overshooting, except fills a blocked consumer needs next (``may_exceed``), so the loop
always makes progress; every wait has an end (``STALL_S``, ``LOOP_STALL_S``). Eviction is
least-recently-used (:func:`choose_victims`) over entries no live protection record names, under
the machine-wide eviction lock; a byte ledger (``usage``) spares most fills a scan. The free-disk
floor (``min_free``) holds with or without a budget.
"""
from __future__ import annotations

import contextlib
import gc
import os
import shutil
import threading
import time
import weakref
from typing import Callable, Iterable

from .._util import O_NOFOLLOW
from ..errors import CacheFullError
from ..units import format_size
from .admission import ADMIT, REFUSE, STALL, Waiting, admit, must_count, next_delay, still_waiting
from .cache_layout import CacheLayout, RemovalToken, listdir, serial
from .locks import open_private
from .cache_usage import CacheUsage, scan
from .locks import process_tag, tag_alive
from .protection import ProtectionRecords

DEFAULT_MIN_FREE = 0.10
STALL_S = 120.0  # a fill no loop waits on gives up after this long without any room freed nor any fill copying
SETTLE_S = 3.0  # a budget too small set by another dataset is re-read this long before it is refused
LOOP_STALL_S = 60.0  # a fill of a loop (may_exceed given) likewise: its consumption reports never free room


def choose_victims(entries: Iterable[tuple[str, int, float]], bytes_to_free: int) -> list[str]:
    """LRU choice: the oldest (by last use) entries whose sizes add up to ``bytes_to_free``.

    ``entries`` are ``(path, size, last_used)`` of unprotected entries only.
    """
    victims: list[str] = []
    freed = 0
    for path, size, _ in sorted(entries, key=lambda e: e[2]):
        if freed >= bytes_to_free:
            break
        victims.append(path)
        freed += size
    return victims


def parse_limit_name(name: str) -> tuple[str, int] | None:
    """``(process tag, cache_limit bytes)`` of a budget record's name in ``locks/``, else None."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "limit" or not parts[3].isdigit():
        return None
    return parts[1], int(parts[3])


def _drop_limit_record(path: str, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits the finaliser: only the creating process removes it
        with contextlib.suppress(OSError):
            os.unlink(path)


def reap(layout: CacheLayout, records: ProtectionRecords) -> dict[str, int]:
    """Drop protection records of dead owners, temp files and half-removed entries of dead writers, and
    entries of the old layout (``data/``) no live process protects. Returns counts."""
    protected, dropped = records.reap()
    old = layout.reap_old_layout(protected)
    return {"records": dropped, "tmp": layout.reap_tmp(), "old": old}


class BudgetKeeper:
    """One process's view of a cache directory's budget: the limit records, the ledger, the room
    fills reserve, eviction and the free-disk floor.

    Args:
        layout, records, removals: the directory, its protection records and its removal token.
        limit: this object's ``cache_limit`` in bytes (recorded while the keeper lives), or None.
        min_free: fraction of the disk always left free.
    """

    def __init__(self, layout: CacheLayout, records: ProtectionRecords, removals: RemovalToken,
                 limit: int | None, min_free: float) -> None:
        self.layout = layout
        self.records = records
        self.removals = removals
        self.limit = limit
        self.min_free = min_free
        self._scan_s = 0.001
        self._synced_at = 0.0
        self._free_at = 0.0
        self._free_est = 0
        self._floor = 0
        self._budget, self._limits_at = limit, -1.0
        self._waiting: dict[int, int] = {}  # fills waiting for room: ticket -> bytes (see _queue)
        self._tickets = 0
        self._waiting_mu = threading.Lock()
        self._record_limit()

    # ------------------------------------------------------------ the budget in force

    def budget(self, *, fresh: bool = False) -> int | None:
        """The byte budget fills honour: the smallest ``cache_limit`` of any live process using this
        directory (this one's included; each records its own in ``locks/``), None when none set one.
        Re-read at most once a second (``fresh``: now); records of exited processes are removed on the way."""
        now = time.monotonic()
        if not fresh and now - self._limits_at < 1.0:
            return self._budget
        best = self.limit
        for name in listdir(self.layout.locks):
            parsed = parse_limit_name(name)
            if parsed is None or (best is not None and parsed[1] >= best):
                continue
            if tag_alive(parsed[0]):
                best = parsed[1]
            else:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self.layout.locks, name))
        self._budget, self._limits_at = best, now
        return best

    def settled(self, budget: int) -> int | None:
        """The budget in force once datasets on their way out are gone: a dataset just interrupted
        (Ctrl-C, an error) keeps its cache_limit record while a fill of it is still running, or
        until a collection frees it from a reference cycle. Re-read for up to :data:`SETTLE_S`, each time
        after a collection: a fill that ends during the wait may leave the dataset in a cycle (its error's
        traceback) that nothing else would collect while this thread sleeps."""
        deadline = time.monotonic() + SETTLE_S
        while True:
            gc.collect()
            now = self.budget(fresh=True)
            if now is None or now > budget or time.monotonic() >= deadline:
                return now
            time.sleep(0.1)

    def budget_name(self, limit: int) -> str:
        """``cache_limit=...`` as an error names it (saying so when another dataset set it)."""
        own = self.limit is not None and limit >= self.limit
        return (f"cache_limit={format_size(limit)}" if own else
                f"cache_limit={format_size(limit)} (set by another live dataset using {self.layout.root}, in this or "
                "another process: the smallest budget of any live one holds)")

    def _record_limit(self) -> None:
        """Let every process using this directory honour this object's ``cache_limit`` while it (and
        its process) lives: a record ``locks/limit.<process>.<n>.<bytes>``, removed when the object goes."""
        if self.limit is None:
            return
        path = os.path.join(self.layout.locks, f"limit.{process_tag()}.{serial()}.{self.limit}")
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
            weakref.finalize(self, _drop_limit_record, path, os.getpid())

    # ------------------------------------------------------------ accounting and the ledger

    def scan(self, protected: set[str]) -> tuple[list[tuple[str, int, float]], CacheUsage]:
        """:func:`~ucmagic.files.cache_usage.scan`, timed (waits and re-counts scale with its cost)."""
        t0 = time.monotonic()
        out = scan(self.layout, protected)
        self._scan_s = 0.8 * self._scan_s + 0.2 * (time.monotonic() - t0)
        return out

    def read_ledger(self) -> int | None:
        try:
            with open(self.layout.ledger, "rb") as f:
                return int(f.read() or b"0")
        except (OSError, ValueError):
            return None

    def write_ledger(self, value: int) -> None:
        fd = open_private(self.layout.ledger, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, what="cache ledger")
        try:
            os.write(fd, str(max(0, int(value))).encode().rjust(20))  # fixed width: the file's own size never changes
        finally:
            os.close(fd)

    def ledger_stale(self) -> None:
        """Entries were removed outside an eviction: the next reservation re-counts."""
        self._synced_at = 0.0

    # ------------------------------------------------------------ eviction

    def eviction_lock(self) -> contextlib.AbstractContextManager[None]:
        """The machine-wide lock under which entries are evicted and budgets reserved."""
        return self.layout.evicting()

    def evict(self, bytes_to_free: int = 0, *, keep_below: int | None = None) -> int:
        """Remove least-recently-used unprotected entries until ``bytes_to_free`` bytes are gone.

        With ``keep_below``, free what it takes to bring the whole directory (as counted now, under
        the eviction lock) under that many bytes instead. Dead owners' records and temp files go too.
        """
        with self.eviction_lock():
            return self.evict_locked(bytes_to_free, keep_below)[0]

    def evict_locked(self, bytes_to_free: int, keep_below: int | None) -> tuple[int, int]:
        """(bytes freed, usage total after) — caller holds the eviction lock."""
        reap(self.layout, self.records)
        free, usage = self.scan(self.records.protected_names(reap=False))
        total = usage.total_bytes
        if keep_below is not None:
            bytes_to_free = total - keep_below
        freed = 0
        victims = choose_victims(free, bytes_to_free) if bytes_to_free > 0 else []
        if victims:
            freed = self._drop_locked(victims, {p: s for p, s, _ in free})
        self.write_ledger(total - freed)
        self._synced_at = time.monotonic()
        return freed, total - freed

    # ------------------------------------------------------------ room for a fill

    def reserve(self, size: int, tmp: str, *, may_exceed: Callable[[], bool] | None = None,
                on_wait: Callable[[], None] | None = None) -> int:
        """Hold room for ``size`` bytes at ``tmp`` (created empty, through the cache root's descriptor; its name
        carries the size), within the budget and the free-disk floor. Waits for room while others consume;
        raises when a file can never fit or the disk is full of protected files and this fill must not wait.
        Returns the temp file's descriptor, open for writing (the caller closes it), or -1 without ``tmp``
        or a budget."""
        limit = self.budget() if tmp else None  # no temp file: the caller found no budget (one ask per fill)
        fd = -1
        if limit is not None:
            if admit(size, limit, 0).verdict == REFUSE:  # it never fits: waiting would never end
                raise self._too_big(size, limit)
            fd = self._reserve_budget(size, tmp, may_exceed, on_wait)
        # without a budget the temp file appears when the copy starts (one open less per fill)
        try:
            self._ensure_disk(size, may_exceed, on_wait)
        except BaseException:
            if fd >= 0:
                os.close(fd)
                with contextlib.suppress(OSError):
                    os.unlink("tmp/" + os.path.basename(tmp), dir_fd=self.layout.anchor())
            raise
        return fd

    def _hold(self, tmp: str) -> int:
        """Make the temp file ``tmp`` that holds a fill's room: new, under ``tmp/``, through the cache root's
        descriptor (never by path, never through a link); its descriptor, open for writing."""
        name = "tmp/" + os.path.basename(tmp)
        return self.layout.at_root(lambda root: os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW
                                                        | os.O_CLOEXEC, 0o600, dir_fd=root))

    def _reserve_budget(self, size: int, tmp: str, may_exceed: Callable[[], bool] | None,
                        on_wait: Callable[[], None] | None) -> int:
        """Wait until :func:`~ucmagic.files.admission.admit` lets the fill in, then hold its room at ``tmp``.
        Fills of this process that started waiting earlier (the loop's order) get room first."""
        delay = 0.005
        waited = 0.0
        state = Waiting()  # the lowest count seen while waiting, since when, what fills had copied
        stall_s = STALL_S if may_exceed is None else LOOP_STALL_S
        ticket = self._queue(size)
        try:
            while True:
                limit = self.budget()
                if limit is None:  # the process that set the only budget is gone: no limit now
                    return self._hold(tmp)
                # checked before the lock: the fill a blocked consumer needs next, after a moment for
                # other streams to release
                head = waited >= 0.05 and may_exceed is not None and may_exceed()
                with self.eviction_lock():
                    total = self.read_ledger()
                    evictable: list[tuple[str, int, float]] = []
                    counted, copying = False, state.copied
                    if total is None or must_count(total, size, limit, time.monotonic() - self._synced_at,
                                                   self._scan_s):
                        reap(self.layout, self.records)
                        evictable, usage = self.scan(self.records.protected_names(reap=False))
                        total, copying = usage.total_bytes, usage.tmp_written
                        self._synced_at, counted = time.monotonic(), True
                    # evict a little more than this file needs: the next fills find room without a scan
                    d = admit(size, limit, total, evictable, head=head, ahead=self._ahead(ticket),
                              slack=min(limit // 16, 256 << 20))
                    if d.evict:
                        total -= self._drop_locked(d.evict, {p: n for p, n, _ in evictable})
                    if d.verdict == ADMIT:
                        fd = self._hold(tmp)  # visible to every process's count from now on
                        try:
                            self.write_ledger(total + size)
                        except BaseException:
                            os.close(fd)
                            with contextlib.suppress(OSError):
                                os.unlink("tmp/" + os.path.basename(tmp), dir_fd=self.layout.anchor())
                            raise
                        return fd
                    if counted:  # the count, for every process's next look
                        self.write_ledger(total)
                if d.verdict == REFUSE:  # the budget in force shrank below this file meanwhile
                    raise self._too_big(size, limit)
                state, verdict = still_waiting(state, time.monotonic(), total, copying, stall_s)
                if verdict == STALL:
                    raise self._stalled(size, limit, total, loop=may_exceed is not None)
                if on_wait is not None:
                    on_wait()  # may raise: the loop that wanted this file is gone
                time.sleep(delay)
                waited += delay
                delay = next_delay(delay, self._scan_s)
        finally:
            self._dequeue(ticket)

    def _stalled(self, size: int, limit: int, total: int, *, loop: bool) -> CacheFullError:
        """The error of a fill that waited for room without any being freed (see :func:`still_waiting`)."""
        if not loop:  # no loop of this process waits on this fill, and nothing was freed for a long time
            return CacheFullError(
                f"no room for a {format_size(size)} file in {self.budget_name(limit)} for {STALL_S:g} s: "
                f"{format_size(total)} is held by files running loops have not consumed yet. Raise "
                "cache_limit, or let those loops finish first")
        # a loop's fill, never allowed over and nothing freed: the loop's consumption reports lag
        # behind what it read (a wrapper that yields fewer items than it takes), a deadlock
        return CacheFullError(
            f"no room for a {format_size(size)} file in {self.budget_name(limit)} for "
            f"{LOOP_STALL_S:g} s while the loop waits: {format_size(total)} is held by files it has "
            "not reported consumed (a wrapper dataset that yields fewer items than it reads "
            "under-reports). Raise cache_limit to hold a few batches per DataLoader worker, or set "
            "cache_limit=None")

    def _queue(self, size: int) -> int:
        """A ticket for a fill of ``size`` bytes about to ask for room: fills asking earlier go first."""
        with self._waiting_mu:
            self._tickets += 1
            self._waiting[self._tickets] = size
            return self._tickets

    def _dequeue(self, ticket: int) -> None:
        with self._waiting_mu:
            self._waiting.pop(ticket, None)

    def _ahead(self, ticket: int) -> int:
        """Bytes of this process's fills that asked for room before ``ticket`` and still wait."""
        with self._waiting_mu:
            return sum(size for t, size in self._waiting.items() if t < ticket)

    def _drop_locked(self, paths: Iterable[str], sizes: dict[str, int]) -> int:
        """Remove the entries whose files are ``paths`` (as a scan found them, of ``sizes``); the bytes
        freed. Under the eviction lock; the removal token changes before and after."""
        freed = 0
        self.removals.change()
        for p in paths:
            name = self.layout.entry_of(p)
            if name is not None and self.layout.drop_entry(name):
                freed += sizes[p]
        self.removals.change()
        return freed

    def _too_big(self, size: int, limit: int) -> CacheFullError:
        return CacheFullError(
            f"a {format_size(size)} file does not fit in {self.budget_name(limit)}: raise cache_limit to at "
            f"least {format_size(size)}")

    # ------------------------------------------------------------ the free-disk floor

    def _ensure_disk(self, size: int, may_exceed: Callable[[], bool] | None,
                     on_wait: Callable[[], None] | None) -> None:
        """Keep the free-disk floor. ``statvfs`` only when the estimate of free space runs low."""
        now = time.monotonic()
        margin = 64 << 20
        if now - self._free_at < 1.0 and self._free_est - size >= self._floor + margin:
            self._free_est -= size
            return
        waited = 0.0
        while True:
            du = shutil.disk_usage(self.layout.root)
            floor = int(du.total * self.min_free)
            self._floor, self._free_at, self._free_est = floor, time.monotonic(), du.free - size
            if du.free - size >= floor:
                return
            slack = min(du.total // 50, 256 << 20)  # free a little extra: other fills run at the same time
            if self.evict(floor - (du.free - size) + slack):
                continue
            if may_exceed is None or may_exceed() or waited > 30.0:
                raise self.disk_full(size, du.free, floor)
            if on_wait is not None:
                on_wait()
            time.sleep(0.02)
            waited += 0.02

    def disk_full(self, size: int, free: int | None = None, floor: int | None = None) -> CacheFullError:
        """The error of a fill of ``size`` bytes that the cache disk has no room for (``free`` and
        ``floor``: as measured, else measured now), naming the free space, the budget and the fixes."""
        root = self.layout.root
        if free is None or floor is None:
            try:
                du = shutil.disk_usage(root)
                free, floor = du.free, int(du.total * self.min_free)
            except OSError:
                free, floor = 0, 0
        limit = self.budget()
        try:
            held = self.scan(self.records.protected_names(reap=False))[1].total_bytes  # an error path: a scan is fine
        except OSError:
            held = 0
        room = format_size(max(0, held + free - floor))  # what this cache can have on this disk
        budget = (f"{self.budget_name(limit)} is more than the disk holds: lower it to under {room}"
                  if limit is not None else f"set cache_limit= under {room} (what the disk holds)")
        return CacheFullError(
            f"cache disk of {root} is full: a {format_size(size)} file does not fit in {format_size(free)} free "
            f"({format_size(floor)} must stay free, min_free={self.min_free:g}; the cache holds {format_size(held)}, "
            f"none of it evictable now). Either {budget}, free disk space, or set cache_dir= (or "
            "$UCMAGIC_CACHE_DIR) to a larger disk")
