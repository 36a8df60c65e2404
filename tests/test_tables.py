"""Tables: name validation, the local catalog, load_table, register_table."""
import os
import types

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ucmagic.tables import sources
from ucmagic.errors import SourceNotFoundError
from ucmagic.tables import (InvalidTableNameError, TableNotFoundError, TableTooLargeError, UnsupportedSourceError,
                            is_sql, load_table, looks_like_table_name, parse_table_name, register_table,
                            resolve_source)


@pytest.fixture
def catalog(tmp_path, monkeypatch):
    root = tmp_path / "catalog"
    root.mkdir()
    monkeypatch.setenv("UCMAGIC_CATALOG_ROOT", str(root))
    return root


def frame(n=1000, offset=0):
    i = np.arange(offset, offset + n)
    return pd.DataFrame({"id": i, "x": i * 0.5, "label": i % 3, "text": [f"row-{k}" for k in i]})


# ---------------------------------------------------------------- pure name handling

@pytest.mark.parametrize("name", ["main.sales.orders", "dev_1.my-schema.t2", "a.b.c"])
def test_valid_table_names_parse_into_three_parts(name):
    t = parse_table_name(name)
    assert str(t) == name and t.quoted().count("`") == 6


@pytest.mark.parametrize("bad", ["main.sales", "a.b.c.d", "a..c", "a.b.c;drop table x", "a.b.`c`", "a.b.c d",
                                 "a.b./etc", ".a.b", "", "a.b.c'--"])
def test_malformed_table_names_are_refused_with_the_expected_form(bad):
    with pytest.raises(InvalidTableNameError, match="catalog.schema.table"):
        parse_table_name(bad)


def test_sql_and_table_name_detection_needs_no_io():
    assert is_sql("SELECT 1") and is_sql("  with t as (select 1) select * from t") and is_sql("FROM range(3)")
    assert not is_sql("select") and not is_sql("main.sales.orders")
    assert looks_like_table_name("main.sales.orders")
    for path in ("data.parquet", "a/b.c.d", "./x.y.z", "s3://b/a.b.c", "x.y.csv", "*.parquet", "plain"):
        assert not looks_like_table_name(path)


# ---------------------------------------------------------------- local catalog

def test_register_then_load_a_delta_table_with_projection_and_limit(catalog):
    path = register_table("main.ml.train", frame())
    assert path == str(catalog / "main" / "ml" / "train") and os.path.isdir(os.path.join(path, "_delta_log"))
    df = load_table("main.ml.train")
    pd.testing.assert_frame_equal(df, frame())
    part = load_table("main.ml.train", columns=["text", "id"], limit=7)
    assert list(part.columns) == ["text", "id"] and len(part) == 7


def test_register_parquet_table_and_modes(catalog):
    register_table("main.ml.pq", frame(100), format="parquet")
    assert len(load_table("main.ml.pq")) == 100
    with pytest.raises(FileExistsError, match="mode='overwrite'"):
        register_table("main.ml.pq", frame(5), format="parquet")
    register_table("main.ml.pq", frame(5), format="parquet", mode="overwrite")
    assert len(load_table("main.ml.pq")) == 5
    with pytest.raises(ValueError, match="delta"):
        register_table("main.ml.pq", frame(5), format="parquet", mode="append")
    with pytest.raises(ValueError, match="format"):
        register_table("main.ml.x", frame(5), format="orc")


def test_delta_append_and_time_travel(catalog):
    path = register_table("main.ml.hist", frame(10))
    register_table("main.ml.hist", frame(5, offset=10), mode="append")
    assert sorted(load_table("main.ml.hist")["id"]) == list(range(15))
    assert len(load_table("main.ml.hist", version=0)) == 10
    assert len(load_table(path, version=1)) == 15


def test_unknown_table_lists_what_exists(catalog):
    register_table("main.ml.known", frame(3))
    with pytest.raises(TableNotFoundError, match="main.ml.known") as e:
        load_table("main.ml.unknown")
    assert isinstance(e.value, FileNotFoundError) and "register_table" in str(e.value)


def test_table_names_need_a_catalog_root_without_spark(monkeypatch):
    monkeypatch.delenv("UCMAGIC_CATALOG_ROOT", raising=False)
    with pytest.raises(TableNotFoundError, match="UCMAGIC_CATALOG_ROOT"):
        load_table("main.ml.train")


def test_volumes_paths_resolve_under_the_catalog_root(catalog):
    vol = catalog / "main" / "raw" / "volumes" / "files" / "day1"
    vol.mkdir(parents=True)
    pq.write_table(pa.Table.from_pandas(frame(20), preserve_index=False), vol / "a.parquet")
    frame(5).to_csv(vol / "b.csv", index=False)
    assert len(load_table("/Volumes/main/raw/files/day1/a.parquet")) == 20
    assert len(load_table("/Volumes/main/raw/files/day1/*.csv")) == 5


# ---------------------------------------------------------------- other sources and errors

def test_load_parquet_csv_globs_and_sql(tmp_path, monkeypatch):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    pq.write_table(pa.Table.from_pandas(frame(10), preserve_index=False), d / "a.parquet")
    pq.write_table(pa.Table.from_pandas(frame(10, 10), preserve_index=False), d / "sub" / "b.parquet")
    (d / "_SUCCESS").write_text("")
    assert sorted(load_table(str(d))["id"]) == list(range(20))  # recursive, side files ignored
    assert len(load_table(str(d / "*.parquet"))) == 10
    frame(4).to_csv(tmp_path / "t.csv", index=False)
    assert list(load_table(str(tmp_path / "t.csv"))["text"]) == [f"row-{k}" for k in range(4)]
    monkeypatch.setenv("UCMAGIC_SQL_FILES", str(d))  # SQL reads only the folders the user lets it (test_security.py)
    q = f"SELECT label, count(*) AS n FROM read_parquet('{d}/**/*.parquet') GROUP BY label ORDER BY label"
    assert list(load_table(q)["n"]) == [7, 7, 6]


def test_bad_inputs_say_what_to_do(tmp_path):
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        load_table(str(tmp_path / "missing.parquet"))
    with pytest.raises(SourceNotFoundError, match="UCMAGIC_CATALOG_ROOT"):
        load_table("/Volumes/nope/nope/nope/x.parquet")
    with pytest.raises(UnsupportedSourceError, match="pandas DataFrame"):
        load_table(42)
    with pytest.raises(UnsupportedSourceError, match="Parquet"):
        (tmp_path / "notes.txt").write_text("x")
        load_table(str(tmp_path / "notes.txt"))
    with pytest.raises(SourceNotFoundError, match="no Parquet or CSV"):
        (tmp_path / "empty").mkdir()
        load_table(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="limit"):
        load_table(frame(3), limit=-1)


def test_unknown_column_lists_the_columns(tmp_path):
    pq.write_table(pa.Table.from_pandas(frame(3), preserve_index=False), tmp_path / "a.parquet")
    with pytest.raises(KeyError, match="label"):
        load_table(str(tmp_path / "a.parquet"), columns=["nope"])


def test_too_large_table_points_to_export_and_streaming(catalog, monkeypatch):
    register_table("main.ml.big", frame(20000))
    with pytest.raises(TableTooLargeError) as e:
        load_table("main.ml.big", max_bytes="100KB")
    msg = str(e.value)
    assert "export_parquet" in msg and "ParquetDataset" in msg and "main.ml.big" in msg
    assert len(load_table("main.ml.big", max_bytes="100KB", limit=100)) == 100  # a part fits
    assert len(load_table("main.ml.big", max_bytes="100KB", columns=["label"])) == 20000
    monkeypatch.setenv("UCMAGIC_LOAD_TABLE_MAX_BYTES", "1KB")
    with pytest.raises(TableTooLargeError):
        load_table("main.ml.big")


def test_in_memory_sources_load_directly():
    assert len(load_table(pa.Table.from_pandas(frame(8)), columns=["id"])) == 8
    assert load_table(frame(8), limit=2)["id"].tolist() == [0, 1]


# ---------------------------------------------------------------- with a Spark session (faked: no JVM here)

class _FakeReader:
    def __init__(self, log):
        self.log = log

    def table(self, name):
        self.log.append(name)
        if "missing" in name:
            raise RuntimeError("[TABLE_OR_VIEW_NOT_FOUND] The table or view cannot be found")
        return _FakeDF(self.log)


class _FakeDF:
    __module__ = "pyspark.sql.dataframe"

    def __init__(self, log):
        self.log = log

    def select(self, *cols):
        self.log.append(("select", cols))
        return self

    def limit(self, n):
        self.log.append(("limit", n))
        return self

    def toPandas(self):  # noqa: N802 - Spark's name
        return frame(3)


_FakeDF.__name__ = "DataFrame"


def test_names_go_through_the_active_spark_session_quoted(monkeypatch, catalog):
    log = []
    monkeypatch.setattr(sources, "active_spark", lambda: types.SimpleNamespace(read=_FakeReader(log)))
    df = load_table("main.ml.orders", columns=["id"], limit=3)
    assert len(df) == 3
    assert log == ["`main`.`ml`.`orders`", ("select", ("id",)), ("limit", 3)]
    with pytest.raises(TableNotFoundError, match="Spark"):
        load_table("main.ml.missing")
    assert resolve_source("main.ml.orders").kind == "spark_table"


# ---------------------------------------------------------------- export keeps the source's row order

@pytest.mark.parametrize("kind", ["table", "delta_dir", "pandas", "arrow", "parquet", "duckdb"])
@pytest.mark.parametrize("target", ["256MB", "200KB"])  # one file; several files
def test_export_keeps_the_source_s_row_order(catalog, tmp_path, kind, target):
    import duckdb

    from ucmagic import ParquetDataset, export_parquet, register_table

    n = 100_000  # more rows than one Arrow batch (65,536): a multi-threaded COPY of a stream reordered them
    df = frame(n)
    if kind in ("table", "delta_dir"):
        register_table("main.ml.ordered", df, mode="overwrite")
        source = "main.ml.ordered" if kind == "table" else str(catalog / "main" / "ml" / "ordered")
    elif kind == "pandas":
        source = df
    elif kind == "arrow":
        source = pa.Table.from_pandas(df)
    elif kind == "parquet":
        source = str(tmp_path / "src.parquet")
        df.to_parquet(source, row_group_size=20_000)
    else:
        con = duckdb.connect()
        source = con.from_df(df)
    out = str(tmp_path / "out")
    res = export_parquet(source, out, target_file_size=target)
    if kind != "duckdb":  # a DuckDB relation's row size is unknown: its row groups, hence files, are DuckDB's size
        assert (len(res.files) > 1) == (target == "200KB")
    got = pq.read_table(out, columns=["id"]).column("id").to_numpy()  # files in name order
    assert (got == np.arange(n)).all(), f"rows out of order from {got[0]}"
    ids = [b["id"] for b in ParquetDataset(out, columns=["id"], batch_size=10_000)]
    assert np.array_equal(np.concatenate([np.asarray(i) for i in ids]), np.arange(n))


def test_hive_partition_directories_are_columns_typed_as_pyarrow_infers_them(tmp_path):
    import subprocess
    import sys

    import pyarrow.dataset as pads
    import torch

    from ucmagic.tables import ParquetDataset, export_parquet

    d = tmp_path / "t"
    export_parquet(frame(60), d, partition_by=["label"])
    oracle = pads.dataset(str(d), format="parquet", partitioning="hive").to_table()
    assert oracle.schema.field("label").type == pa.int32()
    want = sorted(zip(oracle.column("id").to_pylist(), oracle.column("label").to_pylist()))
    df = load_table(str(d))
    assert sorted(zip(df["id"], df["label"])) == want and str(df["label"].dtype) == "int32"
    assert list(load_table(str(d), columns=["label"]).columns) == ["label"]
    batches = list(ParquetDataset(str(d), columns=["id", "label"], batch_size=7))
    assert batches[0]["label"].dtype == torch.int32
    assert sorted((int(i), int(lab)) for b in batches for i, lab in zip(b["id"], b["label"])) == want
    (only,) = list(ParquetDataset(str(d), columns=["label"], batch_size=100))
    assert sorted(only["label"].tolist()) == sorted(lab for _, lab in want)
    ds = ParquetDataset(str(d), batch_size=10)  # resume fingerprints still hold
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    ParquetDataset(str(d), batch_size=10).load_state_dict(state)
    out = tmp_path / "flat"
    export_parquet(str(d), out)  # an export of a partitioned directory keeps the partition column
    assert sorted(zip(*(pq.read_table(out).column(c).to_pylist() for c in ("id", "label")))) == want
    cli = subprocess.run([sys.executable, "-m", "ucmagic", "load", str(d), "--stream"], capture_output=True,
                         text=True, timeout=120)
    assert cli.returncode == 0 and "rows: 60" in cli.stdout, cli.stderr
