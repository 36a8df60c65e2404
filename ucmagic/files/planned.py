"""The contract between ``ucmagic.DataLoader`` and planned datasets: :class:`PlannedDataset` and its parts.

A *planned* dataset (:class:`~ucmagic.files.dataset.UCVolumeDataset`,
:class:`~ucmagic.tables.parquet_dataset.ParquetDataset`, the shard and mix datasets) fixes each epoch's
order up front with :mod:`ucmagic.files.plan`, so a loader can turn "batches the training loop received"
into an exact, elastic resume state. :class:`PlannedDataset` is that contract;
:class:`~ucmagic.files.epochs.EpochTracking` is the shared implementation of its epoch half.

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

from dataclasses import dataclass
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

from . import plan
from ..errors import ListingChangedError
from ..telemetry import SharedCounters

__all__ = ["PlannedDataset", "ConsumptionSink", "LoaderNeeds", "StateSchema", "check_state_kind", "stream_lengths",
           "wrapped_planned"]


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
