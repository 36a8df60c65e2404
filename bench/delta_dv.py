"""Benchmark: ParquetDataset over a Delta table with deletion vectors vs the same table without them.

    python bench/delta_dv.py                    # 2M rows, 4,000 deleted through an inline vector
    python bench/delta_dv.py --rows 200000 --deleted 400 --repeats 2   # a smoke run

The table (id int64, x float32, 128K-row row groups) is written by deltalake, copied, and the copy
gets a deletion vector written by following the Delta protocol (tests/delta_fixtures.py). Epochs over
both are interleaved; the figures are the median rows/s and CPU ns/row of each and their ratio
(target: the table with vectors within 1.2x of the one without).
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--deleted", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4096)
    a = ap.parse_args()

    import numpy as np
    import pyarrow as pa
    from deltalake import WriterProperties, write_deltalake

    import delta_fixtures as fx
    from ucmagic.tables import ParquetDataset

    root = tempfile.mkdtemp(prefix="ucmagic-bench-dv-")
    try:
        plain, dv = os.path.join(root, "plain"), os.path.join(root, "dv")
        t = pa.table({"id": np.arange(a.rows), "x": np.random.default_rng(0).random(a.rows).astype(np.float32)})
        write_deltalake(plain, t, writer_properties=WriterProperties(max_row_group_size=131072))
        shutil.copytree(plain, dv)
        fx.enable_dv_protocol(dv)
        add = fx.live_adds(dv)[0]["path"]
        n_file = fx.file_rows(dv, add)
        fx.delete_rows(dv, {add: np.random.default_rng(1).choice(n_file, min(a.deleted, n_file), replace=False)},
                       storage="i")
        ds = {k: ParquetDataset(p, batch_size=a.batch_size) for k, p in (("plain", plain), ("dv", dv))}
        rate: dict[str, list[float]] = {"plain": [], "dv": []}
        cpu: dict[str, list[float]] = {"plain": [], "dv": []}
        for _ in range(a.repeats):
            for k in ("plain", "dv"):
                w0, c0 = time.perf_counter(), time.process_time()
                rows = sum(len(b["id"]) for b in ds[k])
                rate[k].append(rows / (time.perf_counter() - w0))
                cpu[k].append((time.process_time() - c0) / rows * 1e9)
        rp, rd = statistics.median(rate["plain"]), statistics.median(rate["dv"])
        cp, cd = statistics.median(cpu["plain"]), statistics.median(cpu["dv"])
        print(f"rows: {ds['plain'].num_rows} without vectors, {ds['dv'].num_rows} with")
        print(f"rows/s: {rp / 1e6:.1f}M without, {rd / 1e6:.1f}M with; ratio {rp / rd:.2f}x")
        print(f"CPU ns/row: {cp:.1f} without, {cd:.1f} with; ratio {cd / cp:.2f}x")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
