"""What to change so the loop stops waiting: ranked advice with a predicted epoch time (pure).

Input is plain data (:class:`Measured`: the measured stage seconds of each epoch and the loader's
settings, built from a loader's records by :func:`ucmagic.loading.stats_analysis.measured`); output a
list of :class:`Advice`, best first, each naming the measured numbers its prediction used.

The model of one epoch with ``w`` workers: each batch costs its producing process ``f + u + k``
seconds (fetch, the user's code, collate), so ``w`` workers make one batch every
``max((f + u + k) / w, (u + k) / cpus)`` seconds (fetch waits on I/O and scales with the workers,
the user's code and collate need a core each; ``cpus`` is the cores the loop leaves free); the loop
takes ``c`` seconds of its own per batch, so the epoch lasts ``batches * max(c, period)`` plus what
the measured epoch had beyond this model, up to its first batch's wait (startup), which every
prediction keeps. With no workers
everything runs in the loop: ``batches * (c + f + u + k)``.

A change that takes work off the workers (``ds.warm()``, a larger ``cache_limit``, packing) also gives
the loop its cores back: of ``c``, the part beyond the loop thread's measured CPU time (it waited for a
core) shrinks with the workers' work (:func:`compute_after`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

NOT_BOTTLENECK = 0.05  # the loop waits under this share of its time: loading is not the bottleneck
WORTH = 0.05  # a change predicted to save under this share of the epoch is not advised
REFETCH_SHARE = 0.05  # re-fetched items over this share of an epoch's items: the cache is too small
SMALL_FILE = 256 * 1024  # mean bytes per file under which per-file opens dominate a copy
SHARD_RATE = 100e6  # bytes/s assumed for reading packed shards (stated in the advice)
MIN_SHARD, MAX_SHARD = 1 << 20, 1 << 30  # shard sizes the pack advice names: 1 MiB .. pack's default 1 GiB
MAX_PREFETCH = 16


@dataclass
class EpochTimes:
    """One epoch's measured seconds (as ``LoaderStats.breakdown(epoch)``) and counts."""

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

    @property
    def total(self) -> float:
        """The loop's time in this epoch: compute + wait."""
        return self.compute + self.wait


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


@dataclass
class Advice:
    """One change: ``change`` (what to do), ``predicted_s`` (the epoch time with it), ``now_s`` (the
    measured epoch it is compared with), ``because`` (the measured numbers used) and ``kind``."""

    kind: str
    change: str
    predicted_s: float
    now_s: float
    because: str
    settings: dict[str, object] = field(default_factory=dict)  # the loader/dataset arguments it changes

    def __str__(self) -> str:
        return f"{self.change}: epoch {_s(self.now_s)} s -> {_s(self.predicted_s)} s predicted ({self.because})"


def cpus_free(m: Measured, e: EpochTimes) -> float:
    """Cores the workers can use: all but the share of one the loop's own compute keeps busy."""
    busy = e.compute / e.total if e.total > 0 else 0.0
    return max(1.0, m.cores - busy)


def epoch_model(e: EpochTimes, workers: int, cpus: float, fetch: float | None = None,
                compute: float | None = None) -> float:
    """Modelled seconds of epoch ``e`` with ``workers`` (``fetch``, ``compute``: its total fetch and loop
    compute seconds instead of the measured ones)."""
    n = max(e.batches, 1.0)
    f = (e.fetch if fetch is None else fetch) / n
    u, k, c = e.user / n, e.collate / n, (e.compute if compute is None else compute) / n
    if workers <= 0:
        return e.batches * (c + f + u + k)
    period = max((f + u + k) / workers, (u + k) / min(cpus, workers))
    return e.batches * max(c, period)


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


def _contention(e: EpochTimes) -> str:
    """The measured numbers :func:`compute_after` used, for an advice's ``because``."""
    if e.compute_cpu is None or e.compute_cpu >= e.compute:
        return ""
    n = max(e.batches, 1.0)
    return (f"; the loop's compute took {e.compute / n * 1e3:.1f} ms per batch, {e.compute_cpu / n * 1e3:.1f} ms of "
            "it on the CPU: the rest shrinks with the workers' work")


def _overhead(m: Measured, e: EpochTimes) -> float:
    """What the measured epoch took beyond the model that a change keeps: its startup, at most."""
    return min(e.first_wait, max(0.0, e.total - epoch_model(e, m.num_workers, cpus_free(m, e))))


def _startup(e: EpochTimes) -> float:
    """The epoch's start beyond making its first batch (starting workers): kept by a changed first epoch."""
    return max(0.0, e.first_wait - e.first_made)


def _stages(e: EpochTimes) -> str:
    n = max(e.batches, 1.0)
    return (f"per batch: fetch {e.fetch / n * 1e3:.1f} ms, your code {e.user / n * 1e3:.1f} ms, collate "
            f"{e.collate / n * 1e3:.1f} ms in a worker, loop compute {e.compute / n * 1e3:.1f} ms, "
            f"wait {e.wait / n * 1e3:.1f} ms")


def advise(m: Measured) -> list[Advice]:
    """Ranked advice (largest predicted saving first) from measured stage times.

    "data loading is not the bottleneck" alone when the loop waits under 5% of its time in its last
    epoch; otherwise every change predicted to save at least 5% of an epoch: workers, prefetch depth,
    ``cache_limit``, ``ds.warm()``, packing small files into shards."""
    if not m.epochs or m.epochs[-1].total <= 0:
        return []
    last = m.epochs[-1]
    stall = last.wait / last.total
    if stall < NOT_BOTTLENECK and not _cold(m):
        return [Advice("none", "data loading is not the bottleneck", last.total, last.total,
                       f"the loop waited {stall:.0%} of its {_s(last.total)} s last epoch ({_stages(last)})")]
    found = [a for a in (_workers(m, last), _prefetch(m, last), _cache_limit(m, last), _warm(m), _pack(m, last))
             if a is not None and a.now_s - a.predicted_s >= WORTH * a.now_s]
    found.sort(key=lambda a: a.predicted_s - a.now_s)
    if not found and stall < NOT_BOTTLENECK:
        return [Advice("none", "data loading is not the bottleneck", last.total, last.total,
                       f"the loop waited {stall:.0%} of its {_s(last.total)} s last epoch")]
    return found or [_limit(m, last)]


def _limit(m: Measured, e: EpochTimes) -> Advice:
    """Nothing within this machine helps: the workers use every core on fetch, your code and collate.
    Its ``settings``: ``cores`` (the machine's) and ``num_workers`` (one per core) it predicts with."""
    cpus = cpus_free(m, e)
    more = epoch_model(e, 2 * m.cores, cpus + m.cores) + _overhead(m, e)
    return Advice("limit", f"make your per-item code cheaper, or use {2 * m.cores} cores", more, e.total,
                  f"{m.num_workers} workers on {m.cores} cores already make batches as fast as the cores allow; "
                  f"{_stages(e)}; predicted with twice the cores and num_workers={2 * m.cores}",
                  {"cores": 2 * m.cores, "num_workers": 2 * m.cores})


def _s(x: float) -> str:
    return f"{x:.3g}"


def _workers(m: Measured, e: EpochTimes) -> Advice | None:
    cpus = cpus_free(m, e)
    extra = _overhead(m, e)
    n = max(e.batches, 1.0)
    io_bound = e.fetch > e.user + e.collate
    top = max(4, 2 * m.cores) if io_bound else max(1, m.cores)  # I/O waits need no core; decoding does
    options = sorted({0, 1, 2, 4, 8, 16, m.cores, top} & set(range(top + 1)) | {m.num_workers})
    pred = {w: epoch_model(e, w, cpus) + extra for w in options}
    best = min(options, key=lambda w: (round(pred[w], 6), abs(w - m.num_workers)))
    if best == m.num_workers:
        return None
    kind = "I/O-bound (fetch)" if io_bound else "decode-bound (your code + collate)"
    return Advice("workers", f"num_workers={best} (now {m.num_workers})", pred[best], e.total,
                  f"{kind}: {_stages(e)}; {m.cores} cores, {cpus:.1f} free of the loop; "
                  f"{m.num_workers} workers make a batch every "
                  f"{epoch_model(e, m.num_workers, cpus) / n * 1e3:.1f} ms", {"num_workers": best})


def _prefetch(m: Measured, e: EpochTimes) -> Advice | None:
    if m.num_workers <= 0 or e.batches < 2:
        return None
    n = e.batches
    steady = epoch_model(e, m.num_workers, cpus_free(m, e))
    if steady > e.compute * 1.05:  # the workers cannot keep up on average: depth does not help
        return None
    depth = min(MAX_PREFETCH, max(4, 2 * max(1, m.prefetch_factor)))
    if depth <= m.prefetch_factor:
        return None
    predicted = steady + min(e.wait, e.wait_p99)  # the bursts absorbed; about one slow batch still felt
    return Advice("prefetch", f"prefetch_factor={depth} (now {m.prefetch_factor})", predicted, e.total,
                  f"the workers keep up on average ({steady / n * 1e3:.1f} ms per batch vs the loop's "
                  f"{e.compute / n * 1e3:.1f} ms) yet the loop waited {_s(e.wait)} s in bursts "
                  f"(p99 {e.wait_p99 * 1e3:.0f} ms)", {"prefetch_factor": depth})


def _cache_limit(m: Measured, e: EpochTimes) -> Advice | None:
    if len(m.epochs) < 2 or not m.later_misses or m.refetches < REFETCH_SHARE * max(1, e.items):
        return None
    share = min(1.0, m.refetches / max(1, sum(x.misses for x in m.epochs[1:])))
    # hits cost next to nothing beside a copy: the re-fetched share of the misses is that share of the fetch
    fetch = e.fetch * (1 - share)
    predicted = epoch_model(e, m.num_workers, cpus_free(m, e), fetch, compute_after(e, fetch)) + _startup(e)
    size = f"{m.dataset_bytes / 1e9:.2f} GB" if m.dataset_bytes else "the dataset's size"
    now = f"now {m.cache_limit / 1e9:.2f} GB" if m.cache_limit else "now unset: the disk's free space"
    return Advice("cache_limit", f"cache_limit >= {size} ({now})", predicted, e.total,
                  f"{m.refetches} of {m.later_misses} misses after the first epoch re-fetched files the cache "
                  f"had held (evicted); last epoch fetch {_s(e.fetch)} s{_contention(e)}",
                  {"cache_limit": m.dataset_bytes})


def _cold(m: Measured) -> bool:
    first = m.epochs[0]
    return first.misses > 0 and first.wait >= 0.5 * first.total and (first.misses >= 0.5 * max(1, first.items))


def _warm(m: Measured) -> Advice | None:
    first = m.epochs[0]
    if not _cold(m) or (m.cache_limit and m.dataset_bytes and m.cache_limit < m.dataset_bytes):
        return None  # the cache cannot hold the dataset: warming it evicts what it copied first
    warm = next((e for e in m.epochs[1:] if e.misses <= 0.05 * max(1, e.items)), None)
    if warm is not None:  # a warm epoch was measured: epoch 0 warmed runs as it did (bursts included)
        n0, n1 = max(first.batches, 1.0), max(warm.batches, 1.0)
        steady = max(0.0, warm.total - _startup(warm))
        predicted = steady * n0 / n1 + _startup(first)
        how = f"a warm epoch took {_s(steady / n1 * 1e3)} ms per batch beyond its startup ({_stages(warm)})"
        because = ""
    else:
        fetch = first.fetch * (1 - first.misses / max(1, first.items))
        predicted = (epoch_model(first, m.num_workers, cpus_free(m, first), fetch, compute_after(first, fetch))
                     + _startup(first))
        how = "the hits' share of the fetch kept"
        because = _contention(first)
    return Advice("warm", "ds.warm(background=False) before training", predicted, first.total,
                  f"epoch 0 missed {first.misses} of {first.items} items and waited {_s(first.wait)} s of "
                  f"{_s(first.total)} s (fetch {_s(first.fetch)} s); {how}{because}; warming copies the files "
                  "once, before the loop, in parallel (its own time, about that of epoch 0's copies, is not in "
                  "the prediction)", {"warm": True})


def _pack(m: Measured, e: EpochTimes) -> Advice | None:
    cold = m.epochs[0]
    if not m.mean_file_bytes or m.mean_file_bytes >= SMALL_FILE or cold.misses < max(1, cold.items) // 2:
        return None
    if cold.fetch <= cold.user + cold.collate or cold.wait < 0.5 * cold.total:
        return None
    per_miss = cold.fetch / max(1, cold.misses)
    read = m.mean_file_bytes / SHARD_RATE
    if per_miss <= 2 * read:
        return None
    total = m.dataset_bytes or m.mean_file_bytes * max(1, cold.items)
    workers = max(1, m.num_workers)
    # shards enough for every worker to stream two: each shard costs one open (a file's copy latency
    # less its bytes at the assumed rate) plus its bytes; a worker reads its shards one after another
    shard = int(min(MAX_SHARD, max(MIN_SHARD, total / (2 * workers))))
    shards = max(1, math.ceil(total / shard))
    opening = max(0.0, m.miss_latency - read) if m.miss_latency is not None else 0.0
    per_worker = math.ceil(shards / workers) * (opening + shard / SHARD_RATE)
    fetch = min(cold.fetch, per_worker * workers)  # the model divides the fetch over the workers
    predicted = epoch_model(cold, m.num_workers, cpus_free(m, cold), fetch, compute_after(cold, fetch)) + _startup(cold)
    opens = (f"; {shards} shards of {shard / 1e6:.0f} MB, each opened in {opening * 1e3:.0f} ms (a file's copy "
             f"took {m.miss_latency * 1e3:.0f} ms)" if m.miss_latency is not None else "")
    return Advice("pack", f"pack the small files into shards of {_size(shard)} (ucmagic.shards.pack)", predicted,
                  cold.total,
                  f"mean file {m.mean_file_bytes / 1024:.0f} KB took {per_miss * 1e3:.1f} ms of fetch per copy "
                  f"in epoch 0, {read * 1e3:.2f} ms at an assumed {SHARD_RATE / 1e6:.0f} MB/s from shards: the "
                  f"per-file opens dominate{opens}{_contention(cold)}", {"pack": True, "shard_size": shard})


def _size(n: float) -> str:
    """``n`` bytes as pack's ``shard_size`` takes it (MB or GB, rounded)."""
    return f"{n / 1e9:.0f}GB" if n >= 1e9 else f"{max(1, round(n / 1e6))}MB"
