"""Random access by row on ParquetDataset (issue 44 item 5): ``ds.rows[i]``, ``ds.rows[i:j]``, ``len(ds.rows)``,
over the filtered rows with ``filter=``, a map-style dataset for torch samplers and ucmagic.DataLoader (exact
resume); a cold ``rows[i]`` on a remote table reads one row group's bytes, not the file."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import toy_backend
from ucmagic import DataLoader
from ucmagic.tables import ParquetDataset


def _write(root, files=3, rows=100, group=30):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(files):
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "s": [f"s{k}" for k in ids],
                                 "x": pa.array([None if k % 9 == 0 else k * 0.5 for k in ids], pa.float64())}),
                       root / f"f{i}.parquet", row_group_size=group)
    return files * rows


@pytest.mark.parametrize("fmt", ["torch", "numpy", "arrow", "pandas"])
def test_rows_index_a_row_and_slice_a_batch_in_every_format(tmp_path, fmt):
    n = _write(tmp_path / "t")
    ds = ParquetDataset(str(tmp_path / "t"), batch_size=7, format=fmt)
    assert len(ds.rows) == n and len(ds) == -(-n // 7)  # len(ds) counts batches
    row = ds.rows[95]
    assert int(row["id"]) == 95 and row["s"] == "s95"
    assert int(ds.rows[-1]["id"]) == n - 1
    batch = ds.rows[25:130]  # across row groups and files
    ids = batch["id"] if fmt != "arrow" else batch.column("id").to_pylist()
    assert [int(v) for v in ids] == list(range(25, 130))
    whole = [b for b in ParquetDataset(str(tmp_path / "t"), batch_size=n, format=fmt)][0]
    if fmt in ("torch", "numpy"):  # the same keys, dtypes and masks as the dataset's batches
        assert list(batch) == list(whole)
        assert all(getattr(batch[k], "dtype", None) == getattr(whole[k], "dtype", None) for k in batch)
        assert not bool(ds.rows[9]["x__valid"]) and bool(ds.rows[10]["x__valid"])
    with pytest.raises(IndexError, match="out of range"):
        ds.rows[n]


@settings(max_examples=10)
@given(lo=st.integers(0, 300), width=st.integers(0, 120), filtered=st.booleans())
def test_rows_slices_equal_the_rows_iteration_delivers_in_order(tmp_path_factory, lo, width, filtered):
    root = tmp_path_factory.mktemp("rows")
    _write(root)
    ds = ParquetDataset(str(root), batch_size=50, filter="id % 3 = 0 OR x IS NULL" if filtered else None)
    order = [int(v) for b in ds for v in b["id"]]
    assert len(ds.rows) == len(order)
    assert [int(v) for v in ds.rows[lo:lo + width]["id"]] == order[lo:lo + width]
    if lo < len(order):
        assert int(ds.rows[lo]["id"]) == order[lo]


def test_rows_is_a_map_style_dataset_for_torch_samplers_and_workers(tmp_path):
    n = _write(tmp_path / "t")
    ds = ParquetDataset(str(tmp_path / "t"), filter="id >= 20")
    loader = torch.utils.data.DataLoader(ds.rows, batch_size=16, shuffle=True, num_workers=2,
                                         multiprocessing_context="fork")
    got = sorted(int(v) for b in loader for v in b["id"])
    assert got == list(range(20, n))


def test_ucmagic_dataloader_over_rows_resumes_exactly(tmp_path):
    n = _write(tmp_path / "t")
    ds = ParquetDataset(str(tmp_path / "t"), filter="x IS NOT NULL")
    want = sorted(int(ds.rows[i]["id"]) for i in range(len(ds.rows)))
    a = DataLoader(ds.rows, batch_size=8, shuffle=True, num_workers=0)
    it = iter(a)
    before = [int(v) for _ in range(5) for v in next(it)["id"]]
    state = json.loads(json.dumps(a.state_dict()))
    b = DataLoader(ParquetDataset(str(tmp_path / "t"), filter="x IS NOT NULL").rows, batch_size=8, shuffle=True,
                   num_workers=0)
    b.load_state_dict(state)
    after = [int(v) for x in b for v in x["id"]]
    assert len(before) == 40 and sorted(before + after) == want and len(want) < n


def test_a_cold_row_of_a_remote_table_reads_one_row_group_range(tmp_path):
    root = tmp_path / "vol"
    root.mkdir()
    rng = np.random.default_rng(1)
    for i in range(4):
        pq.write_table(pa.table({"id": np.arange(i * 50_000, (i + 1) * 50_000), "v": rng.random(50_000)}),
                       root / f"f{i}.parquet", row_group_size=5000, compression="none")
    with toy_backend.registered():
        url = toy_backend.ToyVolume(str(root)).uri
        ds = ParquetDataset(url, cache_dir=str(tmp_path / "c"))
        before = dict(toy_backend.CALLS.get(str(root / "f2.parquet"), {}))
        assert int(ds.rows[123_456]["id"]) == 123_456
        calls = toy_backend.CALLS.get(str(root / "f2.parquet"), {})
        assert calls.get("copy_to", 0) == before.get("copy_to", 0)  # no whole-file copy
        cached = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(tmp_path / "c") for f in fs
                     if not f.endswith((".json", ".lock", ".db")))
        assert cached < 0.05 * sum(os.path.getsize(root / f) for f in os.listdir(root))
    for key in [k for k in toy_backend.CALLS if k.startswith(str(root))]:
        del toy_backend.CALLS[key]


def test_cache_clear_removes_the_row_index_and_the_rows_are_built_again(tmp_path):
    from ucmagic.files.cache_report import cache_command

    _write(tmp_path / "t")
    cache = tmp_path / "c"
    with toy_backend.registered():
        url = toy_backend.ToyVolume(str(tmp_path / "t")).uri
        ds = ParquetDataset(url, filter="id % 4 = 1", cache_dir=str(cache))
        want = [int(v) for v in ds.rows[0:len(ds.rows)]["id"]]
        assert want == list(range(1, 300, 4))
        assert len(os.listdir(cache / "row-index")) == 1  # the filter's row index, kept for the next dataset
        report = cache_command("clear", str(cache))
        assert "1 row index(es)" in report and os.listdir(cache / "row-index") == []
        again = ParquetDataset(url, filter="id % 4 = 1", cache_dir=str(cache))
        assert [int(v) for v in again.rows[0:len(again.rows)]["id"]] == want
        assert len(os.listdir(cache / "row-index")) == 1  # built again
    for key in [k for k in toy_backend.CALLS if k.startswith(str(tmp_path / "t"))]:
        del toy_backend.CALLS[key]
