"""Random access by row to a ParquetDataset: ``ds.rows[i]`` (one row), ``ds.rows[i:j]`` (a batch),
``len(ds.rows)`` (the table's rows; with ``filter=``, the rows it keeps).

Row ``i`` is the ``i``-th row in the files' order (after deletion vectors and the filter). The row index is
the dataset's: row counts per row group from the footers (with a filter, the kept-row bitmaps built from the
filter's columns), so ``rows[i]`` finds its row group by a binary search and reads that row group only (a
byte range filled into the cache for remote and ``/Volumes`` files). Decoded row groups are kept in a small
per-process LRU (``cache_groups``), so nearby and repeated rows cost no decode.

:class:`Rows` is a map-style ``torch.utils.data.Dataset``: use it with torch samplers, ``torch``'s
DataLoader or ``ucmagic.DataLoader`` (exact resume). Call order: ``rows = ds.rows`` (or
``Rows(ds.reader, ...)``), then ``rows[i]`` from any thread; a worker process gets its own handles and LRU
(forked or spawned), and the handles left open are closed at exit (:mod:`ucmagic.tables.owned`).
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from .batching import BatchCutter
from .owned import on_exit
from .rows import EpochLayout, Segment
from .table_reader import TableReader, close_readers

__all__ = ["Rows", "DEFAULT_CACHE_GROUPS"]

DEFAULT_CACHE_GROUPS = 8
"""Decoded row groups kept per process by ``ds.rows``."""


class Rows(Dataset[Any]):
    """``ds.rows`` (see the module). ``fingerprint``: the dataset's (files, version, filter), for resume checks."""

    def __init__(self, reader: TableReader, group_rows: list[int], cutter: BatchCutter, fingerprint: str,
                 cache_groups: int = DEFAULT_CACHE_GROUPS) -> None:
        self.reader, self.cutter, self.fingerprint = reader, cutter, fingerprint
        self.layout = EpochLayout(group_rows)  # files' order, one window per row group
        self.starts = self.layout.win_start
        self.cache_groups = max(1, int(cache_groups))
        self._init_local()

    def _init_local(self) -> None:
        """This process's handles: open files, their lock, the decoded row groups (a forked child starts with
        none of its parent's: shared file offsets gave torn reads; spawned workers get them by pickling)."""
        self._pid = os.getpid()
        self._readers: dict[Any, Any] = {}
        self._lock = threading.Lock()
        self._decoded: OrderedDict[int, tuple[dict[str, Any], int]] = OrderedDict()
        on_exit(self, Rows.close)

    def _mine(self) -> None:
        if self._pid != os.getpid():  # a forked DataLoader worker: its own files and cache
            self._init_local()

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_readers", "_lock", "_decoded", "_pid")}

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__dict__.update(st)
        self._init_local()

    def __len__(self) -> int:
        return int(self.layout.total)

    def __repr__(self) -> str:
        return f"<rows of a ParquetDataset: {len(self)} rows in {self.layout.num_windows} row groups>"

    def close(self) -> None:
        """Close the files and drop the decoded row groups (reopened on the next access)."""
        self._mine()
        with self._lock:
            close_readers(self._readers)
            self._decoded.clear()

    def _window(self, w: int) -> tuple[dict[str, Any], int]:
        """Row group ``w`` decoded (the dataset's own decoding), from the LRU or read now."""
        self._mine()
        with self._lock:
            got = self._decoded.get(w)
            if got is not None:
                self._decoded.move_to_end(w)
                return got
        got = self.reader.load(self.layout, Segment(w, 0, self.layout.window_len(w)), self._readers, self._lock,
                               ranged=True)
        with self._lock:
            self._decoded[w] = got
            while len(self._decoded) > self.cache_groups:
                self._decoded.popitem(last=False)
        return got

    def _pieces(self, lo: int, hi: int) -> list[tuple[dict[str, Any], int]]:
        """Decoded pieces holding rows ``lo..hi``, sliced to them."""
        out = []
        w = int(np.searchsorted(self.starts, lo, side="right")) - 1
        while lo < hi:
            start, stop = int(self.starts[w]), int(self.starts[w + 1])
            if stop > lo:
                piece, _ = self._window(w)
                a, b = lo - start, min(hi, stop) - start
                out.append((_slice(piece, a, b), b - a))
                lo = start + b
            w += 1
        return out

    def __getitem__(self, index: Any) -> Any:
        n = len(self)
        if isinstance(index, slice):
            for part in (index.start, index.stop, index.step):
                if part is not None:
                    _position(part, "a slice's start, stop and step")
            lo, hi, step = index.indices(n)
            if step != 1:
                raise IndexError("rows[i:j:k]: only a step of 1 is supported; index rows one by one for others")
            hi = max(lo, hi)
            return self._batch(lo, hi)
        i = _position(index, "rows[...]")
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"row {index} is out of range: the table has {n} rows")
        fmt = self.cutter.format
        if fmt == "numpy":  # numpy's conversions (datetime64, objects) are the batch cutter's
            return _row(self._batch(i, i + 1), fmt)
        w = int(np.searchsorted(self.starts, i, side="right")) - 1
        piece, _ = self._window(w)
        k = i - int(self.starts[w])
        if fmt == "torch":  # tensors (and masks) indexed, Arrow arrays (lists, strings) as Python values
            lists = self.cutter.lists
            return {c: (piece[c][k].as_py() if c in lists else piece[c][k]) for c in self.cutter.out_keys}
        return _row(piece[""].slice(k, 1), "arrow")

    def __getitems__(self, indices: list[int]) -> list[Any]:  # torch's batched fetch: one lookup per row
        return [self[i] for i in indices]

    def _batch(self, lo: int, hi: int) -> Any:
        cut = BatchCutter(self.cutter.format, max(1, hi - lo), self.cutter.columns, self.cutter.out_keys,
                          self.cutter.lists, self.cutter.mask_set)
        if hi > lo:
            return next(iter(cut.batches(iter(self._pieces(lo, hi)), False)))
        if not self.layout.num_windows:
            return None
        one = next(iter(cut.batches(iter([(_slice(self._window(0)[0], 0, 1), 1)]), False)))  # no rows, same keys
        if isinstance(one, dict):
            return {k: v[:0] for k, v in one.items()}
        return one.slice(0, 0) if hasattr(one, "slice") else one.iloc[:0]


def _position(index: Any, what: str) -> int:
    """``index`` as a row position: an int (numpy's too), never a bool, a float or a string (``rows[1.7]``,
    ``rows[True]`` and ``rows['3']`` read rows 1, 1 and 3 before: a bug in the caller, not a position)."""
    import operator

    if isinstance(index, (bool, np.bool_)) or not isinstance(index, (int, np.integer)):
        raise TypeError(f"{what} takes integers (row positions) or a slice of them, got {index!r} "
                        f"({type(index).__name__})")
    return operator.index(index)


def _slice(piece: dict[str, Any], a: int, b: int) -> dict[str, Any]:
    """Rows ``a..b`` of a decoded piece (tensors and Arrow arrays, or one Arrow table under ``""``)."""
    out = {}
    for k, v in piece.items():
        out[k] = v.slice(a, b - a) if hasattr(v, "slice") and not hasattr(v, "numpy") else v[a:b]
    return out


def _row(batch: Any, fmt: str) -> Any:
    """One row of a one-row batch: a dict of values (0-d tensors, numpy scalars, Python objects)."""
    if fmt == "arrow":  # Python values; one Python cannot hold (a timestamp past year 9999) stays an Arrow scalar
        return {name: _py(col[0]) for name, col in zip(batch.column_names, batch.columns)}
    if fmt == "pandas":
        return batch.iloc[0].to_dict()
    return {k: v[0] for k, v in batch.items()}


def _py(scalar: Any) -> Any:
    try:
        return scalar.as_py()
    except (OverflowError, ValueError):
        return scalar
