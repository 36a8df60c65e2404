"""What to change so the loop stops waiting: ranked advice, each predicting the whole run (pure).

Input is plain data (:class:`Measured`: each epoch's measured seconds per stage, the loader's settings,
what the machine had free; built from a loader's records by
:func:`ucmagic.loading.stats_analysis.measured`); output a list of :class:`Advice`, best first.

**One baseline.** The run measured: its epochs' seconds added up (or ``epochs=`` of them, the epochs
past those measured taken as the last measured one). Every advice predicts that same run with its
change, its own cost included (warming the cache, packing the files), so each line compares with one
number, stated in it.

**The model of an epoch** (``n`` batches): the epoch lasts ``n * max(loop, fetch, make)`` plus its
startup (the first batch's wait beyond making it: starting workers), where per batch

- ``loop``: the loop's own seconds (its compute, and with workers its thread's CPU, which includes
  receiving the batch);
- ``fetch``: the read-ahead's pace. A file dataset keeps a fixed number of copies in flight *per rank*
  (:func:`~ucmagic.files.fetch.stream_depth`), spread over its workers, so more workers do not copy more
  at once; shard streams read ahead per worker. Measured where the workers waited on it (a worker's
  cycle, fetch + decode, over the workers), else ``misses x copy latency / files in flight``;
- ``make``: each worker makes its batches one after another (fetch lookups, the user's code, collate),
  and needs a core for the CPU part of it: ``max(cycle / w, cpu / cores free)``, the cores free being
  measured (the loader's processes' CPU plus what sat idle on the machine, less the loop's share).

With no workers the loop's thread does it all: ``max(fetch, loop + make)``. A batch made in a worker
crosses to the loop through shared memory; the run does not measure what that costs in the other mode,
so advice that moves between 0 and some workers with batches of more than :data:`CROSS_SURE` of the
batch time in copying (at an assumed :data:`CROSS_RATE`) says "unsure" instead of a number.

Each epoch's prediction keeps what the model did not explain of it (bursts) and its startup; an epoch
the model explains worse than :data:`EXPLAINED` makes its predictions unsure. ``prefetch_factor`` is
predicted by replaying the measured batches through torch's pipeline (:func:`replay`) at both depths.

**Quiet.** No advice whose predicted saving is under the noise: the spread of the run's warm epochs when
it has two or more, else :data:`NOISE_SHARE` of the mean epoch, at least :data:`MIN_SAVING_S`. A knob
just followed (``before``: the run measured before it was changed) is not advised again unless that
change measured a saving. "Decode-bound" and "make your code cheaper" need the user's code to be a
measured share of the batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from ..files.fetch import DEFAULT_INFLIGHT, stream_depth

NOT_BOTTLENECK = 0.05  # the loop waits under this share of its time: loading is not the bottleneck
NOISE_SHARE = 0.10  # the noise of a run without two warm epochs: this share of its mean epoch
MIN_SAVING_S = 0.5  # ... and never under this many seconds of the run (nobody changes code for less)
WORTH = 0.05  # nor under this share of the run
REFETCH_SHARE = 0.05  # re-fetched items over this share of an epoch's items: the cache is too small
WARM_MISSES = 0.05  # an epoch is warm when at most this share of its items missed
FETCH_WAITED = 0.25  # workers waited on fetch for over this share of their decode: the read-ahead set the pace
USER_SHARE = 0.25  # the user's code is a measured share of the batch: "decode-bound"
LIMIT_SHARE = 0.5  # ... and "make your code cheaper" when it is at least half of making a batch
EXPLAINED = 0.25  # the model explains an epoch when its steady part is within this share of the measured
SMALL_FILE = 256 * 1024  # mean bytes per file under which per-file opens dominate a copy
SHARD_RATE = 100e6  # bytes/s assumed for reading packed shards (stated in the advice)
PACK_READS = 256  # pack's reads in flight (its default workers)
WRITE_RATE = 500e6  # bytes/s assumed for writing packed shards to local disk
PACK_FILE_S = 3e-4  # pack's own seconds per file (tar headers, the index), assumed
PACK_START_S = 0.3  # pack's listing, index and commit, assumed
MIN_SHARD, MAX_SHARD = 1 << 20, 1 << 30  # shard sizes the pack advice names: 1 MiB .. pack's default 1 GiB
HIT_S = 1e-4  # seconds per cached item's lookup when no hit was measured
CROSS_RATE = 1e9  # bytes/s assumed for moving a batch through shared memory between processes
CROSS_SURE = 0.1  # a batch's crossing (at CROSS_RATE) over this share of its time: 0 <-> N workers is unsure
WORKER_START_S = 0.05  # seconds to start one worker process (fork), once per run (persistent workers)
HEADROOM = 0.1  # cache_limit advice: the working set plus this share
MAX_PREFETCH = 16


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
    miss_latency: float | None = None  # median seconds of one missed file's copy in this epoch (fetch thread)
    hit_latency: float | None = None  # median seconds of one cached item's lookup in this epoch
    wall: float | None = None  # the iteration's wall seconds (None: unknown)
    cpu: float | None = None  # the loop's process's CPU seconds in it (all threads)
    workers_cpu: float | None = None  # the workers' CPU seconds in it
    idle: float | None = None  # core-seconds that sat idle on the cores the loader may use
    batch_bytes: float | None = None  # mean bytes of arrays in a batch (what crosses from a worker)
    made: list[float] = field(default_factory=list)  # per batch: its producing process's seconds (stages)
    waits: list[float] = field(default_factory=list)  # per batch: the loop's wait
    computes: list[float] = field(default_factory=list)  # per batch: the loop's compute before asking for it

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


@dataclass
class Advice:
    """One change: ``change`` (what to do), ``predicted_s`` (the run's seconds with it, its own cost
    included; None: the model is unsure and does not predict), ``now_s`` (the measured run: the one
    baseline of the list), ``epochs`` (the run's epochs), ``cost_s`` (the change's own seconds in the
    prediction: warming, packing), ``because`` (the measured numbers used), ``settings`` (what it
    changes) and ``kind``."""

    kind: str
    change: str
    predicted_s: float | None
    now_s: float
    because: str
    settings: dict[str, object] = field(default_factory=dict)  # the loader/dataset arguments it changes
    epochs: int = 1
    cost_s: float = 0.0

    @property
    def sure(self) -> bool:
        """Whether the model predicts this change (an unsure one is a lead to try, not a prediction)."""
        return self.predicted_s is not None

    def __str__(self) -> str:
        run = f"run of {self.epochs} epoch{'s' if self.epochs != 1 else ''}"
        if self.kind == "none":
            return f"{self.change} ({run}: {_s(self.now_s)} s; {self.because})"
        if self.predicted_s is None:
            return f"{self.change}: unsure, not predicted ({self.because})"
        cost = f", {_s(self.cost_s)} s of it the change itself" if self.cost_s > 0 else ""
        return f"{self.change}: {run} {_s(self.now_s)} s -> {_s(self.predicted_s)} s predicted{cost} ({self.because})"


def _s(x: float) -> str:
    return f"{x:.3g}"


def header(advice: Sequence[Advice]) -> str:
    """The line above a list of advice: the one measured run that every line compares with ("" for none)."""
    if not advice:
        return ""
    n = advice[0].epochs
    return (f"the measured run: {n} epoch{'s' if n != 1 else ''}, {_s(advice[0].now_s)} s (each prediction is "
            "that run with one change, its own cost included)")


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
    later = _warm_epoch(m, m.epochs[-1]) if repeats_warm(m) else None
    return run_of(m, [e.total for e in m.epochs], later)


def _warm_epochs(m: Measured) -> list[EpochTimes]:
    """The run's warm epochs: those with few misses."""
    return [e for e in m.epochs if e.misses <= WARM_MISSES * max(1, e.items)]


def noise(m: Measured) -> float:
    """The seconds under which a run's saving is not advised (:func:`threshold`)."""
    return threshold(m)[0]


# ------------------------------------------------------------------ the model of one epoch

@dataclass
class _Parts:
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
    fetch_bound: bool  # the workers waited on the read-ahead


def cores_free(m: Measured, e: EpochTimes) -> float:
    """Cores the loader's processes could have had while ``e`` ran: what they used plus what sat idle (measured),
    else the machine's."""
    if e.idle is None or not e.wall or e.cpu is None:
        return float(m.cores)
    used = e.cpu + (e.workers_cpu or 0.0)
    return min(float(m.cores), max(0.5, (used + e.idle) / e.wall))


def _parts(m: Measured, e: EpochTimes) -> _Parts:
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
    if waited:
        fetch_rank = (f + d) / w0 if w0 > 0 else f + d + c
    elif latency is not None and e.misses:
        fetch_rank = (e.misses / n) * latency / _in_flight(m, w0)
    else:
        fetch_rank = 0.0
    cpu = (e.workers_cpu / n) if w0 > 0 and e.workers_cpu is not None else d + lookups
    cpu = min(cpu, d + f)
    if w0 > 0:  # a worker's decode without the wait for a core the measured workers shared
        free = max(0.25, cores - loop_busy)
        over = max(1.0, w0 / free)
        dcpu = min(cpu, d)
        make = min(d, dcpu + max(0.0, d - dcpu * over))
    else:
        make = d
    return _Parts(n, loop, fetch_rank, lookups, make, cpu, cores, loop_busy, _startup(e), e.total, waited)


def _in_flight(m: Measured, workers: int) -> float:
    """Files the dataset copies at once per rank with ``workers`` (its read-ahead's scope and depth)."""
    if m.read_ahead == "rank":
        return float(stream_depth(m.read_depth, workers) * max(1, workers))
    return float(stream_depth(m.read_depth, 1) * max(1, workers))


def _startup(e: EpochTimes) -> float:
    """The epoch's start beyond making its first batch (starting workers, before and during its first wait): kept
    by a changed epoch."""
    before = max(0.0, e.total - e.compute - e.wait - e.compute / max(1.0, e.batches))  # the last batch's compute
    return max(0.0, e.first_wait - e.first_made) + before


def period(m: Measured, p: _Parts, workers: int, *, fetch_scale: float = 1.0, lookups: float | None = None,
           loop: float | None = None, cores: float | None = None, make: float | None = None) -> float:
    """Seconds per batch of an epoch with ``workers`` (the read-ahead's pace scaled by ``fetch_scale``;
    ``lookups``, ``loop``, ``cores``, ``make``: instead of the measured ones)."""
    w0 = m.num_workers
    look = p.lookups if lookups is None else lookups
    own = p.loop if loop is None else loop
    dec = p.make if make is None else make
    fetch = p.fetch_rank * fetch_scale * _in_flight(m, w0) / _in_flight(m, workers)
    if workers <= 0:
        return max(fetch, own + look + dec)
    free = max(0.25, (p.cores if cores is None else cores) - p.loop_busy)
    cpu = min(p.cpu, look + dec)  # the part of a worker's cycle that needs a core
    cycle = look + dec + cpu * (max(1.0, workers / free) - 1.0)  # workers beyond the free cores wait for one
    return max(own, fetch, cycle / workers)


def epoch_seconds(m: Measured, e: EpochTimes, workers: int, **kw: float | None) -> float:
    """The modelled seconds of epoch ``e`` with ``workers`` (``kw``: as :func:`period`), its startup included."""
    p = _parts(m, e)
    return p.n * period(m, p, workers, **kw) + p.startup  # type: ignore[arg-type]


def _explained(m: Measured, e: EpochTimes) -> tuple[float, float]:
    """``(residual, scale)`` of epoch ``e``: the seconds the model leaves unexplained (bursts: kept by every
    prediction) and the factor its steady part is off by where the model is slower than what was measured."""
    p = _parts(m, e)
    steady = p.n * period(m, p, m.num_workers)
    seen = max(0.0, e.total - p.startup)
    if steady <= 0:
        return seen, 1.0
    if seen >= steady:
        return seen - steady, 1.0
    return 0.0, seen / steady


def explains(m: Measured, e: EpochTimes) -> bool:
    """Whether the model explains epoch ``e`` within :data:`EXPLAINED` (else its predictions are unsure)."""
    p = _parts(m, e)
    seen = max(0.0, e.total - p.startup)
    steady = p.n * period(m, p, m.num_workers)
    return abs(steady - seen) <= EXPLAINED * max(seen, 1e-9)


def predict(m: Measured, e: EpochTimes, workers: int, *, keep_residual: bool = True, **kw: float | None) -> float:
    """Epoch ``e`` predicted with ``workers`` and ``kw`` (:func:`period`'s), calibrated on what was measured."""
    p = _parts(m, e)
    residual, scale = _explained(m, e)
    return p.n * period(m, p, workers, **kw) * scale + (residual if keep_residual else 0.0) + p.startup  # type: ignore[arg-type]


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


# ------------------------------------------------------------------ the advice

def advise(m: Measured, before: Measured | None = None, followed: str | None = None) -> list[Advice]:
    """Ranked advice, best first: every change predicted to save more than the noise (workers, prefetch
    depth, ``cache_limit``, ``ds.warm()``, packing small files into shards, more cores), then changes the
    model cannot predict (``predicted_s`` None); or one "none" line saying why nothing is advised.

    ``before``: the run measured before ``followed`` (an advice kind) was changed to this run's setting; that
    knob is advised again only where the change measured a saving."""
    if not m.epochs or all(e.total <= 0 for e in m.epochs):
        return []
    now = baseline(m)
    quiet, quiet_words = threshold(m)
    last = m.epochs[-1]
    stall = last.wait / last.total if last.total > 0 else 0.0
    tried = [_workers(m, now), _prefetch(m, now), _cache_limit(m, now), _warm(m, now), _pack(m, now)]
    blocked = _blocked(m, before, followed, quiet)
    if not any(a is not None and a.predicted_s is not None and now - a.predicted_s >= WORTH * now for a in tried):
        tried.append(_limit(m, now))  # only when nothing within this machine would help, noise or not
    sure = [a for a in tried if a is not None and a.predicted_s is not None and a.kind not in blocked
            and now - a.predicted_s >= quiet]
    unsure = [a for a in tried if a is not None and a.predicted_s is None and a.kind not in blocked]
    sure.sort(key=lambda a: a.predicted_s if a.predicted_s is not None else math.inf)
    if sure or unsure:
        return sure + unsure
    if stall < NOT_BOTTLENECK and not _cold(m):
        why = f"the loop waited {stall:.0%} of its last epoch ({_stages(last)})"
        return [Advice("none", "data loading is not the bottleneck", None, now, why, epochs=run_epochs(m))]
    why = (f"no change is predicted to save more than {_s(quiet)} s ({quiet_words}); "
           f"{_bound_words(m, last)}")
    if blocked:
        why += f"; {', '.join(sorted(blocked))} was just changed and measured no saving"
    return [Advice("none", "nothing to change in the loader", None, now, why, epochs=run_epochs(m))]


def _blocked(m: Measured, before: Measured | None, followed: str | None, quiet: float) -> set[str]:
    """The knob just followed, unless the run measured a saving against the run before it."""
    if before is None or not followed:
        return set()
    r = run_epochs(m)
    then = baseline(replace(before, run_epochs=r))
    now = baseline(m)
    return set() if then - now >= quiet else {followed}


def threshold(m: Measured) -> tuple[float, str]:
    """The least saving advised, in seconds of the run, and what it is: the noise (:func:`noise`), at least
    :data:`WORTH` of the run and :data:`MIN_SAVING_S`."""
    now = baseline(m)
    warm = _warm_epochs(m)
    spread = NOISE_SHARE * sum(e.total for e in m.epochs) / len(m.epochs)
    if len(warm) >= 2:
        spread = (max(e.total - _startup(e) for e in warm) - min(e.total - _startup(e) for e in warm)) \
            * math.sqrt(run_epochs(m))
        words = f"the spread of its {len(warm)} warm epochs"
    else:
        words = f"{NOISE_SHARE:.0%} of an epoch"
    options = [(spread, words), (WORTH * now, f"{WORTH:.0%} of the run"), (MIN_SAVING_S, "the least saving advised")]
    return max(options, key=lambda o: o[0])


def _stages(e: EpochTimes) -> str:
    n = max(e.batches, 1.0)
    return (f"per batch: fetch {e.fetch / n * 1e3:.1f} ms, your code {e.user / n * 1e3:.1f} ms, collate "
            f"{e.collate / n * 1e3:.1f} ms where it is made, loop compute {e.compute / n * 1e3:.1f} ms, "
            f"wait {e.wait / n * 1e3:.1f} ms")


def _user_share(e: EpochTimes) -> float:
    """The user's code's share of making a batch (fetch + user + collate), measured."""
    made = e.fetch + e.user + e.collate
    return e.user / made if made > 0 else 0.0


def _bound_words(m: Measured, e: EpochTimes) -> str:
    """What sets the pace of epoch ``e``, in words, from the model's parts."""
    p = _parts(m, e)
    w = m.num_workers
    n = p.n
    if p.fetch_bound:
        scope = ("the rank's read-ahead, which more workers do not widen" if m.read_ahead == "rank"
                 else "the read-ahead")
        return (f"the loop waits on the volume's copies ({e.misses} misses, {_stages(e)}): {scope} sets the pace"
                if e.misses else f"the loop waits on fetch ({_stages(e)})")
    if w > 0 and p.make / w >= p.loop and _user_share(e) >= USER_SHARE:
        return f"your code makes the batches ({_stages(e)}) on {p.cores:.1f} cores free"
    return f"{_stages(e)}; {n:.0f} batches"


def _cold(m: Measured) -> bool:
    first = m.epochs[0]
    return first.misses > 0 and first.wait >= 0.5 * first.total and first.misses >= 0.5 * max(1, first.items)


def _unsure_epochs(m: Measured) -> list[int]:
    return [i for i, e in enumerate(m.epochs) if not explains(m, e)]


def _crossing(m: Measured, workers: int) -> tuple[bool, str]:
    """Whether moving to ``workers`` changes where batches are made (0 <-> some workers) by more than the model
    can say: ``(unsure, why)``. Moved into the loop's process, your code runs beside the loop (and torch's
    threads there); moved out, it runs on one thread per worker and its batches cross between processes: the run
    measured neither."""
    w0 = m.num_workers
    if (w0 > 0) == (workers > 0):
        return False, ""
    worst = 0.0
    for e in m.epochs:
        if e.batch_bytes and e.batches and e.total > 0:
            worst = max(worst, (e.batch_bytes / CROSS_RATE) / (e.total / e.batches))
    if worst > CROSS_SURE:
        mb = max(e.batch_bytes or 0.0 for e in m.epochs) / 1e6
        return True, (f"batches of {mb:.1f} MB would {'stop crossing' if workers == 0 else 'cross'} between "
                      f"processes, about {worst:.0%} of a batch's time at an assumed {CROSS_RATE / 1e9:.0f} GB/s, "
                      "which this run did not measure")
    last = m.epochs[-1]
    if workers == 0 and _user_share(last) >= USER_SHARE:
        return True, (f"your code ({_user_share(last):.0%} of making a batch) would run in the loop's process, beside "
                      "the loop and torch's threads there, which this run did not measure")
    threads = max((e.cpu / e.wall for e in m.epochs if e.cpu is not None and e.wall), default=0.0)
    if workers > 0 and threads > 1.2:
        return True, (f"the loop's process kept {threads:.1f} cores busy (several threads); in workers your code "
                      "runs on one thread each, which this run did not measure")
    return False, ""


def _workers(m: Measured, now: float) -> Advice | None:
    w0 = m.num_workers
    top = max(4, 2 * m.cores)
    options = sorted({0, 1, 2, 4, 8, 16, m.cores, top} & set(range(top + 1)) - {w0})
    if not options:
        return None
    preds: dict[int, float] = {}
    for w in options:
        per = [predict(m, e, w) for e in m.epochs]
        start = WORKER_START_S * w if w0 == 0 and w > 0 else 0.0
        preds[w] = run_of(m, per, _warm_epoch(m, m.epochs[-1], w) if repeats_warm(m) else None) + start
    best = min(options, key=lambda w: (round(preds[w], 6), abs(w - w0)))
    last = m.epochs[-1]
    p = _parts(m, last)
    kind_words = _why_workers(m, last, p, best)
    unsure, why = _crossing(m, best)
    bad = _unsure_epochs(m)
    if bad and not unsure:
        unsure, why = True, (f"the model explains epoch{'s' if len(bad) > 1 else ''} "
                             f"{', '.join(map(str, bad))} only to more than {EXPLAINED:.0%}")
    change = f"num_workers={best} (now {w0})"
    if unsure:
        if now - preds[best] < noise(m):
            return None
        return Advice("workers", change, None, now, f"{kind_words}; {why}", {"num_workers": best}, run_epochs(m))
    return Advice("workers", change, preds[best], now, kind_words, {"num_workers": best}, run_epochs(m))


def _why_workers(m: Measured, e: EpochTimes, p: _Parts, w: int) -> str:
    n = p.n
    free = max(0.25, p.cores - p.loop_busy)
    share = _user_share(e)
    if p.fetch_bound and m.read_ahead == "rank":
        head = "the volume's copies set the pace, and the rank's read-ahead does not grow with workers"
    elif p.fetch_bound:
        head = "I/O-bound (fetch): each worker stream reads ahead on its own"
    elif share >= USER_SHARE:
        head = f"decode-bound: your code is {share:.0%} of making a batch"
    else:
        head = "making batches sets the pace"
    return (f"{head}; {_stages(e)}; {p.cores:.1f} of {m.cores} cores free to the loader (measured), "
            f"{free:.1f} to workers; {m.num_workers} workers make a batch every "
            f"{period(m, p, m.num_workers) * 1e3:.1f} ms, {w} every {period(m, p, w) * 1e3:.1f} ms (over {n:.0f} "
            "batches)")


def _prefetch(m: Measured, now: float) -> Advice | None:
    w0 = m.num_workers
    if w0 <= 0:
        return None
    depth = min(MAX_PREFETCH, max(4, 2 * max(1, m.prefetch_factor)))
    if depth <= m.prefetch_factor:
        return None
    per = []
    for e in m.epochs:
        if len(e.made) != int(e.batches) or len(e.computes) != len(e.made):
            return None  # no per-batch records to replay
        start = _startup(e)
        was = replay(e.made, e.computes, w0, m.prefetch_factor, start)
        deeper = replay(e.made, e.computes, w0, depth, start)
        per.append(max(0.0, e.total - max(0.0, was - deeper)))
    predicted = run_of(m, per, _warm_epoch(m, m.epochs[-1]) if repeats_warm(m) else None)
    last = m.epochs[-1]
    return Advice("prefetch", f"prefetch_factor={depth} (now {m.prefetch_factor})", predicted, now,
                  f"the measured batches replayed through torch's pipeline with {depth} batches asked for ahead per "
                  f"worker instead of {m.prefetch_factor}: the loop waited {_s(last.wait)} s in its last epoch "
                  f"(p99 {last.wait_p99 * 1e3:.0f} ms)", {"prefetch_factor": depth}, run_epochs(m))


def working_set(m: Measured) -> int | None:
    """Bytes a ``cache_limit`` must hold for a full epoch to stay cached: the dataset, the read-ahead's copies
    in flight (counted at their size while they fill) and :data:`HEADROOM` for the cache's own records."""
    if not m.dataset_bytes:
        return None
    mean = m.mean_file_bytes or (m.dataset_bytes / max(1, m.files or 1))
    flight = _in_flight(m, m.num_workers) * mean
    return int(math.ceil((m.dataset_bytes + flight) * (1 + HEADROOM)))


def _warm_epoch(m: Measured, e: EpochTimes, workers: int | None = None) -> float:
    """Epoch ``e`` predicted with every item cached: a measured warm epoch's pace where there is one, else the
    model with the copies gone (each item a lookup) and the loop's cores given back."""
    w = m.num_workers if workers is None else workers
    warm = _warm_epochs(m)
    if warm and w == m.num_workers:
        ref = warm[-1]
        per = max(0.0, ref.total - _startup(ref)) / max(1.0, ref.batches)
        return per * e.batches + _startup(e)
    p = _parts(m, e)
    items = e.items / max(1.0, e.batches)
    hit = next((x.hit_latency for x in m.epochs if x.hit_latency is not None), None)
    look = items * (hit if hit is not None else HIT_S)
    loop = max(compute_after(e, look * p.n) / p.n, (e.compute_cpu or 0.0) / p.n if m.num_workers > 0 else 0.0)
    return p.n * period(m, p, w, fetch_scale=0.0, lookups=look, loop=loop) + p.startup


def _cache_limit(m: Measured, now: float) -> Advice | None:
    if len(m.epochs) < 2 or not m.later_misses or m.refetches < REFETCH_SHARE * max(1, m.epochs[-1].items):
        return None
    need = working_set(m)
    if need is None:
        return None
    per = [m.epochs[0].total] + [_warm_epoch(m, e) for e in m.epochs[1:]]
    predicted = run_of(m, per, _warm_epoch(m, m.epochs[-1]))
    set_now = f"now {m.cache_limit / 1e9:.2f} GB" if m.cache_limit else "now unset: the disk's free space"
    return Advice("cache_limit", f"cache_limit >= {_size(need)} ({set_now})", predicted, now,
                  f"{m.refetches} of {m.later_misses} misses after the first epoch re-fetched files the cache had "
                  f"held (evicted); a full epoch needs {(m.dataset_bytes or 0) / 1e6:.0f} MB of files plus "
                  f"{_in_flight(m, m.num_workers):.0f} copies in flight, plus {HEADROOM:.0%} headroom; "
                  "epochs after the first predicted with every item cached",
                  {"cache_limit": need}, run_epochs(m))


def _fetch_per_miss(m: Measured) -> float | None:
    """Seconds of the rank's time per missed file in the cold epoch (its copies overlapped as they ran): the
    read-ahead's pace over the misses of a batch, else the copy latency over the files in flight."""
    cold = m.epochs[0]
    if not cold.misses:
        return None
    p = _parts(m, cold)
    if p.fetch_rank > 0:
        return p.fetch_rank * p.n / cold.misses
    latency = cold.miss_latency if cold.miss_latency is not None else m.miss_latency
    return latency / _in_flight(m, m.num_workers) if latency is not None else None


def _warm(m: Measured, now: float) -> Advice | None:
    first = m.epochs[0]
    if run_epochs(m) < 2:
        return None  # one pass reads each file once: copying it first only moves the copies
    if not _cold(m) or (m.cache_limit and m.dataset_bytes and m.cache_limit < (working_set(m) or m.dataset_bytes)):
        return None  # the cache cannot hold the dataset: warming it evicts what it copied first
    each = _fetch_per_miss(m)
    if each is None:
        return None
    files = m.files or first.misses
    cost = files * each * _in_flight(m, m.num_workers) / DEFAULT_INFLIGHT
    per = [_warm_epoch(m, e) for e in m.epochs]
    predicted = cost + run_of(m, per, _warm_epoch(m, m.epochs[-1]))
    return Advice("warm", "ds.warm(background=False) before training", predicted, now,
                  f"epoch 0 missed {first.misses} of {first.items} items and waited {_s(first.wait)} s of "
                  f"{_s(first.total)} s; warming copies the {files} files with {DEFAULT_INFLIGHT} in flight, at the "
                  f"pace epoch 0 copied them ({each * 1e3:.2f} ms per file), then every epoch runs warm",
                  {"warm": True}, run_epochs(m), cost)


def _pack(m: Measured, now: float) -> Advice | None:
    cold = m.epochs[0]
    if m.read_ahead != "rank" or not m.mean_file_bytes or m.mean_file_bytes >= SMALL_FILE:
        return None
    if cold.misses < max(1, cold.items) // 2 or not _cold(m):
        return None
    each = _fetch_per_miss(m)
    latency = cold.miss_latency if cold.miss_latency is not None else m.miss_latency
    if each is None or latency is None:
        return None
    read = m.mean_file_bytes / SHARD_RATE
    if latency <= 2 * read:
        return None  # the copies are mostly bytes: packing does not save the opens
    total = m.dataset_bytes or m.mean_file_bytes * max(1, cold.items)
    files = m.files or cold.items
    workers = max(1, m.num_workers)
    # shards enough for every worker to stream two; each costs one open (a copy's latency less its bytes at the
    # assumed rate) plus its bytes; a worker reads its shards one after another
    shard = int(min(MAX_SHARD, max(MIN_SHARD, total / (2 * workers))))
    shards = max(1, math.ceil(total / shard))
    opening = max(0.0, latency - read)
    stream = math.ceil(shards / workers) * (opening + shard / SHARD_RATE)
    per_file = max(each * _in_flight(m, m.num_workers) / PACK_READS, PACK_FILE_S)
    cost = PACK_START_S + files * per_file + total / WRITE_RATE
    need = working_set(m)
    kept = not (m.cache_limit and need and m.cache_limit < need)  # the cache keeps the shards' chunks
    per = []
    for i, e in enumerate(m.epochs):
        warm = _warm_epoch(m, e)
        if i == 0 or not kept:  # read from the volume: the streams' opens and bytes spread over the epoch's batches
            per.append(max(warm, stream + _parts(m, e).startup))
        else:
            per.append(warm)
    later = _warm_epoch(m, m.epochs[-1]) if kept else per[-1]
    predicted = cost + run_of(m, per, later)
    return Advice("pack", f"pack the small files into shards of {_size(shard)} (ucmagic.shards.pack)", predicted,
                  now, f"mean file {m.mean_file_bytes / 1024:.0f} KB, a copy took {latency * 1e3:.0f} ms in epoch 0, "
                  f"{read * 1e3:.2f} ms of it its bytes at an assumed {SHARD_RATE / 1e6:.0f} MB/s: the per-file opens "
                  f"dominate; {shards} shards of {_size(shard)} over {workers} worker stream"
                  f"{'s' if workers > 1 else ''}, each opened once"
                  f"{'' if kept else ', every epoch (the cache is smaller than the data)'}; "
                  f"packing reads every file with {PACK_READS} in flight ({_s(cost)} s predicted, in the total)",
                  {"pack": True, "shard_size": shard},
                  run_epochs(m), cost)


def _limit(m: Measured, now: float) -> Advice | None:
    """Nothing within this machine helps and the user's code makes the batches: cheaper code, or more cores.
    Its ``settings``: ``cores`` and ``num_workers`` (one per core) it predicts with."""
    last = m.epochs[-1]
    if m.num_workers <= 0 or _user_share(last) < LIMIT_SHARE or last.wait < NOT_BOTTLENECK * last.total:
        return None
    p = _parts(m, last)
    if p.fetch_bound:
        return None
    more = 2 * m.cores
    per = [predict(m, e, more, cores=_parts(m, e).cores + m.cores) for e in m.epochs]
    predicted = run_of(m, per, _warm_epoch(m, m.epochs[-1]) if repeats_warm(m) else None)
    others = (f" (other processes held {m.cores - p.cores:.1f} of the machine's {m.cores})"
              if p.cores < m.cores - 0.25 else "")
    return Advice("limit", f"make your per-item code cheaper, or use {more} cores", predicted, now,
                  f"your code is {_user_share(last):.0%} of making a batch and the workers use the {p.cores:.1f} cores "
                  f"free to them{others}; {_stages(last)}; predicted with twice the cores and num_workers={more}",
                  {"cores": more, "num_workers": more}, run_epochs(m))


def _size(n: float) -> str:
    """``n`` bytes as ``cache_limit`` and pack's ``shard_size`` take it (MB or GB, rounded up)."""
    return f"{math.ceil(n / 1e8) / 10:.1f}GB" if n >= 1e9 else f"{max(1, math.ceil(n / 1e6))}MB"
