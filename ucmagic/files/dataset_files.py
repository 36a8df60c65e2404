"""A dataset's listed files in the cache: their keys, which are cached, where a cached path came from, warming.

Call order: ``ListedFiles(listing, volume, cache, space, filler)`` once per dataset object; then, from any
thread, ``keys(indices)`` (what :class:`~ucmagic.files.stream_items.StreamItems` decodes), ``cached()``,
``source_of(path)``, ``warm(...)``.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from .._util import release_free_heap
from ..errors import NotAnEntryError
from .cache import FileCache
from .cache_layout import cache_key, cache_keys, map_relpath, safe_suffix, unmap_relpath, version_stamp
from .fetch import read_ahead
from .filler import CacheFiller
from .listing import Listing
from .stream_items import STREAM_CHUNK
from .volume import FileEntry, Volume


@dataclass(frozen=True)
class SourceFile:
    """Where a cached file came from (:meth:`UCVolumeDataset.source_of`)."""

    source: str  # the file in the volume, as ucmagic displays it (a local path or a URI)
    rel: str  # its path relative to the dataset's root (what the cached path ends with)
    size: int  # bytes, as listed
    mtime: float  # modification time (seconds since the epoch), as listed


class ListedFiles:
    """The files of ``listing`` (in ``volume``) as entries of ``cache`` in ``space``, filled by ``filler``."""

    def __init__(self, listing: Listing, volume: Volume, cache: FileCache, space: str, filler: CacheFiller) -> None:
        self.listing, self.volume, self.cache, self.space, self.filler = listing, volume, cache, space, filler

    def keys(self, idx: np.ndarray) -> list[tuple[str, str]]:
        """``(cache key, suffix)`` of a chunk of files: the keys stored in the node listing (the
        suffix stays empty: an entry keeps the file's relative path, extension included)."""
        if self.listing.volume_uri != self.volume.uri:  # keys depend on the URI the listing was built under
            return cache_keys(self.volume.uri, self.listing.entries(idx))
        return [(k, "") for k in self.listing.keys(idx)]

    def stamps(self, idx: np.ndarray) -> list[int]:
        """The version stamps of :meth:`keys` (from the listing's key bytes where its keys are these)."""
        if self.listing.volume_uri != self.volume.uri:
            return [version_stamp(k) for k, _ in self.keys(idx)]
        return self.listing.stamps(idx)

    def key(self, e: FileEntry) -> tuple[str, str]:
        return cache_key(self.volume.uri, e.path, e.size, e.mtime), safe_suffix(e.path)

    def fill(self, e: FileEntry) -> tuple[str, bool]:
        """``(cached path, copied now)`` for ``e``: a hit, or one (single-flight) copy from the volume."""
        key, suffix = self.key(e)
        return self.filler.fill_file(self.volume, e, key, suffix, rel=e.path, space=self.space)

    def cached(self) -> Iterator[tuple[str, int]]:
        """(path, bytes) of each listed file that is in the cache, in listing order."""
        for e in self.listing.iter_entries(STREAM_CHUNK):  # small chunks: a short-lived per-file transient
            p = self.cache.lookup(*self.key(e), e.size, rel=e.path, space=self.space, touch=False)
            if p is not None:
                yield p, e.size
        release_free_heap()

    def warm(self, background: bool, depth: int, timeout: float | None) -> Future[int]:
        """Copy every listed file into the cache (see :meth:`UCVolumeDataset.warm`)."""
        fut: Future[int] = Future()
        counters = self.filler.counters

        def misses() -> int:
            return 0 if counters is None else counters.totals()["misses"]

        def run() -> None:
            before = misses()
            try:
                for _ in read_ahead(self.fill, self.listing.iter_entries(), depth=depth, timeout=timeout):
                    pass
                fut.set_result(misses() - before)
            except BaseException as exc:  # noqa: BLE001 - surfaces through fut.result()
                fut.set_exception(exc)

        if background:
            threading.Thread(target=run, name="ucmagic-warm", daemon=True).start()
        else:
            run()
            fut.result()
        return fut

    def source_of(self, path: str | os.PathLike[str]) -> SourceFile:
        """The listed file whose cached copy is ``path`` (see :meth:`UCVolumeDataset.source_of`)."""
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
            key, _ = self.keys(np.array([index]))[0]
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
