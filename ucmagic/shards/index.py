"""The shard index: which samples a tar shard holds and where each member's bytes lie.

``<dest>/index.json`` (written by :func:`ucmagic.pack`, or built from the tar headers of foreign
shards)::

    {"format": "ucmagic.shards", "version": 1,
     "shards": [{"name": "shard-000000.tar", "size": <bytes>, "samples": <n>,
                 "members": [[key, ext, data_offset, size], ...]}, ...]}

Members are in tar order; ``data_offset`` is the byte offset of the member's data in the tar. A
sample is a run of consecutive members sharing a key (the WebDataset convention: the key is the
member path up to the first dot of its base name, the extension the rest: ``a/000123.seg.png`` ->
``("a/000123", "seg.png")``); a repeated extension within a run starts a new sample, as
``webdataset`` groups them. Members that are not regular files, have no dot in their base name or
are WebDataset metadata (``__*__``) are left out.
"""
from __future__ import annotations

import io
import json
import os
import re
import tarfile
from dataclasses import dataclass
from typing import IO, Any, Iterable, Iterator, Sequence, overload

import numpy as np

from .._util import gc_paused, is_integer
from ..errors import ShardFormatError
from ..files.entries import is_safe_rel

FORMAT = "ucmagic.shards"
VERSION = 1
INDEX_NAME = "index.json"

COMPRESSED = ((b"\x1f\x8b", "gzip", "gzip -dc {f} > {plain}"), (b"BZh", "bzip2", "bzip2 -dc {f} > {plain}"),
              (b"\xfd7zXZ\x00", "xz", "xz -dc {f} > {plain}"), (b"\x28\xb5\x2f\xfd", "zstd", "zstd -dc {f} > {plain}"))
"""(magic, name, command) of the compressions tar files come in: shards must be plain tars (chunks need offsets)."""
COMPRESSED_SUFFIXES = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tbz", ".tar.xz", ".txz", ".tar.zst", ".tar.zstd",
                       ".tzst")
_KEY_EXT = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext
_META = re.compile(r"__[^/]*__($|/)")                   # webdataset's skip_meta


@dataclass(frozen=True)
class Member:
    """One member of a tar shard: its sample key, extension, data offset and size in bytes."""

    key: str
    ext: str
    offset: int
    size: int


class MemberColumns(Sequence[Member]):
    """The members of one shard kept as columns (keys, extensions, data offsets, sizes): a read-only
    sequence of :class:`Member` that an index of 70,000 members loads in milliseconds, not as 70,000 objects."""

    __slots__ = ("keys", "exts", "offsets", "sizes")

    def __init__(self, keys: Iterable[str], exts: Iterable[str], offsets: Any, sizes: Any) -> None:
        self.keys, self.exts = list(keys), list(exts)
        self.offsets = np.asarray(offsets, dtype=np.int64).reshape(-1)
        self.sizes = np.asarray(sizes, dtype=np.int64).reshape(-1)
        if not len(self.keys) == len(self.exts) == len(self.offsets) == len(self.sizes):
            raise ValueError("member columns of different lengths")

    @classmethod
    def of(cls, members: Iterable[Member]) -> "MemberColumns":
        """``members`` as columns (itself when it is one already)."""
        if isinstance(members, MemberColumns):
            return members
        ms = list(members)
        return cls([m.key for m in ms], [m.ext for m in ms], [m.offset for m in ms], [m.size for m in ms])

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[Any]]) -> "MemberColumns":
        """From an index's ``[key, ext, data_offset, size]`` rows (one transpose); offsets and sizes must be
        integers (``ValueError`` otherwise: a string, float or number past 64 bits is not coerced)."""
        if not rows:
            return cls([], [], [], [])
        keys, exts, offsets, sizes = zip(*rows)
        offs, lens = np.array(offsets), np.array(sizes)
        if offs.dtype.kind not in "iub" or lens.dtype.kind not in "iub" or offs.dtype == np.uint64 \
                or lens.dtype == np.uint64:
            raise ValueError("member offsets and sizes must be integers below 2**63")
        return cls(map(str, keys), map(str, exts), offs, lens)

    def rows(self) -> list[list[Any]]:
        """The ``[key, ext, data_offset, size]`` rows an index stores."""
        return [list(r) for r in zip(self.keys, self.exts, self.offsets.tolist(), self.sizes.tolist())]

    def __len__(self) -> int:
        return len(self.keys)

    @overload
    def __getitem__(self, i: int) -> Member: ...

    @overload
    def __getitem__(self, i: slice) -> "MemberColumns": ...

    def __getitem__(self, i: int | slice) -> "Member | MemberColumns":
        if isinstance(i, slice):
            return MemberColumns(self.keys[i], self.exts[i], self.offsets[i], self.sizes[i])
        return Member(self.keys[i], self.exts[i], int(self.offsets[i]), int(self.sizes[i]))

    def __iter__(self) -> Iterator[Member]:
        return (Member(k, e, o, n) for k, e, o, n in zip(self.keys, self.exts, self.offsets.tolist(),
                                                         self.sizes.tolist()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other))

    def __hash__(self) -> int:
        return hash((tuple(self.keys), tuple(self.exts), self.offsets.tobytes(), self.sizes.tobytes()))

    def __repr__(self) -> str:
        return f"MemberColumns({len(self)} members)"

    def sample_starts(self) -> np.ndarray:
        """:func:`sample_starts` of these members, vectorised (runs of one key; a repeated extension
        within a run, rare, falls back to the member-by-member rule)."""
        n = len(self.keys)
        if n == 0:
            return np.zeros(0, dtype=np.int64)
        keys = np.asarray(self.keys, dtype=object)
        new = np.ones(n, dtype=bool)
        new[1:] = keys[1:] != keys[:-1]
        if new.all():
            return np.arange(n, dtype=np.int64)
        ids: dict[str, int] = {}  # extensions are compared lower-cased, as samples hold them: x.JPG repeats x.jpg
        ext = np.fromiter((ids.setdefault(e.lower(), len(ids)) for e in self.exts), dtype=np.int64, count=n)
        run = np.cumsum(new)
        order = np.lexsort((ext, run))
        if ((run[order][1:] == run[order][:-1]) & (ext[order][1:] == ext[order][:-1])).any():
            return np.asarray(sample_starts(list(self)), dtype=np.int64)
        return np.flatnonzero(new).astype(np.int64)


@dataclass(frozen=True)
class ShardInfo:
    """One shard of an index: file name (relative to the index's directory), size, sample count, members
    (a :class:`MemberColumns` when read from an index)."""

    name: str
    size: int
    samples: int
    members: Sequence[Member]


def split_key(name: str) -> tuple[str, str] | None:
    """``(key, ext)`` of a member path by the WebDataset convention, or None for a path without one."""
    if _META.match(name.rsplit("/", 1)[-1]) or _META.match(name):
        return None
    m = _KEY_EXT.match(name)
    return (m.group(1), m.group(2)) if m else None


def sample_starts(members: Sequence[Member]) -> list[int]:
    """Index of the first member of each sample (runs of one key; a repeated extension, compared lower-cased,
    starts a new one)."""
    if isinstance(members, MemberColumns):
        return members.sample_starts().tolist()  # type: ignore[no-any-return]
    starts: list[int] = []
    key: str | None = None
    seen: set[str] = set()
    for i, m in enumerate(members):
        ext = m.ext.lower()  # a sample's extensions are lower-cased: x.JPG after x.jpg would overwrite it
        if m.key != key or ext in seen:
            starts.append(i)
            key, seen = m.key, set()
        seen.add(ext)
    return starts


def plain_name(name: str) -> str:
    """The name a compressed tar has once decompressed (``a.tar.gz`` -> ``a.tar``, ``a.tgz`` -> ``a.tar``)."""
    for suffix in COMPRESSED_SUFFIXES:
        if name.endswith(suffix):
            return name[:-len(suffix)] + ".tar"
    return name + ".plain.tar" if name.endswith(".tar") else name + ".tar"


def compression_of(head: bytes) -> tuple[str, str] | None:
    """``(compression, command template)`` when ``head`` (a file's first bytes) starts compressed data."""
    for magic, what, command in COMPRESSED:
        if head.startswith(magic):
            return what, command
    return None


def compressed_error(where: str, what: str, command: str) -> ShardFormatError:
    """The refusal of a compressed tar, with the command that decompresses it."""
    return ShardFormatError(f"{where} is a {what}-compressed tar: compressed tars are refused (chunks need the "
                            "members' byte offsets); decompress it first: "
                            f"{command.format(f=where, plain=plain_name(where))}")


def scan_tar(source: str | os.PathLike[str] | IO[bytes] | io.RawIOBase, name: str | None = None) -> list[Member]:
    """The members of an uncompressed tar (a path or a seekable binary file object), reading headers only.

    GNU and pax long names are resolved as :mod:`tarfile` does; data blocks are skipped by seeking, so
    a file object whose reads are ranged (a remote shard) fetches only the header blocks. A compressed
    tar, a truncated one (a member's data or a header past the end) and a damaged header raise
    :class:`~ucmagic.errors.ShardFormatError` naming the file (``name``), the member and the byte offset.
    """
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return scan_tar(f, name or os.fspath(source))
    where = name or "the tar"
    size = source.seek(0, io.SEEK_END)
    source.seek(0)
    comp = compression_of(source.read(6) or b"")
    if comp is not None:
        raise compressed_error(where, *comp)
    source.seek(0)
    out: list[Member] = []
    last = ""
    tf: tarfile.TarFile | None = None
    try:
        with tarfile.open(fileobj=source, mode="r:") as tf:
            for info in tf:  # TarFile.next() seeks past each member's data
                end = info.offset_data + info.size
                if info.isreg() and info.size < 0:  # a base-256 size field can say anything
                    raise ShardFormatError(f"{where} is damaged: member {info.name!r} (header at byte {info.offset}) "
                                           f"claims {info.size} bytes of data: copy or write the shard again")
                if info.isreg() and not info.issparse() and end > size:
                    raise ShardFormatError(
                        f"{where} is truncated: member {info.name!r} (header at byte {info.offset}) has "
                        f"{info.size} bytes of data from byte {info.offset_data}, but the file ends at byte {size} "
                        f"({end - size} bytes missing): copy or write the shard again")
                if info.isreg() and (ke := split_key(info.name)) is not None:
                    out.append(Member(ke[0], ke[1], info.offset_data, info.size))
                last = info.name
                tf.members.clear()  # type: ignore[attr-defined]  # headers only: no TarInfo list for 10 GiB
            at = tf.offset
    except tarfile.ReadError as exc:
        at = tf.offset if tf is not None else 0
        if size == 0:
            raise ShardFormatError(f"{where} is empty: copy or write the shard again") from None
        if at >= size:  # the next header would start past the end: cut in the padding after a member's data
            raise ShardFormatError(f"{where} is truncated: it ends at byte {size}, inside the padding after member "
                                   f"{last!r} (the next header would start at byte {at}): copy or write the shard "
                                   "again") from None
        if 0 < size - at < tarfile.BLOCKSIZE or str(exc) in _CUT_SHORT:
            raise _cut_header(where, at, size, last) from None  # at: the first block of the member's headers
        after = f" (after member {last!r})" if last else ""
        raise ShardFormatError(f"{where} is not a readable tar at byte {at}{after}: {exc}; shards must be plain, "
                               "complete .tar files") from None
    if at < size:  # tarfile stops quietly at a header cut short or damaged: only a zero block ends a tar
        source.seek(at)
        if any(source.read(min(size - at, tarfile.BLOCKSIZE)) or b""):
            if size - at < tarfile.BLOCKSIZE:
                raise _cut_header(where, at, size, last)
            after = f" (after member {last!r})" if last else ""
            raise ShardFormatError(f"{where} is damaged: no valid tar header at byte {at}{after}, and no end of "
                                   "archive there either (the members after it would be lost): copy or write "
                                   "the shard again")
    return out


_CUT_SHORT = ("truncated header", "unexpected end of data", "empty header")  # tarfile's words for a header chain
# (pax or GNU long name, then the member's own header) that the end of the file cut through


def _cut_header(where: str, at: int, size: int, last: str) -> ShardFormatError:
    after = f" after member {last!r}" if last else ""
    return ShardFormatError(f"{where} is truncated: the header at byte {at}{after} is cut short (the file ends at "
                            f"byte {size}): copy or write the shard again")


def shard_info(name: str, size: int, members: Sequence[Member]) -> ShardInfo:
    """A :class:`ShardInfo` whose sample count is derived from ``members``."""
    cols = MemberColumns.of(members)
    return ShardInfo(name, size, len(cols.sample_starts()), cols)


def dumps_index(shards: Iterable[ShardInfo]) -> bytes:
    """The JSON text of an index over ``shards``."""
    doc = {"format": FORMAT, "version": VERSION, "shards": [
        {"name": s.name, "size": s.size, "samples": s.samples,
         "members": MemberColumns.of(s.members).rows()} for s in shards]}
    return json.dumps(doc, separators=(",", ":")).encode()


def loads_index(data: bytes | str, where: str = INDEX_NAME) -> list[ShardInfo]:
    """Parse an index's JSON text; a foreign or newer format raises ``ValueError`` naming ``where``.

    Every field is data someone else may have written: a shard's name must be a plain relative path, its
    size a non-negative integer, and each member's data range (offset, size) must lie inside its shard, or
    :class:`~ucmagic.errors.ShardFormatError` names the shard and member (before any read or allocation)."""
    with gc_paused():  # hundreds of thousands of short-lived lists and numbers, none in a cycle
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError) as exc:
            raise ShardFormatError(f"{where} is not a ucmagic shard index: {exc}; re-run pack") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ShardFormatError(f"{where} is not a ucmagic shard index (format {FORMAT!r} expected)")
        if doc.get("version") != VERSION:
            raise ShardFormatError(f"{where} has shard index version {doc.get('version')!r}; "
                             f"this ucmagic reads version {VERSION}: upgrade ucmagic or re-run pack")
        shards = doc.get("shards")
        if not isinstance(shards, list):
            raise ShardFormatError(f"{where} lists no shards; re-run pack")
        return [_checked_shard(s, where) for s in shards]


def _checked_shard(s: Any, where: str) -> ShardInfo:
    """One shard entry of an index, checked (see :func:`loads_index`)."""
    fix = "the index does not match its shards (damaged, or written by someone else): re-run pack"
    if not isinstance(s, dict) or not isinstance(s.get("name"), str) or not is_safe_rel(s["name"]):
        given = s.get("name") if isinstance(s, dict) else s
        raise ShardFormatError(f"{where} names the shard {given!r}, not a plain path under its folder: {fix}")
    name: str = s["name"]
    size_v: Any = s.get("size")
    samples: Any = s.get("samples")
    rows: Any = s.get("members")
    if not is_integer(size_v) or not 0 <= size_v < 1 << 62 or not is_integer(samples) or not isinstance(rows, list):
        raise ShardFormatError(f"{where}: the entry of {name} has size {size_v!r}, samples {samples!r}: {fix}")
    size = int(size_v)
    try:
        if not all(isinstance(r, list) and len(r) == 4 and isinstance(r[0], str) and isinstance(r[1], str)
                   for r in rows):
            raise ValueError("a member is not [key, ext, offset, size]")
        cols = MemberColumns.from_rows(rows) if rows else MemberColumns([], [], [], [])
    except (ValueError, TypeError, OverflowError) as exc:
        raise ShardFormatError(f"{where}: the members of {name} cannot be read ({exc}): {fix}") from None
    offs, sizes = cols.offsets, cols.sizes
    bad = np.flatnonzero((offs < 0) | (sizes < 0) | (offs > size - sizes))
    if len(bad):
        i = int(bad[0])
        raise ShardFormatError(f"{where}: member {cols.keys[i]}.{cols.exts[i]} of {name} has {int(sizes[i])} bytes "
                               f"at byte {int(offs[i])}, outside the shard's {size} bytes: {fix}")
    return ShardInfo(name, size, int(samples), cols)


def write_index(dest: str | os.PathLike[str], shards: Iterable[ShardInfo]) -> str:
    """Write ``<dest>/index.json`` atomically (readers see the old index or the new); return its path."""
    from ..files.locks import write_atomically

    path = os.path.join(os.fspath(dest), INDEX_NAME)
    write_atomically(path, dumps_index(shards), sync=True)  # through the folder's descriptor while it is held
    return path


def read_index(dest: str | os.PathLike[str]) -> list[ShardInfo]:
    """The shards of ``<dest>/index.json``, in index order."""
    path = os.path.join(os.fspath(dest), INDEX_NAME)
    with open(path, "rb") as f:
        return loads_index(f.read(), path)
