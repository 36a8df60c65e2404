"""Buffered MLflow logging of per-batch loader timings.

The training loop only appends two floats per batch; every ``interval`` seconds the window is handed
to one background thread that aggregates it (mean, p50/p99/max fetch latency, stall fraction) and
writes it with one ``MlflowClient.log_batch`` call, so a slow tracking server never stalls the loop.
``flush(wait=True)`` (end of epoch, break, error) writes everything still buffered before returning.

MLflow is imported only when it is already imported by the user (an active run needs that) or
``MLFLOW_RUN_ID`` is set (torchrun children, jobs). Without a run nothing is logged and nothing fails.
"""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Tuple

import numpy as np

from ..telemetry import p50_p99

PREFIX = "dataloader"
MAX_METRICS_PER_CALL = 1000  # MLflow's log_batch limit
DEFAULT_INTERVAL_S = 5.0


def active_run_id() -> str | None:
    """The active MLflow run's id, else ``$MLFLOW_RUN_ID``, else None (never imports MLflow needlessly)."""
    env = os.environ.get("MLFLOW_RUN_ID") or None
    if "mlflow" not in sys.modules and env is None:
        return None
    try:
        import mlflow
    except ImportError:
        return None
    try:
        run = mlflow.active_run()
    except Exception:  # noqa: BLE001 - a broken tracking setup must not break training
        run = None
    return run.info.run_id if run is not None else env


def log_artifact(path: str, folder: str = "ucmagic") -> None:
    """Log the file ``path`` to the active MLflow run (none: nothing); a failure warns, never raises."""
    run = active_run_id()
    if run is None:
        return
    try:
        from mlflow.tracking import MlflowClient

        MlflowClient().log_artifact(run, path, folder)
    except Exception as exc:  # noqa: BLE001 - the file is written; the artifact is a bonus
        warnings.warn(f"ucmagic: could not log {path} to MLflow run {run}: {exc}", stacklevel=3)


def cache_gauges(counters: Any) -> Callable[[], dict[str, float]]:
    """MLflow gauges of a UCVolumeDataset's shared counters: bytes fetched and cache hit rate."""

    def gauges() -> dict[str, float]:
        t = counters.totals()
        lookups = t["hits"] + t["misses"]
        out = {"bytes_fetched": float(t["bytes_fetched"])}
        if lookups:
            out["cache_hit_rate"] = t["hits"] / lookups
        return out

    return gauges


WINDOW_NAMES = ("fetch_seconds", "compute_seconds", "fetch_p50_seconds", "fetch_p99_seconds",
                "fetch_max_seconds", "stall_fraction", "batches", "stage_fetch_seconds", "stage_user_seconds",
                "stage_collate_seconds")
Stages = Tuple[float, float, float]  # a batch's fetch, user, collate seconds in its producing process


def metric_keys(rank: int) -> dict[str, str]:
    """MLflow keys for ``rank`` (the rank is the leaf, so all ranks share a chart prefix)."""
    return {n: f"{PREFIX}/{n}/rank_{rank}" for n in WINDOW_NAMES}


def window_metrics(fetch: list[float], compute: list[float], stages: list[Stages] | None = None) -> dict[str, float]:
    """Aggregates of one window of batches: mean fetch and compute time, p50/p99/max fetch
    latency, stall fraction (share of the window's time spent waiting for data), batch count and the
    mean stage seconds per batch in the producing processes (``stage_*_seconds``, measured batches only)."""
    f = np.asarray(fetch, dtype=float)
    c = np.asarray(compute, dtype=float)
    if not len(f):
        return {}
    p50, p99 = p50_p99(f)
    total = float(f.sum() + c.sum())
    out = {"fetch_seconds": float(f.mean()), "compute_seconds": float(c.mean()) if len(c) else 0.0,
           "fetch_p50_seconds": float(p50), "fetch_p99_seconds": float(p99), "fetch_max_seconds": float(f.max()),
           "stall_fraction": float(f.sum()) / total if total > 0 else 0.0, "batches": float(len(f))}
    st = np.asarray(stages or [], dtype=float).reshape(-1, 3)
    st = st[~np.isnan(st).any(axis=1)]
    if len(st):
        for name, v in zip(("stage_fetch_seconds", "stage_user_seconds", "stage_collate_seconds"), st.mean(axis=0)):
            out[name] = float(v)
    return out


class MlflowSink:
    """Per-batch timings of one rank, aggregated per window and written to an MLflow run in the background.

    Each window (``interval`` seconds, and the rest at ``flush``) becomes one ``log_batch`` with the
    window's mean fetch/compute time, p50/p99/max fetch latency, stall fraction and batch count,
    at the step of its last batch. Every batch's own timing stays in ``loader.stats``.

    Args:
        run_id: the MLflow run to write to.
        rank: distributed rank; the leaf of every key (``dataloader/fetch_seconds/rank_0``).
        interval: seconds between background writes.
        extra: called on the loop's thread at each write; returns more ``{name: value}`` gauges
            (logged as ``dataloader/<name>/rank_<r>`` at the window's last step).
        client: an ``MlflowClient`` (tests); created lazily otherwise.
    """

    def __init__(self, run_id: str, rank: int = 0, *, interval: float = DEFAULT_INTERVAL_S,
                 extra: Callable[[], dict[str, float]] | None = None, client: Any = None) -> None:
        self.run_id = run_id
        self.rank = int(rank)
        self.interval = float(interval)
        self.extra = extra
        self.keys = metric_keys(self.rank)
        self._client = client
        self._fetch: list[float] = []
        self._compute: list[float] = []
        self._stages: list[Stages] = []
        self._step = 0
        self._next_flush = time.monotonic() + self.interval
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[Any]] = []
        self._warned = False
        self.calls = 0  # log_batch calls made (tests and benchmarks read it)
        self.logged = 0  # metrics written

    @classmethod
    def for_active_run(cls, rank: int = 0, **kw: Any) -> "MlflowSink | None":
        """A sink for the active run (or ``$MLFLOW_RUN_ID``); None when there is none."""
        run_id = active_run_id()
        if not run_id:
            return None
        if kw.get("client") is None:
            from mlflow.tracking import MlflowClient

            kw["client"] = MlflowClient()  # the tracking URI of now, on the loop's thread
        return cls(run_id, rank, **kw)

    # -- loop thread
    def add(self, step: int, fetch_s: float, compute_s: float, stages: Stages | None = None) -> None:
        """Buffer one batch (``stages``: its producing process's fetch, user, collate seconds); hand the
        window to the writer when ``interval`` has passed."""
        self._fetch.append(fetch_s)
        self._compute.append(compute_s)
        if stages is not None:
            self._stages.append(stages)
        self._step = step
        if time.monotonic() >= self._next_flush:
            self.flush(wait=False)

    def flush(self, wait: bool = True) -> None:
        """Write what is buffered; with ``wait`` block until every write so far is done."""
        fetch, compute, stages = self._fetch, self._compute, self._stages
        self._fetch, self._compute, self._stages = [], [], []
        self._next_flush = time.monotonic() + self.interval
        if fetch:
            gauges: dict[str, float] = {}
            if self.extra is not None:
                try:
                    gauges = dict(self.extra())
                except Exception:  # noqa: BLE001 - a failing gauge callback must not stop the metrics
                    gauges = {}
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="ucmagic-mlflow")
            self._pending = [f for f in self._pending if not f.done()]
            window = (fetch, compute, self._step, int(time.time() * 1000), stages)
            self._pending.append(self._pool.submit(self._write, window, gauges))
        if wait:
            for f in self._pending:
                f.result()
            self._pending = []

    def close(self) -> None:
        """Final flush, then stop the writer thread."""
        self.flush(wait=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- writer thread
    def _write(self, window: tuple[list[float], list[float], int, int, list[Stages]],
               gauges: dict[str, float]) -> None:
        try:
            from mlflow.entities import Metric

            fetch, compute, step, ts, stages = window
            values = {**window_metrics(fetch, compute, stages), **gauges}
            metrics = [Metric(self.keys.get(name) or f"{PREFIX}/{name}/rank_{self.rank}", float(v), ts, step)
                       for name, v in values.items() if v is not None and math.isfinite(float(v))]
            client = self._get_client()
            for i in range(0, len(metrics), MAX_METRICS_PER_CALL):
                client.log_batch(self.run_id, metrics=metrics[i:i + MAX_METRICS_PER_CALL], synchronous=True)
                self.calls += 1
            self.logged += len(metrics)
        except Exception as exc:  # noqa: BLE001 - logging must never break training
            if not self._warned:
                self._warned = True
                warnings.warn(f"ucmagic: could not log loader metrics to MLflow run {self.run_id}: {exc} "
                              "(training goes on; further errors are silent)", stacklevel=2)

    _client_lock = threading.Lock()

    def _get_client(self) -> Any:
        with self._client_lock:
            if self._client is None:
                from mlflow.tracking import MlflowClient

                self._client = MlflowClient()
            return self._client
