"""Delta tables exactly as Delta defines them, through every tables entry point.

Tables are built the way real writers build them: deltalake (partitions with null and special-character
values, schema evolution, deletes, time travel, checkpoints, change data), and, for what deltalake 1.6.6
does not write, fixtures that follow the Delta protocol (tests/delta_fixtures.py: deletion vectors inline
and in files, column mapping in name and id modes). Each table's expected rows are deltalake's own reading
(``DeltaTable.scan()``, which applies deletion vectors and column mapping).
"""
from __future__ import annotations

import datetime
import decimal
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import delta_fixtures as fx
from ucmagic import ListingChangedError, UnsupportedTableFeatureError
from ucmagic.tables import ParquetDataset, export_parquet, load_table
from ucmagic.tables.delta import decode_dv, keep_mask, live_counts, live_span, z85_decode

deltalake = pytest.importorskip("deltalake")
DeltaTable, write_deltalake = deltalake.DeltaTable, deltalake.write_deltalake


# ---------------------------------------------------------------- helpers

def delta_rows(path, version=None):
    """Rows deltalake's engine defines for the table (sorted by every column, as Python values)."""
    t = pa.table(pa.RecordBatchReader.from_stream(DeltaTable(path, version=version).scan()))
    return _sorted(t.to_pylist())


def _sorted(rows):
    return sorted(rows, key=lambda r: [(v is None, str(v)) for v in r.values()])


def _norm(v):
    """One spelling for values pandas (load_table) and Arrow write differently: dates as datetimes,
    decimals as floats, maps as dicts, aware datetimes in UTC, NaN/NaT as None."""
    if v is not None and type(v).__name__ in ("NaTType", "NAType"):
        return None
    if isinstance(v, datetime.datetime):
        return v.astimezone(datetime.timezone.utc).replace(tzinfo=None) if v.tzinfo else v
    if isinstance(v, datetime.date):
        return datetime.datetime(v.year, v.month, v.day)
    if isinstance(v, decimal.Decimal):
        return float(v)
    if isinstance(v, float) and v != v:
        return None
    if isinstance(v, list) and v and all(isinstance(x, tuple) and len(x) == 2 for x in v):
        return {k: _norm(x) for k, x in v}
    if isinstance(v, dict):
        return {k: _norm(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_norm(x) for x in v]
    if hasattr(v, "to_pydatetime"):  # pandas Timestamp
        return _norm(v.to_pydatetime())
    if isinstance(v, np.generic):
        return v.item()
    return v


def _norm_rows(rows):
    return _sorted([{k: _norm(v) for k, v in r.items()} for r in rows])


def ds_rows(ds):
    """Every row a ParquetDataset yields (format="arrow"), as Python values."""
    parts = list(ds)
    if not parts:
        return []
    return pa.concat_tables(parts).to_pylist()


def hf_rows(files):
    datasets = pytest.importorskip("datasets")
    d = datasets.load_dataset("parquet", data_files=list(files), split="train")
    return d.to_list()


def base_table(n=200, seed=0):
    rng = np.random.default_rng(seed)
    return pa.table({"id": pa.array(np.arange(n), pa.int64()), "x": pa.array(rng.random(n)),
                     "s": pa.array([f"row-{i}" for i in range(n)])})


def check_all_entry_points(path, tmp_path, *, version=None, key="id", hf=True):
    """ParquetDataset (torch and arrow), load_table, export_parquet (read back with Hugging Face datasets,
    or pyarrow with ``hf=False`` for types datasets has no dtype for, e.g. maps) all give deltalake's rows."""
    want = delta_rows(path, version)
    got = ds_rows(ParquetDataset(path, version=version, format="arrow", batch_size=7))
    assert _sorted(got) == want
    df = load_table(path, version=version)  # pandas: DuckDB's spelling of dates, decimals and maps
    assert _norm_rows(df.to_dict("records")) == _norm_rows(want)
    out = tmp_path / f"export-{os.path.basename(path)}-{version}"
    res = export_parquet(path, out, version=version)
    assert res.rows == len(want)
    if not res.files:
        assert want == []
    elif hf:
        assert _sorted(hf_rows(res.files)) == want
    else:
        assert _sorted(pa.concat_tables([pq.read_table(f) for f in res.files]).to_pylist()) == want
    tds = ParquetDataset(path, version=version, batch_size=16, columns=[key])
    ids = torch.cat([b[key] for b in tds]).tolist() if len(want) else []
    assert sorted(ids) == sorted(r[key] for r in want)
    return want


# ---------------------------------------------------------------- pure: deletion vector format

@settings(max_examples=60, deadline=None)
@given(st.sets(st.integers(0, 300_000), max_size=400), st.booleans())
def test_deletion_vector_bitmaps_decode_to_the_rows_written(rows, runs):
    data = fx.serialize_dv(rows, runs=runs)
    assert decode_dv(data).tolist() == sorted(rows)


def test_deletion_vector_bitset_and_run_containers_and_high_buckets_decode():
    dense = set(range(0, 60_000, 3))  # > 4096 in one container: a bitset
    runs = set(range(70_000, 90_000))  # long runs
    high = {(1 << 32) + 5, (2 << 32) + 7}  # other 32-bit buckets
    for r in (False, True):
        assert decode_dv(fx.serialize_dv(dense | runs | high, runs=r)).tolist() == sorted(dense | runs | high)


def test_a_bitmap_without_the_magic_number_is_refused():
    with pytest.raises(ValueError, match="magic number"):
        decode_dv(b"\0" * 16)


def test_z85_round_trips_with_delta_padding():
    data = bytes(range(7))
    assert z85_decode(fx.z85_encode(data), len(data)) == data


def test_keep_mask_and_live_counts_follow_the_deleted_rows():
    deleted = np.array([0, 5, 6, 19], dtype=np.int64)
    assert live_counts(deleted, [5, 10, 5]) == [4, 8, 4]
    assert keep_mask(deleted, 5, 10).tolist() == [False, False, True, True, True]
    assert keep_mask(deleted, 7, 19) is None


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 300), st.data())
def test_live_span_finds_the_stored_rows_of_live_positions(n, data):
    dels = np.array(sorted(data.draw(st.sets(st.integers(0, n - 1), max_size=n - 1))), dtype=np.int64)
    live = np.setdiff1d(np.arange(n), dels)
    k0 = data.draw(st.integers(0, len(live) - 1))
    k1 = data.draw(st.integers(k0 + 1, len(live)))
    first, stop, mask = live_span(dels, k0, k1)
    rows = np.arange(first, stop) if mask is None else np.arange(first, stop)[mask]
    assert rows.tolist() == live[k0:k1].tolist()


# ---------------------------------------------------------------- deletion vectors

@pytest.mark.parametrize("storage", ["i", "u", "p"])
def test_rows_deleted_through_deletion_vectors_never_come_back(tmp_path, storage):
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(300).slice(0, 150))
    write_deltalake(path, base_table(300).slice(150), mode="append")
    fx.enable_dv_protocol(path)
    adds = fx.live_adds(path)
    fx.delete_rows(path, {adds[0]["path"]: [0, 3, 4, 149], adds[1]["path"]: range(10, 40)}, storage=storage)
    # deltalake's own reader decodes the fixture's vectors to the same rows
    sv = pa.table(DeltaTable(path).deletion_vectors())
    assert sorted(sum(1 for k in v if not k) for v in sv.column("selection_vector").to_pylist()) == [4, 30]
    want = check_all_entry_points(path, tmp_path)
    assert len(want) == 300 - 34
    assert {0, 3, 4, 149, 160, 189}.isdisjoint(r["id"] for r in want)


def test_a_second_delete_extends_the_vector_and_time_travel_sees_each_version(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(100))
    fx.enable_dv_protocol(path)
    add = fx.live_adds(path)[0]["path"]
    v1 = fx.delete_rows(path, {add: [1, 2]}, storage="i")
    v2 = fx.delete_rows(path, {add: range(50, 100)}, storage="u", runs=True)
    for v, n in ((0, 100), (v1, 98), (v2, 48)):
        assert len(check_all_entry_points(path, tmp_path, version=v)) == n


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, "global"])
def test_every_live_row_once_per_epoch_over_ranks_and_workers_with_deletion_vectors(tmp_path, workers, shuffle):
    path = str(tmp_path / "t")
    for k in range(3):
        pq_t = base_table(600).slice(200 * k, 200)
        write_deltalake(path, pq_t, mode="append" if k else "error",
                        writer_properties=deltalake.WriterProperties(max_row_group_size=64))
    fx.enable_dv_protocol(path)
    adds = fx.live_adds(path)
    deleted_idx = {adds[0]["path"]: range(0, 200, 2), adds[2]["path"]: range(60, 130)}
    fx.delete_rows(path, deleted_idx, storage="u")
    want = sorted(r["id"] for r in delta_rows(path))
    ds = ParquetDataset(path, columns=["id", "s"], batch_size=10, partition="drop", shuffle=shuffle, seed=3)
    assert ds.num_rows == len(want) == 600 - 100 - 70
    dv_files = [f for f in ds.files if f.stored_rows is not None]  # row-group counts after the vector
    assert len(dv_files) == 2 and all(len(f.group_rows) > 1 for f in dv_files)
    # ranks x workers streams of one epoch: disjoint, together every live row once
    got = []
    for rank in range(2):
        for w in range(2):
            for b in ds.iter_stream(0, rank, 2, w, 2):
                assert b["s"] == [f"row-{i}" for i in b["id"].tolist()]  # columns stay aligned
                got += b["id"].tolist()
    assert len(got) == len(set(got)) and set(got) <= set(want) and len(want) - len(got) < 2 * 2 * 10
    full = ParquetDataset(path, columns=["id"], batch_size=10, shuffle=shuffle, seed=3)
    loader = torch.utils.data.DataLoader(full, batch_size=None, num_workers=workers)
    ids = [int(i) for b in loader for i in b["id"]]
    if workers:
        assert sorted(set(ids)) == want
    else:
        assert sorted(ids) == want


@pytest.mark.timeout(300)
@settings(max_examples=12, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 120), st.integers(5, 50)), min_size=1, max_size=3), st.data())
def test_any_table_with_deletion_vectors_yields_deltas_rows_on_any_layout(tmp_path_factory, files, data):
    """Random files (rows, row-group size), random deletes in any storage, random order and layout:
    the streams of an epoch together hold each live row once (plus "pad" repeats), as deltalake reads them."""
    path = str(tmp_path_factory.mktemp("t") / "t")
    start = 0
    for k, (rows, rg) in enumerate(files):
        write_deltalake(path, base_table(start + rows).slice(start, rows), mode="append" if k else "error",
                        writer_properties=deltalake.WriterProperties(max_row_group_size=rg))
        start += rows
    fx.enable_dv_protocol(path)
    adds = fx.live_adds(path)
    for _ in range(data.draw(st.integers(1, 2))):  # one or two DELETEs
        # indices, not paths: file names are random UUIDs, and hypothesis replays need the same choices
        pick = [adds[i]["path"] for i in sorted(data.draw(st.sets(st.integers(0, len(adds) - 1), min_size=1)))]
        deleted = {p: data.draw(st.sets(st.integers(0, fx.file_rows(path, p) - 1), max_size=40)) for p in pick}
        storage = data.draw(st.sampled_from(["i", "u", "p"]))
        fx.delete_rows(path, deleted, storage=storage, runs=data.draw(st.booleans()))
    want = sorted(r["id"] for r in delta_rows(path))
    shuffle = data.draw(st.sampled_from([False, "global"]))
    partition = data.draw(st.sampled_from(["pad", "drop"]))
    world, workers = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2))
    ds = ParquetDataset(path, columns=["id", "s"], batch_size=data.draw(st.integers(1, 16)), shuffle=shuffle,
                        partition=partition, seed=data.draw(st.integers(0, 9)))
    assert ds.num_rows == len(want)
    got = []
    for r in range(world):
        for w in range(workers):
            for b in ds.iter_stream(0, r, world, w, workers):
                assert b["s"] == [f"row-{i}" for i in b["id"].tolist()]
                got += b["id"].tolist()
    if partition == "pad":
        assert sorted(set(got)) == want and len(got) - len(want) < world
    else:
        assert len(got) == len(set(got)) and set(got) <= set(want) and len(want) - len(got) < world


@pytest.mark.parametrize("shuffle", [False, "global"])
def test_elastic_resume_on_a_table_with_deletion_vectors_delivers_each_live_row_once(tmp_path, shuffle):
    import pickle

    path = str(tmp_path / "t")
    write_deltalake(path, base_table(900), writer_properties=deltalake.WriterProperties(max_row_group_size=100))
    fx.enable_dv_protocol(path)
    add = fx.live_adds(path)[0]["path"]
    fx.delete_rows(path, {add: range(0, 900, 3)}, storage="u", runs=True)
    want = sorted(r["id"] for r in delta_rows(path))
    ds = ParquetDataset(path, columns=["id"], batch_size=10, partition="drop", shuffle=shuffle, seed=1)
    assert ds.num_rows == 600
    # what workers receive holds deletion-vector descriptors, not masks: its size does not grow with them
    assert len(pickle.dumps(ds)) < 64 << 10
    lengths = ds.stream_lengths(2, 2)
    delivered = [n // 3 // 10 * 10 for n in lengths]
    done = []  # stream s = (rank s // 2, worker s % 2) received its first delivered[s] rows
    for s, d in enumerate(delivered):
        done.append([int(i) for b in ds.iter_stream(0, s // 2, 2, s % 2, 2) for i in b["id"]][:d])
    state = ds.make_state(0, delivered, world=2, num_workers=2)
    again = ParquetDataset(path, columns=["id"], batch_size=7, partition="drop", shuffle=shuffle, seed=1)
    again.load_state_dict(state)
    rest = [[int(i) for b in again.iter_stream(0, r, 3, 0, 1) for i in b["id"]] for r in range(3)]
    got = [i for part in done + rest for i in part]
    assert len(got) == len(set(got)) and set(got) <= set(want)
    assert len(want) - len(got) < 3 + 2 * 2 * 10  # only "drop" remainders are left out


def test_resume_after_a_delete_that_only_adds_a_deletion_vector_is_a_changed_listing(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(100))
    fx.enable_dv_protocol(path)
    ds = ParquetDataset(path, columns=["id"], batch_size=10)
    it = iter(ds)
    first = [next(it) for _ in range(3)]
    state = ds.state_dict()
    same = ParquetDataset(path, columns=["id"], batch_size=10)
    same.load_state_dict(state)
    rest = [int(i) for b in same for i in b["id"]]
    assert sorted([int(i) for b in first for i in b["id"]] + rest) == list(range(100))
    fx.delete_rows(path, {fx.live_adds(path)[0]["path"]: [99]}, storage="i")  # same files, same sizes
    changed = ParquetDataset(path, columns=["id"], batch_size=10)
    with pytest.raises(ListingChangedError):
        changed.load_state_dict(state)


def test_a_corrupt_deletion_vector_file_is_an_error_not_different_rows(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(50))
    fx.enable_dv_protocol(path)
    fx.delete_rows(path, {fx.live_adds(path)[0]["path"]: [1, 2]}, storage="u", prefix="")
    dv = next(p for p in os.listdir(path) if p.startswith("deletion_vector_"))
    with open(os.path.join(path, dv), "r+b") as f:
        f.seek(12)
        f.write(b"\xff")
    with pytest.raises(UnsupportedTableFeatureError, match="CRC-32"):
        ParquetDataset(path)


# ---------------------------------------------------------------- column mapping

@pytest.mark.parametrize("mode", ["name", "id"])
def test_column_mapping_yields_logical_names_and_values(tmp_path, mode):
    path = str(tmp_path / "t")
    data = pa.table({"Super Name": pa.array(range(40), pa.int64()), "q": ["u", "v"] * 20,
                     "when": pa.array([datetime.date(2024, 1, 1 + i % 28) for i in range(40)]),
                     "nested": pa.array([{"inner a": i, "b": f"b{i}"} if i % 5 else None for i in range(40)])})
    phys = fx.write_column_mapped(path, data, mode=mode, partition_by=["q"])
    assert all(p.startswith("col-") for p in phys.values())
    fx.enable_dv_protocol(path)  # and a deletion vector on a mapped table
    fx.delete_rows(path, {fx.live_adds(path)[0]["path"]: [0]}, storage="i")
    want = check_all_entry_points(path, tmp_path, key="Super Name")
    assert len(want) == 39 and set(want[0]) == {"Super Name", "q", "when", "nested"}
    b = next(iter(ParquetDataset(path, batch_size=100)))
    assert set(b) == {"Super Name", "q", "when", "nested"} and b["Super Name"].dtype == torch.int64
    assert {"inner a": 1, "b": "b1"} in b["nested"] and None in b["nested"]  # nested fields by logical name


def test_id_mode_column_mapping_resolves_columns_by_parquet_field_id(tmp_path):
    """In ``id`` mode a file's column is the one with the field's id, whatever the file calls it (files
    rewritten here under other names, as converters from Iceberg leave them)."""
    path = str(tmp_path / "t")
    fx.write_column_mapped(path, pa.table({"a": pa.array([1, 2, 3, 4], pa.int64()), "b": ["w", "x", "y", "z"]}),
                           mode="id", files=2)
    for add in fx.live_adds(path):
        f = os.path.join(path, add["path"])
        t = pq.read_table(f)
        fields = [pa.field(f"renamed-{i}", fld.type, metadata=fld.metadata) for i, fld in enumerate(t.schema)]
        pq.write_table(pa.Table.from_arrays(t.columns, schema=pa.schema(fields)), f)
    got = sorted(ds_rows(ParquetDataset(path, format="arrow")), key=lambda r: r["a"])
    assert got == [{"a": 1, "b": "w"}, {"a": 2, "b": "x"}, {"a": 3, "b": "y"}, {"a": 4, "b": "z"}]
    assert sorted(load_table(path)["b"]) == ["w", "x", "y", "z"]


# ---------------------------------------------------------------- deltalake-written shapes

def test_partition_columns_with_null_and_special_values_are_present_and_typed(tmp_path):
    path = str(tmp_path / "t")
    t = pa.table({"id": pa.array(range(12), pa.int64()),
                  "p": ["a b", "x/y%z", None, "é=1", "a b", None] * 2,
                  "d": pa.array([datetime.date(2020, 1, 1), None] * 6),
                  "n": pa.array([1, 2, None] * 4, pa.int32())})
    write_deltalake(path, t, partition_by=["p", "d", "n"])
    want = check_all_entry_points(path, tmp_path)
    assert {r["p"] for r in want} == {"a b", "x/y%z", None, "é=1"}
    ds = ParquetDataset(path, batch_size=100, format="numpy")
    b = next(iter(ds))
    assert b["d"].dtype == np.dtype("datetime64[D]") and b["n"].dtype == np.int32  # the column's type, nulls or not
    assert int(b["n__valid"].sum()) == 8  # 12 rows, every third null
    assert ParquetDataset(path).schema.field("n").type == pa.int32()


def test_partition_values_of_every_type_keep_their_type(tmp_path):
    path = str(tmp_path / "t")
    t = pa.table({"id": pa.array([1, 2, 3], pa.int64()),
                  "ts": pa.array([datetime.datetime(2020, 1, 1, 1, 2, 3), None, datetime.datetime(2021, 5, 6)],
                                 pa.timestamp("us", "UTC")),
                  "b": [True, False, None], "f": [1.5, None, 2.0],
                  "dec": pa.array([decimal.Decimal("1.50"), None, decimal.Decimal("2.25")], pa.decimal128(6, 2))})
    write_deltalake(path, t, partition_by=["ts", "b", "dec", "f"])
    want = check_all_entry_points(path, tmp_path)
    assert [r["dec"] for r in sorted(want, key=lambda r: r["id"])] == [decimal.Decimal("1.50"), None,
                                                                         decimal.Decimal("2.25")]
    assert ParquetDataset(path).schema.field("ts").type == pa.timestamp("us", "UTC")


def test_columns_added_later_are_null_in_older_files(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1, 2], pa.int64())}))
    write_deltalake(path, pa.table({"id": pa.array([3], pa.int64()), "extra": ["e"]}), mode="append",
                    schema_mode="merge")
    want = check_all_entry_points(path, tmp_path)
    assert sorted((r["id"], r["extra"]) for r in want) == [(1, None), (2, None), (3, "e")]


def test_deletes_updates_checkpoints_and_change_data_give_the_snapshot(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(60), configuration={"delta.enableChangeDataFeed": "true"})
    dt = DeltaTable(path)
    dt.update(updates={"x": "x + 100"}, predicate="id < 5")
    DeltaTable(path).delete("id >= 50")
    DeltaTable(path).create_checkpoint()
    write_deltalake(path, base_table(70).slice(60), mode="append")
    assert os.path.isdir(os.path.join(path, "_change_data"))
    want = check_all_entry_points(path, tmp_path)
    assert len(want) == 60 and "_change_type" not in want[0]
    assert [r["id"] for r in want if r["x"] > 100] == [0, 1, 2, 3, 4]
    assert len(check_all_entry_points(path, tmp_path, version=0)) == 60


def test_every_arrow_type_yields_something_usable(tmp_path):
    path = str(tmp_path / "t")
    n = 6
    t = pa.table({
        "i8": pa.array(range(n), pa.int8()), "f": pa.array(np.linspace(0, 1, n), pa.float32()),
        "b": pa.array([True, False] * 3), "s": [f"s{i}" for i in range(n)],
        "bin": pa.array([b"\x00\x01"] * n, pa.binary()),
        "d": pa.array([datetime.date(2024, 1, 1 + i) for i in range(n)]),
        "ts": pa.array([datetime.datetime(2024, 1, 1, i, tzinfo=datetime.timezone.utc) for i in range(n - 1)]
                       + [datetime.datetime(3000, 1, 1, tzinfo=datetime.timezone.utc)], pa.timestamp("us", "UTC")),
        "ntz": pa.array([datetime.datetime(1500, 1, 1)] * n, pa.timestamp("us")),
        "dec": pa.array([decimal.Decimal("1.25")] * n, pa.decimal128(10, 2)),
        "st": pa.array([{"a": i, "b": "x"} for i in range(n)]),
        "l": pa.array([[i, i + 1] for i in range(n)]),
        "m": pa.array([[("k", i)] for i in range(n)], pa.map_(pa.string(), pa.int64())),
    })
    write_deltalake(path, t)
    check_all_entry_points(path, tmp_path, key="i8", hf=False)  # datasets has no dtype for maps
    assert len(hf_rows(export_parquet(t.drop_columns(["m"]), tmp_path / "hf").files)) == n
    b = next(iter(ParquetDataset(path, batch_size=n)))
    assert b["i8"].dtype == torch.int8 and b["b"].dtype == torch.bool and b["f"].dtype == torch.float32
    days = (datetime.date(2024, 1, 1) - datetime.date(1970, 1, 1)).days
    assert b["d"].dtype == torch.int64 and b["d"][0].item() == days  # days since the epoch
    assert b["ts"][-1].item() == int(datetime.datetime(3000, 1, 1, tzinfo=datetime.timezone.utc).timestamp()) * 10**6
    assert b["dec"].dtype == torch.float64 and b["dec"][0].item() == 1.25
    assert b["s"][0] == "s0" and b["bin"][0] == b"\x00\x01"
    assert b["st"][1] == {"a": 1, "b": "x"} and b["l"][1] == [1, 2] and b["m"][1] == [("k", 1)]
    nb = next(iter(ParquetDataset(path, batch_size=n, format="numpy")))
    assert nb["ts"].dtype == np.dtype("datetime64[us]") and nb["s"].dtype == object
    pdf = next(iter(ParquetDataset(path, batch_size=n, format="pandas")))
    assert list(pdf.columns) == t.column_names and len(pdf) == n
    at = next(iter(ParquetDataset(path, batch_size=4, format="arrow")))
    assert isinstance(at, pa.Table) and at.num_rows == 4


def test_columns_with_nulls_and_other_parquet_types_yield_something_usable(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    t = pa.table({
        "bn": pa.array([True, None, False]), "inull": pa.array([1, None, 3]), "u64": pa.array([1, 2, 3], pa.uint64()),
        "f16": pa.array([1, 2, 3], pa.float16()), "fsl": pa.array([[1, 2], [3, 4], [5, 6]], pa.list_(pa.int32(), 2)),
        "ll": pa.array([[1], [2], None], pa.large_list(pa.int64())), "nul": pa.nulls(3),
        "dic": pa.array(["a", "b", "a"]).dictionary_encode(), "t64": pa.array([1, 2, 3], pa.time64("us")),
        "dur": pa.array([1, 2, 3], pa.duration("ms")), "bin": pa.array([b"a", None, b"c"], pa.large_binary()),
        "dec": pa.array([decimal.Decimal("1.5"), None, decimal.Decimal("2")], pa.decimal128(5, 1)),
    })
    pq.write_table(t, d / "a.parquet")
    b = next(iter(ParquetDataset(str(d))))
    assert b["bn"].dtype == torch.bool and b["bn"].tolist() == [True, False, False]  # a null reads as False ...
    assert b["bn__valid"].tolist() == [True, False, True]  # ... and its mask says so
    assert b["inull"].dtype == torch.int64 and not b["inull__valid"][1] and b["inull"][2].item() == 3
    assert b["u64"].tolist() == [1, 2, 3] and b["f16"].dtype == torch.float16
    assert b["fsl"] == [[1, 2], [3, 4], [5, 6]] and b["ll"][2] is None and b["nul"] == [None] * 3
    assert b["dic"] == ["a", "b", "a"] and b["t64"].tolist() == [1, 2, 3] and b["dur"].tolist() == [1, 2, 3]
    assert b["bin"] == [b"a", None, b"c"] and b["dec"][0].item() == 1.5
    for fmt in ("numpy", "arrow", "pandas"):
        assert len(next(iter(ParquetDataset(str(d), format=fmt)))["bn"]) == 3


def test_an_empty_table_gives_zero_batches(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(0))
    ds = ParquetDataset(path)
    assert ds.num_rows == 0 and list(ds) == [] and len(ds) == 0
    assert len(load_table(path)) == 0
    assert export_parquet(path, tmp_path / "out").rows == 0


def test_string_and_large_string_files_unify(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    pq.write_table(pa.table({"s": pa.array(["a", "b"], pa.string())}), d / "a.parquet")
    pq.write_table(pa.table({"s": pa.array(["c"], pa.large_string())}), d / "b.parquet")
    assert [s for b in ParquetDataset(str(d)) for s in b["s"]] == ["a", "b", "c"]


# ---------------------------------------------------------------- features

def _add_features(path, reader=(), writer=()):
    fx.commit(path, [{"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": list(reader),
                                   "writerFeatures": list({*reader, *writer})}}], "SET TBLPROPERTIES")


def test_liquid_clustering_and_timestamp_ntz_read_as_the_table(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1, 2], pa.int64()),
                                    "ntz": pa.array([datetime.datetime(2020, 1, 1)] * 2, pa.timestamp("us"))}))
    _add_features(path, reader=["timestampNtz"], writer=["clustering", "domainMetadata"])
    fx.commit(path, [{"domainMetadata": {"domain": "delta.clustering", "configuration":
                                         '{"clusteringColumns":[["id"]]}', "removed": False}}], "CLUSTER BY")
    check_all_entry_points(path, tmp_path)


def test_a_table_deltalake_creates_with_deletion_vectors_enabled_reads(tmp_path):
    """deltalake lists variantType and deletionVectors as reader features of such a table (no variant
    column): both are honoured, and its DELETE (which rewrites files) is read as the snapshot."""
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(50), configuration={"delta.enableDeletionVectors": "true"})
    assert "variantType" in DeltaTable(path).protocol().reader_features
    DeltaTable(path).delete("id < 10")
    assert len(check_all_entry_points(path, tmp_path)) == 40


def test_type_widening_reads_older_files_as_the_wider_type(tmp_path):
    """typeWidening (int -> long, as Databricks' ALTER COLUMN TYPE writes it); deltalake's own scan refuses
    the feature, so the expected rows are the values written."""
    import json

    path = str(tmp_path / "t")
    write_deltalake(path, pa.table({"id": pa.array([1, 2], pa.int32())}))
    meta = next(a["metaData"] for a in fx.read_actions(path, 0) if "metaData" in a)
    schema = json.loads(meta["schemaString"])
    schema["fields"][0].update(type="long", metadata={"delta.typeChanges": [{"fromType": "integer", "toType": "long"}]})
    meta["schemaString"] = json.dumps(schema)
    _add_features(path, reader=["typeWidening"])
    fx.commit(path, [{"metaData": meta}], "ALTER TABLE")
    b = next(iter(ParquetDataset(path)))
    assert b["id"].dtype == torch.int64 and b["id"].tolist() == [1, 2]
    assert load_table(path)["id"].tolist() == [1, 2]
    assert pq.read_table(export_parquet(path, tmp_path / "o").files[0]).schema.field("id").type == pa.int64()


def test_a_reader_feature_ucmagic_cannot_honour_is_a_clear_error(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(5))
    _add_features(path, reader=["someFutureFeature"])
    for fn in (ParquetDataset, load_table, lambda p: export_parquet(p, tmp_path / "o")):
        with pytest.raises(UnsupportedTableFeatureError, match="someFutureFeature"):
            fn(path)


def v2_checkpoint_table(path: str) -> None:
    """30 rows in three commits, 2 deleted by a deletion vector, a JSON v2 checkpoint with a Parquet
    sidecar, one commit after it, and the JSON commits before the checkpoint removed (28 rows live)."""
    write_deltalake(path, base_table(30).slice(0, 10))
    write_deltalake(path, base_table(30).slice(10, 10), mode="append")
    fx.enable_dv_protocol(path)
    fx.delete_rows(path, {fx.live_adds(path)[0]["path"]: [0, 1]}, storage="i")
    fx.write_v2_checkpoint(path)
    write_deltalake(path, base_table(30).slice(20, 10), mode="append")
    for v in range(fx.last_version(path) - 1):  # the json commits before the checkpoint are gone
        os.unlink(fx.log_path(path, v))


def test_v2_checkpoint_with_sidecars_reads_the_snapshot(tmp_path):
    path = str(tmp_path / "t")
    v2_checkpoint_table(path)
    want = check_all_entry_points(path, tmp_path)
    assert len(want) == 28


def test_a_multi_part_checkpoint_reads_the_snapshot(tmp_path):
    path = str(tmp_path / "t")
    for k in range(4):
        write_deltalake(path, base_table(40).slice(10 * k, 10), mode="append" if k else "error")
    fx.enable_dv_protocol(path)
    fx.delete_rows(path, {fx.live_adds(path)[1]["path"]: [3]}, storage="i")
    DeltaTable(path).create_checkpoint()
    fx.split_checkpoint(path, parts=3)
    write_deltalake(path, base_table(50).slice(40), mode="append")
    for v in range(fx.last_version(path) - 1):
        os.unlink(fx.log_path(path, v))
    assert len(check_all_entry_points(path, tmp_path)) == 49


@pytest.mark.timeout(300)
def test_the_cli_export_and_ucmagic_load_read_the_snapshot(tmp_path):
    path = str(tmp_path / "t")
    write_deltalake(path, base_table(40))
    fx.enable_dv_protocol(path)
    fx.delete_rows(path, {fx.live_adds(path)[0]["path"]: range(10)}, storage="u")
    out = tmp_path / "cli"
    subprocess.run([sys.executable, "-m", "ucmagic", "export", path, str(out)], check=True, timeout=240,
                   capture_output=True)
    files = sorted(str(p) for p in out.rglob("*.parquet"))
    assert _sorted(hf_rows(files)) == delta_rows(path)
    import ucmagic

    assert len(ucmagic.load(path)) == 30
    assert ucmagic.describe_load(path).rows == 30  # what `python -m ucmagic load` and %ucload report
    loader = ucmagic.load(path, stream=True, batch_size=8, num_workers=0)
    assert sorted(int(i) for b in loader for i in b["id"]) == list(range(10, 40))


# ---------------------------------------------------------------- Spark-written files

@pytest.mark.spark
@pytest.mark.timeout(300)
def test_spark_int96_timestamps_beyond_the_nanosecond_range_read_everywhere(tmp_path):
    """Spark writes INT96 timestamps (years 1500 and 3000); deltalake converts the directory to a Delta
    table (convert_to_deltalake); every entry point reads the years as written."""
    import shutil

    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        pytest.skip("Java is not installed (needed by pyspark)")
    pytest.importorskip("pyspark")
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[1]").appName("ucmagic-delta-int96")
             .config("spark.ui.enabled", "false").config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.parquet.outputTimestampType", "INT96")
             .config("spark.sql.parquet.int96RebaseModeInWrite", "CORRECTED").getOrCreate())
    path = str(tmp_path / "spark_int96")
    try:
        spark.sql("SELECT id, CASE WHEN id % 3 = 0 THEN timestamp'3000-01-01 00:00:00' "
                  "WHEN id % 3 = 1 THEN timestamp'1500-06-01 12:00:00' ELSE timestamp'2024-01-01 00:00:00' END AS ts, "
                  "cast(id AS string) AS s FROM range(30)").repartition(2).write.parquet(path)
    finally:
        spark.stop()
    assert any(str(pq.ParquetFile(os.path.join(path, f)).schema.column(1).physical_type) == "INT96"
               for f in os.listdir(path) if f.endswith(".parquet"))
    deltalake.convert_to_deltalake(path)
    # the years as written (deltalake's own scan reads INT96 as nanoseconds here and wraps 3000 to 1830)
    want = [{"id": i, "ts": datetime.datetime(3000, 1, 1) if i % 3 == 0 else datetime.datetime(1500, 6, 1, 12)
             if i % 3 == 1 else datetime.datetime(2024, 1, 1), "s": str(i)} for i in range(30)]
    assert _sorted(ds_rows(ParquetDataset(path, format="arrow"))) == _sorted(want)
    assert _norm_rows(load_table(path).to_dict("records")) == _norm_rows(want)
    res = export_parquet(path, tmp_path / "out")
    assert _sorted(pa.concat_tables([pq.read_table(f) for f in res.files]).to_pylist()) == _sorted(want)
    ts = torch.cat([b["ts"] for b in ParquetDataset(path, columns=["ts"])])
    us_3000 = int((datetime.datetime(3000, 1, 1) - datetime.datetime(1970, 1, 1)).total_seconds()) * 10**6
    assert ts.max().item() == us_3000  # microseconds since the epoch


# ---------------------------------------------------------------- Spark-written tables (need delta-spark jars)

def _delta_spark_jars():
    """delta-spark + delta-storage jars: $UCMAGIC_DELTA_SPARK_JARS (a directory) or pyspark's jars folder."""
    import glob

    dirs = [os.environ.get("UCMAGIC_DELTA_SPARK_JARS", "")]
    try:
        import pyspark

        dirs.append(os.path.join(os.path.dirname(pyspark.__file__), "jars"))
    except ImportError:
        return []
    for d in dirs:
        jars = sorted(glob.glob(os.path.join(d, "delta-spark*.jar")) + glob.glob(os.path.join(d, "delta-storage*.jar")))
        if d and len(jars) >= 2:
            return jars
    return []


@pytest.mark.spark
@pytest.mark.timeout(600)
def test_tables_spark_writes_with_deletion_vectors_column_mapping_and_cdf(tmp_path):
    jars = _delta_spark_jars()
    if not jars:
        pytest.skip("Spark-written Delta tables need the delta-spark and delta-storage jars (Maven Central is not "
                    "reachable here): put them in $UCMAGIC_DELTA_SPARK_JARS")
    from pyspark.sql import SparkSession

    spark = (SparkSession.builder.master("local[2]").config("spark.jars", ",".join(jars))
             .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
             .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
             .config("spark.ui.enabled", "false").getOrCreate())
    try:
        path = str(tmp_path / "spark_t")
        spark.range(0, 1000).selectExpr("id", "id % 7 as `Super Name`", "cast(id % 3 as string) as p") \
            .write.format("delta").partitionBy("p").option("delta.enableDeletionVectors", "true") \
            .option("delta.columnMapping.mode", "name").option("delta.enableChangeDataFeed", "true").save(path)
        spark.sql(f"DELETE FROM delta.`{path}` WHERE id % 10 = 0")
        spark.sql(f"UPDATE delta.`{path}` SET `Super Name` = -1 WHERE id < 50")
        want = sorted(tuple(r) for r in spark.read.format("delta").load(path).select("id", "Super Name", "p").collect())
    finally:
        spark.stop()
    got = ds_rows(ParquetDataset(path, format="arrow", columns=["id", "Super Name", "p"]))
    assert sorted((r["id"], r["Super Name"], r["p"]) for r in got) == want
    df = load_table(path, columns=["id", "Super Name", "p"])
    assert sorted(map(tuple, df.itertuples(index=False))) == want


# ---------------------------------------------------------------- a table on object storage

# s3_env (tests/conftest.py): the session's moto S3 server on loopback, credentials and endpoint in the
# environment, where both deltalake and s3fs read them.

def test_a_table_on_s3_with_deletion_vectors_reads_its_snapshot(tmp_path, s3_env):
    import s3fs

    path = str(tmp_path / "t")
    write_deltalake(path, base_table(80), partition_by=None)
    fx.enable_dv_protocol(path)
    add = fx.live_adds(path)[0]["path"]
    fx.delete_rows(path, {add: [0, 1]}, storage="i")
    fx.delete_rows(path, {add: range(40, 50)}, storage="u")  # a DV file with a random-prefix directory
    fs = s3fs.S3FileSystem()
    fs.mkdir("tables")
    fs.put(path, "tables/t", recursive=True)
    want = delta_rows(path)
    ds = ParquetDataset("s3://tables/t", format="arrow", cache_dir=str(tmp_path / "cache"))
    assert ds.use_cache and _sorted(ds_rows(ds)) == want and len(want) == 68
    assert _norm_rows(load_table("s3://tables/t").to_dict("records")) == _norm_rows(want)


def test_ucload_of_a_catalog_delta_table_reads_its_snapshot(tmp_path, magic_shell, monkeypatch):
    """%ucload of a table name (the local catalog) as a DataFrame and as a stream: deleted rows stay
    deleted, mapped columns keep their logical names, partition columns are present."""
    monkeypatch.setenv("UCMAGIC_PROGRESS", "off")
    path = str(tmp_path / "catalog" / "main" / "ml" / "mapped")
    data = pa.table({"Super Name": pa.array(range(30), pa.int64()), "q": ["u", "v", "w"] * 10})
    fx.write_column_mapped(path, data, partition_by=["q"])
    fx.enable_dv_protocol(path)
    fx.delete_rows(path, {a["path"]: [0] for a in fx.live_adds(path)}, storage="i")
    want = delta_rows(path)
    df = magic_shell.run_line_magic("ucload", "main.ml.mapped --no-widget")
    assert _norm_rows(df.to_dict("records")) == _norm_rows(want) and len(want) == 27
    loader = magic_shell.run_line_magic("ucload", "main.ml.mapped --stream -b 4 -w 0 --no-widget")
    rows = [(int(i), q) for b in loader for i, q in zip(b["Super Name"], b["q"])]
    assert sorted(rows) == sorted((r["Super Name"], r["q"]) for r in want)


def test_a_table_on_s3_with_a_v2_checkpoint_and_sidecars_reads_its_snapshot(tmp_path, s3_env):
    """The log replay lists and reads ``_delta_log`` on S3 through the table's Volume: the JSON v2
    checkpoint, its Parquet sidecar under ``_sidecars`` and the commit after it (earlier commits gone)."""
    import uuid

    import s3fs

    path = str(tmp_path / "t")
    v2_checkpoint_table(path)
    want = delta_rows(path)
    bucket = f"tables-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem()
    fs.mkdir(bucket)
    try:
        fs.put(path, f"{bucket}/t", recursive=True)
        url = f"s3://{bucket}/t"
        assert _norm_rows(load_table(url).to_dict("records")) == _norm_rows(want) and len(want) == 28
        ds = ParquetDataset(url, format="arrow", cache_dir=str(tmp_path / "cache"))
        assert _sorted(ds_rows(ds)) == want
    finally:
        fs.rm(bucket, recursive=True)
