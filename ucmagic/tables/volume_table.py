"""Labels from a table, files from a volume: :func:`files_from_table` (issue 44 item 6).

A table (Delta, Parquet, a pandas/Spark DataFrame, a pyarrow Table, anything ``load_table`` reads) has
a column of file paths (relative to ``root=``, or absolute paths under it) and other columns (labels,
ids, splits). :func:`files_from_table` returns a :class:`TableFilesDataset`: a ``UCVolumeDataset`` over
exactly the files the table names, whose items are dicts ``{"path": <cached local path>, <field>: value,
...}``. Everything ``UCVolumeDataset`` promises holds because it *is* one (cache, budget, read-ahead,
shuffle, partition over ranks and workers, exact resume, ``ucmagic.DataLoader``); only its listing comes
from the table, through :class:`TableVolume`.

Call order (one dataset)::

    read_rows(table, ...)          # the table's rows: projected, filtered, paths made relative, sorted
    TableVolume(base, entries,...) # the files as a read-only volume (its listing is the rows' files)
    TableFilesDataset(volume, ...) # UCVolumeDataset.__init__ lists it (node listing, cache keys)
    iter(ds)                       # UCVolumeDataset's cached paths, each mapped back to its row's fields

Layering: ``files/`` never imports ``tables/``; this module uses ``files/`` through its public API.
"""
from __future__ import annotations

import bisect
import builtins
import hashlib
import json
import math
import os
import posixpath
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator, Sequence, cast

from .._util import path_under
from ..errors import (ColumnNotFoundError, DuplicatePathError, EmptyListingError, InvalidArgumentError,
                      ListingChangedError, SourceChangedError, SourceNotFoundError, UnsafeSourceError)
from ..files.cache_layout import unmap_relpath
from ..files.dataset import STATE_VERSION, UCVolumeDataset
from ..files.planned import StateSchema
from ..files.ranged import RangeReader
from ..files.volume import DirScan, FileEntry, Volume, filter_entries, is_safe_rel, open_volume

__all__ = ["TableFilesDataset", "TableVolume", "files_from_table", "read_rows", "relative_paths", "FILTER_VIA"]

STAT_THREADS = 16  # parallel stats of the files when the table gives no sizes and mtimes
MISSING_NAMED = 3  # missing files named in an error or warning (the rest are counted)
# How filter= is applied: load_table's (tables/predicate.RowFilter), pushed down to partitions and
# row-group statistics for Parquet and Delta; over the rows in memory for pandas and pyarrow data; in Spark.
FILTER_VIA = "load_table's filter= (Parquet/Delta pushed down), RowFilter over in-memory rows, Spark for Spark"
FLOAT_SLACK = 1e-6  # seconds as a float near 2**31 are exact to ~2.4e-7: a table's value may be 1 us off
_MTIME_UNITS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


# ---------------------------------------------------------------- pure: paths

def relative_paths(paths: Sequence[Any], root: str | None) -> tuple[str, list[str]]:
    """``(root, relative paths)`` of a table's path column.

    A path relative to ``root`` is kept (normalised: ``./a`` is ``a``); an absolute one must lie under
    ``root`` (compared as text after normalising both). Without ``root`` every path must be absolute
    and the root is their deepest common folder. Raises :class:`InvalidArgumentError` naming the first
    null, empty, escaping (``..``) or outside path, and how to fix it.
    """
    def norm(p: str) -> str:
        if "://" in p:
            scheme, _, rest = p.partition("://")
            return scheme + "://" + posixpath.normpath(rest).lstrip("/") if rest else p
        return posixpath.normpath(p)

    texts: list[str] = []
    for i, p in enumerate(paths):
        if not isinstance(p, str) or not p.strip():
            raise InvalidArgumentError(f"row {i} of the path column holds {p!r}, not a file path: every row must "
                                       "name a file (filter= the rows without one out)")
        texts.append(p)
    if root is None:
        relative = next((p for p in texts if not (p.startswith("/") or "://" in p)), None)
        if relative is not None:
            raise InvalidArgumentError(f"the path column holds the relative path {relative!r} and root= is not "
                                       "set: pass root= (the folder those paths are relative to)")
        if any("://" in p for p in texts):
            raise InvalidArgumentError("the path column holds URLs: pass root= (the URL of the folder they lie "
                                       "under, e.g. root='s3://bucket/images')")
        root = posixpath.commonpath([posixpath.dirname(norm(p)) for p in texts])
    base = norm(str(root)).rstrip("/")
    rels: list[str] = []
    for p in texts:
        if p.startswith("/") or "://" in p:
            n = norm(p)
            if not n.startswith(base + "/"):
                raise InvalidArgumentError(f"{p!r} is not under root={root!r}: give a root that holds every file "
                                           "of the table, or paths relative to it")
            rel = n[len(base) + 1:]
        else:
            rel = posixpath.normpath(p)
        if not is_safe_rel(rel):
            raise InvalidArgumentError(f"{p!r} leaves root={root!r} ('..') or is not a file path: name files "
                                       "under the root")
        rels.append(rel)
    return str(root), rels


def duplicate_rows(rels: Sequence[str]) -> dict[str, int]:
    """Paths named by more than one row, with their row counts (``rels`` sorted)."""
    dups: dict[str, int] = {}
    for a, b in zip(rels, rels[1:]):
        if a == b:
            dups[a] = dups.get(a, 1) + 1
    return dups


def mtime_slack(arrow_type: Any) -> float:
    """How far a volume's mtime may lie from the table's value of this type: its unit (a table keeping
    milliseconds truncates the file's mtime to them) and float rounding."""
    import pyarrow as pa

    if pa.types.is_timestamp(arrow_type):
        return _MTIME_UNITS[arrow_type.unit] + FLOAT_SLACK
    if pa.types.is_integer(arrow_type):
        return 1.0 + FLOAT_SLACK
    if pa.types.is_floating(arrow_type):
        return FLOAT_SLACK
    raise InvalidArgumentError(f"mtime_column must hold timestamps or seconds since the epoch (a number), "
                               f"not {arrow_type}: cast it, or leave mtime_column out to stat the files")


def _seconds(col: Any) -> list[float | None]:
    """An mtime column as seconds since the epoch."""
    import pyarrow as pa

    if pa.types.is_timestamp(col.type):
        ints = col.cast(pa.timestamp(col.type.unit)).cast(pa.int64()).to_pylist()
        unit = _MTIME_UNITS[col.type.unit]
        return [None if v is None else v * unit for v in ints]
    return [None if v is None else float(v) for v in col.to_pylist()]


# ---------------------------------------------------------------- reading the table

def _identity(src: Any, table: Any, version: int | None) -> str:
    """What names the table across processes (its path, catalog name or SQL); DataFrames have none."""
    if src.kind in ("pandas", "arrow", "spark", "duckdb"):
        return "dataframe"
    return json.dumps([src.kind, src.describe() if src.kind != "sql" else str(table), version])


def _filter_text(filter: Any) -> str:  # noqa: A002 - the option's documented name
    return "" if filter is None else f"{type(filter).__name__}:{filter}"


def read_rows(table: Any, *, needed: Sequence[str] | None, filter: Any = None,  # noqa: A002
              version: int | None = None, storage_options: dict[str, Any] | None = None) -> tuple[Any, str]:
    """``(pyarrow Table of the rows, identity)``: ``table`` read with the ``needed`` columns (None: all),
    rows kept where ``filter`` holds, as ``load_table``'s ``filter=`` keeps them (:data:`FILTER_VIA`)."""
    import pyarrow as pa

    from .predicate import RowFilter, spark_filter
    from .sources import as_source

    src = as_source(table, version=version, storage_options=storage_options)
    filter = src.with_filter(filter)  # noqa: A001 - or the one an entry point set on the source
    cols = None if needed is None else list(needed)
    if src.kind in ("pandas", "arrow"):  # in memory: no copy through pandas
        obj = src.obj
        if src.kind == "pandas":
            t = pa.Table.from_pandas(obj, preserve_index=False)
        elif isinstance(obj, pa.RecordBatch):
            t = pa.Table.from_batches([obj])
        elif isinstance(obj, pa.RecordBatchReader):
            t = obj.read_all()
        elif isinstance(obj, pa.Table):
            t = obj
        else:  # a pyarrow dataset
            t = obj.to_table()
        rf = RowFilter.of(filter, t.column_names)
        if rf is not None:
            t = rf.apply(t)
    elif src.kind == "spark":  # filtered in Spark, before anything leaves the cluster
        df = spark_filter(src.obj, filter)
        if cols is not None:
            df = df.select(*[c for c in cols if c in df.columns])
        t = df.toArrow() if hasattr(df, "toArrow") else pa.Table.from_pandas(df.toPandas(), preserve_index=False)
    else:  # Parquet, Delta (pruned by partitions and row-group statistics), SQL, CSV, table names: load_table
        from .api import load_table  # (pandas: imported only here)

        t = pa.Table.from_pandas(load_table(table, columns=cols, filter=filter, version=version,
                                            storage_options=storage_options), preserve_index=False)
    if cols is not None:
        missing = [c for c in cols if c not in t.column_names]
        if missing:
            raise ColumnNotFoundError(f"{src.describe()} has no column {missing[0]!r}; its columns: "
                                       f"{', '.join(t.column_names)}")
    return t, _identity(src, table, version)


# ---------------------------------------------------------------- the volume of the table's files

class TableVolume(Volume):
    """A read-only view of ``base`` holding exactly the files a table names (its listing), read
    from ``base``. ``uri`` is ``base``'s plus the table's identity, so the node listing and cache
    space of every (table, path column, filter) are their own while a new version of the same table
    keeps its cache warm (entries are keyed by path, size and mtime).

    ``slack``: seconds a file's mtime on ``base`` may lie from the listed one (the unit of the table's
    mtime column; 0 where the listing came from ``base.stat``). Pickles without its listing (a
    DataLoader worker only copies files).
    """

    keeps_dir_mtimes = False  # re-validated by listing it again: the table's rows, compared

    def __init__(self, base: Volume, entries: builtins.list[FileEntry], identity: str, *, slack: float = 0.0) -> None:
        self.base = base
        self.entries: builtins.list[FileEntry] | None = entries
        self.identity = identity
        self.slack = float(slack)
        self.uri = base.uri.rstrip("/") + "#table=" + hashlib.sha256(identity.encode()).hexdigest()[:16]
        self.local_root = base.local_root

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "entries": None}

    @property
    def follow_symlinks(self) -> str:
        """The base volume's link policy: it checks each file it opens against it (set through this view)."""
        return self.base.follow_symlinks

    @follow_symlinks.setter
    def follow_symlinks(self, policy: str) -> None:
        self.base.follow_symlinks = policy

    @property
    def local_disk(self) -> bool:
        return self.base.local_disk

    def display(self, rel: str = "") -> str:
        return self.base.display(rel)

    def list(self, pattern: str | None = None) -> list[FileEntry]:
        if self.entries is None:
            raise InvalidArgumentError("this TableVolume was unpickled without its rows: list it where it was made")
        return self._check_listing(filter_entries(self.entries, pattern), pattern)

    def scan(self, pattern: str | None = None) -> Iterator[DirScan]:
        try:
            yield DirScan("", -1, self.list(pattern))
        except EmptyListingError:
            return

    def stat(self, rel: str) -> FileEntry:
        return self.base.stat(rel)

    def copy_to(self, rel: str, dest: str, *, expect: FileEntry | None = None) -> int:
        if expect is None or self.slack == 0.0:
            return self.base.copy_to(rel, dest, expect=expect) if expect is not None else self.base.copy_to(rel, dest)
        if expect.size < self.base.range_threshold:  # one plain copy, then one look (as FsspecVolume's copy)
            n = self.base.copy_to(rel, dest)
            self._check_listed(rel, expect, self.base.stat(rel))
            return n
        now = self.base.stat(rel)  # a ranged copy checks against an exact entry: the volume's own
        self._check_listed(rel, expect, now)
        return self.base.copy_to(rel, dest, expect=now)  # the volume's own check of a change during the copy

    def _check_listed(self, rel: str, expect: FileEntry, now: FileEntry) -> None:
        """Refuse ``now`` unless it is the file the table lists: the same size, the mtime within the
        table's unit."""
        if now.size != expect.size or abs(now.mtime - expect.mtime) > self.slack:
            raise SourceChangedError(
                f"{self.display(rel)} is not the file the table lists (table: {expect.size} bytes, mtime "
                f"{expect.mtime:.6f}; volume: {now.size} bytes, mtime {now.mtime:.6f}): the table's size and mtime "
                "columns must hold the file's current values; update them, or leave size_column/mtime_column "
                "out to stat the files")

    def range_reader(self, rel: str) -> RangeReader:
        return self.base.range_reader(rel)

    def read_bytes(self, rel: str) -> bytes:
        return self.base.read_bytes(rel)

    def exists(self, rel: str) -> bool:
        return self.base.exists(rel)

    def list_names(self, rel: str) -> builtins.list[str]:
        return self.base.list_names(rel)

    def _read_only(self, *_: Any, **__: Any) -> None:
        raise InvalidArgumentError(f"{self.display()} seen through a table is read-only: write to the volume itself")

    write_bytes = upload = makedirs = remove = remove_tree = rename = _read_only


# ---------------------------------------------------------------- the dataset

class TableFilesDataset(UCVolumeDataset):
    """A ``UCVolumeDataset`` over the files a table names whose items are dicts: ``"path"`` (the cached
    local path, as ``UCVolumeDataset`` yields it) and the row's fields (Python values; a null is None).
    Made by :func:`files_from_table`. Its resume state's fingerprint covers the files and the rows'
    fields, so a state saved over another version of the table (other labels) is refused."""

    kind = "TableFilesDataset"
    state_schema = StateSchema(kind, STATE_VERSION, "files")

    def __init__(self, volume: TableVolume, rels: list[str], fields: Any, rows_hash: str, **options: Any) -> None:
        super().__init__(volume, **options)
        self.rels = rels  # sorted: row i of ``fields`` is file rels[i]
        self.fields = fields.combine_chunks()  # a pyarrow Table, one row per file
        self.field_names = list(fields.column_names)
        self.rows_hash = rows_hash
        self.fingerprint = hashlib.sha256(f"{self.listing.fingerprint}\0{rows_hash}".encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        fields = getattr(self, "field_names", None)  # (None while __init__ runs)
        return (f"TableFilesDataset({self.volume.display()!r}, files={len(self.listing)}, fields={fields}, "
                f"cache_dir={self.cache.root!r}, shuffle={self.shuffle!r})")

    def row_of(self, path: str) -> dict[str, Any]:
        """The item of a cached path this dataset yielded: ``{"path": path, <field>: value, ...}``."""
        i = self._row_index(path)
        cols = self.fields.columns
        return {"path": path, **{name: cols[k][i].as_py() for k, name in enumerate(self.field_names)}}

    def _row_index(self, path: str) -> int:
        """The row of a path this dataset yielded: read off the entry's path (``<cache>/files/<space>[~v]/
        <mapped rel>``, docs/cache.md) where it names one of the rows, else through :meth:`source_of`
        (an escaped name; a path that is no entry of this dataset raises NotAnEntryError there)."""
        prefix = self._files_prefix
        if path.startswith(prefix):
            top, _, inner = path[len(prefix):].partition(os.sep)
            rel = unmap_relpath(inner.replace(os.sep, "/")) if top.partition("~")[0] == self.space else None
            if rel is not None:
                i = bisect.bisect_left(self.rels, rel)
                if i < len(self.rels) and self.rels[i] == rel:
                    return i
        rel = self.source_of(path).rel
        i = bisect.bisect_left(self.rels, rel)
        if i == len(self.rels) or self.rels[i] != rel:  # never another row's fields
            raise ListingChangedError(f"{rel!r} is in this node's listing but not in the table's rows: create "
                                      "the dataset again (relist=True)")
        return i

    @property
    def _files_prefix(self) -> str:
        return os.path.join(self.cache.root, "files") + os.sep

    def __iter__(self) -> Iterator[dict[str, Any]]:  # type: ignore[override]  # dicts, not paths
        return self._rows(super().__iter__())

    def _rows(self, paths: Iterator[str]) -> Iterator[dict[str, Any]]:
        try:
            for p in paths:
                yield self.row_of(p)
        finally:
            close = getattr(paths, "close", None)
            if close is not None:
                close()


def _stat_all(base: Volume, rels: list[str]) -> list[FileEntry | None]:
    """``base.stat`` of every file on :data:`STAT_THREADS` threads; None where it is missing."""
    def one(rel: str) -> FileEntry | None:
        try:
            return base.stat(rel)
        except FileNotFoundError:
            return None

    if len(rels) <= 4:
        return [one(r) for r in rels]
    with ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="ucmagic-table-stat") as pool:
        return list(pool.map(one, rels, chunksize=64))


def links_refused(root: str, rels: list[str], policy: str) -> list[str]:
    """Files of a local ``root`` that ``follow_symlinks=policy`` refuses (as ``UCVolumeDataset``'s listing
    does): ``"inside"``, reached through a link to outside ``root``; ``"none"``, through any link; ``"all"``: none."""
    if policy == "all":
        return []
    real_root = os.path.realpath(root)

    def refused(rel: str) -> bool:
        real = os.path.realpath(os.path.join(root, *rel.split("/")))
        if policy == "none":
            return real != os.path.join(real_root, *rel.split("/"))
        return path_under(real, real_root) is None

    with ThreadPoolExecutor(STAT_THREADS, thread_name_prefix="ucmagic-table-links") as pool:
        return [r for r, bad in zip(rels, pool.map(refused, rels, chunksize=64)) if bad]


def _rows_hash(t: Any) -> str:
    """A hash of a table's content (its Arrow IPC stream)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, t.schema) as w:
        w.write_table(t.combine_chunks())
    return hashlib.sha256(sink.getvalue().to_pybytes()).hexdigest()[:16]


def _without_refused_links(t: Any, rels: list[str], base: Volume, options: dict[str, Any]) -> tuple[Any, list[str]]:
    """The rows whose files ``follow_symlinks`` allows on a local root; the others raise
    :class:`UnsafeSourceError` or, with ``on_error="skip"``, are left out with a warning."""
    import pyarrow as pa

    policy = options.get("follow_symlinks", "inside")
    out = links_refused(base.local_root or "", rels, policy)
    if not out:
        return t, rels
    named = ", ".join(base.display(r) for r in out[:MISSING_NAMED])
    if options.get("on_error") != "skip":
        raise UnsafeSourceError(f"{len(out)} file(s) the table names are links that follow_symlinks={policy!r} "
                                f"refuses: {named}; pass follow_symlinks='all' for a tree you trust, or "
                                "on_error='skip' to leave them out")
    warnings.warn(f"ucmagic: left out {len(out)} linked file(s) follow_symlinks refuses: {named}", stacklevel=3)
    keep = sorted(set(range(len(rels))) - {bisect.bisect_left(rels, r) for r in out})
    return t.take(pa.array(keep, pa.int64())), [rels[i] for i in keep]


def _table_entries(t: Any, rels: list[str], size_column: str, mtime_column: str) -> list[FileEntry]:
    """The listing from the table's size and mtime columns (a value for every file, or InvalidArgumentError)."""
    sizes, mtimes = t.column(size_column).to_pylist(), _seconds(t.column(mtime_column))
    bad = next((i for i, (s, m) in enumerate(zip(sizes, mtimes)) if s is None or m is None or s < 0
                or not math.isfinite(m)), None)
    if bad is not None:
        raise InvalidArgumentError(f"row of {rels[bad]!r} has size {sizes[bad]!r}, mtime {mtimes[bad]!r}: "
                                   "size_column and mtime_column must hold a value for every file")
    return [FileEntry(r, int(s), float(cast(float, m))) for r, s, m in zip(rels, sizes, mtimes)]  # checked


def _stat_entries(t: Any, rels: list[str], base: Volume,
                  options: dict[str, Any]) -> tuple[Any, list[str], list[FileEntry]]:
    """The listing from one parallel stat of every file; a missing file raises SourceNotFoundError or, with
    ``on_missing``/``on_error="skip"``, its row is left out with a warning."""
    import pyarrow as pa

    stats = _stat_all(base, rels)
    missing = [r for r, st in zip(rels, stats) if st is None]
    if missing:
        named = ", ".join(base.display(r) for r in missing[:MISSING_NAMED])
        more = f" and {len(missing) - MISSING_NAMED} more" if len(missing) > MISSING_NAMED else ""
        if "skip" not in (options.get("on_missing"), options.get("on_error")):
            raise SourceNotFoundError(f"{len(missing)} file(s) the table names do not exist: {named}{more}; fix "
                                      "the paths (and root=), filter= those rows out, or pass on_missing='skip'")
        warnings.warn(f"ucmagic: left out {len(missing)} file(s) the table names that do not exist: "
                      f"{named}{more}", stacklevel=3)
        keep = [i for i, st in enumerate(stats) if st is not None]
        if not keep:
            raise EmptyListingError("none of the files the table names exists: check the paths and root=")
        t, rels = t.take(pa.array(keep, pa.int64())), [rels[i] for i in keep]
    return t, rels, [FileEntry(r, st.size, st.mtime) for r, st in zip(rels, (x for x in stats if x is not None))]


def files_from_table(table: Any, *, path_column: str = "path", columns: Sequence[str] | None = None,
                     root: str | None = None, filter: Any = None,  # noqa: A002 - the option's documented name
                     size_column: str | None = None, mtime_column: str | None = None, version: int | None = None,
                     table_storage_options: dict[str, Any] | None = None,
                     **options: Any) -> TableFilesDataset:
    """A dataset of the files a table names, each item ``{"path": <cached local path>, <field>: value}``.

    Args:
        table: a Delta or Parquet directory, a table name, a SQL query, a pandas or Spark DataFrame, a
            pyarrow Table (anything ``load_table`` reads).
        path_column: the column of file paths: relative to ``root``, or absolute paths under it
            (``/Volumes/...``, local, or URLs under a URL ``root``).
        columns: the fields each item carries (default: every other column). ``"path"`` is the item's
            own key: a field of that name is refused.
        root: the folder (or URL) the files lie under; default: the deepest folder common to absolute paths.
        filter: keep the rows where it holds: a SQL predicate string in DuckDB's dialect (Spark's for a
            Spark DataFrame) or a ``pyarrow.compute`` expression (:data:`FILTER_VIA`).
        size_column, mtime_column: the files' sizes (bytes) and mtimes (a timestamp, or seconds since
            the epoch), both or neither. Given, the files are not stat-ed; a file whose size or mtime
            (within the column's unit) differs when it is copied raises :class:`SourceChangedError`.
            Without them every file is stat-ed once, in parallel.
        version: a Delta table's version (time travel).
        table_storage_options: fsspec options for reading a remote table (``storage_options=`` goes to
            the files' volume, as for ``UCVolumeDataset``).
        **options: ``UCVolumeDataset``'s (cache_dir, cache_limit, shuffle, seed, partition, prefetch,
            on_missing, ...); ``validate=`` has no effect: the node's listing is compared with the rows in
            memory each time (a reused one is never another table's or version's). A file the table names
            that does not exist: ``on_missing="raise"`` (the default) raises :class:`SourceNotFoundError`
            naming it at construction (when stat-ed) or at its fetch (sizes from the table); ``"skip"``
            leaves it out with a warning (counted in ``stats()["errors"]`` when found at its fetch).

    Several rows naming one file raise :class:`DuplicatePathError`: one row per file (aggregate the
    labels, e.g. ``GROUP BY path``). See docs/table_files.md.
    """
    import pyarrow as pa

    if not isinstance(path_column, str):
        raise InvalidArgumentError(f"path_column must be a column name, got {path_column!r}")
    if "path" in options:
        raise InvalidArgumentError("path= is the table's path_column and root=: leave it out")
    if (size_column is None) != (mtime_column is None):
        raise InvalidArgumentError("size_column and mtime_column go together: give both (the files are not "
                                   "stat-ed) or neither (each file is stat-ed once)")
    if columns is not None and (isinstance(columns, str) or not all(isinstance(c, str) for c in columns)):
        raise InvalidArgumentError(f"columns must be a list of column names, got {columns!r}")
    meta = [c for c in (size_column, mtime_column) if c is not None]
    needed = None if columns is None else [path_column, *meta, *columns]
    from .sources import Source

    if isinstance(table, Source):  # resolved by an entry point: its filter is this read's (and its identity's)
        filter = table.with_filter(filter)  # noqa: A001
    t, identity = read_rows(table, needed=needed, filter=filter, version=version,
                            storage_options=table_storage_options)
    for c in (path_column, *meta):
        if c not in t.column_names:
            raise ColumnNotFoundError(f"the table has no column {c!r}; its columns: {', '.join(t.column_names)}")
    fields = list(columns) if columns is not None else [c for c in t.column_names if c not in (path_column, *meta)]
    if "path" in fields:
        raise InvalidArgumentError("a field named 'path' would hide the item's cached path: leave it out of "
                                   "columns= (or rename it)")
    if t.num_rows == 0:
        raise EmptyListingError(f"the table names no file{' where filter= holds' if filter is not None else ''}: "
                                "check the table and the filter")
    root, rels = relative_paths(t.column(path_column).to_pylist(), root)
    order = sorted(range(len(rels)), key=rels.__getitem__)
    rels = [rels[i] for i in order]
    dups = duplicate_rows(rels)
    if dups:
        first = sorted(dups.items())[:MISSING_NAMED]
        raise DuplicatePathError(
            f"{len(dups)} file(s) are named by several rows ({', '.join(f'{p!r}: {n} rows' for p, n in first)}): "
            "a dataset item is one file with one row's fields; aggregate the rows first (e.g. GROUP BY the path, "
            "collecting the labels in a list) or filter= the extra rows out")
    t = t.take(pa.array(order, pa.int64()))
    base = open_volume(root, options.get("storage_options"))
    if base.local_root is not None:
        t, rels = _without_refused_links(t, rels, base, options)
    if size_column is not None and mtime_column is not None:
        entries = _table_entries(t, rels, size_column, mtime_column)
        slack = mtime_slack(t.schema.field(mtime_column).type)
    else:
        t, rels, entries = _stat_entries(t, rels, base, options)
        slack = 0.0
    rows = t.select(fields)
    volume = TableVolume(base, entries, json.dumps([identity, path_column, _filter_text(filter)]), slack=slack)
    if options.get("validate") == "none":  # the node listing is always compared with the rows (in memory)
        options = {**options, "validate": "files"}
    return TableFilesDataset(volume, rels, rows, _rows_hash(t.select([path_column, *meta, *fields])), **options)
