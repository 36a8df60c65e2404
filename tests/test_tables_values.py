"""Values as the docs promise them (issue 51 item 3): a decimal is the double nearest to it in every output
(torch, numpy, pandas, ``load_table``, ``ds.rows``), checked against Python's own correctly rounded
``float(Decimal)`` over every precision and scale of every decimal width; a dictionary column arrives in pandas
as its value type; ``ds.rows`` takes row positions only (integers and slices of them); ``ds.rows[i]`` in the
arrow format holds a timestamp Python's datetime cannot."""
from __future__ import annotations

import decimal
import random

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ucmagic.tables import ParquetDataset, load_table
from ucmagic.tables.columns import decimal_float64

_CTX = decimal.Context(prec=100)
_WIDTHS = {pa.decimal32: 9, pa.decimal64: 18, pa.decimal128: 38, pa.decimal256: 76}


def _values(p: int, s: int, rng: random.Random) -> list[decimal.Decimal]:
    top = 10 ** p - 1
    mants = [top, -top, 0, 1, -1, 1269704 % (top + 1), 324876030017944 % (top + 1)]
    mants += [rng.randint(-top, top) for _ in range(12)]
    return [decimal.Decimal(m).scaleb(-s, _CTX) for m in mants]


def test_every_precision_and_scale_converts_to_the_nearest_double():
    rng = random.Random(51)
    checked = 0
    for make, widest in _WIDTHS.items():
        for p in range(1, widest + 1):
            for s in sorted({0, 1, p // 2, p - 1, p, -1, -5}):
                if s > p:
                    continue
                try:
                    arr = pa.array([None, *_values(p, s, rng), None], make(p, s))
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):  # a scale pyarrow cannot build values of
                    continue
                for piece in (arr, arr.slice(1, len(arr) - 2), pa.chunked_array([arr.slice(0, 3), arr.slice(3)])):
                    want = [None if v is None else float(v) for v in piece.to_pylist()]
                    assert decimal_float64(piece).to_pylist() == want, make(p, s)
                    checked += len(want)
    assert checked > 10_000


def test_decimals_are_the_nearest_double_through_every_entry_point(tmp_path):
    vals = [decimal.Decimal("0.1269704"), decimal.Decimal("0.0000001"), None, decimal.Decimal("-0.9999999")]
    wide = [decimal.Decimal("324876030017.944"), decimal.Decimal("-0.001"), None, decimal.Decimal("1.5")]
    t = pa.table({"id": pa.array(range(4), pa.int64()), "amt": pa.array(vals, pa.decimal128(7, 7)),
                  "dec15": pa.array(wide, pa.decimal128(15, 3))})
    pq.write_table(t, tmp_path / "f.parquet", row_group_size=3)
    root = str(tmp_path)
    want = {c: [None if v is None else float(v) for v in t[c].to_pylist()] for c in ("amt", "dec15")}

    def same(got, col):
        got = [None if (isinstance(v, float) and v != v) else v for v in got]
        expected = want[col]
        assert [g if e is not None else None for g, e in zip(got, expected)] == expected, col

    for col in ("amt", "dec15"):
        torch_batch = next(iter(ParquetDataset(root, batch_size=4)))
        same(torch_batch[col].tolist(), col)
        same(next(iter(ParquetDataset(root, batch_size=4, format="numpy")))[col].tolist(), col)
        same(next(iter(ParquetDataset(root, batch_size=4, format="pandas")))[col].tolist(), col)
        same(load_table(root)[col].tolist(), col)
        rows = ParquetDataset(root).rows
        same([float(rows[i][col]) for i in range(4)], col)
        same(rows[0:4][col].tolist(), col)


def test_a_dictionary_column_arrives_in_pandas_as_its_value_type(tmp_path):
    t = pa.table({"label": pa.array(["cat", "dog", None, "cat"]).dictionary_encode(),
                  "plain": pa.array(["cat", "dog", None, "cat"]),
                  "n": pa.array([1, 2, 1, None], pa.int64()).dictionary_encode()})
    pq.write_table(t, tmp_path / "f.parquet")
    for df in (load_table(str(tmp_path)), next(iter(ParquetDataset(str(tmp_path), format="pandas"))),
               ParquetDataset(str(tmp_path), format="pandas").rows[0:4]):
        assert str(df["label"].dtype) != "category" and df["label"].dtype == df["plain"].dtype
        assert df["label"].tolist()[:2] == ["cat", "dog"] and df["n"].dtype.name == "Int64"


def test_rows_take_integer_positions_only(tmp_path):
    pq.write_table(pa.table({"id": pa.array(range(6), pa.int64())}), tmp_path / "f.parquet")
    rows = ParquetDataset(str(tmp_path)).rows
    for bad in (1.7, True, False, "3", np.float64(1.0), np.bool_(True), None, slice(0.5, 2), slice(None, "3"),
                slice(True, 3)):
        with pytest.raises(TypeError, match="integers"):
            rows[bad]
    assert int(rows[np.int64(2)]["id"]) == 2 and int(rows[-1]["id"]) == 5
    assert rows[np.int32(1):np.int64(4)]["id"].tolist() == [1, 2, 3]


def test_an_arrow_row_keeps_a_timestamp_past_pythons_datetime(tmp_path):
    t = pa.table({"id": pa.array([0, 1], pa.int64()), "ts": pa.array([0, 2 ** 62], pa.timestamp("us"))})
    pq.write_table(t, tmp_path / "f.parquet")
    rows = ParquetDataset(str(tmp_path), format="arrow").rows
    assert rows[0]["ts"].year == 1970
    far = rows[1]["ts"]
    assert isinstance(far, pa.TimestampScalar) and far.value == 2 ** 62 and rows[1]["id"] == 1
