"""Sources: what a name or path points at, and how to read it.

Table names (``catalog.schema.table``: Spark when a session is active, else the local catalog under
``$UCMAGIC_CATALOG_ROOT``), their resolution into a :class:`Source` (:func:`resolve_source`),
DuckDB and Spark relations over a source, and the "files or table?" question
(:func:`classify_source`) that :func:`ucmagic.load`, ``%ucload`` and ``python -m ucmagic load`` ask.
Used by :mod:`ucmagic.tables.api`, :mod:`ucmagic.tables.export` and :mod:`ucmagic.tables.parquet_dataset`; it
imports none of them. Names are validated and never pasted into SQL.
"""
from __future__ import annotations

import contextlib
import glob as globmod
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

from .._util import error_line, is_remote_url, is_url
from ..errors import (ColumnNotFoundError, EmptyListingError, InvalidTableNameError, SourceNotADirectoryError,
                      SourceNotFoundError, SQLFileAccessError, TableNotFoundError, UnsupportedSourceError)
from ..units import parse_size
from ..files.volume import Volume, compile_pattern, existing_local, open_volume, resolve_local_path
from .journal import committed_listing


# ---------------------------------------------------------------- names (pure)

_IDENT = r"[A-Za-z0-9_][A-Za-z0-9_\-]{0,254}"
_NAME_RE = re.compile(rf"^({_IDENT})\.({_IDENT})\.({_IDENT})$")
_SQL_RE = re.compile(r"^\s*(select|with|from|values|table|pivot|unpivot|summarize|describe|show)\b", re.I | re.S)
DATA_EXTS = {"parquet", "pq", "csv", "tsv", "gz", "zst", "json", "delta"}
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class TableName:
    catalog: str
    schema: str
    table: str

    def __str__(self) -> str:
        return f"{self.catalog}.{self.schema}.{self.table}"

    def quoted(self) -> str:
        """Backtick-quoted for Spark (parts are validated, so they hold no backtick)."""
        return ".".join(f"`{p}`" for p in (self.catalog, self.schema, self.table))


def parse_table_name(name: str) -> TableName:
    """Validate ``catalog.schema.table`` (letters, digits, ``_``, ``-``; no dots, quotes or slashes)."""
    m = _NAME_RE.match(name.strip()) if isinstance(name, str) else None
    if not m:
        raise InvalidTableNameError(
            f"{name!r} is not a table name nor an existing path: table names have three parts, "
            "catalog.schema.table, each made of letters, digits, '_' or '-' (e.g. 'main.sales.orders')"
        )
    return TableName(*m.groups())


def is_sql(text: str) -> bool:
    """True for a string that reads as a SQL query (``SELECT ...``, ``WITH ...``, ``FROM ...``)."""
    return bool(_SQL_RE.match(text)) and any(c.isspace() for c in text.strip())


def looks_like_table_name(text: str) -> bool:
    """A dotted string without path syntax or a data-file extension (checked before any I/O)."""
    t = text.strip()
    if not t or "/" in t or "\\" in t or t.startswith(("~", ".")) or _GLOB_CHARS & set(t):
        return False
    if "." not in t:
        return False
    return t.rsplit(".", 1)[-1].lower() not in DATA_EXTS


# ---------------------------------------------------------------- Spark and the local catalog

def active_spark() -> Any | None:
    """The active Spark session (classic or Spark Connect), or None. Never imports pyspark itself."""
    if "pyspark" not in sys.modules:
        return None
    for modname in ("pyspark.sql", "pyspark.sql.connect.session"):
        mod = sys.modules.get(modname)
        cls = getattr(mod, "SparkSession", None) if mod else None
        if cls is None:
            continue
        try:
            s = cls.getActiveSession()
        except Exception:  # noqa: BLE001 - a half-initialised JVM must not break local use
            s = None
        if s is not None:
            return s
    return None


def is_spark_dataframe(obj: Any) -> bool:
    mod = type(obj).__module__ or ""
    return mod.startswith("pyspark.sql") and type(obj).__name__ == "DataFrame"


def catalog_root() -> str:
    root = os.environ.get("UCMAGIC_CATALOG_ROOT")
    if not root:
        raise TableNotFoundError(
            "no Spark session is active and UCMAGIC_CATALOG_ROOT is not set: set it to a directory "
            "that holds <catalog>/<schema>/<table> (the local catalog), or start a Spark session"
        )
    return os.path.abspath(os.path.expanduser(root))


def table_path(name: str | TableName) -> str:
    """Local-catalog directory of a table: ``$UCMAGIC_CATALOG_ROOT/<catalog>/<schema>/<table>``."""
    t = name if isinstance(name, TableName) else parse_table_name(name)
    return os.path.join(catalog_root(), t.catalog, t.schema, t.table)


def list_tables(root: str | None = None) -> list[str]:
    """Names of the tables in the local catalog (directories three levels down, ``volumes`` excluded)."""
    root = root or catalog_root()
    out = []
    for path in sorted(globmod.glob(os.path.join(root, "*", "*", "*"))):
        c, s, t = path.split(os.sep)[-3:]
        if os.path.isdir(path) and t != "volumes" and not t.startswith((".", "_")) and _NAME_RE.match(f"{c}.{s}.{t}"):
            out.append(f"{c}.{s}.{t}")
    return out


def is_delta_dir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "_delta_log"))


# ---------------------------------------------------------------- sources

@dataclass
class Source:
    """What to read. ``kind``: spark, spark_table, pandas, arrow, duckdb, sql, delta, parquet, csv."""

    kind: str
    obj: Any = None
    paths: list[str] = field(default_factory=list)  # local files, or URLs (remote=True)
    root: str | None = None  # the directory a path source came from
    version: int | None = None
    name: str | None = None
    remote: bool = False
    storage_options: dict[str, Any] | None = None
    snapshot: Any = field(default=None, repr=False, compare=False)  # a delta source's, once resolved
    schema: Any = field(default=None, repr=False, compare=False)  # the table's Arrow schema, once read
    footers: Any = field(default=None, repr=False, compare=False)  # a parquet source's files (TableFile), once read
    filter: Any = field(default=None, repr=False, compare=False)  # the RowFilter a caller set on it

    def with_filter(self, filter: Any) -> Any:  # noqa: A002 - the entry points' option name
        """The filter a read of this source applies: ``filter`` (the read's own ``filter=``) or the one an entry
        point set on the source; both set and different is refused (a read never drops either silently)."""
        if filter is None:
            return self.filter
        if self.filter is None or self.filter is filter or (isinstance(filter, str) and filter == self.filter):
            return filter
        raise ValueError(f"{self.describe()} was resolved with the filter {self.filter!r} and this read passes "
                         f"filter={filter!r}: pass one filter (combine them with AND in one predicate)")

    def describe(self) -> str:
        if self.name:
            return self.name
        if self.root:
            return self.root
        if self.paths:
            return self.paths[0] + (f" (+{len(self.paths) - 1} files)" if len(self.paths) > 1 else "")
        return self.kind


def is_data_path(rel: str) -> bool:
    """Data files only: no hidden or side files (``_SUCCESS``, ``.crc``, ``_delta_log``...)."""
    return not any(part.startswith(("_", ".")) for part in rel.split("/"))


def _kind_of_file(path: str) -> str | None:
    low = path.lower()
    if low.endswith((".parquet", ".pq")) or re.search(r"\.parquet\.[a-z0-9]+$", low):
        return "parquet"
    if low.endswith((".csv", ".tsv", ".csv.gz", ".tsv.gz", ".csv.zst")):
        return "csv"
    return None


def _files_kind(files: Sequence[str], what: str) -> str:
    kinds = {_kind_of_file(f) for f in files}
    if kinds == {"parquet"}:
        return "parquet"
    if kinds == {"csv"}:
        return "csv"
    raise UnsupportedSourceError(
        f"{what}: expected Parquet (.parquet) or CSV (.csv/.tsv) files, found "
        f"{sorted(os.path.basename(f) for f in files)[:5]}; pass a glob that selects one kind"
    )


def _local_dir_files(root: str) -> list[str]:
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(("_", ".")))
        for f in filenames:
            full = os.path.join(dirpath, f)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            if is_data_path(rel) and _kind_of_file(f):
                files.append(full)
    return sorted(files)


def _rels(vol: Volume, pattern: str | None = None) -> list[str]:
    """The volume's files (relative paths) matching ``pattern`` (anchored at its root), sorted; [] for none."""
    try:
        entries = vol.list(None)
    except EmptyListingError:
        return []
    rx = compile_pattern(pattern, anchored=True) if pattern else None
    return [e.path for e in entries if rx is None or rx.match(e.path)]


def _remote_source(url: str, version: int | None, storage_options: dict[str, Any] | None) -> Source:
    """A URL source, listed and read through its volume backend (:func:`~ucmagic.files.volume.open_volume`)."""
    glob_at = min((url.index(c) for c in _GLOB_CHARS if c in url), default=-1)
    if glob_at >= 0:  # the folder above the first wildcard, then the glob below it
        cut = url.rfind("/", 0, glob_at)
        try:
            vol = open_volume(url[:cut], storage_options)
            files = [vol.display(r) for r in _rels(vol, url[cut + 1:]) if _kind_of_file(r)]
        except (SourceNotFoundError, SourceNotADirectoryError):
            files = []
        if not files:
            raise SourceNotFoundError(f"no Parquet or CSV file matches {url}: check the glob")
        return Source(_files_kind(files, url), paths=files, remote=True, storage_options=storage_options)
    try:
        vol = open_volume(url, storage_options)
    except SourceNotADirectoryError:  # one file
        return Source(_files_kind([url], url), paths=[url], remote=True, storage_options=storage_options)
    if vol.exists("_delta_log"):
        return Source("delta", root=url, version=version, remote=True, storage_options=storage_options)
    manifest = volume_manifest(vol)
    if manifest is not None:
        files = [vol.display(f) for f in manifest]
    else:
        files = [vol.display(r) for r in _rels(vol) if _kind_of_file(r) and is_data_path(r)]
    if not files:
        raise SourceNotFoundError(f"no Parquet or CSV files under {url}")
    return Source(_files_kind(files, url), paths=files, root=url, remote=True, storage_options=storage_options)


MANIFEST = "_ucmagic_manifest.json"


def _manifest_files(data: bytes) -> list[str]:
    import json

    return list(json.loads(data.decode())["files"])


def volume_manifest(vol: Volume) -> list[str] | None:
    """File names listed by an export to the volume's root (written last, so a reader never sees a mixture)."""
    try:
        return _manifest_files(vol.read_bytes(MANIFEST))
    except FileNotFoundError:
        return None


def read_manifest(fs: Any, root: str) -> list[str] | None:
    """:func:`volume_manifest` for an fsspec filesystem and root path (the export writer's view)."""
    try:
        return _manifest_files(fs.cat_file(root.rstrip("/") + "/" + MANIFEST))
    except FileNotFoundError:
        return None


def resolve_path_source(path: str, *, version: int | None = None,
                        storage_options: dict[str, Any] | None = None) -> Source:
    """A file, a glob, a directory (Parquet/CSV files or a Delta table), a ``/Volumes`` path or a URL."""
    if is_remote_url(path):
        return _remote_source(path, version, storage_options)
    if path.startswith("file://"):
        path = path[len("file://"):]
    if _GLOB_CHARS & set(path):
        files = sorted(f for f in globmod.glob(resolve_local_path(path), recursive=True)
                       if os.path.isfile(f) and _kind_of_file(f))
        if not files:
            raise SourceNotFoundError(f"no Parquet or CSV file matches {path}: check the glob")
        return Source(_files_kind(files, path), paths=files)
    real, is_dir = existing_local(path)
    if is_dir:
        if is_delta_dir(real):
            return Source("delta", root=real, version=version)
        files = committed_listing(real, _local_dir_files)  # an unfinished append: none of its files
        if not files:
            raise SourceNotFoundError(f"no Parquet or CSV files under {path}: pass a directory of .parquet/.csv files")
        return Source(_files_kind(files, path), paths=files, root=real)
    return Source(_files_kind([real], path), paths=[real])


def as_source(source: Any, *, version: int | None = None,
              storage_options: dict[str, Any] | None = None) -> Source:
    """``source`` as a :class:`Source`: one an entry point already resolved passes through untouched (with its
    listing, snapshot, footers and schema), anything else is resolved now (:func:`resolve_source`)."""
    if isinstance(source, Source):
        if version is not None and version != source.version:
            raise ValueError(f"version={version} differs from the resolved source's version {source.version}")
        return source
    return resolve_source(source, version=version, storage_options=storage_options)


def resolve_again(src: Source, err: BaseException) -> Source:
    """``src`` listed again from its directory after ``err`` (an overwrite swapped its files meanwhile); for a
    source that is not a directory, ``err`` is raised."""
    if not src.root or src.kind not in ("parquet", "csv", "delta"):
        raise err
    again = resolve_path_source(src.root, version=src.version, storage_options=src.storage_options)
    again.name, again.filter = src.name, src.filter
    return again


def resolve_source(source: Any, *, version: int | None = None,
                   storage_options: dict[str, Any] | None = None) -> Source:
    """Classify anything ``export_parquet``/``load_table`` accept. Raises clear errors for the rest."""
    if is_spark_dataframe(source):
        return Source("spark", obj=source)
    mod = type(source).__module__ or ""
    if mod.startswith("pandas") and type(source).__name__ == "DataFrame":
        return Source("pandas", obj=source)
    if mod.startswith("pyarrow"):
        import pyarrow as pa
        import pyarrow.dataset as pads

        if isinstance(source, (pa.Table, pa.RecordBatch, pa.RecordBatchReader, pads.Dataset)):
            return Source("arrow", obj=source)
    if mod.startswith("duckdb") and hasattr(source, "fetch_arrow_reader"):
        return Source("duckdb", obj=source)
    if isinstance(source, (list, tuple)) and source and all(isinstance(p, (str, os.PathLike)) for p in source):
        srcs = [resolve_path_source(os.fspath(p), storage_options=storage_options) for p in source]
        files = [f for s in srcs for f in s.paths]
        if any(s.kind not in ("parquet", "csv") for s in srcs) or not files:
            raise UnsupportedSourceError("a list of paths must name Parquet or CSV files (one Delta table at a time)")
        return Source(_files_kind(files, "the listed paths"), paths=files, remote=any(s.remote for s in srcs),
                      storage_options=storage_options)
    if isinstance(source, os.PathLike):
        source = os.fspath(source)
    if isinstance(source, str):
        text = source.strip()
        if is_sql(text):
            return Source("sql", obj=text)
        if (_NAME_RE.match(text) or looks_like_table_name(text)) and not os.path.exists(text):
            name = parse_table_name(text)
            if active_spark() is not None:
                return Source("spark_table", name=str(name), obj=name)
            path = table_path(name)
            if not os.path.isdir(path):
                known = list_tables()
                raise TableNotFoundError(
                    f"table {name} not found in the local catalog (no directory {path}, and no file {text!r} "
                    "exists here); "
                    f"tables there: {', '.join(known[:10]) or 'none'}. Create it with register_table()"
                )
            src = resolve_path_source(path, version=version)
            src.name = str(name)
            return src
        return resolve_path_source(text, version=version, storage_options=storage_options)
    raise UnsupportedSourceError(
        f"cannot read a {type(source).__module__}.{type(source).__name__}: pass a Spark or pandas DataFrame, "
        "a pyarrow Table, a table name (catalog.schema.table), a Delta directory, Parquet/CSV paths or a SQL query"
    )


# ---------------------------------------------------------------- reading with the embedded engine

def delta_snapshot(src: Source) -> Any:
    """The :class:`~ucmagic.tables.delta.DeltaSnapshot` of a ``delta`` source (its version, files, schema),
    resolved once per source: every reader of the source sees the same version."""
    from .delta import open_snapshot

    if src.snapshot is None:
        src.snapshot = open_snapshot(src.root or "", version=src.version, name=src.describe(),
                                     storage_options=src.storage_options)
    return src.snapshot


def hive_partitioned(src: Source) -> bool:
    """True for a directory source whose files lie in Hive-style ``key=value/`` directories."""
    if not src.root or src.kind not in ("parquet", "csv"):
        return False
    base = src.root.rstrip("/") + "/"
    return any("=" in part for p in src.paths if p.startswith(base)
               for part in p[len(base):].split("/")[:-1])


def arrow_dataset(src: Source, columns: Sequence[str] | None = None, schema: Any = None) -> Any:
    """A lazy pyarrow dataset over a Parquet or CSV source (streams; projects columns; Hive ``key=value/``
    directories are columns, typed as pyarrow infers them); for a Delta table, a RecordBatchReader of the
    rows its snapshot defines (deletion vectors applied, logical names, partition columns), in log order."""
    import pyarrow.dataset as pads

    if src.kind == "delta":
        return delta_snapshot(src).reader(columns)
    fmt = "parquet" if src.kind == "parquet" else "csv"
    hive: dict[str, Any] = {}
    if hive_partitioned(src):
        hive = {"partitioning": "hive", "partition_base_dir": fsspec_strip(src.root or "")}
    if src.remote:  # read through the registered volume of the source (ranged reads)
        from .table_io import TableFiles, arrow_filesystem

        fs = arrow_filesystem(TableFiles(src.root, src.storage_options))
        if hive:
            hive["partition_base_dir"] = src.root
        return pads.dataset(list(src.paths), format=fmt, filesystem=fs, schema=schema, **hive)
    return pads.dataset(src.paths, format=fmt, schema=schema, **hive)


def hive_partitions(src: Source) -> tuple[Any, dict[str, dict[str, Any]]]:
    """``(schema of the partition columns, {file path: {column: value}})`` of a Hive-partitioned source, as
    pyarrow infers them (integers as int32, else strings; ``__HIVE_DEFAULT_PARTITION__`` as null)."""
    import pyarrow as pa
    import pyarrow.dataset as pads

    if not hive_partitioned(src):
        return pa.schema([]), {}
    ds = arrow_dataset(src)
    schema = ds.partitioning.schema if ds.partitioning is not None else pa.schema([])
    by_path = {p if src.remote else fsspec_strip(p): p for p in src.paths}
    values = {by_path.get(fr.path, fr.path): pads.get_partition_keys(fr.partition_expression)
              for fr in ds.get_fragments()}
    return schema, values


def delta_files(src: Source) -> list[str]:
    """Data files of the Delta table's selected version, in log order (local paths, or URLs for remote
    tables). Their rows are not the table's rows when it has deletion vectors: read through delta_snapshot."""
    return [f.path for f in delta_snapshot(src).files]


def fsspec_strip(url: str) -> str:
    return url.split("://", 1)[1] if is_url(url) else url


SQL_FILES_ENV = "UCMAGIC_SQL_FILES"  # folders (os.pathsep-separated) a user's SQL may read besides ours; "any": all
_exported: set[str] = set()  # local folders export_parquet wrote in this process (a user's SQL may read them)


def remember_export(dest: str) -> None:
    """Let a user's SQL read what ``export_parquet`` wrote to the local folder ``dest`` in this process."""
    _exported.add(os.path.realpath(dest))


def sql_allowed_dirs(setting: str | None, catalog: str | None, exported: Sequence[str],
                     extra: Sequence[str] = ()) -> list[str] | None:
    """The folders a user's SQL may read or write (None: anything the user can). ``setting`` is
    ``$UCMAGIC_SQL_FILES``: ``"any"``, or folders separated by ``os.pathsep``, added to the local
    catalog (``catalog``), this process's exports (``exported``) and ucmagic's own ``extra`` folders
    (an export's staging, the spill folder). Each ends with a separator: ``/a`` does not admit ``/ab``."""
    if setting is not None and setting.strip().lower() == "any":
        return None
    dirs = [d for d in (setting or "").split(os.pathsep) if d.strip()]
    dirs += [catalog] if catalog else []
    out = []
    for d in [*dirs, *exported, *extra]:
        full = os.path.realpath(os.path.expanduser(d)) if not is_url(d) else d
        out.append(full.rstrip("/") + "/")
    return sorted(set(out))


def restrict_sql(con: Any, writable: Sequence[str] = ()) -> None:
    """Before a user's SQL runs on ``con``: DuckDB may touch files only in :func:`sql_allowed_dirs`
    (``enable_external_access=false`` with ``allowed_directories``; it cannot be turned back on for
    this connection). ``$UCMAGIC_SQL_FILES=any`` leaves the SQL the user's full file access."""
    catalog = os.environ.get("UCMAGIC_CATALOG_ROOT")
    allowed = sql_allowed_dirs(os.environ.get(SQL_FILES_ENV), catalog, sorted(_exported),
                               [*writable, os.path.dirname(spill_dir())])
    if allowed is None:
        return
    con.execute("SET allowed_directories = $1", [allowed])  # a parameter: paths are never pasted into SQL
    if writable:  # the folders themselves (a COPY ... TO <folder> makes it), not only what is in them
        con.execute("SET allowed_paths = $1", [[os.path.realpath(w) if not is_url(w) else w for w in writable]])
    con.execute("SET enable_external_access = false")


def duckdb_relation(con: Any, src: Source, columns: Sequence[str] | None = None, *,
                    writable: Sequence[str] = ()) -> Any:
    """A DuckDB relation reading ``src`` lazily (DuckDB streams it: memory stays bounded).

    ``columns`` projects a Delta table before its rows are read (other kinds: use :func:`select_columns`).
    A SQL query runs with file access limited to :func:`restrict_sql`'s folders (plus ``writable``:
    where the caller will have DuckDB write)."""
    if src.kind == "delta":
        return con.from_arrow(delta_snapshot(src).reader(columns))
    if src.kind == "pandas":
        return con.from_df(src.obj)
    if src.kind == "arrow":
        return con.from_arrow(src.obj)
    if src.kind == "duckdb":
        return con.from_arrow(src.obj.fetch_arrow_reader(1 << 16))
    if src.kind == "sql":
        restrict_sql(con, writable)
        import duckdb

        try:
            return con.sql(src.obj)
        except duckdb.PermissionException as exc:
            raise SQLFileAccessError(
                f"{error_line(exc)}. SQL given to ucmagic may use files only in the local catalog, in what "
                f"export_parquet wrote in this process and in the folders of ${SQL_FILES_ENV} (separated by "
                f"'{os.pathsep}'): set {SQL_FILES_ENV}=<folder> to let it read that folder, or {SQL_FILES_ENV}=any "
                "for all your files") from exc
    if src.kind == "parquet" and not src.remote and not hive_partitioned(src):
        return con.read_parquet(src.paths)
    if src.kind == "csv" and not src.remote and not hive_partitioned(src):
        return con.read_csv(src.paths)
    if src.kind in ("delta", "parquet", "csv"):
        return con.from_arrow(arrow_dataset(src))
    raise UnsupportedSourceError(f"{src.kind} sources are read by Spark, not the embedded engine")


def select_columns(rel: Any, columns: Sequence[str] | None, what: str) -> Any:
    """Project ``rel`` on ``columns`` (names checked, never pasted into SQL)."""
    if not columns:
        return rel
    import duckdb

    missing = [c for c in columns if c not in rel.columns]
    if missing:
        raise ColumnNotFoundError(f"{what} has no column {missing[0]!r}; columns: {', '.join(rel.columns)}")
    return rel.select(*[duckdb.ColumnExpression(c) for c in columns])


SPILL_PREFIX = "ucmagic-duckdb-"  # older ucmagic: <tmp>/ucmagic-duckdb-<pid> (swept when its process is gone)


def spill_owner(name: str, prefix: str = SPILL_PREFIX) -> int | None:
    """The pid in a spill folder's name (``<prefix><pid>``), else None."""
    pid = name[len(prefix):] if name.startswith(prefix) else ""
    return int(pid) if pid.isascii() and pid.isdigit() else None


def sweep_spill_dirs(tmp: str, prefix: str = SPILL_PREFIX) -> int:
    """Remove the DuckDB spill directories (``<tmp>/<prefix><pid>``) of this user's processes that are
    gone (DuckDB removes its own when the connection closes, a killed process leaves it): only real
    folders of this user's own, never through a link. Returns how many went."""
    import shutil

    from ..files.locks import dir_problem, pid_running

    uid = os.getuid() if hasattr(os, "getuid") else None
    n = 0
    for path in globmod.glob(os.path.join(globmod.escape(tmp), globmod.escape(prefix) + "*")):
        pid = spill_owner(os.path.basename(path), prefix)
        if pid is None or pid == os.getpid() or pid_running(pid):
            continue
        with contextlib.suppress(OSError):
            if dir_problem(os.lstat(path), uid) is None:
                shutil.rmtree(path, ignore_errors=True)
                n += 1
    return n


def spill_dir() -> str:
    """This process's DuckDB spill folder, ``<cache dir>/spill/duckdb-<pid>``: inside the user's private
    cache directory (made, or checked to be a real folder of the user's that no one else may write
    to: :func:`ucmagic.files.locks.private_dir`), so no other user can make it first or read what
    spills. DuckDB makes it when it spills and removes it when the connection closes."""
    import tempfile

    from ..files.cache_layout import default_cache_dir
    from ..files.locks import private_dir

    root = default_cache_dir()
    private_dir(root, tighten=True, what="cache directory")
    folder = private_dir(os.path.join(root, "spill"), what="DuckDB spill folder")
    sweep_spill_dirs(folder, "duckdb-")
    sweep_spill_dirs(tempfile.gettempdir())  # older ucmagic's
    return os.path.join(folder, f"duckdb-{os.getpid()}")


def connect(memory_limit: int | str | None = None, threads: int | None = None) -> Any:
    """A fresh in-memory DuckDB connection with a memory limit and a private spill directory."""
    import duckdb

    cfg: dict[str, Any] = {"temp_directory": spill_dir()}
    if memory_limit is not None:
        cfg["memory_limit"] = f"{parse_size(memory_limit)}B"
    if threads:
        cfg["threads"] = int(threads)
    return duckdb.connect(config=cfg)



# ---------------------------------------------------------------- Spark

# ---------------------------------------------------------------- files or table?

def classify_source(source: str, *, force: str | None = None) -> str:
    """``'files'`` (a directory of files), ``'table'`` (a table name, SQL query, Parquet/CSV file or
    glob, Delta or Parquet directory), ``'file'`` (some other single file) or ``'missing'``."""
    if force:
        return force
    if is_sql(source):
        return "table"
    if is_url(source):
        return "table" if source.rstrip("/").endswith((".parquet", ".csv")) else "files"
    if set("*?[") & set(source):
        return "table" if source.endswith((".parquet", ".csv")) else "missing"
    real = resolve_local_path(source)
    if not os.path.exists(real):
        return "table" if looks_like_table_name(source) else "missing"
    if os.path.isfile(real):
        return "table" if real.endswith((".parquet", ".csv")) else "file"
    if os.path.isdir(os.path.join(real, "_delta_log")):
        return "table"
    return "table" if all_parquet(real) else "files"


def all_parquet(root: str, limit: int = 200) -> bool:
    """True when the first files found under ``root`` (up to ``limit``) are all Parquet files."""
    seen = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "_"))]
        for f in filenames:
            if f.startswith((".", "_")):
                continue
            if not f.endswith(".parquet"):
                return False
            seen += 1
            if seen >= limit:
                return True
    return seen > 0
