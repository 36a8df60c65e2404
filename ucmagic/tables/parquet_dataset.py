"""ParquetDataset: stream column batches of Parquet files into PyTorch.

Rows are split over ``world_size x num_workers`` streams as equal contiguous row ranges (slicing
row groups at the edges) with :mod:`ucmagic.files.plan`, so every rank gets the same number of rows, no
row is skipped or repeated (except wrap-around padding), and ``state_dict`` resumes exactly, on
any layout. Each stream reads only the requested columns of the row groups it needs, decoding
ahead on a thread; remote files (URLs of any registered volume backend, ``/Volumes`` FUSE mounts) go
through the local file cache first (whole files, or with ``filter=`` and for ``ds.rows`` the row groups read,
as byte ranges). A Delta table is read through its snapshot (:mod:`ucmagic.tables.delta`): row
groups count the rows its deletion vectors leave, and each row group is turned into the table's
rows (logical names, partition columns, the vector applied) as it is read.
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
from typing import Any, Iterator, Sequence, cast

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..files import plan
from .. import telemetry
from ..files.cache import FileCache
from ..files.cache_layout import cache_root
from ..files.locks import private_dir
from ..dist import dist_info
from ..files.epochs import EpochTracking
from ..files.planned import LoaderNeeds, StateSchema, stream_lengths
from ..errors import ColumnNotFoundError, UnsupportedSourceError
from ..files.fetch import read_ahead
from .columns import (check_exact, column_kind, mask_key, output_kind)
from .rows import EpochLayout, Segment
from .batching import BatchCutter
from .row_access import Rows
from .table_reader import AHEAD, FillAhead, TableReader, close_readers
from .footers import read_footers, source_footers
from .predicate import RowFilter
from .sources import Source, as_source, delta_snapshot, resolve_again
from .spark_source import spark_table_files
from .table_io import TableFiles

STATE_VERSION = 1
DEFAULT_SHUFFLE_BUFFER = 65536

__all__ = ["ParquetDataset"]


FORMATS = ("torch", "numpy", "arrow", "pandas")
PREFETCH = 4
"""Row-group windows decoded ahead per stream where reads come from this machine's disk or the cache (whole files
filled ahead of the decode, :class:`~ucmagic.tables.table_reader.FillAhead`): a warm 30 M-row scan (240 row groups),
6 interleaved rounds, took 0.90 s at 2 windows, 0.80 s at 4, 0.80-0.83 s at 6 and 8, pyarrow's scanner 0.72 s
(docs/benchmarks.md, session 27)."""
IN_PLACE_PREFETCH = 16
"""... where every read of a column chunk waits on a mount or remote storage (read in place: ``cache=False`` or a path
not cached by default; or a filter's byte ranges filled from such a volume): a 30 M-row table (30 files of 47 MB)
through a FUSE mount with 20 ms per open took 7.9 s at 2 windows, 4.3 s at 4, 3.0-3.3 s at 8 (session 26); with each
file opened once per stream, 3.0-3.2 s at 8, 2.2-2.4 s at 16, 2.3-2.6 s at 32, pyarrow's scanner on the same mount
1.7-1.9 s (3 interleaved rounds; docs/benchmarks.md, session 27)."""
PREFETCH_BYTES = 256 << 20
"""... and either way those windows hold at most this many decoded bytes (estimated from the footers' uncompressed
sizes; the first window always goes), so tables of big row groups do not hold several of them in memory."""



def _batch_len(batch: Any) -> int:
    """Rows in a batch of any ``format`` (a dict of columns, a pyarrow Table, a DataFrame)."""
    if isinstance(batch, dict):
        return len(next(iter(batch.values()))) if batch else 0
    return len(batch)


def pa_schema_of(schema: Any, columns: Sequence[str]) -> Any:
    import pyarrow as pa

    return pa.schema([schema.field(c) for c in columns])


class ParquetDataset(EpochTracking, IterableDataset[Any]):
    """An IterableDataset of column batches: ``{"col": tensor, "text_col": [str, ...]}``.

    Use it with ``DataLoader(ds, batch_size=None)`` (the dataset batches). Numeric, boolean and
    temporal (as int64: days for dates, the type's unit for times and timestamps, microseconds since the
    epoch for Delta timestamps) columns become tensors of a dtype fixed by their type, decimals of at
    most 15 digits float64 tensors; strings, binary and nested values (as Python lists/dicts) become
    lists. A column that may hold nulls comes with ``batch[name + "__valid"]`` (bool, True where a value
    is present; nulls read 0/False, NaN for floats): no value ever changes (docs/tables.md, "Column
    types"). Hive ``key=value/`` directories are columns. A Delta table yields the rows its snapshot
    defines: deletion vectors applied, logical column names, partition columns (see docs/tables.md).

    Args:
        path: a directory of Parquet files (recursive; ``_``/``.`` side files ignored), a file, a
            glob, a Delta table directory, a local-catalog table name, a ``/Volumes`` path or a URL (or a
            :class:`~ucmagic.tables.sources.Source` an entry point resolved: used as it is, its filter too).
        columns: columns to read (default all); only these are read from storage.
        batch_size: rows per batch; every stream's share is a multiple of it except one per rank.
        shuffle: ``False`` (files' order), ``"global"`` (per epoch, row groups are permuted and rows
            shuffled within a bounded buffer), ``"node"`` (each node, i.e. the ``LOCAL_WORLD_SIZE``
            ranks that share a machine, keeps the same slice of the rows every epoch and shuffles
            within it, windows never crossing the slice's edges, so its cached files stay hot) or
            ``True`` (``"node"`` on several nodes, ``"global"`` on one). The order of an epoch is
            identical on every rank and depends only on the seed, the epoch and (``"node"``) the
            world size and ``LOCAL_WORLD_SIZE`` that started the epoch.
        reshuffle_every: with node-affine shuffling, rotate the slices one node onward every N epochs.
        seed: shuffle seed (the order depends only on ``seed`` and the epoch).
        shuffle_buffer: rows held for the in-buffer shuffle (default 65536, or one row group if larger).
        partition: ``"pad"`` (ranks equal by wrap-around) or ``"drop"`` (drop the remainder).
        dtype: a torch dtype for every numeric column (e.g. ``torch.float32``), or a dict per column.
        version: Delta table version (time travel).
        format: ``"torch"`` (default: dicts of tensors and lists), ``"numpy"`` (dicts of numpy arrays:
            datetime64 for dates and timestamps, object arrays for strings and nested values),
            ``"arrow"`` (a ``pyarrow.Table`` per batch) or ``"pandas"`` (a DataFrame per batch).
        cache: copy files to the local cache before reading (default: for URLs and ``/Volumes`` mounts).
        cache_dir, cache_limit: the file cache (see :class:`ucmagic.files.cache.FileCache`).
        prefetch: row-group windows decoded ahead per stream (default: up to 4 where the files are read from this
            machine's disk or the cache, up to 16 where each read waits on a mount or remote storage, either way
            holding at most 256 MB).
        storage_options: for fsspec URLs.
        filter: only the rows a SQL predicate string (DuckDB's dialect, ``"label = 3"``) or a pyarrow compute
            expression keeps, after Delta deletion vectors; row groups the partition values and statistics rule
            out are never read, the others are read as byte ranges (docs/tables.md, "Filters").

    ``ds.rows`` gives random access by row (``ds.rows[i]``, ``ds.rows[i:j]``, ``len(ds.rows)``), a map-style
    dataset over the same (filtered) rows.
    """

    kind = "ParquetDataset"
    # "parquet": how states were marked before the kinds were unified (they always carried a kind)
    state_schema = StateSchema(kind, STATE_VERSION, "rows", legacy_kinds=("parquet",), kind_required=True)
    # it batches itself; decoding runs on its read-ahead thread, so worker processes only add a copy per batch
    loader_needs = LoaderNeeds(yields_batches=True, num_workers=0)

    def __init__(self, path: Any, *, columns: Sequence[str] | None = None, batch_size: int = 1024,
                 shuffle: bool | str = False, seed: int = 0, shuffle_buffer: int | None = None,
                 partition: str = "pad", dtype: Any = None, version: int | None = None,
                 cache: bool | None = None, cache_dir: str | None = None, cache_limit: int | str | None = None,
                 prefetch: int | None = None, timeout: float | None = 300.0,
                 storage_options: dict[str, Any] | None = None, reshuffle_every: int | None = None,
                 format: str = "torch", filter: Any = None) -> None:  # noqa: A002 - the options' documented names
        if format not in FORMATS:
            raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
        self.format = format
        if partition not in plan.PARTITION_MODES:
            raise ValueError(f"partition must be one of {plan.PARTITION_MODES}, got {partition!r}")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        if shuffle not in (False, True, "global", "node"):
            raise ValueError(f"shuffle must be False, True, 'global' or 'node', got {shuffle!r}")
        if reshuffle_every is not None and (not isinstance(reshuffle_every, int) or reshuffle_every < 0):
            raise ValueError(f"reshuffle_every must be a positive int or None, got {reshuffle_every!r}")
        given = path if isinstance(path, Source) else None  # resolved once by the entry (ucmagic.load)
        if given is not None and storage_options is None:
            storage_options = given.storage_options
        self.path = given.describe() if given is not None else os.fspath(path) if isinstance(path, os.PathLike) \
            else path
        self.batch_size = int(batch_size)
        self.shuffle: bool | str = shuffle if isinstance(shuffle, str) else bool(shuffle)
        self.reshuffle_every = int(reshuffle_every) if reshuffle_every else None
        self.seed = int(seed)
        self.partition = partition
        self.prefetch = None if prefetch is None else max(1, int(prefetch))
        self.timeout = timeout
        self.storage_options = storage_options
        self.lease_items = 1  # set by ucmagic.DataLoader; unused here
        src = given
        for attempt in range(5):
            try:
                if src is None:
                    src = as_source(self.path, version=version, storage_options=storage_options)
                if src.kind == "spark_table":  # a Spark catalog table: its files, through the session
                    src = spark_table_files(src, version)
                if src.kind not in ("delta", "parquet"):
                    raise UnsupportedSourceError(
                        f"ParquetDataset reads Parquet files or a Delta table, not a {src.kind} source "
                        f"({src.describe()}): write it with export_parquet(source, dest) and pass dest"
                    )
                self.snapshot = delta_snapshot(src) if src.kind == "delta" else None
                paths = [f.path for f in self.snapshot.files] if self.snapshot is not None else list(src.paths)
                self.remote = any("://" in p for p in paths)
                self.io = TableFiles(self.snapshot.root if self.snapshot is not None else src.root,
                                     storage_options)
                if self.snapshot is not None:
                    self.files, schema = read_footers(paths, self.snapshot, self.io, timeout=timeout,
                                                      what=str(self.path))
                else:  # the files' one schema (unify_schemas) and Hive partitions, read once per source
                    self.files, schema = source_footers(src, timeout=timeout)
                break
            except FileNotFoundError as e:  # an export_parquet overwrite swapped the directory meanwhile?
                if attempt == 4:
                    raise
                time.sleep(0.01 * (attempt + 1))
                src = None if given is None else resolve_again(given, e)
        src = cast(Source, src)  # the loop ended with a break: resolved
        self.use_cache = ((self.remote or any(p.startswith("/Volumes/") for p in paths)) if cache is None
                          else bool(cache))
        self.cache = FileCache(cache_dir, cache_limit) if self.use_cache else None
        self._cache_dir = cache_dir  # where workers of a loader other than ucmagic's count epochs (its locks/)
        names = list(schema.names)
        if columns is not None:
            columns = list(columns)
            bad = [c for c in columns if c not in names]
            if bad:
                raise ColumnNotFoundError(f"{src.describe()} has no column {bad[0]!r}; columns: {', '.join(names)}")
        self.columns = columns if columns is not None else names
        self.schema = schema
        self._kinds = {c: column_kind(schema.field(c).type) for c in self.columns}
        self._lists = {c for c in self.columns if output_kind(schema.field(c).type) == "list"}
        self._dtypes = self._resolve_dtypes(dtype)
        if self.format == "torch":  # decided once from the types: refused here, never a rounded batch later
            for c in self.columns:
                check_exact(c, schema.field(c).type, c in self._dtypes, src.describe())
                if output_kind(schema.field(c).type) == "decimal":
                    self._kinds[c] = "float64"  # dtype= asked for the rounding
        self.filter = RowFilter.of(src.with_filter(filter), names, schema)
        self.masked = self._mask_columns(names)
        self._mask_set = set(self.masked)
        # the keys of a torch/numpy batch: each column, followed by its mask when it has one
        self.out_keys = [k for c in self.columns for k in ((c, mask_key(c)) if c in self._mask_set else (c,))]
        self.reader = TableReader(self.files, self.io, self.cache, self.snapshot, schema, self.columns, self.format,
                                  self._kinds, self._mask_set, self._dtypes, self.filter, timeout)
        if self.filter is not None:
            self.reader.index()
        # the row groups the epochs plan over (with a filter: those that keep a row)
        self._group_file = [(i, j) for i, f in enumerate(self.files) for j, r in enumerate(f.group_rows)
                            if r or self.filter is None]
        self.reader.group_file = self._group_file
        self._per_row: list[float] | None = None  # decoded bytes per row of each planned row group (_bytes_per_row)
        self.group_rows = [self.files[i].group_rows[j] for i, j in self._group_file]
        self.num_rows = int(sum(self.group_rows))
        biggest = max(self.group_rows, default=0)
        self.shuffle_buffer = int(shuffle_buffer) if shuffle_buffer else max(DEFAULT_SHUFFLE_BUFFER, biggest)
        self.fingerprint = self._fingerprint()
        self._init_epochs()
        self._layouts: dict[tuple[Any, ...], EpochLayout] = {}

    # ------------------------------------------------------------ metadata

    def _mask_columns(self, names: list[str]) -> list[str]:
        """Columns that get a validity mask (``name + "__valid"``) in the torch and numpy formats: those whose
        values are tensors/arrays (not Python objects) and that may hold nulls in some file."""
        if self.format not in ("torch", "numpy"):
            return []
        may = set().union(*(f.nulls for f in self.files)) if self.files else set()
        objects = ("list",) if self.format == "torch" else ("list", "decimal")
        out = [c for c in self.columns if c in may and output_kind(self.schema.field(c).type) not in objects]
        clash = [c for c in out if mask_key(c) in names]
        if clash:
            raise ValueError(f"column {clash[0]!r} may hold nulls and its mask would be named {mask_key(clash[0])!r},"
                             " which is a column too: rename that column or leave it out with columns=")
        return out

    def _fingerprint(self) -> str:
        h = hashlib.sha256()
        if self.snapshot is not None:  # a DELETE that only adds a deletion vector is a new version
            h.update(f"delta\0{self.snapshot.root}\0{self.snapshot.version}\n".encode("utf-8", "surrogateescape"))
            for f in self.files:
                dv = f.delta.dv.unique_id if f.delta is not None and f.delta.dv is not None else ""
                h.update(f"{dv}\n".encode("utf-8", "surrogateescape"))
        for f in self.files:
            h.update(f"{f.path}\0{f.size}\0{','.join(map(str, f.group_rows))}\n".encode("utf-8", "surrogateescape"))
        if self.filter is not None:  # a state saved under one filter never resumes under another
            h.update(f"filter\0{self.filter.text}\n".encode("utf-8", "surrogateescape"))
        return h.hexdigest()[:16]

    def _resolve_dtypes(self, dtype: Any) -> dict[str, torch.dtype]:
        if dtype is None:
            return {}
        if isinstance(dtype, dict):
            bad = [c for c in dtype if c not in self.columns]
            if bad:
                raise KeyError(f"dtype names column {bad[0]!r}, which is not read; columns: {', '.join(self.columns)}")
            return dict(dtype)
        return {c: dtype for c in self.columns if c not in self._lists}

    # ------------------------------------------------------------ basics

    def __len__(self) -> int:
        """Batches this rank yields in a whole epoch: the same after a resume (which yields fewer), as
        torchdata's StatefulDataLoader keeps ``len()``."""
        return -(-plan.per_rank(self.num_rows, dist_info().world, self.partition) // self.batch_size)

    def __repr__(self) -> str:
        return (f"ParquetDataset({self.path!r}, files={len(self.files)}, rows={self.num_rows}, "
                f"columns={self.columns}, batch_size={self.batch_size}, shuffle={self.shuffle!r})")

    def __getstate__(self) -> dict[str, Any]:
        if self._per_row is None and all(f.meta is not None for f in self.files):
            self._bytes_per_row()  # footers are not pickled: workers get the estimate, not an open per file for it
        st = self.__dict__.copy()
        st["_layouts"] = {}
        return st

    @property
    def batch_quantum(self) -> int:
        """Rows per stream come in multiples of this (the dataset's own batch size)."""
        return self.batch_size

    @batch_quantum.setter
    def batch_quantum(self, value: int) -> None:  # a DataLoader with batch_size=None sets 1: ignored
        pass

    # ------------------------------------------------------------ plan

    def layout(self, epoch: int, world: int | None = None) -> EpochLayout:
        """The row order of ``epoch`` for a run on ``world`` ranks (default: this process's)."""
        mode, ow, olws = self._order_params(epoch, world)
        key = (epoch, mode, ow, olws, self.reshuffle_every)
        lay = self._layouts.get(key)
        if lay is None:
            r = self._active_resume(epoch)
            part = r["partition"] if r is not None else self.partition
            blocks = plan.node_blocks(self.num_rows, ow, olws, part) if mode == "node" else None
            lay = EpochLayout(self.group_rows, shuffle=mode, seed=self.seed, epoch=epoch,
                              buffer_rows=self.shuffle_buffer, blocks=blocks, reshuffle_every=self.reshuffle_every)
            self._layouts = {key: lay}
        return lay

    def epoch_items(self, epoch: int) -> int:
        """Items of a whole ``epoch`` (a resume's rest aside): what ``len()`` and the loader's length count."""
        return self.num_rows

    def epoch_plan(self, epoch: int) -> tuple[list[plan.Range], None]:
        return self._resumed_pool(epoch, self.num_rows), None

    def stream_ranges(self, epoch: int, rank: int, world: int, worker: int, num_workers: int) -> list[plan.Range]:
        """Epoch positions (ranges) that stream (rank, worker) delivers, in order (the rest of its own, after a
        stream's state)."""
        return self._stream_ranges(epoch, rank, world, worker, num_workers)

    def stream_lengths(self, world: int, num_workers: int, epoch: int | None = None) -> list[int]:
        """Rows of every stream (rank-major) this epoch; for loaders that turn batches into rows."""
        return stream_lengths(self, self.epoch if epoch is None else epoch, world, num_workers)

    # ------------------------------------------------------------ reading

    @property
    def rows(self) -> Rows:
        """Random access by row: ``ds.rows[i]`` (a row), ``ds.rows[i:j]`` (a batch in this dataset's ``format``),
        ``len(ds.rows)`` (rows; with ``filter=``, those it keeps). A map-style dataset for torch samplers and
        ``ucmagic.DataLoader`` (see :mod:`ucmagic.tables.row_access`)."""
        got = self.__dict__.get("_rows")
        if got is None:
            got = self.__dict__["_rows"] = Rows(self.reader, self.group_rows, self.cutter(), self.fingerprint)
        return got

    def cutter(self) -> BatchCutter:
        """How decoded pieces become this dataset's batches."""
        return BatchCutter(self.format, self.batch_size, self.columns, self.out_keys, self._lists, self._mask_set)

    def iter_stream(self, epoch: int, rank: int = 0, world: int = 1, worker: int = 0,
                    num_workers: int = 1) -> Iterator[dict[str, Any]]:
        """Batches of one (rank, worker) stream of ``epoch`` (what ``__iter__`` runs in each process)."""
        lay = self.layout(epoch, world)
        segs = lay.segments(self.stream_ranges(epoch, rank, world, worker, num_workers))
        readers: dict[Any, Any] = {}
        if self.cache is not None and self.filter is None:  # whole-file fills: the next files fill ahead
            order = [self._group_file[g][0] for s in segs for g, _, _ in lay.window_pieces(s.window)]
            readers[AHEAD] = FillAhead(self.reader, list(dict.fromkeys(order)))
        lock = threading.Lock()
        own = get_worker_info() is not None  # worker batches cross processes: no views of big buffers
        cur: list[Any] = [0, 0.0]  # per-item records: row group and read seconds of the piece a batch ends in

        def load(s: Segment) -> tuple[dict[str, Any], int]:
            t0 = time.perf_counter()
            out = self.reader.load(lay, s, readers, lock)
            return out, lay.window_pieces(s.window)[0][0], time.perf_counter() - t0  # type: ignore[return-value]

        def unpack(timed: Iterator[Any]) -> Iterator[tuple[dict[str, Any], int]]:
            for out, cur[0], cur[1] in timed:
                yield out
        depth, cost, max_bytes = self.prefetch, None, None
        if depth is None:  # the default: a few windows ahead (more where each read waits), bounded in bytes
            per_row = self._bytes_per_row()

            def segment_bytes(s: Segment) -> int:  # decoded bytes of the segment's share of its window
                window = sum(per_row[g] * (hi - lo) for g, lo, hi in lay.window_pieces(s.window))
                return int(window * (s.hi - s.lo) / max(1, lay.window_len(s.window)))
            depth = IN_PLACE_PREFETCH if self.reader.reads_wait() else PREFETCH
            cost, max_bytes = segment_bytes, PREFETCH_BYTES
        try:
            pieces = read_ahead(load, segs, depth=depth, cost=cost, max_bytes=max_bytes,
                                timeout=self.timeout, describe=lambda s: f"row-group window {s.window}")
            for batch in self.cutter().batches(unpack(pieces), own):
                nbytes = (sum(v.nbytes for v in batch.values() if isinstance(v, (torch.Tensor, np.ndarray)))
                          if isinstance(batch, dict) else int(getattr(batch, "nbytes", 0) or 0))
                telemetry.record_item(cur[0], True, cur[1], nbytes)
                yield batch
        finally:
            close_readers(readers)

    def _bytes_per_row(self) -> list[float]:
        """Decoded bytes per row of each planned row group (its footer's uncompressed size over its rows: an estimate,
        all columns before projection), kept once known."""
        if self._per_row is None:
            out = []
            for fi, j in self._group_file:
                rg = self.reader.meta(fi).row_group(j)
                out.append(rg.total_byte_size / max(1, rg.num_rows))
            self._per_row = out
        return self._per_row

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return telemetry.fetch_timed(self._iterate(self._iteration_ticket()))  # timed when a user's wrapper iterates it

    def _iterate(self, ticket: int) -> Iterator[dict[str, Any]]:
        self._check_consumer()  # Accelerate splitting again or skipping twice, a stateless wrapper resumed
        if get_worker_info() is None:
            epoch = self.begin_epoch(ticket=ticket)
        else:
            epoch = self._worker_epoch(self._epoch_lock(), ticket)
        progress = self._open_progress(epoch)
        rank, world, _, _, worker, nworkers = dist_info()
        for batch in self.iter_stream(epoch, rank, world, worker, nworkers):
            progress.count += _batch_len(batch)
            yield batch
        progress.ended = True

    def _epoch_lock(self) -> str:
        """Where DataLoader workers count epochs up: the cache directory's locks (made on first use when the files
        are read in place)."""
        if self.cache is not None:
            folder = os.path.join(self.cache.root, "locks")
        else:
            folder = private_dir(os.path.join(cache_root(self._cache_dir), "locks"), what="lock folder")
        return os.path.join(folder, f"epoch-{self._epoch_id}.lock")

    def describe_item(self, group: int) -> tuple[str, int]:
        """``(file#row group, approximate bytes)`` of row group ``group`` (for fetch records)."""
        fi, j = self._group_file[group]
        f = self.files[fi]
        return f"{f.path}#rg{j}", int(f.size * f.group_rows[j] / max(1, sum(f.group_rows)))

    # ------------------------------------------------------------ resume

    def make_state(self, epoch: int, delivered: Sequence[int], *, world: int, num_workers: int) -> dict[str, Any]:
        """Resume state after stream ``s`` (rank-major) delivered ``delivered[s]`` rows of ``epoch``."""
        return self._planned_state(epoch, self.epoch_plan(epoch)[0], delivered, world=world, num_workers=num_workers,
                                   fingerprint=self.fingerprint, count=self.num_rows, shuffle_option=self.shuffle,
                                   shuffle_buffer=self.shuffle_buffer)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration delivers exactly the rows not yet delivered in the saved epoch
        (any world size, number of workers or batch size). Raises ListingChangedError if the files changed."""
        self.state_schema.check(state, fingerprint=self.fingerprint, count=self.num_rows,
                                what=f"the Parquet files of {self.path!r}")
        self.shuffle = state.get("shuffle_option", bool(state["shuffle"]))  # later epochs; this one: state's order
        self.shuffle_buffer = int(state["shuffle_buffer"])
        self._layouts = {}
        self._resume_from(state)
