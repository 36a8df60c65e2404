"""TarShards: the samples of WebDataset tar shards (written by ``webdataset``, ``tar`` or ``ucmagic.pack``).

A sample is a run of tar members sharing a key (see :mod:`.index`), yielded as
``{"__key__": "000123", "__url__": <shard>, "jpg": b"...", "cls": b"3"}`` with extensions lower-cased,
as ``webdataset`` yields them. Where the directory holds ``index.json`` (``ucmagic.pack`` writes
it) the member index is read from it; otherwise each shard's tar headers are read once per node
(header reads only, ranged for remote shards) and kept in the cache directory under the shard's
(volume, path, size, mtime), like the file listing.
"""
from __future__ import annotations

import contextlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from .._util import atomic_write
from ..files.cache_layout import cache_key
from ..files.locks import file_lock
from ..files.ranged import RangedFile
from ..errors import ShardFormatError
from ..files.volume import FileEntry, Volume, filter_entries, open_volume
from .chunks import CHUNK_SIZE
from .index import (COMPRESSED, COMPRESSED_SUFFIXES, INDEX_NAME, MemberColumns, ShardInfo, dumps_index,
                    loads_index, plain_name, scan_tar, shard_info)
from .samples import ShardDataset, Span

INDEX_THREADS = 16  # shards whose headers are read at once when no index.json exists
TAR_PATTERN = "**/*.tar"


def _read_small(volume: Volume, entry: FileEntry) -> bytes:
    with RangedFile(volume.range_reader(entry.path), entry.size) as f:
        return f.read()


def node_index(volume: Volume, entry: FileEntry, cache_root: str) -> ShardInfo:
    """The member index of one foreign shard, built from its tar headers once per node and kept."""
    folder = os.path.join(cache_root, "shard-index")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    key = cache_key(volume.uri, entry.path, entry.size, entry.mtime)
    path = os.path.join(folder, key + ".json")
    for attempt in range(2):
        with contextlib.suppress(FileNotFoundError, ValueError, KeyError, json.JSONDecodeError), \
                open(path, "rb") as f:
            return loads_index(f.read(), path)[0]
        if attempt:
            break
        with file_lock(path + ".lock"):  # one process of the node reads the headers; the others wait
            if os.path.exists(path):
                continue
            with RangedFile(volume.range_reader(entry.path), entry.size) as raw:
                members = scan_tar(raw, volume.display(entry.path))  # names a compressed or truncated shard
            info = shard_info(entry.path, entry.size, members)
            atomic_write(path, dumps_index([info]))
            return info
    raise ShardFormatError(f"the member index of {volume.display(entry.path)} at {path} cannot be read: remove it")


def no_shards_error(volume: Volume, listed: Iterable[FileEntry], pattern: str) -> ShardFormatError:
    """Why no shard matched ``pattern``: compressed tars (named, with the command that decompresses them),
    or no tar at all."""
    packed = sorted(e.path for e in listed if e.path.endswith(COMPRESSED_SUFFIXES))
    if not packed:
        return ShardFormatError(f"no tar shards ({pattern}) under {volume.display()}: write shards with "
                                "ucmagic.pack, webdataset or tar, or pass pattern= to pick them")
    first = volume.display(packed[0])
    command = next((c for _, w, c in COMPRESSED if packed[0].endswith(_SUFFIX_OF[w])), COMPRESSED[0][2])
    more = f" and {len(packed) - 1:,} more" if len(packed) > 1 else ""
    return ShardFormatError(f"no plain tar shards ({pattern}) under {volume.display()}, only compressed tars "
                            f"({packed[0]}{more}): compressed tars are refused (chunks need the members' byte "
                            f"offsets); decompress them first, e.g. {command.format(f=first, plain=plain_name(first))}"
                            " for each")


_SUFFIX_OF = {"gzip": (".gz", ".tgz"), "bzip2": (".bz2", ".tbz2", ".tbz"), "xz": (".xz", ".txz"),
              "zstd": (".zst", ".zstd", ".tzst")}


class TarShards(ShardDataset):
    """The samples of the tar shards under ``path``: ``ds[i]`` is a dict of bytes per extension.

    Args:
        path: a directory (local, ``/Volumes/...`` or an fsspec URL) holding ``.tar`` shards, with or
            without ``index.json``.
        pattern: which files are shards when there is no ``index.json`` (default ``"**/*.tar"``); given,
            the tars it matches are indexed from their headers even where ``index.json`` exists.
        transform: applied to each sample dict (e.g. decode the image) where it is read.
        cache_dir, cache_limit, min_free: the chunk cache (as for UCVolumeDataset).
        chunk_size: bytes per cached chunk (default 32 MiB).
    """

    kind = "TarShards"

    def __init__(self, path: Any, *, pattern: str | None = None,
                 transform: Callable[[dict[str, Any]], Any] | None = None, cache_dir: str | None = None,
                 cache_limit: int | str | None = None, chunk_size: int = CHUNK_SIZE,
                 storage_options: dict[str, Any] | None = None, min_free: float = 0.10) -> None:
        volume = open_volume(path, storage_options)
        listing = {e.path: e for e in volume.list(None)}
        idx = listing.get(INDEX_NAME) if pattern is None else None
        infos: list[ShardInfo] | None = None
        if idx is not None:
            infos = loads_index(_read_small(volume, idx), volume.display(INDEX_NAME))
            entries = []
            for s in infos:
                e = listing.get(s.name)
                if e is None or e.size != s.size:
                    what = "is missing" if e is None else f"has {e.size} bytes, the index says {s.size}"
                    raise ShardFormatError(f"{volume.display(s.name)} {what}: the shards under {volume.display()} "
                                           "do not match index.json (pack again, or pass pattern= to index the tars)")
                entries.append(e)
        else:
            entries = sorted(filter_entries(listing.values(), pattern or TAR_PATTERN), key=lambda e: e.path)
            if not entries:
                raise no_shards_error(volume, listing.values(), pattern or TAR_PATTERN)
        super().__init__(volume, entries, cache_dir=cache_dir, cache_limit=cache_limit, chunk_size=chunk_size,
                         min_free=min_free)
        if infos is None:
            root = self.cache.root
            with ThreadPoolExecutor(min(INDEX_THREADS, len(entries)), thread_name_prefix="ucmagic-index") as pool:
                infos = list(pool.map(lambda e: node_index(volume, e, root), entries))
        self.path = volume.display()
        self.transform = transform
        self.shards: list[ShardInfo] = infos
        self._build(infos)

    def _build(self, infos: Sequence[ShardInfo]) -> None:
        exts: dict[str, int] = {}
        offs, sizes, ext_ids, first, sfile = [], [], [], [], []
        keys: list[str] = []
        base = 0
        for fi, s in enumerate(infos):
            cols = MemberColumns.of(s.members)
            offs.append(cols.offsets)
            sizes.append(cols.sizes)
            ext_ids.append(np.fromiter((exts.setdefault(e.lower(), len(exts)) for e in cols.exts), dtype=np.int32,
                                       count=len(cols)))
            starts = cols.sample_starts()
            first.append(starts + base)
            keys.extend(cols.keys[i] for i in starts.tolist())
            sfile.append(np.full(len(starts), fi, dtype=np.int32))
            base += len(cols)
        self.exts = list(exts)
        self.member_offset = np.concatenate([*offs, np.zeros(0, dtype=np.int64)])
        self.member_size = np.concatenate([*sizes, np.zeros(0, dtype=np.int64)])
        self.member_ext = np.concatenate([*ext_ids, np.zeros(0, dtype=np.int32)])
        self.sample_first = np.concatenate([*first, [base]]).astype(np.int64)
        self.sample_file = np.concatenate([*sfile, np.zeros(0, dtype=np.int32)])
        self.keys = keys
        self._urls = [self.volume.display(f.entry.path) for f in self.files]
        self.num_samples = len(keys)
        if self.num_samples == 0:
            raise ShardFormatError(f"the shards under {self.path} hold no samples (no member with a key.ext name)")
        # runs of samples that start in one chunk of one shard: the shuffle's unit
        start_chunk = self.member_offset[self.sample_first[:-1]] // self.chunk_size
        tag = self.sample_file.astype(np.int64) * (1 << 32) + start_chunk
        cut = np.flatnonzero(np.diff(tag)) + 1
        edges = np.concatenate([[0], cut, [self.num_samples]])
        self.group_sizes = np.diff(edges).tolist()

    def __repr__(self) -> str:
        return f"TarShards({self.path!r}, shards={len(self.files)}, samples={self.num_samples})"

    def spans(self, i: int) -> list[Span]:
        a, b = int(self.sample_first[i]), int(self.sample_first[i + 1])
        f = int(self.sample_file[i])
        offs, sizes = self.member_offset[a:b].tolist(), self.member_size[a:b].tolist()
        return [(f, o, n) for o, n in zip(offs, sizes)]  # one read per member: its bytes, copied once

    def decode(self, i: int, parts: list[bytes]) -> Any:
        a, b = int(self.sample_first[i]), int(self.sample_first[i + 1])
        out: dict[str, Any] = {"__key__": self.keys[i], "__url__": self._urls[int(self.sample_file[i])]}
        exts = self.exts
        for e, data in zip(self.member_ext[a:b].tolist(), parts):
            out[exts[e]] = data
        return self.transform(out) if self.transform is not None else out

    def shard_of(self, samples: Sequence[int] | np.ndarray) -> np.ndarray:
        """The shard index of each sample (for shuffle-quality figures)."""
        return self.sample_file[np.asarray(samples, dtype=np.int64)]
