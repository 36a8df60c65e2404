"""The one fill path of the cache: whole files and byte ranges, retries, validation, skip policy, counters.

Every dataset family fills through a :class:`CacheFiller` (files: :meth:`~CacheFiller.fill_file`; shard
chunks and Parquet row groups: :meth:`~CacheFiller.fill_range`; anything else that writes one entry:
:meth:`~CacheFiller.fill`). The cache (:class:`~ucmagic.files.cache.FileCache`) does the single-flight
copy, the budget and the naming; the filler adds what is the same for every family: the retry policy
(:func:`~ucmagic.files.fetch.with_retries`), errors that name the file, the checks that a source is still
the version listed, and the counters.

Call order (one filler per dataset object and process; thread-safe)::

    filler = CacheFiller(cache, retries=..., counters=..., progress=watch_progress, skip=SkipPolicy(...))
    path, fetched = filler.fill_file(volume, entry, key, suffix, rel=..., space=...)   # a whole file, or
    path, fetched = filler.fill_range(volume, entry, start, end, key=..., checked=...)  # bytes [start, end)
    filler.skippable(exc)       # a fill's error: skip the file (on_error / on_missing) or raise it

``progress`` is called by the cache's fill with a probe of the bytes written (``None`` when it ends):
:func:`~ucmagic.files.fetch.watch_progress` by default, so a read-ahead's timeout counts only time without
progress. :class:`SourceChecks` is ``validate="lazy"``'s check of a reused listing's files.
"""
from __future__ import annotations

import errno
import time
from typing import Callable, NamedTuple, Sequence

from .._shared import SharedBits
from .._util import DEFAULT_RETRIES
from ..errors import CacheFullError, CacheFullFetchError, FetchError, SourceChangedError
from ..telemetry import SharedCounters
from . import ranged
from .cache import FileCache
from .cache_layout import cache_key
from .fetch import shared_pool, watch_progress, with_retries
from .volume import FileEntry, Volume, check_unchanged, copy_error

Progress = Callable[[Callable[[], object] | None], None]
"""Told a probe of a fill's progress when its copy starts, ``None`` when it ends (see the module)."""

CHECK_THREADS = 16  # threads of one process's validate="lazy" checks (their own pool: a hit waits on them)
CHECKED_HERE = 16  # validate="lazy": files checked on the calling thread before timing decides on threads
FAST_CHECK_S = 50e-6  # a check (one stat) faster than this: the rest is checked on the calling thread


class SkipPolicy(NamedTuple):
    """Which fill errors skip the file instead of raising: ``on_error`` / ``on_missing`` = ``"raise"`` or ``"skip"``."""

    on_error: str = "raise"
    on_missing: str = "raise"

    def skippable(self, exc: BaseException) -> bool:
        if isinstance(exc, CacheFullError):  # the cache disk or budget, not the file: every next one fails too
            return False
        return self.on_error == "skip" or (self.on_missing == "skip" and source_missing(exc))


def source_missing(exc: BaseException) -> bool:
    """True when a fill failed because the source file is gone (deleted after the listing)."""
    return isinstance(exc, FetchError) and isinstance(exc.__cause__, FileNotFoundError)


def takes_expect(volume: Volume) -> bool:
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


def copies_into(volume: Volume) -> bool:
    """True when a fill may copy through ``volume.copy_into`` (into its own descriptor) instead of ``copy_to``:
    the ``copy_into`` in force is defined by the class of the ``copy_to`` in force or a subclass of it (a
    subclass that overrides ``copy_to`` below it, to inject faults or transform bytes, is always copied
    through its ``copy_to``; ``Volume``'s own ``copy_into`` copies nothing) and ``copy_to`` takes ``expect=``."""
    if "copy_to" in getattr(volume, "__dict__", {}):  # set on the object itself
        return False
    cls = type(volume)
    known = _INTO.get(cls)
    if known is None:
        def owner(name: str) -> type | None:
            return next((k for k in cls.__mro__ if name in k.__dict__), None)

        into, to = owner("copy_into"), owner("copy_to")
        known = _INTO[cls] = into is not None and to is not None and issubclass(into, to) and takes_expect(volume)
    return known


_INTO: dict[type, bool] = {}


def range_key(volume: Volume, entry: FileEntry, start: int, end: int) -> str:
    """The cache key of bytes ``[start, end)`` of one version of ``entry`` (a changed size or mtime: new keys)."""
    return cache_key(f"{volume.uri}#range/{start}-{end}", entry.path, entry.size, entry.mtime)


class _OffsetReader:
    """A range reader shifted by ``base`` bytes: a ranged copy of one range reads the source at its offset."""

    def __init__(self, reader: ranged.RangeReader, base: int) -> None:
        self.reader, self.base = reader, base

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        return self.reader.readinto_at(self.base + offset, buf)

    def close(self) -> None:
        self.reader.close()


class CacheFiller:
    """Fills cache entries (see the module for the call order).

    Args:
        cache: the cache filled.
        retries: transient failures retried per fill (:func:`~ucmagic.files.fetch.with_retries`).
        counters: hits, misses, bytes fetched, retries and fill latencies are added here (None: not counted).
        progress: told the fill's progress probe (default :func:`~ucmagic.files.fetch.watch_progress`).
        skip: which errors :meth:`skippable` reports as "skip the file".
    """

    def __init__(self, cache: FileCache, *, retries: int = DEFAULT_RETRIES, counters: SharedCounters | None = None,
                 progress: Progress | None = watch_progress, skip: SkipPolicy = SkipPolicy()) -> None:
        self.cache = cache
        self.retries = int(retries)
        self.counters = counters
        self.progress = progress
        self.skip = skip

    def skippable(self, exc: BaseException) -> bool:
        """Whether a fill's error skips the file (the dataset's ``on_error`` / ``on_missing``)."""
        return self.skip.skippable(exc)

    def fill(self, key: str, suffix: str, size: int, write: Callable[[str], int], *, rel: str | None = None,
             space: str | None = None, may_exceed: Callable[[], bool] | None = None,
             on_wait: Callable[[], None] | None = None, looked_up: bool = False,
             count_hit: bool = True, write_fd: Callable[[int], int | None] | None = None) -> tuple[str, bool]:
        """``(path, fetched)`` of the entry ``key`` of ``size`` bytes: a hit, or one single-flight call of
        ``write(tmp_path) -> bytes written`` (or ``write_fd(fd)``; see :meth:`FileCache.fill` for the
        arguments), retried on transient errors. A full cache disk raises :class:`CacheFullError` at once (not retried).
        Counted as a miss (with its latency and bytes) or, unless not ``count_hit``, a hit."""
        cache, counters = self.cache, self.counters
        t0 = time.perf_counter()

        def attempt(_: object) -> tuple[str, bool]:
            try:
                return cache.fill(key, suffix, size, write, may_exceed=may_exceed, on_wait=on_wait,
                                  looked_up=looked_up, rel=rel, space=space, progress=self.progress,
                                  write_fd=write_fd)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the cache disk, not the file: not retried
                    raise cache.budget_keeper.disk_full(size) from exc
                raise

        on_retry = None if counters is None else (lambda _: counters.add(retries=1))
        path, fetched = with_retries(attempt, None, self.retries, on_retry=on_retry)
        if counters is not None:
            if fetched:
                counters.fetched(size, time.perf_counter() - t0)
            elif count_hit:
                counters.add(hits=1)
        return path, fetched

    def fill_file(self, volume: Volume, entry: FileEntry, key: str | None = None, suffix: str = "", *,
                  rel: str | None = None, space: str | None = None, may_exceed: Callable[[], bool] | None = None,
                  on_wait: Callable[[], None] | None = None, looked_up: bool = False,
                  count_hit: bool = True) -> tuple[str, bool]:
        """``(path, fetched)`` of a whole file of ``volume`` (``volume.copy_to``, told ``expect=entry``
        where it takes it; ``volume.copy_into`` the fill's descriptor where :func:`copies_into`). ``key``
        defaults to :func:`cache_key` of the entry. Errors name the file: :class:`FetchError` (a copy),
        :class:`CacheFullFetchError` (no room; also a CacheFullError)."""
        if key is None:
            key = cache_key(volume.uri, entry.path, entry.size, entry.mtime)
        kw = {"expect": entry} if takes_expect(volume) else {}

        def write(tmp: str) -> int:
            return volume.copy_to(entry.path, tmp, **kw)

        def write_fd(fd: int) -> int | None:  # into the fill's own descriptor, where the volume can
            return volume.copy_into(entry.path, fd, expect=entry)

        try:
            return self.fill(key, suffix, entry.size, write, rel=rel, space=space, may_exceed=may_exceed,
                             on_wait=on_wait, looked_up=looked_up, count_hit=count_hit,
                             write_fd=write_fd if copies_into(volume) else None)
        except FetchError:
            raise
        except CacheFullError as exc:  # catchable as CacheFullError (and FetchError), naming the file
            raise CacheFullFetchError(f"{volume.display(entry.path)}: {exc}") from exc
        except Exception as exc:
            raise copy_error(volume, entry.path, exc) from exc

    def fill_range(self, volume: Volume, entry: FileEntry, start: int, end: int, *, key: str | None = None,
                   suffix: str = ".range", checked: set[str] | None = None,
                   may_exceed: Callable[[], bool] | None = None, on_wait: Callable[[], None] | None = None,
                   range_size: int | None = None) -> tuple[str, bool]:
        """``(path, fetched)`` of bytes ``[start, end)`` of one version of ``entry``: a hit, or one
        ranged copy (:func:`ranged.ranged_copy`, parallel range streams) into an entry of its own.

        ``key`` defaults to :func:`range_key`. The source is stat'ed before the first fill of the file
        (tracked by path in ``checked``) and after every fill: a source that no longer matches ``entry``
        raises :class:`SourceChangedError` and the range is dropped, so two versions are never mixed."""
        if key is None:
            key = range_key(volume, entry, start, end)
        size = end - start
        hit = self.cache.lookup(key, suffix, size)
        if hit:
            if self.counters is not None:
                self.counters.add(hits=1)
            return hit, False
        if checked is None or entry.path not in checked:
            check_unchanged(volume, entry, volume.stat(entry.path))
            if checked is not None:
                checked.add(entry.path)
        step = range_size or max(1 << 20, min(volume.range_size, size // 4))

        def write(tmp: str) -> int:
            return ranged.ranged_copy(lambda: _OffsetReader(volume.range_reader(entry.path), start), size, tmp,
                                      range_size=step, chunk=volume.range_chunk, retries=volume.range_retries)

        path, filled = self.fill(key, suffix, size, write, may_exceed=may_exceed, on_wait=on_wait, looked_up=True)
        if filled:
            try:
                check_unchanged(volume, entry, volume.stat(entry.path))
            except BaseException:
                self.cache.remove([path])
                raise
        return path, filled


class SourceChecks:
    """``validate="lazy"``: a reused listing's files are checked against the volume (size and mtime)
    before each is first served, one bit per file in ``checked`` (shared with DataLoader workers).

    Call order: :meth:`ahead` for a run of files about to be looked up (checks the unchecked ones at
    once, on threads where a check is slow), then :meth:`check` for each file served (raises
    :class:`SourceChangedError` for a file rewritten in place)."""

    def __init__(self, volume: Volume, checked: SharedBits) -> None:
        self.volume = volume
        self.checked = checked

    def check(self, index: int, entry: FileEntry, copied: bool) -> None:
        """Before file ``index`` is first served: the volume still holds the version listed. A copy
        made just now was checked by ``copy_to`` (where it takes ``expect=``); a hit costs one ``stat``."""
        checked = self.checked
        if index in checked:
            return
        volume = self.volume
        if not (copied and takes_expect(volume)):
            try:
                now = volume.stat(entry.path)
            except FileNotFoundError as exc:
                raise copy_error(volume, entry.path, exc) from exc
            if (now.size, now.mtime) != (entry.size, entry.mtime):
                raise SourceChangedError(
                    f"{volume.display(entry.path)} changed after this node's listing was taken (listed "
                    f"{entry.size} bytes, mtime {entry.mtime:.6f}; now {now.size} bytes, mtime {now.mtime:.6f}; "
                    "rewritten in place): its cached copy of the listed version was not served. The listing "
                    "is marked stale: create the dataset again to list the files again")
        checked.add(index)

    def ahead(self, files: Sequence[tuple[int, FileEntry]]) -> None:
        """Check the unchecked of ``files`` (``(index, entry)``) at once, on :data:`CHECK_THREADS`
        threads (on the calling thread where a check takes under :data:`FAST_CHECK_S`), so that warm
        hits keep being served without a thread hop. Files that changed stay unchecked."""
        checked, volume = self.checked, self.volume
        todo = [(i, e) for i, e in files if i not in checked]

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
