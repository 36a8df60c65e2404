"""Analysis of a loader's records (pure: numpy in, numbers and sentences out; nothing recorded here).

The per-batch table (:func:`batch_table`), filters over it (:func:`select`, :func:`slowest`), the
cache fill a live snapshot shows (:func:`cache_fill`) and the straggler hints
(:func:`straggler_hints`). :class:`~ucmagic.loading.loader_stats.LoaderStats` calls these on its records;
the explorer and the panel read them through LoaderStats.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Sequence

import numpy as np

from ..telemetry import STAGES, BatchRecorder, ItemLog, percentiles
from .advise_model import EpochTimes, Measured
from ..units import short_name

BatchTable = Dict[str, np.ndarray]  # one row per batch, see batch_table()
FileRows = Callable[[int], "list[dict[str, Any]]"]  # batch position -> its items, slowest first
ItemTimes = Callable[[int], "tuple[np.ndarray, np.ndarray]"]  # batch position -> its items' (fetch seconds, hit)

COLD_SHARE = 0.5  # a cold epoch (or the batches with misses) holding this share of the wait: warm first
FEW_FILES = 3  # files named by the p99 hint
FEW_FILES_SHARE = 0.3  # ... when they hold this share of the p99 wait
SLOW_FILE = 3.0  # ... and each took this many times the median file's fetch (of its kind: copies or lookups)
DECODE_STALL = 0.3  # waiting this share of the time with a warm cache: decoding is the bottleneck
WARM_MISS_SHARE = 0.05  # a cache is warm when at most this share of items missed
SLOW_WORKER = 2.0  # a worker's median wait this many times the others' (and >= 5 ms)
STAGE_WORDS = {"fetch": "its fetch", "user": "your code", "collate": "collate"}
SLOW_RANK = 1.5  # a rank's mean wait this many times the median rank's (and >= 1 ms)
NOT_BOTTLENECK = 0.05  # waiting under this share of the time: loading is not the bottleneck


def batch_table(rec: BatchRecorder, log: ItemLog) -> BatchTable:
    """One row per batch: ``step`` (per rank), ``fetch_s``, ``compute_s``, ``epoch``, ``worker``
    (-1: main process), ``rank``, ``items``, ``misses`` and ``bytes`` (of the recorded items)."""
    a = log.arrays()
    n = min(len(rec), len(a["count"]))
    rank = a["rank"][:n]
    step = np.zeros(n, dtype=np.int64)
    for r in np.unique(rank):
        m = rank == r
        step[m] = np.arange(int(m.sum()))
    return {"step": step, "fetch_s": rec.fetch_array()[:n], "compute_s": rec.compute_array()[:n],
            "epoch": a["epoch"][:n], "worker": a["worker"][:n], "rank": rank, "items": a["count"][:n],
            "misses": a["misses"][:n], "bytes": a["nbytes"][:n],
            **{f"stage_{k}_s": a[f"stage_{k}"][:n].astype(float) for k in STAGES}}


class StageTotals:
    """Running seconds per stage of a set of batches (an epoch; the live panel's bar), O(1) per batch.

    The loop's ``compute`` and ``wait``; the wait split over the batch's stages in proportion to its
    stage times (``wait_fetch``, ``wait_user``, ``wait_collate``; a batch without them counts as
    fetch); the producing processes' ``fetch``, ``user``, ``collate`` (overlapping the loop with
    workers); ``batches``."""

    KEYS = ("compute", "wait", *(f"wait_{k}" for k in STAGES), *STAGES, "batches")

    def __init__(self) -> None:
        self._v = [0.0] * len(self.KEYS)  # in KEYS order: the loop's thread adds to it per batch

    def add(self, wait: float, compute: float, stages: Sequence[float | None] | None) -> None:
        """One batch (flat and unrolled: the loop's thread runs it per batch)."""
        v = self._v
        v[0] += compute
        v[1] += wait
        v[8] += 1.0
        if stages is None:
            v[2] += wait
            return
        f, u, k = stages
        f = 0.0 if f is None or f != f else f  # f != f: NaN (not measured)
        u = 0.0 if u is None or u != u else u
        k = 0.0 if k is None or k != k else k
        v[5] += f
        v[6] += u
        v[7] += k
        made = f + u + k
        if made > 0:
            share = wait / made
            v[2] += f * share
            v[3] += u * share
            v[4] += k * share
        else:
            v[2] += wait

    @property
    def sums(self) -> dict[str, float]:
        """Seconds per key (:data:`KEYS`)."""
        return dict(zip(self.KEYS, self._v))

    def as_dict(self) -> dict[str, float]:
        return self.sums


def breakdown(b: BatchTable, mask: np.ndarray) -> dict[str, float]:
    """:class:`StageTotals` of the batches in ``mask``."""
    t = StageTotals()
    cols = [b[f"stage_{k}_s"][mask].tolist() for k in STAGES]
    for w, c, *st in zip(b["fetch_s"][mask].tolist(), b["compute_s"][mask].tolist(), *cols):
        t.add(w, c, st)
    return t.as_dict()


def _item_epochs(a: dict[str, np.ndarray], epochs: np.ndarray) -> np.ndarray | None:
    """The epoch of every item kept in detail (``a``: :meth:`ItemLog.arrays`); None when none are."""
    n = min(len(epochs), len(a["count"]))
    kept = int(a["start"][n - 1] + a["count"][n - 1]) if n else 0
    if not kept or kept > len(a["index"]):
        return None
    return np.repeat(epochs[:n], a["count"][:n])[:kept]


def refetched_items(a: dict[str, np.ndarray], epochs: np.ndarray) -> tuple[int, int]:
    """``(misses of files already copied in an earlier epoch, misses in epochs after the first)``:
    re-fetches mean the cache evicted what a later epoch read again (a ``cache_limit`` too small).
    ``a``: the item log's :meth:`ItemLog.arrays`."""
    item_epoch = _item_epochs(a, epochs)
    if item_epoch is None:
        return 0, 0
    kept = len(item_epoch)
    idx, miss = a["index"][:kept], ~np.signbit(a["fetch"][:kept])
    seen: set[int] = set()
    refetch = later = 0
    for e in np.unique(item_epoch).tolist():
        m = (item_epoch == e) & miss
        ids = idx[m].tolist()
        if e != int(item_epoch[0]):
            later += len(ids)
            refetch += sum(1 for i in ids if i in seen)
        seen.update(ids)
    return refetch, later


def first_miss_latency(a: dict[str, np.ndarray], epochs: np.ndarray) -> float | None:
    """Median seconds one missed file's copy took (on its fetch thread) in the first recorded epoch; None
    without item records or misses. ``a``: the item log's :meth:`ItemLog.arrays`."""
    item_epoch = _item_epochs(a, epochs)
    if item_epoch is None:
        return None
    return item_latencies(a, epochs).get(int(item_epoch[0]), (None, None))[0]


def item_latencies(a: dict[str, np.ndarray], epochs: np.ndarray) -> dict[int, tuple[float | None, float | None]]:
    """Per epoch, ``(median seconds of a missed file's copy, median seconds of a cached item's lookup)``
    (None where the epoch had none) from the item records. ``a``: the item log's :meth:`ItemLog.arrays`."""
    item_epoch = _item_epochs(a, epochs)
    if item_epoch is None:
        return {}
    f = a["fetch"][:len(item_epoch)]
    out: dict[int, tuple[float | None, float | None]] = {}
    for e in np.unique(item_epoch).tolist():
        x = f[item_epoch == e]
        hit = np.signbit(x)
        out[int(e)] = (float(np.median(x[~hit])) if (~hit).any() else None,
                       float(np.median(-x[hit])) if hit.any() else None)
    return out


def measured(b: BatchTable, setup: dict[str, Any], counters: dict[str, int] | None, log: ItemLog,
             run_epochs: int | None = None) -> Measured:
    """The plain numbers :func:`~ucmagic.loading.advise.advise` decides on, from a loader's records
    (merged ranks: the rank whose loop took longest, which the others wait for); ``run_epochs``: the run's
    epochs to predict (None: those recorded)."""
    items_log = log.arrays()  # one copy for all three (over the whole log: its rows are b's)
    refetch, later = refetched_items(items_log, b["epoch"])
    latency = first_miss_latency(items_log, b["epoch"])
    per_item = item_latencies(items_log, b["epoch"])
    ranks = np.unique(b["rank"])
    if len(ranks) > 1:
        slowest = max(ranks.tolist(), key=lambda r: float((b["fetch_s"] + b["compute_s"])[b["rank"] == r].sum()))
        keep = b["rank"] == slowest
        b = {k: v[keep] for k, v in b.items()}
    epochs = sorted({int(e) for e in b["epoch"]})
    loop_cpu = setup.get("loop_cpu_s") or {}
    resources = setup.get("resources") or {}
    workers = int(setup.get("num_workers") or 0)
    items = b["items"]
    sized = items > 0
    made = np.nan_to_num(b["stage_fetch_s"]) + np.nan_to_num(b["stage_user_s"]) + np.nan_to_num(b["stage_collate_s"])
    out = []
    for e in epochs:
        m = b["epoch"] == e
        p = breakdown(b, m)
        got = resources.get(str(e)) if isinstance(resources, dict) else None
        res: dict[str, Any] = got if isinstance(got, dict) else {}
        miss_s, hit_s = per_item.get(e, (None, None))
        out.append(EpochTimes(
            **{k: v for k, v in p.items() if k in EpochTimes.__dataclass_fields__},
            misses=int(b["misses"][m].sum()), items=int(items[m].sum()),
            wait_p99=float(percentiles(b["fetch_s"][m], (99,))["p99"]),
            first_wait=float(b["fetch_s"][m][0]), first_made=float(made[m][0]),
            # with workers the loop thread's CPU is its compute's (without, it also made the batches)
            compute_cpu=(float(loop_cpu[str(e)]) if workers > 0 and str(e) in loop_cpu else None),
            loop_cpu=(float(loop_cpu[str(e)]) if workers <= 0 and str(e) in loop_cpu else None),
            miss_latency=miss_s, hit_latency=hit_s, wall=_number(res.get("wall")), cpu=_number(res.get("cpu")),
            workers_cpu=_number(res.get("workers_cpu")) if workers > 0 else None, idle=_number(res.get("idle")),
            batch_bytes=_number(res.get("batch_bytes")), made=made[m], waits=b["fetch_s"][m],
            computes=b["compute_s"][m]))
    return Measured(
        epochs=out, num_workers=workers, prefetch_factor=int(setup.get("prefetch_factor") or 0),
        cores=int(setup.get("cores") or 1), batch_size=int(setup.get("batch_size") or 1),
        dataset=str(setup.get("dataset") or ""), cache_limit=setup.get("cache_limit"),
        dataset_bytes=setup.get("dataset_bytes"), files=setup.get("files"),
        mean_file_bytes=float(b["bytes"][sized].sum() / items[sized].sum()) if sized.any() else None,
        refetches=refetch, later_misses=later, hits=(counters or {}).get("hits"), miss_latency=latency,
        read_ahead=setup.get("read_ahead") if setup.get("read_ahead") in ("rank", "stream") else None,
        read_depth=int(setup["read_depth"]) if isinstance(setup.get("read_depth"), int) else None,
        run_epochs=run_epochs)


def _number(v: Any) -> float | None:
    """A saved number (a file's value: anything), or None."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def select(b: BatchTable, *, lo: int | None = None, hi: int | None = None, epoch: int | None = None,
           worker: int | None = None, rank: int | None = None) -> np.ndarray:
    """Boolean mask over ``b``'s rows: steps ``lo..hi`` (inclusive), one epoch/worker/rank."""
    m = np.ones(len(b["step"]), dtype=bool)
    if lo is not None:
        m &= b["step"] >= lo
    if hi is not None:
        m &= b["step"] <= hi
    for key, v in (("epoch", epoch), ("worker", worker), ("rank", rank)):
        if v is not None:
            m &= b[key] == v
    return m


def slowest(b: BatchTable, n: int, mask: np.ndarray) -> list[int]:
    """Positions of the ``n`` slowest batches among ``mask`` (ties: the earlier first)."""
    pos = np.flatnonzero(mask)
    order = pos[np.argsort(-b["fetch_s"][pos], kind="stable")]
    return [int(i) for i in order[:n]]


def cache_fill(totals: dict[str, int], base: dict[str, int]) -> dict[str, Any]:
    """A snapshot's cache keys: ``base`` (a measured fill and the counters then) advanced by the
    counter ``totals`` since (each miss since filled one file)."""
    new_files = max(0, totals["misses"] - base.get("misses", 0))
    new_bytes = max(0, totals["bytes_fetched"] - base.get("bytes_fetched", 0))
    lookups = totals["hits"] + totals["misses"]
    files, size = base.get("files", 0), base.get("bytes", 0)
    return {"hits": totals["hits"], "misses": totals["misses"], "bytes_fetched": totals["bytes_fetched"],
            "hit_rate": totals["hits"] / lookups if lookups else math.nan, "files": files, "bytes": size,
            "files_cached": min(files, base.get("files_cached", 0) + new_files),
            "bytes_cached": min(size, base.get("bytes_cached", 0) + new_bytes)}


# ------------------------------------------------------------------ straggler hints

def straggler_hints(b: BatchTable, stall: float, files_of: FileRows, items_of: ItemTimes | None = None) -> list[str]:
    """One-line hints from a batch table: where the wait is and what would shorten it.

    ``stall`` is the loop's share of time waiting for data; ``files_of(b)`` the items of batch ``b``
    (file name and fetch time), slowest first; ``items_of(b)`` their fetch seconds and hit flags alone (cheap;
    default: from ``files_of``)."""
    if len(b["fetch_s"]) == 0:
        return []
    if items_of is None:
        def items_of(i: int) -> tuple[np.ndarray, np.ndarray]:
            rows = files_of(i)
            return (np.array([r["fetch_s"] for r in rows], dtype=float),
                    np.array([bool(r.get("hit")) for r in rows], dtype=bool))
    return [h for h in (_cold_hint(b, stall), _few_files_hint(b, files_of, items_of), _decode_hint(b, stall),
                        _worker_hint(b, items_of),
                        _rank_hint(b), _not_bottleneck_hint(b, stall)) if h]


def _cold_hint(b: BatchTable, stall: float) -> str | None:
    """Where the wait of a loop that waits is in cold reads; silent when loading is not the bottleneck. One
    epoch: no ``ds.warm()`` (warming first costs a one-pass run the same copies, and more: issue 52)."""
    fetch, total, misses = b["fetch_s"], float(b["fetch_s"].sum()), int(b["misses"].sum())
    if total <= 0 or not misses or stall < NOT_BOTTLENECK:
        return None
    epochs = sorted({int(e) for e in b["epoch"]})
    cold = epochs[0]
    share = float(fetch[b["epoch"] == cold].sum()) / total
    if len(epochs) > 1 and share >= COLD_SHARE:
        return f"{share:.0%} of the wait is in cold epoch {cold}: warm the cache first with `ds.warm()`"
    miss_share = float(fetch[b["misses"] > 0].sum()) / total
    if len(epochs) == 1 and miss_share >= COLD_SHARE:
        return (f"{miss_share:.0%} of the wait is in batches with cache misses (cold cache): the next epochs "
                "read from the cache; `stats.advise()` says whether warming or packing pays for this run")
    return None


def startup_batches(b: BatchTable) -> np.ndarray:
    """Mask of each epoch's first batch on each rank: its wait is the start (workers, the first copies)."""
    first = np.zeros(len(b["step"]), dtype=bool)
    seen: set[tuple[int, int]] = set()
    for i, key in enumerate(zip(b["rank"].tolist(), b["epoch"].tolist())):
        if key not in seen:
            seen.add(key)
            first[i] = True
    return first


def _few_files_hint(b: BatchTable, files_of: FileRows, items_of: ItemTimes) -> str | None:
    """The files behind the slowest batches (startup batches left out), each slower than the median file."""
    fetch = b["fetch_s"]
    steady = np.flatnonzero(~startup_batches(b))
    if len(steady) < 20 or float(fetch[steady].sum()) <= 0:
        return None
    p99 = percentiles(fetch[steady], (99,))["p99"]
    slow = steady[fetch[steady] >= p99]
    wait = float(fetch[slow].sum())
    per_file: dict[str, tuple[float, bool]] = {}
    for i in slow.tolist():
        for r in files_of(i):
            if r["fetch_s"] > per_file.get(r["file"], (-1.0, False))[0]:
                per_file[r["file"]] = (r["fetch_s"], bool(r.get("hit")))
    if not per_file or wait <= 0:
        return None
    typical = _median_fetch(items_of, steady)
    top = [(k, v) for k, (v, hit) in sorted(per_file.items(), key=lambda kv: -kv[1][0])
           if v >= SLOW_FILE * typical.get(hit, typical.get(None, 0.0))][:FEW_FILES]
    share = min(1.0, sum(v for _, v in top) / wait) if top else 0.0
    if share < FEW_FILES_SHARE:
        return None
    names = ", ".join(short_name(k) for k, _ in top)
    return (f"{len(top)} file{'s account' if len(top) > 1 else ' accounts'} for {share:.0%} of the p99 wait, each "
            f"{SLOW_FILE:g}x+ the median file's fetch: {names}")


def _median_fetch(items_of: ItemTimes, rows: np.ndarray, cap: int = 2000) -> dict[bool | None, float]:
    """Median fetch seconds of the items in batches ``rows`` (up to ``cap`` of them, evenly spread): per kind
    (True: cached lookups, False: copies) where a kind has 10+ items, and of all (``None``)."""
    pick = rows if len(rows) <= cap else rows[np.linspace(0, len(rows) - 1, cap).astype(int)]
    got = [items_of(i) for i in pick.tolist()]
    fetch = np.concatenate([f for f, _ in got]) if got else np.zeros(0)
    hit = np.concatenate([h for _, h in got]) if got else np.zeros(0, dtype=bool)
    out: dict[bool | None, float] = {k: float(np.median(fetch[hit == k])) for k in (True, False)
                                     if int((hit == k).sum()) >= 10}
    if len(fetch):
        out[None] = float(np.median(fetch))
    return out


def _decode_hint(b: BatchTable, stall: float) -> str | None:
    misses, items = int(b["misses"].sum()), int(b["items"].sum())
    if stall < DECODE_STALL or (items and misses > WARM_MISS_SHARE * items):
        return None
    t = breakdown(b, np.ones(len(b["fetch_s"]), dtype=bool))
    if t["wait"] > 0 and t["fetch"] + t["user"] + t["collate"] > 0:  # measured: say where, advise() says what
        where = max(STAGES, key=lambda k: t[f"wait_{k}"])
        name = {"fetch": "ucmagic's fetch", "user": "your code (decode, transforms)", "collate": "collate"}[where]
        return (f"the loop waits for data {stall:.0%} of the time with a warm cache, "
                f"{t[f'wait_{where}'] / t['wait']:.0%} of it on {name} (measured): see stats.advise()")
    workers = {int(w) for w in b["worker"] if w >= 0}
    now = f" (now {len(workers)})" if workers else ""
    return (f"the loop waits for data {stall:.0%} of the time with a warm cache: decoding is the "
            f"bottleneck, raise num_workers{now}")


def _worker_hint(b: BatchTable, items_of: ItemTimes) -> str | None:
    """A worker that makes its batches (its stage seconds; without them, the loop's waits for them) 2x+ slower
    than the median worker, startup batches left out; "it reads slow files" only when its files' fetch is."""
    steady = ~startup_batches(b)
    workers = sorted({int(w) for w in b["worker"][steady] if w >= 0})
    if len(workers) < 2:
        return None
    made = b["stage_fetch_s"] + b["stage_user_s"] + b["stage_collate_s"]
    measured = bool(np.isfinite(made[steady & (b["worker"] >= 0)]).all())
    per = made if measured else b["fetch_s"]
    med = {w: float(np.median(per[steady & (b["worker"] == w)])) for w in workers}
    worst = max(med, key=lambda w: med[w])
    typical = float(np.median([v for w, v in med.items() if w != worst]))
    if med[worst] < 5e-3 or med[worst] < SLOW_WORKER * max(typical, 1e-9):
        return None
    head = (f"worker {worst} takes {med[worst] / max(typical, 1e-9):.1f}x the median worker's time to make a batch "
            f"({med[worst] * 1e3:.0f} ms vs {typical * 1e3:.0f} ms)" if measured else
            f"worker {worst}'s batches wait {med[worst] / max(typical, 1e-9):.1f}x longer than the median "
            f"worker's ({med[worst] * 1e3:.0f} ms vs {typical * 1e3:.0f} ms)")
    mine = _median_fetch(items_of, np.flatnonzero(steady & (b["worker"] == worst)), 500).get(None)
    others = np.flatnonzero(steady & (b["worker"] >= 0) & (b["worker"] != worst))
    theirs = _median_fetch(items_of, others, 500).get(None)
    if mine is not None and theirs is not None and mine >= SLOW_WORKER * max(theirs, 1e-6):
        return f"{head}: it reads slow files (median fetch {mine * 1e3:.1f} ms vs {theirs * 1e3:.1f} ms)"
    if measured:
        where = max(STAGES, key=lambda k: float(np.nansum(b[f"stage_{k}_s"][steady & (b["worker"] == worst)])))
        return f"{head}: most of it in {STAGE_WORDS[where]}"
    return head


def _rank_hint(b: BatchTable) -> str | None:
    ranks = sorted({int(r) for r in b["rank"]})
    if len(ranks) < 2:
        return None
    mean = {r: float(b["fetch_s"][b["rank"] == r].mean()) for r in ranks}
    worst = max(mean, key=lambda r: mean[r])
    typical = float(np.median(list(mean.values())))
    if mean[worst] < SLOW_RANK * max(typical, 1e-9) or mean[worst] < 1e-3:
        return None
    return (f"rank {worst} waits {mean[worst] / max(typical, 1e-9):.1f}x the median rank "
            f"({mean[worst] * 1e3:.0f} ms vs {typical * 1e3:.0f} ms per batch): the others wait for it")


def _not_bottleneck_hint(b: BatchTable, stall: float) -> str | None:
    if len(b["fetch_s"]) < 10 or stall >= NOT_BOTTLENECK:
        return None
    return f"the loop waits for data only {stall:.0%} of the time: data loading is not the bottleneck"
