"""ucmagic: training data from slow network volumes into PyTorch, fast.

``import ucmagic`` is light: torch and the engines load when a name that needs them is first used.
In IPython, ``%load_ext ucmagic`` adds the ``%ucload``, ``%ucstage`` and ``%ucckpt`` magics.

Layout: the engine is ``files`` (volume -> listing -> cache -> fetch -> plan -> dataset) and
``loading`` (the DataLoader, its stats and MLflow logging), over the shared top-level helpers
(errors, units, telemetry, dist); ``checkpoints``, ``tables`` (and Parquet), ``shards``, ``notebook``
and ``testing`` (the slow-volume simulator) are subpackages on top; see docs/architecture.md.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# public name -> module that defines it
_EXPORTS = {
    "UCVolumeDataset": "files.dataset",
    "SourceFile": "files.dataset",
    "DataLoader": "loading.loader",
    "LoaderStats": "loading.loader_stats",
    "ParquetDataset": "tables",
    "export_parquet": "tables",
    "load_table": "tables",
    "register_table": "tables",
    "stage": "staging",
    "StageResult": "staging",
    "pack": "shards.pack",
    "PackSummary": "shards.pack",
    "UCVolumeWriter": "checkpoints",
    "UCVolumeReader": "checkpoints",
    "save_checkpoint": "checkpoints",
    "load_checkpoint": "checkpoints",
    "list_checkpoints": "checkpoints",
    "distributed": "launch",
    "FileCache": "files.cache",
    "parse_size": "units",
    "format_size": "units",
    "UCMagicError": "errors",
    "SourceNotFoundError": "errors",
    "SourceNotADirectoryError": "errors",
    "MissingExtraError": "errors",
    "EmptyListingError": "errors",
    "SizeParseError": "errors",
    "FetchError": "errors",
    "FetchTimeoutError": "errors",
    "SourceChangedError": "errors",
    "CacheFullError": "errors",
    "BudgetTooSmallError": "errors",
    "CacheFullFetchError": "errors",
    "CacheDirError": "errors",
    "UnreadableDirectoryError": "errors",
    "InvalidArgumentError": "errors",
    "FilterError": "errors",
    "SchemaMismatchError": "errors",
    "ListingChangedError": "errors",
    "ResumeOrderError": "errors",
    "ResumeLayoutError": "errors",
    "ResumeRecipeError": "errors",
    "SplitTwiceError": "errors",
    "UnsafeCacheError": "errors",
    "UnsafeDirectoryError": "errors",
    "UnsafeSourceError": "errors",
    "SQLFileAccessError": "errors",
    "NotAnEntryError": "errors",
    "local_path": "files.volume",
    "Volume": "files.volume",
    "register_volume": "files.volume",
    "unregister_volume": "files.volume",
    "TorchVersionError": "errors",
    "CheckpointError": "errors",
    "CheckpointNotCommittedError": "errors",
    "CheckpointInProgressError": "errors",
    "CheckpointExistsError": "errors",
    "NoCheckpointError": "errors",
    "CheckpointCorruptError": "errors",
    "CheckpointUploadError": "errors",
    "CheckpointDestinationError": "errors",
    "CheckpointOverwrittenError": "errors",
    "CheckpointAbandonedError": "errors",
    "CheckpointSupersededError": "errors",
    "CheckpointMismatchError": "errors",
    "UnsafeCheckpointError": "errors",
    "CheckpointPathError": "errors",
    "CheckpointCredentialsError": "errors",
    "InvalidTableNameError": "errors",
    "TableNotFoundError": "errors",
    "UnsupportedSourceError": "errors",
    "TableTooLargeError": "errors",
    "UnsupportedTableFeatureError": "errors",
    "LossyColumnError": "errors",
    "ColumnNotFoundError": "errors",
    "ExportOverlapError": "errors",
    "StagingError": "errors",
    "PackError": "errors",
    "DistributedRunError": "errors",
    "DistributedTimeoutError": "errors",
    "MagicUsageError": "errors",
    "LoadUsageError": "errors",
    "describe_load": "api",
    "load": "api",
    "TarShards": "shards.webdataset",
    "TokenWindows": "shards.tokens",
    "SampleStream": "shards.samples",
    "mix": "shards.mix",
    "ShardFormatError": "errors",
    "files_from_table": "tables.volume_table",
    "TableFilesDataset": "tables.volume_table",
    "DuplicatePathError": "errors",
    "StatsFileError": "errors",
}

__all__ = sorted(_EXPORTS)


# Not ``_util.lazy_exports`` (which the subpackages use): ``import ucmagic`` loads no ucmagic module
# at all (tests/test_layout.py), so the top level keeps its own four lines.
def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'ucmagic' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext ucmagic``: register the magics."""
    from .notebook.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext ucmagic``: remove the magics."""
    from .notebook.magics import unload_ipython_extension as unload

    unload(ipython)
