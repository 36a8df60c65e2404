"""Pure row planning for ParquetDataset: the epoch's row order over row groups, as windows.

Positions are indices into the epoch's row order (``0..total``); :mod:`ucmagic.plan` splits them
into equal contiguous ranges per (rank, worker) stream and does the resume math. This module maps
positions back to row groups:

- without shuffle the order is the files' order; each row group is one *window*;
- with shuffle, row groups are permuted (seeded by ``seed`` and ``epoch``), consecutive permuted
  row groups are gathered into windows of at least ``buffer_rows`` rows, and the rows of each
  window are permuted (seeded by ``seed``, ``epoch`` and the window). A reader holds one window
  at a time, so memory stays bounded by the buffer, and the order is one fixed permutation of all
  rows, identical on every rank, so resume is exact.
"""
from __future__ import annotations

from typing import Iterable, NamedTuple, Sequence

import numpy as np

Range = tuple[int, int]


class Segment(NamedTuple):
    """Positions ``lo..hi`` relative to the start of window ``window``."""

    window: int
    lo: int
    hi: int


class EpochLayout:
    """The row order of one epoch. ``group_rows[g]``: rows in row group ``g`` (files' order)."""

    def __init__(self, group_rows: Sequence[int], *, shuffle: bool = False, seed: int = 0, epoch: int = 0,
                 buffer_rows: int = 0) -> None:
        rows = np.asarray(group_rows, dtype=np.int64)
        self.shuffle = bool(shuffle)
        self.seed, self.epoch = int(seed), int(epoch)
        self.group_offset = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)  # global row of each group
        self.total = int(self.group_offset[-1])
        if self.shuffle:
            self.order = np.random.default_rng([self.seed, self.epoch, 0x9A0]).permutation(len(rows)).astype(np.int64)
        else:
            self.order = np.arange(len(rows), dtype=np.int64)
        ordered = rows[self.order]
        self.slot_start = np.concatenate([[0], np.cumsum(ordered)]).astype(np.int64)
        self.win_slots = self._windows(ordered, int(buffer_rows) if self.shuffle else 0)
        self.win_start = self.slot_start[self.win_slots]

    @staticmethod
    def _windows(ordered: np.ndarray, buffer_rows: int) -> np.ndarray:
        """Slot index where each window starts (plus the end): groups gathered up to ``buffer_rows``."""
        n = len(ordered)
        if buffer_rows <= 0:
            return np.arange(n + 1, dtype=np.int64)
        bounds = [0]
        acc = 0
        for i, r in enumerate(ordered):
            acc += int(r)
            if acc >= buffer_rows and i + 1 < n:
                bounds.append(i + 1)
                acc = 0
        bounds.append(n)
        return np.asarray(bounds, dtype=np.int64)

    @property
    def num_windows(self) -> int:
        return len(self.win_slots) - 1

    def window_groups(self, w: int) -> np.ndarray:
        """Row-group ids of window ``w``, in the order its rows are concatenated."""
        return self.order[self.win_slots[w]:self.win_slots[w + 1]]

    def window_len(self, w: int) -> int:
        return int(self.win_start[w + 1] - self.win_start[w])

    def window_perm(self, w: int) -> np.ndarray | None:
        """Row permutation inside window ``w`` (None without shuffle: identity)."""
        if not self.shuffle:
            return None
        return np.random.default_rng([self.seed, self.epoch, int(w), 0xB0F]).permutation(self.window_len(w))

    def segments(self, ranges: Iterable[Range]) -> list[Segment]:
        """Split position ranges at window boundaries, in order."""
        out: list[Segment] = []
        for a, b in ranges:
            if b <= a:
                continue
            w = int(np.searchsorted(self.win_start, a, side="right")) - 1
            while a < b:
                start, stop = int(self.win_start[w]), int(self.win_start[w + 1])
                hi = min(b, stop)
                if hi > a:
                    out.append(Segment(w, a - start, hi - start))
                a = max(a, hi)
                w += 1
        return out

    def segment_rows(self, seg: Segment) -> np.ndarray:
        """Global row indices (files' order) of a segment, in delivery order."""
        groups = self.window_groups(seg.window)
        rows = np.concatenate([np.arange(self.group_offset[g], self.group_offset[g + 1]) for g in groups]) \
            if len(groups) else np.zeros(0, dtype=np.int64)
        perm = self.window_perm(seg.window)
        idx = np.arange(seg.lo, seg.hi) if perm is None else perm[seg.lo:seg.hi]
        return rows[idx]

    def rows_of(self, ranges: Iterable[Range]) -> np.ndarray:
        """Global row indices delivered for position ranges (tests and debugging)."""
        parts = [self.segment_rows(s) for s in self.segments(ranges)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
