"""UCVolumeDataset: stream files of a slow volume through the persistent local cache."""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from torch.utils.data import IterableDataset, get_worker_info

from . import plan
from .. import telemetry
from .._util import DEFAULT_RETRIES, is_integer, path_under
from .cache import FileCache, SeenEntries
from .cache_layout import cache_root, space_of
from .locks import process_tag
from .protection import release_at_exit
from ..dist import dist_info, local_world_size
from .epochs import EpochTracking
from .planned import StateSchema
from ..errors import InvalidArgumentError
from .epoch_stream import EpochParts, EpochStream, Retired
from .dataset_files import ListedFiles, SourceFile
from .fetch import DEFAULT_INFLIGHT, stream_depth
from .filler import CacheFiller, SkipPolicy, SourceChecks
from .lease import ConsumptionChannel, StreamLease, StreamLeases
from .stream_items import STREAM_CHUNKS_KEPT, StreamItems  # noqa: F401 - STREAM_CHUNKS_KEPT: tests import it from here
from .listing import VALIDATE_MODES, Listing, open_listing
from ..progress import Progress
from .._shared import SharedBits
from ..telemetry import SharedCounters, percentiles
from .volume import Volume, open_volume
from .windows import DEFAULT_LEASE_ITEMS, WindowPolicy

STATE_VERSION = 2  # 2: the array-free epoch order (plan.ORDER_VERSION 2)


def check_seed(seed: Any) -> int:
    """``seed`` as an int: an int, or an integral value (numpy integers); anything else is an error
    naming ``seed`` (``"x"``, ``1.5``, ``True`` are rejected, never converted or truncated)."""
    if not is_integer(seed):
        raise InvalidArgumentError(f"seed must be an integer, got {seed!r} ({type(seed).__name__}): "
                                   "pass an int such as seed=0")
    return int(seed)


class CheckedFiles(SharedBits):
    """One bit per file of a listing: "its size and mtime were checked against the volume", in
    shared memory seen by every DataLoader worker (n/8 bytes). Lost updates (two processes setting
    bits of one byte at once) only cause a second check. A plain pickle forgets the checks."""

    checked_prefix = SharedBits.prefix  # how many of ``indices``, from the first, are checked

    def _snapshot(self) -> tuple[int, bytes]:
        return self.n, b""  # a copy (a saved dataset) checks again


_live_iterations: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _close_at_exit(it: Iterator[str]) -> None:
    """Close ``it`` at interpreter exit if it is still alive then (a loop left mid-epoch): its
    cleanup runs while modules are intact (no "Exception ignored ... TypeError" at exit) and its
    read-ahead stops."""
    if not _live_iterations:
        import atexit

        atexit.unregister(_close_live_iterations)
        atexit.register(_close_live_iterations)
    _live_iterations.add(it)


def _close_live_iterations() -> None:
    for it in list(_live_iterations):
        with contextlib.suppress(Exception):
            it.close()


class UCVolumeDataset(EpochTracking, IterableDataset[str]):
    """An IterableDataset yielding the local path of a cached copy of each file under ``path``.

    Drop-in for ``databricks.air.data.UCVolumeDataset(path)``. Files are listed once (recursively,
    sorted, with size and mtime), copied to a persistent machine-wide cache on first use, and
    fetched ahead of the training loop by a thread pool in each iterating process. With
    ``torch.distributed`` and/or DataLoader workers, each (rank, worker) gets its own slice with no
    overlap and no gap; every rank gets the same number of items. The path yielded is the cache
    entry's own, ``<cache_dir>/files/<dataset id>/<the file's path relative to path>`` (folder names
    and extension kept; unsafe names escaped: docs/cache.md): stable across epochs and processes, new
    for a rewritten file, readable until a budget evicts it. :meth:`source_of` maps it back.

    Args:
        path: directory, ``/Volumes/<catalog>/<schema>/<volume>/...``, or fsspec URL.
        pattern: glob over relative paths (``"**/*.jpg"``; no ``/`` means "file name at any depth").
        cache_dir: cache directory (default ``$UCMAGIC_CACHE_DIR`` or ``~/.cache/ucmagic``).
        cache_limit: budget of the whole cache directory in bytes or as a string (``"50GB"``); fills wait
            for room the loop frees (docs/cache.md). Default: keep 10% of the disk free. With
            ``ucmagic.DataLoader`` (also over a wrapper dataset) exactly the items the loop has not
            consumed are protected; otherwise each stream protects a window of the last items it handed
            out sized to fit a third of its share of the budget (64 to ``lease_items`` files; all
            ``lease_items`` where you set it, e.g. to torch's queue, ``(prefetch_factor + 1) * batch_size``),
            so a small budget slows the loop down; one that cannot hold that least window per stream
            raises :class:`BudgetTooSmallError` at the first item, naming the size needed. The smallest
            ``cache_limit`` of any live process using the cache directory bounds this one's fills too,
            and the windows of every live process's streams share it; none goes below its least window
            (files a loop may still open are not evicted to keep the budget).
        shuffle: ``False``, ``True`` (per-epoch seeded permutation; node-affine on several nodes),
            ``"global"`` (always one global permutation) or ``"node"`` (each node keeps its slice of
            the files across epochs and shuffles within it, so its cache stays hot).
        reshuffle_every: with node-affine shuffling, rotate the slices between nodes every N epochs.
        seed: shuffle seed; the order of epoch ``e`` depends only on ``(seed, e)``.
        partition: ``"pad"`` (wrap around so ranks are equal) or ``"drop"`` (drop the remainder).
        prefetch: files in flight per iterating process (default: 128 per rank, split over workers).
        retries: retries of a failing copy, with exponential backoff capped at 2 s (default 14: a volume
            failing 1 open in 3 still delivers; a file that never copies fails after ~22 s).
        timeout: seconds a started file copy may go without writing a byte before the epoch fails
            (a big file that is still copying never times out; a hung open does).
        on_error: ``"raise"`` (default) or ``"skip"`` (count in ``stats()["errors"]`` and go on; one
            summary warning per epoch and stream) for files that fail.
        on_missing: a file deleted from the volume after the listing was taken and not in the cache:
            ``"raise"`` (default: :class:`FetchError` naming it) or ``"skip"`` (count it in
            ``stats()["errors"]`` and go on). ``on_error="skip"`` skips such files too. The listing
            is a snapshot: a file changed since then is served as listed while cached; a new
            dataset object re-validates the listing and fetches the new version (its size/mtime
            give a new key).
        storage_options: passed to fsspec for URLs.
        min_free: fraction of the cache disk always kept free.
        relist: list the volume again even if this node holds a valid listing (docs/scaling.md).
        validate: how a listing this node wrote earlier is checked before reuse, one of
            :data:`ucmagic.files.listing.VALIDATE_MODES` (their meanings: that module's doc and
            docs/scaling.md). Default ``"lazy"``: directory mtimes up front, each file's size and
            mtime when it is first fetched (a file rewritten in place raises
            :class:`SourceChangedError` instead of being served from its old cached copy).
        listing_progress: called with the number of files found so far while listing (from one second
            in); default: a line on stderr.
        follow_symlinks: a symlinked file in the tree is read only when it points inside ``path``
            (``"inside"``, the default), always (``"all"``: a tree you trust) or never (``"none"``).
            One pointing outside raises :class:`UnsafeSourceError` naming it, or with ``on_error="skip"``
            is left out with one warning. Symlinked folders are never walked (docs/reliability.md).
    """

    kind = "UCVolumeDataset"
    read_ahead_scope = "rank"  # files in flight per rank (stream_depth): more workers do not copy more at once
    # version 1: before the array-free order (unshuffled only); states from before kinds have none
    state_schema = StateSchema(kind, STATE_VERSION, "files", older=(1,))

    def __init__(self, path: Any, *, pattern: str | None = None, cache_dir: str | None = None,
                 cache_limit: int | str | None = None, shuffle: bool | str = False, seed: int = 0,
                 partition: str = "pad", prefetch: int | None = None, retries: int = DEFAULT_RETRIES,
                 timeout: float | None = 120.0, on_error: str = "raise", on_missing: str = "raise",
                 storage_options: dict[str, Any] | None = None, min_free: float = 0.10,
                 reshuffle_every: int | None = None, relist: bool = False, validate: str = "lazy",
                 listing_progress: Callable[[int], None] | None = None,
                 follow_symlinks: str = "inside") -> None:
        if not isinstance(path, (str, os.PathLike, Volume)):
            raise InvalidArgumentError(f"path must be a directory, a /Volumes/... path or a URL (a str or a "
                                       f"path-like), got {path!r}")
        if pattern is not None and not isinstance(pattern, str):
            raise InvalidArgumentError(f"pattern must be a glob string such as '**/*.jpg', or None, got {pattern!r}")
        if partition not in plan.PARTITION_MODES:
            raise InvalidArgumentError(f"partition must be one of {plan.PARTITION_MODES}, got {partition!r}")
        if shuffle not in (False, True, "global", "node"):
            raise InvalidArgumentError(f"shuffle must be False, True, 'global' or 'node', got {shuffle!r}")
        if on_error not in ("raise", "skip"):
            raise InvalidArgumentError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if on_missing not in ("raise", "skip"):
            raise InvalidArgumentError(f"on_missing must be 'raise' or 'skip', got {on_missing!r}")
        if validate not in VALIDATE_MODES:
            raise InvalidArgumentError(f"validate must be one of {VALIDATE_MODES}, got {validate!r}")
        if follow_symlinks not in ("inside", "all", "none"):
            raise InvalidArgumentError(f"follow_symlinks must be 'inside', 'all' or 'none', got {follow_symlinks!r}")
        seed = check_seed(seed)  # every argument is checked before the listing, which may take minutes
        self.path = os.fspath(path) if not isinstance(path, Volume) else path.uri
        self.pattern = pattern
        self.volume: Volume = open_volume(path, storage_options)
        self.space = space_of(self.volume.uri)  # the folder of its entries under the cache's files/
        if on_error == "skip":
            self.volume.unreadable = "skip"  # an unreadable directory is left out of the listing, with a warning
        self.volume.follow_symlinks = follow_symlinks  # a link out of the tree: UnsafeSourceError, or skip + warn
        self.volume.outside_links = "warn" if on_error == "skip" else "raise"
        root = cache_root(cache_dir)
        inside = path_under(root, self.volume.local_root) if self.volume.local_root else None
        if inside == ".":  # refused before the cache makes its folders there
            raise InvalidArgumentError(f"cache_dir {root} is the dataset's own directory: set cache_dir= (or "
                                       "$UCMAGIC_CACHE_DIR) to a directory of its own, outside the data")
        self.cache = FileCache(cache_dir, cache_limit, min_free)
        if inside:  # the cache lies inside the data: its copies (and listings) are not data
            self.volume.skip_dirs = self.volume.skip_dirs | {inside}
        bar: list[Progress] = []

        listing_started = time.monotonic()

        def shown(count: int) -> None:
            if not bar:  # the first call comes after a second of listing: show the time since it began
                bar.append(Progress(desc=f"listing {self.volume.display()}", mode="text"))
                bar[0].start = listing_started
            bar[0].set(count)

        opened_at = time.time()
        try:
            self.listing: Listing = open_listing(self.volume, pattern, self.cache.root, relist=relist,
                                                 validate=validate,
                                                 progress=listing_progress or shown)
        finally:
            if bar:
                bar[0].close()
        # "lazy": a reused listing's files are checked when first fetched (a fresh one is current;
        # volumes without directory mtimes were re-listed and compared by open_listing already)
        lazy = validate == "lazy" and self.volume.keeps_dir_mtimes and self.listing.listed_at < opened_at
        self._checked = CheckedFiles(len(self.listing)) if lazy else None
        self.fingerprint = self.listing.fingerprint
        self.shuffle = shuffle
        self.reshuffle_every = int(reshuffle_every) if reshuffle_every else None
        self.seed = seed
        self.partition = partition
        self.prefetch = prefetch
        self.retries = int(retries)
        self.timeout = timeout
        self.on_error = on_error
        self.on_missing = on_missing
        self.batch_quantum = 1  # set by ucmagic.DataLoader to its batch size
        # Without ucmagic.DataLoader's consumption reports, the last lease_items items each stream
        # handed out stay protected (enough for torch's prefetch queue plus the batch in use); under
        # a budget at least 64, or all of them where lease_items was set (docs/cache.md)
        self._lease_items, self._lease_set = DEFAULT_LEASE_ITEMS, False
        self._init_epochs()
        self._counters = SharedCounters()
        self.filler = CacheFiller(self.cache, retries=self.retries, counters=self._counters,
                                  skip=SkipPolicy(on_error, on_missing))
        self._leases = StreamLeases(self.cache)  # this object's stream leases (records) in each process
        self._consumed = ConsumptionChannel()  # items the loop finished, per worker stream
        self._stream_now: EpochStream | None = None  # this process's current (or last) iteration (state_dict)
        self._owner = ""  # the consuming process (set when pickled for DataLoader workers)
        self._seen: SeenEntries | None = None  # the cache entries this process found (warm lookups)
        self.cache.reap()  # protection and temp files left by dead processes go at once

    # ------------------------------------------------------------ basics

    @property
    def lease_items(self) -> int:
        """Handed-out items each stream keeps protected where the loop's consumption is not
        reported (torch's DataLoader, a plain loop): default 1024, at least 64 under a budget. A value
        you set, e.g. ``(prefetch_factor + 1) * batch_size`` for torch's loader, is kept under any
        budget (one that cannot hold it is a :class:`BudgetTooSmallError` at the first item)."""
        return self._lease_items

    @lease_items.setter
    def lease_items(self, n: int) -> None:
        self._lease_items, self._lease_set = int(n), True

    def configure(self, *, batch_quantum: int, lease_items: int) -> None:
        super().configure(batch_quantum=batch_quantum, lease_items=lease_items)
        self._lease_set = False  # the loader's choice (it reports consumption), not a least window

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()  # the listing pickles as its file path
        st["_seen"] = st["_stream_now"] = None  # per process
        if get_worker_info() is None:
            st["_owner"] = process_tag()  # workers protect items for the process that will consume them
        return st

    def __len__(self) -> int:
        """Items this rank delivers in a whole epoch: the same after a resume (which delivers fewer), as
        torchdata's StatefulDataLoader keeps ``len()`` (trainers read it once to count an epoch's steps)."""
        return plan.per_rank(len(self.listing), dist_info().world, self.partition)

    def __repr__(self) -> str:
        return (f"UCVolumeDataset({self.volume.display()!r}, files={len(self.listing)}, "
                f"cache_dir={self.cache.root!r}, shuffle={self.shuffle!r})")

    @property
    def total_bytes(self) -> int:
        return self.listing.total_bytes

    # ------------------------------------------------------------ plan

    def _order(self, epoch: int, world: int, shuffle: bool | str, lws: int) -> Callable[[np.ndarray], np.ndarray]:
        """The epoch order as a function of positions (plan.order_at: no n-element array)."""
        n = len(self.listing)
        blocks = plan.node_blocks(n, world, lws, self.partition) if shuffle == "node" else None
        seed, every = self.seed, self.reshuffle_every

        def order(positions: np.ndarray) -> np.ndarray:
            return plan.order_at(n, positions, seed=seed, epoch=epoch, shuffle=shuffle, blocks=blocks,
                                 reshuffle_every=every)

        return order

    def epoch_items(self, epoch: int) -> int:
        """Items of a whole ``epoch`` (a resume's rest aside): what ``len()`` and the loader's length count."""
        return len(self.listing)

    def epoch_plan(self, epoch: int) -> tuple[list[plan.Range], Any]:
        """(pool, order) for ``epoch``: the resumed remainder if a state was loaded for it."""
        world = dist_info().world
        r = self._active_resume(epoch)
        if r is not None:
            order = self._order(epoch, r["order_world"], r["shuffle"], r["order_local_world"])
            return [tuple(x) for x in r["pool"]], order
        shuffle = self._shuffle_mode(world)
        return [(0, len(self.listing))], self._order(epoch, world, shuffle, local_world_size(world))

    def stream_items(self, epoch: int | None = None) -> StreamItems:
        """The calling (rank, worker) stream's items this epoch, in order, decoded chunk by chunk."""
        rank, world, _, _, worker, nworkers = dist_info()
        ep = self.epoch if epoch is None else epoch
        _, order = self.epoch_plan(ep)
        pos = self._stream_ranges(ep, rank, world, worker, nworkers)
        files = self.files
        return StreamItems(self.listing, pos, order, files.keys, self.space, stamps=files.stamps)

    # ------------------------------------------------------------ fetching

    @property
    def files(self) -> ListedFiles:
        """This dataset's listed files in its cache (keys, cached paths, sources, warming)."""
        return ListedFiles(self.listing, self.volume, self.cache, self.space, self.filler)

    @property
    def counters(self) -> SharedCounters:
        """Cache counters shared with the workers: hits, misses, bytes fetched, retries, errors."""
        return self._counters

    def consumption_channel(self) -> ConsumptionChannel:
        """Where a loader reports, per worker stream, how many items the training loop has finished
        with (shared memory, seen by every worker). Used by ucmagic.DataLoader."""
        return self._consumed

    def window_policy(self) -> WindowPolicy:
        """The rules that size this dataset's protection windows and read-ahead (see :mod:`.windows`)."""
        n = len(self.listing)
        typical = max(1, -(-self.listing.total_bytes // n)) if n else 1
        return WindowPolicy(self.lease_items, typical, n, least_window=self.lease_items if self._lease_set else None,
                            largest=int(self.listing.sizes.max()) if n else 0)

    def __iter__(self) -> Iterator[str]:
        it = self._iterate(self._iteration_ticket())
        _close_at_exit(it)
        return telemetry.fetch_timed(it)  # timed when a user's wrapper iterates it (the loader's stage times)

    def _iterate(self, ticket: int) -> Iterator[str]:
        main = get_worker_info() is None
        # files in flight per stream: prefetch=, else the rank's DEFAULT_INFLIGHT spread over its workers
        depth = stream_depth(self.prefetch, dist_info().num_workers)
        items, lease = self._open_stream(main, depth, ticket)
        if self._seen is None:
            self._seen = self.cache.seen_entries(len(self.listing))
        checks = None if self._checked is None else SourceChecks(self.volume, self._checked)
        lanes = EpochStream(EpochParts(items, lease, self.filler, self.volume, self.space, self._seen, checks),
                            main=main, depth=depth, timeout=self.timeout)
        self._stream_now = lanes
        abandoned = True  # until the stream is exhausted or fails: break or close() leaves it
        try:
            yield from lanes.run()
            abandoned = False  # exhausted: the loop may still hold (and report) its last batches
            if self._progress is not None:
                self._progress.ended = True
        except Retired:
            pass  # ucmagic.DataLoader's loop left this iteration: nothing more is wanted of this stream
        except Exception:
            # failed (a full cache disk, a source error): the loop still opens what this stream handed out before
            # the error reaches it (torch's queue holds a worker's batches ahead of its error), so that stays
            # protected as at a stream's end; unprotected, another stream's fill evicted it (FileNotFoundError)
            abandoned = False
            raise
        finally:
            lanes.end(abandoned=abandoned)

    def _open_stream(self, main: bool, depth: int, ticket: int) -> tuple[StreamItems, StreamLease]:
        """This (rank, worker) stream's items this epoch and their protection (begins the epoch in
        the main process; a worker follows the epoch its main process began)."""
        info = get_worker_info()
        self._check_consumer()  # Accelerate splitting again or skipping twice, a stateless wrapper resumed
        cache = self.cache
        if main:
            epoch = self.begin_epoch(ticket=ticket)
            owner = process_tag()
            release_at_exit(cache, owner)
        else:
            if not os.path.isdir(cache.layout.locks):  # the cache directory was removed by hand: made again
                cache.layout.ensure()  # (the main process's first write, a protection record, does it there)
            epoch = self._worker_epoch(os.path.join(cache.root, "locks", f"epoch-{self._epoch_id}.lock"), ticket)
            owner = self._owner or process_tag(os.getppid())
        cache.records.drop_records(owner)  # records of this owner's exited workers: an earlier iteration's
        self._open_progress(epoch)
        self._stream_now = None
        items = self.stream_items(epoch)
        slot = 0 if info is None else info.id
        return items, self._leases.open(items, owner, slot, policy=self.window_policy(),
                                        consumption=self._consumed.reader(slot), quantum=self.batch_quantum,
                                        depth=depth)

    # ------------------------------------------------------------ resume

    def _sync_progress(self) -> None:
        """The positions handed out so far (skipped files included) are the progress of this iteration."""
        if self._progress is not None and self._stream_now is not None:
            self._progress.count = self._stream_now.handed

    def make_state(self, epoch: int, delivered: Sequence[int], *, world: int, num_workers: int) -> dict[str, Any]:
        """Resume state after stream ``s`` delivered ``delivered[s]`` items of ``epoch``."""
        return self._planned_state(epoch, self.epoch_plan(epoch)[0], delivered, world=world, num_workers=num_workers,
                                   fingerprint=self.fingerprint, count=len(self.listing),
                                   order_version=plan.ORDER_VERSION)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration delivers exactly the files not yet delivered in the saved epoch.

        Works with a different world size or number of workers. Raises ListingChangedError when the
        files under the path changed since the state was saved, ResumeOrderError when the state was
        saved under another epoch order (an older ucmagic).
        """
        plan.check_order_version(state)
        self.state_schema.check(state, fingerprint=self.fingerprint, count=len(self.listing),
                                what=f"the files under {self.volume.display()}")
        self._resume_from(state)

    # ------------------------------------------------------------ cache management

    def warm(self, background: bool = True, *, threads: int | None = None) -> Future[int]:
        """Copy every file of the listing into the cache. Returns a Future (already done when
        ``background=False``) whose result is the number of files fetched from the volume."""
        return self.files.warm(background, threads or DEFAULT_INFLIGHT, self.timeout)

    def describe_item(self, index: int) -> tuple[str, int]:
        """``(display path, bytes)`` of file ``index`` of the listing (for fetch records)."""
        e = self.listing.entry(index)
        return self.volume.display(e.path), e.size

    def source_of(self, path: str | os.PathLike[str]) -> SourceFile:
        """The source file whose cached copy is ``path`` (a path this dataset yielded): its display
        path or URI in the volume, relative path, size and mtime as listed.

        Works on the path alone where it can (an evicted entry's path still answers); a file at the
        first place of its name is checked to be the listed version. Raises
        :class:`~ucmagic.errors.NotAnEntryError` for a path that is not one of this dataset's files
        in its cache (another dataset's entry, a version no longer listed, any other path).
        """
        return self.files.source_of(path)

    def clear_cache(self) -> int:
        """Remove this dataset's files from the cache, plus protection records of dead processes and
        abandoned temp files (other datasets' entries stay, and so do files that a running loop of
        another process has not consumed yet). Returns the number of entries removed."""
        self.cache.reap()
        return self.cache.remove_unprotected(p for p, _ in self.files.cached())

    def stats(self) -> dict[str, Any]:
        """Files/bytes cached of the total, hits, misses, bytes fetched, retries, errors, fetch latency,
        and every byte under ``cache_dir``: this dataset's entries, other entries, protection records
        and temp files (``cache_*`` keys; they add up to ``cache_total_bytes``)."""
        n_cached = mine = 0
        for _, size in self.files.cached():
            n_cached += 1
            mine += size
        u = self.cache.usage()
        t = self._counters.totals()
        lat = self._counters.latencies()
        pct = percentiles(lat)
        lookups = t["hits"] + t["misses"]
        return {
            "files": len(self.listing), "bytes": self.total_bytes,
            "files_cached": n_cached, "bytes_cached": mine,
            "hits": t["hits"], "misses": t["misses"],
            "hit_rate": (t["hits"] / lookups) if lookups else 0.0,
            "bytes_fetched": t["bytes_fetched"], "retries": t["retries"], "errors": t["errors"],
            "delivered": t["delivered"],
            "fetch_p50_s": pct["p50"], "fetch_p90_s": pct["p90"], "fetch_p99_s": pct["p99"],
            "cache_dir": self.cache.root, "epoch": self.epoch,
            "cache_total_bytes": u.total_bytes, "cache_other_entries_bytes": u.bytes - mine,
            "cache_protected_bytes": u.protected_bytes, "cache_records_bytes": u.records_bytes,
            "cache_tmp_bytes": u.tmp_bytes, "cache_misc_bytes": u.other_bytes,
            "cache_limit": self.cache.limit,
        }

