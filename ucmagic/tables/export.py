"""export_parquet: write any table as Parquet files of about a target size, atomically.

Engines: Spark (a Spark DataFrame, or a table name with an active session) writes distributed;
everything else goes through the embedded engine (DuckDB ``COPY ... FILE_SIZE_BYTES``), which
streams its input, so memory stays bounded for tables larger than RAM.

Atomic overwrite of a local or mounted directory: the new files are written to a hidden sibling
staging directory, then swapped in with one ``rename`` (``renameat2(RENAME_EXCHANGE)`` when the
filesystem has it). File names carry a per-export id, so a reader that listed the old version
finds its files gone rather than a mixture. ``dest/*.parquet`` stays readable by any tool.
Appends stage the same way, then rename each file in under a journal (:mod:`.journal`): ucmagic's
readers see an append whole or not at all, and one killed midway is rolled back by the next ucmagic
call on ``dest`` (:func:`recover_destination`). For
fsspec URLs (object stores have no rename) the destination's :class:`~ucmagic.files.volume.Volume`
uploads the new files under new names, then writes a manifest (``_ucmagic_manifest.json``) naming
them in one put, then removes stale files; ucmagic readers follow the manifest.
"""
from __future__ import annotations

import ctypes
import errno
import io
import json
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

from .._util import is_remote_url, path_under
from ..errors import (EmptyListingError, ExportOverlapError, SourceNotADirectoryError, SourceNotFoundError,
                      UCMagicError, UnsupportedSourceError)
from .predicate import RowFilter, filter_relation, spark_filter
from .sources import (MANIFEST, Source, connect, delta_files, duckdb_relation, is_data_path, remember_export,
                      restrict_sql,
                      as_source, volume_manifest)
from .spark_source import spark_dataframe
from ..units import format_size, parse_size
from ..files.locks import check_write_dest, held, hold_dir, release_dir
from ..files.volume import FsspecVolume, Volume, resolve_local_path, volume_class
from .journal import recover_destination, remove_journal, roll_back, staging_path, sweep_staging, write_journal

EXPORT_MODES = ("overwrite", "append", "error")
MAX_ROW_GROUP_ROWS = 131072
MIN_ROW_GROUP_ROWS = 2048
DEFAULT_MEMORY_LIMIT = "384MB"


@dataclass
class ExportResult:
    """What ``export_parquet`` wrote: final file paths, rows, bytes, seconds, engine."""

    dest: str
    files: list[str] = field(default_factory=list)
    rows: int = 0
    bytes: int = 0
    seconds: float = 0.0
    engine: str = "duckdb"

    @property
    def num_files(self) -> int:
        return len(self.files)

    def __repr__(self) -> str:
        return (f"ExportResult(dest={self.dest!r}, files={self.num_files}, rows={self.rows}, "
                f"bytes={format_size(self.bytes)}, seconds={self.seconds:.2f}, engine={self.engine!r})")


# ---------------------------------------------------------------- pure helpers

def row_group_rows(target_bytes: int, bytes_per_row: float | None) -> int:
    """Rows per row group: at most 1/8 of a file (so files land near the target), 2048..131072."""
    if not bytes_per_row or bytes_per_row <= 0:
        return MAX_ROW_GROUP_ROWS
    rows = int(target_bytes / bytes_per_row / 8)
    rows = (rows // MIN_ROW_GROUP_ROWS) * MIN_ROW_GROUP_ROWS
    return max(MIN_ROW_GROUP_ROWS, min(MAX_ROW_GROUP_ROWS, rows))


def spark_file_plan(rows: int, bytes_per_row: float, target_bytes: int) -> tuple[int, int]:
    """``(number of files, maxRecordsPerFile)`` for Spark from a row count and an on-disk row size."""
    per_file = max(1, int(target_bytes / max(bytes_per_row, 1e-9)))
    return max(1, math.ceil(rows / per_file)), per_file


def final_name(index: int, export_id: str) -> str:
    return f"part-{index:05d}-{export_id}.parquet"


def _partition_cols(partition_by: str | Sequence[str] | None) -> list[str]:
    if partition_by is None:
        return []
    cols = [partition_by] if isinstance(partition_by, str) else list(partition_by)
    if not cols or not all(isinstance(c, str) and c for c in cols):
        raise ValueError(f"partition_by must be a column name or a list of names, got {partition_by!r}")
    return cols


# ---------------------------------------------------------------- atomic directory swap

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Atomically swap two paths (Linux renameat2), through their folder's descriptor where it is held
    (:func:`~ucmagic.files.locks.hold_dir`). False when the OS or filesystem cannot."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    (fa, na), (fb, nb) = held(a), held(b)
    if fn(_AT_FDCWD if fa is None else fa, os.fsencode(na), _AT_FDCWD if fb is None else fb, os.fsencode(nb),
          _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, f"cannot swap {a} and {b}: {os.strerror(err)}")


def _rename(src: str, dst: str) -> None:
    """``os.rename`` of two names in one folder, through its descriptor where it is held."""
    (fs, ns), (fd, nd) = held(src), held(dst)
    os.rename(ns, nd, src_dir_fd=fs, dst_dir_fd=fd)


def swap_in(staging: str, dest: str) -> str | None:
    """Make ``staging`` appear at ``dest`` in one step (both in the destination's parent, through its
    descriptor while the export holds it). Returns the old version's path to delete."""
    if not os.path.lexists(dest):
        try:
            _rename(staging, dest)
            return None
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
    if not os.path.isdir(dest):
        raise SourceNotADirectoryError(f"{dest} exists and is not a directory: export_parquet writes a directory")
    if _exchange(staging, dest):
        return staging
    old = staging_path(dest, "old", uuid.uuid4().hex[:8])
    _rename(dest, old)  # no atomic exchange here: dest is missing for the instant between the renames
    _rename(staging, dest)
    return old


def sweep_leftovers(dest: str) -> int:
    """Remove the hidden staging/old directories a killed earlier export left beside ``dest`` (see
    :func:`ucmagic.tables.journal.sweep_staging`); a running export's stay."""
    return sweep_staging(dest)


def check_no_overlap(src: Source, dest: str) -> None:
    """Refuse a destination inside the source, or a source inside the destination: the export would read
    its own output (an append duplicates the source on every run; an overwrite swaps the source away)."""
    if src.kind not in ("parquet", "csv", "delta"):
        return
    places = [src.root] if src.root else list(src.paths)
    for place in places:
        if place is None:
            continue
        if is_remote_url(place) != is_remote_url(dest):
            continue
        if is_remote_url(dest):
            a, b = place.rstrip("/") + "/", dest.rstrip("/") + "/"
            within, around = b.startswith(a), a.startswith(b)
        else:
            within, around = path_under(dest, place) is not None, path_under(place, dest) is not None
        if within or around:
            where = "inside its own source" if within else "around its own source"
            raise ExportOverlapError(
                f"export_parquet would write {dest}, {where} {place}: it would read its own output (an append "
                "would add the source to itself on every run). Write to a directory outside the source, e.g. a "
                "sibling of it")


def _resolve_dest(dest: str) -> str:
    """Local path for ``dest``: a ``/Volumes`` path whose volume exists stays; else the catalog mapping."""
    p = os.path.abspath(os.path.expanduser(dest))
    parts = p.split(os.sep)
    if len(parts) >= 5 and parts[1] == "Volumes" and os.path.isdir(os.sep.join(parts[:5])):
        return p
    if len(parts) >= 5 and parts[1] == "Volumes":
        return resolve_local_path(p) if not os.path.exists(p) else p
    return p


def _non_empty(path: str) -> bool:
    return os.path.isdir(path) and any(True for _ in os.scandir(path))


# ---------------------------------------------------------------- staging tidy-up

def _finish_staging(staging: str, export_id: str, rename: bool) -> list[str]:
    """Drop side files (``_SUCCESS``, ``.crc``), name data files uniquely, return them sorted (relative)."""
    import re

    out = []
    for dirpath, dirnames, filenames in os.walk(staging):
        for d in list(dirnames):
            if d.startswith(("_", ".")):
                shutil.rmtree(os.path.join(dirpath, d), ignore_errors=True)
                dirnames.remove(d)
        data = []
        for f in filenames:
            full = os.path.join(dirpath, f)
            if f.startswith(("_", ".")) or not f.endswith(".parquet"):
                os.unlink(full)
            else:
                data.append(f)

        def index(name: str) -> tuple[int, str]:
            m = re.search(r"(\d+)", name)
            return (int(m.group(1)) if m else 0, name)

        for i, f in enumerate(sorted(data, key=index)):
            name = final_name(i, export_id) if rename else f
            if name != f:
                os.rename(os.path.join(dirpath, f), os.path.join(dirpath, name))
            out.append(os.path.relpath(os.path.join(dirpath, name), staging).replace(os.sep, "/"))
    return sorted(out)


def _publish_local(write: Any, staging: str, dest: str, export_id: str, mode: str, *,
                   renumber: bool) -> tuple[list[str], int, int]:
    """``write(staging)`` (the engine's files), then the staged files into ``dest``: swapped in whole
    (:func:`swap_in`) or added beside its files (``mode="append"``); ``(files, rows, bytes)``. A failure on the way
    removes the staging folder; the old version goes once the new one is in place."""
    old = None
    try:
        write(staging)
        if not os.path.isdir(staging):
            os.makedirs(staging)
        rels = _finish_staging(staging, export_id, rename=renumber)
        rows, size = _count(staging, rels)
        if mode == "error" and _non_empty(dest):
            raise FileExistsError(f"{dest} was created by someone else during the export; nothing was changed")
        if mode == "append":
            _append_in(staging, rels, dest, export_id)
        else:
            old = swap_in(staging, dest)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if old:
        shutil.rmtree(old, ignore_errors=True)
    return rels, rows, size


def _append_in(staging: str, rels: list[str], dest: str, export_id: str) -> None:
    """Move the staged files into ``dest`` beside the files already there, all or nothing for ucmagic's
    readers: the journal naming them is written first and removed last (see :mod:`.journal`); a failure
    or Ctrl-C on the way removes what was moved. Each rename is atomic (a file appears complete)."""
    taken = [r for r in rels if os.path.lexists(os.path.join(dest, r))]
    if taken:
        raise FileExistsError(f"{os.path.join(dest, taken[0])} already exists: append writes new, uniquely "
                              "named files; nothing was changed")
    os.makedirs(dest, exist_ok=True)
    journal = write_journal(dest, export_id, staging, rels)
    try:
        for r in rels:
            target = os.path.join(dest, r)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.rename(os.path.join(staging, r), target)
        remove_journal(journal)  # the commit point
    except BaseException:
        roll_back(dest, journal, {"files": rels, "staging": staging})
        raise
    shutil.rmtree(staging, ignore_errors=True)


def _count(staging: str, rels: list[str]) -> tuple[int, int]:
    import pyarrow.parquet as pq

    rows = size = 0
    for r in rels:
        p = os.path.join(staging, r)
        rows += pq.read_metadata(p).num_rows
        size += os.path.getsize(p)
    return rows, size


# ---------------------------------------------------------------- engines

def _bytes_per_row(src: Source) -> float | None:
    """On-disk bytes per row of a file-backed source (footers only), or a guess for in-memory data."""
    import pyarrow.parquet as pq

    try:
        if src.kind in ("parquet", "delta") and not src.remote:
            files = src.paths if src.kind == "parquet" else delta_files(src)
            files = files[:64]
            rows: int = sum(pq.read_metadata(f).num_rows for f in files)
            if not rows:
                return None
            total: int = sum(os.path.getsize(f) for f in files)
            return total / rows
        if src.kind == "arrow" and hasattr(src.obj, "nbytes") and getattr(src.obj, "num_rows", None):
            return float(src.obj.nbytes / src.obj.num_rows / 2)
        if src.kind == "pandas" and len(src.obj):
            return float(src.obj.memory_usage(deep=True).sum()) / len(src.obj) / 3
    except Exception:  # noqa: BLE001 - an estimate only steers row-group size
        return None
    return None


COMPRESSIONS = ("snappy", "zstd", "gzip", "lz4", "lz4_raw", "brotli", "uncompressed")


def _write_duckdb(src: Source, staging: str, target: int, cols: list[str], memory_limit: Any,
                  threads: int | None, compression: str, spec: Any = None) -> None:
    if compression.lower() not in COMPRESSIONS:
        raise ValueError(f"compression must be one of {', '.join(COMPRESSIONS)}, got {compression!r}")
    con = connect(memory_limit, threads)
    close: Any = con.close  # replaced by the filter's (a second connection for an expression)
    try:
        rel = duckdb_relation(con, src, writable=[staging])
        if src.kind in ("csv", "parquet") and not src.remote and src.paths:  # a filter= with file access off
            restrict_sql(con, [staging, *src.paths])

        def reopen() -> tuple[Any, Any]:
            other = connect(memory_limit, threads)
            return duckdb_relation(other, src), other.close

        rel, close = filter_relation(con, rel, RowFilter.of(spec, rel.columns), reopen)
        missing = [c for c in cols if c not in rel.columns]
        if missing:
            raise KeyError(f"partition_by column {missing[0]!r} is not in {src.describe()}; "
                           f"columns: {', '.join(rel.columns)}")
        rows = row_group_rows(target, _bytes_per_row(src))
        if cols:  # rows grouped by partition: DuckDB keeps no order across them (nor PRESERVE_ORDER)
            interruptible(con, lambda: rel.write_parquet(
                staging, file_size_bytes=target, row_group_size=rows, filename_pattern="part-{i}",
                compression=compression, overwrite=True, partition_by=cols))
        else:
            interruptible(con, lambda: _copy_in_order(con, rel, staging, target, rows, compression.lower()))
    finally:
        con.close()
        close()


def _copy_in_order(con: Any, rel: Any, dest: str, target: int, rows: int, compression: str) -> None:
    """``rel`` written as Parquet files of about ``target`` bytes into ``dest``, rows in the source's
    order, files numbered in it. A COPY with FILE_SIZE_BYTES on several threads writes batches out of
    order unless PRESERVE_ORDER is set, which ``write_parquet`` has no argument for (DuckDB 2.0).
    Every value is a statement parameter."""
    rel.create_view("ucmagic_export_source", replace=True)
    con.execute("COPY (SELECT * FROM ucmagic_export_source) TO $dest (FORMAT parquet, FILE_SIZE_BYTES $size, "
                "ROW_GROUP_SIZE $rows, FILENAME_PATTERN 'part-{i}', COMPRESSION $codec, OVERWRITE true, "
                "PRESERVE_ORDER true)", {"dest": dest, "size": int(target), "rows": int(rows), "codec": compression})


def interruptible(con: Any, statement: Any) -> Any:
    """Run ``statement()`` (a DuckDB call on ``con``) so that Ctrl-C stops it promptly: on a helper thread,
    while this thread waits and receives the KeyboardInterrupt, then interrupts DuckDB, waits for it to
    stop and raises KeyboardInterrupt. (Run on the main thread, a multi-threaded DuckDB query checks for
    signals only when the main thread runs a task of its own: a COPY could ignore Ctrl-C to its end.)"""
    import threading

    box: dict[str, Any] = {}
    done = threading.Event()  # not Thread.join/is_alive: a join interrupted by Ctrl-C can leave is_alive() False

    def run() -> None:
        try:
            box["result"] = statement()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="ucmagic-duckdb", daemon=True).start()
    try:
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        while not done.is_set():  # stop DuckDB before the connection closes (again at a second Ctrl-C)
            con.interrupt()
            try:
                done.wait(0.1)
            except KeyboardInterrupt:
                continue
        raise
    if "error" in box:
        raise box["error"]
    return box.get("result")


def _spark_row_bytes(df: Any, sample: int = 20000) -> float:
    import pyarrow as pa
    import pyarrow.parquet as pq

    part = df.limit(sample)
    t = part.toArrow() if hasattr(part, "toArrow") else pa.Table.from_pandas(part.toPandas(), preserve_index=False)
    if t.num_rows == 0:
        return 100.0
    buf = io.BytesIO()
    pq.write_table(t, buf, compression="snappy")
    return max(1.0, buf.tell() / int(t.num_rows))


def _write_spark(src: Source, staging: str, target: int, cols: list[str], compression: str, spec: Any = None) -> None:
    df = spark_filter(spark_dataframe(src), spec)  # Spark filters in Spark
    rows = df.count()
    nfiles, per_file = spark_file_plan(rows, _spark_row_bytes(df), target)
    df = df.repartition(nfiles, *cols) if cols else df.repartition(nfiles)
    w = (df.write.mode("overwrite").option("maxRecordsPerFile", per_file)
         .option("parquet.block.size", min(target, 128 << 20)).option("compression", compression))
    if cols:
        w = w.partitionBy(*cols)
    w.parquet(staging)


# ---------------------------------------------------------------- publishing to a URL (through its Volume)

def _dest_volume(dest: str, storage_options: dict[str, Any] | None) -> Volume:
    """The Volume of an export's URL destination; a prefix that does not exist yet is fine (an object
    store creates it with its first key)."""
    cls = volume_class(dest)
    try:
        return cls.from_path(dest, storage_options)
    except SourceNotFoundError:
        if not issubclass(cls, FsspecVolume):
            raise
        vol = cls(dest, storage_options)
        vol.fs.makedirs(vol.root, exist_ok=True)  # as export always did: s3fs creates a missing bucket
        return vol


def _listed_data(vol: Volume) -> list[str]:
    """The Parquet data files under the volume's root (relative); none when it is empty or missing."""
    try:
        entries = vol.list()
    except (EmptyListingError, FileNotFoundError):
        return []
    return [e.path for e in entries if e.path.endswith(".parquet") and is_data_path(e.path)]


def _publish_remote(local_staging: str, rels: list[str], vol: Volume, dest: str, append: bool = False) -> list[str]:
    """Upload the new files under new names (each upload atomic), write the manifest naming the committed
    files (the commit point: one atomic put), then remove the stale files. No rename is needed, so the
    same steps hold where :attr:`Volume.atomic_rename` is False."""
    vol.makedirs("")
    old = _listed_data(vol)
    for r in rels:
        vol.upload(os.path.join(local_staging, r), r)
    listed = rels
    if append:  # the new files join the committed ones (the manifest's: not a killed append's uploads)
        committed = volume_manifest(vol)
        listed = sorted(set(rels) | set(committed if committed is not None else old))
    vol.write_bytes(MANIFEST, json.dumps({"files": listed}).encode())  # the commit point
    keep = set(listed)
    for r in old:
        if r not in keep:
            vol.remove(r)
    return [dest.rstrip("/") + "/" + r for r in rels]


def _remote_non_empty(vol: Volume) -> bool:
    return bool(vol.list_names(""))


# ---------------------------------------------------------------- public API

def export_parquet(source: Any, dest: str | os.PathLike[str], *, target_file_size: int | str = "1GB",
                   mode: str = "overwrite", partition_by: str | Sequence[str] | None = None,
                   version: int | None = None, memory_limit: int | str | None = DEFAULT_MEMORY_LIMIT,
                   threads: int | None = None, compression: str = "snappy",
                   storage_options: dict[str, Any] | None = None, allow_shared_dest: bool = False,
                   filter: Any = None) -> ExportResult:  # noqa: A002 - the option's documented name
    """Write ``source`` as Parquet files of about ``target_file_size`` into the directory ``dest``.

    ``source``: a Spark DataFrame or a table name with an active Spark session (Spark writes,
    distributed); a local-catalog table name; a Delta directory (``version=`` for time travel);
    Parquet/CSV paths or globs; a pandas DataFrame or pyarrow Table; a SQL query (DuckDB).
    ``dest``: a local or mounted directory, a ``/Volumes/...`` path, or an fsspec URL.
    ``mode="overwrite"`` replaces ``dest`` atomically (readers see the old files or the new ones,
    never a mixture, and no stale file survives); ``mode="append"`` adds the new files beside the
    old ones (uniquely named; ucmagic's readers see all of them or none, and an append killed midway
    is rolled back by the next ucmagic call on ``dest``, so rerunning it adds its rows once);
    ``mode="error"`` refuses a non-empty ``dest``.
    ``filter``: only the rows a SQL predicate string (DuckDB's dialect; Spark's for Spark sources) or a pyarrow
    compute expression keeps (see docs/tables.md, "Filters").
    ``partition_by`` writes Hive-style ``col=value/`` directories. The embedded engine streams its
    input under ``memory_limit``. Returns an :class:`ExportResult` (files, rows, bytes, seconds).
    A local ``dest`` (or its folder) of another user's or writable by others is refused
    (:class:`UnsafeDirectoryError`) unless ``allow_shared_dest=True``; a sticky folder such as ``/tmp``
    is fine as the folder that holds ``dest``.
    """
    t0 = time.perf_counter()
    if mode not in EXPORT_MODES:
        raise ValueError(f"mode must be one of {EXPORT_MODES}, got {mode!r}")
    target = parse_size(target_file_size)
    if not target:
        raise ValueError(f"target_file_size must be > 0, got {target_file_size!r}")
    cols = _partition_cols(partition_by)
    src = as_source(source, version=version, storage_options=storage_options)
    filter = src.with_filter(filter)  # noqa: A001 - or the one an entry point set on the source
    spark = src.kind in ("spark", "spark_table")
    dest = os.fspath(dest)
    export_id = uuid.uuid4().hex[:12]
    remote = is_remote_url(dest)
    check_no_overlap(src, dest if remote else _resolve_dest(dest[len("file://"):] if dest.startswith("file://")
                                                        else dest))
    if remote:
        if spark:
            raise UnsupportedSourceError(
                "export_parquet from Spark writes to a /Volumes path or a local directory; for an "
                "object-store URL use df.write.parquet(url) in Spark, or pass a /Volumes path"
            )
        vol = _dest_volume(dest, storage_options)
        if mode == "error" and _remote_non_empty(vol):
            raise FileExistsError(f"{dest} exists and is not empty: pass mode='overwrite' to replace it")
        staging = tempfile.mkdtemp(prefix="ucmagic-export-")
        try:
            _write_duckdb(src, os.path.join(staging, "out"), target, cols, memory_limit, threads, compression, filter)
            out = os.path.join(staging, "out")
            rels = _finish_staging(out, export_id, rename=True)
            rows, size = _count(out, rels)
            files = _publish_remote(out, rels, vol, dest, append=mode == "append")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return ExportResult(dest, files, rows, size, time.perf_counter() - t0, "duckdb")

    dest = _resolve_dest(dest[len("file://"):] if dest.startswith("file://") else dest)
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise SourceNotADirectoryError(f"{dest} is a file: export_parquet writes a directory of Parquet files")
    recover_destination(dest)  # an append killed earlier: rolled back before anything else
    if mode == "error" and _non_empty(dest):
        raise FileExistsError(f"{dest} exists and is not empty: pass mode='overwrite' to replace it atomically")
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    check_write_dest(parent, allow_shared=allow_shared_dest, sticky_ok=True, what="folder of the export destination")
    if os.path.lexists(dest):
        check_write_dest(dest, allow_shared=allow_shared_dest, what="export destination")
    # the parent is held open while the export writes: its private staging folder is made, and swapped in,
    # through that descriptor (an engine writes by path, but only inside the folder made that way)
    hold_dir(parent, shared_ok=allow_shared_dest, sticky_ok=True, what="folder of the export destination")
    try:
        sweep_leftovers(dest)
        staging = staging_path(dest, "staging", export_id)
        fd, name = held(staging)
        os.mkdir(name, 0o700, dir_fd=fd)

        def write(staging: str) -> None:
            if spark:
                _write_spark(src, staging, target, cols, compression, filter)
            else:
                _write_duckdb(src, staging, target, cols, memory_limit, threads, compression, filter)

        rels, rows, size = _publish_local(write, staging, dest, export_id, mode, renumber=not spark)
    finally:
        release_dir(parent)
    files = [os.path.join(dest, r) for r in rels]
    remember_export(dest)  # a later SQL query of this process may read what it wrote
    return ExportResult(dest, files, rows, size, time.perf_counter() - t0, "spark" if spark else "duckdb")


__all__ = ["export_parquet", "ExportResult", "UCMagicError", "ExportOverlapError", "recover_destination"]
