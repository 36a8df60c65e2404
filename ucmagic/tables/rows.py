"""Pure row planning for ParquetDataset: the epoch's row order over row groups, as windows.

Positions are indices into the epoch's row order (``0..total``); :mod:`ucmagic.files.plan` splits them
into equal contiguous ranges per (rank, worker) stream and does the resume math. This module maps
positions back to rows of row groups. The order is a sequence of *pieces* (a row range of one row
group) gathered into *windows*; a reader holds one window at a time, so memory stays bounded by
the buffer, and the order is one fixed permutation of all rows, identical on every rank, so resume
is exact:

- without shuffle the order is the files' order; each row group is one window;
- ``"global"`` (or ``True``): row groups are permuted (seeded by ``seed`` and ``epoch``),
  consecutive permuted row groups are gathered into windows of at least ``buffer_rows`` rows, and
  the rows of each window are permuted (seeded by ``seed``, ``epoch`` and the window);
- ``"node"`` with several ``blocks`` (one node's share of the positions each, see
  :func:`ucmagic.files.plan.node_blocks`): block ``k`` holds the same contiguous slice of the rows (files'
  order) every epoch, so a node keeps its rows (and its cached files) across epochs. Within a
  block, its pieces (row groups cut at the block's edges) are permuted, gathered into windows that
  never cross the block's end, and the rows of each window permuted, all per epoch. With
  ``reshuffle_every=N`` the slices rotate by one block every N epochs (like
  :func:`ucmagic.files.plan.epoch_order` does for files).
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

    def __init__(self, group_rows: Sequence[int], *, shuffle: bool | str = False, seed: int = 0, epoch: int = 0,
                 buffer_rows: int = 0, blocks: Sequence[Range] | None = None,
                 reshuffle_every: int | None = None) -> None:
        rows = np.asarray(group_rows, dtype=np.int64)
        if shuffle not in (False, True, "global", "node"):
            raise ValueError(f"shuffle must be False, True, 'global' or 'node', got {shuffle!r}")
        self.mode: bool | str = False if not shuffle else ("node" if shuffle == "node" and blocks and len(blocks) > 1
                                                            else "global")
        self.shuffle = bool(shuffle)
        self.seed, self.epoch = int(seed), int(epoch)
        self.group_offset = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)  # global row of each group
        self.total = int(self.group_offset[-1])
        buffer = int(buffer_rows) if self.shuffle else 0
        if self.mode == "node":
            self._node_pieces(rows, list(blocks or ()), reshuffle_every, buffer)
        else:
            if self.shuffle:
                order = np.random.default_rng([self.seed, self.epoch, 0x9A0]).permutation(len(rows)).astype(np.int64)
            else:
                order = np.arange(len(rows), dtype=np.int64)
            self.piece_group = order
            self.piece_lo = np.zeros(len(rows), dtype=np.int64)
            self.piece_hi = rows[order]
            self.win_slots = self._windows(self.piece_hi, buffer)
        self.slot_start = np.concatenate([[0], np.cumsum(self.piece_hi - self.piece_lo)]).astype(np.int64)
        self.win_start = self.slot_start[self.win_slots]

    def _node_pieces(self, rows: np.ndarray, blocks: list[Range], reshuffle_every: int | None, buffer: int) -> None:
        n = self.total
        stride = blocks[0][1] - blocks[0][0]
        rotation = self.epoch // int(reshuffle_every) if reshuffle_every else 0
        shift = (rotation * stride) % n if n else 0
        groups, los, his, bounds = [], [], [], [0]
        for k, (a, b) in enumerate(blocks):
            spans = []  # rows (files' order) of block k: [a + shift, b + shift) modulo n
            s, e = a + shift, b + shift
            if b > a:
                if s >= n:
                    s, e = s - n, e - n
                spans = [(s, min(e, n))] + ([(0, e - n)] if e > n else [])
            bg: list[int] = []
            bl: list[int] = []
            bh: list[int] = []
            for lo, hi in spans:  # cut at row-group edges; empty groups never appear
                g = int(np.searchsorted(self.group_offset, lo, side="right")) - 1
                while lo < hi:
                    end = min(hi, int(self.group_offset[g + 1]))
                    if end > lo:
                        bg.append(g)
                        bl.append(lo - int(self.group_offset[g]))
                        bh.append(end - int(self.group_offset[g]))
                    lo = end
                    g += 1
            perm = np.random.default_rng([self.seed, self.epoch, k, 0x90DE]).permutation(len(bg))
            ag, al, ah = (np.asarray(x, dtype=np.int64)[perm] for x in (bg, bl, bh))
            wins = self._windows(ah - al, buffer)
            base = bounds[-1]
            bounds.extend((base + wins[1:]).tolist())
            groups.append(ag)
            los.append(al)
            his.append(ah)

        def cat(xs: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(xs).astype(np.int64) if xs else np.zeros(0, dtype=np.int64)

        self.piece_group, self.piece_lo, self.piece_hi = cat(groups), cat(los), cat(his)
        self.win_slots = np.asarray(bounds, dtype=np.int64)

    @staticmethod
    def _windows(ordered: np.ndarray, buffer_rows: int) -> np.ndarray:
        """Slot index where each window starts (plus the end): pieces gathered up to ``buffer_rows``."""
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
        if n:
            bounds.append(n)
        return np.asarray(bounds, dtype=np.int64)

    @property
    def num_windows(self) -> int:
        return len(self.win_slots) - 1

    @property
    def order(self) -> np.ndarray:
        """Row-group id of each piece, in delivery order (whole groups unless in node mode)."""
        return self.piece_group

    def window_pieces(self, w: int) -> list[tuple[int, int, int]]:
        """``(group, lo, hi)`` of window ``w``: rows ``lo..hi`` of each row group, concatenated in order."""
        a, b = int(self.win_slots[w]), int(self.win_slots[w + 1])
        return [(int(g), int(lo), int(hi)) for g, lo, hi in
                zip(self.piece_group[a:b], self.piece_lo[a:b], self.piece_hi[a:b])]

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
        pieces = self.window_pieces(seg.window)
        off = self.group_offset
        rows = np.concatenate([np.arange(off[g] + lo, off[g] + hi) for g, lo, hi in pieces]) \
            if pieces else np.zeros(0, dtype=np.int64)
        perm = self.window_perm(seg.window)
        idx = np.arange(seg.lo, seg.hi) if perm is None else perm[seg.lo:seg.hi]
        return rows[idx]

    def rows_of(self, ranges: Iterable[Range]) -> np.ndarray:
        """Global row indices delivered for position ranges (tests and debugging)."""
        parts = [self.segment_rows(s) for s in self.segments(ranges)]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
