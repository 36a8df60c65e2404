"""One stream's items in delivery order (:class:`StreamItems`), decoded from the listing a chunk at a time.

Call order: ``StreamItems(listing, ranges, order, keys, space, stamps=...)`` once per stream and epoch; then any of
``entry(pos)``, ``key_at(pos)``, ``file_at(pos)``, ``run(lo, hi)``, ``names(lo, hi)``, from any thread.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from . import plan
from .cache_layout import entry_files, version_stamp
from .listing import Listing
from .volume import FileEntry

STREAM_CHUNK = 512  # items of a stream decoded from the listing at once (~450 B each while kept)
STREAM_CHUNKS_KEPT = 8  # decoded chunks kept per stream (read-ahead and protection stay within them)


class _Chunk:
    """One decoded chunk of a stream: listing indices, relative paths, entry files (for lookups and
    protection records), version stamps and sizes; the cache keys and :class:`FileEntry` objects only
    once asked for (a warm run needs neither: decoding them cost about a third of a warm epoch of
    200,000 small files)."""

    __slots__ = ("idx", "arr", "_keys", "_keys_of", "rels", "files", "stamps", "sizes", "entries")

    def __init__(self, arr: np.ndarray, keys_of: Callable[[np.ndarray], list[tuple[str, str]]], stamps: list[int],
                 sizes: list[int], rels: list[str], space: str, plain: bool = False) -> None:
        self.arr = arr
        self.idx: list[int] = arr.tolist()
        self._keys: list[tuple[str, str]] | None = None
        self._keys_of = keys_of
        self.rels = rels
        self.files = entry_files(space, rels, plain=plain)
        self.stamps = stamps
        self.sizes = sizes
        self.entries: list[FileEntry] | None = None

    @property
    def keys(self) -> list[tuple[str, str]]:
        """``(cache key, suffix)`` of each item (decoded once asked for; two threads at once: twice)."""
        keys = self._keys
        if keys is None:
            keys = self._keys = self._keys_of(self.arr)
        return keys


class StreamItems:
    """One stream's items in delivery order, decoded from the listing a chunk at a time.

    ``order(positions)`` maps epoch positions to listing indices (e.g. :func:`plan.order_at`);
    ``ranges`` are the stream's epoch positions (:func:`plan.stream_positions`); ``keys(indices)`` and
    ``stamps(indices)`` give the cache keys and their version stamps (by default from the keys). Only the last
    :data:`STREAM_CHUNKS_KEPT` chunks are held; an older one is recomputed when asked for again, so
    memory does not grow with the stream. Thread-safe.
    """

    def __init__(self, listing: Listing, ranges: Sequence[plan.Range], order: Callable[[np.ndarray], np.ndarray],
                 keys: Callable[[np.ndarray], list[tuple[str, str]]], space: str,
                 chunk: int = STREAM_CHUNK, stamps: Callable[[np.ndarray], list[int]] | None = None) -> None:
        self.listing = listing
        self.space = space
        self.ranges = list(ranges)
        self.order = order
        self.keys = keys
        self.stamps = stamps or (lambda idx: [version_stamp(k) for k, _ in keys(idx)])
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
        got = _Chunk(idx, self.keys, self.stamps(idx), self.listing.sizes[idx].tolist(), self.listing.paths(idx),
                     self.space, self.listing.all_plain(idx))
        with self._mu:
            self._kept[c] = got
            while len(self._kept) > STREAM_CHUNKS_KEPT:
                self._kept.popitem(last=False)
        return got

    def index(self, pos: int) -> int:
        return self._at(pos // self.chunk).idx[pos % self.chunk]

    def entry(self, pos: int) -> FileEntry:
        return self._entries(self._at(pos // self.chunk))[pos % self.chunk]

    def _entries(self, got: _Chunk) -> list[FileEntry]:
        entries = got.entries
        if entries is None:  # decoded once per chunk (two threads at once: the same list twice)
            entries = got.entries = [FileEntry(r, s, m) for r, s, m in
                                     zip(got.rels, got.sizes, self.listing.mtimes[got.arr].tolist())]
        return entries

    def fill_info(self, pos: int) -> tuple[FileEntry, str, str, str, int]:
        """What a fill of position ``pos`` needs, from one chunk lookup (it runs per file filled): its
        entry, cache key and suffix, entry file (:meth:`file_at`) and listing index."""
        got = self._at(pos // self.chunk)
        i = pos % self.chunk
        key, suffix = got.keys[i]
        return self._entries(got)[i], key, suffix, got.files[i], got.idx[i]

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
