"""The saved form of a loader's records (``stats.save()``, ``LoaderStats.load()``, ``merge()``).

A JSON object, version :data:`SAVE_VERSION`: per-batch columns (``fetch_s``, ``compute_s``,
``count``, ``epoch``, ``worker``, ``batch_rank``, ``misses``, ``nbytes``, and the producing process's
stage seconds ``stage_fetch_s``, ``stage_user_s``, ``stage_collate_s``: null when not measured), the
item columns kept in detail (``item_index``, ``item_fetch_s``: negative for a cache hit), the name and
size of every recorded item (``files``), the cache ``counters``, ``rank``, ``truncated`` and ``setup``
(the loader's settings and the machine's ``cores``; files written before stage times have none). Pure: dicts and
records in, dicts and records out; :class:`~ucmagic.loading.loader_stats.LoaderStats` does the I/O.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, NamedTuple, Sequence

import numpy as np

from ..telemetry import STAGES, BatchRecorder, ItemLog

SAVE_VERSION = 1

BATCH_COLUMNS = ("fetch_s", "compute_s", "count", "epoch", "worker", "misses", "nbytes")
STAGE_COLUMNS = tuple(f"stage_{k}_s" for k in STAGES)


def cores() -> int:
    """CPUs this process may run on (its affinity), saved beside the stats: advice is bounded by them."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1
Describe = Callable[[int], "tuple[str, int | None]"]  # item index -> (name, bytes)


class Records(NamedTuple):
    """What a saved file holds, as records again."""

    rec: BatchRecorder
    log: ItemLog
    files: dict[int, tuple[str, int | None]]
    counters: dict[str, int] | None
    epoch: int | None
    setup: dict[str, Any]


def to_dict(rec: BatchRecorder, log: ItemLog, describe: Describe, counters: dict[str, int] | None,
            rank: int, setup: dict[str, Any] | None = None) -> dict[str, Any]:
    """The saved form of ``rec`` and ``log`` (``describe`` names each recorded item)."""
    a = log.arrays()
    n = min(len(rec), len(a["count"]))
    cols = {k: a[k][:n].tolist() for k in ("count", "epoch", "worker", "misses", "nbytes")}
    cols["batch_rank"] = a["rank"][:n].tolist()
    for k, col in zip(STAGES, STAGE_COLUMNS):
        cols[col] = [None if math.isnan(x) else x for x in a[f"stage_{k}"][:n].astype(float).tolist()]
    kept = int(a["start"][n - 1] + a["count"][n - 1]) if n else 0
    index = a["index"][:min(kept, len(a["index"]))]
    files = {str(i): list(describe(i)) for i in np.unique(index).tolist()}
    return {"version": SAVE_VERSION, "rank": rank, "fetch_s": rec.fetch_array()[:n].tolist(),
            "compute_s": rec.compute_array()[:n].tolist(), **cols,
            "item_index": index.tolist(), "item_fetch_s": [float(x) for x in a["fetch"][:len(index)]],
            "files": files, "counters": counters, "truncated": log.truncated, "setup": dict(setup or {})}


EXPECTED = "a JSON object written by loader.stats.save()"


def check(d: Any) -> None:
    """Raise ``ValueError`` saying what is wrong where ``d`` (read from a file: anything) is not the saved form."""
    if not isinstance(d, dict):
        raise ValueError(f"expected {EXPECTED}, found a JSON {type(d).__name__}")
    if "version" in d and d["version"] != SAVE_VERSION:
        raise ValueError(f"unsupported LoaderStats file version {d.get('version')!r} (this ucmagic reads "
                         f"version {SAVE_VERSION})")
    if "version" not in d or "fetch_s" not in d:
        raise ValueError(f"expected {EXPECTED} (keys version, fetch_s, compute_s, ...), found keys "
                         f"{', '.join(sorted(map(str, d))[:6]) or 'none'}")
    n = _column(d, "fetch_s", float)
    for key in ("compute_s",):
        if _column(d, key, float) != n:
            raise ValueError(f"expected {key} to have one value per batch ({n}), found {len(d[key])}")
    for key in ("count", "epoch", "worker", "misses", "nbytes"):
        if _column(d, key, int) != n:
            raise ValueError(f"expected {key} to have one value per batch ({n}), found {len(d[key])}")
    for key in ("batch_rank", *STAGE_COLUMNS):
        if d.get(key) is not None and _column(d, key, float, nulls=True) != n:
            raise ValueError(f"expected {key} to have one value per batch ({n}), found {len(d[key])}")
    if _column(d, "item_index", int) != _column(d, "item_fetch_s", float):
        raise ValueError("expected item_index and item_fetch_s of the same length")
    if any(c < 0 for c in d["count"]) or any(not 0 <= i < 2**31 for i in d["item_index"]):
        raise ValueError("expected counts >= 0 and item indices in 0 .. 2**31 - 1")
    files = d.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, list) and len(v) == 2 and isinstance(v[0], str)
                                              for v in files.values()):
        raise ValueError('expected files to map each item index to [name, bytes]')
    for key in ("counters", "setup"):
        if d.get(key) is not None and not isinstance(d[key], dict):
            raise ValueError(f"expected {key} to be a JSON object, found a JSON {type(d[key]).__name__}")


def _column(d: dict[str, Any], key: str, kind: type, nulls: bool = False) -> int:
    """The length of ``d[key]``, a list of numbers (``kind`` int: whole numbers; ``nulls``: null allowed)."""
    v = d.get(key)
    if not isinstance(v, list):
        found = "nothing" if v is None else type(v).__name__
        raise ValueError(f"expected {key} to be a list of numbers, found {found}")
    ok = (int,) if kind is int else (int, float)
    if not all((x is None and nulls) or (isinstance(x, ok) and not isinstance(x, bool)) for x in v):
        raise ValueError(f"expected {key} to hold only {'whole ' if kind is int else ''}numbers")
    return len(v)


def from_dict(d: dict[str, Any], rank: int | None = None) -> Records:
    """Records from :func:`to_dict` output (``rank`` overrides the saved ones); ``ValueError`` (what was expected)
    where ``d`` is not that (:func:`check`)."""
    check(d)
    rec = BatchRecorder()
    rec.extend(d["fetch_s"], d["compute_s"])
    log = ItemLog()
    idx = np.asarray(d["item_index"], dtype=np.int32)
    fetch = np.asarray(d["item_fetch_s"], dtype=np.float32)
    off = 0
    ranks = d.get("batch_rank") or [d.get("rank", 0)] * len(d["count"])
    stages = zip(*(_floats(d.get(col), len(d["count"])) for col in STAGE_COLUMNS))
    for c, e, w, m, nb, dr, st in zip(d["count"], d["epoch"], d["worker"], d["misses"], d["nbytes"], ranks, stages):
        take = c if off + c <= len(idx) else 0
        log.add(int(e), int(w), idx[off:off + take].tobytes(), fetch[off:off + take].tobytes(), int(nb),
                rank=int(dr) if rank is None else int(rank), stages=st)
        if not take:  # the batch's items were not kept in detail
            log.count[-1], log.misses[-1] = int(c), int(m)
        off += take
    log.truncated = bool(d.get("truncated"))
    files = {int(k): (v[0], v[1]) for k, v in d.get("files", {}).items()}
    epoch = int(d["epoch"][-1]) if d["epoch"] else None
    return Records(rec, log, files, d.get("counters"), epoch, dict(d.get("setup") or {}))


def _floats(values: Sequence[float | None] | None, n: int) -> list[float]:
    """A saved stage column as floats (null, or a file without the column: NaN)."""
    if values is None:
        return [math.nan] * n
    return [math.nan if v is None else float(v) for v in values]


def merge(dicts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One saved form of several ranks' (each part keeps its rank; file indices renumbered by name)."""
    ranks = [int(d["rank"]) for d in dicts]
    if len(set(ranks)) < len(ranks):  # saved by one process (or unknown ranks): number them in order
        ranks = list(range(len(dicts)))
    names: dict[tuple[str, Any], int] = {}
    counters: dict[str, int] = {}
    merged: dict[str, Any] = {"version": SAVE_VERSION, "rank": 0, "item_index": [], "item_fetch_s": [],
                              "truncated": False, "batch_rank": [],
                              **{k: [] for k in BATCH_COLUMNS + STAGE_COLUMNS}}
    for d, rank in zip(dicts, ranks):
        remap = {int(k): names.setdefault((name, size), len(names)) for k, (name, size) in d["files"].items()}
        merged["item_index"] += [remap.get(x, x) for x in d["item_index"]]
        merged["item_fetch_s"] += d["item_fetch_s"]
        for k in BATCH_COLUMNS:
            merged[k] += d[k]
        for k in STAGE_COLUMNS:
            merged[k] += d.get(k) or [None] * len(d["count"])
        merged["batch_rank"] += [rank] * len(d["count"])
        merged["truncated"] |= bool(d.get("truncated"))
        for k, v in (d.get("counters") or {}).items():
            counters[k] = counters.get(k, 0) + int(v)
    merged["files"] = {str(g): list(key) for key, g in names.items()}
    merged["counters"] = counters or None
    merged["setup"] = {**(dicts[0].get("setup") or {}), "ranks": len(dicts)} if dicts else {}
    loop_cpu: dict[str, float] = {}  # per epoch, the busiest rank's loop
    for d in dicts:
        for e, v in ((d.get("setup") or {}).get("loop_cpu_s") or {}).items():
            loop_cpu[e] = max(loop_cpu.get(e, 0.0), float(v))
    if loop_cpu:
        merged["setup"]["loop_cpu_s"] = loop_cpu
    resources: dict[str, dict[str, Any]] = {}  # per epoch, the rank whose iteration took longest
    for d in dicts:
        for e, r in ((d.get("setup") or {}).get("resources") or {}).items():
            if isinstance(r, dict) and float(r.get("wall") or 0.0) >= float(resources.get(e, {}).get("wall") or 0.0):
                resources[e] = r
    if resources:
        merged["setup"]["resources"] = resources
    return merged
