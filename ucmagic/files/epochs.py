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
import secrets
import sys
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

from . import plan
from .locks import file_lock
from ..dist import dist_info, local_world_size, worker_info
from .._util import is_integer
from ..errors import (InvalidArgumentError, ListingChangedError, ResumeLayoutError, ResumeRecipeError,
                      SplitTwiceError)
from .._shared import SharedInt, SharedInts
from ..telemetry import SharedCounters

__all__ = ["PlannedDataset", "ConsumptionSink", "EpochTracking", "LoaderNeeds", "StateSchema", "StreamProgress",
           "check_state_kind", "check_stream_layout", "stream_lengths", "wrapped_planned"]

# shared epoch-sync slots: set_epoch was called / a ucmagic.DataLoader sets epochs / last iteration key / seen one /
# the token of the loaded state armed for the next iteration (0: none) / the token an iteration took (it is spent
# when the next iteration begins, whichever loader runs it)
_EXPLICIT, _MANAGED, _KEY, _SEEN, _ARMED, _TAKEN = range(6)


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


@dataclass
class StreamProgress:
    """One process's iteration of a planned dataset: which stream of which epoch, and how far it got.

    ``pool`` is the epoch's positions when the iteration began (all of them, or what a loaded state left);
    the stream is ``(rank, worker)`` of ``world x num_workers`` cut with ``partition`` and ``quantum``;
    ``base`` items of it came before (a stream state's resume), ``count`` were handed out since, and
    ``ended`` says the stream ran out. ``single``: the only stream of its epoch (a plain loop on one rank).
    """

    epoch: int
    pool: list[plan.Range]
    world: int
    rank: int
    num_workers: int
    worker: int
    quantum: int
    partition: str
    base: int = 0
    count: int = 0
    ended: bool = False
    single: bool = False


def check_stream_layout(stream: Mapping[str, Any], kind: str) -> None:
    """Raise :class:`~ucmagic.errors.ResumeLayoutError` unless one stream's state (``stream``: the ``world``,
    ``rank``, ``num_workers`` and ``worker`` it was saved by) is loaded by that same stream now."""
    d = dist_info()
    saved = (int(stream["world"]), int(stream["rank"]), int(stream["num_workers"]), int(stream["worker"]))
    if saved != (d.world, d.rank, d.num_workers, d.worker):
        where = "the main process" if worker_info() is None else f"worker {d.worker} of {d.num_workers}"
        raise ResumeLayoutError(
            f"this {kind} state is one stream's own position (saved by worker {saved[3]} of {saved[2]} on rank "
            f"{saved[1]} of {saved[0]}: what torchdata's StatefulDataLoader keeps per worker, or a plain loop on one "
            f"of several ranks); it is loaded in {where} on rank {d.rank} of {d.world}. Resume it with the same "
            "num_workers and world size, or save with ucmagic.DataLoader.state_dict(), whose states resume on any")


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

    def begin_epoch(self, *, hand_over: bool = False, ticket: int | None = None) -> int:
        """Start an iteration in the main process; returns its epoch (``hand_over``, ``ticket``: see EpochTracking)."""

    def upcoming_epoch(self) -> int:
        """The epoch the next iteration will run (for a state saved before iterating)."""

    def finish_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` delivered everything: drop any resume state, the next iteration runs ``epoch + 1``."""

    def consumption_channel(self) -> ConsumptionSink | None:
        """Where the loader reports what the loop consumed, or None when the dataset needs no reports."""

    def epoch_plan(self, epoch: int) -> tuple[list[tuple[int, int]], Any]:
        """``(pool, order)`` of ``epoch``: the position ranges still to deliver and the item order."""

    def epoch_items(self, epoch: int) -> int:
        """Items of a whole ``epoch`` (what a resume leaves of it aside): the loader's length counts them."""

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
        self._epoch_sync = SharedInts(6)
        self._epoch_id = uuid.uuid4().hex[:16]
        self._iters = 0  # iter() calls on this process's copy (persistent workers keep it): each iteration's ticket
        self._fresh = True  # the next begin_epoch keeps the epoch (start, set_epoch, resume)
        self._handed = False  # a loader began this iteration in this process: the dataset's own __iter__ follows
        self._resume: dict[str, Any] | None = None  # a loaded state, for the next iteration of the epoch it names
        self._progress: StreamProgress | None = None  # this process's current (or last) iteration of the dataset

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
        self._handed = False
        self._progress = None

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
        r = self._resume
        if r is not None and "stream" in r:
            raise ResumeLayoutError(
                f"this {self.kind} holds one stream's own state (a worker's under torchdata's StatefulDataLoader, "
                "or a plain loop's on one of several ranks): ucmagic.DataLoader plans every stream itself; load a "
                "state that ucmagic.DataLoader.state_dict() saved, or resume with the loader that saved this one")
        self.batch_quantum = int(batch_quantum)
        self.lease_items = int(lease_items)
        self._epoch_sync[_MANAGED] = 1

    def begin_epoch(self, *, hand_over: bool = False, ticket: int | None = None) -> int:
        """Start an iteration in the main process and return its epoch: without set_epoch, epochs
        count up. ``hand_over=True``: the dataset's own ``__iter__`` in this process runs next (a
        loader with ``num_workers=0``) and starts this same epoch instead of counting up again.
        ``ticket``: the :meth:`_iteration_ticket` of the dataset's own iteration starting now.

        A loaded state applies to the next iteration only (torchdata's StatefulDataLoader rule): this
        one takes it, or, when another loader's iteration already took it (Accelerate's
        ``SkipDataLoader``, torch's loader with workers), it is spent and this epoch is the next one."""
        if self._handed:
            self._handed = False
            return self._epoch.value
        self._settle_resume(ticket)
        if not self._fresh and not self._epoch_explicit:
            self._epoch.value = self._epoch.value + 1
        self._fresh = False
        self._handed = hand_over
        self._epoch_sync[_SEEN] = 1
        self._epoch_sync[_KEY] = 0
        self._take_resume(self._epoch.value)
        return self._epoch.value

    def upcoming_epoch(self) -> int:
        """The epoch the next :meth:`begin_epoch` will return."""
        if self._handed or self._epoch_explicit:
            return self.epoch
        if self._fresh and not self._resume_ran_elsewhere():
            return self.epoch
        return self.epoch + 1

    def restart_epochs(self, epoch: int) -> None:
        """The next iteration (main process or workers) runs ``epoch`` (after a resume)."""
        self._epoch.value = int(epoch)
        self._fresh = True
        self._handed = False
        self._progress = None
        self._epoch_sync[_SEEN] = 0
        self._epoch_sync[_KEY] = 0

    def finish_epoch(self, epoch: int) -> None:
        """Epoch ``epoch`` delivered everything: forget the loaded state, the next iteration runs ``epoch + 1``."""
        self._drop_resume()
        self.restart_epochs(int(epoch) + 1)

    # ------------------------------------------------------------ the loaded state: armed, taken, spent

    def _arm_resume(self, state: Mapping[str, Any]) -> None:
        """``state`` (checked) applies to the next iteration of its epoch, whichever loader or process runs it.

        A state of the whole epoch (a ucmagic.DataLoader's, a plain loop's on one rank) is armed in shared
        memory, so every copy of the dataset (DataLoader workers, another loader's) sees whether an iteration
        took it. A stream's own state (a worker's under StatefulDataLoader, a rank's plain loop) applies to
        this copy of the dataset only.
        """
        r = dict(state)
        if "stream" in r:
            check_stream_layout(r["stream"], self.kind)
            # for the next iter() of this copy only: torchdata makes that iterator, and drops it unused when the
            # saved iteration had ended (the one after it, the next epoch, comes with a later ticket)
            r["used"], r["ticket"] = False, self._iters + 1
            self._resume = r
            self._progress = None
            if worker_info() is None:
                self.restart_epochs(int(r["epoch"]))
            else:
                self._pin_worker_epoch(int(r["epoch"]))
            return
        token = secrets.randbits(62) + 1
        r["token"] = token
        self._resume = r
        self._epoch_sync[_ARMED] = token
        self._epoch_sync[_TAKEN] = 0
        self.restart_epochs(int(r["epoch"]))
        if int(r["remaining"]) == 0 and r.get("ended", True):
            # saved once the loop had ended (StopIteration): the next iteration is the next epoch. Saved at the
            # last batch, the loop still running (``ended`` False): the next iteration is the empty rest of that
            # epoch and the one after it the next epoch, as torchdata's StatefulDataLoader resumes
            self.finish_epoch(int(r["epoch"]))

    def _drop_resume(self) -> None:
        r, self._resume = self._resume, None
        if r is not None and "token" in r and self._epoch_sync[_ARMED] == r["token"]:
            self._epoch_sync[_ARMED] = 0

    def _resume_ran_elsewhere(self) -> bool:
        """The armed state was taken by an iteration this copy's begin_epoch did not start."""
        r = self._resume
        return (r is not None and "token" in r and self._epoch_sync[_ARMED] == r["token"]
                and self._epoch_sync[_TAKEN] == r["token"])

    def _iteration_ticket(self) -> int:
        """Called by each kind's ``__iter__`` itself (not its generator, which torch may make and drop unused):
        numbers the iterations of this copy, so a stream's state applies to the one it was loaded for."""
        self._iters += 1
        return self._iters

    def _settle_stream(self, ticket: int | None) -> None:
        """At an iteration's start: a stream's own state applies to the iteration it was loaded for (``ticket``;
        without one, the first to start) and is dropped at any other; one whose iteration never ran (torchdata
        dropped it: the saved iteration had ended) leaves its epoch behind."""
        r = self._resume
        if r is None or "stream" not in r:
            return
        if not r["used"] and (ticket is None or ticket == r["ticket"]):
            r["used"] = True
            return
        self._resume = None
        if not r["used"] and worker_info() is None:
            self._fresh = False  # that epoch's iteration is over: this one is the next

    def _settle_resume(self, ticket: int | None = None) -> None:
        """At an iteration's start in the main process: a state an earlier iteration took is spent now."""
        r = self._resume
        if r is None:
            return
        if "stream" in r:
            self._settle_stream(ticket)
            return
        if self._epoch_sync[_ARMED] != r["token"]:  # spent (by another copy's iteration, or finish_epoch)
            self._resume = None
        elif self._epoch_sync[_TAKEN] == r["token"]:  # an earlier iteration, here or another loader's, took it
            self._drop_resume()
            self._fresh = False  # that iteration ran its epoch: this one is the next (unless set_epoch chose)

    def _take_resume(self, epoch: int) -> None:
        """The iteration starting now (of ``epoch``) follows the loaded state, if one is armed for ``epoch``."""
        r = self._active_resume(epoch)
        if r is not None and "token" in r and self._epoch_sync[_TAKEN] != r["token"]:
            self._epoch_sync[_TAKEN] = r["token"]

    def _active_resume(self, epoch: int) -> dict[str, Any] | None:
        """The loaded state the iteration of ``epoch`` follows (armed, not spent), else None."""
        r = self._resume
        if r is None or int(r["epoch"]) != int(epoch):
            return None
        if "token" in r and self._epoch_sync[_ARMED] != r["token"]:
            return None
        return r

    def _pin_worker_epoch(self, epoch: int) -> None:
        """In a DataLoader worker loading its stream's state: the iteration this worker runs next is ``epoch``
        (every worker of it pins the same), and the iterations after it count on from there."""
        info = worker_info()
        if info is None:
            return
        self._epoch.value = int(epoch)
        self._epoch_sync[_SEEN] = 1
        self._epoch_sync[_KEY] = self._iteration_key(info, self._iters + 1)

    def state_dict(self) -> dict[str, Any]:
        """Where this process's iteration of the dataset is: small, plain JSON, for ``load_state_dict``.

        In a plain loop on one rank (or torchdata's ``StatefulDataLoader`` with ``num_workers=0``): what the
        epoch has left, resumable on any layout. In a DataLoader worker (``StatefulDataLoader`` asks each
        worker's copy after every batch) or on one of several ranks: this stream's own position (``stream``),
        resumed by the same stream on the same layout. Before any iteration: the epoch the next one runs,
        whole (or a loaded state not used yet). With ``ucmagic.DataLoader`` use ``loader.state_dict()``.
        """
        self._sync_progress()
        p = self._progress
        if p is None:
            r = self._resume
            if r is not None and "stream" in r and not r["used"]:
                return {k: v for k, v in r.items() if k not in ("used", "ticket")}
            epoch = self.upcoming_epoch() if worker_info() is None else self._worker_upcoming()
            p = self._new_progress(epoch)
        if p.single:  # one stream in all: what the epoch has left, on any layout
            st = self.make_state(p.epoch, [p.base + p.count], world=1, num_workers=1)
        else:
            st = self.make_state(p.epoch, [0] * (p.world * p.num_workers), world=p.world, num_workers=p.num_workers)
            left = plan.stream_rest(p.pool, p.world, p.rank, p.num_workers, p.worker, p.partition, p.quantum,
                                    p.base + p.count)
            st.update(pool=[list(x) for x in p.pool], remaining=plan.ranges_len(left), stream={
                "world": p.world, "rank": p.rank, "num_workers": p.num_workers, "worker": p.worker,
                "partition": p.partition, "quantum": p.quantum, "delivered": p.base + p.count})
        st["ended"] = p.ended
        return st

    def epoch_plan(self, epoch: int) -> tuple[list[plan.Range], Any]:
        """``(pool, order)`` of ``epoch`` (each kind's own)."""
        raise NotImplementedError

    def epoch_items(self, epoch: int) -> int:
        """Items of a whole ``epoch`` (each kind's own)."""
        raise NotImplementedError

    def make_state(self, epoch: int, delivered: Sequence[int], *, world: int, num_workers: int) -> dict[str, Any]:
        """The kind's state after stream ``s`` delivered ``delivered[s]`` items of ``epoch`` (each kind's own)."""
        raise NotImplementedError

    def _check_consumer(self) -> None:
        """At an iteration's start (before it takes a loaded state): refuse, by name, a consumer that would
        split this rank's share again, skip what a loaded state skips already, or resume a stateless wrapper
        by replaying the wrong epoch."""
        refuse_split_twice(self.kind)
        skipper = accelerate_skipping()
        if skipper is not None:
            self._refuse_skip(skipper)
        refuse_stateless_wrapper(self)

    def _refuse_skip(self, skipper: str) -> None:
        """Accelerate's ``skip_first_batches`` iterates this dataset again, dropping its first batches: exact
        only on a known epoch (``set_epoch``) with no loaded state, which would skip the same batches twice."""
        r = self._resume
        pending = (r is not None and "token" in r and self._epoch_sync[_ARMED] == r["token"]
                   and self._epoch_sync[_TAKEN] != r["token"])
        if pending:
            raise ResumeRecipeError(
                f"HF Accelerate's skip_first_batches ({skipper}) drops the first batches of this {self.kind}'s "
                f"iteration, but the state loaded into it (epoch {r['epoch'] if r else '?'}) already leaves out "
                "every batch delivered before the save: those batches would be skipped twice. After "
                "accelerator.load_state (with register_for_checkpointing) iterate the loader itself, without "
                "skip_first_batches: it resumes exactly (docs/trainers.md)")
        if not self._epoch_explicit:
            raise ResumeRecipeError(
                f"HF Accelerate's skip_first_batches ({skipper}) drops the first batches of this {self.kind}'s "
                f"iteration, but which epoch's order it replays is unknown here (epochs count up by themselves from "
                "0 in each process, and no state was loaded): batches of another epoch would be skipped. Register "
                "the loader for checkpointing (accelerator.register_for_checkpointing(loader)) and iterate it after "
                "load_state without skip_first_batches, or call loader.set_epoch(epoch) with the epoch you resume "
                "before skip_first_batches (docs/trainers.md)")

    def _sync_progress(self) -> None:
        """Bring :attr:`_progress` up to date (a kind that counts its stream elsewhere overrides this)."""

    def _new_progress(self, epoch: int) -> StreamProgress:
        """The calling stream's iteration of ``epoch``, nothing delivered yet (a stream state's own layout)."""
        pool, _ = self.epoch_plan(epoch)
        r = self._active_resume(epoch)
        if r is not None and "stream" in r:
            s = r["stream"]
            return StreamProgress(epoch, pool, int(s["world"]), int(s["rank"]), int(s["num_workers"]),
                                  int(s["worker"]), int(s["quantum"]), str(s["partition"]), int(s["delivered"]))
        d = dist_info()
        return StreamProgress(epoch, pool, d.world, d.rank, d.num_workers, d.worker, self.batch_quantum,
                              self.partition, single=d.world == 1 and worker_info() is None)

    def _open_progress(self, epoch: int) -> StreamProgress:
        """This process's iteration of ``epoch`` begins (each kind's ``__iter__``, once its epoch is known);
        the kind counts the items it hands out and marks the end."""
        self._progress = self._new_progress(epoch)
        return self._progress

    def _stream_ranges(self, epoch: int, rank: int, world: int, worker: int, num_workers: int) -> list[plan.Range]:
        """Epoch positions stream (rank, worker) delivers in this iteration, in order: its share of the pool,
        or what a stream state of its own left of it."""
        pool, _ = self.epoch_plan(epoch)
        r = self._active_resume(epoch)
        if r is not None and "stream" in r:
            s = r["stream"]
            if (int(s["world"]), int(s["rank"]), int(s["num_workers"]), int(s["worker"])) == (
                    world, rank, num_workers, worker):
                return plan.stream_rest(pool, world, rank, num_workers, worker, str(s["partition"]),
                                        int(s["quantum"]), int(s["delivered"]))
        return plan.stream_positions(pool, world, rank, num_workers, worker, self.partition, self.batch_quantum)

    def consumption_channel(self) -> ConsumptionSink | None:
        """Where a loader reports consumed items; None: this dataset needs no reports."""
        return None

    @staticmethod
    def _iteration_key(info: Any, iterations: int) -> int:
        """The name of a worker's ``iterations``-th iteration: (its loader iteration's base seed, the count)."""
        return ((int(info.seed) - int(info.id)) * 1_000_003 + int(iterations)) % (2**62) + 1

    def _worker_epoch(self, lock_path: str | None, ticket: int) -> int:
        """The epoch of this iteration, as seen from a DataLoader worker (which starts it here).

        The workers of one loader iteration share a base seed (``seed - id``); a persistent worker
        keeps its dataset copy, so (base seed, iterations of this copy) names the iteration. The
        first worker to see a new name counts the shared epoch up, under a file lock (no
        multiprocessing lock survives every start method). Explicit ``set_epoch`` and loaders that
        manage epochs win. A loaded state armed for this epoch is taken by this iteration; one an
        earlier iteration took is spent when a new iteration is seen. Without ``lock_path`` the workers
        follow the main process's epoch. ``ticket``: this iteration's :meth:`_iteration_ticket`.
        """
        info = worker_info()
        self._settle_stream(ticket)  # this copy's own state: the iteration it was loaded for only
        if info is None or lock_path is None or self._epoch_sync[_EXPLICIT] or self._epoch_sync[_MANAGED]:
            self._take_resume(self._epoch.value)
            return self._epoch.value
        key = self._iteration_key(info, ticket)
        with file_lock(lock_path):
            if self._epoch_sync[_KEY] != key:
                if self._epoch_sync[_SEEN]:
                    token = self._epoch_sync[_ARMED]
                    if token and self._epoch_sync[_TAKEN] == token:  # the previous iteration took it: spent
                        self._epoch_sync[_ARMED] = 0
                    self._epoch.value = self._epoch.value + 1
                self._epoch_sync[_SEEN] = 1
                self._epoch_sync[_KEY] = key
            self._take_resume(self._epoch.value)
        return self._epoch.value

    def _worker_upcoming(self) -> int:
        """The epoch this worker's next iteration will run (for a state asked for before it starts)."""
        info = worker_info()
        if info is None or self._epoch_sync[_EXPLICIT] or self._epoch_sync[_MANAGED]:
            return self._epoch.value
        seen_other = self._epoch_sync[_SEEN] and self._epoch_sync[_KEY] != self._iteration_key(info, self._iters + 1)
        return self._epoch.value + (1 if seen_other else 0)

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
        r = self._active_resume(epoch)
        if r is not None:
            if "order_world" in r:
                return r["shuffle"], int(r["order_world"]), int(r["order_local_world"])
            return ("global" if r["shuffle"] else False), 1, 1  # a ParquetDataset state from before node shuffling
        if world is None:
            world = dist_info().world
        return self._shuffle_mode(world), world, local_world_size(world)

    def _resumed_pool(self, epoch: int, items: int) -> list[plan.Range]:
        """The positions of ``epoch`` still to deliver: the loaded state's remainder, else all ``items``."""
        r = self._active_resume(epoch)
        if r is not None:
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
        self._arm_resume(state)


# HF Accelerate's wrappers that split a loader's data over the ranks (again, for a ucmagic dataset)
_ACCELERATE_SPLITTERS = ("IterableDatasetShard", "DataLoaderShard", "DataLoaderDispatcher")


# Accelerate's loader that skip_first_batches makes over an iterable dataset (a torch DataLoader iterating it again)
_ACCELERATE_SKIPPERS = ("SkipDataLoader", "SkipBatchSampler")


def _accelerate_splitter(depth: int = 16, names: tuple[str, ...] = _ACCELERATE_SPLITTERS) -> str | None:
    """The Accelerate class (of ``names``: splitting over the ranks by default) iterating the dataset now, or None.

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
            if name in names:
                return name
        frame = frame.f_back
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    refs = shared.get("_dataloader_references_ref") if isinstance(shared, dict) else None
    active = refs[-1]() if refs and refs[-1] is not None else None  # GradientState.active_dataloader
    name = type(active).__name__ if active is not None else ""
    # only when that loader is the one this worker serves (a loader left mid-epoch stays marked active)
    served = getattr(worker_info(), "dataset", None)
    if name in names and served is not None and getattr(active, "dataset", None) is served:
        return name
    return None


def accelerate_skipping() -> str | None:
    """The Accelerate class of ``skip_first_batches`` (SkipDataLoader, SkipBatchSampler) iterating now, or None."""
    return _accelerate_splitter(24, _ACCELERATE_SKIPPERS)


def _stateful_loader_dataset(depth: int = 24) -> tuple[bool, Any]:
    """``(True, the dataset it was given)`` when torchdata's StatefulDataLoader iterates the dataset now (in
    its worker loop, or its single-process iterator), else ``(False, None)``: the dataset is the one torch's
    fetcher iterates. Nothing is looked at unless torchdata's StatefulDataLoader is imported."""
    if "torchdata.stateful_dataloader" not in sys.modules:
        return False, None
    frame = inspect.currentframe()
    top = None
    for _ in range(depth):
        if frame is None:
            break
        module = str(frame.f_globals.get("__name__", ""))
        if module == "torch.utils.data._utils.fetch" and top is None:
            top = getattr(frame.f_locals.get("self"), "dataset", None)
        elif module.startswith("torchdata.stateful_dataloader"):
            return True, top
        frame = frame.f_back
    return False, None


def is_stateful(obj: Any) -> bool:
    """``obj`` has ``state_dict`` and ``load_state_dict`` (torchdata's ``Stateful``: it saves and restores it)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def refuse_stateless_wrapper(ds: Any) -> None:
    """Raise :class:`~ucmagic.errors.ResumeRecipeError` when torchdata's StatefulDataLoader iterates ``ds`` (a
    ucmagic dataset) through a user's wrapper without ``state_dict``/``load_state_dict``: it would resume that
    wrapper by fetching and dropping the batches it delivered, which replays the epoch ``ds`` is on then (epoch 0
    in a new process), not the saved one."""
    under, top = _stateful_loader_dataset()
    if not under or top is None or top is ds or is_stateful(top):
        return
    attr = next((k for k, v in vars(top).items() if v is ds), None) if hasattr(top, "__dict__") else None
    inner = f"self.{attr}" if attr else f"the {ds.kind} it wraps"
    raise ResumeRecipeError(
        f"torchdata's StatefulDataLoader iterates your {type(top).__name__} around a {ds.kind}, and your wrapper has "
        "no state_dict/load_state_dict: it would resume by fetching and dropping the delivered batches, which "
        f"replays the epoch the {ds.kind} is on then (epoch 0 in a new process), not the saved one. Give the "
        f"wrapper the two methods, forwarding to the {ds.kind}: `def state_dict(self): return {inner}.state_dict()` "
        f"and `def load_state_dict(self, state): {inner}.load_state_dict(state)` (each worker then resumes its own "
        "stream exactly, nothing fetched twice), or use ucmagic.DataLoader (docs/loading.md)")


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
