"""Reading one row group of a table's file as the table's rows, and the row index a ``filter=`` builds.

:func:`read_columns` reads columns of one row group (every stored row: the caller drops what a deletion
vector or the filter removes): for Delta, the table's logical columns (partition columns, nulls for columns
the file predates); for Parquet, the unified types with Hive partition values. :func:`index_file` evaluates
a :class:`~ucmagic.tables.predicate.RowFilter` over a file's row groups (pruned by statistics and partition
values first; only the filter's columns are read, by ranged reads through the volume) and records the kept
rows as bitmaps: the row index a filtered ParquetDataset plans its epochs and ``rows[i]`` over.
:class:`RangeFile` is a file whose row groups were filled one by one into the cache (byte ranges), read with
the footer the dataset already holds.
"""
from __future__ import annotations

import bisect
import io
import mmap
import os
from typing import Any, Sequence

import numpy as np

from ..files.local_files import FdReader
from ..files.ranged import RangedFile
from .deletion_vectors import deleted_in, filter_rows, keep_mask
from .footers import TableFile
from .predicate import RowFilter

__all__ = ["read_columns", "dropped_rows", "index_file", "group_span", "RangeFile", "map_file"]


def read_columns(pf: Any, f: TableFile, j: int, columns: Sequence[str], schema: Any, snap: Any,
                 threads: bool = False) -> Any:
    """Columns ``columns`` of row group ``j`` of ``f`` (every stored row), as the table defines them;
    ``threads``: decode the columns on pyarrow's CPU pool (in a process that has the cores to itself)."""
    import pyarrow as pa

    cols = list(columns)
    if snap is None:
        part = f.partition
        have = set(pf.schema_arrow.names)
        t = pf.read_row_group(j, columns=[c for c in cols if c not in part and c in have], use_threads=threads)
        if part or len(t.column_names) < len(cols):  # Hive partition values: one constant column each; a column
            n = pf.metadata.row_group(j).num_rows   # this file lacks: nulls (unify_schemas); in the requested order
            for c in cols:
                if c in part:
                    typ = schema.field(c).type
                    t = t.append_column(c, pa.nulls(n, typ) if part[c] is None
                                        else pa.repeat(pa.scalar(part[c], typ), n))
                elif c not in have:
                    t = t.append_column(c, pa.nulls(n, schema.field(c).type))
            t = t.select(cols)
        want = pa.schema([schema.field(c) for c in cols])
        return t if t.schema.equals(want) else t.cast(want)
    fcols = snap.file_columns(pf.schema_arrow, [c for c in cols if c not in snap.partition_columns])
    data = pf.read_row_group(j, columns=sorted({v for v in fcols.values() if v is not None}), use_threads=threads)
    return snap.logical(data, f.delta, cols, fcols)


def stored_starts(f: TableFile) -> np.ndarray | None:
    """First stored row of each row group of ``f`` (None when every stored row is a row: no DV, no filter)."""
    return None if f.stored_rows is None else np.concatenate([[0], np.cumsum(f.stored_rows)]).astype(np.int64)


def dropped_rows(f: TableFile, j: int, deleted: np.ndarray | None, starts: np.ndarray | None) -> np.ndarray | None:
    """Stored rows of row group ``j`` that are not rows of the (filtered) table, sorted; None when none are.
    ``deleted``: the file's deletion vector (sorted file rows), ``starts``: :func:`stored_starts`."""
    if f.kept is not None:
        bits = f.kept[j]
        n = f.stored_rows[j] if f.stored_rows is not None else 0
        if bits is None:
            return np.arange(n, dtype=np.int64)
        gone = np.flatnonzero(~np.unpackbits(bits, count=n).astype(bool))
        return gone if len(gone) else None
    if deleted is None or starts is None:
        return None
    return deleted_in(deleted, int(starts[j]), int(starts[j + 1]))


def prune_args(md: Any, f: TableFile, snap: Any, part_schema: Any) -> tuple[Any, Any, dict[str, Any] | None, Any]:
    """What :meth:`RowFilter.files_may_match` takes for file ``f`` (its footer ``md``): the footer, the file's
    Arrow schema, its partition values and their schema. A Delta table with column mapping names its columns
    physically in the files: no statistics there (the partition values still prune)."""
    if snap is None:
        return md, md.schema.to_arrow_schema(), f.partition, part_schema
    file_schema = md.schema.to_arrow_schema() if snap.mapping_mode == "none" else None
    return md, file_schema, dict(f.delta.partition) if f.delta is not None else None, snap.schema


def index_file(pf: Any, f: TableFile, rf: RowFilter, schema: Any, snap: Any, may: Sequence[bool], md: Any) -> None:
    """Evaluate ``rf`` over ``f`` (footer ``md``; ``pf`` its open file, None when every row group is pruned),
    after its deletion vector, in the row groups ``may`` leaves (the others are pruned: their statistics prove
    no row matches): ``f.kept[j]`` the packed bitmap of the stored rows kept (None: nothing kept),
    ``f.group_rows[j]`` their count, ``f.stored_rows`` set."""
    stored = [md.row_group(j).num_rows for j in range(md.num_row_groups)]
    deleted = (snap.deleted_rows(f.delta) if any(may) and snap is not None and f.delta is not None and f.delta.dv
               else None)
    starts = np.concatenate([[0], np.cumsum(stored)]).astype(np.int64)
    lives: dict[int, np.ndarray | None] = {}
    parts = []  # the live rows of every row group that may match: one evaluation per file
    total = 0  # their rows (a filter naming no column reads tables with no column, and no length)
    for j, n in enumerate(stored):
        live = keep_mask(deleted, int(starts[j]), int(starts[j + 1])) if deleted is not None else None
        if not may[j] or n == 0 or (live is not None and not live.any()):
            continue
        t = read_columns(pf, f, j, rf.columns, schema, snap)
        lives[j] = live
        parts.append(t if live is None else filter_rows(t, live))
        total += n if live is None else int(live.sum())
    import pyarrow as pa

    got = rf.keep(pa.concat_tables(parts), total) if parts else np.zeros(0, dtype=bool)
    kept: list[np.ndarray | None] = []
    rows: list[int] = []
    at = 0
    for j, n in enumerate(stored):
        if j not in lives:
            kept.append(None)
            rows.append(0)
            continue
        live = lives[j]
        width = n if live is None else int(live.sum())
        if live is None:
            mask = got[at:at + width]
        else:
            mask = live.copy()
            mask[live] = got[at:at + width]
        at += width
        count = int(mask.sum())
        kept.append(np.packbits(mask) if count else None)
        rows.append(count)
    f.kept, f.group_rows, f.stored_rows = kept, rows, stored


def group_span(md: Any, j: int) -> tuple[int, int]:
    """Byte range ``[start, end)`` of row group ``j``'s column chunks in its file."""
    rg = md.row_group(j)
    lo, hi = None, 0
    for k in range(rg.num_columns):
        c = rg.column(k)
        start = c.dictionary_page_offset if c.has_dictionary_page and c.dictionary_page_offset else c.data_page_offset
        lo = start if lo is None else min(lo, start)
        hi = max(hi, start + c.total_compressed_size)
    return int(lo or 0), int(hi)


class RangeFile(RangedFile):
    """A Parquet file of which only some byte ranges are here (each a cache entry holding ``[start, end)``):
    pyarrow, given the footer, reads only inside them; a read elsewhere is an error naming the offset.

    Each entry is memory-mapped (read-only) when added and ``read`` hands pyarrow a view of the mapping: no
    copy before decoding and no descriptor kept. Cache entries are written to a temporary name and renamed,
    never changed in place; one evicted while mapped stays readable until its mapping goes."""

    def __init__(self, name: str, size: int) -> None:
        super().__init__(None, size)
        self.name_ = name
        self.starts: list[int] = []
        self.spans: list[tuple[int, int, memoryview]] = []  # (start, end, the entry's bytes), sorted by start

    def add(self, start: int, end: int, path: str) -> None:
        if any(s == start and e == end for s, e, _ in self.spans):
            return
        view = map_file(path, end - start)
        i = bisect.bisect_left(self.starts, start)
        self.starts.insert(i, start)
        self.spans.insert(i, (start, end, view))

    def _span(self, want: int) -> tuple[memoryview, int]:
        """``(bytes of the entry, offset in it)`` of the ``want`` bytes at the position; an error where they
        were not filled."""
        i = bisect.bisect_right(self.starts, self._pos) - 1
        if i < 0 or self._pos + want > self.spans[i][1]:
            raise OSError(f"{self.name_}: bytes {self._pos}..{self._pos + want} were not filled (a row group's "
                          "range is filled before it is read)")
        start, _, view = self.spans[i]
        return view, self._pos - start

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        want = self._want(len(view))
        if not want:
            return 0
        src, at = self._span(want)
        view[:want] = src[at:at + want]
        self._pos += want
        return want

    def read(self, size: int = -1) -> Any:  # a read-only view of the mapping, as pyarrow takes it
        """A view of the mapped entry (pyarrow wraps it without a copy and keeps the mapping alive while it
        holds it)."""
        want = self._want(size)
        if not want:
            return b""
        src, at = self._span(want)
        self._pos += want
        return src[at:at + want]

    def close(self) -> None:
        if not self.closed:  # the mappings go with the last view pyarrow still holds
            self.spans, self.starts = [], []
        super().close()


def map_file(path: str, size: int) -> memoryview:
    """The first ``size`` bytes of the file at ``path``, memory-mapped read-only (no descriptor kept); read
    into memory where the cache's file system cannot map files."""
    if size <= 0:
        return memoryview(b"")
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        have = os.fstat(fd).st_size
        if have < size:
            raise OSError(f"{path}: a cache entry of {have} bytes where {size} were filled (was the cache "
                          "changed by hand?): run `python -m ucmagic cache clear` and read again")
        try:
            return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_READ))
        except OSError:  # e.g. ENODEV: a file system without mmap: read into memory
            buf = bytearray(size)
            with RangedFile(FdReader(path), size) as f:
                got = f.readinto(buf)
            if got < size:
                raise OSError(f"{path}: a cache entry ended at byte {got} of {size}") from None
            return memoryview(buf).toreadonly()
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the row index on disk

INDEX_VERSION = 1


def index_key(files: Sequence[TableFile], rf: RowFilter, version: Any) -> str:
    """Names one row index: the files (path, size, mtime, deletion vector), the table version and the filter."""
    import hashlib

    h = hashlib.sha256(f"rowindex\0{INDEX_VERSION}\0{version}\0{rf.text}\n".encode("utf-8", "surrogateescape"))
    for f in files:
        dv = f.delta.dv.unique_id if f.delta is not None and f.delta.dv is not None else ""
        h.update(f"{f.path}\0{f.size}\0{f.mtime!r}\0{dv}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:32]


def save_index(path: str, files: Sequence[TableFile]) -> None:
    """Write the files' row index (``kept``, ``group_rows``, ``stored_rows``) to ``path`` (npz, 0600, atomic)."""
    from .._util import atomic_write

    rows, stored, lens, bits = [], [], [], []
    for f in files:
        if f.kept is None or f.stored_rows is None:
            return
        rows += f.group_rows
        stored += f.stored_rows
        for b in f.kept:
            lens.append(-1 if b is None else len(b))
            if b is not None:
                bits.append(b)
    buf = io.BytesIO()
    np.savez(buf, rows=np.asarray(rows, np.int64), stored=np.asarray(stored, np.int64),
             lens=np.asarray(lens, np.int64), bits=np.concatenate(bits) if bits else np.zeros(0, np.uint8))
    atomic_write(path, buf.getvalue(), mode=0o600)


def load_index(path: str, files: Sequence[TableFile], groups: Sequence[int]) -> bool:
    """Set the files' row index from ``path`` (``groups``: row groups per file); False when it is missing or
    does not fit (then the caller builds it)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            rows, stored, lens, bits = z["rows"], z["stored"], z["lens"], z["bits"]
    except (OSError, ValueError, KeyError):
        return False
    if len(rows) != sum(groups) or len(stored) != len(rows) or len(lens) != len(rows):
        return False
    # a file like any other: each row group's bitmap must hold exactly its stored rows, its kept count lie
    # within them, and the bitmaps fit the array, or the index is built again (never read out of range)
    if (stored < 0).any() or (rows < 0).any() or (rows > stored).any() \
            or ((lens >= 0) & (lens != (stored + 7) // 8)).any() or (lens < -1).any() \
            or int(np.maximum(lens, 0).sum()) != len(bits):
        return False
    g = at = 0
    for f, n in zip(files, groups):
        kept: list[np.ndarray | None] = []
        for k in range(n):
            width = int(lens[g + k])
            kept.append(None if width < 0 else bits[at:at + width].copy())
            at += max(width, 0)
        f.kept, f.group_rows = kept, [int(r) for r in rows[g:g + n]]
        f.stored_rows = [int(r) for r in stored[g:g + n]]
        g += n
    return True
