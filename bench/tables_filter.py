"""Benchmark: filter= and ds.rows on a table on a slow volume (issue 44 targets).

    python bench/tables_filter.py            # 8 files x 8 row groups of ~16 MB (~1 GB), P100
    python bench/tables_filter.py --quick    # 8 files x 2 row groups of ~1 MB: a smoke run (seconds)

A synthetic table (a sorted int64 ``id``, 15 float64 columns, an int32 ``label`` = id % 10) is written as 8
Parquet files of equal row groups on local disk, then read through the simulator's ``slow://`` volume at
P100 (100 ms per open, 100 MB/s per stream; bench/coldwarm.py mounts the same profile through FUSE), with a
byte counter on every byte the volume hands out (a ``SlowVolume`` subclass registered for ``slow://``).
Measured, one process, in this order:

1. bytes read from the volume for ``filter="id < <1% of rows>"`` (a cold cache; footers included), as a
   share of the table's bytes (target <= 5%);
2. filtered rows/s, warm (the median of 7 interleaved epochs after the first: the kept row groups are
   cached), ucmagic's ParquetDataset (``format="arrow"``) vs pyarrow's dataset scanner over the same files
   on local disk with the same filter, for the 1% sorted filter and a 10% filter on ``label`` (target
   >= 0.8x);
3. the first ``ds.rows[i]`` on a cold cache: the dataset's construction (footers) and the row itself
   (target: the row within 0.5 s);
4. uniform random ``ds.rows[i]`` over the warm table, rows/s (``ds.rows.cache_groups`` set to every row
   group: a decoded row-group cache; target >= 5,000 rows/s).

Every figure is printed beside its target; run it on a quiet machine for figures.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

P100 = {"open_ms": 100, "mbps": 100}
FLOATS = [f"f{i}" for i in range(15)]
ROW_BYTES = 8 + 8 * len(FLOATS) + 4


def make_table(dest: str, files: int, groups: int, group_mb: float) -> int:
    """The table under ``dest`` (uncompressed: the bytes are the row groups'); returns its rows."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows_per_group = max(1, int(group_mb * (1 << 20) / ROW_BYTES))
    per_file = rows_per_group * groups
    os.makedirs(dest, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(files):
        ids = np.arange(i * per_file, (i + 1) * per_file, dtype=np.int64)
        cols = {"id": ids, **{c: rng.random(per_file) for c in FLOATS}, "label": (ids % 10).astype(np.int32)}
        pq.write_table(pa.table(cols), os.path.join(dest, f"part-{i:03d}.parquet"), row_group_size=rows_per_group,
                       compression="none")
    return files * per_file


class Counter:
    """Bytes read through the counting slow volume (all threads)."""

    def __init__(self) -> None:
        self.n = 0
        self.mu = threading.Lock()

    def add(self, n: int) -> None:
        with self.mu:
            self.n += n


COUNT = Counter()


def register_counting_volume() -> str:
    """``slow://`` served by the simulator's volume with every byte it hands out counted (ranged reads and
    whole-file copies); returns the scheme."""
    from ucmagic.files.volume import register_volume
    from ucmagic.testing import SlowVolume

    class CountedReader:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def readinto_at(self, offset: int, buf: memoryview) -> int:
            n = self.inner.readinto_at(offset, buf)
            COUNT.add(n)
            return n

        def close(self) -> None:
            self.inner.close()

    class CountingSlowVolume(SlowVolume):
        """The slow volume, counted."""

        def range_reader(self, rel: str) -> Any:
            return CountedReader(super().range_reader(rel))

        def copy_to(self, rel: str, dest: str, *, expect: Any = None) -> int:
            n = super().copy_to(rel, dest, expect=expect)
            COUNT.add(n)
            return n

    register_volume("slow", CountingSlowVolume)
    return "slow"


REPEATS = 7  # warm epochs per side, interleaved; the median counts


def rows_per_s(batches: Any) -> tuple[int, float]:
    t0 = time.perf_counter()
    n = sum(b.num_rows for b in batches)
    return n, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a tiny table (2 row groups of ~1 MB per file): a smoke run")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--groups", type=int, default=None, help="row groups per file (default 8; --quick 2)")
    ap.add_argument("--group-mb", type=float, default=None, help="MB per row group (default 16; --quick 1)")
    ap.add_argument("--random-rows", type=int, default=None, help="random rows[i] reads (default 20000; --quick 500)")
    ap.add_argument("--dir", default=None, help="where to write the table (default: a temp dir, removed after)")
    a = ap.parse_args()
    groups = a.groups or (2 if a.quick else 8)
    group_mb = a.group_mb or (1.0 if a.quick else 16.0)
    nrandom = a.random_rows or (500 if a.quick else 20_000)

    import numpy as np
    import pyarrow.compute as pc
    import pyarrow.dataset as pads

    from ucmagic.tables import ParquetDataset

    work = a.dir or tempfile.mkdtemp(prefix="ucmagic-bench-tables-")
    table = os.path.join(work, "table")
    try:
        t0 = time.perf_counter()
        rows = make_table(table, a.files, groups, group_mb)
        total = sum(os.path.getsize(os.path.join(table, f)) for f in os.listdir(table))
        print(f"table: {a.files} files x {groups} row groups of ~{group_mb:g} MB = {rows:,} rows, "
              f"{total / 1e6:,.0f} MB (written in {time.perf_counter() - t0:.1f} s); volume: slow:// P100 "
              f"({P100['open_ms']} ms per open, {P100['mbps']} MB/s per stream)", flush=True)
        url = f"{register_counting_volume()}://{table}"
        so = dict(P100)
        cut = rows // 100
        sorted_1 = f"id < {cut}"
        label_10 = "label = 3"
        out: list[tuple[str, str, str, str, str]] = []

        # 1. bytes read for a 1% filter on the sorted column, cold
        cache = os.path.join(work, "cache-1")
        COUNT.n = 0
        t0 = time.perf_counter()
        ds = ParquetDataset(url, filter=sorted_1, format="arrow", batch_size=65536, cache_dir=cache,
                            storage_options=so)
        n, _ = rows_per_s(iter(ds))
        cold_s = time.perf_counter() - t0
        share = COUNT.n / total
        out.append(("bytes read, 1% sorted filter (cold)", f"{COUNT.n / 1e6:,.1f} MB = {share:.2%}", "-",
                    f"{share:.2%}", "<= 5%" + (" ok" if share <= 0.05 else " MISSED")))
        out.append(("cold filtered epoch (incl. footers + index)", f"{cold_s:.2f} s, {n:,} rows", "-", "-", "-"))
        if n != cut:
            print(f"WRONG: the 1% filter gave {n} rows, expected {cut}", file=sys.stderr)
            return 1

        # 2. warm filtered rows/s vs pyarrow's scanner (local files, same filter)
        for name, pred, expr in (("1% sorted", sorted_1, pc.field("id") < cut),
                                 ("10% label", label_10, pc.field("label") == 3)):
            dsw = ParquetDataset(url, filter=pred, format="arrow", batch_size=65536,
                                 cache_dir=os.path.join(work, "cache-2"), storage_options=so)
            list(dsw)  # the cold epoch fills the cache
            scan = pads.dataset(table, format="parquet")
            list(scan.to_batches(filter=expr))  # page cache warm for the baseline too
            ours, theirs = [], []
            for _ in range(REPEATS):  # interleaved; an epoch of 1% is ~10 ms: one run is noise
                ours.append(rows_per_s(iter(dsw)))
                theirs.append(rows_per_s(scan.to_batches(filter=expr)))
            n1, s1 = ours[0][0], statistics.median(t for _, t in ours)
            n2, s2 = theirs[0][0], statistics.median(t for _, t in theirs)
            if n1 != n2:
                print(f"WRONG: {name}: ucmagic {n1} rows, pyarrow {n2}", file=sys.stderr)
                return 1
            r1, r2 = n1 / max(s1, 1e-9), n2 / max(s2, 1e-9)
            out.append((f"filtered rows/s, warm, {name}", f"{r1:,.0f}", f"{r2:,.0f}", f"{r1 / r2:.2f}x",
                        ">= 0.8x" + (" ok" if r1 >= 0.8 * r2 else " MISSED")))

        # 3. cold first ds.rows[i]
        rng = np.random.default_rng(1)
        t0 = time.perf_counter()
        dsr = ParquetDataset(url, cache_dir=os.path.join(work, "cache-3"), storage_options=so)
        built = time.perf_counter() - t0
        i = int(rng.integers(rows))
        t0 = time.perf_counter()
        got = int(dsr.rows[i]["id"])
        first = time.perf_counter() - t0
        if got != i:
            print(f"WRONG: rows[{i}] gave id {got}", file=sys.stderr)
            return 1
        out.append(("cold: ParquetDataset() (footers)", f"{built:.3f} s", "-", "-", "-"))
        out.append(("cold: first ds.rows[i]", f"{first:.3f} s", "-", "-", "<= 0.5 s" + (" ok" if first <= 0.5
                                                                                         else " MISSED")))

        # 4. random ds.rows[i] over the warm table
        dsr.rows.cache_groups = a.files * groups
        for k in range(len(dsr.group_rows)):  # warm: every row group cached and decoded once
            dsr.rows[int(sum(dsr.group_rows[:k]))]
        picks = rng.integers(rows, size=nrandom)
        t0 = time.perf_counter()
        for j in picks:
            dsr.rows[int(j)]
        rate = nrandom / (time.perf_counter() - t0)
        out.append(("random ds.rows[i], warm, rows/s", f"{rate:,.0f}", "-", "-",
                    ">= 5,000" + (" ok" if rate >= 5000 else " MISSED")))

        w = [max(len(r[k]) for r in out + [("metric", "ucmagic", "pyarrow", "ratio", "target")]) for k in range(5)]
        print()
        for r in [("metric", "ucmagic", "pyarrow", "ratio", "target")] + out:
            print("  ".join(c.ljust(w[k]) for k, c in enumerate(r)))
        if a.quick:
            print("\n(--quick: a smoke run on a tiny table; the targets are for the full size on a quiet machine)")
        return 0
    finally:
        if a.dir is None:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
