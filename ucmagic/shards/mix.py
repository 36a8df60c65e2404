"""``ucmagic.mix``: interleave several streams with fixed, seeded proportions.

Each delivered sample picks its source by a seeded draw from ``weights`` (one draw per position
of the stream, from ``(seed, epoch, rank, worker)``), so the sequence of sources is the same in
every run and the proportions converge to the weights. Every source is iterated in the same
process as the mix, so a source that splits itself over ranks x workers (a
:class:`~ucmagic.shards.samples.SampleStream`, a ``UCVolumeDataset``) gives each worker's mix its own
part. The epoch ends at the first source that runs out (the proportions never drift).

Resume: :meth:`Mix.state_dict` (plain iteration) holds the positions delivered and each source's
state; :meth:`Mix.load_state_dict` restores them, so the next iteration continues the same
sequence of sources and samples. Under DataLoader workers, ``ucmagic.DataLoader`` resumes it by
skipping the delivered batches (same number of workers).
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

import numpy as np
from torch.utils.data import IterableDataset

from ..dist import dist_info

STATE_VERSION = 1
DRAW_BLOCK = 4096


def choices(weights: Sequence[float], seed: int, epoch: int, stream: int, start: int, count: int) -> np.ndarray:
    """Source index at positions ``start .. start + count`` of one stream's sequence (pure)."""
    w = np.asarray(weights, dtype=np.float64)
    cum = np.cumsum(w / w.sum())
    cum[-1] = 1.0
    out = []
    first = start // DRAW_BLOCK
    last = (start + count + DRAW_BLOCK - 1) // DRAW_BLOCK
    for b in range(first, max(first + 1, last)):  # blocks of draws: position p is block p // DRAW_BLOCK
        u = np.random.default_rng([int(seed), int(epoch), int(stream), b, 0x31C5]).random(DRAW_BLOCK)
        out.append(np.searchsorted(cum, u, side="right"))
    arr = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    lo = start - first * DRAW_BLOCK
    return arr[lo:lo + count].astype(np.int64)


class Mix(IterableDataset):
    """Samples of several datasets interleaved with ``weights`` (see the module doc)."""

    kind = "Mix"

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float] | None = None, *, seed: int = 0) -> None:
        if not datasets:
            raise ValueError("mix needs at least one dataset")
        w = [1.0] * len(datasets) if weights is None else [float(x) for x in weights]
        if len(w) != len(datasets):
            raise ValueError(f"mix got {len(datasets)} datasets and {len(w)} weights: give one weight per dataset")
        if any(x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"mix weights must be >= 0 with a positive sum, got {w}")
        self.datasets = list(datasets)
        self.weights = w
        self.seed = int(seed)
        self._epoch = 0
        self._explicit: int | None = None
        self._resume: dict[str, Any] | None = None
        self._delivered = 0
        self._taken = [0] * len(datasets)

    def __repr__(self) -> str:
        return f"Mix({len(self.datasets)} datasets, weights={self.weights}, seed={self.seed})"

    def set_epoch(self, epoch: int) -> None:
        """The epoch of the next iteration, for the mix and every source that has ``set_epoch``."""
        self._explicit = int(epoch)
        for d in self.datasets:
            fn = getattr(d, "set_epoch", None)
            if callable(fn):
                fn(int(epoch))

    @property
    def epoch(self) -> int:
        return self._epoch

    def __iter__(self) -> Iterator[Any]:
        d = dist_info()
        stream = d.rank * max(1, d.num_workers) + d.worker
        r = self._resume
        self._resume = None
        if r is not None:
            epoch, start = int(r["epoch"]), int(r["delivered"])
        else:
            epoch = self._explicit if self._explicit is not None else (self._epoch + 1 if self._delivered else 0)
            start = 0
        self._explicit = None
        self._epoch, self._delivered = epoch, start
        if r is None:
            self._taken = [0] * len(self.datasets)
        its = [iter(ds) for ds in self.datasets]
        pos = start
        try:
            while True:
                for k in choices(self.weights, self.seed, epoch, stream, pos, DRAW_BLOCK).tolist():
                    try:
                        item = next(its[k])
                    except StopIteration:
                        return
                    pos += 1
                    self._delivered = pos
                    self._taken[k] += 1
                    yield item
        finally:
            for it in its:
                close = getattr(it, "close", None)
                if callable(close):
                    close()

    def proportions(self) -> list[float]:
        """Share of each source among the samples delivered so far this epoch (plain iteration)."""
        n = sum(self._taken)
        return [t / n if n else 0.0 for t in self._taken]

    def state_dict(self) -> dict[str, Any]:
        """Where plain iteration stands: the epoch, samples delivered and each source's own state."""
        sources = []
        for ds in self.datasets:
            fn = getattr(ds, "state_dict", None)
            sources.append(fn() if callable(fn) else None)
        return {"version": STATE_VERSION, "kind": self.kind, "epoch": self._epoch, "delivered": self._delivered,
                "taken": list(self._taken), "seed": self.seed, "weights": list(self.weights), "sources": sources}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the same sources and samples follow, in the same order."""
        if state.get("kind") != self.kind or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a Mix state (kind {state.get('kind')!r}, version {state.get('version')!r})")
        if len(state["sources"]) != len(self.datasets) or list(state["weights"]) != self.weights:
            raise ValueError("this Mix state was saved with other datasets or weights: mix the same datasets "
                             "with the same weights to resume")
        for ds, s in zip(self.datasets, state["sources"]):
            if s is not None:
                ds.load_state_dict(s)
        self.seed = int(state["seed"])
        self._taken = [int(x) for x in state["taken"]]
        self._resume = dict(state)


def mix(datasets: Sequence[Any], weights: Sequence[float] | None = None, *, seed: int = 0) -> Mix:
    """Interleave ``datasets`` (streams) with ``weights`` (default equal): ``ucmagic.mix([a, b], [0.7, 0.3])``."""
    return Mix(datasets, weights, seed=seed)
