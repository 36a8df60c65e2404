"""Counters and latency percentiles.

:class:`SharedCounters` lives in shared memory so DataLoader worker processes (fork, spawn or
forkserver) bump counters that the main process reads: each process writes only its own slot,
so no locks are needed and nothing is lost.
"""
from __future__ import annotations

import math
import multiprocessing as mp
from typing import Sequence

import numpy as np

SLOTS = 65  # the main process + 64 workers; more workers share slots (counts stay close)
RING = 2048  # latency samples kept per slot
_FIELDS = ("hits", "misses", "bytes_fetched", "retries", "errors", "delivered", "nsamples")
_H, _M, _B, _R, _E, _D, _N = range(len(_FIELDS))


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99)) -> dict[str, float]:
    """``{"p50": .., "p90": .., "p99": ..}`` of ``values`` (linear interpolation); NaN when empty."""
    if len(values) == 0:
        return {f"p{q:g}": math.nan for q in qs}
    arr = np.asarray(values, dtype=float)
    return {f"p{q:g}": float(np.percentile(arr, q)) for q in qs}


def current_slot() -> int:
    try:
        from torch.utils.data import get_worker_info

        info = get_worker_info()
    except ImportError:  # pragma: no cover
        info = None
    return 0 if info is None else 1 + info.id % (SLOTS - 1)


class SharedCounters:
    """Per-process counter slots plus a ring of recent fetch latencies, in shared memory."""

    def __init__(self) -> None:
        ctx = mp.get_context()
        self._counts = ctx.RawArray("q", SLOTS * len(_FIELDS))
        self._lat = ctx.RawArray("d", SLOTS * RING)

    def _base(self) -> int:
        return current_slot() * len(_FIELDS)

    def add(self, *, hits: int = 0, misses: int = 0, bytes_fetched: int = 0, retries: int = 0,
            errors: int = 0, delivered: int = 0) -> None:
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

    def record_latency(self, seconds: float) -> None:
        slot = current_slot()
        b = slot * len(_FIELDS)
        n = self._counts[b + _N]
        self._lat[slot * RING + n % RING] = seconds
        self._counts[b + _N] = n + 1

    def totals(self) -> dict[str, int]:
        arr = np.frombuffer(self._counts, dtype=np.int64).reshape(SLOTS, len(_FIELDS)).sum(axis=0)
        return {k: int(v) for k, v in zip(_FIELDS, arr) if k != "nsamples"}

    def latencies(self) -> np.ndarray:
        counts = np.frombuffer(self._counts, dtype=np.int64).reshape(SLOTS, len(_FIELDS))[:, _N]
        lat = np.frombuffer(self._lat, dtype=np.float64).reshape(SLOTS, RING)
        parts = [lat[s, : min(int(n), RING)] for s, n in enumerate(counts) if n]
        return np.concatenate(parts) if parts else np.zeros(0)

    def reset(self) -> None:
        np.frombuffer(self._counts, dtype=np.int64)[:] = 0

    # Shared memory travels to worker processes when they start; a plain pickle (e.g. a user
    # saving the dataset object) carries a snapshot instead.
    def __getstate__(self):
        from multiprocessing import context

        if context.get_spawning_popen() is not None:
            return {"shared": (self._counts, self._lat)}
        return {"copy": (bytes(self._counts), bytes(self._lat))}

    def __setstate__(self, st):
        if "shared" in st:
            self._counts, self._lat = st["shared"]
        else:
            self.__init__()
            counts, lat = st["copy"]
            np.frombuffer(self._counts, dtype=np.int64)[:] = np.frombuffer(counts, dtype=np.int64)
            np.frombuffer(self._lat, dtype=np.float64)[:] = np.frombuffer(lat, dtype=np.float64)


class SharedInt:
    """One integer in shared memory (the epoch number), same pickling rules as SharedCounters."""

    def __init__(self, value: int = 0) -> None:
        self._v = mp.get_context().RawValue("q", value)

    @property
    def value(self) -> int:
        return int(self._v.value)

    @value.setter
    def value(self, v: int) -> None:
        self._v.value = int(v)

    def __getstate__(self):
        from multiprocessing import context

        if context.get_spawning_popen() is not None:
            return {"shared": self._v}
        return {"copy": self.value}

    def __setstate__(self, st):
        if "shared" in st:
            self._v = st["shared"]
        else:
            self.__init__(st["copy"])


class BatchRecorder:
    """Per-batch timings of a training loop: fetch latency (time ``next()`` waited) and compute
    time (time between batches). Appends are O(1) into compact arrays; read in the main process.
    """

    def __init__(self) -> None:
        from array import array

        self.fetch = array("d")
        self.compute = array("d")
        self.fetch_total = 0.0
        self.compute_total = 0.0

    def record(self, fetch_s: float, compute_s: float) -> None:
        self.fetch.append(fetch_s)
        self.compute.append(compute_s)
        self.fetch_total += fetch_s
        self.compute_total += compute_s

    def __len__(self) -> int:
        return len(self.fetch)

    def fetch_array(self, last: int | None = None) -> np.ndarray:
        """Fetch latencies as a float64 array (a copy), optionally only the ``last`` ones."""
        return _tail(self.fetch, last)

    def compute_array(self, last: int | None = None) -> np.ndarray:
        return _tail(self.compute, last)

    def stall_fraction(self) -> float:
        """Share of the loop's wall time spent waiting for data (0 when nothing was recorded)."""
        total = self.fetch_total + self.compute_total
        return self.fetch_total / total if total > 0 else 0.0

    def reset(self) -> None:
        self.__init__()


def _tail(values, last: int | None) -> np.ndarray:
    # Slice first (a copy), so no buffer of the growing array stays exported.
    part = values[-last:] if last else values[:]
    return np.frombuffer(part, dtype=np.float64) if len(part) else np.zeros(0)


class SharedInts:
    """A fixed array of integers in shared memory, same pickling rules as SharedCounters.

    Each index is written by one process at a time (no lock); readers see a recent value.
    """

    def __init__(self, n: int) -> None:
        self._a = mp.get_context().RawArray("q", int(n))

    def __len__(self) -> int:
        return len(self._a)

    def __getitem__(self, i: int) -> int:
        return int(self._a[i])

    def __setitem__(self, i: int, v: int) -> None:
        self._a[i] = int(v)

    def __getstate__(self):
        from multiprocessing import context

        if context.get_spawning_popen() is not None:
            return {"shared": self._a}
        return {"copy": list(self._a)}

    def __setstate__(self, st):
        if "shared" in st:
            self._a = st["shared"]
        else:
            self.__init__(len(st["copy"]))
            self._a[:] = st["copy"]
