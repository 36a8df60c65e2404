"""``ucmagic.DataLoader``: torch's DataLoader with tuned defaults, per-batch telemetry, MLflow
logging and exact (elastic) mid-epoch resume.

Resume counts the batches the training loop *received* in the current epoch (not what workers
prefetched) and turns that count into items per worker stream with the round-robin model in
:mod:`ucmagic.files.plan`. For a :class:`~ucmagic.files.dataset.UCVolumeDataset` the state is the epoch's
remaining pool (position ranges), valid for any ``num_workers`` and world size; the loader drives
such planned datasets only through :class:`ucmagic.files.planned.PlannedDataset`. A map-style dataset
given without a sampler is split over the ranks by the loader's own sampler and resumes from the
positions of its epoch order left (any layout); with the user's sampler, by skipping the delivered
batches (same world size); other iterable datasets by skipping delivered batches with the same layout.
"""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Callable, Iterator, Mapping

import numpy.random  # noqa: F401  (workers seed it; importing it in a forked child can hit a stale import lock)
import torch
import torch.utils.data as tud

from .. import _torch_compat as compat
from .._util import frozen_for_fork, is_integer
from ..files import plan
from ..dist import all_gather_ints, dist_info
from ..files.planned import LoaderNeeds, PlannedDataset, stream_lengths, wrapped_planned
from ..errors import InvalidArgumentError, ListingChangedError, ResumeLayoutError
from .consumers import caller_lookahead
from .loader_stats import LoaderStats
from .mlflow_sink import cache_gauges
from .samplers import END, ResumableIndexSampler, SplitSampler, StageIndexSampler, order_seed
from ..presenters import presenter
from ..telemetry import ItemCollate, StageMode, idle_seconds, set_fetch_timing

__all__ = ["DataLoader"]

DEFAULT_NUM_WORKERS = 6
DEFAULT_PREFETCH_FACTOR = 4
STATE_VERSION = 1

BatchCallback = Callable[["DataLoader", LoaderStats], None]
EndCallback = Callable[["DataLoader", LoaderStats, "BaseException | None"], None]


_UNSET: Any = object()  # batch_size not given (torch's default is 1)


def default_num_workers(needs: LoaderNeeds | None = None) -> int:
    """The default worker count for a dataset with ``needs`` (a planned dataset's :attr:`loader_needs`).

    Its ``num_workers`` when it names one (a ``ParquetDataset``: 0, its decoding already runs on a
    read-ahead thread and every batch crossing processes costs more than it brings). Otherwise 6
    worker processes, or as many as there are CPUs if fewer; ucmagic's file I/O runs on threads
    inside each iterating process, so workers are only needed for decoding, and more processes than
    CPUs slow the epoch down, cost memory and make torch warn.
    """
    if needs is not None and needs.num_workers is not None:
        return needs.num_workers
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(DEFAULT_NUM_WORKERS, cpus))


def _shutdown_held(held: list[Any], channels: list[Any]) -> None:
    """Stop the persistent workers of the iterators in ``held`` (the loader's finaliser). Their
    streams are retired first (``channels``: the loader's consumption channel, if any): a worker
    whose fill waits for room the stopped loop will never free goes on at once, instead of making
    torch wait out its join timeout (5 s per worker) at exit."""
    if held:
        for chan in channels:
            chan.retire()
    while held:
        compat.shutdown_workers(held.pop())


def _rank_streams(ds: PlannedDataset, epoch: int, num_workers: int) -> list[int]:
    """Items of each of this rank's worker streams of ``ds`` in ``epoch``."""
    rank, world = dist_info()[:2]
    nw = max(1, num_workers)
    return stream_lengths(ds, epoch, world, nw)[rank * nw:(rank + 1) * nw]


def _own_random_sampler(loader: tud.DataLoader[Any], generator: torch.Generator | None
                        ) -> tuple[int | None, torch.Generator | None]:
    """Make a RandomSampler's order depend only on (seed, epoch), so a resume can replay it: the
    loader's ``(seed, generator)`` to reseed per epoch, ``(None, None)`` when it is not its own."""
    s: Any = loader.sampler
    if not isinstance(s, tud.RandomSampler):
        s = getattr(loader.batch_sampler, "sampler", None)
    if not isinstance(s, tud.RandomSampler) or (s.generator is not None and s.generator is not generator):
        return None, None
    seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
    s.generator = torch.Generator()
    return seed, s.generator


# ------------------------------------------------------------------ the loader

# Each loader's persistent-worker iterator and consumption channel, for its finaliser (see __init__)
_HELD: weakref.WeakKeyDictionary[Any, tuple[list[Any], list[Any]]] = weakref.WeakKeyDictionary()


class DataLoader(tud.DataLoader[Any]):
    """Drop-in ``torch.utils.data.DataLoader`` tuned for slow volumes, with timing and resume.

    Defaults differ from torch's only where torch's are slow: ``num_workers=6`` (fewer on
    machines with fewer CPUs; 0 for a ``ParquetDataset``, which decodes on its own thread),
    ``prefetch_factor=4`` and ``persistent_workers=True`` when there are workers, ``pin_memory``
    when CUDA is available. Every argument you pass wins. Works with any dataset.

    Extra keyword arguments:
        log_to_mlflow: ``None`` (default) logs to the active MLflow run or ``$MLFLOW_RUN_ID`` when
            there is one; ``False`` never logs.
        log_interval: seconds between buffered MLflow writes.

    ``loader.stats`` holds per-batch timings; ``state_dict()``/``load_state_dict()`` resume
    mid-epoch; ``add_batch_callback(fn)`` calls ``fn(loader, stats)`` after every batch;
    ``monitor()`` shows a live display in a notebook.
    """

    dataset: Any  # any torch dataset; planned ones (files.planned.PlannedDataset) add configure, epoch_plan, ...

    def __init__(self, dataset: Any, batch_size: int | None = _UNSET, shuffle: bool | None = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int | None = None,
                 collate_fn: Callable[..., Any] | None = None, pin_memory: bool | None = None,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Callable[[int], None] | None = None,
                 multiprocessing_context: Any = None,
                 generator: torch.Generator | None = None, *, prefetch_factor: int | None = None,
                 persistent_workers: bool | None = None, log_to_mlflow: bool | None = None,
                 log_interval: float = 5.0, **kwargs: Any) -> None:
        planned = dataset if isinstance(dataset, PlannedDataset) else None
        kind = planned.kind if planned is not None else None
        needs = planned.loader_needs if planned is not None else None
        uc = planned is not None
        if uc and shuffle:
            raise ValueError(f"shuffle goes to the dataset, not the loader: {kind}(path, shuffle=True)")
        if needs is not None and needs.yields_batches:
            if batch_size is not _UNSET and batch_size is not None:
                raise ValueError(f"{kind} yields whole batches already: leave the loader's batch_size unset "
                                 f"(or None) and set it on the dataset: {kind}(path, batch_size=...)")
            batch_size = None
        elif batch_size is _UNSET:
            batch_size = 1
        if batch_size is not None and (not is_integer(batch_size) or batch_size < 1):
            raise InvalidArgumentError(f"batch_size must be a positive int (or None: the dataset yields batches), "
                                       f"got {batch_size!r}")
        if num_workers is None:
            num_workers = default_num_workers(needs)
        if prefetch_factor is None and num_workers > 0:
            prefetch_factor = DEFAULT_PREFETCH_FACTOR
        if persistent_workers is None:
            persistent_workers = num_workers > 0
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        split: SplitSampler | None = None
        if not uc and sampler is None and batch_sampler is None and not isinstance(dataset, tud.IterableDataset):
            # a map-style dataset: ucmagic splits it over the ranks itself (exact, and resumable on any layout)
            sampler = split = SplitSampler(dataset, bool(shuffle))
            shuffle = None
        # by keyword: Lightning re-creates a loader from the arguments its first __init__ call saw (to add
        # a DistributedSampler), which is this one when the class was imported after Lightning patched them
        super().__init__(dataset, batch_size=batch_size, shuffle=shuffle, sampler=sampler,
                         batch_sampler=batch_sampler, num_workers=num_workers, collate_fn=collate_fn,
                         pin_memory=pin_memory, drop_last=drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
                         multiprocessing_context=multiprocessing_context, generator=generator,
                         prefetch_factor=prefetch_factor, persistent_workers=persistent_workers, **kwargs)
        self._uc = uc
        self._uc_kind = kind
        self._uc_needs = needs
        self.log_to_mlflow = log_to_mlflow
        self.log_interval = float(log_interval)
        self._batch_callbacks: list[BatchCallback] = []
        self._end_callbacks: list[EndCallback] = []
        self._step = 0  # batches delivered since creation (MLflow step); restored on resume
        self._epoch_batches = 0  # batches delivered to the loop in the current epoch
        self._epoch_complete = False
        self._epoch: int | None = None  # epoch of the current/last iteration
        self._fresh = True  # the next iteration keeps self._epoch (start or after set_epoch/resume)
        self._started = False  # an iteration began since creation / set_epoch / load_state_dict
        self._lookahead = 0  # batches the iterating code holds ahead of the one it uses (Lightning: 1)
        self._lengths: list[int] = []  # this rank's worker stream lengths (UCVolumeDataset)
        self._pending_skip = [0]  # batches to skip at the next iteration (non-UC resume)
        self._sampler_gen: torch.Generator | None = None
        self._sampler_seed: int | None = None
        self._split = split  # the loader's own rank-splitting sampler (map-style dataset without sampler=)
        self._seed_agreed = False  # the ranks agreed on _sampler_seed (a gather at the first epoch)
        self._next_pool: plan.Ranges | None = None  # the pool of the next epoch (a resume's rest), None: whole
        self._epoch_pool: plan.Ranges = []  # the pool the current epoch started with
        self._consumed: Any = None  # the dataset's consumption channel (UCVolumeDataset)
        # Persistent workers are shut down by a finaliser that holds their iterator: when the loader
        # dies inside a reference cycle (a callback that refers to it), the iterator's queues are
        # still alive when the workers are told to stop, so nobody waits for join timeouts. The
        # iterator and the consumption channel it holds live beside the loader (_HELD), not in its
        # __dict__: Lightning re-creates a loader (to add a DistributedSampler) and copies the old
        # one's attributes into it, and the old one's finaliser then stopped the new one's workers.
        held: list[Any] = []
        channels: list[Any] = []
        _HELD[self] = (held, channels)
        weakref.finalize(self, _shutdown_held, held, channels)
        if uc:
            self._configure_dataset()
        elif split is not None:
            self._sampler_seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        elif compat.is_map_style(self):
            self._sampler_seed, self._sampler_gen = _own_random_sampler(self, generator)
        # the seed's pattern: a wrapper IterableDataset over a UCVolumeDataset; the loop's consumption
        # reaches the inner dataset, so its protection follows the loop as without the wrapper
        self._wrapped = None if uc else wrapped_planned(dataset)
        if self._wrapped is not None:
            self._set_channel(self._wrapped.consumption_channel())
            # batch-aligned streams as without the wrapper: the fills of the whole batch the loop
            # waits for may go over a budget (with the default quantum of 1 only its first could,
            # and a budget under one batch waited for room forever); the loader sets its epochs as
            # without the wrapper, so a resume knows the epoch and its order (elastic, exact)
            self._configure_planned(self._wrapped)
        planned = self._planned
        scope = getattr(planned, "read_ahead_scope", None)
        self.stats = LoaderStats(planned if planned is not None else dataset, setup={
            "num_workers": num_workers, "prefetch_factor": prefetch_factor or 0, "batch_size": batch_size or 1,
            "dataset": planned.kind if planned is not None else type(dataset).__name__,
            "cache_limit": getattr(getattr(planned, "cache", None), "limit", None),
            # how the dataset reads ahead: per rank (files) or per worker stream (shards); its prefetch= (in flight)
            "read_ahead": scope, "read_depth": getattr(planned, "prefetch", None) if scope == "rank" else None})

    @property
    def _is_accelerate_prepared(self) -> bool:
        """What HF Accelerate's ``prepare()`` asks before it rebuilds a loader as torch's and splits its
        data over the ranks again (IterableDatasetShard, or rank 0 reading for all: half the data lost,
        silently): True (leave this loader, its resume state and telemetry as they are) when its data is
        split per rank already (ucmagic's datasets, a wrapper of one, a DistributedSampler)."""
        told = self.__dict__.get("_accelerate_prepared")  # Accelerate sets it after preparing
        if told is not None:
            return bool(told)
        samplers = (self.sampler, getattr(self.batch_sampler, "sampler", None))
        return self._uc or self._wrapped is not None or any(isinstance(s, tud.DistributedSampler) for s in samplers)

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self.__dict__["_accelerate_prepared"] = bool(value)

    # -- setup
    def _configure_dataset(self) -> None:
        """Batch-aligned worker streams; epochs set here; a UCVolumeDataset learns what the loop consumed."""
        self._configure_planned(self.dataset)
        if self._consumed is None:
            self._set_channel(self.dataset.consumption_channel())

    def _configure_planned(self, ds: PlannedDataset) -> None:
        bs = self.batch_size or 1
        ds.configure(batch_quantum=bs, lease_items=((self.prefetch_factor or 0) + 3) * bs)

    @property
    def _planned(self) -> PlannedDataset | None:
        """The planned dataset whose epochs and resume state this loader keeps: the dataset itself, or
        the one a user's wrapper iterates (the seeds' pattern), else None."""
        return self.dataset if self._uc else self._wrapped

    def _set_channel(self, chan: Any) -> None:
        self._consumed = chan
        _HELD[self][1][:] = [] if chan is None else [chan]  # a dataset that needs no reports has none

    def _report_consumed(self) -> None:
        """Tell the workers how many items of each stream the loop has finished with: every batch
        received before the ``next()`` being called now. Their protection of those items ends."""
        chan = self._consumed
        if chan is None:
            return
        for i, n in enumerate(self._items_delivered()):
            chan[i] = n

    def _batches_used(self) -> int:
        """Batches of this epoch the training step has had: every batch received, but for one a
        consumer that fetches ahead (Lightning) still holds, until the epoch ran out."""
        if self._epoch_complete:
            return self._epoch_batches
        return max(0, self._epoch_batches - self._lookahead)

    def _items_delivered(self) -> list[int]:
        """Items of each of this rank's worker streams in the batches the loop received this epoch."""
        used = self._batches_used()
        if self._uc_needs is not None and self._uc_needs.yields_batches:  # each item is one of the dataset's batches
            return plan.items_delivered(self._lengths, self.dataset.batch_quantum, False, used)
        return plan.items_delivered(self._lengths, self.batch_size, self.drop_last, used)

    @property
    def _index_sampler(self) -> Any:
        inner = compat.base_index_sampler(self)
        pending = self.__dict__.get("_pending_skip")
        if pending is not None and compat.is_map_style(self):
            inner = ResumableIndexSampler(inner, pending)
        if pending is None:  # torch's own __init__ asking
            return inner
        return StageIndexSampler(inner, self.num_workers > 0)

    @property
    def _skip_batches(self) -> int:
        """Batches the next iteration skips (set by load_state_dict for datasets other than UCVolumeDataset)."""
        return self._pending_skip[0]

    @_skip_batches.setter
    def _skip_batches(self, n: int) -> None:
        self._pending_skip[0] = int(n)

    def __len__(self) -> int:
        """Batches per epoch, as torch counts them; for a ucmagic dataset or a user's wrapper around one (which
        has no length of its own): the batches this rank's loop receives in a whole epoch. A resumed epoch
        delivers fewer, and the length stays (torchdata's StatefulDataLoader keeps it too): trainers that count
        an epoch's steps once (HF ``Trainer``, Lightning) count whole epochs."""
        planned = self._planned
        if planned is None or self.batch_size is None:
            return super().__len__()
        self._configure_planned(planned)
        rank, world = dist_info()[:2]
        total = planned.epoch_items(planned.upcoming_epoch())
        return plan.rank_batches(total, world, rank, max(1, self.num_workers), planned.partition,
                                 planned.batch_quantum, self.batch_size, self.drop_last)

    # -- callbacks
    def add_batch_callback(self, fn: BatchCallback) -> BatchCallback:
        """Call ``fn(loader, stats)`` on the main thread after each batch (before the loop gets it)."""
        self._batch_callbacks.append(fn)
        return fn

    def remove_batch_callback(self, fn: BatchCallback) -> None:
        self._batch_callbacks.remove(fn)

    def add_epoch_end_callback(self, fn: EndCallback) -> EndCallback:
        """Call ``fn(loader, stats, error)`` when an iteration ends: ``error`` is the exception that
        stopped it, or None when the epoch finished or the loop left early (``break``)."""
        self._end_callbacks.append(fn)
        return fn

    def remove_epoch_end_callback(self, fn: EndCallback) -> None:
        self._end_callbacks.remove(fn)

    def monitor(self, **kw: Any) -> Any:
        """Live display of this loader (widget in a notebook, one text line elsewhere)."""
        return presenter("monitor")(self, **kw)

    # -- epochs
    @property
    def epoch(self) -> int:
        planned = self._planned
        if planned is not None:
            return planned.epoch
        return self._epoch if self._epoch is not None else 0

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch of the next iteration (forwarded to the dataset and sampler when they have set_epoch)."""
        split = self._split
        if split is not None and self._started and self._epoch_batches == 0 and int(epoch) == self._epoch:
            self._next_pool = split.pool  # the same epoch again before any batch (Lightning): a resume's rest stays
        self._epoch, self._fresh = int(epoch), True
        self._started = False
        seen: list[Any] = []
        for obj in (self.dataset, self._wrapped, self.sampler, getattr(self.batch_sampler, "sampler", None)):
            fn = getattr(obj, "set_epoch", None)
            if callable(fn) and not any(obj is o for o in seen):
                seen.append(obj)
                fn(int(epoch))

    def _begin_epoch(self) -> None:
        planned = self._planned
        if planned is not None:
            planned.claim_iteration(self)  # before anything of the epoch changes: a refusal leaves all as it was
            self._configure_planned(planned)
            # num_workers=0: the dataset's own __iter__ runs next here and must not advance the epoch again
            self._epoch = planned.begin_epoch(hand_over=self.num_workers == 0)
            self._lengths = _rank_streams(planned, self._epoch, self.num_workers)
            if self._consumed is not None:
                self._consumed.reset(len(self._lengths))
        else:
            if self._epoch is None:
                self._epoch = 0
            elif not self._fresh:
                self._epoch += 1
            self._fresh = False
            if self._sampler_gen is not None and self._sampler_seed is not None:  # set together
                self._sampler_gen.manual_seed(order_seed(self._sampler_seed, self._epoch))
            if self._split is not None:
                self._begin_split_epoch(self._split)
        self._epoch_batches = 0
        self._epoch_complete = False
        self._started = True
        self.stats.begin_epoch(self._epoch)

    def _agree_seed(self) -> None:
        """Every rank orders the epoch with one seed: rank 0's, gathered once when a process group is up
        (each process drew its own from torch's generator)."""
        world = dist_info(from_env=False).world
        if not self._seed_agreed and world > 1 and self._split is not None and self._split.shuffle:
            self._sampler_seed = all_gather_ints([int(self._sampler_seed or 0)], world)[0]
        self._seed_agreed = True

    def _begin_split_epoch(self, split: SplitSampler) -> None:
        self._agree_seed()
        split.seed, split.epoch = int(self._sampler_seed or 0), int(self._epoch or 0)
        split.pool, self._next_pool = self._next_pool, None
        self._epoch_pool = split.epoch_pool()

    def _split_state(self, split: SplitSampler, world: int) -> dict[str, Any]:
        """What the epoch has left, as a pool of positions of its order: valid on any world size."""
        if self._started and self._epoch_complete:
            return {"epoch": int(self._epoch or 0), "pool": None, "complete": True}
        pool: plan.Ranges | None
        if self._started:
            used = self._batches_used()
            share = plan.ranges_len(split.share(self._epoch_pool))
            mine = min(share, used * self.batch_size) if self.batch_size is not None else min(share, used)
            delivered = all_gather_ints([mine], world)
            epoch = int(self._epoch or 0)
            pool = plan.remaining_pool(self._epoch_pool, world, 1, "pad", 1, delivered)
        else:  # the next iteration is the one to run (or resume)
            epoch = 0 if self._epoch is None else self._epoch + (0 if self._fresh else 1)
            pool = self._next_pool
        # all delivered with the end not reached yet: the resumed iteration is the epoch's empty rest, then the next
        return {"epoch": epoch, "pool": None if pool is None else [[a, b] for a, b in pool], "complete": False}

    # -- iteration
    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        began = time.perf_counter()  # starting the iteration (its workers) is part of the epoch's time
        self._lookahead = caller_lookahead(self)
        self._begin_epoch()
        skip = 0
        map_style = compat.is_map_style(self)
        if map_style:
            self._epoch_batches = self._skip_batches  # the sampler wrapper skips them (no data loaded)
        elif not self._uc:
            skip, self._skip_batches = self._skip_batches, 0
        # batches bring their items' fetch records and stage times, to this loader only: the collate_fn
        # others read (Accelerate's copy) stays the user's own
        mode = StageMode.PLANNED if self._uc else StageMode.WRAPPER if self._wrapped is not None else StageMode.OTHER
        if mode != StageMode.PLANNED:  # ucmagic's reads inside a user's dataset count as fetch
            set_fetch_timing(True)  # here and in forked workers; spawned ones turn it on with ItemCollate
        user_collate = self.collate_fn
        self.collate_fn = ItemCollate(user_collate, mode)
        try:
            with frozen_for_fork(self.num_workers > 0):  # workers start here (persistent ones the first time)
                inner = super().__iter__()
        finally:
            self.collate_fn = user_collate
        if map_style:  # every sampler iterator of this start has skipped them (see ResumableIndexSampler)
            self._skip_batches = 0
        held = _HELD[self][0]
        if compat.live_iterator(self) is not None and not held:
            held.append(compat.live_iterator(self))
        return self._timed(inner, skip, time.perf_counter() - began)

    def _make_sink(self) -> Any:
        if self.log_to_mlflow is False:
            return None
        from .mlflow_sink import MlflowSink

        counters = self.dataset.counters if self._uc else None
        extra = cache_gauges(counters) if counters is not None else None
        rank = dist_info().rank
        return MlflowSink.for_active_run(rank, interval=self.log_interval, extra=extra)

    def _timed(self, inner: Iterator[Any], skip: int, starting: float) -> Iterator[Any]:
        stats, batch_cbs = self.stats, self._batch_callbacks
        sink = self._make_sink()
        perf = time.perf_counter
        error: BaseException | None = None
        # the loop thread's CPU over the epoch (one read at each end): how much of its compute was its own work;
        # the process's CPU and the cores that sat idle meanwhile: what the machine had free (advise())
        ident, cpu, proc_cpu, idle = threading.get_ident, time.thread_time, time.process_time, idle_seconds
        cpu0, thread, epoch = cpu(), ident(), stats.epoch
        wall0, proc0, idle0 = perf() - starting, proc_cpu(), idle()
        try:
            for _ in range(skip):  # generic iterable resume: drop what was delivered before
                if next(inner, END) is END:
                    break
                self._epoch_batches += 1
            last = None
            report = self._report_consumed if self._consumed is not None else None
            pull = compat.batch_puller(inner)  # next(inner), without torch's per-batch profiler range when none runs
            while True:
                if report is not None:
                    report()
                t0 = perf()
                try:
                    batch = pull()
                except StopIteration:
                    self._epoch_complete = True
                    return
                t1 = perf()
                batch = stats.take_items(batch)
                compute = t0 - last if last is not None else 0.0
                fetch = t1 - t0
                self._epoch_batches += 1
                step = self._step
                self._step += 1
                stats.record_batch(fetch, compute)
                if sink is not None:
                    sink.add(step, fetch, compute, stats.last_stages)
                for cb in batch_cbs:
                    cb(self, stats)
                last = t1
                yield batch
        except GeneratorExit:
            raise
        except BaseException as exc:
            error = exc
            raise
        finally:
            if not self._epoch_complete and self._consumed is not None:
                # left (break, an error, Ctrl-C): nothing will consume this iteration's items any more, so
                # its streams go stale now; workers whose fills wait for room go on and see torch's stop
                self._consumed.retire()
            planned = self._planned
            if planned is not None:
                planned.release_iteration(self)
            if sink is not None:
                sink.close()
            if ident() == thread:  # closed from another thread: its clock is not this loop's
                stats.add_loop_cpu(epoch, cpu() - cpu0)
                try:  # best effort: closed at interpreter exit, the builtins /proc/stat needs may be gone
                    idle1 = idle()
                    stats.add_epoch_resources(epoch, wall=perf() - wall0, cpu=proc_cpu() - proc0,
                                              idle=None if idle0 is None or idle1 is None else idle1 - idle0)
                except Exception:  # noqa: BLE001, S110 - nothing to report it to then
                    pass
            for end_cb in self._end_callbacks:
                end_cb(self, stats, error)

    # -- resume
    def state_dict(self) -> dict[str, Any]:
        """What the training loop received so far in this epoch; small and JSON-serialisable.

        With several ranks every rank must call it (it gathers the per-rank counts).
        """
        if self.num_workers > 0 and not getattr(self, "in_order", True):
            raise RuntimeError("state_dict() needs in_order=True (the default): with in_order=False the "
                               "order batches reach the loop is not reproducible")
        rank, world = dist_info()[:2]
        if self._uc:
            return {"version": STATE_VERSION, "kind": self._uc_kind, **self._planned_state(self.dataset, world)}
        if self._wrapped is not None:  # the wrapped dataset's state: elastic, and its epoch's own order
            return {"version": STATE_VERSION, "kind": "iterable", "wraps": self._wrapped.kind,
                    **self._planned_state(self._wrapped, world)}
        if self._started:
            epoch, batches, complete = self._epoch, self._batches_used(), self._epoch_complete
        else:  # the next iteration is the one to run (or resume)
            nxt = 0 if self._epoch is None else self._epoch + (0 if self._fresh else 1)
            epoch, batches, complete = nxt, self._skip_batches, False
        base = {"version": STATE_VERSION, "epoch": epoch, "batches": batches, "complete": complete,
                "world": world, "num_workers": self.num_workers, "step": self._step}
        if self._split is not None:  # the rest as positions of the epoch's order: any layout
            split = self._split_state(self._split, world)
            return {**base, **split, "batches": batches if split["pool"] is not None or split["complete"] else 0,
                    "kind": "map", "len": len(self.dataset), "sampler_seed": self._sampler_seed, "split": True}
        if compat.is_map_style(self):
            sampler: Any = getattr(self.batch_sampler, "sampler", None) or self.sampler
            return {**base, "kind": "map", "len": len(self.dataset), "sampler_seed": self._sampler_seed,
                    "sampler_epoch": getattr(sampler, "epoch", None)}
        return {**base, "kind": "iterable"}

    def _planned_state(self, ds: PlannedDataset, world: int) -> dict[str, Any]:
        """``dataset`` (the planned dataset's own state: what its epoch has left), ``batches``, ``step``."""
        nw = max(1, self.num_workers)
        if not self._started:  # the upcoming epoch (or the loaded remainder) is all still to deliver
            epoch = ds.upcoming_epoch()
            self._configure_planned(ds)
            mine = [0] * nw
        else:
            epoch = self._epoch if self._epoch is not None else ds.epoch
            mine = list(self._lengths) if self._epoch_complete else self._items_delivered()
        delivered = all_gather_ints(mine, world)
        state = ds.make_state(epoch, delivered, world=world, num_workers=nw)
        # the loop saw the end of the epoch (StopIteration): a resume goes on with the next epoch; all delivered but
        # the loop still running: the resumed iteration is the epoch's empty rest, then the next (StatefulDataLoader)
        state["ended"] = bool(self._started and self._epoch_complete)
        return {"dataset": state, "epoch": int(state["epoch"]), "batches": self._batches_used(), "step": self._step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration delivers exactly what the saved epoch had not delivered yet.

        For a ucmagic dataset, or a user's wrapper around one, this works with another ``num_workers``
        or world size, and raises :class:`~ucmagic.errors.ListingChangedError` when the files changed;
        a map-style dataset resumes with any ``num_workers``; a user's own ``IterableDataset`` only on
        the layout it was saved with (else :class:`~ucmagic.errors.ResumeLayoutError`). Live persistent
        workers are shut down so the new plan reaches fresh ones.
        """
        if not isinstance(state, Mapping) or "version" not in state or "kind" not in state:
            what = f"a dict with keys {sorted(map(str, state))}" if isinstance(state, Mapping) else type(state).__name__
            raise InvalidArgumentError(f"load_state_dict takes what ucmagic.DataLoader.state_dict() returned, "
                                       f"got {what}")
        if state.get("version") != STATE_VERSION:
            raise InvalidArgumentError(f"unsupported ucmagic.DataLoader state version {state.get('version')!r} "
                                       f"(this ucmagic writes and reads version {STATE_VERSION!r})")
        kind = state.get("kind")
        expected = self._uc_kind or ("map" if compat.is_map_style(self) else "iterable")
        if kind != expected:
            raise ValueError(f"this state was saved from a loader over a {kind} dataset; this loader's "
                             f"dataset is {expected}: load it into the same kind of dataset")
        planned = self._planned
        if planned is not None and "dataset" in state:
            # the dataset arms it for the next iteration; a state saved once the epoch had ended goes on with the
            # next epoch, one saved at its last batch with the loop still running with the epoch's empty rest
            planned.load_state_dict(state["dataset"])
        elif "dataset" in state:
            raise ValueError(f"this state was saved from a loader over a wrapper of a {state.get('wraps')}; this "
                             "loader's dataset wraps none: load it into a loader over the same wrapper")
        else:
            self._load_generic(state)
        self._shutdown_workers()
        self._step = int(state.get("step", 0))
        self._epoch_batches = 0
        self._epoch_complete = False
        self._started = False

    def _load_generic(self, state: dict[str, Any]) -> None:
        rank, world = dist_info()[:2]
        if state["kind"] == "map":
            if state["len"] != len(self.dataset):
                raise ListingChangedError(f"the dataset has {len(self.dataset)} items but the state was saved with "
                                          f"{state['len']}: resume needs the same dataset")
            if state.get("sampler_seed") is not None:
                self._sampler_seed = int(state["sampler_seed"])
                self._seed_agreed = True
            if state.get("split") and self._split is not None:  # ucmagic's own split: any world size
                self._epoch, self._skip_batches, self._fresh = int(state["epoch"]) + bool(state["complete"]), 0, True
                pool = None if state["complete"] or state["pool"] is None else state["pool"]
                self._next_pool = None if pool is None else [(int(a), int(b)) for a, b in pool]
                if self._started and self._epoch_batches == 0:  # an iteration began, no batch taken yet
                    split = self._split
                    split.seed, split.epoch, split.pool = int(self._sampler_seed or 0), self._epoch, self._next_pool
                return
            sampler: Any = getattr(self.batch_sampler, "sampler", None) or self.sampler
            if state.get("split"):
                raise ResumeLayoutError(
                    f"this state was saved by a ucmagic.DataLoader that split the map-style dataset itself (no "
                    f"sampler=); this loader has your {type(sampler).__name__}, whose order ucmagic does not know: "
                    "build the loader without sampler= / batch_sampler= to resume it")
            if state["world"] != world:
                raise ResumeLayoutError(
                    f"this map-style dataset's state was saved on world_size={state['world']}, not {world}, with "
                    f"your own {type(sampler).__name__}, which splits the epoch by world size in an order ucmagic "
                    f"cannot re-split: resume on {state['world']} ranks (any num_workers), or leave the sampler "
                    "to ucmagic.DataLoader (no sampler=: it splits over ranks itself and resumes on any)")
            if state.get("sampler_epoch") is not None and callable(getattr(sampler, "set_epoch", None)):
                sampler.set_epoch(int(state["sampler_epoch"]))
        elif state["num_workers"] != self.num_workers or state["world"] != world:
            raise ResumeLayoutError(
                f"this state of your own IterableDataset was saved with num_workers={state['num_workers']}, "
                f"world_size={state['world']}; this loader has num_workers={self.num_workers}, world_size={world}: "
                "it resumes by skipping the batches each worker delivered, so pass the same num_workers and world "
                "size, or build it on a ucmagic dataset (a wrapper around UCVolumeDataset resumes on any)")
        if state["complete"]:
            self._epoch, self._skip_batches = int(state["epoch"]) + 1, 0
        else:
            self._epoch, self._skip_batches = int(state["epoch"]), int(state["batches"])
        self._fresh = True
        fn = getattr(self.dataset, "set_epoch", None)
        if callable(fn):
            fn(self._epoch)

    def _shutdown_workers(self) -> None:
        held, channels = _HELD[self]
        _shutdown_held(held, channels)
        if compat.live_iterator(self) is not None:
            _shutdown_held([compat.live_iterator(self)], channels)
            compat.forget_iterator(self)
