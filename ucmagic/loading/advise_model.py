"""The advisor's model of the engine: what an epoch costs per batch and what a run of them takes (pure).

Input is plain data (:class:`Measured`: each epoch's measured seconds per stage, the loader's settings,
what the machine had free; built from a loader's records by
:func:`ucmagic.loading.stats_analysis.measured`); :mod:`.advise` turns it into advice.

**An epoch** of ``n`` batches lasts ``n * max(loop, fetch, make)`` plus its startup (the first batch's
wait beyond making it, and starting the workers), where per batch

- ``loop``: the loop's own seconds (its compute, and with workers its thread's CPU, which includes
  receiving the batch);
- ``fetch``: the read-ahead's pace. A file dataset keeps a fixed number of copies in flight *per rank*
  (:func:`~ucmagic.files.fetch.stream_depth`), spread over its workers, so more workers do not copy more
  at once; shard streams read ahead per worker. Measured where the workers waited on it (a worker's
  cycle, fetch + decode, over the workers), else ``misses x copy latency / files in flight``;
- ``make``: each worker makes its batches one after another (fetch lookups, the user's code, collate),
  and needs a core for the CPU part of it: ``max(cycle / w, cpu / cores free)``, the cores free being
  measured (the loader's processes' CPU plus what sat idle on the machine, less the loop's share).

With no workers the loop's thread does it all: ``max(fetch, loop + make)``, where ``fetch`` is the copies' pace
(``misses x copy latency / files in flight``) and ``make`` the CPU the loop's process took per batch less the
loop's compute (its wait on the copying threads included: in workers each waits on its own). Each epoch's prediction
keeps what the model did not explain of it (bursts) and its startup (:func:`predict`);
:func:`explains` says whether the model explains an epoch within :data:`EXPLAINED`. :func:`replay`
plays measured batches through torch's pipeline at a prefetch depth.

**A run**: the epochs measured, or ``run_epochs`` of them, the later ones taken as the last measured, or
as warm when only a cold one was measured and the cache can hold the data (:func:`baseline`). Its noise
(:func:`threshold`): the spread of its warm epochs when it has two or more, else :data:`NOISE_SHARE` of
an epoch, at least :data:`WORTH` of the run and :data:`MIN_SAVING_S`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..files.fetch import stream_depth

NOISE_SHARE = 0.10  # the noise of a run without two warm epochs: this share of its mean epoch
MIN_SAVING_S = 0.5  # ... and never under this many seconds of the run (nobody changes code for less)
WORTH = 0.05  # nor under this share of the run
WARM_MISSES = 0.05  # an epoch is warm when at most this share of its items missed
WARM_FETCH, WARM_FETCH_SHARE = 2.0, 0.02  # ... and its fetch per batch at most this many times the run's least,
# plus this share of its batch
FETCH_WAITED = 0.25  # workers waited on fetch for over this share of their decode: the read-ahead set the pace
EXPLAINED = 0.25  # the model explains an epoch when its steady part is within this share of the measured
HIT_S = 1e-4  # seconds per cached item's lookup when no hit was measured
HEADROOM = 0.1  # cache_limit advice: the working set plus this share


@dataclass
class EpochTimes:
    """One epoch's measured seconds (as ``LoaderStats.breakdown(epoch)``), counts and resources."""

    compute: float
    wait: float
    fetch: float
    user: float
    collate: float
    batches: float
    wait_fetch: float = 0.0
    wait_user: float = 0.0
    wait_collate: float = 0.0
    misses: int = 0
    items: int = 0
    wait_p99: float = 0.0
    first_wait: float = 0.0  # the epoch's first batch's wait: its startup (workers, the first fetches)
    first_made: float = 0.0  # that batch's stage seconds: what of the first wait was making it
    compute_cpu: float | None = None  # the loop thread's CPU seconds in the epoch (with workers; None: unknown)
    loop_cpu: float | None = None  # without workers: the loop thread's CPU seconds (its compute and the making)
    miss_latency: float | None = None  # median seconds of one missed file's copy in this epoch (fetch thread)
    hit_latency: float | None = None  # median seconds of one cached item's lookup in this epoch
    wall: float | None = None  # the iteration's wall seconds (None: unknown)
    cpu: float | None = None  # the loop's process's CPU seconds in it (all threads)
    workers_cpu: float | None = None  # the workers' CPU seconds in it
    idle: float | None = None  # core-seconds that sat idle on the cores the loader may use
    batch_bytes: float | None = None  # mean bytes of arrays in a batch (what crosses from a worker)
    made: Sequence[float] = ()  # per batch: its producing process's seconds (stages)
    waits: Sequence[float] = ()  # per batch: the loop's wait
    computes: Sequence[float] = ()  # per batch: the loop's compute before asking for it

    @property
    def total(self) -> float:
        """The epoch's seconds: the iteration's wall time where measured (starting its workers included), else
        the loop's compute + wait."""
        return max(self.compute + self.wait, self.wall or 0.0)


@dataclass
class Measured:
    """Everything :func:`advise` decides on."""

    epochs: list[EpochTimes]
    num_workers: int
    prefetch_factor: int
    cores: int
    batch_size: int = 1
    dataset: str = ""  # the planned dataset's kind ("UCVolumeDataset", ...), "" for others
    cache_limit: int | None = None
    dataset_bytes: int | None = None
    files: int | None = None
    mean_file_bytes: float | None = None
    refetches: int = 0  # misses of files an earlier epoch had copied already
    later_misses: int = 0  # misses in epochs after the first
    hits: int | None = None
    miss_latency: float | None = None  # median seconds of one missed file's copy in epoch 0 (its fetch thread)
    read_ahead: str | None = None  # "rank": files in flight per rank (UCVolumeDataset); "stream": per worker
    read_depth: int | None = None  # the dataset's prefetch= (files in flight per stream), None: the default
    run_epochs: int | None = None  # the run to predict, in epochs (None: the epochs measured)


# ------------------------------------------------------------------ the run and its noise


def run_epochs(m: Measured) -> int:
    """Epochs of the run the advice predicts: ``m.run_epochs``, else the epochs measured."""
    return max(1, int(m.run_epochs or len(m.epochs)))


def run_of(m: Measured, per_epoch: Sequence[float], later: float | None = None) -> float:
    """A run's seconds from one value per measured epoch: the first ``run_epochs`` of them, each epoch past
    those measured costing ``later`` (default: the last value)."""
    r = run_epochs(m)
    vals = list(per_epoch)[:r]
    more = later if later is not None else (vals[-1] if vals else 0.0)
    return sum(vals) + (r - len(vals)) * more


def repeats_warm(m: Measured) -> bool:
    """Whether the epochs of the run past those measured would read a warm cache although the last measured
    one missed: only a cold epoch was measured and the cache can hold the data."""
    if len(m.epochs) > 1 or m.epochs[0].misses <= WARM_MISSES * max(1, m.epochs[0].items):
        return False
    need = working_set(m)
    return not (m.cache_limit and need and m.cache_limit < need)


def baseline(m: Measured) -> float:
    """The measured run's seconds (the one number every advice compares with)."""
    later = warm_epoch(m, m.epochs[-1]) if repeats_warm(m) else None
    return run_of(m, [e.total for e in m.epochs], later)


def warm_epochs(m: Measured) -> list[EpochTimes]:
    """The run's warm epochs: those with few misses, and fetch per batch not many times the run's least (a shard
    stream's cold epoch misses once per chunk, a small share of its samples, yet it copied everything: its
    shard reads are fetch)."""
    least = min((e.fetch / max(1.0, e.batches) for e in m.epochs), default=0.0)
    return [e for e in m.epochs if e.misses <= WARM_MISSES * max(1, e.items)
            and e.fetch / max(1.0, e.batches) <= WARM_FETCH * least + WARM_FETCH_SHARE * e.total / max(1.0, e.batches)]


def noise(m: Measured) -> float:
    """The seconds under which a run's saving is not advised (:func:`threshold`)."""
    return threshold(m)[0]


def threshold(m: Measured) -> tuple[float, str]:
    """The least saving advised, in seconds of the run, and what it is: the noise (:func:`noise`), at least
    :data:`WORTH` of the run and :data:`MIN_SAVING_S`."""
    now = baseline(m)
    warm = warm_epochs(m)
    spread = NOISE_SHARE * sum(e.total for e in m.epochs) / len(m.epochs)
    if len(warm) >= 2:
        spread = (max(e.total - startup(e) for e in warm) - min(e.total - startup(e) for e in warm)) \
            * math.sqrt(run_epochs(m))
        words = f"the spread of its {len(warm)} warm epochs"
    else:
        words = f"{NOISE_SHARE:.0%} of an epoch"
    options = [(spread, words), (WORTH * now, f"{WORTH:.0%} of the run"), (MIN_SAVING_S, "the least saving advised")]
    return max(options, key=lambda o: o[0])


# ------------------------------------------------------------------ the model of one epoch


@dataclass
class Parts:
    """One epoch's per-batch seconds, as the model uses them (see the module's docstring)."""

    n: float
    loop: float  # the loop's own seconds per batch
    fetch_rank: float  # the read-ahead's pace: seconds per batch at the measured workers
    lookups: float  # fetch a worker waits on in its own thread per batch (cached items' lookups)
    make: float  # a worker's decode (user + collate) wall seconds per batch, uncontended
    cpu: float  # a worker's CPU seconds per batch (decode and its read-ahead)
    cores: float  # cores the loader's processes could have had (measured, else the machine's)
    loop_busy: float  # cores the loop's process keeps busy
    startup: float  # the epoch's startup beyond making its first batch
    measured: float  # the epoch's seconds
    fetch_bound: bool  # the workers waited on the read-ahead (no workers: on the copies, which set the pace)


def cores_free(m: Measured, e: EpochTimes) -> float:
    """Cores the loader's processes could have had while ``e`` ran: what they used plus what sat idle (measured),
    else the machine's."""
    if e.idle is None or not e.wall or e.cpu is None:
        return float(m.cores)
    used = e.cpu + (e.workers_cpu or 0.0)
    return min(float(m.cores), max(0.5, (used + e.idle) / e.wall))


def parts(m: Measured, e: EpochTimes) -> Parts:
    n = max(e.batches, 1.0)
    w0 = m.num_workers
    f, u, k, c = e.fetch / n, e.user / n, e.collate / n, e.compute / n
    d = u + k
    hits = max(0, e.items - e.misses) / n
    # fetch a worker waits on in its own thread: all of it without misses, else the cached items' lookups
    lookups = f if not e.misses else min(f, hits * (e.hit_latency if e.hit_latency is not None else HIT_S))
    own_cpu = (e.compute_cpu or 0.0) / n if w0 > 0 else 0.0
    loop = max(c, own_cpu)
    busy = (e.cpu / e.wall if e.cpu is not None and e.wall else (c / (e.total / n) if e.total > 0 else 0.0))
    loop_busy = min(1.0, busy) if w0 > 0 else min(1.0, c / max(e.total / n, 1e-9))
    cores = cores_free(m, e)
    # the read-ahead's pace: where the workers waited on it, a worker's cycle is the stream's pace
    waited = f - lookups > FETCH_WAITED * (d + (c if w0 <= 0 else 0.0)) and f - lookups > 1e-4
    latency = e.miss_latency if e.miss_latency is not None else m.miss_latency
    copies = (e.misses / n) * latency / in_flight(m, w0) if latency is not None and e.misses else 0.0
    if w0 <= 0:
        # no workers: the loop's thread made the batches, waiting on the read-ahead between its items (the
        # copies, and the copying threads' CPU in its process, under one GIL); that making moves into workers,
        # each waiting on its own items, and the copies' pace is the floor (the loop's cycle is not the
        # read-ahead's pace). A worker with a core makes a batch in the CPU it took here (all the process's
        # threads, less the loop's compute), not in the wall time other processes stretched.
        lookups = 0.0
        fetch_rank = copies if latency is not None else (f if waited else 0.0)
        waited = waited and fetch_rank >= (1 - EXPLAINED) * (c + f + d)
        if e.cpu is not None:
            # the share of its compute the loop's thread had a core for (as of its own work: compute + making)
            share = min(1.0, e.loop_cpu / max(e.compute + e.user + e.collate, 1e-9)) if e.loop_cpu is not None else 1.0
            d = min(f + d, max(0.0, e.cpu / n - c * share))
        else:
            d = f + d
    elif waited:
        fetch_rank = (f + d) / w0
    else:
        fetch_rank = copies
    cpu = min(e.workers_cpu / n if w0 > 0 and e.workers_cpu is not None else d + lookups, d + f)
    if w0 > 0:  # a worker's decode without the wait for a core the measured workers shared
        free = max(0.25, cores - loop_busy)
        over = max(1.0, w0 / free)
        dcpu = min(cpu, d)
        make = min(d, dcpu + max(0.0, d - dcpu * over))
    else:
        make = d
    return Parts(n, loop, fetch_rank, lookups, make, cpu, cores, loop_busy, startup(e), e.total, waited)


def in_flight(m: Measured, workers: int) -> float:
    """Files the dataset copies at once per rank with ``workers`` (its read-ahead's scope and depth)."""
    if m.read_ahead == "rank":
        return float(stream_depth(m.read_depth, workers) * max(1, workers))
    return float(stream_depth(m.read_depth, 1) * max(1, workers))


def startup(e: EpochTimes) -> float:
    """The epoch's start beyond making its first batch (starting workers, before and during its first wait): kept
    by a changed epoch."""
    before = max(0.0, e.total - e.compute - e.wait - e.compute / max(1.0, e.batches))  # the last batch's compute
    return max(0.0, e.first_wait - e.first_made) + before


def period(m: Measured, p: Parts, workers: int, *, fetch_scale: float = 1.0, lookups: float | None = None,
           loop: float | None = None, cores: float | None = None, make: float | None = None) -> float:
    """Seconds per batch of an epoch with ``workers`` (the read-ahead's pace scaled by ``fetch_scale``;
    ``lookups``, ``loop``, ``cores``, ``make``: instead of the measured ones)."""
    w0 = m.num_workers
    look = p.lookups if lookups is None else lookups
    own = p.loop if loop is None else loop
    dec = p.make if make is None else make
    fetch = p.fetch_rank * fetch_scale * in_flight(m, w0) / in_flight(m, workers)
    if workers <= 0:
        return max(fetch, own + look + dec)
    free = max(0.25, (p.cores if cores is None else cores) - p.loop_busy)
    cpu = min(p.cpu, look + dec)  # the part of a worker's cycle that needs a core
    cycle = look + dec + cpu * (max(1.0, workers / free) - 1.0)  # workers beyond the free cores wait for one
    return max(own, fetch, cycle / workers)


def explained(m: Measured, e: EpochTimes) -> tuple[float, float]:
    """``(residual, scale)`` of epoch ``e``: the seconds the model leaves unexplained (bursts: kept by every
    prediction) and the factor its steady part is off by where the model is slower than what was measured."""
    p = parts(m, e)
    steady = p.n * period(m, p, m.num_workers)
    seen = max(0.0, e.total - p.startup)
    if steady <= 0:
        return seen, 1.0
    if seen >= steady:
        return seen - steady, 1.0
    return 0.0, seen / steady


def explains(m: Measured, e: EpochTimes) -> bool:
    """Whether the model explains epoch ``e`` within :data:`EXPLAINED` (else its predictions are unsure)."""
    p = parts(m, e)
    seen = max(0.0, e.total - p.startup)
    steady = p.n * period(m, p, m.num_workers)
    return abs(steady - seen) <= EXPLAINED * max(seen, 1e-9)


def predict(m: Measured, e: EpochTimes, workers: int, **kw: float | None) -> float:
    """Epoch ``e`` predicted with ``workers`` and ``kw`` (:func:`period`'s), calibrated on what was measured."""
    p = parts(m, e)
    residual, scale = explained(m, e)
    return p.n * period(m, p, workers, **kw) * scale + residual + p.startup  # type: ignore[arg-type]


def compute_after(e: EpochTimes, fetch: float) -> float:
    """The loop's compute seconds in epoch ``e`` once the workers fetch ``fetch`` seconds instead of
    ``e.fetch``. The loop's thread ran ``e.compute_cpu`` of its ``e.compute`` seconds on a core; the rest it
    waited for one the workers held, and that share shrinks with the workers' work (fetch + your code +
    collate). Unknown CPU (no workers, older stats): the measured compute."""
    cc = e.compute_cpu
    work = e.fetch + e.user + e.collate
    if cc is None or cc >= e.compute or work <= 0:
        return e.compute
    return cc + (e.compute - cc) * min(1.0, (fetch + e.user + e.collate) / work)


def replay(made: Sequence[float], computes: Sequence[float], workers: int, depth: int, start: float = 0.0) -> float:
    """Seconds torch's pipeline takes for these batches: ``workers`` make them in turn (batch ``i`` by worker
    ``i % workers``, ``made[i]`` seconds each, one after another), each holding at most ``depth`` batches
    asked for ahead (``prefetch_factor``); the loop asks for batch ``i`` ``computes[i]`` seconds after it
    received the one before, and a new batch is asked for each time the loop receives one. ``start``: when
    the workers begin."""
    n = len(made)
    w = max(1, workers)
    ahead = max(1, depth) * w
    asked = [0.0] * n  # when batch i was asked for: at the start, or when batch i - ahead reached the loop
    free = [start] * w  # when each worker is done with what it was asked for
    got = 0.0  # when the loop received the batch before
    for i in range(n):
        done = max(asked[i], free[i % w]) + made[i]
        free[i % w] = done
        got = max(got + computes[i], done)
        if i + ahead < n:
            asked[i + ahead] = got
    return got


def working_set(m: Measured) -> int | None:
    """Bytes a ``cache_limit`` must hold for a full epoch to stay cached: the dataset, the read-ahead's copies
    in flight (counted at their size while they fill) and :data:`HEADROOM` for the cache's own records."""
    if not m.dataset_bytes:
        return None
    mean = m.mean_file_bytes or (m.dataset_bytes / max(1, m.files or 1))
    flight = in_flight(m, m.num_workers) * mean
    return int(math.ceil((m.dataset_bytes + flight) * (1 + HEADROOM)))


def warm_epoch(m: Measured, e: EpochTimes, workers: int | None = None) -> float:
    """Epoch ``e`` predicted with every item cached: a measured warm epoch's pace where there is one, else the
    model with the copies gone (each item a lookup) and the loop's cores given back."""
    w = m.num_workers if workers is None else workers
    warm = warm_epochs(m)
    if warm and w == m.num_workers:
        ref = warm[-1]
        per = max(0.0, ref.total - startup(ref)) / max(1.0, ref.batches)
        return per * e.batches + startup(e)
    p = parts(m, e)
    items = e.items / max(1.0, e.batches)
    hit = next((x.hit_latency for x in m.epochs if x.hit_latency is not None), None)
    look = items * (hit if hit is not None else HIT_S)
    loop = max(compute_after(e, look * p.n) / p.n, (e.compute_cpu or 0.0) / p.n if m.num_workers > 0 else 0.0)
    return p.n * period(m, p, w, fetch_scale=0.0, lookups=look, loop=loop) + p.startup


def fetch_per_miss(m: Measured) -> float | None:
    """Seconds of the rank's time per missed file in the cold epoch (its copies overlapped as they ran): the
    read-ahead's pace over the misses of a batch, else the copy latency over the files in flight."""
    cold = m.epochs[0]
    if not cold.misses:
        return None
    p = parts(m, cold)
    if m.num_workers <= 0:  # the loop's thread waited on its copies: at least that wait per batch
        return max(p.fetch_rank, cold.fetch / p.n) * p.n / cold.misses
    if p.fetch_rank > 0:
        return p.fetch_rank * p.n / cold.misses
    latency = cold.miss_latency if cold.miss_latency is not None else m.miss_latency
    return latency / in_flight(m, m.num_workers) if latency is not None else None


def user_share(e: EpochTimes) -> float:
    """The user's code's share of making a batch (fetch + user + collate), measured."""
    made = e.fetch + e.user + e.collate
    return e.user / made if made > 0 else 0.0
