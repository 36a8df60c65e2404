"""LoaderStats: per-batch fetch/compute timings of a loader, the fetch records of each batch's
items, cache counters, snapshot, plot, save/load/merge, straggler hints and the explorer."""
from __future__ import annotations

import contextlib
import json
import math
import os
from typing import Any, Iterable

import numpy as np

from ._util import atomic_write
from .telemetry import BatchItems, BatchRecorder, ItemLog, SharedCounters, percentiles
from .units import short_name

SAVE_VERSION = 1

RECENT = 256  # batches in a snapshot's recent window


class LoaderStats:
    """Per-batch timings of a :class:`DataLoader` (all epochs since creation or :meth:`reset`).

    ``fetch`` is how long ``next()`` waited for a batch, ``compute`` the time from one batch's
    return to the next request. With a :class:`~ucmagic.dataset.UCVolumeDataset`, cache hits,
    misses and bytes fetched come from the dataset's shared counters.
    """

    def __init__(self, dataset: Any = None) -> None:
        self._dataset = dataset
        self._rec = BatchRecorder()
        self.epoch: int | None = None
        self.epoch_count = 0  # batches delivered in the current epoch
        self.last_fetch_s = math.nan
        self.last_compute_s = math.nan
        self._cache_base: dict[str, int] | None = None
        self._item_log = ItemLog()
        self._pending: BatchItems | None = None
        self._files: dict[int, tuple[str, int]] = {}  # index -> (name, bytes) of loaded stats
        self._saved_counters: dict[str, int] | None = None  # cache counters of loaded stats

    # -- recording (loop thread)
    def take_items(self, batch: Any) -> Any:
        """Unwrap a batch that brought its items' fetch records (see :class:`~ucmagic.telemetry.ItemCollate`)."""
        if isinstance(batch, BatchItems):
            self._pending = batch
            return batch.batch
        return batch

    def record_batch(self, fetch_s: float, compute_s: float) -> None:
        """The loop received a batch after ``fetch_s`` s of waiting and ``compute_s`` s of its own work."""
        self._rec.record(fetch_s, compute_s)
        p, self._pending = self._pending, None
        epoch = self.epoch if self.epoch is not None else 0
        if p is None:
            self._item_log.add(epoch, -1)
        else:
            self._item_log.add(epoch, p.worker, p.index, p.fetch, p.nbytes)
        self.last_fetch_s, self.last_compute_s = fetch_s, compute_s
        self.epoch_count += 1

    def begin_epoch(self, epoch: int | None) -> None:
        """A new iteration over ``epoch`` starts (per-epoch counts restart)."""
        self.epoch, self.epoch_count = epoch, 0

    def reset(self) -> None:
        """Forget every recorded batch."""
        self._rec.reset()
        self._item_log.reset()
        self.epoch_count = 0
        self.last_fetch_s = self.last_compute_s = math.nan

    # -- timings
    @property
    def count(self) -> int:
        return len(self._rec)

    @property
    def fetch_seconds(self) -> np.ndarray:
        """Fetch latency of every batch (seconds)."""
        return self._rec.fetch_array()

    @property
    def compute_seconds(self) -> np.ndarray:
        """Time between batches (seconds); 0 for the first batch of an epoch."""
        return self._rec.compute_array()

    @property
    def mean(self) -> float:
        return self._rec.fetch_total / self.count if self.count else math.nan

    def percentiles(self) -> dict[str, float]:
        """``{"p50", "p90", "p99"}`` of fetch latency (seconds)."""
        return percentiles(self._rec.fetch_array())

    @property
    def p50(self) -> float:
        return self.percentiles()["p50"]

    @property
    def p90(self) -> float:
        return self.percentiles()["p90"]

    @property
    def p99(self) -> float:
        return self.percentiles()["p99"]

    @property
    def max(self) -> float:
        return float(self._rec.fetch_array().max()) if self.count else math.nan

    @property
    def stall_fraction(self) -> float:
        """Share of the loop's wall time spent waiting for data."""
        return self._rec.stall_fraction()

    # -- cache (UCVolumeDataset only)
    def _counters(self) -> dict[str, int] | None:
        c = getattr(self._dataset, "counters", None)  # a planned dataset's (ucmagic.epochs.PlannedDataset)
        return c.totals() if isinstance(c, SharedCounters) else self._saved_counters

    @property
    def hits(self) -> int | None:
        t = self._counters()
        return t["hits"] if t else None

    @property
    def misses(self) -> int | None:
        t = self._counters()
        return t["misses"] if t else None

    @property
    def bytes_fetched(self) -> int | None:
        t = self._counters()
        return t["bytes_fetched"] if t else None

    def cache(self) -> dict[str, Any] | None:
        """The dataset's full ``stats()`` (cache fill scans the listing: O(files)); None if it has none."""
        fn = getattr(self._dataset, "stats", None)
        return fn() if callable(fn) else None

    def summary(self) -> dict[str, Any]:
        """Timings and cache counters as one plain dict."""
        pct = self.percentiles()
        out: dict[str, Any] = {"count": self.count, "mean": self.mean, **pct, "max": self.max,
                               "stall_fraction": self.stall_fraction}
        t = self._counters()
        if t:
            out.update(hits=t["hits"], misses=t["misses"], bytes_fetched=t["bytes_fetched"])
        return out

    def snapshot(self, recent: int = RECENT) -> dict[str, Any]:
        """Cheap view for live displays (call from the main thread, a few times a second).

        Keys: ``count``, ``epoch``, ``epoch_count``, ``last_fetch_s``, ``recent_fetch_s`` (list),
        ``p50_s``/``p99_s`` (of the recent window), ``mean_s``, ``stall_fraction``, and for a
        UCVolumeDataset ``hits``, ``misses``, ``hit_rate``, ``bytes_fetched``, ``files``,
        ``files_cached``, ``bytes``, ``bytes_cached``. Cache fill is measured once (O(files)) and
        then advanced by the fetch counters, so a snapshot stays O(recent).
        """
        window = self._rec.fetch_array(recent)
        pct = percentiles(window, (50, 99))
        snap: dict[str, Any] = {
            "count": self.count, "epoch": self.epoch, "epoch_count": self.epoch_count,
            "last_fetch_s": self.last_fetch_s, "recent_fetch_s": window.tolist(),
            "p50_s": pct["p50"], "p99_s": pct["p99"], "mean_s": self.mean,
            "stall_fraction": self.stall_fraction,
        }
        t = self._counters()
        if t is not None:
            if self._cache_base is None:
                self.refresh_cache_fill()
            b = self._cache_base or {}
            new_files = max(0, t["misses"] - b.get("misses", 0))
            new_bytes = max(0, t["bytes_fetched"] - b.get("bytes_fetched", 0))
            lookups = t["hits"] + t["misses"]
            snap.update(hits=t["hits"], misses=t["misses"], bytes_fetched=t["bytes_fetched"],
                        hit_rate=t["hits"] / lookups if lookups else math.nan,
                        files=b.get("files", 0), bytes=b.get("bytes", 0),
                        files_cached=min(b.get("files", 0), b.get("files_cached", 0) + new_files),
                        bytes_cached=min(b.get("bytes", 0), b.get("bytes_cached", 0) + new_bytes))
        return snap

    def refresh_cache_fill(self) -> None:
        """Measure the cache fill exactly now (O(files)); later snapshots build on it."""
        st = self.cache()
        t = self._counters()
        if st is None or t is None:
            return
        self._cache_base = {"files": int(st["files"]), "bytes": int(st["bytes"]),
                            "files_cached": int(st["files_cached"]), "bytes_cached": int(st["bytes_cached"]),
                            "misses": t["misses"], "bytes_fetched": t["bytes_fetched"]}

    def plot(self, **kw: Any) -> Any:
        """Matplotlib figure: fetch latency per batch with p50/p99 lines, and its histogram."""
        from .notebook.plots import latency_figure

        title = kw.pop("title", None) or (f"DataLoader fetch latency: {self.count} batches, "
                                          f"{self.stall_fraction:.1%} of the time waiting for data")
        return latency_figure(self._rec.fetch_array(), self._rec.compute_array(), title=title, **kw)

    # -- per-item fetch records
    def batches(self) -> dict[str, np.ndarray]:
        """One row per batch: ``step`` (per rank), ``fetch_s``, ``compute_s``, ``epoch``, ``worker``
        (-1: main process), ``rank``, ``items``, ``misses`` and ``bytes`` (of the recorded items)."""
        a = self._item_log.arrays()
        n = min(self.count, len(a["count"]))
        rank = a["rank"][:n]
        step = np.zeros(n, dtype=np.int64)
        for r in np.unique(rank):
            m = rank == r
            step[m] = np.arange(int(m.sum()))
        return {"step": step, "fetch_s": self._rec.fetch_array()[:n], "compute_s": self._rec.compute_array()[:n],
                "epoch": a["epoch"][:n], "worker": a["worker"][:n], "rank": rank, "items": a["count"][:n],
                "misses": a["misses"][:n], "bytes": a["nbytes"][:n]}

    def describe_item(self, index: int) -> tuple[str, int | None]:
        """``(name, bytes)`` of a recorded item index (file path, or Parquet ``file#rg``)."""
        if index in self._files:
            return self._files[index]
        fn = getattr(self._dataset, "describe_item", None)
        if callable(fn):
            with contextlib.suppress(IndexError, KeyError):
                return fn(int(index))
        return f"item {index}", None

    def batch_files(self, b: int) -> list[dict[str, Any]]:
        """The items of batch ``b``, slowest first: ``file``, ``index``, ``bytes``, ``fetch_s``, ``hit``."""
        idx, fetch, hit = self._item_log.items(b)
        rows = []
        for i, f, h in zip(idx.tolist(), fetch.tolist(), hit.tolist()):
            name, size = self.describe_item(i)
            rows.append({"file": name, "index": i, "bytes": size, "fetch_s": f, "hit": bool(h)})
        rows.sort(key=lambda r: -r["fetch_s"])
        return rows

    def slowest_batches(self, n: int = 10, *, lo: int | None = None, hi: int | None = None,
                        epoch: int | None = None, worker: int | None = None, rank: int | None = None) -> list[int]:
        """Positions of the ``n`` slowest batches, optionally within steps ``lo..hi`` and one epoch/worker/rank."""
        b = self.batches()
        m = self.select(b, lo=lo, hi=hi, epoch=epoch, worker=worker, rank=rank)
        pos = np.flatnonzero(m)
        order = pos[np.argsort(-b["fetch_s"][pos], kind="stable")]
        return order[:n].tolist()

    @staticmethod
    def select(b: dict[str, np.ndarray], *, lo: int | None = None, hi: int | None = None,
               epoch: int | None = None, worker: int | None = None, rank: int | None = None) -> np.ndarray:
        """Boolean mask over :meth:`batches` rows: steps ``lo..hi`` (inclusive), one epoch/worker/rank."""
        m = np.ones(len(b["step"]), dtype=bool)
        if lo is not None:
            m &= b["step"] >= lo
        if hi is not None:
            m &= b["step"] <= hi
        for key, v in (("epoch", epoch), ("worker", worker), ("rank", rank)):
            if v is not None:
                m &= b[key] == v
        return m

    def records_memory(self) -> int:
        """Bytes held by the per-batch and per-item records (timings included)."""
        return self._item_log.memory_bytes() + 16 * self.count

    # -- save / load / merge
    def to_dict(self) -> dict[str, Any]:
        """Everything :meth:`load` needs, JSON-serialisable (file names of every recorded item included)."""
        a = self._item_log.arrays()
        n = min(self.count, len(a["count"]))
        cols = {k: a[k][:n].tolist() for k in ("count", "epoch", "worker", "misses", "nbytes")}
        cols["batch_rank"] = a["rank"][:n].tolist()
        kept = int(a["start"][n - 1] + a["count"][n - 1]) if n else 0
        kept = min(kept, len(a["index"]))
        index = a["index"][:kept]
        files = {}
        for i in np.unique(index).tolist():
            name, size = self.describe_item(i)
            files[str(i)] = [name, size]
        rank = 0
        with contextlib.suppress(Exception):  # torch missing or odd env: rank 0
            from .dist import dist_info

            rank = dist_info().rank
        return {"version": SAVE_VERSION, "rank": rank, "fetch_s": self._rec.fetch_array()[:n].tolist(),
                "compute_s": self._rec.compute_array()[:n].tolist(), **cols,
                "item_index": index.tolist(), "item_fetch_s": [float(x) for x in a["fetch"][:kept]],
                "files": files, "counters": self._counters(), "truncated": self._item_log.truncated}

    def save(self, path: str | os.PathLike) -> str:
        """Write the stats as JSON (atomically); also logged as an MLflow artifact when a run is active."""
        path = os.fspath(path)
        atomic_write(path, json.dumps(self.to_dict(), separators=(",", ":")).encode())
        from .mlflow_sink import active_run_id

        run = active_run_id()
        if run is not None:
            try:
                from mlflow.tracking import MlflowClient

                MlflowClient().log_artifact(run, path, "ucmagic")
            except Exception as exc:  # noqa: BLE001 - the file is written; the artifact is a bonus
                import warnings

                warnings.warn(f"ucmagic: could not log {path} to MLflow run {run}: {exc}", stacklevel=2)
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any], rank: int | None = None) -> "LoaderStats":
        """Stats from :meth:`to_dict` output (``rank`` overrides the saved one)."""
        if d.get("version") != SAVE_VERSION:
            raise ValueError(f"unsupported LoaderStats file version {d.get('version')!r} (this ucmagic reads "
                             f"version {SAVE_VERSION})")
        st = cls()
        r = int(d.get("rank", 0) if rank is None else rank)
        st._rec.fetch.fromlist([float(x) for x in d["fetch_s"]])
        st._rec.compute.fromlist([float(x) for x in d["compute_s"]])
        st._rec.fetch_total, st._rec.compute_total = float(sum(d["fetch_s"])), float(sum(d["compute_s"]))
        idx = np.asarray(d["item_index"], dtype=np.int32)
        fetch = np.asarray(d["item_fetch_s"], dtype=np.float32)
        off = 0
        ranks = d.get("batch_rank") or [d.get("rank", 0)] * len(d["count"])
        for c, e, w, m, nb, dr in zip(d["count"], d["epoch"], d["worker"], d["misses"], d["nbytes"], ranks):
            take = c if off + c <= len(idx) else 0
            st._item_log.add(int(e), int(w), idx[off:off + take].tobytes(), fetch[off:off + take].tobytes(), int(nb),
                          rank=r if rank is not None else int(dr))
            if not take:  # the batch's items were not kept in detail
                st._item_log.count[-1], st._item_log.misses[-1] = int(c), int(m)
            off += take
        st._item_log.truncated = bool(d.get("truncated"))
        st._files = {int(k): (v[0], v[1]) for k, v in d.get("files", {}).items()}
        st._saved_counters = d.get("counters")
        st.epoch = int(d["epoch"][-1]) if d["epoch"] else None
        return st

    @classmethod
    def load(cls, path: str | os.PathLike) -> "LoaderStats":
        """Read stats written by :meth:`save`."""
        with open(os.fspath(path)) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def merge(cls, parts: Iterable["LoaderStats | str | os.PathLike"]) -> "LoaderStats":
        """One LoaderStats of several ranks (stats or saved files); each part keeps its rank, and
        the explorer's rank selector compares them. File indices are renumbered by name."""
        dicts = [(p if isinstance(p, LoaderStats) else cls.load(p)).to_dict() for p in parts]
        ranks = [int(d["rank"]) for d in dicts]
        if len(set(ranks)) < len(ranks):  # saved by one process (or unknown ranks): number them in order
            ranks = list(range(len(dicts)))
        names: dict[tuple[str, Any], int] = {}
        files: dict[int, tuple[str, Any]] = {}
        counters: dict[str, int] = {}
        merged: dict[str, Any] = {"version": SAVE_VERSION, "rank": 0, "item_index": [], "item_fetch_s": [],
                                  "truncated": False, **{k: [] for k in ("fetch_s", "compute_s", "count", "epoch",
                                                                          "worker", "misses", "nbytes", "batch_rank")}}
        for d, rank in zip(dicts, ranks):
            remap = {}
            for k, (name, size) in d["files"].items():
                g = names.setdefault((name, size), len(names))
                remap[int(k)] = g
                files[g] = (name, size)
            merged["item_index"] += [remap.get(x, x) for x in d["item_index"]]
            merged["item_fetch_s"] += d["item_fetch_s"]
            for k in ("fetch_s", "compute_s", "count", "epoch", "worker", "misses", "nbytes"):
                merged[k] += d[k]
            merged["batch_rank"] += [rank] * len(d["count"])
            merged["truncated"] |= bool(d.get("truncated"))
            for k, v in (d.get("counters") or {}).items():
                counters[k] = counters.get(k, 0) + int(v)
        merged["files"] = {str(k): list(v) for k, v in files.items()}
        merged["counters"] = counters or None
        return cls.from_dict(merged)

    # -- hints and the explorer
    def hints(self) -> list[str]:
        """One-line suggestions from the records: where the wait is and what would shorten it."""
        return straggler_hints(self)

    def explore(self, **kw: Any) -> Any:
        """An interactive explorer (ipywidgets + matplotlib): zoom, epoch/worker/rank, slowest batches
        and their files. Works during and after training and on :meth:`load`-ed or merged stats."""
        from .notebook.explorer import Explorer

        return Explorer(self, **kw)

    def __repr__(self) -> str:
        if not self.count:
            return "LoaderStats(count=0)"
        pct = self.percentiles()
        return (f"LoaderStats(count={self.count}, mean={self.mean * 1e3:.2f}ms, p50={pct['p50'] * 1e3:.2f}ms, "
                f"p99={pct['p99'] * 1e3:.2f}ms, max={self.max * 1e3:.2f}ms, stall={self.stall_fraction:.1%})")


# ------------------------------------------------------------------ straggler hints

def straggler_hints(stats: LoaderStats) -> list[str]:
    """One-line hints from a :class:`LoaderStats` (pure: reads its records, changes nothing)."""
    b = stats.batches()
    n = len(b["fetch_s"])
    if n == 0:
        return []
    fetch, total = b["fetch_s"], float(b["fetch_s"].sum())
    out: list[str] = []
    stall = stats.stall_fraction
    misses, items = int(b["misses"].sum()), int(b["items"].sum())
    workers = sorted({int(w) for w in b["worker"] if w >= 0})
    if total > 0 and misses:
        epochs = sorted({int(e) for e in b["epoch"]})
        cold = epochs[0]
        share = float(fetch[b["epoch"] == cold].sum()) / total
        if len(epochs) > 1 and share >= 0.5:
            out.append(f"{share:.0%} of the wait is in cold epoch {cold}: warm the cache first with `ds.warm()`")
        elif len(epochs) == 1:
            miss_share = float(fetch[b["misses"] > 0].sum()) / total
            if miss_share >= 0.5:
                out.append(f"{miss_share:.0%} of the wait is in batches with cache misses (cold cache): "
                           "warm the cache first with `ds.warm()`")
    if n >= 20 and total > 0:
        p99 = percentiles(fetch, (99,))["p99"]
        slow = np.flatnonzero(fetch >= p99)
        wait = float(fetch[slow].sum())
        per_file: dict[str, float] = {}
        for i in slow.tolist():
            for r in stats.batch_files(i):
                per_file[r["file"]] = max(per_file.get(r["file"], 0.0), r["fetch_s"])
        if per_file and wait > 0:
            top = sorted(per_file.items(), key=lambda kv: -kv[1])[:3]
            share = min(1.0, sum(v for _, v in top) / wait)
            if share >= 0.3:
                names = ", ".join(short_name(k) for k, _ in top)
                out.append(f"{len(top)} file{'s' if len(top) > 1 else ''} account for {share:.0%} of the p99 wait: "
                           f"{names}")
    if stall >= 0.3 and (items == 0 or misses <= 0.05 * items):
        now = f" (now {len(workers)})" if workers else ""
        out.append(f"the loop waits for data {stall:.0%} of the time with a warm cache: decoding is the "
                   f"bottleneck, raise num_workers{now}")
    if len(workers) >= 2:
        med = {w: float(np.median(fetch[b["worker"] == w])) for w in workers}
        worst = max(med, key=lambda w: med[w])
        others = float(np.median([v for w, v in med.items() if w != worst]))
        if med[worst] >= 5e-3 and med[worst] >= 2 * max(others, 1e-9):
            out.append(f"worker {worst}'s batches wait {med[worst] / max(others, 1e-9):.1f}x longer than the "
                       f"others' (median {med[worst] * 1e3:.0f} ms vs {others * 1e3:.0f} ms): it reads slow files")
    ranks = sorted({int(r) for r in b["rank"]})
    if len(ranks) >= 2:
        mean = {r: float(fetch[b["rank"] == r].mean()) for r in ranks}
        worst = max(mean, key=lambda r: mean[r])
        typical = float(np.median(list(mean.values())))
        if mean[worst] >= 1.5 * max(typical, 1e-9) and mean[worst] >= 1e-3:
            out.append(f"rank {worst} waits {mean[worst] / max(typical, 1e-9):.1f}x the median rank "
                       f"({mean[worst] * 1e3:.0f} ms vs {typical * 1e3:.0f} ms per batch): the others wait for it")
    if n >= 10 and stall < 0.05:
        out.append(f"the loop waits for data only {stall:.0%} of the time: data loading is not the bottleneck")
    return out
