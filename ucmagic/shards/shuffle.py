"""Sample-level shuffle with a bounded cache, and its quality figures (pure; no I/O).

The unit is a *run*: consecutive samples (file order) that start in one chunk. An epoch's order
permutes the runs (seeded by seed and epoch), gathers ``window`` consecutive permuted runs into a
window and permutes the samples inside each window -- the idea of MosaicML Streaming's py1br/py1e
with chunks instead of shards, so a stream reading its contiguous part of the order holds about
``window`` chunks at a time, whatever the shard size. ``"node"``: each node keeps the same slice
of the samples every epoch (its cache stays hot), shuffled the same way inside it. The layout
itself is :class:`ucmagic.tables.rows.EpochLayout` (row groups there, runs here).

Quality: :func:`distinct_files` (mean number of distinct files among each ``k`` consecutive
samples; ``k`` is ideal, 1 is an unshuffled stream) and :func:`file_spread` (how evenly a block
of samples spreads over the files: 1.0 is proportional).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..files import plan
from ..tables.rows import EpochLayout

DEFAULT_WINDOW = 8
"""Runs (about one chunk each) mixed at a time by a shuffled stream."""


def sample_layout(group_sizes: Sequence[int], *, shuffle: bool | str, seed: int, epoch: int,
                  window: int = DEFAULT_WINDOW, world: int = 1, local_world: int = 1, partition: str = "pad",
                  reshuffle_every: int | None = None) -> EpochLayout:
    """The epoch's sample order over runs of ``group_sizes`` samples (see the module doc)."""
    sizes = np.asarray(group_sizes, dtype=np.int64)
    total = int(sizes.sum())
    mean = total / max(1, len(sizes))
    buffer = int(np.ceil(max(1, window) * mean)) if shuffle else 0
    blocks = plan.node_blocks(total, world, local_world, partition) if shuffle == "node" else None
    return EpochLayout(sizes.tolist(), shuffle=shuffle, seed=seed, epoch=epoch, buffer_rows=buffer, blocks=blocks,
                       reshuffle_every=reshuffle_every)


def distinct_files(files: Sequence[int] | np.ndarray, k: int = 16) -> float:
    """Mean number of distinct values among each ``k`` consecutive entries of ``files`` (the file or
    shard of each delivered sample); non-overlapping blocks, the last partial one left out."""
    arr = np.asarray(files, dtype=np.int64)
    blocks = len(arr) // max(1, k)
    if blocks == 0:
        return float(len(np.unique(arr)))
    m = arr[:blocks * k].reshape(blocks, k)
    m = np.sort(m, axis=1)
    return float(np.mean(1 + (np.diff(m, axis=1) != 0).sum(axis=1)))


def file_spread(files: Sequence[int] | np.ndarray, sizes: Sequence[int], block: int) -> float:
    """How evenly blocks of ``block`` consecutive samples spread over files of ``sizes`` samples:
    the mean over blocks of 1 - total variation distance between the block's file histogram and
    the files' shares (1.0: each block mirrors the dataset; near 0: a block comes from one file)."""
    arr = np.asarray(files, dtype=np.int64)
    share = np.asarray(sizes, dtype=np.float64)
    share = share / share.sum()
    blocks = len(arr) // max(1, block)
    if blocks == 0:
        return 0.0
    out = []
    for b in range(blocks):
        h = np.bincount(arr[b * block:(b + 1) * block], minlength=len(share)) / block
        out.append(1.0 - 0.5 * float(np.abs(h - share).sum()))
    return float(np.mean(out))
