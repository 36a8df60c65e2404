"""LoaderStats: per-batch fetch/compute timings of a loader, cache counters, snapshot and plot."""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .telemetry import BatchRecorder, percentiles

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

    # -- recording (loop thread)
    def _record(self, fetch_s: float, compute_s: float) -> None:
        self._rec.record(fetch_s, compute_s)
        self.last_fetch_s, self.last_compute_s = fetch_s, compute_s
        self.epoch_count += 1

    def _new_epoch(self, epoch: int | None) -> None:
        self.epoch, self.epoch_count = epoch, 0

    def reset(self) -> None:
        """Forget every recorded batch."""
        self._rec.reset()
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
        c = getattr(self._dataset, "_counters", None)
        return c.totals() if c is not None else None

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
        from .plots import latency_figure

        title = kw.pop("title", None) or (f"DataLoader fetch latency: {self.count} batches, "
                                          f"{self.stall_fraction:.1%} of the time waiting for data")
        return latency_figure(self._rec.fetch_array(), self._rec.compute_array(), title=title, **kw)

    def __repr__(self) -> str:
        if not self.count:
            return "LoaderStats(count=0)"
        pct = self.percentiles()
        return (f"LoaderStats(count={self.count}, mean={self.mean * 1e3:.2f}ms, p50={pct['p50'] * 1e3:.2f}ms, "
                f"p99={pct['p99'] * 1e3:.2f}ms, max={self.max * 1e3:.2f}ms, stall={self.stall_fraction:.1%})")
