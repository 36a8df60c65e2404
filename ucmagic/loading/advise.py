"""What to change so the loop stops waiting: ranked advice, each predicting the whole run (pure).

Input is plain data (:class:`~ucmagic.loading.advise_model.Measured`); output a list of :class:`Advice`,
best first. The model of the engine the predictions come from is :mod:`.advise_model`.

**One baseline.** The run measured (:func:`~ucmagic.loading.advise_model.baseline`). Every advice predicts
that same run with its change, its own cost included (warming the cache, packing the files), so each
line compares with one number, stated in it (:func:`header` says it above the list).

**Right or silent.** A batch made in a worker crosses to the loop through shared memory, and code moved
into the loop's process runs beside the loop (and torch's threads there): the run measures one side only,
so advice that moves between 0 and some workers with big batches (over :data:`CROSS_SURE` of a batch's
time at an assumed :data:`CROSS_RATE`), with the user's code a measured share of making a batch, or from a
loop process that kept several cores busy, says "unsure" instead of a number; so does advice on a run the
model does not explain. No advice saves less than the noise (:func:`~ucmagic.loading.advise_model.threshold`),
and one with its own cost (warming, packing: predicted, not measured) not less than the noise plus
:data:`COST_DOUBT` of that cost.
A knob just followed (``before``: the run measured before it was changed) is not advised again unless that
change measured a saving. "Decode-bound" and "make your code cheaper" need the user's code to be a measured
share of making a batch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

from ..files.fetch import DEFAULT_INFLIGHT
from .advise_model import (EXPLAINED, HEADROOM, WORTH, EpochTimes, Measured, Parts, baseline, compute_after,
                           cores_free, explains, fetch_per_miss, in_flight, noise, parts, period, predict,
                           repeats_warm, replay, run_epochs, run_of, startup, threshold, user_share, warm_epoch,
                           working_set)

__all__ = ["Advice", "EpochTimes", "Measured", "advise", "baseline", "compute_after", "cores_free", "header",
           "noise", "period", "predict", "replay", "run_epochs", "threshold", "working_set"]

NOT_BOTTLENECK = 0.05  # the loop waits under this share of its time: loading is not the bottleneck
REFETCH_SHARE = 0.05  # re-fetched items over this share of an epoch's items: the cache is too small
USER_SHARE = 0.25  # the user's code is a measured share of the batch: "decode-bound"
LIMIT_SHARE = 0.5  # ... and "make your code cheaper" when it is at least half of making a batch
SMALL_FILE = 256 * 1024  # mean bytes per file under which per-file opens dominate a copy
SHARD_RATE = 100e6  # bytes/s assumed for reading packed shards (stated in the advice)
PACK_READS = 256  # pack's reads in flight (its default workers)
WRITE_RATE = 500e6  # bytes/s assumed for writing packed shards to local disk
PACK_FILE_S = 3e-4  # pack's own seconds per file (tar headers, the index), assumed
PACK_START_S = 0.3  # pack's listing, index and commit, assumed
MIN_SHARD, MAX_SHARD = 1 << 20, 1 << 30  # shard sizes the pack advice names: 1 MiB .. pack's default 1 GiB
CROSS_RATE = 0.5e9  # bytes/s assumed for moving a batch between processes (issue 52: 19 MB cost 30-50 ms more)
CROSS_SURE = 0.1  # a batch's crossing (at CROSS_RATE) over this share of its time: a change of workers is unsure
WORKER_START_S = 0.05  # seconds to start one worker process (fork), once per run (persistent workers)
MAX_PREFETCH = 16
REPLAY_MAX = 20_000  # batches of an epoch replayed through torch's pipeline (prefetch advice)
COST_DOUBT = 0.25  # a change with its own cost must save this share of that cost more than the noise


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
    # a change's own cost (warming, packing) is itself predicted: it must save that much more than the noise
    sure = [a for a in tried if a is not None and a.predicted_s is not None and a.kind not in blocked
            and now - a.predicted_s >= quiet + COST_DOUBT * a.cost_s]
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


def _stages(e: EpochTimes) -> str:
    n = max(e.batches, 1.0)
    return (f"per batch: fetch {e.fetch / n * 1e3:.1f} ms, your code {e.user / n * 1e3:.1f} ms, collate "
            f"{e.collate / n * 1e3:.1f} ms where it is made, loop compute {e.compute / n * 1e3:.1f} ms, "
            f"wait {e.wait / n * 1e3:.1f} ms")


def _bound_words(m: Measured, e: EpochTimes) -> str:
    """What sets the pace of epoch ``e``, in words, from the model's parts."""
    p = parts(m, e)
    w = m.num_workers
    n = p.n
    if p.fetch_bound:
        scope = ("the rank's read-ahead, which more workers do not widen" if m.read_ahead == "rank"
                 else "the read-ahead")
        return (f"the loop waits on the volume's copies ({e.misses} misses, {_stages(e)}): {scope} sets the pace"
                if e.misses else f"the loop waits on fetch ({_stages(e)})")
    if w > 0 and p.make / w >= p.loop and user_share(e) >= USER_SHARE:
        return f"your code makes the batches ({_stages(e)}) on {p.cores:.1f} cores free"
    return f"{_stages(e)}; {n:.0f} batches"


def _cold(m: Measured) -> bool:
    first = m.epochs[0]
    return first.misses > 0 and first.wait >= 0.5 * first.total and first.misses >= 0.5 * max(1, first.items)


def _unsure_epochs(m: Measured) -> list[int]:
    return [i for i, e in enumerate(m.epochs) if not explains(m, e)]


def _crossing(m: Measured, workers: int) -> tuple[bool, str]:
    """Whether moving to ``workers`` changes how batches are made by more than the model can say: ``(unsure,
    why)``. Big batches: copied through shared memory by each worker at once (memory traffic the run measured
    at one count only), or not at all without workers. Moved into the loop's process, your code runs beside the
    loop (and torch's threads there); moved out, on one thread per worker: the run measured neither."""
    w0 = m.num_workers
    if workers == w0:
        return False, ""
    worst = 0.0
    for e in m.epochs:
        if e.batch_bytes and e.batches and e.total > 0:
            worst = max(worst, (e.batch_bytes / CROSS_RATE) / (e.total / e.batches))
    if worst > CROSS_SURE:
        mb = max(e.batch_bytes or 0.0 for e in m.epochs) / 1e6
        how = ("would stop crossing between processes" if workers == 0 else
               f"would cross from {workers} workers at once" if w0 > 0 else "would cross between processes")
        return True, (f"batches of {mb:.1f} MB {how}, about {worst:.0%} of a batch's time at an assumed "
                      f"{CROSS_RATE / 1e9:.1f} GB/s, which this run did not measure")
    if (w0 > 0) == (workers > 0):
        return False, ""
    last = m.epochs[-1]
    if workers == 0 and user_share(last) >= USER_SHARE:
        return True, (f"your code ({user_share(last):.0%} of making a batch) would run in the loop's process, beside "
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
        preds[w] = run_of(m, per, warm_epoch(m, m.epochs[-1], w) if repeats_warm(m) else None) + start
    best = min(options, key=lambda w: (round(preds[w], 6), abs(w - w0)))
    # the words describe the epoch the change saves most in (a cold epoch's fetch, a warm one's decode)
    saves = max(m.epochs, key=lambda e: predict(m, e, w0) - predict(m, e, best))
    kind_words = _why_workers(m, saves, parts(m, saves), best)
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


def _why_workers(m: Measured, e: EpochTimes, p: Parts, w: int) -> str:
    n = p.n
    free = max(0.25, p.cores - p.loop_busy)
    share = user_share(e)
    if p.fetch_bound and m.read_ahead == "rank":
        head = "the volume's copies set the pace, and the rank's read-ahead does not grow with workers"
    elif p.fetch_bound:
        head = "I/O-bound (fetch): each worker stream reads ahead on its own"
    elif share >= USER_SHARE:
        head = f"decode-bound: your code is {share:.0%} of making a batch"
    else:
        head = "making batches sets the pace"
    which = f"epoch {m.epochs.index(e)}: " if len(m.epochs) > 1 else ""
    return (f"{which}{head}; {_stages(e)}; {p.cores:.1f} of {m.cores} cores free to the loader (measured), "
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
        n = len(e.made)
        if n != int(e.batches) or len(e.computes) != n or not n:
            return None  # no per-batch records to replay
        k = min(n, REPLAY_MAX)  # a long epoch: its first batches, the saving scaled to all of them
        made, comp = [float(x) for x in e.made[:k]], [float(x) for x in e.computes[:k]]
        start = startup(e)
        saved = replay(made, comp, w0, m.prefetch_factor, start) - replay(made, comp, w0, depth, start)
        per.append(max(0.0, e.total - max(0.0, saved) * n / k))
    predicted = run_of(m, per, warm_epoch(m, m.epochs[-1]) if repeats_warm(m) else None)
    last = m.epochs[-1]
    return Advice("prefetch", f"prefetch_factor={depth} (now {m.prefetch_factor})", predicted, now,
                  f"the measured batches replayed through torch's pipeline with {depth} batches asked for ahead per "
                  f"worker instead of {m.prefetch_factor}: the loop waited {_s(last.wait)} s in its last epoch "
                  f"(p99 {last.wait_p99 * 1e3:.0f} ms)", {"prefetch_factor": depth}, run_epochs(m))


def _cache_limit(m: Measured, now: float) -> Advice | None:
    if len(m.epochs) < 2 or not m.later_misses or m.refetches < REFETCH_SHARE * max(1, m.epochs[-1].items):
        return None
    need = working_set(m)
    if need is None:
        return None
    per = [m.epochs[0].total] + [warm_epoch(m, e) for e in m.epochs[1:]]
    predicted = run_of(m, per, warm_epoch(m, m.epochs[-1]))
    set_now = f"now {m.cache_limit / 1e9:.2f} GB" if m.cache_limit else "now unset: the disk's free space"
    return Advice("cache_limit", f"cache_limit >= {_size(need)} ({set_now})", predicted, now,
                  f"{m.refetches} of {m.later_misses} misses after the first epoch re-fetched files the cache had "
                  f"held (evicted); a full epoch needs {(m.dataset_bytes or 0) / 1e6:.0f} MB of files plus "
                  f"{in_flight(m, m.num_workers):.0f} copies in flight, plus {HEADROOM:.0%} headroom; "
                  "epochs after the first predicted with every item cached",
                  {"cache_limit": need}, run_epochs(m))


def _warm(m: Measured, now: float) -> Advice | None:
    first = m.epochs[0]
    if run_epochs(m) < 2:
        return None  # one pass reads each file once: copying it first only moves the copies
    if not _cold(m) or (m.cache_limit and m.dataset_bytes and m.cache_limit < (working_set(m) or m.dataset_bytes)):
        return None  # the cache cannot hold the dataset: warming it evicts what it copied first
    each = fetch_per_miss(m)
    if each is None:
        return None
    files = m.files or first.misses
    cost = files * each * in_flight(m, m.num_workers) / DEFAULT_INFLIGHT
    per = [warm_epoch(m, e) for e in m.epochs]
    predicted = cost + run_of(m, per, warm_epoch(m, m.epochs[-1]))
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
    each = fetch_per_miss(m)
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
    # more reads in flight divide the copies' latency, not the CPU the loop's process spent copying them (0 workers,
    # its wait not explained by the copies: that is what each file cost it)
    bound = m.num_workers > 0 or parts(m, cold).fetch_bound
    per_file = max(each * in_flight(m, m.num_workers) / PACK_READS if bound else each, PACK_FILE_S)
    cost = PACK_START_S + files * per_file + total / WRITE_RATE
    need = working_set(m)
    kept = not (m.cache_limit and need and m.cache_limit < need)  # the cache keeps the shards' chunks
    per = []
    for i, e in enumerate(m.epochs):
        warm = warm_epoch(m, e)
        if i == 0 or not kept:  # read from the volume: the streams' opens and bytes spread over the epoch's batches
            per.append(max(warm, stream + parts(m, e).startup))
        else:
            per.append(warm)
    later = warm_epoch(m, m.epochs[-1]) if kept else per[-1]
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
    if m.num_workers <= 0 or user_share(last) < LIMIT_SHARE or last.wait < NOT_BOTTLENECK * last.total:
        return None
    p = parts(m, last)
    if p.fetch_bound:
        return None
    more = 2 * m.cores
    # cores do not speed up an epoch whose copies set the pace (a cold epoch's fetch): it stays as measured
    per = [e.total if parts(m, e).fetch_bound else predict(m, e, more, cores=parts(m, e).cores + m.cores)
           for e in m.epochs]
    predicted = run_of(m, per, warm_epoch(m, m.epochs[-1]) if repeats_warm(m) else None)
    others = (f" (other processes held {m.cores - p.cores:.1f} of the machine's {m.cores})"
              if p.cores < m.cores - 0.25 else "")
    return Advice("limit", f"make your per-item code cheaper, or use {more} cores", predicted, now,
                  f"your code is {user_share(last):.0%} of making a batch and the workers use the {p.cores:.1f} cores "
                  f"free to them{others}; {_stages(last)}; predicted with twice the cores and num_workers={more}",
                  {"cores": more, "num_workers": more}, run_epochs(m))


def _size(n: float) -> str:
    """``n`` bytes as ``cache_limit`` and pack's ``shard_size`` take it (MB or GB, rounded up)."""
    return f"{math.ceil(n / 1e8) / 10:.1f}GB" if n >= 1e9 else f"{max(1, math.ceil(n / 1e6))}MB"
