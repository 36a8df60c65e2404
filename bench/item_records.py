"""Cost of the per-item fetch records: microseconds per item and memory at 1 M and 10 M items.

    python bench/item_records.py                 # 1 M and 10 M items, batches of 32
    python bench/item_records.py --items 1e6

Per item: ``telemetry.record_item`` in the iterating process, the collate wrapper packing a
batch's records, and ``ItemLog.add`` in the main process (what a loader does per batch).
Memory: ``ItemLog.memory_bytes()`` (per-item and per-batch arrays) and the process's RSS growth.
"""
from __future__ import annotations

import argparse
import os
import resource
import time

from ucmagic import telemetry
from ucmagic.telemetry import ItemCollate, ItemLog


def rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def baseline_us(items: int, batch: int) -> float:
    """The same loop calling a no-op function: what one Python call costs on this machine right now."""
    def noop(index: int, hit: bool, fetch_s: float, nbytes: int) -> None:
        pass

    perf = time.perf_counter
    t0 = perf()
    for b in range(items // batch):
        base = b * batch
        for k in range(batch):
            noop(base + k, k % 3 != 0, 0.001, 4096)
    return (perf() - t0) / (items // batch * batch) * 1e6


def run(items: int, batch: int) -> dict[str, float]:
    log = ItemLog()
    collate = ItemCollate(lambda xs: None)
    batches = items // batch
    rss0 = rss_mb()
    t_rec = t_pack = t_add = 0.0
    perf = time.perf_counter
    for b in range(batches):
        t0 = perf()
        base = b * batch
        for k in range(batch):
            telemetry.record_item(base + k, k % 3 != 0, 0.001, 4096)
        t1 = perf()
        out = collate([None] * batch)
        t2 = perf()
        log.add(0, out.worker, out.index, out.fetch, out.nbytes)
        t3 = perf()
        t_rec, t_pack, t_add = t_rec + t1 - t0, t_pack + t2 - t1, t_add + t3 - t2
    n = batches * batch
    return {"items": n, "record_us": t_rec / n * 1e6, "pack_us": t_pack / n * 1e6, "main_us": t_add / n * 1e6,
            "total_us": (t_rec + t_pack + t_add) / n * 1e6, "log_mb": log.memory_bytes() / 2**20,
            "rss_growth_mb": rss_mb() - rss0}


def main() -> None:
    import torch.utils.data  # noqa: F401  (a loader has it imported; the collate wrapper looks up the worker)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=float, nargs="*", default=[1e6, 1e7])
    ap.add_argument("--batch", type=int, default=32)
    a = ap.parse_args()
    for n in a.items:
        base = baseline_us(int(n), a.batch)
        r = run(int(n), a.batch)
        print(f"{r['items']:>11,} items  record {r['record_us']:.2f} us + pack {r['pack_us']:.2f} us + main "
              f"{r['main_us']:.2f} us = {r['total_us']:.2f} us/item  ItemLog {r['log_mb']:.1f} MB  "
              f"RSS +{r['rss_growth_mb']:.1f} MB  (a no-op call: {base:.2f} us)")


if __name__ == "__main__":
    main()
