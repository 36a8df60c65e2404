"""Record keeping of a loader: shared counters, per-batch timings, per-item fetch records, and the
one home of latency percentiles.

:class:`SharedCounters` lives in shared memory so DataLoader worker processes (fork, spawn or
forkserver) bump counters that the main process reads: each process writes only its own slot,
so no locks are needed and nothing is lost (pickling rule: :mod:`ucmagic._shared`).
"""
from __future__ import annotations

import ctypes
import math
import multiprocessing as mp
import os
import time
from array import array
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ._shared import SharedMemory
from .dist import worker_info

SLOTS = 65  # the main process + 64 workers; more workers share slots (counts stay close)
RING = 2048  # latency samples kept per slot
_FIELDS = ("hits", "misses", "bytes_fetched", "retries", "errors", "delivered", "nsamples")
_H, _M, _B, _R, _E, _D, _N = range(len(_FIELDS))
Buffers = tuple["ctypes.Array[ctypes.c_int64]", "ctypes.Array[ctypes.c_double]"]  # counter slots, latency rings


def percentiles(values: Sequence[float] | np.ndarray, qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": .., "p90": .., "p99": ..}`` of ``values`` (linear interpolation); NaN when empty.

    The package's one percentile: the loader's stats, the live panel, the explorer, the figures and
    the MLflow metrics all read theirs here."""
    if len(values) == 0:
        return {f"p{q:g}": math.nan for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


def p50_p99(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """The median and the 99th percentile of ``values`` (as :func:`percentiles`; NaN when empty)."""
    pct = percentiles(values, (50, 99))
    return pct["p50"], pct["p99"]


def current_slot() -> int:
    """This process's counter slot: 0 in the main process, 1 + worker id (mod 64) in a worker."""
    known = _slot[0]
    if known >= 0:  # found once per process (it is asked twice per fetched file); forgotten at fork
        return known
    info = worker_info()
    known = _slot[0] = 0 if info is None else 1 + info.id % (SLOTS - 1)
    return known


# This process's slot once known, -1 before. A forked child asks again: a DataLoader worker's code runs
# only after torch set its worker info (worker_init_fn and the dataset come later), so its first ask sees it.
_slot = [-1]
os.register_at_fork(after_in_child=lambda: _slot.__setitem__(0, -1))


class SharedCounters(SharedMemory[Buffers, "tuple[bytes, bytes]"]):
    """Per-process counter slots plus a ring of recent fetch latencies, in shared memory."""

    def __init__(self) -> None:
        ctx = mp.get_context()
        self._counts = ctx.RawArray(ctypes.c_int64, SLOTS * len(_FIELDS))
        self._lat = ctx.RawArray(ctypes.c_double, SLOTS * RING)

    def _base(self) -> int:
        return current_slot() * len(_FIELDS)

    def add(self, *, hits: int = 0, misses: int = 0, bytes_fetched: int = 0, retries: int = 0,
            errors: int = 0, delivered: int = 0) -> None:
        """Bump this process's slot. Unrolled on purpose: it runs per fetched file (no tuple per call)."""
        b = self._base()
        c = self._counts
        if hits:
            c[b + _H] += hits
        if misses:
            c[b + _M] += misses
        if bytes_fetched:
            c[b + _B] += bytes_fetched
        if retries:
            c[b + _R] += retries
        if errors:
            c[b + _E] += errors
        if delivered:
            c[b + _D] += delivered

    def fetched(self, nbytes: int, seconds: float) -> None:
        """One miss: a file of ``nbytes`` copied in ``seconds`` (``add(misses=1, bytes_fetched=nbytes)`` and
        :meth:`record_latency` in one call: it runs per file filled)."""
        slot = current_slot()
        b = slot * len(_FIELDS)
        c = self._counts
        c[b + _M] += 1
        c[b + _B] += nbytes
        n = c[b + _N]
        self._lat[slot * RING + n % RING] = seconds
        c[b + _N] = n + 1

    def record_latency(self, seconds: float) -> None:
        slot = current_slot()
        b = slot * len(_FIELDS)
        n = self._counts[b + _N]
        self._lat[slot * RING + n % RING] = seconds
        self._counts[b + _N] = n + 1

    def totals(self) -> dict[str, int]:
        arr = np.frombuffer(memoryview(self._counts), dtype=np.int64).reshape(SLOTS, len(_FIELDS)).sum(axis=0)
        return {k: int(v) for k, v in zip(_FIELDS, arr) if k != "nsamples"}

    def latencies(self) -> np.ndarray:
        counts = np.frombuffer(memoryview(self._counts), dtype=np.int64).reshape(SLOTS, len(_FIELDS))[:, _N]
        lat = np.frombuffer(memoryview(self._lat), dtype=np.float64).reshape(SLOTS, RING)
        parts = [lat[s, : min(int(n), RING)] for s, n in enumerate(counts) if n]
        return np.concatenate(parts) if parts else np.zeros(0)

    def reset(self) -> None:
        np.frombuffer(memoryview(self._counts), dtype=np.int64)[:] = 0

    def _buffers(self) -> Buffers:
        return self._counts, self._lat

    def _attach(self, buffers: Buffers) -> None:
        self._counts, self._lat = buffers

    def _snapshot(self) -> tuple[bytes, bytes]:
        return bytes(self._counts), bytes(self._lat)

    def _restore(self, snapshot: tuple[bytes, bytes]) -> None:
        SharedCounters.__init__(self)
        counts, lat = snapshot
        np.frombuffer(memoryview(self._counts), dtype=np.int64)[:] = np.frombuffer(counts, dtype=np.int64)
        np.frombuffer(memoryview(self._lat), dtype=np.float64)[:] = np.frombuffer(lat, dtype=np.float64)


class BatchRecorder:
    """Per-batch timings of a training loop: fetch latency (time ``next()`` waited) and compute
    time (time between batches). Appends are O(1) into compact arrays; read in the main process.
    """

    def __init__(self) -> None:
        self.fetch = array("d")
        self.compute = array("d")
        self.fetch_total = 0.0
        self.compute_total = 0.0

    def record(self, fetch_s: float, compute_s: float) -> None:
        self.fetch.append(fetch_s)
        self.compute.append(compute_s)
        self.fetch_total += fetch_s
        self.compute_total += compute_s

    def extend(self, fetch_s: Sequence[float], compute_s: Sequence[float]) -> None:
        """Append many batches at once (loading saved stats)."""
        self.fetch.fromlist([float(x) for x in fetch_s])
        self.compute.fromlist([float(x) for x in compute_s])
        self.fetch_total += float(sum(fetch_s))
        self.compute_total += float(sum(compute_s))

    def __len__(self) -> int:
        return len(self.fetch)

    def fetch_array(self, last: int | None = None) -> np.ndarray:
        """Fetch latencies as a float64 array (a copy), optionally only the ``last`` ones."""
        return _tail(self.fetch, last)

    def compute_array(self, last: int | None = None) -> np.ndarray:
        """Compute times as a float64 array (a copy), optionally only the ``last`` ones."""
        return _tail(self.compute, last)

    def stall_fraction(self) -> float:
        """Share of the loop's wall time spent waiting for data (0 when nothing was recorded)."""
        total = self.fetch_total + self.compute_total
        return self.fetch_total / total if total > 0 else 0.0

    def reset(self) -> None:
        type(self).__init__(self)


def _tail(values: array[float], last: int | None) -> np.ndarray:
    # Slice first (a copy), so no buffer of the growing array stays exported.
    part = values[-last:] if last else values[:]
    return np.frombuffer(part, dtype=np.float64) if len(part) else np.zeros(0)


# ------------------------------------------------------------------ per-item fetch records
#
# A planned dataset calls record_item() once per item it delivers, in whatever process iterates it
# (a DataLoader worker or the main process). The records wait in a small process-local buffer; the
# loader's collate function (ItemCollate) takes the ones of each batch and sends them to the main
# process *with the batch* (BatchItems), so they arrive under any start method, in order, with
# no shared memory to size. The main process keeps them in an ItemLog: 8 bytes per item.

PENDING_CAP = 1 << 16  # records a process keeps while nobody collects them (plain iteration)
ITEM_CAP = 10_000_000  # items an ItemLog keeps in detail (80 MB); later batches keep their totals only

_pending_index = array("i")  # int32, as batches carry them (a listing index or row group: < 2**31)
_pending_fetch = array("f")  # seconds; negative (sign bit set) for a cache hit
_pending_bytes = array("q")


def record_item(index: int, hit: bool, fetch_s: float, nbytes: int) -> None:
    """Note one delivered item: its file index (or Parquet row group), whether it was a cache hit,
    how long fetching it took, and its size. Cheap (well under a microsecond)."""
    _pending_index.append(index)
    _pending_fetch.append(-fetch_s if hit else fetch_s)
    _pending_bytes.append(nbytes)
    if len(_pending_index) > PENDING_CAP:  # nobody collects (the dataset iterated on its own)
        drop_pending()


def record_items(indices: Sequence[int], hit: bool, fetch_s: float, sizes: Sequence[int]) -> None:
    """:func:`record_item` for a run of items with one hit flag and fetch time (a warm run)."""
    _pending_index.extend(indices)
    _pending_fetch.extend([-fetch_s if hit else fetch_s] * len(indices))
    _pending_bytes.extend(sizes)
    if len(_pending_index) > PENDING_CAP:
        drop_pending()


def drop_pending() -> None:
    """Forget the records of this process not yet taken by a batch."""
    del _pending_index[:], _pending_fetch[:], _pending_bytes[:]


def take_items(n: int) -> tuple[bytes, bytes, int]:
    """The last ``n`` pending records of this process as ``(indices int32, fetch float32, total bytes)``;
    older ones (items a ``drop_last`` loader never batched) are dropped."""
    k = min(n, len(_pending_index))
    idx = _pending_index[len(_pending_index) - k:].tobytes() if k else b""
    fetch = _pending_fetch[len(_pending_fetch) - k:].tobytes() if k else b""
    nbytes = sum(_pending_bytes[len(_pending_bytes) - k:]) if k else 0
    drop_pending()
    return idx, fetch, nbytes


# ------------------------------------------------------------------ stage clock (the producing process)
#
# Where a batch's time goes inside the process that produces it, measured per batch (the clock reads are
# per batch, not per item, except ucmagic's fetch under a user's wrapper):
#   1. the batch starts when its index reaches the producing process: BatchStart, unpickled in a worker
#      (the loader's index sampler marks it directly with num_workers=0): batch_started();
#   2. under a user's wrapper, the time inside the planned dataset's next() adds up (fetch_timed(), which
#      the planned dataset puts around its own iterator when set_fetch_timing(True) was called here);
#   3. ItemCollate reads the clock at collate start and end, and sends the batch's StageTimes with it.

STAGES = ("fetch", "user", "collate")  # seconds per batch in the producing process, in this order
_clock = [0.0, 0.0, 0.0]  # [batch start (perf_counter; 0: not marked), fetch seconds since, last collate end]
_timing = [False]  # time the planned dataset's next() (a user's wrapper is around it)
_clock_owner: list[Any] = [None]  # the WorkerInfo (None: the main process) whose batches the clock last timed


def batch_started() -> None:
    """The producing process takes the next batch's index now (its stage clock starts; ucmagic's reads
    timed before it, outside any batch, are not this batch's)."""
    _clock[0] = time.perf_counter()
    _clock[1] = 0.0


def _received(value: Any) -> Any:
    batch_started()
    return value


class BatchStart:
    """An index a DataLoader worker receives; unpickling it marks the batch's start there and gives
    back the index itself (``value``), so the fetcher sees what torch's sampler yielded."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Callable[[Any], Any], tuple[Any]]:
        return _received, (self.value,)


def set_fetch_timing(on: bool) -> None:
    """Time ucmagic's reads in this process from now on: every planned dataset iterator it opens (see
    :func:`fetch_timed`) and every sample a shard dataset reads by index (:func:`fetch_timing`)."""
    _timing[0] = bool(on)


def fetch_timing() -> bool:
    """Whether ucmagic's reads are timed in this process (a user's dataset is around them)."""
    return _timing[0]


def add_fetch(seconds: float) -> None:
    """Add ``seconds`` of ucmagic's reading (a shard sample read by index) to this process's stage clock."""
    _clock[1] += seconds


def fetch_timed(it: Iterator[Any]) -> Iterator[Any]:
    """``it`` itself, or, when fetch timing is on here (a user's wrapper iterates a planned dataset),
    an iterator adding the time spent in ``next(it)`` to this process's stage clock."""
    return _timed(it) if _timing[0] else it


def _timed(it: Iterator[Any]) -> Iterator[Any]:
    nxt, perf, clock = it.__next__, time.perf_counter, _clock
    try:
        while True:
            t0 = perf()
            try:
                x = nxt()
            except StopIteration:
                return
            clock[1] += perf() - t0
            yield x
    finally:
        close = getattr(it, "close", None)
        if close is not None:
            close()


class StageMode:
    """How the producing process's time splits for a loader's dataset (:class:`ItemCollate`'s ``mode``)."""

    PLANNED = 0  # ucmagic's own dataset: everything before collate is its fetch
    WRAPPER = 1  # a user's dataset around a planned one: fetch is timed inside, the rest is the user's
    OTHER = 2  # any other dataset (map-style ``__getitem__``, a plain IterableDataset): the user's, but for
    # what ucmagic read inside it (a shard dataset's samples by index, a planned iterator): fetch


def _stage_times(mode: int, t_collate: float, t_end: float) -> tuple[float, float, float]:
    """``(fetch, user, collate)`` seconds of the batch whose collate ran ``t_collate``-``t_end``; resets the clock."""
    start, fetched, last = _clock
    begun = start or last  # not marked (a plain iterable with workers): since the last batch's collate
    produce = t_collate - begun if begun else math.nan
    _clock[0], _clock[1], _clock[2] = 0.0, 0.0, t_end
    if mode == StageMode.PLANNED:
        return produce, 0.0, t_end - t_collate
    return fetched, max(0.0, produce - fetched), t_end - t_collate


CPU_MARK_S = 0.05  # a worker reads its process's CPU clock at most this often (one syscall per read)
_cpu_mark: list[Any] = [None, -math.inf, math.nan]  # [the worker's WorkerInfo, perf time of the read, CPU s then]


def worker_cpu(info: Any, now: float) -> float:
    """This worker process's CPU seconds (all its threads: decode, collate, its read-ahead), read at most
    every :data:`CPU_MARK_S` (``now``: perf_counter); NaN in the main process (``info`` None). A forked
    worker inherits the parent's mark: a new ``info`` starts its own."""
    mark = _cpu_mark
    if info is None:
        return math.nan
    if mark[0] is not info:
        mark[0], mark[1] = info, -math.inf
    if now - mark[1] >= CPU_MARK_S:
        mark[1], mark[2] = now, time.process_time()
    return float(mark[2])


class BatchItems:
    """A batch travelling from a worker with the fetch records of its items, its stage times
    (``stages``: seconds in :data:`STAGES` order) and its worker's CPU clock (``cpu``: the process's CPU
    seconds at a recent mark, NaN in the main process), unwrapped by the loader."""

    __slots__ = ("batch", "worker", "index", "fetch", "nbytes", "stages", "cpu")

    def __init__(self, batch: Any, worker: int, index: bytes, fetch: bytes, nbytes: int,
                 stages: tuple[float, float, float] = (math.nan, math.nan, math.nan), cpu: float = math.nan) -> None:
        self.batch, self.worker, self.index, self.fetch, self.nbytes = batch, worker, index, fetch, nbytes
        self.stages = stages
        self.cpu = cpu

    def pin_memory(self, device: Any = None) -> BatchItems:  # the pin-memory thread pins the batch inside
        from ._torch_compat import pin_memory

        return BatchItems(pin_memory(self.batch, device), self.worker, self.index, self.fetch, self.nbytes,
                          self.stages, self.cpu)


class ItemCollate:
    """Wraps a DataLoader's ``collate_fn``: each batch leaves its process with its items' records and
    its stage times (``mode``: a :class:`StageMode`). Unpickled in a spawned worker under a wrapper, it
    turns fetch timing on there (a forked one inherits the main process's setting)."""

    def __init__(self, inner: Callable[[Any], Any], mode: int = StageMode.PLANNED) -> None:
        self.inner = inner
        self.mode = mode

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self.mode != StageMode.PLANNED:
            set_fetch_timing(True)

    def __call__(self, data: Any) -> BatchItems:
        t0 = time.perf_counter()
        n = len(data) if isinstance(data, list) else 1
        index, fetch, nbytes = take_items(n)
        info = worker_info()
        if _clock_owner[0] is not info:  # a new worker (forked with the parent's clock) or back in the main process
            _clock_owner[0] = info
            if not _clock[0]:  # not marked: nothing of the parent's clock is this batch's
                _clock[1] = _clock[2] = 0.0
        out = self.inner(data)
        t1 = time.perf_counter()
        stages = _stage_times(self.mode, t0, t1)
        return BatchItems(out, -1 if info is None else info.id, index, fetch, nbytes, stages, worker_cpu(info, t1))


class ItemLog:
    """Per-batch item records in the main process: which items each batch held (file index), each
    item's fetch time and hit/miss, plus per-batch epoch, worker, rank, miss count and bytes.

    Each batch's stage times in its producing process (:data:`STAGES`: fetch, user, collate seconds;
    NaN when not measured) are kept for every batch.

    Memory: 8 bytes per item and 38 per batch, items kept in detail up to ``cap`` (default 10 M,
    80 MB); later batches keep their per-batch totals.
    """

    def __init__(self, cap: int = ITEM_CAP) -> None:
        self.cap = int(cap)
        self.start = array("q")  # first item of each batch in index/fetch
        self.count = array("i")  # items in each batch (also when not kept in detail)
        self.epoch = array("i")
        self.worker = array("h")  # -1: the main process
        self.rank = array("h")
        self.misses = array("i")
        self.nbytes = array("q")
        self.index = array("i")
        self.fetch = array("f")  # seconds, negative for a hit
        self.stage_fetch = array("f")  # the producing process's seconds per batch (STAGES)
        self.stage_user = array("f")
        self.stage_collate = array("f")
        self.truncated = False

    def __len__(self) -> int:
        return len(self.start)

    def add(self, epoch: int, worker: int, index: bytes = b"", fetch: bytes = b"", nbytes: int = 0,
            rank: int = 0, stages: Sequence[float] = (math.nan, math.nan, math.nan)) -> None:
        """Append one batch (its items' ``index`` int32 and ``fetch`` float32 bytes, its stage seconds)."""
        n = len(index) // 4
        self.stage_fetch.append(stages[0])
        self.stage_user.append(stages[1])
        self.stage_collate.append(stages[2])
        self.start.append(len(self.index))
        self.count.append(n)
        self.epoch.append(epoch)
        self.worker.append(worker)
        self.rank.append(rank)
        self.nbytes.append(nbytes)
        if n:
            f = np.frombuffer(fetch, dtype=np.float32)
            self.misses.append(int(n - np.count_nonzero(np.signbit(f))))
            if len(self.index) + n <= self.cap:
                self.index.frombytes(index)
                self.fetch.frombytes(fetch)
            else:
                self.truncated = True
        else:
            self.misses.append(0)

    def items(self, b: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(index, fetch_s, hit)`` of batch ``b`` (empty when not kept in detail)."""
        s = self.start[b]
        n = self.count[b] if s + self.count[b] <= len(self.index) else 0
        idx = np.frombuffer(self.index, dtype=np.int32)[s:s + n].copy() if n else np.zeros(0, np.int32)
        f = np.frombuffer(self.fetch, dtype=np.float32)[s:s + n].astype(float) if n else np.zeros(0)
        return idx, np.abs(f), np.signbit(f)

    def arrays(self) -> dict[str, np.ndarray]:
        """Every per-batch column and the item columns as numpy arrays (copies)."""
        return {k: np.array(getattr(self, k)) for k in _LOG_COLUMNS}

    def memory_bytes(self) -> int:
        return sum(getattr(self, k).itemsize * len(getattr(self, k)) for k in _LOG_COLUMNS)

    def reset(self) -> None:
        type(self).__init__(self, self.cap)


_LOG_COLUMNS = ("start", "count", "epoch", "worker", "rank", "misses", "nbytes", "index", "fetch", "stage_fetch",
                "stage_user", "stage_collate")


# ------------------------------------------------------------------ what a batch weighs, what the machine had free

def batch_bytes(batch: Any, depth: int = 3, fanout: int = 64) -> int:
    """Bytes of the arrays (tensors, numpy) and ``bytes`` in a batch: what crosses from a worker to the
    loop. Walks dicts, lists and tuples ``depth`` levels deep and their first ``fanout`` members (a batch
    of many small objects counts what it walked: an estimate, cheap at any size)."""
    nbytes = getattr(batch, "nbytes", None)
    if isinstance(nbytes, int) and not isinstance(batch, (bytes, bytearray)):
        return nbytes
    if isinstance(batch, (bytes, bytearray, memoryview)):
        return len(batch)
    if depth <= 0:
        return 0
    if isinstance(batch, dict):
        members = list(batch.values())
    elif isinstance(batch, (list, tuple)):
        members = list(batch)
    else:
        return 0
    walked = sum(batch_bytes(x, depth - 1, fanout) for x in members[:fanout])
    return walked if len(members) <= fanout else walked * len(members) // fanout


def parse_idle(stat: str, cpus: Sequence[int] | None = None, hz: float = 100.0) -> float | None:
    """Idle seconds (idle + iowait, summed over ``cpus``; all when None) in the text of ``/proc/stat``
    (per-CPU lines, in ticks of ``1 / hz`` s); None when none of the lines is there."""
    want = None if cpus is None else {f"cpu{c}" for c in cpus}
    ticks, seen = 0, False
    for line in stat.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        parts = line.split()
        if want is not None and parts[0] not in want:
            continue
        if len(parts) < 6:
            continue
        try:
            ticks += int(parts[4]) + int(parts[5])
        except ValueError:
            continue
        seen = True
    return ticks / hz if seen else None


def idle_seconds() -> float | None:
    """Idle core-seconds so far on the cores this process may run on (``/proc/stat``); None where the
    machine does not say (not Linux). Two reads apart give what sat idle in between."""
    try:
        with open("/proc/stat") as f:
            text = f.read()
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        hz = float(os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, AttributeError):
        return None
    return parse_idle(text, cpus, hz)
