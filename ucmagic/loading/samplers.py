"""The index samplers ``ucmagic.DataLoader`` puts in front of torch's: skipping what a resume
delivered already (:class:`ResumableIndexSampler`), marking where each batch starts in the process
that produces it (:class:`StageIndexSampler`), and splitting a map-style dataset over the ranks
(:class:`SplitSampler`)."""
from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.utils.data as tud

from ..dist import dist_info
from ..errors import ResumeRecipeError
from ..files import plan
from ..files.foreign_loaders import accelerate_skipping
from ..telemetry import BatchStart, batch_started


class StageIndexSampler:
    """Wraps the loader's index sampler: each index marks its batch's start where the batch is made.

    With workers it yields :class:`~ucmagic.telemetry.BatchStart` (a worker unpickling it starts its
    clock and gets the index itself); with ``num_workers=0`` the batch is made right after the index
    is drawn, so drawing it starts the clock. One clock read per batch.
    """

    def __init__(self, inner: Any, workers: bool) -> None:
        self.inner = inner
        self.workers = workers

    def __iter__(self) -> Iterator[Any]:
        if self.workers:
            return map(BatchStart, iter(self.inner))
        return self._marking(iter(self.inner))

    @staticmethod
    def _marking(it: Iterator[Any]) -> Iterator[Any]:
        for index in it:
            batch_started()
            yield index

    def __len__(self) -> int:
        return len(self.inner)


class ResumableIndexSampler:
    """Wraps the loader's index sampler: the iteration after a resume skips delivered batches.

    Every ``iter()`` taken while the loader starts that iteration skips them: torch takes two
    (one in its base iterator, one when the multi-process iterator resets), and the skip once went
    to the first only, so a resume with workers replayed the whole epoch. The skip runs at the
    first ``next()``, so the dropped iterator draws no random order. The loader clears the
    count once its iterator exists (:meth:`DataLoader.__iter__`). It shares only a one-item list
    with the loader (no reference cycle: torch shuts persistent workers down from the iterator's
    ``__del__``, which must not wait for the cycle collector).
    """

    def __init__(self, inner: Any, pending: list[int]) -> None:
        self.inner = inner
        self.pending = pending

    def __iter__(self) -> Iterator[Any]:
        return self._skipping(self.pending[0])

    def _skipping(self, skip: int) -> Iterator[Any]:
        # lazy, as torch's samplers are: the iterator torch takes and drops unused draws no random order
        it: Iterator[Any] = iter(self.inner)
        for _ in range(skip):
            if next(it, END) is END:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.inner)


END = object()


def order_seed(seed: int, epoch: int) -> int:
    """The generator seed of one epoch's order (as the loader seeds a RandomSampler's generator)."""
    return (seed * 1_000_003 + epoch) % (2**63)


class SplitSampler(tud.DistributedSampler):
    """``ucmagic.DataLoader``'s sampler for a map-style dataset given without ``sampler=``.

    One order per epoch (``torch.randperm`` from ``(seed, epoch)`` with shuffle, else ``0..n-1``:
    the order a RandomSampler/SequentialSampler gives on one rank), split over the ranks in
    contiguous shares of the epoch's *pool* (the positions of that order still to deliver: all of
    them, or what a resume left, set by the loader). Every rank gets the same count (with several
    ranks the short share is padded from the start of the pool, as ``DistributedSampler`` does), so
    collectives cannot hang. It is a ``DistributedSampler`` so trainers (Lightning, Accelerate) see
    the data is split already and add no sampler of their own. Rank and world size are read when it
    is iterated; the loader sets ``seed``, ``epoch`` and ``pool`` before each epoch.
    """

    def __init__(self, dataset: Any, shuffle: bool) -> None:  # no super().__init__: it asks for a rank now
        self.dataset: Any = dataset
        self.shuffle = bool(shuffle)
        self.seed = 0
        self.epoch = 0
        self.drop_last = False
        self.pool: plan.Ranges | None = None  # None: the whole epoch
        self.rank, self.num_replicas = 0, 1

    def epoch_pool(self) -> plan.Ranges:
        return self.pool if self.pool is not None else [(0, len(self.dataset))]

    def share(self, pool: plan.Ranges | None = None) -> plan.Ranges:
        """This rank's positions of the epoch order, in delivery order."""
        self.rank, self.num_replicas = dist_info()[:2]
        return plan.stream_positions(self.epoch_pool() if pool is None else pool, self.num_replicas, self.rank, 1, 0)

    def __iter__(self) -> Iterator[int]:
        # lazy: the pool, seed and epoch are read at the first next(), so a state loaded between iter()
        # and the first batch (Lightning restores its loaders so) is the one followed
        skipper = accelerate_skipping()
        if skipper is not None:
            raise ResumeRecipeError(
                f"HF Accelerate's skip_first_batches ({skipper}) iterates ucmagic.DataLoader's own split of your "
                "map-style dataset outside the loader, which sets that split's seed, epoch and rest at each of its "
                "iterations: the batches it skips are not the ones delivered before the save. Register the loader "
                "for checkpointing (accelerator.register_for_checkpointing(loader)) and iterate it after load_state, "
                "without skip_first_batches: it resumes exactly (docs/trainers.md)")
        pos = plan.positions(self.share())
        if not self.shuffle:
            yield from pos.tolist()
            return
        g = torch.Generator()
        g.manual_seed(order_seed(self.seed, self.epoch))
        order = torch.randperm(len(self.dataset), generator=g).numpy()
        yield from order[pos].tolist()

    def __len__(self) -> int:
        """This rank's items in a whole epoch (a resumed epoch delivers fewer): trainers that restore their
        own batch count (Lightning) end a resumed epoch at that count, and this must not be the rest's."""
        return plan.ranges_len(self.share([(0, len(self.dataset))]))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
