"""``ucmagic.load``: one call from a source to what trains on it, and ``describe_load`` to preview it.

A directory of files (a path, ``/Volumes/...`` or a URL) becomes a cached, prefetching
:class:`~ucmagic.loading.loader.DataLoader` over a :class:`~ucmagic.files.dataset.UCVolumeDataset`; a table
(a name, SQL query, Delta or Parquet directory, Parquet/CSV file or glob) becomes a pandas
DataFrame, or with ``stream=True`` a DataLoader over a :class:`~ucmagic.tables.ParquetDataset`.
``%ucload`` and ``python -m ucmagic load`` are thin layers over these two functions.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import LoadUsageError, SourceNotFoundError
from .tables.sources import classify_source

DEFAULT_FILE_BATCH = 32
DEFAULT_ROW_BATCH = 1024


@dataclass(frozen=True)
class LoadPlan:
    """What :func:`load` would build: ``kind`` is ``"files"``, ``"shards"``, ``"table"`` or ``"stream"``."""

    source: str
    kind: str
    files: int | None = None
    rows: int | None = None
    bytes: int | None = None

    def describe(self) -> str:
        from .units import format_size

        parts = [f"kind: {self.kind}"]
        if self.files is not None:
            parts.append(f"files: {self.files}")
        parts.append(f"rows: {self.rows if self.rows is not None else 'unknown'}")
        parts.append(f"bytes: {format_size(self.bytes) if self.bytes is not None else 'unknown'}")
        return f"{self.source}\n" + "\n".join("  " + p for p in parts)


def _bad(flag: str, text: str) -> LoadUsageError:
    return LoadUsageError(f"{flag} {text}")


def source_kind(source: str, *, files: bool = False) -> str:
    """``"files"`` or ``"table"`` for ``source``; raises :class:`LoadUsageError` / :class:`SourceNotFoundError`."""
    kind = classify_source(source, force="files" if files else None)
    if kind == "missing" and set("*?[") & set(source):
        raise LoadUsageError(f"{source}: pass the directory as SOURCE and the glob with -p (pattern=), "
                             "e.g. %ucload /data/images -p \"*.jpg\"")
    if kind == "missing":
        hint = ""
        if source.startswith("/Volumes/") and not os.environ.get("UCMAGIC_CATALOG_ROOT"):
            hint = " (outside Databricks, set UCMAGIC_CATALOG_ROOT to map /Volumes/... to a local directory)"
        raise SourceNotFoundError(f"{source} does not exist: check the path or the table name{hint}")
    if kind == "file":
        raise LoadUsageError(f"{source} is a file: pass the directory that holds your files "
                             "(use -p GLOB / pattern= to pick some)")
    return kind


def check_load_args(source: str, kind: str, *, pattern: str | None = None, batch_size: int | None = None,
                    num_workers: int | None = None, shuffle: bool = False, cache_dir: str | None = None,
                    cache_limit: Any = None, rows: int | None = None, columns: Sequence[str] | None = None,
                    stream: bool = False) -> None:
    """Refuse options that do not apply to ``kind`` (:class:`LoadUsageError` naming the option)."""
    if kind == "files":
        for flag, v in (("rows=/--rows", rows), ("columns=/--columns", columns), ("stream=/--stream", stream or None)):
            if v is not None:
                raise _bad(flag, f"applies to tables, but {source} is a directory of files")
        return
    if pattern is not None:
        raise LoadUsageError(f"pattern=/-p applies to directories of files, but {source} is a table "
                             "(add --files / files=True to read its files as files)")
    if stream:
        if rows is not None:
            raise LoadUsageError("rows=/--rows applies to DataFrames; with --stream every row is read")
        return
    for flag, v in (("batch_size=/-b", batch_size), ("num_workers=/-w", num_workers),
                    ("shuffle=/--shuffle", shuffle or None),
                    ("cache_limit=/--limit", cache_limit), ("cache_dir=/--cache-dir", cache_dir)):
        if v is not None:
            raise _bad(flag, f"applies to loaders: add --stream (stream=True) to stream {source}")


def _resolved(source: str, where: Any) -> Any:
    """The table ``source`` resolved once, with its filter: everything below reads this
    :class:`~ucmagic.tables.sources.Source` (its listing, snapshot, footers, schema) and resolves nothing again."""
    from .tables.sources import resolve_source

    src = resolve_source(source)
    src.filter = where
    return src


def load(source: str | os.PathLike[str], *, files: bool = False, pattern: str | None = None,
         batch_size: int | None = None, num_workers: int | None = None, shuffle: bool = False, seed: int = 0,
         cache_dir: str | None = None, cache_limit: int | str | None = None, rows: int | None = None,
         columns: Sequence[str] | None = None, stream: bool = False, kind: str | None = None,
         block_size: int | None = None,
         on_start: Callable[[str], None] | None = None, listing_progress: Callable[[int], None] | None = None,
         where: Any = None, **loader_kwargs: Any) -> Any:
    """Load training data from ``source``: a DataLoader for files (or ``stream=True`` tables), else a DataFrame.

    ``files=True`` reads a directory of Parquet files as files. ``pattern`` selects files (``"**/*.jpg"``);
    ``rows``/``columns`` cut a DataFrame; ``batch_size`` defaults to 32 files or 1024 rows; other keyword
    arguments go to :class:`~ucmagic.loading.loader.DataLoader`. ``on_start(kind)`` is called once the arguments
    are checked, before the (slow) listing; ``listing_progress(files_so_far)`` is called while a long listing
    runs (instead of the stderr line). Raises :class:`LoadUsageError` for options that do not apply.
    A directory of tar shards (an ``index.json`` from ``pack``, or only ``.tar`` files) streams samples
    (:class:`~ucmagic.shards.TarShards`); ``kind="files"`` / ``"shards"`` / ``"tokens"`` (with ``block_size``)
    overrides the guess (docs/shards.md). ``where``: tables only, the rows a SQL predicate (DuckDB's dialect)
    or a pyarrow expression keeps (``filter=`` of load_table / ParquetDataset).
    """
    from .shards.detect import check_kind, shard_kind

    source = os.fspath(source)
    wanted = check_kind(kind)
    kind = source_kind(source, files=files or wanted is not None)
    check_load_args(source, kind, pattern=pattern, batch_size=batch_size, num_workers=num_workers,
                    shuffle=shuffle, cache_dir=cache_dir, cache_limit=cache_limit, rows=rows, columns=columns,
                    stream=stream)
    if where is not None and kind == "files":
        raise _bad("where=/--where", f"applies to tables, but {source} is a directory of files")
    if kind == "table" and not stream:
        from .tables.api import load_table

        return load_table(_resolved(source, where), columns=list(columns) if columns else None, limit=rows)
    if on_start is not None:
        on_start("stream" if stream else kind)
    from .loading.loader import DataLoader
    from .units import parse_size

    limit = parse_size(cache_limit) if cache_limit is not None else None
    if num_workers is not None:
        loader_kwargs["num_workers"] = num_workers
    if kind == "files":
        shard = None if files or wanted == "files" else (wanted or shard_kind(source))
        if shard is not None:
            from .shards.detect import open_shards

            sds = open_shards(source, shard, pattern=pattern, shuffle=shuffle, seed=seed, cache_dir=cache_dir,
                              cache_limit=limit, block_size=block_size)
            return DataLoader(sds, batch_size=batch_size or DEFAULT_FILE_BATCH, **loader_kwargs)
        from .files.dataset import UCVolumeDataset

        ds = UCVolumeDataset(source, pattern=pattern, cache_dir=cache_dir, cache_limit=limit, shuffle=shuffle,
                             seed=seed, listing_progress=listing_progress)
        return DataLoader(ds, batch_size=batch_size or DEFAULT_FILE_BATCH, **loader_kwargs)
    from .tables.parquet_dataset import ParquetDataset

    pds = ParquetDataset(_resolved(source, where), columns=list(columns) if columns else None,
                         batch_size=batch_size or DEFAULT_ROW_BATCH, shuffle=shuffle, seed=seed,
                         cache_dir=cache_dir, cache_limit=limit)
    return DataLoader(pds, batch_size=None, **loader_kwargs)


def describe_load(source: str | os.PathLike[str], *, files: bool = False, pattern: str | None = None,
                  stream: bool = False, where: Any = None) -> LoadPlan:
    """What :func:`load` would build from ``source``, without building it: kind, file count, rows, bytes.

    Lists the files (or reads Parquet footers) but reads no data; rows and bytes are ``None`` where
    only the engine could tell (SQL queries, Spark tables, CSV rows). With ``where`` (a filter), the rows it
    keeps: its columns are read (row groups its statistics rule out are not).
    """
    source = os.fspath(source)
    kind = source_kind(source, files=files)
    check_load_args(source, kind, pattern=pattern, stream=stream)
    if where is not None and kind == "files":
        raise _bad("where=/--where", f"applies to tables, but {source} is a directory of files")
    if kind == "files":
        from .shards.detect import shard_kind
        from .files.volume import open_volume

        from .shards.webdataset import TAR_PATTERN

        shown = "shards" if not files and shard_kind(source) else "files"  # what load() would stream
        entries = open_volume(source).list(pattern or TAR_PATTERN if shown == "shards" else pattern)  # as TarShards
        return LoadPlan(source, shown, files=len(entries), bytes=sum(e.size for e in entries))
    from .tables.sources import delta_snapshot

    src = _resolved(source, where)  # once: the filter's dataset below reads this Source
    shown = "stream" if stream else "table"
    if src.kind not in ("parquet", "delta", "csv") or src.remote:
        return LoadPlan(source, shown)
    snap = delta_snapshot(src) if src.kind == "delta" else None
    paths = [f.path for f in snap.files] if snap is not None else src.paths
    nbytes = sum(os.path.getsize(p) for p in paths)
    rows = None
    if src.kind != "csv":
        import pyarrow.parquet as pq

        rows = sum(pq.read_metadata(p).num_rows for p in paths)
        if snap is not None:  # rows a deletion vector removed are not the table's
            rows -= sum(f.dv.cardinality for f in snap.files if f.dv is not None)
        if where is not None:
            from .tables.parquet_dataset import ParquetDataset

            rows = ParquetDataset(src, cache=False).num_rows
    return LoadPlan(source, shown, files=len(paths), rows=rows, bytes=nbytes)
