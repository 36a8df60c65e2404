"""LoaderStats: the public face of a loader's telemetry.

It keeps the records (per-batch timings and each batch's item records, :mod:`.telemetry`) and
answers from them; the work lives in one unit per job:

- record keeping: :class:`~ucmagic.telemetry.BatchRecorder`, :class:`~ucmagic.telemetry.ItemLog`
  and the dataset's :class:`~ucmagic.telemetry.SharedCounters` (:mod:`.telemetry`);
- analysis: the batch table, filters, the cache fill of a snapshot, straggler hints
  (:mod:`.stats_analysis`, pure);
- the saved form: save / load / merge (:mod:`.stats_file`, pure; the file write and the MLflow
  artifact are here);
- presentation: ``plot()`` and ``explore()`` call the presenters a display layer registered
  (:mod:`.presenters`; the notebook layer by default). Nothing here imports a display module.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from typing import Any, Iterable

import numpy as np

from . import stats_analysis as analysis
from . import stats_file
from .._util import atomic_write
from ..presenters import presenter
from ..telemetry import BatchItems, BatchRecorder, ItemLog, SharedCounters, batch_bytes, percentiles

__all__ = ["LoaderStats", "RECENT"]

RECENT = 256  # batches in a snapshot's recent window
WEIGH_FIRST, WEIGH_EVERY = 4, 64  # batches weighed (telemetry.batch_bytes): an epoch's first ones, then every 64th


class _Read:
    """A read-only attribute of :class:`LoaderStats`: one key of what one of its methods returns
    (None when that returns None): the percentiles and the cache counters, without a method each."""

    def __init__(self, method: str, key: str, doc: str) -> None:
        self.method, self.key, self.__doc__ = method, key, doc

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        got = getattr(obj, self.method)()
        return got[self.key] if got else None


# The last knob advice given in this process per dataset (kind, files, bytes, batch size): a loader that runs
# with its setting followed it, and advise() compares the two runs before advising that knob again.
_ADVISED: dict[tuple[Any, ...], tuple[dict[str, Any], Any, str]] = {}
_FOLLOWABLE = {"num_workers", "prefetch_factor", "cache_limit"}  # advice settings named as the loader's setup


def _advice_key(setup: dict[str, Any]) -> tuple[Any, ...]:
    return (setup.get("dataset"), setup.get("files"), setup.get("dataset_bytes"), setup.get("batch_size"))


class LoaderStats:
    """Per-batch timings of a :class:`DataLoader` (all epochs since creation or :meth:`reset`).

    ``fetch`` is how long ``next()`` waited for a batch, ``compute`` the time from one batch's
    return to the next request. With a :class:`~ucmagic.files.dataset.UCVolumeDataset`, cache hits,
    misses and bytes fetched come from the dataset's shared counters.
    """

    def __init__(self, dataset: object = None, setup: dict[str, Any] | None = None) -> None:
        self._dataset = dataset
        self._rec = BatchRecorder()
        self._item_log = ItemLog()
        self.epoch: int | None = None
        self.epoch_count = 0  # batches delivered in the current epoch
        self.last_fetch_s = math.nan
        self.last_compute_s = math.nan
        self.last_stages: tuple[float, float, float] | None = None  # the last batch's (fetch, user, collate) s
        self.epoch_stages = analysis.StageTotals()  # the current epoch's seconds per stage (the live panel's bar)
        self._cache_base: dict[str, int] | None = None
        self._pending: BatchItems | None = None
        self._files: dict[int, tuple[str, int | None]] = {}  # index -> (name, bytes) of loaded stats
        self._saved_counters: dict[str, int] | None = None  # cache counters of loaded stats
        self._worker_clock: dict[int, float] = {}  # each worker's last CPU clock (telemetry.BatchItems.cpu)
        # the loader's settings and the machine's cores (advise() reads them; saved with the stats)
        self.setup: dict[str, Any] = {"cores": stats_file.cores(), **(setup or {})}

    # -- recording (loop thread)
    def take_items(self, batch: Any) -> Any:
        """Unwrap a batch that brought its items' fetch records (see :class:`~ucmagic.telemetry.ItemCollate`);
        weigh the first batches of an epoch and every 64th (what a batch carries across processes)."""
        if isinstance(batch, BatchItems):
            self._pending = batch
            batch = batch.batch
        n = self.epoch_count
        if n < WEIGH_FIRST or n % WEIGH_EVERY == 0:
            self._epoch_resources()["weighed"].append(batch_bytes(batch))
        return batch

    def record_batch(self, fetch_s: float, compute_s: float) -> None:
        """The loop received a batch after ``fetch_s`` s of waiting and ``compute_s`` s of its own work."""
        self._rec.record(fetch_s, compute_s)
        p, self._pending = self._pending, None
        epoch = self.epoch if self.epoch is not None else 0
        if p is None:
            self._item_log.add(epoch, -1)
            self.last_stages = None
        else:
            self._item_log.add(epoch, p.worker, p.index, p.fetch, p.nbytes, stages=p.stages)
            self.last_stages = p.stages
            cpu = p.cpu  # a worker's CPU clock, read every 50 ms (NaN: the main process's, measured per iteration)
            if cpu == cpu and self._worker_clock.get(p.worker) != cpu:
                self._worker_cpu(p.worker, cpu)
        self.epoch_stages.add(fetch_s, compute_s, self.last_stages)
        self.last_fetch_s, self.last_compute_s = fetch_s, compute_s
        self.epoch_count += 1

    def add_loop_cpu(self, epoch: int | None, seconds: float) -> None:
        """The loop's thread spent ``seconds`` of CPU in an iteration over ``epoch`` (kept in :attr:`setup`,
        ``"loop_cpu_s"``: {epoch: seconds}, saved and merged with it)."""
        per = self.setup.setdefault("loop_cpu_s", {})
        key = str(epoch if epoch is not None else 0)
        per[key] = per.get(key, 0.0) + max(0.0, float(seconds))

    def _worker_cpu(self, worker: int, cpu: float) -> None:
        """Worker ``worker``'s process had used ``cpu`` CPU seconds when it made the batch just recorded."""
        last = self._worker_clock.get(worker)
        self._worker_clock[worker] = cpu
        grew = cpu - last if last is not None and cpu >= last else cpu  # lower: a new process (workers restarted)
        res = self._epoch_resources()
        res["workers_cpu"] = res.get("workers_cpu", 0.0) + grew

    def _epoch_resources(self) -> dict[str, Any]:
        """The current epoch's entry of ``setup["resources"]`` (the loop's batch weights while it runs)."""
        key = str(self.epoch if self.epoch is not None else 0)
        res = self.setup.setdefault("resources", {}).setdefault(key, {})
        res.setdefault("weighed", [])
        return res  # type: ignore[no-any-return]

    def add_epoch_resources(self, epoch: int | None, *, wall: float, cpu: float, idle: float | None) -> None:
        """An iteration over ``epoch`` took ``wall`` seconds, its process ``cpu`` CPU seconds (all threads), and
        ``idle`` core-seconds of the cores it may use sat idle meanwhile (None: unknown). Kept in :attr:`setup`
        (``"resources"``: {epoch: {"wall", "cpu", "idle", "workers_cpu", "batch_bytes"}}), saved and merged."""
        res = self.setup.setdefault("resources", {}).setdefault(str(epoch if epoch is not None else 0), {})
        res["wall"] = res.get("wall", 0.0) + max(0.0, float(wall))
        res["cpu"] = res.get("cpu", 0.0) + max(0.0, float(cpu))
        if idle is not None and res.get("idle", 0.0) is not None:
            res["idle"] = res.get("idle", 0.0) + max(0.0, float(idle))
        else:
            res["idle"] = None
        weighed = res.pop("weighed", [])
        if weighed:
            res["batch_bytes"] = float(np.mean(weighed))

    def begin_epoch(self, epoch: int | None) -> None:
        """A new iteration over ``epoch`` starts (per-epoch counts restart)."""
        self.epoch, self.epoch_count = epoch, 0
        self.epoch_stages = analysis.StageTotals()

    def reset(self) -> None:
        """Forget every recorded batch."""
        self._rec.reset()
        self._item_log.reset()
        self.epoch_stages = analysis.StageTotals()
        self.setup.pop("loop_cpu_s", None)
        self.setup.pop("resources", None)
        self._worker_clock.clear()
        self.epoch_count = 0
        self.last_fetch_s = self.last_compute_s = math.nan

    # -- timings
    @property
    def count(self) -> int:
        """Batches recorded."""
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
        """Mean fetch latency (seconds; NaN before the first batch)."""
        return self._rec.fetch_total / self.count if self.count else math.nan

    def percentiles(self) -> dict[str, float]:
        """``{"p50", "p90", "p99"}`` of fetch latency (seconds)."""
        return percentiles(self._rec.fetch_array())

    p50 = _Read("percentiles", "p50", "Median fetch latency (seconds).")
    p90 = _Read("percentiles", "p90", "90th percentile of fetch latency (seconds).")
    p99 = _Read("percentiles", "p99", "99th percentile of fetch latency (seconds).")

    @property
    def max(self) -> float:
        """The longest fetch latency (seconds; NaN before the first batch)."""
        return float(self._rec.fetch_array().max()) if self.count else math.nan

    @property
    def stall_fraction(self) -> float:
        """Share of the loop's wall time spent waiting for data."""
        return self._rec.stall_fraction()

    # -- cache (UCVolumeDataset only)
    def _counters(self) -> dict[str, int] | None:
        c = getattr(self._dataset, "counters", None)  # a planned dataset's (ucmagic.files.planned.PlannedDataset)
        return c.totals() if isinstance(c, SharedCounters) else self._saved_counters

    hits = _Read("_counters", "hits", "Cache hits over all workers (None: the dataset has no cache).")
    misses = _Read("_counters", "misses", "Cache misses over all workers (None: the dataset has no cache).")
    bytes_fetched = _Read("_counters", "bytes_fetched", "Bytes copied from the volume (None: no cache).")

    def cache(self) -> dict[str, Any] | None:
        """The dataset's full ``stats()`` (cache fill scans the listing: O(files)); None if it has none."""
        fn = getattr(self._dataset, "stats", None)
        return fn() if callable(fn) else None

    def summary(self) -> dict[str, Any]:
        """Timings and cache counters as one plain dict."""
        out: dict[str, Any] = {"count": self.count, "mean": self.mean, **self.percentiles(), "max": self.max,
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
            snap.update(analysis.cache_fill(t, self._cache_base or {}))
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

    # -- per-item fetch records (analysis: stats_analysis)
    def batches(self) -> dict[str, np.ndarray]:
        """One row per batch: ``step`` (per rank), ``fetch_s`` (the loop's wait), ``compute_s``, ``epoch``,
        ``worker`` (-1: main process), ``rank``, ``items``, ``misses``, ``bytes`` (of the recorded items) and
        the producing process's stage seconds ``stage_fetch_s``, ``stage_user_s``, ``stage_collate_s``."""
        return analysis.batch_table(self._rec, self._item_log)

    def describe_item(self, index: int) -> tuple[str, int | None]:
        """``(name, bytes)`` of a recorded item index (file path, or Parquet ``file#rg``)."""
        if index in self._files:
            return self._files[index]
        fn = getattr(self._dataset, "describe_item", None)
        if callable(fn):
            with contextlib.suppress(IndexError, KeyError):
                described: tuple[str, int | None] = fn(int(index))
                return described
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
        return analysis.slowest(b, n, analysis.select(b, lo=lo, hi=hi, epoch=epoch, worker=worker, rank=rank))

    select = staticmethod(analysis.select)  # mask over batches() rows: steps lo..hi, one epoch/worker/rank

    def breakdown(self, epoch: int | None = None, *, per_epoch: bool = False) -> dict[Any, Any]:
        """Where the time went, in seconds: the loop's ``compute`` and ``wait`` (the wait split over the
        stages of the batches waited on: ``wait_fetch``, ``wait_user``, ``wait_collate``), and the
        producing processes' ``fetch`` (ucmagic's fetch: cache lookups, copies, waiting on read-ahead),
        ``user`` (your code: a wrapper's decode, a map-style ``__getitem__``) and ``collate`` seconds,
        which overlap the loop when there are workers; ``batches``. One ``epoch`` only, or with
        ``per_epoch`` a dict of such dicts by epoch."""
        b = self.batches()
        if per_epoch:
            return {int(e): analysis.breakdown(b, b["epoch"] == e) for e in np.unique(b["epoch"])}
        return analysis.breakdown(b, analysis.select(b, epoch=epoch))

    def hints(self) -> list[str]:
        """One-line findings from the records: where the wait is (what to change: :meth:`advise`)."""
        def items_of(b: int) -> tuple[np.ndarray, np.ndarray]:
            _, fetch, hit = self._item_log.items(b)
            return fetch, hit

        return analysis.straggler_hints(self.batches(), self.stall_fraction, self.batch_files, items_of)

    def advise(self, epochs: int | None = None) -> list[Any]:
        """A ranked list of changes, each an :class:`~ucmagic.loading.advise.Advice` predicting the run's
        seconds with it (the epochs recorded, or ``epochs``; its own cost included) against the measured run,
        with the measured numbers it used (``str()`` of one is its line).

        A knob that this process advised for the same data and this loader now runs with (the advice was
        followed) is advised again only if this run measured a saving against the run it was advised on."""
        from .advise import advise

        if epochs is not None and (not isinstance(epochs, int) or isinstance(epochs, bool) or epochs < 1):
            from ..errors import InvalidArgumentError

            raise InvalidArgumentError(f"epochs must be a positive int (the run's epochs to predict), got {epochs!r}")
        setup = self._setup_now()
        m = analysis.measured(self.batches(), setup, self._counters(), self._item_log, run_epochs=epochs)
        key = _advice_key(setup)
        before = _ADVISED.get(key)
        follows = before is not None and all(setup.get(k) == v for k, v in before[0].items())
        got = advise(m, before[1] if follows and before else None, before[2] if follows and before else None)
        top = next((a for a in got if a.sure and a.kind != "none"), None)
        if top is not None and set(top.settings) <= _FOLLOWABLE:  # kept without the per-batch columns
            slim = dataclasses.replace(m, epochs=[dataclasses.replace(e, made=(), waits=(), computes=())
                                                  for e in m.epochs])
            _ADVISED[key] = (dict(top.settings), slim, top.kind)
        return got

    def _setup_now(self) -> dict[str, Any]:
        """:attr:`setup` with the dataset's size (files, bytes) when it has a listing."""
        ds, out = self._dataset, dict(self.setup)
        with contextlib.suppress(Exception):  # a dataset without a listing (or one not listed yet)
            out.update(files=len(ds.listing), dataset_bytes=int(ds.total_bytes))  # type: ignore[attr-defined]
        return out

    # -- save / load / merge (the saved form: stats_file)
    def to_dict(self) -> dict[str, Any]:
        """Everything :meth:`load` needs, JSON-serialisable (file names of every recorded item included)."""
        rank = 0
        with contextlib.suppress(Exception):  # torch missing or odd env: rank 0
            from ..dist import dist_info

            rank = dist_info().rank
        return stats_file.to_dict(self._rec, self._item_log, self.describe_item, self._counters(), rank,
                                  self._setup_now())

    def save(self, path: str | os.PathLike[str]) -> str:
        """Write the stats as JSON (atomically); also logged as an MLflow artifact when a run is active."""
        from .mlflow_sink import log_artifact

        path = os.fspath(path)
        atomic_write(path, json.dumps(self.to_dict(), separators=(",", ":")).encode())
        log_artifact(path, "ucmagic")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any], rank: int | None = None) -> LoaderStats:
        """Stats from :meth:`to_dict` output (``rank`` overrides the saved one)."""
        records = stats_file.from_dict(d, rank)
        st = cls()
        st._rec, st._item_log, st._files = records.rec, records.log, records.files
        st._saved_counters, st.epoch, st.setup = records.counters, records.epoch, records.setup
        return st

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> LoaderStats:
        """Read stats written by :meth:`save`; :class:`~ucmagic.errors.StatsFileError` names the file and what it
        expected where the file is something else."""
        from ..errors import StatsFileError

        path = os.fspath(path)
        with open(path, "rb") as f:
            raw = f.read()
        if not raw.strip():
            raise StatsFileError(f"{path} is empty: expected {stats_file.EXPECTED}")
        try:
            d = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            where = f" ({e.msg} at line {e.lineno}, column {e.colno})" if isinstance(e, json.JSONDecodeError) else ""
            raise StatsFileError(f"{path} is not JSON{where}: expected {stats_file.EXPECTED}") from None
        try:
            return cls.from_dict(d)
        except ValueError as e:
            raise StatsFileError(f"{path} is not a LoaderStats file: {e}") from None

    @classmethod
    def merge(cls, parts: Iterable[LoaderStats | str | os.PathLike[str]]) -> LoaderStats:
        """One LoaderStats of several ranks (stats or saved files); each part keeps its rank, and
        the explorer's rank selector compares them. File indices are renumbered by name."""
        dicts = [(p if isinstance(p, LoaderStats) else cls.load(p)).to_dict() for p in parts]
        return cls.from_dict(stats_file.merge(dicts))

    # -- presentation (the presenters a display layer registered: ucmagic.presenters)
    def plot(self, **kw: Any) -> Any:
        """Matplotlib figure: fetch latency per batch with p50/p99 lines, and its histogram."""
        return presenter("plot")(self, **kw)

    def explore(self, **kw: Any) -> Any:
        """An interactive explorer (ipywidgets + matplotlib): zoom, epoch/worker/rank, slowest batches
        and their files. Works during and after training and on :meth:`load`-ed or merged stats."""
        return presenter("explore")(self, **kw)

    def __repr__(self) -> str:
        if not self.count:
            return "LoaderStats(count=0)"
        pct = self.percentiles()
        return (f"LoaderStats(count={self.count}, mean={self.mean * 1e3:.2f}ms, p50={pct['p50'] * 1e3:.2f}ms, "
                f"p99={pct['p99'] * 1e3:.2f}ms, max={self.max * 1e3:.2f}ms, stall={self.stall_fraction:.1%})")
