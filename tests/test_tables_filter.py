"""``filter=`` (issue 44 item 4) on ParquetDataset, load_table and export_parquet: the rows equal DuckDB's for
Parquet directories (also on generated tables) and deltalake's for Delta tables, row groups the statistics
rule out are never read from the volume (ranged fills, no whole-file copy), and a resume state carries the
filter. ``--where`` on the CLI's load/export and on %ucload."""
from __future__ import annotations

import os

import duckdb
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import toy_backend
from ucmagic import ColumnNotFoundError, ListingChangedError
from ucmagic.errors import InvalidArgumentError
from ucmagic.tables import ParquetDataset, export_parquet, load_table


def _write_hive(root, files=4, rows=60, group=10):
    for i in range(files):
        part = root / f"label={i % 2}"
        part.mkdir(parents=True, exist_ok=True)
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        x = pa.array([None if k % 9 == 0 else float(k) for k in ids], pa.float64())
        s = pa.array([None if k % 7 == 0 else f"s{k % 5}" for k in ids])
        pq.write_table(pa.table({"id": ids, "x": x, "s": s}), part / f"f{i}.parquet", row_group_size=group)


def _duck_ids(root, predicate):
    """DuckDB's answer over the rows pyarrow reads (DuckDB's own Parquet reader prunes row groups by statistics
    that leave NaN out, so ``f <> 0`` loses a NaN row there that DuckDB keeps over the same rows in memory)."""
    import pyarrow.dataset as pads

    rows_in = pads.dataset(str(root), format="parquet", partitioning="hive").to_table()
    con = duckdb.connect()
    try:
        con.register("rows_in", rows_in)
        rows = con.execute(f"SELECT id FROM rows_in WHERE {predicate}").fetchall()
    finally:
        con.close()
    return sorted(r[0] for r in rows)


def _ds_ids(ds):
    return sorted(int(v) for b in ds for v in b["id"])


PREDICATES = ["label = 1 AND x IS NULL", "x > 200.5 OR s IN ('s1', 's3')",
              "NOT (id BETWEEN 5 AND 230) AND s LIKE 's%' AND id % 3 = 0"]


@pytest.mark.parametrize("predicate", PREDICATES)
def test_every_entry_point_keeps_the_rows_duckdb_keeps(tmp_path, predicate):
    _write_hive(tmp_path / "t")
    want = _duck_ids(tmp_path / "t", predicate)
    root = str(tmp_path / "t")
    assert _ds_ids(ParquetDataset(root, batch_size=7, filter=predicate)) == want
    assert _ds_ids(ParquetDataset(root, batch_size=7, filter=predicate, shuffle=True, format="numpy")) == want
    assert sorted(load_table(root, filter=predicate)["id"].tolist()) == want
    out = export_parquet(root, str(tmp_path / "out"), filter=predicate)
    assert out.rows == len(want)
    assert sorted(load_table(str(tmp_path / "out"))["id"].tolist()) == want


def test_a_pyarrow_expression_filters_as_pyarrow_does(tmp_path):
    _write_hive(tmp_path / "t")
    root = str(tmp_path / "t")
    expr = (pc.field("label") == 0) & (pc.field("x") < 100)
    want = sorted(pq.read_table(root).filter(expr)["id"].to_pylist())
    assert want and _ds_ids(ParquetDataset(root, batch_size=16, filter=expr)) == want
    assert sorted(load_table(root, filter=expr, columns=["id"])["id"].tolist()) == want
    export_parquet(root, str(tmp_path / "out"), filter=expr)
    assert sorted(load_table(str(tmp_path / "out"))["id"].tolist()) == want


def test_row_groups_the_statistics_rule_out_are_pruned(tmp_path):
    _write_hive(tmp_path / "t")
    ds = ParquetDataset(str(tmp_path / "t"), batch_size=8, filter="id >= 75 AND id < 95")
    assert ds.num_rows == 20 and ds.group_rows == [5, 10, 5]  # of 24 row groups, the three that hold the rows
    assert ParquetDataset(str(tmp_path / "t"), filter="label = 7").num_rows == 0  # partition values prune
    only_x = ParquetDataset(str(tmp_path / "t"), columns=["x"], batch_size=100, filter="id >= 75 AND id < 95")
    assert only_x.columns == ["x"] and [list(b) for b in only_x] == [["x", "x__valid"]]  # filter columns not added


def test_bad_filters_are_refused_naming_the_fix(tmp_path):
    _write_hive(tmp_path / "t", files=1)
    root = str(tmp_path / "t")
    with pytest.raises(InvalidArgumentError, match="WHERE clause"):
        ParquetDataset(root, filter="id = 1; DROP TABLE x")
    with pytest.raises(InvalidArgumentError, match="one predicate"):
        ParquetDataset(root, filter="1=1) UNION (SELECT 1")
    with pytest.raises(ColumnNotFoundError, match="nope") as got:
        ParquetDataset(root, filter="nope = 3")
    assert isinstance(got.value, KeyError) and isinstance(got.value, InvalidArgumentError)
    assert str(got.value).startswith("filter 'nope = 3' names column 'nope'")  # no KeyError quotes around it
    with pytest.raises(InvalidArgumentError, match="pyarrow compute expression"):
        ParquetDataset(root, filter=42)
    for call in (lambda: ParquetDataset(root, columns=["nope"]), lambda: load_table(root, columns=["nope"]),
                 lambda: load_table(root, filter="nope > 1")):
        with pytest.raises(ColumnNotFoundError, match="nope"):
            call()


def test_the_resume_fingerprint_includes_the_filter(tmp_path):
    _write_hive(tmp_path / "t", files=2)
    root = str(tmp_path / "t")
    a = ParquetDataset(root, batch_size=4, filter="id < 50")
    it = iter(a)
    first = next(it)
    state = a.state_dict()
    rest = ParquetDataset(root, batch_size=4, filter="id < 50")
    rest.load_state_dict(state)
    assert sorted([int(v) for v in first["id"]] + _ds_ids(rest)) == list(range(50))
    with pytest.raises(ListingChangedError):
        ParquetDataset(root, batch_size=4, filter="id < 51").load_state_dict(state)


# ---------------------------------------------------------------- generated tables (differential)

_OPS = ["=", "<>", "<", ">", "<=", ">="]


@st.composite
def _predicates(draw, depth=0):
    kind = draw(st.sampled_from(["cmp", "cmp", "null", "in", "between"] + (["and", "or", "not"] if depth < 2 else [])))
    col = draw(st.sampled_from(["a", "b", "f"]))
    k = draw(st.integers(-3, 40))
    if kind == "cmp":
        return f"{col} {draw(st.sampled_from(_OPS))} {k}"
    if kind == "null":
        return f"{col} IS {draw(st.sampled_from(['', 'NOT ']))}NULL"
    if kind == "in":
        return f"{col} IN ({k}, {k + 3}, {k * 2})"
    if kind == "between":
        return f"{col} BETWEEN {k} AND {k + draw(st.integers(0, 15))}"
    if kind == "not":
        return f"NOT ({draw(_predicates(depth + 1))})"
    return f"({draw(_predicates(depth + 1))}) {kind.upper()} ({draw(_predicates(depth + 1))})"


@st.composite
def _tables(draw):
    files = []
    start = 0
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(0, 30))
        vals = st.one_of(st.none(), st.integers(-5, 40))
        a = draw(st.lists(vals, min_size=n, max_size=n))
        b = sorted(draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)))  # a sorted column: statistics prune
        f = draw(st.lists(st.one_of(st.none(), st.just(float("nan")), st.floats(-5, 40, allow_nan=False)),
                          min_size=n, max_size=n))
        files.append((pa.table({"id": pa.array(range(start, start + n), pa.int64()), "a": pa.array(a, pa.int64()),
                                "b": pa.array(b, pa.int32()), "f": pa.array(f, pa.float64())}),
                      draw(st.integers(1, 8))))
        start += n
    return files


@settings(max_examples=12)
@given(tables=_tables(), predicate=_predicates())
def test_generated_tables_and_predicates_keep_duckdbs_rows(tmp_path_factory, tables, predicate):
    root = tmp_path_factory.mktemp("gen")
    for i, (t, group) in enumerate(tables):
        pq.write_table(t, root / f"part-{i}.parquet", row_group_size=group)
    want = _duck_ids(root, predicate)
    assert _ds_ids(ParquetDataset(str(root), batch_size=5, filter=predicate)) == want
    assert sorted(load_table(str(root), filter=predicate)["id"].tolist()) == want


# ---------------------------------------------------------------- Delta tables: deltalake's rows, filtered

def test_delta_tables_keep_the_rows_deltalakes_snapshot_keeps(tmp_path):
    deltalake = pytest.importorskip("deltalake")
    import delta_fixtures as fx

    path = str(tmp_path / "d")
    data = pa.table({"id": pa.array(range(120), pa.int64()), "p": pa.array([None if i % 11 == 0 else i % 3
                                                                           for i in range(120)], pa.int64())})
    deltalake.write_deltalake(path, data.slice(0, 60), partition_by=["p"])
    deltalake.write_deltalake(path, data.slice(60), partition_by=["p"], mode="append")
    adds = fx.live_adds(path)
    fx.delete_rows(path, {adds[0]["path"]: [0, 1], adds[-1]["path"]: [2]}, storage="u")
    deltalake.write_deltalake(path, pa.table({"id": pa.array([500], pa.int64()), "p": pa.array([1], pa.int64()),
                                              "extra": pa.array(["e"])}), mode="append", schema_mode="merge",
                              partition_by=["p"])
    mapped = str(tmp_path / "m")
    fx.write_column_mapped(mapped, pa.table({"id": pa.array(range(40), pa.int64()),
                                             "v": pa.array([i * 1.5 for i in range(40)])}), mode="name")
    for table, predicate in [(path, "p = 1 AND id > 30"), (path, "p IS NULL OR extra = 'e'"),
                             (path, "id BETWEEN 0 AND 70"), (mapped, "v >= 30 AND id <> 25")]:
        live = pa.table(pa.RecordBatchReader.from_stream(deltalake.DeltaTable(table).scan()))
        con = duckdb.connect()
        con.register("live", live)
        want = sorted(r[0] for r in con.execute(f"SELECT id FROM live WHERE {predicate}").fetchall())
        con.close()
        assert _ds_ids(ParquetDataset(table, batch_size=9, filter=predicate)) == want, predicate
        assert sorted(load_table(table, filter=predicate)["id"].tolist()) == want, predicate


# ---------------------------------------------------------------- ranged reads through the volume

class _ByteCountingToy(toy_backend.ToyVolume):
    """The toy backend, counting the bytes its range readers and copies hand out."""

    bytes_read = 0

    def range_reader(self, rel):
        inner = super().range_reader(rel)

        class Counted:
            def readinto_at(self, offset, buf):
                n = inner.readinto_at(offset, buf)
                _ByteCountingToy.bytes_read += n
                return n

            def close(self):
                inner.close()

        return Counted()

    def copy_to(self, rel, dest, *, expect=None):
        n = super().copy_to(rel, dest, expect=expect)
        _ByteCountingToy.bytes_read += n
        return n


def test_a_filter_reads_only_the_row_groups_that_match_from_the_volume(tmp_path):
    root = tmp_path / "vol"
    root.mkdir()
    rng = np.random.default_rng(0)
    for i in range(4):  # a sorted id, a payload column that dominates the bytes
        ids = np.arange(i * 100_000, (i + 1) * 100_000, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "blob": rng.random(100_000)}), root / f"f{i}.parquet",
                       row_group_size=5000, compression="none")
    total = sum(os.path.getsize(root / f) for f in os.listdir(root))
    _ByteCountingToy.bytes_read = 0
    with toy_backend.registered(toy_backend.SCHEME, _ByteCountingToy):
        url = f"{toy_backend.SCHEME}://{root}"
        pred = "id >= 102_100 AND id < 102_140"
        ds = ParquetDataset(url, batch_size=64, filter=pred, cache_dir=str(tmp_path / "c"))
        built = _ByteCountingToy.bytes_read
        assert _ds_ids(ds) == list(range(102_100, 102_140))
        assert _ds_ids(ds) == list(range(102_100, 102_140))  # a second epoch: the row group's range is cached
        assert _ByteCountingToy.bytes_read < 0.08 * total, (_ByteCountingToy.bytes_read, total)  # footers + 1 group
        before = _ByteCountingToy.bytes_read
        again = ParquetDataset(url, batch_size=64, filter=pred, cache_dir=str(tmp_path / "c"))
        assert _ByteCountingToy.bytes_read - before < built  # the row index is cached: footers only
        assert again.group_rows == ds.group_rows and _ds_ids(again) == list(range(102_100, 102_140))
        other = ParquetDataset(url, batch_size=64, filter=pred + " + 1", cache_dir=str(tmp_path / "c"))
        assert other.num_rows == 41  # another filter, another index


def test_batches_read_from_mapped_cache_entries_survive_the_cache_being_cleared(tmp_path):
    """Cached copies and row-group ranges are memory-mapped: a batch (arrow, zero-copy) still holds its values
    after the entries are removed; an entry shortened by hand is filled again, never read short."""
    root = tmp_path / "vol"
    root.mkdir()
    for i in range(2):
        ids = np.arange(i * 4000, (i + 1) * 4000, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids * 0.5}), root / f"f{i}.parquet", row_group_size=1000,
                       compression="none")
    cache = tmp_path / "c"
    with toy_backend.registered(toy_backend.SCHEME, toy_backend.ToyVolume):
        url = f"{toy_backend.SCHEME}://{root}"
        for pred in (None, "id % 3 = 0"):
            ds = ParquetDataset(url, batch_size=700, filter=pred, format="arrow", cache_dir=str(cache))
            held = list(ds)  # arrow batches over the mapped entries
            want = [i for i in range(8000) if pred is None or i % 3 == 0]
            for dirpath, _, names in os.walk(cache):
                for n in names:
                    os.unlink(os.path.join(dirpath, n))
            got = [v for b in held for v in b.column("id").to_pylist()]
            assert got == want
            assert [v for b in held for v in b.column("x").to_pylist()] == [i * 0.5 for i in want]
            assert _ds_ids(ds) == want  # the entries are filled again
        ranges = [os.path.join(d, n) for d, _, names in os.walk(cache) for n in names if n.endswith(".range")]
        assert ranges
        with open(ranges[0], "r+b") as f:
            f.truncate(10)
        fresh = ParquetDataset(url, batch_size=700, filter="id % 3 = 0", format="arrow", cache_dir=str(cache))
        assert _ds_ids(fresh) == [i for i in range(8000) if i % 3 == 0]  # the short entry is a miss: filled again


def test_a_cache_on_a_file_system_without_mmap_reads_plainly(tmp_path, monkeypatch):
    import errno
    import mmap
    import types

    import pyarrow

    from ucmagic.tables import group_reader

    tried = []

    def no_mmap(*a, **k):
        tried.append(a)
        raise OSError(errno.ENODEV, "No such device")

    monkeypatch.setattr(group_reader, "mmap", types.SimpleNamespace(mmap=no_mmap, ACCESS_READ=mmap.ACCESS_READ))
    monkeypatch.setattr(pyarrow, "memory_map", no_mmap)
    root = tmp_path / "vol"
    root.mkdir()
    ids = np.arange(3000, dtype=np.int64)
    pq.write_table(pa.table({"id": ids}), root / "f.parquet", row_group_size=500)
    with toy_backend.registered(toy_backend.SCHEME, toy_backend.ToyVolume):
        url = f"{toy_backend.SCHEME}://{root}"
        for pred in (None, "id % 7 = 0"):
            ds = ParquetDataset(url, batch_size=256, filter=pred, cache_dir=str(tmp_path / "c"))
            want = [i for i in range(3000) if pred is None or i % 7 == 0]
            assert _ds_ids(ds) == want and _ds_ids(ds) == want  # cold, then from the cache
    # both were refused and read around: pyarrow's map of a whole copy (a path), ours of a range (a descriptor)
    assert {type(a[0]) for a in tried} == {str, int}


# ---------------------------------------------------------------- --where

def test_where_on_the_cli_load_and_export_and_on_ucload(tmp_path, capsys, magic_shell, monkeypatch):
    from ucmagic.__main__ import main

    _write_hive(tmp_path / "t")
    root = str(tmp_path / "t")
    want = _duck_ids(root, "label = 1")
    assert main(["load", root, "--where", "label = 1"]) == 0
    assert f"{len(want):,}" in capsys.readouterr().out or str(len(want)) in capsys.readouterr().out
    assert main(["export", root, str(tmp_path / "out"), "--where", "label = 1"]) == 0
    assert sorted(load_table(str(tmp_path / "out"))["id"].tolist()) == want
    monkeypatch.setenv("UCMAGIC_PROGRESS", "off")
    df = magic_shell.run_line_magic("ucload", f'{root} --where "label = 1 AND id < 100"')
    assert sorted(df["id"].tolist()) == [i for i in want if i < 100]


def test_delta_time_travel_inline_vectors_updates_checkpoints_and_id_mapping_filter_as_deltalake(tmp_path):
    deltalake = pytest.importorskip("deltalake")
    import delta_fixtures as fx

    def check(table, predicate, version=None):
        live = pa.table(pa.RecordBatchReader.from_stream(deltalake.DeltaTable(table, version=version).scan()))
        con = duckdb.connect()
        con.register("live", live)
        want = sorted(r[0] for r in con.execute(f"SELECT id FROM live WHERE {predicate}").fetchall())
        con.close()
        got = _ds_ids(ParquetDataset(table, batch_size=9, filter=predicate, version=version))
        assert got == want, (table, predicate, version)
        assert sorted(load_table(table, filter=predicate, version=version)["id"].tolist()) == want

    path = str(tmp_path / "d")
    deltalake.write_deltalake(path, pa.table({"id": pa.array(range(80), pa.int64()),
                                              "x": pa.array([float(i) for i in range(80)])}))
    fx.enable_dv_protocol(path)
    add = fx.live_adds(path)[0]["path"]
    v1 = fx.delete_rows(path, {add: [3, 4, 5]}, storage="i")
    fx.delete_rows(path, {add: range(40, 50)}, storage="u", runs=True)
    for version in (v1, None):
        check(path, "x < 45 AND id % 2 = 1", version)
    upd = str(tmp_path / "u")
    deltalake.write_deltalake(upd, pa.table({"id": pa.array(range(60), pa.int64()), "x": pa.array([1.0] * 60)}))
    deltalake.DeltaTable(upd).update(updates={"x": "x + 100"}, predicate="id < 5")
    deltalake.DeltaTable(upd).delete("id >= 50")
    deltalake.DeltaTable(upd).create_checkpoint()
    check(upd, "x > 50 OR id > 45")
    mapped = str(tmp_path / "m")
    words = [f"w{i % 4}" for i in range(30)]
    fx.write_column_mapped(mapped, pa.table({"id": pa.array(range(30), pa.int64()), "b": words}), mode="id", files=2)
    check(mapped, "b = 'w1' AND id > 3")
