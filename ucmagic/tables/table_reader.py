"""Reading a ParquetDataset's row groups: opening files (a cached whole copy, the file itself through its
volume, or row groups filled as byte ranges), the filter's row index, and decoding a segment of rows into
tensors or Arrow arrays.

Call order of :class:`TableReader`: the dataset builds it once its files, schema and output types are known;
``index()`` once when a filter is set; then, per stream (one ``readers`` dict and lock each, closed with
:func:`close_readers`), ``load(layout, segment, readers, lock)`` for each segment, from the read-ahead's
threads. It pickles without its filler (a worker builds its own).
"""
from __future__ import annotations

import contextlib
import os
import threading
from typing import Any

import numpy as np
import torch

from ..errors import ListingChangedError
from ..files.cache import FileCache
from ..files.cache_layout import cache_key
from ..files.fetch import read_ahead, shared_pool
from ..files.filler import CacheFiller
from ..files.locks import private_dir
from ..files.volume import FileEntry
from .columns import column_kind, decimal_float64, mask_key, numeric_numpy, temporal_int64
from .deletion_vectors import filter_rows, live_span
from .footers import TableFile
from .group_reader import (RangeFile, dropped_rows, group_span, index_file, index_key, load_index, prune_args,
                           read_columns, save_index, stored_starts)
from .owned import native_work
from .predicate import RowFilter, pruning_on
from .rows import EpochLayout, Segment
from .table_io import TableFiles

__all__ = ["TableReader", "FillAhead", "close_readers", "AHEAD"]

AHEAD = (0, "ahead")
"""The key of a stream's :class:`FillAhead` in its ``readers`` dict."""
SHARED, OPENING = 1, 2
"""``readers[(SHARED, fi)]``: the native file of file ``fi`` that every thread of a stream reads;
``readers[(OPENING, fi)]``: the lock its first open holds."""
FILL_AHEAD = 8
"""Files a stream fills into the cache ahead of the one it decodes. A decode is several times quicker than a
file's copy from a mount, so the fills set the pace: a cold 30 M-row scan through a FUSE mount took 2.76 s
filling 8 ahead against 3.49 s filling 4 (16: 2.77; medians of 6 interleaved rounds; bench/table_scan.py's
5 rounds after: 3.03 s, within that benchmark's noise of the 3.20 s before)."""

_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16,
              torch.int64: np.int64, torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8,
              torch.uint8: np.uint8, torch.bool: np.bool_}


def close_readers(readers: dict[Any, Any]) -> None:
    """Close the files a stream's ``readers`` opened, and stop its fills ahead."""
    ahead = readers.pop(AHEAD, None)
    if ahead is not None:
        ahead.close()
    for key, val in list(readers.items()):
        if key[1] != "delta" and val[1] is not None:  # (ParquetFile, file) pairs; "delta": a deletion vector
            val[1].close()
    readers.clear()


def _writable(col: Any, arr: np.ndarray) -> np.ndarray:
    """``arr`` (``col``'s values, read-only as Arrow hands them out) as a writable array: the very buffer the
    decode made when Arrow says that memory is mutable (a fresh decode owned by this batch alone: no copy), else
    a copy (a memory-mapped or shared buffer)."""
    chunks = getattr(col, "chunks", None) or [col]
    if len(chunks) == 1 and arr.ndim == 1 and arr.dtype != np.bool_:
        bufs = chunks[0].buffers()
        data = bufs[1] if len(bufs) == 2 else None
        if data is not None and data.is_mutable:
            view = np.frombuffer(data, dtype=arr.dtype)  # writable: the buffer is mutable
            if len(arr) == 0 or (view.ctypes.data <= arr.ctypes.data
                                 and arr.ctypes.data + arr.nbytes <= view.ctypes.data + view.nbytes):
                start = (arr.ctypes.data - view.ctypes.data) // arr.itemsize
                if len(arr) == 0 or (arr.strides == (arr.itemsize,) and
                                     (arr.ctypes.data - view.ctypes.data) % arr.itemsize == 0):
                    return view[start:start + len(arr)]
    return arr.copy()


class FillAhead:
    """Whole-file cache fills of the files a stream reads next, started ahead of its decode: while file ``k`` of the
    stream's order is decoded, files ``k+1 .. k+depth`` fill at once on their own threads (pyarrow's scanner reads
    several files of a mount at once; one fill at a time left a cold scan from a FUSE volume at 2.3x the scanner's
    time). The decode's own fill of a file joins the fill running (one fill per key) or finds the entry, and reports
    any error, naming the file. With a cache budget the files filled ahead hold at most half of it.

    Call order: build it with the stream's files in order of first use; :meth:`reached` from the decode as it
    opens a file (any thread); :meth:`close` when the stream ends: fills not started never start (one running
    completes into the cache, as a decode's own fill would)."""

    def __init__(self, reader: TableReader, order: list[int], depth: int = FILL_AHEAD) -> None:
        self._reader, self._order, self._depth = reader, order, max(0, int(depth))
        self._first: dict[int, int] = {}
        for k, fi in enumerate(order):
            self._first.setdefault(fi, k)
        self._started = 0  # fills submitted: those of order[:_started]
        self._futures: list[Any] = []
        self._mu = threading.Lock()
        self._closed = False

    @property
    def started(self) -> int:
        """Fills submitted so far (the files of the order's first ``started``)."""
        return self._started

    def reached(self, fi: int) -> None:
        """The decode opens file ``fi``: start the fills of the files after it, up to ``depth`` of them."""
        k = self._first.get(fi)
        cache = self._reader.cache
        if k is None or cache is None or not self._depth:
            return
        budget = cache.budget()
        with self._mu:
            if self._closed:
                return
            self._started = max(self._started, k + 1)  # file k itself: the decode's own fill
            want = min(len(self._order), k + 1 + self._depth)
            held = sum(self._reader.files[f].size for f in self._order[k + 1:self._started])
            while self._started < want:
                nxt = self._order[self._started]
                size = self._reader.files[nxt].size
                if budget is not None and held + size > budget // 2:
                    break
                held += size
                self._futures.append(shared_pool(self._depth, "table-fill").submit(self._fill, nxt))
                self._started += 1

    def _fill(self, fi: int) -> None:
        with contextlib.suppress(Exception):  # the decode's own fill of the file raises it, naming the file
            self._reader.local(fi)

    def close(self) -> None:
        with self._mu:
            self._closed = True
            for fut in self._futures:
                fut.cancel()
            self._futures.clear()


class TableReader:
    """Reads and decodes row groups of a table's files (see the module for the call order)."""

    def __init__(self, files: list[TableFile], io: TableFiles, cache: FileCache | None, snapshot: Any, schema: Any,
                 columns: list[str], format: str, kinds: dict[str, str], mask_set: set[str],  # noqa: A002 - the option's name
                 dtypes: dict[str, Any], filter: RowFilter | None, timeout: float | None) -> None:  # noqa: A002
        self.files, self.io, self.cache, self.snapshot, self.schema = files, io, cache, snapshot, schema
        self.columns, self.format, self.kinds, self.mask_set, self.dtypes = columns, format, kinds, mask_set, dtypes
        self.filter, self.timeout = filter, timeout
        self.group_file: list[tuple[int, int]] = []  # the dataset's row groups: (file, row group in the file)
        self._local()

    def _local(self) -> None:
        """What belongs to this process: the filler (its locks and threads), the files checked, whether to
        decode on pyarrow's threads (a forked worker decides again: it shares the cores)."""
        self._pid = os.getpid()
        self._fill: CacheFiller | None = None
        self._checked: set[str] = set()  # files stat-ed before their first ranged fill
        self._threads: bool | None = None  # decode on pyarrow's threads (see threads())

    def _mine(self) -> None:
        if self._pid != os.getpid():
            self._local()

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()
        st["_fill"], st["_checked"], st["_threads"] = None, set(), None
        return st

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__dict__.update(st)
        self._local()

    def local(self, fi: int) -> str:
        """Local path of file ``fi`` (a cached copy for remote or mounted files: the cache's one fill path,
        :class:`~ucmagic.files.filler.CacheFiller`, through the file's registered volume)."""
        f = self.files[fi]
        if self.cache is None:
            return f.path
        vol, rel = self.io.locate(f.path)
        key = cache_key("parquet", f.path, f.size, f.mtime)
        path, _ = self.filler().fill_file(vol, FileEntry(rel, f.size, f.mtime), key, ".parquet")
        return path

    def meta(self, fi: int) -> Any:
        """The footer of file ``fi`` (read again in a process that received the dataset pickled)."""
        import pyarrow.parquet as pq

        f = self.files[fi]
        if f.meta is None:
            with self.io.open(f.path, f.size) as src:
                f.meta = pq.read_metadata(src)
        return f.meta

    def pq_options(self) -> dict[str, Any]:
        # Delta timestamps are microseconds: INT96 files (Spark) read as us, so far dates do not overflow
        return {"coerce_int96_timestamp_unit": "us"} if self.snapshot is not None else {}

    def index(self) -> None:
        """With a filter: evaluate it over every file (pruned row groups unread, only its columns read, by ranged
        reads through the volume): each file's kept rows per row group (:func:`index_file`)."""
        import pyarrow.parquet as pq

        rf = self.filter
        if rf is None:
            return

        path = self._index_path(rf)
        if path is not None and load_index(path, self.files, [self.meta(i).num_row_groups
                                                              for i in range(len(self.files))]):
            return
        part_schema = self.schema if self.snapshot is None else None  # Hive values: the table's types
        may = rf.files_may_match([prune_args(self.meta(i), f, self.snapshot, part_schema)
                                  for i, f in enumerate(self.files)])

        def one(fi: int) -> None:
            f = self.files[fi]
            if not any(may[fi]):  # every row group pruned: the file is not opened
                index_file(None, f, rf, self.schema, self.snapshot, may[fi], self.meta(fi))
                return
            with native_work(), self.io.open_arrow(f.path, f.size) as src:
                index_file(pq.ParquetFile(src, metadata=self.meta(fi), **self.pq_options()), f, rf, self.schema,
                           self.snapshot, may[fi], self.meta(fi))
        for _ in read_ahead(one, range(len(self.files)), depth=8, timeout=self.timeout,
                            describe=lambda fi: f"filter over {self.files[fi].path}"):
            pass
        if path is not None:
            with contextlib.suppress(OSError):  # a cache that cannot take it: built again next time
                save_index(path, self.files)

    def _index_path(self, rf: RowFilter) -> str | None:
        """Where the row index of these files, this version and this filter is kept (the cache's ``row-index``
        folder, private); None without a cache."""
        if self.cache is None or not rf.cacheable or not pruning_on():  # now(): the rows change with time
            return None
        folder = self.cache.layout.indexes
        try:
            private_dir(folder, what="row-index folder of the cache")
        except OSError:
            return None
        version = self.snapshot.version if self.snapshot is not None else None
        return os.path.join(folder, index_key(self.files, rf, version) + ".npz")

    def reads_wait(self) -> bool:
        """Whether decoding reads wait on a mount or remote storage: the files are read in place (no cache) or as
        byte ranges filled into the cache (a filter), from a volume that is not this machine's disk. False where
        whole files are filled ahead into the cache (:class:`FillAhead`) and decoded from there."""
        if not self.files or (self.cache is not None and self.filter is None):
            return False
        vol, _ = self.io.locate(self.files[0].path)
        return not vol.local_disk

    def threads(self) -> bool:
        """Decode a row group's columns in parallel: in the loop's own process, not in a DataLoader worker
        (workers already share the cores)."""
        self._mine()
        if self._threads is None:
            from torch.utils.data import get_worker_info

            self._threads = get_worker_info() is None
        return self._threads

    def filler(self) -> CacheFiller:
        self._mine()
        if self._fill is None:
            if self.cache is None:
                raise RuntimeError("this ParquetDataset reads without a cache (cache=False)")
            self._fill = CacheFiller(self.cache)
        return self._fill

    def changed(self, fi: int, why: str) -> ListingChangedError:
        return ListingChangedError(
            f"{self.files[fi].path} {why} since this ParquetDataset was created (was the directory overwritten "
            "by export_parquet?): create the ParquetDataset again to read the new version"
        )

    def open(self, readers: dict[Any, Any], lock: threading.Lock, fi: int, j: int | None = None,
              ranged: bool | None = None) -> Any:
        """This thread's ParquetFile of file ``fi``: the cached copy (whole-file fill), the file itself through
        its volume (no cache), or, ``ranged`` (default: with a filter), a file of which row group ``j``'s bytes
        were filled into the cache as one byte range (:meth:`CacheFiller.fill_range`)."""
        import pyarrow.parquet as pq

        ranged = (self.filter is not None) if ranged is None else ranged
        key = (threading.get_ident(), fi)
        with lock:
            got = readers.get(key)
        if ranged and self.cache is not None and j is not None and (got is None or isinstance(got[1], RangeFile)):
            tf = self.files[fi]
            if got is None:
                rfile = RangeFile(tf.path, tf.size)
                got = (pq.ParquetFile(rfile, metadata=self.meta(fi), **self.pq_options()), rfile)
                with lock:
                    readers[key] = got
            lo, hi = group_span(self.meta(fi), j)
            vol, rel = self.io.locate(tf.path)
            path, _ = self.filler().fill_range(vol, FileEntry(rel, tf.size, tf.mtime), lo, hi, checked=self._checked)
            got[1].add(lo, hi, path)
            return got[0]
        if got is not None:
            return got[0]
        with lock:
            opened = readers.get((SHARED, fi))
            opening = readers.setdefault((OPENING, fi), (threading.Lock(), None))[0]
        first = None  # the file this thread opened first, not native: its own
        if opened is None:
            with opening:  # the threads that need file fi first wait for one open of it
                with lock:
                    opened = readers.get((SHARED, fi))
                if opened is None:
                    f, native = self._open_file(fi, readers)
                    if self.files[fi].meta is None:  # a dataset received pickled: the footer from this open
                        self.files[fi].meta = pq.read_metadata(f)
                    opened = (None, f, True) if native else (None, None, False)
                    first = None if native else f
                    with lock:
                        readers[(SHARED, fi)] = opened
        # native: reads at an offset, from any thread at once (one file per stream); through Python, each thread
        # reads its own (one read at a time per file)
        own = None if opened[2] else (first if first is not None else self._open_file(fi, readers)[0])
        f, native = (opened[1], True) if opened[2] else (own, False)
        # a ParquetFile per thread, from the footer already read (no read, no open): every open on a mount waits (a
        # FUSE mount, 20 ms per open: 30 files took ~470 opens when each thread opened its own, one per row group
        # and one more for the native file). A native file or a mapped copy: each column chunk read where it is
        # decoded (pre_buffer off). Pre-buffering reads a row group's chunks on Arrow's I/O threads, each into
        # memory of that thread's own heap, which the allocator hands back to the system between row groups and
        # faults in again (zeroing it): a warm 30 M-row scan spent 0.7-2.3 s in the kernel against 0.3 s without
        pf = pq.ParquetFile(f, metadata=self.meta(fi), pre_buffer=not native, **self.pq_options())
        with lock:
            readers[key] = (pf, own)
        return pf

    def _open_file(self, fi: int, readers: dict[Any, Any]) -> tuple[Any, bool]:
        """File ``fi`` opened for pyarrow (the cached copy, memory-mapped, or the file itself through its volume),
        checked against the listing's size; and whether it is native (an Arrow file or mapping, not Python's)."""
        import pyarrow as pa

        ahead = readers.get(AHEAD)
        if ahead is not None:
            ahead.reached(fi)
        path = self.local(fi)
        try:
            if path != self.files[fi].path:  # a cached copy (written once, renamed into place): memory-mapped
                try:
                    f = pa.memory_map(path)
                except FileNotFoundError:
                    raise
                except OSError:  # a cache on a file system without mmap: plain reads
                    f = pa.OSFile(path)
                size = f.size()
            else:  # the file itself, through its volume (native reads where it is local: no GIL in the decode)
                f = self.io.open_arrow(path, self.files[fi].size)
                size = f.size() if callable(getattr(f, "size", None)) else self.io.stat(path).size
        except FileNotFoundError:
            raise self.changed(fi, "disappeared") from None
        if size != self.files[fi].size:
            f.close()
            raise self.changed(fi, "changed size")
        return f, isinstance(f, (pa.OSFile, pa.MemoryMappedFile))

    def read_group(self, readers: dict[Any, Any], lock: threading.Lock, g: int,
                   ranged: bool | None = None) -> tuple[Any, np.ndarray | None]:
        """Row group ``g`` (every stored row, as the table defines them: :func:`read_columns`) and the stored rows
        that are not rows of the table (a Delta deletion vector, the filter; None: none). The caller drops them
        (one copy, see _load)."""
        fi, j = self.group_file[g]
        pf = self.open(readers, lock, fi, j, ranged)
        f = self.files[fi]
        t = read_columns(pf, f, j, self.columns, self.schema, self.snapshot, threads=self.threads())
        if f.stored_rows is None or f.kept is not None or self.snapshot is None:
            return t, dropped_rows(f, j, None, None)
        key = (threading.get_ident(), "delta")
        with lock:
            cur = readers.get(key)
        if cur is None or cur[0] != fi:  # this thread moves to another file: its mask replaces the last one
            cur = (fi, self.snapshot.deleted_rows(f.delta), stored_starts(f))
            with lock:
                readers[key] = cur
        return t, dropped_rows(f, j, cur[1], cur[2])

    def load(self, lay: EpochLayout, seg: Segment, readers: dict[Any, Any], lock: threading.Lock,
             ranged: bool | None = None) -> tuple[dict[str, Any], int]:
        """Decode one segment: tensors (numeric columns, converted once) or arrow arrays (the rest). ``ranged``:
        fill only the row groups' byte ranges into the cache (default: with a filter). Counted as native work
        (:func:`~ucmagic.tables.owned.native_work`): the interpreter's exit waits for it."""
        with native_work():
            return self._load(lay, seg, readers, lock, ranged)

    def _load(self, lay: EpochLayout, seg: Segment, readers: dict[Any, Any], lock: threading.Lock,
              ranged: bool | None) -> tuple[dict[str, Any], int]:
        import pyarrow as pa

        pieces = lay.window_pieces(seg.window)
        perm = lay.window_perm(seg.window)
        pick = None  # keep mask over ``table`` (a deletion vector), applied while converting (one copy)
        if perm is None:  # one row group per window: read it, slice zero-copy
            g, lo, _ = pieces[0]
            t, dels = self.read_group(readers, lock, g, ranged)
            if dels is None:
                table = t.slice(lo + seg.lo, seg.hi - seg.lo)
            else:
                first, stop, pick = live_span(dels, lo + seg.lo, lo + seg.hi)
                table = t.slice(first, stop - first)
        else:
            parts = []
            for g, lo, hi in pieces:  # node mode: a row group may be cut at a node's slice edge
                t, dels = self.read_group(readers, lock, g, ranged)
                if dels is not None:
                    keep = np.ones(t.num_rows, dtype=bool)
                    keep[dels] = False
                    t = filter_rows(t, keep)
                parts.append(t if lo == 0 and hi == t.num_rows else t.slice(lo, hi - lo))
            table = parts[0] if len(parts) == 1 else pa.concat_tables(parts)
            table = table.take(pa.array(perm[seg.lo:seg.hi]))
        if self.format != "torch":  # numpy, arrow, pandas: converted when a batch is cut
            return {"": table if pick is None else filter_rows(table, pick)}, seg.hi - seg.lo
        out: dict[str, Any] = {}
        apick = None
        for c in self.columns:
            col = table.column(c)
            kind = self.kinds[c]
            if kind == "decode":
                col = col.cast(col.type.value_type)
                kind = column_kind(col.type)
            if kind == "int64":
                col = temporal_int64(col)
            elif kind in ("float64", "decimal"):  # a wide decimal only with dtype= (check_exact): the nearest double
                col = decimal_float64(col)
            if kind == "list":
                if pick is not None:
                    apick = pa.array(pick) if apick is None else apick
                    col = col.filter(apick)
                out[c] = col.combine_chunks()
                continue
            if c in self.mask_set:  # the type decides the dtype; nulls are 0/False (NaN) and the mask says so
                valid = np.asarray(col.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
                out[mask_key(c)] = torch.from_numpy(valid[pick] if pick is not None else valid)
            arr = numeric_numpy(col)
            if pick is not None:
                arr = arr[pick]  # a fresh array (boolean indexing): the deletion vector costs no extra copy
            dt = self.dtypes.get(c)
            if dt is not None and _NP_DTYPES.get(dt) is not None:
                arr = arr.astype(_NP_DTYPES[dt])
            elif not arr.flags.writeable:
                arr = _writable(col, arr)
            t = torch.from_numpy(arr)
            out[c] = t.to(dt) if dt is not None and t.dtype != dt else t
        return out, seg.hi - seg.lo
