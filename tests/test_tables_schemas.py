"""One schema rule (issue 51 item 5): ``load_table`` and ``ParquetDataset`` unify a table's files through one
function (``footers.unify_schemas``: pyarrow's permissive promotion). A null-typed column in the first file,
``int32`` then ``int64``, ``timestamp[ms]`` then ``[us]`` are promoted (``load_table`` raised a raw
``ArrowNotImplementedError``/``ArrowInvalid``), a column that only some files have is null in the others' rows
whichever file comes first (it was dropped silently, or refused in the other order), and types no promotion
unifies are refused by name."""
from __future__ import annotations

import datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ucmagic import SchemaMismatchError
from ucmagic.tables import ParquetDataset, load_table

A = pa.table({"id": pa.array([0, 1], pa.int32()), "n": pa.array([None, None], pa.null()),
              "ts": pa.array([0, 1000], pa.timestamp("ms"))})
B = pa.table({"id": pa.array([2, 3], pa.int64()), "n": pa.array(["x", None], pa.string()),
              "ts": pa.array([2_000_000, 3_000_001], pa.timestamp("us")), "late": pa.array([7.5, 8.5])})
WANT = {"id": [0, 1, 2, 3], "n": [None, None, "x", None],
        "ts": [datetime.datetime(1970, 1, 1) + datetime.timedelta(microseconds=us)
               for us in (0, 1_000_000, 2_000_000, 3_000_001)],
        "late": [None, None, 7.5, 8.5]}


@pytest.mark.parametrize("first", ["a", "b"])
def test_files_are_unified_by_one_rule_in_both_readers(tmp_path, first):
    root = tmp_path / "t"
    root.mkdir()
    files = {"a": A, "b": B}
    order = [first, "b" if first == "a" else "a"]
    for k, name in enumerate(order):  # the file named first in the listing comes first
        pq.write_table(files[name], root / f"part-{k}-{name}.parquet")
    rows = {name: [r for r, n in zip(range(4), "aabb") if n == name] for name in "ab"}
    perm = rows[order[0]] + rows[order[1]]
    want = {c: [WANT[c][i] for i in perm] for c in WANT}

    ds = ParquetDataset(str(root), format="arrow", batch_size=10)
    types = {f.name: f.type for f in ds.schema}
    assert types["id"] == pa.int64() and types["n"] == pa.string() and types["ts"] == pa.timestamp("us")
    assert types["late"] == pa.float64()
    got = pa.concat_tables(list(ds))
    assert {c: got.column(c).to_pylist() for c in WANT} == want

    df = load_table(str(root))
    assert sorted(df.columns) == sorted(WANT)
    assert [int(v) for v in df["id"]] == want["id"]
    assert [None if v is None or v != v else v for v in df["n"]] == want["n"]
    assert [None if v != v else float(v) for v in df["late"]] == want["late"]
    assert [v.to_pydatetime() for v in df["ts"]] == want["ts"]

    torch_ds = ParquetDataset(str(root), batch_size=10, columns=["id", "late"])
    (b,) = list(torch_ds)
    assert b["id"].tolist() == want["id"] and b["late__valid"].tolist() == [v is not None for v in want["late"]]


def test_types_no_promotion_unifies_are_refused_naming_the_column_and_files(tmp_path):
    root = tmp_path / "t"
    root.mkdir()
    pq.write_table(pa.table({"id": [1, 2]}), root / "part-0.parquet")
    pq.write_table(pa.table({"id": ["a", "b"]}), root / "part-1.parquet")
    for read in (lambda: ParquetDataset(str(root)), lambda: load_table(str(root))):
        with pytest.raises(SchemaMismatchError, match=r"'?id'?.*part-0\.parquet.*part-1\.parquet|"
                                                      r"'?id'?.*part-1\.parquet.*part-0\.parquet"):
            read()
