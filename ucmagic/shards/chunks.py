"""The ranged chunk cache: big files cached as byte ranges (chunks) instead of whole.

A shard of 1-10 GiB is cut into chunks of ``chunk_size`` bytes (32 MiB by default); each chunk is
one :class:`~ucmagic.files.cache.FileCache` entry keyed by (volume, path, size, mtime, chunk size, chunk
index), so every rule of whole files holds per chunk: one fill per chunk across threads and
processes, the budget (fills wait for room; a fill the reader is blocked on may go over by itself:
the most held is the budget plus one or two chunks per stream when the budget holds the streams'
shuffle windows, the budget plus each stream's window when it does not; docs/shards.md),
least-recently-used eviction that skips what a live reader protects, and validation: the source's
size and mtime are part of the key and are checked before the first fill and after every fill, so
a source rewritten after it was listed raises :class:`~ucmagic.errors.SourceChangedError` and
chunks of two versions are never mixed. A chunk fill reads its range with the parallel ranged
reads of :mod:`ucmagic.files.ranged`.

:class:`ChunkReader` is one stream's view (one per iterating process): ``read(file, offset, size)``
returns bytes, ``prefetch`` starts fills of the chunks the plan needs next on a small thread pool,
``release`` lets chunks go. Chunks being read or filled are named in the stream's protection
record; an open descriptor keeps a held chunk readable even if it is evicted meanwhile.
"""
from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, wait
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

from ..files.cache import FileCache
from ..files.cache_layout import cache_key, entry_record_names
from ..files.filler import CacheFiller
from ..files.lease import LeaseRecord
from ..files.locks import process_tag
from ..files.fetch import shared_pool
from ..telemetry import SharedCounters
from ..files.volume import FileEntry, Volume

CHUNK_SIZE = 32 << 20
"""Default bytes per chunk."""
SUFFIX = ".chunk"
FILL_THREADS = 4  # read-ahead fills per process (each fill reads its chunk on several range streams)
CLOSE_WAIT_S = 30.0  # a closing reader waits this long for its running read-ahead fills


@dataclass(frozen=True)
class ChunkedFile:
    """One version of a source file cut into chunks of ``chunk_size`` bytes."""

    volume: Volume
    entry: FileEntry
    chunk_size: int = CHUNK_SIZE

    @property
    def chunks(self) -> int:
        return -(-self.entry.size // self.chunk_size)

    def span(self, c: int) -> tuple[int, int]:
        """Byte range ``[start, end)`` of chunk ``c``."""
        start = c * self.chunk_size
        return start, min(start + self.chunk_size, self.entry.size)

    def chunks_of(self, offset: int, size: int) -> range:
        """Chunk indices holding bytes ``[offset, offset + size)`` (one chunk for an empty range)."""
        first = offset // self.chunk_size
        last = (offset + max(size, 1) - 1) // self.chunk_size
        return range(first, last + 1)

    def key(self, c: int) -> str:
        """Cache key of chunk ``c`` of this version (a changed size or mtime gives new keys)."""
        e = self.entry
        return cache_key(f"{self.volume.uri}#chunks/{self.chunk_size}/{c}", e.path, e.size, e.mtime)

    def names(self, c: int) -> list[str]:
        """What a protection record lists for chunk ``c`` (the cache's names of its entry)."""
        start, end = self.span(c)
        return entry_record_names(self.key(c), SUFFIX, end - start)


def fill_chunk(cache: FileCache, f: ChunkedFile, c: int, *, may_exceed: Callable[[], bool] | None = None,
               retries: int = 3, checked: set[str] | None = None,
               filler: CacheFiller | None = None) -> tuple[str, bool]:
    """``(path, filled)`` of chunk ``c`` of ``f`` in ``cache``: a hit, or one ranged copy of its bytes
    (:meth:`CacheFiller.fill_range`, the one fill path: ``filler``, else one with ``retries``).

    The source is stat'ed before the first fill of ``f`` (tracked in ``checked``) and after every
    fill; a source that no longer matches ``f.entry`` raises SourceChangedError and the chunk is dropped.
    """
    start, end = f.span(c)
    filler = filler or CacheFiller(cache, retries=retries)
    return filler.fill_range(f.volume, f.entry, start, end, key=f.key(c), suffix=SUFFIX, checked=checked,
                             may_exceed=may_exceed,
                             range_size=max(1 << 20, min(f.volume.range_size, f.chunk_size // 4)))


class ChunkReader:
    """One stream's reads of chunked files through the cache (create one per process; not thread-safe
    except :meth:`prefetch`, whose fills run on a pool).

    Args:
        cache: the file cache.
        files: the chunked files, addressed by index.
        keep: chunks kept open (and protected) at most, least recently used dropped first.
        owner: process the protection record speaks for (default: this one); ``slot``: stream id.
        counters: hits (chunks found cached), misses (chunks filled) and bytes fetched are added here.
    """

    def __init__(self, cache: FileCache, files: Sequence[ChunkedFile], *, keep: int = 4, owner: str | None = None,
                 slot: int | str = 0, counters: SharedCounters | None = None, threads: int = FILL_THREADS,
                 retries: int = 3) -> None:
        self.cache, self.files = cache, list(files)
        self.keep = max(1, int(keep))
        self.counters = counters
        self.retries = retries
        self.filler = CacheFiller(cache, retries=retries, counters=counters)  # the one fill path: counted there
        self._threads = max(1, int(threads))
        # the lease of this reader's chunks: one protection record (ucmagic.files.lease), as every family's
        self._lease = LeaseRecord(cache, owner or process_tag(), f"chunks-{slot}-{id(self):x}")
        self._held: OrderedDict[tuple[int, int], int] = OrderedDict()  # (file, chunk) -> open descriptor
        self._inflight: dict[tuple[int, int], tuple[Future[Any], threading.Event]] = {}
        self._mu = threading.Lock()
        self._checked: set[str] = set()
        self.last_wait_s = 0.0  # seconds the last read waited for a fill
        self.last_hit = True  # the last read's chunks were all cached or held already (none copied for it)
        self.fills = 0

    # ------------------------------------------------------------ protection

    def _protect(self) -> None:
        with self._mu:
            names = {n for i, c in [*self._held, *self._inflight] for n in self.files[i].names(c)}
        self._lease.write(sorted(names))  # written only when the names change

    # ------------------------------------------------------------ fills

    def _fill(self, fc: tuple[int, int], wanted: threading.Event) -> tuple[str, bool]:
        """``(path, filled)``: ``filled`` when the chunk was copied from the volume (else found in the cache)."""
        path, filled = fill_chunk(self.cache, self.files[fc[0]], fc[1], may_exceed=wanted.is_set,
                                  checked=self._checked, filler=self.filler)
        if filled:
            self.fills += 1
        return path, filled

    def prefetch(self, chunks: Iterable[tuple[int, int]]) -> None:
        """Start fills of ``(file, chunk)`` pairs not held or in flight yet (in order, on the pool)."""
        new: list[tuple[tuple[int, int], Future[Any], threading.Event]] = []
        with self._mu:
            for fc in chunks:
                if fc in self._held or fc in self._inflight:
                    continue
                fut: Future[Any] = Future()
                ev = threading.Event()
                self._inflight[fc] = (fut, ev)
                new.append((fc, fut, ev))
        if not new:
            return
        self._protect()  # named before any fill looks its chunk up: found present, it stays until read
        pool = shared_pool(self._threads, "chunks")
        for fc, fut, ev in new:
            pool.submit(self._run, fc, fut, ev)

    def _run(self, fc: tuple[int, int], fut: Future[Any], ev: threading.Event) -> None:
        if not fut.set_running_or_notify_cancel():
            return  # the reader took it over (or closed) before a pool thread got to it
        try:
            fut.set_result(self._fill(fc, ev))
        except BaseException as exc:  # noqa: BLE001 - the reader raises it through the future
            fut.set_exception(exc)

    def pending(self) -> list[tuple[int, int]]:
        """Chunks filled or being filled ahead and not yet read."""
        with self._mu:
            return list(self._inflight)

    def discard(self, chunks: Iterable[tuple[int, int]]) -> None:
        """Forget read-ahead fills of these chunks (cancelled if not started; unprotected)."""
        dropped = False
        for fc in chunks:
            with self._mu:
                job = self._inflight.pop(fc, None)
            if job is not None:
                job[0].cancel()
                dropped = True
        if dropped:
            self._protect()

    def inflight(self) -> int:
        """Fills started and not yet taken by a read."""
        with self._mu:
            return len(self._inflight)

    def _open(self, fc: tuple[int, int]) -> int:
        fd = self._held.get(fc)
        if fd is not None:
            self._held.move_to_end(fc)
            return fd
        t0 = time.perf_counter()
        with self._mu:
            job = self._inflight.get(fc)
        if job is not None and job[0].cancel():
            job = None  # queued behind fills that wait for room: fill it here, now, instead
        if job is None:
            ev = threading.Event()
            ev.set()
            fut: Future[Any] = Future()
            with self._mu:
                self._inflight[fc] = (fut, ev)
            self._protect()  # named before the fill: nobody evicts it between fill and open
            try:
                fut.set_result(self._fill(fc, ev))
            except BaseException as exc:  # noqa: BLE001 - raised below through the future
                fut.set_exception(exc)
        else:
            fut, ev = job
            ev.set()  # the reader waits for it now: its fill may go over the budget
        try:
            path, filled = fut.result()
            try:
                fd = os.open(path, os.O_RDONLY)
            except FileNotFoundError:  # removed by hand (clear_cache) since the fill: fill it again
                path, filled = self._fill(fc, ev)
                fd = os.open(path, os.O_RDONLY)
            if filled:  # copied from the volume (here or ahead): a miss; found in the cache: a hit
                self.last_hit = False
        finally:
            with self._mu:
                self._inflight.pop(fc, None)
        self._held[fc] = fd
        self.last_wait_s += time.perf_counter() - t0
        while len(self._held) > self.keep:
            _, old = self._held.popitem(last=False)
            os.close(old)
        self._protect()
        return fd

    # ------------------------------------------------------------ reads

    def read(self, file: int, offset: int, size: int) -> bytes:
        """Bytes ``[offset, offset + size)`` of file ``file`` (its chunks filled or found in the cache)."""
        f = self.files[file]
        c0 = offset // f.chunk_size
        if (offset + size - 1) // f.chunk_size == c0 or size == 0:  # within one chunk: one pread, one copy
            fd = self._open((file, c0))
            data = os.pread(fd, size, offset - c0 * f.chunk_size)
            if len(data) == size:
                return data
        out = bytearray(size)
        view = memoryview(out)
        got = 0
        for c in f.chunks_of(offset, size):
            fd = self._open((file, c))
            start, end = f.span(c)
            lo = max(offset + got, start)
            hi = min(offset + size, end)
            while lo < hi:
                n = os.preadv(fd, [view[got:got + hi - lo]], lo - start)
                if n <= 0:
                    raise OSError(f"chunk {c} of {f.volume.display(f.entry.path)} is shorter than expected")
                got += n
                lo += n
        return bytes(out)

    def begin(self) -> None:
        """Start timing one item's reads (:attr:`last_wait_s`, :attr:`last_hit`)."""
        self.last_wait_s, self.last_hit = 0.0, True

    def release(self, chunks: Iterable[tuple[int, int]]) -> None:
        """Close and unprotect these held chunks (the plan needs them no more)."""
        changed = False
        for fc in chunks:
            fd = self._held.pop(fc, None)
            if fd is not None:
                os.close(fd)
                changed = True
        if changed:
            self._protect()

    def held(self) -> list[tuple[int, int]]:
        return list(self._held)

    def close(self) -> None:
        """Drop every held chunk and the protection record; cancel fills not started and let the
        running ones finish (a fill waiting for room may take it now) for up to ``CLOSE_WAIT_S``."""
        for fd in self._held.values():
            os.close(fd)
        self._held.clear()
        with self._mu:
            jobs = list(self._inflight.values())
            self._inflight.clear()
        for fut, ev in jobs:
            fut.cancel()
            ev.set()
        wait([fut for fut, _ in jobs], timeout=CLOSE_WAIT_S)
        self._lease.clear()
