"""Exception types raised by ucmagic. Each message names what failed and how to fix it."""
from __future__ import annotations

from typing import Any


class UCMagicError(Exception):
    """Base class for every error ucmagic raises on purpose."""


class SourceNotFoundError(UCMagicError, FileNotFoundError):
    """A dataset/stage/checkpoint source path does not exist."""


class SourceNotADirectoryError(UCMagicError, NotADirectoryError):
    """A file was given where a directory is expected."""


class MissingExtraError(UCMagicError, ModuleNotFoundError):
    """An optional dependency is not installed; the message names the ``pip install`` that adds it."""


class EmptyListingError(UCMagicError, ValueError):
    """A listing (with its pattern) matched no file."""


class SizeParseError(UCMagicError, ValueError):
    """A size string such as "50GB" could not be parsed."""


class FetchError(UCMagicError, OSError):
    """A file could not be copied from the volume after all retries."""


class SourceChangedError(FetchError):
    """A source file changed (size or mtime) while it was being copied; the copy was discarded."""


class FetchTimeoutError(FetchError, TimeoutError):
    """A single file took longer than the per-file timeout."""


class CacheFullError(UCMagicError, OSError):
    """The cache disk has no room left and nothing can be evicted."""


class CacheFullFetchError(FetchError, CacheFullError):
    """A file could not be cached for lack of room (larger than ``cache_limit``, or the cache disk is
    full): catchable as :class:`CacheFullError` and as :class:`FetchError`; never retried or skipped."""


class BudgetTooSmallError(CacheFullError):
    """``cache_limit`` cannot hold what one loop needs at once (a file, or a batch per stream); the
    message names the size it needs. Raised at the first item, before anything waits."""


class CacheDirError(UCMagicError, OSError):
    """The cache directory cannot be used (a file, read-only, no permission); set ``cache_dir=``."""


class UnreadableDirectoryError(UCMagicError, PermissionError):
    """A directory under a dataset's path cannot be read while listing (``on_error="skip"`` skips it)."""


class InvalidArgumentError(UCMagicError, ValueError, TypeError):
    """An argument has the wrong type or value; the message names the argument and what it accepts."""


class ListingChangedError(UCMagicError, ValueError):
    """A saved resume state does not match the dataset's current listing."""


class ResumeOrderError(UCMagicError, ValueError):
    """A saved resume state follows an epoch order this version of ucmagic does not produce."""


class ResumeLayoutError(UCMagicError, ValueError):
    """A resume state of a user's own ``IterableDataset`` (or map-style dataset on another world size)
    loaded on a layout (``num_workers``, world size) it cannot be resumed on exactly."""


class ResumeRecipeError(UCMagicError, RuntimeError):
    """A trainer's resume recipe that cannot resume this data exactly, refused at the first batch: HF Accelerate's
    ``skip_first_batches`` over a ucmagic dataset whose loaded state already skips (or whose epoch is unknown),
    torchdata's ``StatefulDataLoader`` over a wrapper without ``state_dict``/``load_state_dict``. The message names
    the recipe that is exact."""


class SplitTwiceError(UCMagicError, RuntimeError):
    """A trainer (HF Accelerate's ``prepare``, HF ``Trainer``'s own loader) splits over the ranks a
    ucmagic dataset that already reads only its rank's share: most of each epoch would be lost."""


class UnsafeCacheError(UCMagicError, PermissionError):
    """The cache directory is not private to the current user."""


class UnsafeDirectoryError(UnsafeCacheError):
    """A folder or file ucmagic keeps its own files in (cache, checkpoint staging, DuckDB spill, lock
    files) or writes into (a stage, pack or export destination) is a symbolic link, belongs to another
    user or is writable by others."""


class UnsafeSourceError(UCMagicError, PermissionError):
    """A source points outside its own root: a symlink in a file tree (``follow_symlinks="inside"``),
    a Delta log's absolute or ``..`` path."""


class SQLFileAccessError(UCMagicError, PermissionError):
    """A SQL query touched a file outside the folders user SQL may use (the local catalog, this process's
    exports, ``$UCMAGIC_SQL_FILES``); the message names the setting that allows it."""


class NotAnEntryError(UCMagicError, ValueError):
    """A path given to ``source_of`` is not a cached file of that dataset."""


class TorchVersionError(UCMagicError, RuntimeError):
    """The installed torch lacks a feature ucmagic needs; the message names the version that has it."""


# ---------------------------------------------------------------- checkpoints

class CheckpointError(UCMagicError):
    """A checkpoint could not be written or read."""


class CheckpointNotCommittedError(CheckpointError, FileNotFoundError):
    """The checkpoint directory has no valid commit marker (save unfinished, killed or overwritten)."""


class CheckpointInProgressError(CheckpointNotCommittedError):
    """A save into the checkpoint directory has started and not committed (or was killed)."""


class CheckpointExistsError(CheckpointError, RuntimeError):
    """``overwrite=False`` and the directory already holds a checkpoint (torch's "Checkpoint already exists")."""


class NoCheckpointError(CheckpointError, FileNotFoundError):
    """The checkpoint root holds no committed checkpoint."""


class CheckpointCorruptError(CheckpointError, OSError):
    """A checkpoint file's size or checksum differs from its manifest."""


class CheckpointUploadError(CheckpointError, OSError):
    """A staged checkpoint file could not be copied to the volume."""


class CheckpointDestinationError(CheckpointUploadError):
    """The checkpoint destination cannot be written: read-only, not a directory, no permission, or full."""


class CheckpointOverwrittenError(CheckpointInProgressError):
    """A new save into the checkpoint directory started while the checkpoint was being loaded."""


class CheckpointAbandonedError(CheckpointInProgressError):
    """A save into the checkpoint directory was killed: the process that owns its record is gone."""


class CheckpointSupersededError(CheckpointError):
    """A newer save into the same checkpoint directory started before this one committed; this one did not commit."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint's keys do not match the model or optimizer it is loaded into."""


class UnsafeCheckpointError(CheckpointError, PermissionError):
    """The checkpoint holds a pickled object that a weights-only load refuses."""


class CheckpointPathError(CheckpointCorruptError, UnsafeSourceError):
    """A checkpoint's own files name a path outside the checkpoint folder (a ``.metadata`` storage entry with
    ``..`` or an absolute path, a manifest name, a file that is a link out of the folder): refused before
    anything is read or written."""


class CheckpointCredentialsError(CheckpointError, PermissionError):
    """A checkpoint root on a store (``s3://...``) needs credentials that were not found."""


# ---------------------------------------------------------------- tables and sources

class InvalidTableNameError(UCMagicError, ValueError):
    """A string that should be ``catalog.schema.table`` is not."""


class TableNotFoundError(SourceNotFoundError):
    """A well-formed table name that the catalog does not hold."""


class UnsupportedSourceError(UCMagicError, TypeError):
    """An object that no reader or exporter understands."""


class TableTooLargeError(UCMagicError, MemoryError):
    """``load_table`` would need more memory than its budget."""


class UnsupportedTableFeatureError(UCMagicError, NotImplementedError):
    """A Delta table needs a reader feature ucmagic cannot honour (rather than return different rows)."""


class LossyColumnError(UCMagicError, TypeError):
    """A column's type has no exact tensor form (a decimal of more than 15 digits): pass ``dtype=`` to accept
    the rounding, or read it with ``format="numpy"``/``"arrow"``/``"pandas"``."""


class ColumnNotFoundError(InvalidArgumentError, KeyError):
    """``columns=``, ``filter=`` or a column argument names a column the table lacks; the message lists the
    table's columns. (Also a ``KeyError``, what these raised before.)"""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0]) if self.args else ""


class FilterError(InvalidArgumentError):
    """A SQL ``filter=`` that DuckDB, its evaluator, refuses over this table (types it cannot compare, a literal
    it cannot convert, a column type it cannot read) or fails to evaluate; the message names the filter."""


class SchemaMismatchError(InvalidArgumentError):
    """The files of a table have a column whose types no promotion unifies (``int64`` in one file, ``string``
    in another); the message names the column and the files."""


class ExportOverlapError(UCMagicError, ValueError):
    """``export_parquet``'s destination is inside its source (or the source inside the destination): the
    export would read its own output."""


# ---------------------------------------------------------------- staging, launch, magics

class StagingError(UCMagicError, ValueError):
    """Bad staging arguments (destination inside the source, unknown verify mode...)."""


class PackError(UCMagicError, ValueError):
    """Bad ``pack`` input: no samples, a destination inside the source or not empty, a bad shard size..."""


class ShardFormatError(UCMagicError, ValueError):
    """A shard, token file or shard index is not in a format the shard datasets read (a compressed tar...)."""


class DistributedRunError(UCMagicError, RuntimeError):
    """A rank failed in a way that cannot be re-raised as its own exception (it died, or its error
    could not be pickled)."""


class DistributedTimeoutError(UCMagicError, TimeoutError):
    """A ``@distributed`` run took longer than its ``timeout``."""


class LoadUsageError(UCMagicError, ValueError):
    """``ucmagic.load`` got an option that does not apply to its source (``rows=`` for a directory of files...)."""


class MagicUsageError(UCMagicError, ValueError):
    """A magic was used wrongly (raised instead of IPython's UsageError when ``UCMAGIC_RAISE=1``)."""


class DuplicatePathError(UCMagicError, ValueError):
    """Several rows of a table given to ``files_from_table`` name the same file (one row per file)."""


class StatsFileError(UCMagicError, ValueError):
    """A file given to ``LoaderStats.load`` (or ``python -m ucmagic advise``) is not what ``loader.stats.save()``
    writes; the message names the file and what was expected."""


EXTRAS = {"matplotlib": "notebook", "ipywidgets": "notebook", "IPython": "notebook", "mlflow": "mlflow",
          "s3fs": "s3", "deltalake": "delta", "pyspark": "spark", "mfusepy": "fuse"}


def import_extra(module: str, extra: str | None = None, *, feature: str = "this") -> Any:
    """Import an optional dependency, or raise :class:`MissingExtraError` saying which extra installs it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        top = module.split(".")[0]
        if exc.name is not None and exc.name.split(".")[0] != top:
            raise  # the package is there but something it needs is not: the original error says what
        name = extra or EXTRAS.get(top, top)
        raise MissingExtraError(f"{feature} needs {top}, which is not installed: pip install \"ucmagic[{name}]\"",
                                name=top) from exc
