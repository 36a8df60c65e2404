"""``ucmagic.mix``: interleave sample streams with fixed, seeded proportions, planned like one stream.

The mix has one global order per epoch. Position ``p`` takes its source from a seeded draw over
``weights`` (draws depend only on ``(seed, epoch, p)``), and the ``q``-th position that drew source
``k`` is position ``q`` of source ``k``'s own epoch order (its bounded-cache shuffle, see
:mod:`.shuffle`). The epoch ends just before the first source would run out, so the proportions
hold to the end. The mix positions are split over ranks x DataLoader workers by :mod:`ucmagic.files.plan`
like any planned dataset: each stream reads a contiguous run of every source's order (a few chunks
at a time), ranks get equal lengths, and ``ucmagic.DataLoader.state_dict()`` (or
:meth:`Mix.state_dict` in plain iteration) resumes exactly, under any number of workers or ranks.
Sources are streams (``ds.stream(...)``) or shard datasets (their default stream); in a mix they
follow their global order (``shuffle=True`` or ``"node"`` mean ``"global"`` there).
"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Generator, Iterator, Sequence

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from .. import telemetry
from ..files import plan
from ..dist import dist_info
from ..files.epochs import EpochTracking
from ..files.planned import check_state_kind
from ..errors import ListingChangedError
from .samples import SampleStream, ShardDataset
from .shuffle import sample_layout

STATE_VERSION = 2
DRAW_BLOCK = 4096


def choices(weights: Sequence[float], seed: int, epoch: int, start: int, count: int) -> np.ndarray:
    """Source index at mix positions ``start .. start + count`` (pure: the same draws for any window)."""
    w = np.asarray(weights, dtype=np.float64)
    cum = np.cumsum(w / w.sum())
    cum[-1] = 1.0
    if count <= 0:
        return np.zeros(0, dtype=np.int64)
    first, last = start // DRAW_BLOCK, (start + count - 1) // DRAW_BLOCK
    parts = [np.random.default_rng([int(seed), int(epoch), b, 0x31C5]).random(DRAW_BLOCK)
             for b in range(first, last + 1)]
    arr = np.searchsorted(cum, np.concatenate(parts), side="right")
    lo = start - first * DRAW_BLOCK
    return arr[lo:lo + count].astype(np.int64)


class Schedule:
    """The mix order of one epoch: draws, how many positions before ``p`` drew each source, and the
    epoch's length (the last position before a source would run out)."""

    def __init__(self, weights: Sequence[float], seed: int, epoch: int, sizes: Sequence[int]) -> None:
        self.weights, self.seed, self.epoch = list(weights), int(seed), int(epoch)
        k = len(self.weights)
        sizes_a = np.asarray(sizes, dtype=np.int64)
        prefix = [np.zeros(k, dtype=np.int64)]
        total = None
        b = 0
        while total is None:  # whole blocks while every source has room, then the exact end inside one
            c = choices(self.weights, self.seed, self.epoch, b * DRAW_BLOCK, DRAW_BLOCK)
            counts = prefix[-1] + np.bincount(c, minlength=k)
            if np.all(counts <= sizes_a):
                prefix.append(counts)
                b += 1
                continue
            run = prefix[-1].copy()
            for j, src in enumerate(c.tolist()):
                if run[src] == sizes_a[src]:
                    total = b * DRAW_BLOCK + j
                    break
                run[src] += 1
        self.prefix = np.asarray(prefix, dtype=np.int64)  # counts before each whole block
        self.total = int(total)

    def before(self, p: int) -> np.ndarray:
        """Positions before mix position ``p`` that drew each source."""
        b = p // DRAW_BLOCK
        head = choices(self.weights, self.seed, self.epoch, b * DRAW_BLOCK, p - b * DRAW_BLOCK)
        drawn: np.ndarray = self.prefix[b] + np.bincount(head, minlength=len(self.weights))
        return drawn


class Mix(EpochTracking, IterableDataset[Any]):
    """Samples of several streams interleaved with ``weights`` (see the module doc)."""

    kind = "Mix"
    read_ahead_scope = "stream"  # each worker stream reads its own chunks ahead

    def __init__(self, datasets: Sequence[Any], weights: Sequence[float] | None = None, *, seed: int = 0,
                 partition: str = "pad") -> None:
        if not datasets:
            raise ValueError("mix needs at least one dataset")
        w = [1.0] * len(datasets) if weights is None else [float(x) for x in weights]
        if len(w) != len(datasets):
            raise ValueError(f"mix got {len(datasets)} datasets and {len(w)} weights: give one weight per dataset")
        if any(x < 0 for x in w) or sum(w) <= 0:
            raise ValueError(f"mix weights must be >= 0 with a positive sum, got {w}")
        if partition not in plan.PARTITION_MODES:
            raise ValueError(f"partition must be one of {plan.PARTITION_MODES}, got {partition!r}")
        sources = []
        for d in datasets:
            if isinstance(d, ShardDataset):
                d = d.stream()
            if not isinstance(d, SampleStream):
                raise TypeError(f"mix takes shard datasets or their streams (TarShards, TokenWindows, .stream()), "
                                f"not {type(d).__name__}")
            sources.append(d)
        self.sources: list[SampleStream] = sources
        self.weights = w
        self.seed = int(seed)
        self.partition = partition
        self.shuffle = False  # the order is the schedule's; EpochTracking's shuffle mode is unused
        self.batch_quantum = 1
        self.lease_items = 1024
        self._init_epochs()
        self._schedules: dict[int, Schedule] = {}
        self._layouts: dict[tuple[int, int], Any] = {}

    def __repr__(self) -> str:
        return f"Mix({len(self.sources)} sources, weights={self.weights}, seed={self.seed})"

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()
        st["_schedules"], st["_layouts"] = {}, {}
        return st

    def __len__(self) -> int:
        """Samples this rank delivers in a whole epoch of the upcoming epoch's schedule (a resumed epoch delivers
        fewer: ``len()`` stays, as torchdata's StatefulDataLoader keeps it)."""
        return plan.per_rank(self.epoch_items(self.upcoming_epoch()), dist_info().world, self.partition)

    @property
    def fingerprint(self) -> str:
        h = hashlib.blake2b(digest_size=12)
        for s in self.sources:
            h.update(f"{s.dataset.fingerprint}:{s.seed}:{bool(s.shuffle)}:{s.shuffle_window}\n".encode())
        h.update(repr((self.weights, self.seed)).encode())
        return h.hexdigest()

    # ------------------------------------------------------------ plan

    def schedule(self, epoch: int) -> Schedule:
        """The mix order of ``epoch``."""
        s = self._schedules.get(epoch)
        if s is None:
            s = Schedule(self.weights, self.seed, epoch, [src.dataset.num_samples for src in self.sources])
            self._schedules = {epoch: s}
        return s

    def source_layout(self, k: int, epoch: int) -> Any:
        """Source ``k``'s order in ``epoch`` as the mix reads it (global: a mix spreads sources over ranks)."""
        key = (k, epoch)
        lay = self._layouts.get(key)
        if lay is None:
            s = self.sources[k]
            lay = sample_layout(s.dataset.group_sizes, shuffle="global" if s.shuffle else False, seed=s.seed,
                                epoch=epoch, window=s.shuffle_window)
            self._layouts[key] = lay
        return lay

    def epoch_items(self, epoch: int) -> int:
        """Items of a whole ``epoch`` (a resume's rest aside): what ``len()`` and the loader's length count."""
        return self.schedule(epoch).total

    def epoch_plan(self, epoch: int) -> tuple[list[plan.Range], None]:
        return self._resumed_pool(epoch, self.schedule(epoch).total), None

    def stream_ranges(self, epoch: int, rank: int, world: int, worker: int, num_workers: int) -> list[plan.Range]:
        """Mix positions stream (rank, worker) delivers, in order (the rest of its own, after a stream's state)."""
        return self._stream_ranges(epoch, rank, world, worker, num_workers)

    def positions_of(self, epoch: int, a: int, b: int) -> tuple[np.ndarray, list[tuple[int, int]]]:
        """Sources drawn at mix positions ``a..b`` and, per source, the run of its order they take."""
        sch = self.schedule(epoch)
        c = choices(self.weights, self.seed, epoch, a, b - a)
        q = sch.before(a)
        counts = np.bincount(c, minlength=len(self.sources))
        return c, [(int(q[k]), int(q[k] + counts[k])) for k in range(len(self.sources))]

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        return telemetry.fetch_timed(self._iterate(self._iteration_ticket()))  # timed when a user's wrapper iterates it

    def _iterate(self, ticket: int) -> Iterator[Any]:
        self._check_consumer()  # Accelerate splitting again or skipping twice, a stateless wrapper resumed
        if get_worker_info() is None:
            epoch = self.begin_epoch(ticket=ticket)
        else:
            root = self.sources[0].dataset.cache.root
            epoch = self._worker_epoch(os.path.join(root, "locks", f"epoch-{self._epoch_id}.lock"), ticket)
        progress = self._open_progress(epoch)
        rank, world, _, _, worker, nworkers = dist_info()
        readers = [s.stream_reader(f"m{worker}-{k}") for k, s in enumerate(self.sources)]
        try:
            for a, b in self.stream_ranges(epoch, rank, world, worker, nworkers):
                c, runs = self.positions_of(epoch, a, b)
                gens: list[Generator[Any, None, None]] = []
                for k, (lo, hi) in enumerate(runs):
                    lay = self.source_layout(k, epoch)
                    gens.append(self.sources[k].read_segments(readers[k], lay, lay.segments([(lo, hi)])))
                try:
                    for k in c.tolist():
                        sample = next(gens[k])
                        progress.count += 1
                        yield sample
                finally:
                    for g in gens:
                        g.close()
            progress.ended = True
        finally:
            for r in readers:
                r.close()

    def describe_item(self, index: int) -> tuple[str, int]:
        """The chunk a fetch record names (each source numbers its own chunks: exact for one source)."""
        if len(self.sources) == 1:
            return self.sources[0].describe_item(index)
        return f"chunk {index} of one of {len(self.sources)} mixed sources", 0

    # ------------------------------------------------------------ resume

    def make_state(self, epoch: int, delivered: Sequence[int], *, world: int, num_workers: int) -> dict[str, Any]:
        """Resume state after stream ``s`` (rank-major) delivered ``delivered[s]`` samples of ``epoch``."""
        pool, _ = self.epoch_plan(epoch)
        left = plan.remaining_pool(pool, world, num_workers, self.partition, self.batch_quantum, list(delivered))
        return {"version": STATE_VERSION, "kind": self.kind, "epoch": int(epoch), "seed": self.seed,
                "weights": list(self.weights), "partition": self.partition, "fingerprint": self.fingerprint,
                "total": self.schedule(epoch).total, "pool": [list(x) for x in left],
                "remaining": plan.ranges_len(left)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration delivers exactly the samples not yet delivered in the saved epoch
        (any world size or number of workers). The same sources, weights and seeds are needed."""
        check_state_kind(state, self.kind)
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported Mix state version {state.get('version')!r}")
        if state["fingerprint"] != self.fingerprint:
            raise ListingChangedError("this Mix state was saved with other sources, weights or seeds (or their files "
                                      "changed): mix the same streams with the same weights and seed to resume")
        self._arm_resume(state)


def mix(datasets: Sequence[Any], weights: Sequence[float] | None = None, *, seed: int = 0,
        partition: str = "pad") -> Mix:
    """Interleave shard streams with ``weights`` (default equal): ``ucmagic.mix([a, b], [0.7, 0.3])``."""
    return Mix(datasets, weights, seed=seed, partition=partition)
