"""Epochs and resume state of planned datasets: :class:`EpochTracking`, the shared implementation of the
epoch half of :class:`~ucmagic.files.planned.PlannedDataset` (the contract and its call order live there).

The epoch lives in shared memory, so DataLoader workers follow ``set_epoch``; a loaded state applies once, to
the next iteration, and is spent when that iteration begins (whichever loader runs it); a stream's own state
(a worker's under torchdata's ``StatefulDataLoader``, a plain loop's on one of several ranks) is a
:class:`StreamProgress`. Rank and worker identity come from :func:`ucmagic.dist.dist_info`.
"""
from __future__ import annotations

import secrets
import uuid
import weakref
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Sequence

from . import plan
from .foreign_loaders import accelerate_skipping, refuse_split_twice, refuse_stateless_wrapper
from .locks import file_lock
from .planned import ConsumptionSink, LoaderNeeds, StateSchema
from ..dist import dist_info, local_world_size, worker_info
from .._util import is_integer
from ..errors import InvalidArgumentError, ResumeLayoutError, ResumeRecipeError
from .._shared import SharedInt, SharedInts
from ..telemetry import SharedCounters

__all__ = ["EpochTracking", "StreamProgress", "check_stream_layout"]

# shared epoch-sync slots: set_epoch was called / a ucmagic.DataLoader sets epochs / last iteration key / seen one /
# the token of the loaded state armed for the next iteration (0: none) / the token an iteration took (it is spent
# when the next iteration begins, whichever loader runs it)
_EXPLICIT, _MANAGED, _KEY, _SEEN, _ARMED, _TAKEN = range(6)


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

