"""Tables and Parquet: ``load_table`` / ``register_table``, ``export_parquet`` (write any table as
Parquet files, atomically) and ``ParquetDataset`` (stream column batches into PyTorch).

Modules: :mod:`.sources` (table names, the local catalog, resolving any source, DuckDB/Spark
relations, "files or table?"), :mod:`.api` (``load_table``, ``register_table``), :mod:`.export`
(``export_parquet``), :mod:`.parquet_dataset` (``ParquetDataset``), :mod:`.volume_table`
(``files_from_table``: labels from a table, files from a volume), :mod:`.rows` (pure row
planning) and :mod:`.columns` (each Arrow type's output, lossless). The names below load on first
use: ``import ucmagic.tables`` imports no torch.
"""
from __future__ import annotations

from .._util import lazy_exports

# public name -> submodule that defines (or re-exports) it
_EXPORTS = {
    "load_table": "api",
    "register_table": "api",
    "memory_budget": "api",
    "estimate_memory": "api",
    "DEFAULT_BUDGET_FRACTION": "api",
    "REGISTER_MODES": "api",
    "export_parquet": "export",
    "ExportResult": "export",
    "recover_destination": "export",
    "ParquetDataset": "parquet_dataset",
    "files_from_table": "volume_table",
    "TableFilesDataset": "volume_table",
    # the source names (``ucmagic.tables.resolve_source`` ... worked before sources.py was split out)
    **{name: "sources" for name in (
        "DATA_EXTS", "MANIFEST", "Source", "TableName", "active_spark", "arrow_dataset", "as_source", "catalog_root",
        "classify_source", "connect", "delta_files", "delta_snapshot", "duckdb_relation", "fsspec_strip",
        "is_delta_dir", "is_sql",
        "is_spark_dataframe", "list_tables", "looks_like_table_name", "parse_table_name", "read_manifest",
        "resolve_path_source", "resolve_source", "select_columns", "table_path")},
    "spark_dataframe": "spark_source",
    # the errors of this layer (all defined in ucmagic.errors)
    **{name: "api" for name in (
        "InvalidTableNameError", "ListingChangedError", "SourceNotFoundError", "TableNotFoundError",
        "TableTooLargeError", "UnsupportedSourceError", "UnsupportedTableFeatureError")},
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())  # PEP 562: loaded on first use
