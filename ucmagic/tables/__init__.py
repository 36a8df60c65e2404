"""Tables and Parquet: ``load_table`` / ``register_table``, ``export_parquet`` (write any table as
Parquet files, atomically) and ``ParquetDataset`` (stream column batches into PyTorch).

Modules: :mod:`.sources` (table names, the local catalog, resolving any source, DuckDB/Spark
relations, "files or table?"), :mod:`.api` (``load_table``, ``register_table``), :mod:`.export`
(``export_parquet``), :mod:`.parquet_dataset` (``ParquetDataset``) and :mod:`.rows` (pure row
planning). The names below load on first use: ``import ucmagic.tables`` imports no torch.
"""
from __future__ import annotations

import importlib
from typing import Any

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
    "ParquetDataset": "parquet_dataset",
    # the source names (``ucmagic.tables.resolve_source`` ... worked before sources.py was split out)
    **{name: "sources" for name in (
        "DATA_EXTS", "MANIFEST", "Source", "TableName", "active_spark", "arrow_dataset", "catalog_root",
        "classify_source", "connect", "delta_files", "duckdb_relation", "fsspec_strip", "is_delta_dir", "is_sql",
        "is_spark_dataframe", "list_tables", "looks_like_table_name", "parse_table_name", "read_manifest",
        "resolve_path_source", "resolve_source", "select_columns", "spark_dataframe", "table_path")},
    # the errors of this layer (all defined in ucmagic.errors)
    **{name: "api" for name in (
        "InvalidTableNameError", "ListingChangedError", "SourceNotFoundError", "TableNotFoundError",
        "TableTooLargeError", "UnsupportedSourceError")},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
