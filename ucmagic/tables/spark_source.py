"""Spark catalog tables and DataFrames as sources: a ``spark_table`` source's DataFrame (load_table and exports
run through Spark) and its files, resolved through the active session (ParquetDataset reads them in place)."""
from __future__ import annotations

from typing import Any

from .._util import error_line
from ..errors import TableNotFoundError, UnsupportedSourceError
from . import sources
from .sources import Source, resolve_path_source

__all__ = ["spark_dataframe", "spark_table_files", "DELTA_SPARK_HINT"]


def spark_dataframe(src: Source) -> Any:
    """The Spark DataFrame of a ``spark`` or ``spark_table`` source."""
    if src.kind == "spark":
        return src.obj
    spark = sources.active_spark()  # looked up on the module: one place to patch in tests
    if spark is None:
        raise TableNotFoundError(f"table {src.name} needs an active Spark session, and there is none: "
                                 "start one (SparkSession.builder.getOrCreate()) or pass a table path")
    try:
        return spark.read.table(src.obj.quoted())
    except Exception as e:
        if "TABLE_OR_VIEW_NOT_FOUND" in str(e) or "not found" in str(e).lower():
            raise TableNotFoundError(f"table {src.name} not found through the active Spark session: {e}") from None
        raise


DELTA_SPARK_HINT = ("Delta tables in a Spark catalog need the delta-spark package's jars (io.delta:delta-spark) in "
                    "the session, which this machine cannot fetch")


def spark_table_files(src: Source, version: int | None = None) -> Source:
    """The files of a ``spark_table`` source, resolved through the active session (``DESCRIBE TABLE EXTENDED``:
    its provider and location): a Parquet table's directory, or a Delta table's directory read by ucmagic's
    Delta reader. Other providers (and views) raise :class:`UnsupportedSourceError` naming the fix."""
    spark = sources.active_spark()  # looked up on the module: one place to patch in tests
    if spark is None:
        raise TableNotFoundError(f"table {src.name} needs an active Spark session, and there is none: "
                                 "start one (SparkSession.builder.getOrCreate()) or pass a table path")
    try:
        rows = spark.sql(f"DESCRIBE TABLE EXTENDED {src.obj.quoted()}").collect()
    except Exception as e:
        text = str(e)
        if "delta" in text.lower():
            raise UnsupportedSourceError(f"table {src.name}: {DELTA_SPARK_HINT} ({error_line(e)}); pass the "
                                         "table's directory to read it with ucmagic's Delta reader") from None
        if "TABLE_OR_VIEW_NOT_FOUND" in text or "not found" in text.lower():
            raise TableNotFoundError(f"table {src.name} not found through the active Spark session: "
                                     f"{error_line(e)}") from None
        raise
    info = {str(r[0]).strip().lower(): str(r[1] or "").strip() for r in rows if r[0]}
    provider, location = info.get("provider", "").lower(), info.get("location", "")
    if provider not in ("parquet", "delta") or not location:
        raise UnsupportedSourceError(
            f"table {src.name} is a {provider or info.get('type', 'view').lower()} table"
            f"{'' if location else ' without a location'}: ParquetDataset reads Parquet and Delta tables' files. "
            "Write it with export_parquet(name, dest) (Spark writes) and pass dest")
    path = location[len("file:"):] if location.startswith("file:") and not location.startswith("file://") else location
    if path.startswith("file://"):
        path = path[len("file://"):]
    got = resolve_path_source(path, version=version)
    if provider == "delta" and got.kind != "delta":
        raise UnsupportedSourceError(f"table {src.name}: Spark says Delta at {path}, but there is no _delta_log "
                                     "there; " + DELTA_SPARK_HINT)
    got.name = src.name
    return got
