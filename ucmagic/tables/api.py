"""Tables: load_table and register_table (name resolution and readers live in :mod:`ucmagic.tables.sources`).

A *table name* is ``catalog.schema.table`` (three identifiers). With an active Spark session it
goes through Spark; without one it resolves to ``$UCMAGIC_CATALOG_ROOT/<catalog>/<schema>/<table>``,
a Delta table or a directory of Parquet files (the local catalog). Names are validated and never
pasted into SQL: locally they only become path components, in Spark each part is quoted.

:func:`ucmagic.tables.sources.resolve_source` turns anything ``export_parquet``/``load_table`` accept into
a :class:`Source`; :func:`ucmagic.tables.sources.duckdb_relation` reads a local source with the embedded
engine (DuckDB), streaming and with column pushdown. The source names are re-exported by :mod:`ucmagic.tables`.
"""
from __future__ import annotations

import os
from typing import Any, Sequence

from . import sources
from ..errors import (ColumnNotFoundError, InvalidTableNameError, ListingChangedError, SourceNotFoundError,  # noqa: F401 - re-exported
                     TableNotFoundError, TableTooLargeError, UnsupportedSourceError, UnsupportedTableFeatureError,
                     import_extra)
from .footers import source_footers
from .group_reader import prune_args
from .predicate import RowFilter, filter_relation, filtered_reader, spark_filter
from .sources import (DATA_EXTS, MANIFEST, Source, TableName, active_spark, arrow_dataset,  # noqa: F401 - re-exported
                      catalog_root, connect, delta_files, duckdb_relation, fsspec_strip, is_delta_dir, is_sql,
                      is_spark_dataframe, list_tables, looks_like_table_name, parse_table_name, read_manifest,
                      resolve_path_source, resolve_source, select_columns, table_path)
from .sources import as_source
from .spark_source import spark_dataframe
from .table_io import TableFiles
from ..units import format_size, parse_size


# ---------------------------------------------------------------- load_table

DEFAULT_BUDGET_FRACTION = 0.5


def memory_budget(max_bytes: int | str | None = None) -> int:
    """``max_bytes``, else ``$UCMAGIC_LOAD_TABLE_MAX_BYTES``, else half of the available memory."""
    if max_bytes is not None:
        return int(parse_size(max_bytes) or 0)
    env = os.environ.get("UCMAGIC_LOAD_TABLE_MAX_BYTES")
    if env:
        return int(parse_size(env) or 0)
    import psutil

    return int(psutil.virtual_memory().available * DEFAULT_BUDGET_FRACTION)


def estimate_memory(src: Source, columns: Sequence[str] | None, limit: int | None) -> int | None:
    """Rough in-memory size of the selected rows/columns of a file-backed source (None: unknown)."""
    import pyarrow.parquet as pq

    if src.kind == "csv" and not src.remote:
        total = sum(os.path.getsize(p) for p in src.paths) * 2
        return total if limit is None else min(total, limit * 200)
    if src.kind not in ("parquet", "delta") or (src.remote and src.kind == "delta"):
        return None
    want = set(columns or [])
    if src.kind == "delta":
        snap = sources.delta_snapshot(src)
        opener = TableFiles(snap.root)  # footers read as the data will be: no link out of the table
        metas = []
        for f in snap.files:
            with opener.open(f.path) as fh:
                metas.append(pq.read_metadata(fh))
        if want and snap.mapping_mode != "none":  # the footers name columns physically
            want = {snap.fields.get(c, {}).get("metadata", {}).get("delta.columnMapping.physicalName", c)
                    for c in want}
    else:  # the footers every reader of the source shares
        metas = [f.meta for f in source_footers(src)[0]]
    total = rows = 0
    for md in metas:
        rows += md.num_rows
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            for c in range(rg.num_columns):
                col = rg.column(c)
                if not want or col.path_in_schema.split(".")[0] in want:
                    total += col.total_uncompressed_size
    if limit is not None and rows:
        total = int(total * min(1.0, limit / rows))
    return int(total * 1.5)  # pandas objects (strings) take more than their encoded size


def load_table(name_or_path: Any, *, columns: Sequence[str] | None = None, limit: int | None = None,
               version: int | None = None, max_bytes: int | str | None = None,
               storage_options: dict[str, Any] | None = None, filter: Any = None) -> Any:  # noqa: A002 - documented name
    """Read a table into a pandas DataFrame (the ``toPandas()`` path, for tables that fit in memory).

    ``name_or_path``: ``catalog.schema.table`` (Spark when a session is active, else the local
    catalog), a Delta directory (``version=`` for time travel), Parquet/CSV files, a SQL query,
    or a Spark DataFrame. ``columns`` projects, ``limit`` caps rows, ``filter`` keeps the rows a SQL
    predicate string (DuckDB's dialect; Spark's for Spark sources) or a pyarrow compute expression keeps
    (pushed down to partitions and row-group statistics; docs/tables.md, "Filters"). A table larger than the
    memory budget (``max_bytes``, ``$UCMAGIC_LOAD_TABLE_MAX_BYTES``, default half the available
    memory) raises :class:`TableTooLargeError` pointing to ``export_parquet`` + ``ParquetDataset``.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative int, got {limit!r}")
    src = as_source(name_or_path, version=version, storage_options=storage_options)
    filter = src.with_filter(filter)  # noqa: A001 - or the one an entry point set on the source
    budget = memory_budget(max_bytes)
    if src.kind in ("spark", "spark_table"):
        df = spark_filter(spark_dataframe(src), filter)  # Spark filters in Spark
        if columns:
            df = df.select(*columns)
        if limit is not None:
            df = df.limit(limit)
        est = _spark_size_estimate(df)
        if est is not None and est > budget:
            _too_large(src, est, budget)
        return df.toPandas()
    est = estimate_memory(src, columns, limit)
    if est is not None and est > budget:
        _too_large(src, est, budget)
    for attempt in range(5):
        try:
            if src.kind in ("parquet", "delta"):  # pyarrow's own values, converted without loss
                import tempfile

                sources.sweep_spill_dirs(tempfile.gettempdir())  # as connect() does: a killed export's spill
                return _exact_pandas(_arrow_table(src, columns, limit, filter))
            con = connect()
            try:
                rel = duckdb_relation(con, src)
                sandbox_files(con, src)  # a filter= (or a column name) runs with file access off, as every other

                def reopen() -> tuple[Any, Any]:
                    other = connect()
                    out = duckdb_relation(other, src)
                    sandbox_files(other, src)
                    return out, other.close

                rel, close = filter_relation(con, rel, RowFilter.of(filter, rel.columns), reopen)
                try:
                    rel = select_columns(rel, columns, src.describe())
                    if limit is not None:
                        rel = rel.limit(limit)
                    return rel.df()
                finally:
                    close()
            finally:
                con.close()
        except Exception as e:
            # An export_parquet overwrite swapped the directory between listing and reading.
            if not (src.root and src.kind in ("parquet", "csv") and _vanished(e)):
                raise
            if attempt == 4:
                raise ListingChangedError(
                    f"the files under {src.root} kept changing while being read (concurrent overwrites?): try again"
                ) from e
            try:
                src = sources.resolve_again(src, e)
            except SourceNotFoundError:  # between the two renames of a non-atomic swap
                import time

                time.sleep(0.01 * (attempt + 1))
    raise AssertionError("unreachable")  # pragma: no cover


def _arrow_table(src: Source, columns: Sequence[str] | None, limit: int | None, spec: Any = None) -> Any:
    """The rows of a Parquet or Delta source as a pyarrow Table, in file order: the files' one schema
    (:func:`~ucmagic.tables.footers.unify_schemas`), Hive partitions as columns, a Delta snapshot's rows
    (deletion vectors applied), only ``columns``, only the rows the filter ``spec`` keeps (after the deletion
    vectors; row groups whose statistics prove no row matches are not read), at most ``limit`` rows."""
    import pyarrow as pa
    import pyarrow.dataset as pads

    cols = list(columns) if columns else None
    if src.kind == "delta":
        schema = sources.delta_snapshot(src).schema
    else:
        files, schema = source_footers(src)
    if cols:
        missing = [c for c in cols if c not in schema.names]
        if missing:
            raise ColumnNotFoundError(f"{src.describe()} has no column {missing[0]!r}; columns: "
                                      f"{', '.join(schema.names)}")
    rf = RowFilter.of(spec, schema.names, schema)
    read = None if cols is None else cols + [c for c in (rf.columns if rf else []) if c not in cols]
    if src.kind == "delta":
        data = arrow_dataset(src, read)
    else:
        data = arrow_dataset(src, schema=schema)
        if rf is None:  # a pyarrow dataset: projected and limited by its scanner
            return data.head(limit, columns=cols) if limit is not None else data.to_table(columns=cols)
        may = rf.files_may_match([prune_args(f.meta, f, None, schema) for f in files])
        frags = [fr.subset(row_group_ids=[j for j, m in enumerate(keep) if m])
                 for fr, keep in zip(data.get_fragments(), may) if any(keep)]
        data = pads.FileSystemDataset(frags, data.schema, data.format, data.filesystem).scanner(
            columns=read).to_reader()
    if rf is not None:
        data = filtered_reader(data, rf)
    batches, n = [], 0
    for batch in data:  # a RecordBatchReader of the snapshot's (or the filtered) rows
        if limit is not None and n + batch.num_rows >= limit:
            batches.append(batch.slice(0, limit - n))
            break
        batches.append(batch)
        n += batch.num_rows
    t = pa.Table.from_batches(batches, schema=data.schema)
    return t.select(cols) if cols and t.column_names != cols else t


def _exact_pandas(table: Any) -> Any:
    """A DataFrame that changes no value: integer and boolean columns with nulls nullable (``Int64``,
    ``boolean``), the rest as :func:`ucmagic.tables.columns.to_pandas` says."""
    from .columns import to_pandas

    return to_pandas(table, nullable=[c for c, col in zip(table.column_names, table.columns) if col.null_count])


def _vanished(e: BaseException) -> bool:
    return isinstance(e, FileNotFoundError) or "No such file" in str(e) or "No files found" in str(e)


def _spark_size_estimate(df: Any) -> int | None:
    try:  # classic Spark only; Spark Connect has no cheap size statistic
        return int(df._jdf.queryExecution().optimizedPlan().stats().sizeInBytes().longValue())  # noqa: SLF001
    except Exception:  # noqa: BLE001
        return None


def _too_large(src: Source, est: int, budget: int) -> None:
    what = src.describe()
    raise TableTooLargeError(
        f"{what} needs about {format_size(est)} in memory, over the load_table budget of {format_size(budget)}. "
        f"Load a part (columns=, limit=), raise max_bytes= (or $UCMAGIC_LOAD_TABLE_MAX_BYTES), or stream it: "
        f"export_parquet({what!r}, '/Volumes/<catalog>/<schema>/<volume>/<dir>') then "
        f"ParquetDataset('/Volumes/.../<dir>') with a DataLoader"
    )


# ---------------------------------------------------------------- register_table

REGISTER_MODES = ("error", "overwrite", "append")


def register_table(name: str, data: Any, *, format: str = "delta", mode: str = "error") -> str:  # noqa: A002
    """Create a table ``catalog.schema.table`` from ``data`` (pandas, pyarrow, or anything export_parquet reads).

    With an active Spark session: ``saveAsTable``. Without: a Delta table (``format="delta"``) or a
    directory of Parquet files (``"parquet"``) under ``$UCMAGIC_CATALOG_ROOT``. ``mode``:
    ``"error"`` (refuse an existing table), ``"overwrite"`` or ``"append"`` (Delta only).
    Returns the table's location (its path, or its name in Spark).
    """
    t = parse_table_name(name)
    if format not in ("delta", "parquet"):
        raise ValueError(f"format must be 'delta' or 'parquet', got {format!r}")
    if mode not in REGISTER_MODES:
        raise ValueError(f"mode must be one of {REGISTER_MODES}, got {mode!r}")
    spark = sources.active_spark()  # looked up on the module: one place to patch in tests
    if spark is not None:
        df = data if is_spark_dataframe(data) else spark.createDataFrame(_to_pandas(data))
        df.write.format(format).mode(mode).saveAsTable(t.quoted())
        return str(t)
    path = table_path(t)
    exists = os.path.isdir(path) and bool(os.listdir(path))
    if exists and mode == "error":
        raise FileExistsError(f"table {t} already exists at {path}: pass mode='overwrite' or 'append'")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if format == "parquet":
        if mode == "append":
            raise ValueError("mode='append' needs format='delta' (a Parquet directory is rewritten as a whole)")
        from .export import export_parquet

        export_parquet(data, path, mode="overwrite", target_file_size="256MB")
        return path
    write_deltalake = import_extra("deltalake", feature="writing a Delta table").write_deltalake

    if exists and not is_delta_dir(path):
        raise FileExistsError(f"{path} holds a non-Delta table: use format='parquet' or remove it")
    write_deltalake(path, _to_arrow(data), mode=mode)
    return path


def _to_arrow(data: Any) -> Any:
    import pyarrow as pa

    src = resolve_source(data)
    if src.kind == "pandas":
        return pa.Table.from_pandas(src.obj, preserve_index=False)
    if src.kind == "arrow":
        if isinstance(src.obj, pa.RecordBatch):
            return pa.Table.from_batches([src.obj])
        return src.obj.scanner().to_reader() if hasattr(src.obj, "scanner") else src.obj
    if src.kind == "spark":
        return src.obj.toArrow()
    con = connect()
    reader = duckdb_relation(con, src).fetch_arrow_reader(1 << 16)

    def batches() -> Any:  # keeps the connection alive while the writer streams
        try:
            yield from reader
        finally:
            con.close()

    return pa.RecordBatchReader.from_batches(reader.schema, batches())


def _to_pandas(data: Any) -> Any:
    src = resolve_source(data)
    if src.kind == "pandas":
        return src.obj
    t = _to_arrow(data)
    return t.to_pandas() if hasattr(t, "to_pandas") else t.read_all().to_pandas()


def sandbox_files(con: Any, src: Any) -> None:
    """Before a ``filter=`` runs on ``con`` over the files of ``src`` (a CSV or Parquet source DuckDB reads
    itself): DuckDB may read those files and nothing else (``enable_external_access=false``: the filter's SQL
    cannot read, write or attach other files, as a query's cannot; :func:`~ucmagic.tables.sources.restrict_sql`)."""
    if src.kind in ("csv", "parquet") and not src.remote and src.paths:
        sources.restrict_sql(con, list(src.paths))
