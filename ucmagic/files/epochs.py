"""Epochs, resume state and the contract between ``ucmagic.DataLoader`` and planned datasets.

A *planned* dataset (:class:`~ucmagic.files.dataset.UCVolumeDataset`,
:class:`~ucmagic.tables.parquet_dataset.ParquetDataset`) fixes each epoch's order up front with
:mod:`ucmagic.files.plan`, so a loader can turn "batches the training loop received" into an exact,
elastic resume state. :class:`PlannedDataset` is that contract; :class:`EpochTracking` is the
shared implementation of its epoch half. Rank and worker
identity come from :func:`ucmagic.dist.dist_info`.

Call order (one loader iteration; the loader is the only caller besides the dataset itself)::

    configure(batch_quantum=, lease_items=)   # at loader creation and before every epoch
    consumption_channel()                     # once: where the loader reports consumed items
    epoch = begin_epoch(hand_over=...)        # main process, each iteration start
    pool, _ = epoch_plan(epoch)               # the loader sizes the worker streams from it
    ... the dataset's __iter__ runs (in workers, or in this process) ...
    make_state(epoch, delivered, world=, num_workers=)   # state_dict(); upcoming_epoch() before any iteration
    load_state_dict(state)                    # resume (a state whose epoch had delivered everything
                                              # resumes at the next epoch, as finish_epoch(state["epoch"]))

Every dataset state carries ``version``, ``kind`` (the dataset's :attr:`~PlannedDataset.kind`),
``epoch``, ``pool`` and ``remaining``, built and checked by the kind's :class:`StateSchema` (the
one home of the layout). States saved before ``kind`` was added load unchanged
(:func:`check_state_kind`). What the loader adapts to (the dataset's own batches, default
workers) a kind declares in :class:`LoaderNeeds`, never through its name.
"""
from __future__ import annotations

import inspect
import sys
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

from . import plan
from .locks import file_lock
from ..dist import dist_info, local_world_size, worker_info
from .._util import is_integer
from ..errors import InvalidArgumentError, ListingChangedError, SplitTwiceError
from .._shared import SharedInt, SharedInts
from ..telemetry import SharedCounters

__all__ = ["PlannedDataset", "ConsumptionSink", "EpochTracking", "LoaderNeeds", "StateSchema", "check_state_kind",
           "stream_lengths", "wrapped_planned"]

# shared epoch-sync slots: set_epoch was called / a ucmagic.DataLoader sets epochs / last iteration key / seen one
_EXPLICIT, _MANAGED, _KEY, _SEEN = range(4)


@dataclass(frozen=True)
class LoaderNeeds:
    """What ``ucmagic.DataLoader`` adapts to for one dataset kind (:attr:`PlannedDataset.loader_needs`).

    ``yields_batches``: each item is one of the dataset's own batches of ``batch_quantum`` items, so
    the loader's ``batch_size`` stays None and a delivered batch counts ``batch_quantum`` items.
    ``num_workers``: the loader's default worker count (None: its CPU-based default).
    """

    yields_batches: bool = False
    num_workers: int | None = None


@dataclass(frozen=True)
class StateSchema:
    """One dataset kind's resume-state layout, built (:meth:`build`) and checked (:meth:`check`) here.

    Every state carries ``version``, ``kind``, ``epoch``, ``seed``, ``partition``, ``fingerprint``,
    the item count under :attr:`count` (``"files"``, ``"rows"``, ``"samples"``), ``pool`` (the
    position ranges still to deliver) and ``remaining``; kinds add their own fields (the order that
    fixed the epoch: :meth:`EpochTracking._planned_state`).
    """

    kind: str                            # the dataset's kind, stored in its states and its loader's
    version: int                         # the version states are written with
    count: str                           # key of the item count the fingerprint goes with
    older: tuple[int, ...] = ()          # older versions that still load
    legacy_kinds: tuple[str, ...] = ()   # older spellings of ``kind`` that still load
    kind_required: bool = False          # this kind's states always carried a kind: refuse one without

    def build(self, epoch: int, left: Sequence[plan.Range], *, seed: int, partition: str, fingerprint: str,
              count: int, **fields: Any) -> dict[str, Any]:
        """The state of ``epoch`` with ``left`` still to deliver (JSON-serialisable)."""
        return {"version": self.version, "kind": self.kind, "epoch": int(epoch), "seed": seed, "partition": partition,
                "fingerprint": fingerprint, self.count: count, **fields,
                "pool": [list(x) for x in left], "remaining": plan.ranges_len(left)}

    def check(self, state: Mapping[str, Any], *, fingerprint: str, count: int, what: str) -> None:
        """Raise ValueError for a state of another kind or version, ListingChangedError when ``what``
        (the dataset's files, named for the message) changed since the state was saved."""
        if self.kind_required and "kind" not in state:
            raise ValueError(f"not a {self.kind} state (version {state.get('version')!r}, no kind): "
                             "load a state this kind of dataset saved")
        check_state_kind(state, self.kind, *self.legacy_kinds)
        if state.get("version") not in (self.version, *self.older):
            raise ValueError(f"unsupported {self.kind} state version {state.get('version')!r}")
        if state["fingerprint"] != fingerprint or state[self.count] != count:
            raise ListingChangedError(
                f"{what} changed since this state was saved ({state[self.count]} {self.count} then, {count} now): "
                "resume needs the same files; start a new epoch instead (set_epoch) or restore the files")


def stream_lengths(ds: PlannedDataset, epoch: int, world: int, num_workers: int) -> list[int]:
    """Items of every (rank, worker) stream of ``ds`` in ``epoch``, rank-major: what a loader turns its
    count of delivered batches into delivered items with (:func:`ucmagic.files.plan.items_delivered`)."""
    pool, _ = ds.epoch_plan(epoch)
    spans = plan.stream_spans(plan.ranges_len(pool), world, num_workers, ds.partition, ds.batch_quantum)
    return [b - a for a, b in spans]


class ConsumptionSink(Protocol):
    """A loader's side of a dataset's consumption counters (shared memory seen by every worker)."""

    def reset(self, streams: int) -> None:
        """A new iteration with ``streams`` worker streams: nothing consumed yet, reports on."""

    def __setitem__(self, stream: int, items: int) -> None:
        """The loop has finished with the first ``items`` items of worker stream ``stream``."""


@runtime_checkable
class PlannedDataset(Protocol):
    """What ``ucmagic.DataLoader`` needs from a dataset for exact elastic resume (call order: module doc)."""

    kind: str            # "UCVolumeDataset" / "ParquetDataset": the loader state's and dataset state's kind
    partition: str       # plan.stream_spans mode ("pad" / "drop")
    batch_quantum: int   # items per stream come in multiples of this
    lease_items: int     # items each stream keeps protected without consumption reports
    loader_needs: LoaderNeeds  # batches, default workers: what the loader adapts to (no checks of kind)

    @property
    def epoch(self) -> int:
        """The current (or last) epoch."""

    @property
    def counters(self) -> SharedCounters | None:
        """Cache counters shared with the workers (hits, misses, bytes fetched), or None."""

    def set_epoch(self, epoch: int) -> None:
        """The user picks the epoch of the next iteration."""

    def configure(self, *, batch_quantum: int, lease_items: int) -> None:
        """A loader manages this dataset's epochs and batches ``batch_quantum`` items at a time."""

    def claim_iteration(self, loader: object) -> None:
        """``loader`` starts iterating this dataset object; another loader still iterating it is refused."""

    def release_iteration(self, loader: object) -> None:
        """``loader``'s iteration ended (completed, left or failed)."""

    def begin_epoch(self, *, hand_over: bool = False) -> int:
        """Start an iteration in the main process; returns its epoch (``hand_over``: see EpochTracking)."""

    def upcoming_epoch(self) -> int:
        """The epoch the next iteration will run (for a state saved before iterating)."""

    def finish_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` delivered everything: drop any resume state, the next iteration runs ``epoch + 1``."""

    def consumption_channel(self) -> ConsumptionSink | None:
        """Where the loader reports what the loop consumed, or None when the dataset needs no reports."""

    def epoch_plan(self, epoch: int) -> tuple[list[tuple[int, int]], Any]:
        """``(pool, order)`` of ``epoch``: the position ranges still to deliver and the item order."""

    def make_state(self, epoch: int, delivered: Sequence[int], *, world: int, num_workers: int) -> dict[str, Any]:
        """Resume state after stream ``s`` (rank-major) delivered ``delivered[s]`` items of ``epoch``."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from a :meth:`make_state` state (any world size or worker count)."""

    def describe_item(self, index: int) -> tuple[str, int]:
        """``(display name, bytes)`` of item ``index`` (for per-item fetch records)."""


def wrapped_planned(ds: Any, depth: int = 2) -> PlannedDataset | None:
    """The planned dataset that a wrapper dataset iterates, else None (``ds`` itself is not one).

    The seed's pattern: a user ``IterableDataset`` whose ``__iter__`` loops over a
    ``UCVolumeDataset`` it keeps as an attribute. Found as ``ds.source_dataset`` when the wrapper
    sets it (the documented hook, for wrappers holding several datasets), else as the only planned
    dataset among the wrapper's instance attributes (``vars(ds)``), up to ``depth`` wrappers deep.
    ``ucmagic.DataLoader`` reports the loop's consumption to it, counting one of its items per item
    the wrapper yields (a wrapper that yields fewer, e.g. a filter, only keeps files protected longer).
    """
    if isinstance(ds, PlannedDataset) or depth <= 0:
        return None
    hook = getattr(ds, "source_dataset", None)
    if isinstance(hook, PlannedDataset):
        return hook
    try:
        attrs = list(vars(ds).values())
    except TypeError:  # no __dict__ (slots, builtins)
        return None
    found = [a for a in attrs if isinstance(a, PlannedDataset)]
    if len(found) == 1:
        return found[0]
    if found:
        return None  # several: ambiguous without the hook
    deeper = [w for w in (wrapped_planned(a, depth - 1) for a in attrs if hasattr(a, "__iter__")
                          and not isinstance(a, (str, bytes, dict, list, tuple, set))) if w is not None]
    return deeper[0] if len(deeper) == 1 else None


def check_state_kind(state: Mapping[str, Any], kind: str, *legacy: str) -> None:
    """Raise ValueError when ``state`` was saved by another kind of dataset.

    A state without ``kind`` (saved before every state carried one) counts as ``kind``; ``legacy``
    names older spellings of the same kind.
    """
    got = state.get("kind", kind)
    if got != kind and got not in legacy:
        raise ValueError(f"this state was saved by a {got} dataset, not a {kind}: "
                         "load it into the same kind of dataset")


class EpochTracking:
    """Epoch bookkeeping shared by ucmagic's planned datasets (files and Parquet rows).

    The epoch lives in shared memory, so DataLoader workers (any start method, persistent or not)
    follow :meth:`set_epoch`. Without ``set_epoch``, each new iteration counts one epoch up: started
    in the main process, or -- when the dataset is wrapped in the user's own IterableDataset and only
    workers ever iterate it -- detected by the workers themselves (:meth:`_worker_epoch`).
    """

    kind: str
    shuffle: bool | str
    batch_quantum: int
    lease_items: int = 1024  # a loader's configure() sets it; datasets may set their own default
    loader_needs = LoaderNeeds()  # items are the dataset's items; the loader's default workers
    state_schema: StateSchema  # each kind's (kind, version, count key)
    seed: int
    partition: str
    reshuffle_every: int | None
    # The loader iterating each dataset object in this process (claim_iteration): kept outside the
    # objects, which DataLoader workers receive pickled
    _loaders: ClassVar[weakref.WeakKeyDictionary[Any, weakref.ref[object]]] = weakref.WeakKeyDictionary()

    def claim_iteration(self, loader: object) -> None:
        """``loader`` starts iterating this dataset object (in this process). Two loaders iterating one
        dataset object at once would share its epoch count and its consumption reports: each one's
        workers could follow the other's epoch (items silently duplicated and dropped) and each one's
        start would end the other's protection (files evicted before they were read). So a loader
        whose other iteration of this object is still open is refused, naming the fix."""
        ref = self._loaders.get(self)
        other = ref() if ref is not None else None
        if other is not None and other is not loader:
            raise InvalidArgumentError(
                f"this {type(self).__name__} is already being iterated by another DataLoader, whose loop has not "
                "finished: give each loader its own dataset object (created with the same arguments: they share "
                "the cache and the listing), or let that loop finish or leave it first (break, or del that loader)")
        self._loaders[self] = weakref.ref(loader)

    def release_iteration(self, loader: object) -> None:
        """``loader``'s iteration of this dataset object ended (completed, left or failed; also at
        interpreter exit, after module globals went: the registry is a class attribute)."""
        ref = self._loaders.get(self)
        if ref is not None and ref() is loader:
            del self._loaders[self]

    def _init_epochs(self) -> None:
        self._epoch = SharedInt(0)
        self._epoch_sync = SharedInts(4)
        self._epoch_id = uuid.uuid4().hex[:16]
        self._worker_iters = 0  # iterations this process's copy ran (persistent workers keep it)
        self._fresh = True  # the next begin_epoch keeps the epoch (start, set_epoch, resume, hand-over)
        self._resume: dict[str, Any] | None = None  # a loaded state, for the epoch it names

    @property
    def _epoch_explicit(self) -> bool:
        return bool(self._epoch_sync[_EXPLICIT])

    @_epoch_explicit.setter
    def _epoch_explicit(self, v: bool) -> None:
        self._epoch_sync[_EXPLICIT] = int(bool(v))

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows (same on every rank and worker)."""
        if not is_integer(epoch) or epoch < 0:
            raise InvalidArgumentError(f"set_epoch takes the epoch's number, an int >= 0, got {epoch!r}")
        self._epoch.value = int(epoch)
        self._epoch_explicit = True
        self._fresh = True

    @property
    def epoch(self) -> int:
        return self._epoch.value

    @property
    def counters(self) -> SharedCounters | None:
        """Cache counters shared with the workers, or None (datasets without a file cache)."""
        return None

    def configure(self, *, batch_quantum: int, lease_items: int) -> None:
        """A ucmagic.DataLoader batches ``batch_quantum`` items and sets each iteration's epoch in the
        main process (workers only follow it); ``lease_items`` items per stream stay protected."""
        self.batch_quantum = int(batch_quantum)
        self.lease_items = int(lease_items)
        self._epoch_sync[_MANAGED] = 1

    def begin_epoch(self, *, hand_over: bool = False) -> int:
        """Start an iteration in the main process and return its epoch: without set_epoch, epochs
        count up. ``hand_over=True``: the dataset's own ``__iter__`` in this process runs next (a
        loader with ``num_workers=0``) and starts this same epoch instead of counting up again."""
        if not self._fresh and not self._epoch_explicit:
            self._epoch.value = self._epoch.value + 1
        self._fresh = hand_over
        self._epoch_sync[_SEEN] = 1
        self._epoch_sync[_KEY] = 0
        return self._epoch.value

    def upcoming_epoch(self) -> int:
        """The epoch the next :meth:`begin_epoch` will return."""
        return self.epoch if (self._fresh or self._epoch_explicit) else self.epoch + 1

    def restart_epochs(self, epoch: int) -> None:
        """The next iteration (main process or workers) runs ``epoch`` (after a resume)."""
        self._epoch.value = int(epoch)
        self._fresh = True
        self._epoch_sync[_SEEN] = 0
        self._epoch_sync[_KEY] = 0

    def finish_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` delivered everything: forget the loaded state, the next iteration runs ``epoch + 1``."""
        self._resume = None
        self.restart_epochs(int(epoch) + 1)

    def consumption_channel(self) -> ConsumptionSink | None:
        """Where a loader reports consumed items; None: this dataset needs no reports."""
        return None

    def _worker_epoch(self, lock_path: str) -> int:
        """The epoch of this iteration, as seen from a DataLoader worker.

        The workers of one loader iteration share a base seed (``seed - id``); a persistent worker
        keeps its dataset copy, so (base seed, iterations of this copy) names the iteration. The
        first worker to see a new name counts the shared epoch up, under a file lock (no
        multiprocessing lock survives every start method). Explicit ``set_epoch`` and loaders that
        manage epochs win.
        """
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        self._worker_iters += 1
        if info is None or self._epoch_sync[_EXPLICIT] or self._epoch_sync[_MANAGED]:
            return self._epoch.value
        key = ((int(info.seed) - int(info.id)) * 1_000_003 + self._worker_iters) % (2**62) + 1
        with file_lock(lock_path):
            if self._epoch_sync[_KEY] != key:
                if self._epoch_sync[_SEEN]:
                    self._epoch.value = self._epoch.value + 1
                self._epoch_sync[_SEEN] = 1
                self._epoch_sync[_KEY] = key
        return self._epoch.value

    def _shuffle_mode(self, world: int | None = None) -> bool | str:
        """``True`` means node-affine on several nodes and global on one (``world``: default this run's)."""
        if world is None:
            world = dist_info().world
        if self.shuffle is True:
            return "node" if world > local_world_size(world) else "global"
        return self.shuffle

    # ------------------------------------------------------------ resume state (schema: StateSchema)

    def _order_params(self, epoch: int, world: int | None = None) -> tuple[bool | str, int, int]:
        """(shuffle mode, world, local world) that fix ``epoch``'s order: the saved ones when resuming it."""
        r = self._resume
        if r is not None and r["epoch"] == epoch:
            if "order_world" in r:
                return r["shuffle"], int(r["order_world"]), int(r["order_local_world"])
            return ("global" if r["shuffle"] else False), 1, 1  # a ParquetDataset state from before node shuffling
        if world is None:
            world = dist_info().world
        return self._shuffle_mode(world), world, local_world_size(world)

    def _resumed_pool(self, epoch: int, items: int) -> list[plan.Range]:
        """The positions of ``epoch`` still to deliver: the loaded state's remainder, else all ``items``."""
        r = self._resume
        if r is not None and r["epoch"] == epoch:
            return [(int(a), int(b)) for a, b in r["pool"]]
        return [(0, items)]

    def _planned_state(self, epoch: int, pool: list[plan.Range], delivered: Sequence[int], *, world: int,
                       num_workers: int, fingerprint: str, count: int, **fields: Any) -> dict[str, Any]:
        """The :attr:`state_schema` state after stream ``s`` (rank-major) delivered ``delivered[s]``
        items of ``epoch`` (whose positions are ``pool``), with the order that fixed the epoch."""
        mode, ow, olws = self._order_params(epoch, world)
        left = plan.remaining_pool(pool, world, num_workers, self.partition, self.batch_quantum, list(delivered))
        return self.state_schema.build(epoch, left, seed=self.seed, partition=self.partition, fingerprint=fingerprint,
                                       count=count, shuffle=mode, order_world=ow, order_local_world=olws,
                                       reshuffle_every=self.reshuffle_every, **fields)

    def _resume_from(self, state: Mapping[str, Any]) -> None:
        """The next iteration delivers what ``state`` (checked by :meth:`StateSchema.check`) left of its epoch."""
        self.seed = int(state["seed"])
        self.reshuffle_every = state.get("reshuffle_every")
        self._resume = dict(state)
        self.restart_epochs(int(state["epoch"]))
        if int(state["remaining"]) == 0:  # saved after the epoch ended: the next iteration is the next epoch
            self.finish_epoch(int(state["epoch"]))


# HF Accelerate's wrappers that split a loader's data over the ranks (again, for a ucmagic dataset)
_ACCELERATE_SPLITTERS = ("IterableDatasetShard", "DataLoaderShard", "DataLoaderDispatcher")


def _accelerate_splitter(depth: int = 16) -> str | None:
    """The Accelerate class splitting the iteration now starting over the ranks, or None.

    Seen in the frames that iterate the dataset (``IterableDatasetShard`` in a worker or the main
    process, a dispatcher's fetch) or, in a worker forked by such a loader, as the loader Accelerate
    marked active when it started. Cheap: nothing is looked at unless Accelerate is imported.
    """
    if "accelerate.data_loader" not in sys.modules:
        return None
    frame = inspect.currentframe()
    for _ in range(depth):
        if frame is None:
            break
        if frame.f_globals.get("__name__") == "accelerate.data_loader":
            owner = frame.f_locals.get("self")
            name = type(owner).__name__ if owner is not None else frame.f_code.co_name
            if name in _ACCELERATE_SPLITTERS:
                return name
        frame = frame.f_back
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    refs = shared.get("_dataloader_references_ref") if isinstance(shared, dict) else None
    active = refs[-1]() if refs and refs[-1] is not None else None  # GradientState.active_dataloader
    name = type(active).__name__ if active is not None else ""
    # only when that loader is the one this worker serves (a loader left mid-epoch stays marked active)
    served = getattr(worker_info(), "dataset", None)
    if name in _ACCELERATE_SPLITTERS and served is not None and getattr(active, "dataset", None) is served:
        return name
    return None


def refuse_split_twice(kind: str) -> None:
    """Raise :class:`~ucmagic.errors.SplitTwiceError` when HF Accelerate splits over the ranks an
    iteration of a ucmagic dataset (``kind``) that already reads only this rank's share."""
    if dist_info().world <= 1:
        return
    splitter = _accelerate_splitter()
    if splitter is not None:
        raise SplitTwiceError(
            f"HF Accelerate's {splitter} splits this {kind} over the ranks again, but each rank already reads "
            "only its share (most of every epoch would be lost): pass ucmagic.DataLoader(dataset, ...) to "
            "accelerator.prepare (it is left as it is); under HF Trainer, override get_train_dataloader as in "
            "docs/trainers.md")
