"""UCVolumeDataset: stream files of a slow volume through the persistent local cache."""
from __future__ import annotations

import os
import threading
import time
import warnings
from collections import deque
from concurrent.futures import Future
from typing import Any, Iterator

import torch
from torch.utils.data import IterableDataset, get_worker_info

from . import plan, telemetry
from .cache import FileCache, cache_key, safe_suffix
from .errors import FetchError, ListingChangedError
from .fetch import read_ahead, with_retries
from .telemetry import SharedCounters, SharedInt, percentiles
from .volume import FileEntry, Volume, copy_error, listing_fingerprint, open_volume

STATE_VERSION = 1
DEFAULT_INFLIGHT = 128  # files in flight per rank, spread over its DataLoader workers
_last_fetch = threading.local()  # per-item records: did this thread's last _fetch copy the file?


def grid() -> tuple[int, int, int, int]:
    """``(rank, world_size, worker_id, num_workers)`` of the calling process.

    Rank and world size come from an initialised ``torch.distributed`` group, else from the
    ``RANK``/``WORLD_SIZE`` variables torchrun sets (DataLoader workers inherit them).
    """
    rank, world = 0, 1
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"])
    info = get_worker_info()
    return rank, world, (info.id if info else 0), (info.num_workers if info else 1)


def _source_missing(exc: BaseException) -> bool:
    """True when a fetch failed because the source file is gone (deleted after the listing)."""
    return isinstance(exc, FetchError) and isinstance(exc.__cause__, FileNotFoundError)


def local_world_size(world: int) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world


class EpochTracking:
    """Epoch bookkeeping shared by ucmagic's planned datasets (files and Parquet rows).

    The epoch lives in shared memory, so persistent DataLoader workers follow :meth:`set_epoch`;
    without ``set_epoch``, each iteration started in the main process counts one epoch up.
    """

    shuffle: bool | str

    def _init_epochs(self) -> None:
        self._epoch = SharedInt(0)
        self._epoch_explicit = False
        self._fresh = True

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch whose order the next iteration follows (same on every rank and worker)."""
        self._epoch.value = int(epoch)
        self._epoch_explicit = True
        self._fresh = True

    @property
    def epoch(self) -> int:
        return self._epoch.value

    def _next_epoch_auto(self) -> None:
        """Called at each iteration start in the main process: without set_epoch, epochs count up."""
        if not self._fresh and not self._epoch_explicit:
            self._epoch.value = self._epoch.value + 1
        self._fresh = False

    def _shuffle_mode(self, world: int) -> bool | str:
        """``True`` means node-affine on several nodes and global on one."""
        if self.shuffle is True:
            return "node" if world > local_world_size(world) else "global"
        return self.shuffle


class UCVolumeDataset(EpochTracking, IterableDataset):
    """An IterableDataset yielding the local path of a cached copy of each file under ``path``.

    Drop-in for ``databricks.air.data.UCVolumeDataset(path)``. Files are listed once (recursively,
    sorted, with size and mtime), copied to a persistent machine-wide cache on first use, and
    fetched ahead of the training loop by a thread pool in each iterating process. With
    ``torch.distributed`` and/or DataLoader workers, each (rank, worker) gets its own slice with no
    overlap and no gap; every rank gets the same number of items.

    Args:
        path: directory, ``/Volumes/<catalog>/<schema>/<volume>/...``, or fsspec URL.
        pattern: glob over relative paths (``"**/*.jpg"``; no ``/`` means "file name at any depth").
        cache_dir: cache directory (default ``$UCMAGIC_CACHE_DIR`` or ``~/.cache/ucmagic``).
        cache_limit: cache budget in bytes or as a string (``"50GB"``); default: keep 10% of the disk free.
        shuffle: ``False``, ``True`` (per-epoch seeded permutation; node-affine on several nodes),
            ``"global"`` (always one global permutation) or ``"node"`` (each node keeps its slice of
            the files across epochs and shuffles within it, so its cache stays hot).
        reshuffle_every: with node-affine shuffling, rotate the slices between nodes every N epochs.
        seed: shuffle seed; the order of epoch ``e`` depends only on ``(seed, e)``.
        partition: ``"pad"`` (wrap around so ranks are equal) or ``"drop"`` (drop the remainder).
        prefetch: files in flight per iterating process (default: 128 per rank, split over workers).
        retries: retries of a failing copy, with exponential backoff.
        timeout: seconds one file copy may take once started before the epoch fails.
        on_error: ``"raise"`` (default) or ``"skip"`` (warn, count, and go on) for files that fail.
        on_missing: a file deleted from the volume after the listing was taken and not in the cache:
            ``"raise"`` (default: :class:`FetchError` naming it) or ``"skip"`` (warn, count it in
            ``stats()["errors"]``, and go on). ``on_error="skip"`` skips such files too. The listing
            is a snapshot: a file changed since then is served as listed while cached; a new
            dataset object re-lists and fetches the new version (its size/mtime give a new key).
        storage_options: passed to fsspec for URLs.
        min_free: fraction of the cache disk always kept free.
    """

    def __init__(self, path: Any, *, pattern: str | None = None, cache_dir: str | None = None,
                 cache_limit: int | str | None = None, shuffle: bool | str = False, seed: int = 0,
                 partition: str = "pad", prefetch: int | None = None, retries: int = 5,
                 timeout: float | None = 120.0, on_error: str = "raise", on_missing: str = "raise",
                 storage_options: dict[str, Any] | None = None, min_free: float = 0.10,
                 reshuffle_every: int | None = None) -> None:
        if partition not in plan.PARTITION_MODES:
            raise ValueError(f"partition must be one of {plan.PARTITION_MODES}, got {partition!r}")
        if shuffle not in (False, True, "global", "node"):
            raise ValueError(f"shuffle must be False, True, 'global' or 'node', got {shuffle!r}")
        if on_error not in ("raise", "skip"):
            raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
        if on_missing not in ("raise", "skip"):
            raise ValueError(f"on_missing must be 'raise' or 'skip', got {on_missing!r}")
        self.path = os.fspath(path) if not isinstance(path, Volume) else path.uri
        self.pattern = pattern
        self.volume: Volume = open_volume(path, storage_options)
        self.cache = FileCache(cache_dir, cache_limit, min_free)
        self.entries: list[FileEntry] = self.volume.list(pattern)
        self.fingerprint = listing_fingerprint(self.entries)
        self.shuffle = shuffle
        self.reshuffle_every = int(reshuffle_every) if reshuffle_every else None
        self.seed = int(seed)
        self.partition = partition
        self.prefetch = prefetch
        self.retries = int(retries)
        self.timeout = timeout
        self.on_error = on_error
        self.on_missing = on_missing
        self.batch_quantum = 1  # set by ucmagic.DataLoader to its batch size
        self.lease_items = 1024  # pins kept per process; ucmagic.DataLoader sets the exact need
        self._init_epochs()
        self._counters = SharedCounters()
        self._resume: dict[str, Any] | None = None
        self._delivered_main = 0
        self._epoch_main = 0
        self._held: list[str] = []

    # ------------------------------------------------------------ basics

    def __getstate__(self) -> dict[str, Any]:
        st = self.__dict__.copy()
        st["_held"] = []  # leases belong to the process that took them
        return st

    def __len__(self) -> int:
        """Items this rank delivers in the coming epoch (the remainder after a resume)."""
        _, world, _, _ = grid()
        r = self._resume
        todo = r["remaining"] if r is not None and r["epoch"] == self.epoch else len(self.entries)
        return plan.per_rank(todo, world, self.partition)

    def __repr__(self) -> str:
        return (f"UCVolumeDataset({self.volume.display()!r}, files={len(self.entries)}, "
                f"cache_dir={self.cache.root!r}, shuffle={self.shuffle!r})")

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.entries)

    # ------------------------------------------------------------ plan

    def _order(self, epoch: int, world: int, shuffle: bool | str, lws: int):
        n = len(self.entries)
        blocks = plan.node_blocks(n, world, lws, self.partition) if shuffle == "node" else None
        return plan.epoch_order(n, seed=self.seed, epoch=epoch, shuffle=shuffle, blocks=blocks,
                                reshuffle_every=self.reshuffle_every)

    def _epoch_plan(self, epoch: int) -> tuple[list[plan.Range], Any]:
        """(pool, order) for ``epoch``: the resumed remainder if a state was loaded for it."""
        _, world, _, _ = grid()
        r = self._resume
        if r is not None and r["epoch"] == epoch:
            order = self._order(epoch, r["order_world"], r["shuffle"], r["order_local_world"])
            return [tuple(x) for x in r["pool"]], order
        shuffle = self._shuffle_mode(world)
        return [(0, len(self.entries))], self._order(epoch, world, shuffle, local_world_size(world))

    def stream_indices(self, epoch: int | None = None) -> list[int]:
        """File indices the calling (rank, worker) stream delivers this epoch, in order."""
        rank, world, worker, nworkers = grid()
        pool, order = self._epoch_plan(self.epoch if epoch is None else epoch)
        pos = plan.stream_positions(pool, world, rank, nworkers, worker, self.partition, self.batch_quantum)
        return order[plan.positions(pos)].tolist()

    # ------------------------------------------------------------ fetching

    def _inflight(self) -> int:
        if self.prefetch:
            return int(self.prefetch)
        _, _, _, nworkers = grid()
        return max(8, DEFAULT_INFLIGHT // max(1, nworkers))

    def _key(self, e: FileEntry) -> tuple[str, str]:
        return cache_key(self.volume.uri, e.path, e.size, e.mtime), safe_suffix(e.path)

    def _fetch(self, e: FileEntry) -> str:
        """Cached path for ``e``: a hit, or one (single-flight) copy from the volume."""
        key, suffix = self._key(e)
        t0 = time.perf_counter()  # FileCache.fill looks the entry up first: a hit returns fetched=False

        def write(tmp: str) -> int:
            return self.volume.copy_to(e.path, tmp, expect=e)

        def attempt(_: Any) -> tuple[str, bool]:
            return self.cache.fill(key, suffix, e.size, write)

        try:
            path, fetched = with_retries(attempt, None, self.retries, on_retry=lambda _: self._counters.add(retries=1))
        except FetchError:
            raise
        except Exception as exc:
            raise copy_error(self.volume, e.path, exc) from exc
        _last_fetch.fetched = fetched
        if fetched:
            self._counters.add(misses=1, bytes_fetched=e.size)
            self._counters.record_latency(time.perf_counter() - t0)
        else:
            self._counters.add(hits=1)
        return path

    def _lease(self, e: FileEntry) -> str | None:
        """Fetch and pin ``e``; the pinned path exists until released. None when skipped."""
        for _ in range(3):
            try:
                return self.cache.pin(self._fetch(e))
            except FileNotFoundError:
                continue  # evicted between fetch and pin: fetch again
            except Exception as exc:
                if self.on_error == "skip" or (self.on_missing == "skip" and _source_missing(exc)):
                    self._counters.add(errors=1)
                    warnings.warn(f"ucmagic: skipping {self.volume.display(e.path)}: {exc}", stacklevel=2)
                    return None
                raise
        raise FetchError(f"{self.volume.display(e.path)} kept being evicted before use: raise cache_limit")

    def _lease_cached(self, e: FileEntry) -> str | None:
        """The pinned cached copy of ``e`` if it is in the cache (no thread hop), else None."""
        key, suffix = self._key(e)
        path = self.cache.lookup(key, suffix, e.size)
        if path is None:
            return None
        try:
            leased = self.cache.pin(path)
        except FileNotFoundError:  # evicted just now: fetch it the normal way
            return None
        self._counters.add(hits=1)
        return leased

    def __iter__(self) -> Iterator[str]:
        info = get_worker_info()
        main = info is None
        self.cache.in_worker = not main
        if main:
            self._next_epoch_auto()
        # A new epoch starts only after the loop consumed the last one: its leases can go.
        while self._held:
            self.cache.unpin(self._held.pop())
        epoch = self.epoch
        indices = self.stream_indices(epoch)
        entries = [self.entries[i] for i in indices]
        timing: dict[str, tuple[bool, float]] = {}  # per-item fetch records (telemetry.record_item)

        def timed(fn: Any) -> Any:
            def run(e: FileEntry) -> str | None:
                t0, _last_fetch.fetched = time.perf_counter(), False
                out = fn(e)
                timing[e.path] = (not _last_fetch.fetched, time.perf_counter() - t0)
                return out
            return run
        if main:
            self._epoch_main, self._delivered_main = epoch, 0
        leases: deque[str] = deque()
        window = max(16, int(self.lease_items))
        try:
            for pos, leased in enumerate(read_ahead(timed(self._lease), entries, depth=self._inflight(),
                                                    timeout=self.timeout, describe=lambda e: self.volume.display(e.path),
                                                    fast=timed(self._lease_cached))):
                if main:
                    self._delivered_main += 1
                if leased is None:
                    continue
                leases.append(leased)
                while len(leases) > window:
                    self.cache.unpin(leases.popleft())
                self._counters.add(delivered=1)
                telemetry.record_item(indices[pos], *timing.pop(entries[pos].path, (True, 0.0)), entries[pos].size)
                yield leased
        finally:
            # The last items may still be in a batch the loop is using: keep them pinned until the
            # next epoch starts here, or this process exits.
            self._held.extend(leases)

    # ------------------------------------------------------------ resume

    def state_dict(self) -> dict[str, Any]:
        """What the training loop received so far in this epoch (single-process iteration).

        With DataLoader workers or several ranks use ``ucmagic.DataLoader.state_dict()``, which
        knows what reached the loop. The state is small and JSON-serialisable.
        """
        _, world, _, _ = grid()
        if world > 1:
            raise RuntimeError("UCVolumeDataset.state_dict() sees one rank only: use ucmagic.DataLoader.state_dict()")
        return self.make_state(self._epoch_main, [self._delivered_main], world=1, num_workers=1)

    def make_state(self, epoch: int, delivered: list[int], *, world: int, num_workers: int) -> dict[str, Any]:
        """Resume state after stream ``s`` delivered ``delivered[s]`` items of ``epoch``."""
        pool, _ = self._epoch_plan(epoch)
        r = self._resume if self._resume and self._resume["epoch"] == epoch else None
        lws = r["order_local_world"] if r else local_world_size(world)
        shuffle = r["shuffle"] if r else self._shuffle_mode(world)
        left = plan.remaining_pool(pool, world, num_workers, self.partition, self.batch_quantum, delivered)
        return {
            "version": STATE_VERSION, "epoch": int(epoch), "seed": self.seed, "shuffle": shuffle,
            "partition": self.partition, "files": len(self.entries), "fingerprint": self.fingerprint,
            "order_world": r["order_world"] if r else world, "order_local_world": lws,
            "reshuffle_every": self.reshuffle_every,
            "pool": [list(x) for x in left], "remaining": plan.ranges_len(left),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration delivers exactly the files not yet delivered in the saved epoch.

        Works with a different world size or number of workers. Raises ListingChangedError when the
        files under the path changed since the state was saved.
        """
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported UCVolumeDataset state version {state.get('version')!r}")
        if state["fingerprint"] != self.fingerprint or state["files"] != len(self.entries):
            raise ListingChangedError(
                f"the files under {self.volume.display()} changed since this state was saved "
                f"({state['files']} files then, {len(self.entries)} now): resume needs the same listing; "
                "start a new epoch instead (set_epoch) or restore the files"
            )
        self.seed = int(state["seed"])
        self.reshuffle_every = state.get("reshuffle_every")
        self._resume = dict(state)
        self._epoch.value = int(state["epoch"])
        self._fresh = True

    # ------------------------------------------------------------ cache management

    def warm(self, background: bool = True, *, threads: int | None = None) -> Future:
        """Copy every file of the listing into the cache. Returns a Future (already done when
        ``background=False``) whose result is the number of files fetched from the volume."""
        fut: Future = Future()
        depth = threads or DEFAULT_INFLIGHT

        def run() -> None:
            before = self._counters.totals()["misses"]
            try:
                for _ in read_ahead(self._fetch, self.entries, depth=depth, timeout=self.timeout):
                    pass
                fut.set_result(self._counters.totals()["misses"] - before)
            except BaseException as exc:  # surfaces through fut.result()
                fut.set_exception(exc)

        if background:
            threading.Thread(target=run, name="ucmagic-warm", daemon=True).start()
        else:
            run()
            fut.result()
        return fut

    def _cached_paths(self) -> list[tuple[str, int]]:
        out = []
        for e in self.entries:
            key, suffix = self._key(e)
            p = self.cache.data_path(key, suffix)
            try:
                if os.stat(p).st_size == e.size:
                    out.append((p, e.size))
            except FileNotFoundError:
                pass
        return out

    def describe_item(self, index: int) -> tuple[str, int]:
        """``(display path, bytes)`` of file ``index`` of the listing (for fetch records)."""
        e = self.entries[index]
        return self.volume.display(e.path), e.size

    def clear_cache(self) -> int:
        """Remove this dataset's files from the cache (other datasets' entries stay). Returns count."""
        return self.cache.remove(p for p, _ in self._cached_paths())

    def stats(self) -> dict[str, Any]:
        """Files/bytes cached of the total, hits, misses, bytes fetched, retries, errors, fetch latency."""
        cached = self._cached_paths()
        t = self._counters.totals()
        lat = self._counters.latencies()
        pct = percentiles(lat)
        lookups = t["hits"] + t["misses"]
        return {
            "files": len(self.entries), "bytes": self.total_bytes,
            "files_cached": len(cached), "bytes_cached": sum(s for _, s in cached),
            "hits": t["hits"], "misses": t["misses"],
            "hit_rate": (t["hits"] / lookups) if lookups else 0.0,
            "bytes_fetched": t["bytes_fetched"], "retries": t["retries"], "errors": t["errors"],
            "delivered": t["delivered"],
            "fetch_p50_s": pct["p50"], "fetch_p90_s": pct["p90"], "fetch_p99_s": pct["p99"],
            "cache_dir": self.cache.root, "epoch": self.epoch,
        }

