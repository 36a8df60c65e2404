"""Lossless by construction: every entry point that reads Parquet gives back pyarrow's own values.

One oracle: ``pyarrow.dataset`` over the same files (hive partitioning, as pyarrow infers it). Generated
tables hold every Arrow type of the type table in docs/tables.md, nulls in every column, values at the
type's limits, several files with differing null patterns, written by pyarrow (varied row-group sizes),
pandas or DuckDB. Each is read through ``ParquetDataset`` (torch, numpy, arrow, pandas), ``load_table`` and
``export_parquet`` (read back with pyarrow), and every non-null value must come back unchanged, every null
as a null (a validity mask, ``None``, NaN for floats, ``pd.NA``/``NaT``), with each column's dtype fixed by
its type alone. ``UCMAGIC_LOSSLESS_EXAMPLES=N`` runs N generated tables instead of the default few.
"""
from __future__ import annotations

import decimal
import math
import os
import uuid

import duckdb
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

try:
    from ucmagic import LossyColumnError
except ImportError:  # the code before lossless reads (run on an old checkout to see what it loses)
    class LossyColumnError(Exception):  # type: ignore[no-redef]
        pass
from ucmagic.tables import ParquetDataset, export_parquet, load_table

EXAMPLES = int(os.environ.get("UCMAGIC_LOSSLESS_EXAMPLES", "120"))
MASK = "__valid"  # ParquetDataset's validity-mask suffix (torch and numpy formats)

# ---------------------------------------------------------------- the types and their limits


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.sampled_from([lo, hi, lo + 1, hi - 1, 0]), st.integers(lo, hi))


def _signed(bits: int) -> tuple[int, int]:
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


_I64 = (-(2 ** 63) + 1, 2 ** 63 - 1)  # int64 min is numpy's NaT: not a timestamp/duration any reader can return
_NS = {"s": 10 ** 9, "ms": 10 ** 6, "us": 10 ** 3, "ns": 1}
_DAY = 86400


def _decimal(p: int, s: int) -> st.SearchStrategy[decimal.Decimal]:
    top = 10 ** p - 1
    ctx = decimal.Context(prec=60)  # the default 28 digits would round a decimal(38, s) on the way in
    return _ints(-top, top).map(lambda u: decimal.Decimal(u).scaleb(-s, ctx).quantize(
        decimal.Decimal(1).scaleb(-s), context=ctx))


def _float(width: int) -> st.SearchStrategy[float]:
    return st.floats(width=width, allow_nan=True, allow_infinity=True)


# name -> (Arrow type, storage type the values are built in (None: the type itself), value strategy, writers)
PA_ONLY = ("pyarrow",)
ALL_WRITERS = ("pyarrow", "pandas", "duckdb")
TYPES: dict[str, tuple[pa.DataType, pa.DataType | None, st.SearchStrategy, tuple[str, ...]]] = {
    **{f"int{b}": (getattr(pa, f"int{b}")(), None, _ints(*_signed(b)), ALL_WRITERS) for b in (8, 16, 32, 64)},
    **{f"uint{b}": (getattr(pa, f"uint{b}")(), None, _ints(0, 2 ** b - 1), ALL_WRITERS) for b in (8, 16, 32, 64)},
    "float16": (pa.float16(), None, _float(16), PA_ONLY),
    "float32": (pa.float32(), None, _float(32), ALL_WRITERS),
    "float64": (pa.float64(), None, _float(64), ALL_WRITERS),
    "bool": (pa.bool_(), None, st.booleans(), ALL_WRITERS),
    "dec5_2": (pa.decimal128(5, 2), None, _decimal(5, 2), ("pyarrow", "duckdb")),
    "dec15_3": (pa.decimal128(15, 3), None, _decimal(15, 3), ("pyarrow", "duckdb")),
    "dec38_10": (pa.decimal128(38, 10), None, _decimal(38, 10), ("pyarrow", "duckdb")),
    "date32": (pa.date32(), pa.int32(), _ints(*_signed(32)), ("pyarrow", "duckdb")),
    "ts_s": (pa.timestamp("s"), pa.int64(), _ints(-(_I64[1] // 1000), _I64[1] // 1000), PA_ONLY),  # stored as ms
    "ts_ms": (pa.timestamp("ms"), pa.int64(), _ints(*_I64), PA_ONLY),
    "ts_us": (pa.timestamp("us"), pa.int64(), _ints(*_I64), ("pyarrow", "duckdb")),
    "ts_ns": (pa.timestamp("ns"), pa.int64(), _ints(*_I64), ("pyarrow", "pandas")),
    "ts_us_utc": (pa.timestamp("us", tz="UTC"), pa.int64(), _ints(*_I64), PA_ONLY),
    "time32_s": (pa.time32("s"), pa.int32(), _ints(0, _DAY - 1), PA_ONLY),
    "time32_ms": (pa.time32("ms"), pa.int32(), _ints(0, _DAY * 10 ** 3 - 1), PA_ONLY),
    "time64_us": (pa.time64("us"), pa.int64(), _ints(0, _DAY * 10 ** 6 - 1), PA_ONLY),
    "time64_ns": (pa.time64("ns"), pa.int64(), _ints(0, _DAY * 10 ** 9 - 1), PA_ONLY),
    "dur_s": (pa.duration("s"), pa.int64(), _ints(*_I64), PA_ONLY),
    "dur_ns": (pa.duration("ns"), pa.int64(), _ints(*_I64), PA_ONLY),
    "string": (pa.string(), None, st.text(max_size=6), ALL_WRITERS),
    "large_string": (pa.large_string(), None, st.text(max_size=6), PA_ONLY),
    "binary": (pa.binary(), None, st.binary(max_size=6), ("pyarrow", "duckdb")),
    "large_binary": (pa.large_binary(), None, st.binary(max_size=6), PA_ONLY),
    "dict_string": (pa.dictionary(pa.int32(), pa.string()), pa.string(), st.sampled_from(["a", "bb", "", "é"]),
                    PA_ONLY),
    "struct": (pa.struct([("a", pa.int64()), ("b", pa.string())]), None,
               st.fixed_dictionaries({"a": st.none() | _ints(*_signed(64)), "b": st.none() | st.text(max_size=3)}),
               PA_ONLY),
    "list": (pa.list_(pa.int64()), None, st.lists(st.none() | _ints(*_signed(64)), max_size=3), PA_ONLY),
    "large_list": (pa.large_list(pa.int8()), None, st.lists(_ints(*_signed(8)), max_size=3), PA_ONLY),
    "fsl": (pa.list_(pa.int32(), 2), None, st.lists(_ints(*_signed(32)), min_size=2, max_size=2), PA_ONLY),
    "map": (pa.map_(pa.string(), pa.int64()), None,
            st.lists(st.tuples(st.text(max_size=3), _ints(*_signed(64))), max_size=2, unique_by=lambda kv: kv[0]),
            PA_ONLY),
    "null": (pa.null(), None, st.none(), PA_ONLY),
}


# pyarrow 25 cannot read back the null entries of a fixed-size list it wrote ("Expected all lists to be of
# size=2 but index 1 had size=0"): its oracle read fails, so that column is written without top-level nulls
NO_NULLS = {"fsl": [0, 0]}


def build_array(name: str, values: list) -> pa.Array:
    typ, storage, _, _ = TYPES[name]
    if name in NO_NULLS:
        values = [NO_NULLS[name] if v is None else v for v in values]
    if name == "float16":
        vals = np.array([0 if v is None else v for v in values], dtype=np.float16)
        return pa.array(vals, pa.float16(), mask=np.array([v is None for v in values], dtype=bool))
    if name == "null":
        return pa.nulls(len(values))
    if storage is not None:
        arr = pa.array(values, storage)
        return arr.dictionary_encode() if pa.types.is_dictionary(typ) else arr.cast(typ)
    return pa.array(values, typ)


# ---------------------------------------------------------------- generated tables


@st.composite
def tables(draw: st.DrawFn) -> tuple[list[pa.Table], str, list[int]]:
    """Files (same schema, each with its own null pattern) written by one writer, and their row-group sizes."""
    writer = draw(st.sampled_from(ALL_WRITERS))
    pool = [n for n, spec in TYPES.items() if writer in spec[3]]
    cols = draw(st.lists(st.sampled_from(pool), min_size=1, max_size=6, unique=True))
    nfiles = draw(st.integers(1, 3))
    files = []
    for _ in range(nfiles):
        n = draw(st.integers(0, 9))
        data = {}
        for c in cols:
            pattern = draw(st.sampled_from(["none", "some", "all"]))
            vals = [None if pattern == "all" or (pattern == "some" and draw(st.booleans())) else draw(TYPES[c][2])
                    for _ in range(n)]
            data[c] = build_array(c, vals)
        files.append(pa.table(data))
    groups = [draw(st.integers(1, 4)) for _ in files]
    return files, writer, groups


def write_files(root: str, files: list[pa.Table], writer: str, groups: list[int]) -> None:
    os.makedirs(root, exist_ok=True)
    for i, (t, g) in enumerate(zip(files, groups)):
        path = os.path.join(root, f"part-{i:03d}.parquet")
        if writer == "pyarrow":
            pq.write_table(t, path, row_group_size=g)
        elif writer == "pandas":  # what pandas users write: nullable dtypes for integers and booleans
            df = t.to_pandas(types_mapper=_nullable)
            df.to_parquet(path, index=False, row_group_size=g)
        else:
            con = duckdb.connect()
            try:
                con.register("t", t)
                con.execute(f"COPY t TO '{path}' (FORMAT parquet, ROW_GROUP_SIZE {max(g, 1)})")
            finally:
                con.close()


_PANDAS_NULLABLE = {pa.int8(): pd.Int8Dtype(), pa.int16(): pd.Int16Dtype(), pa.int32(): pd.Int32Dtype(),
                    pa.int64(): pd.Int64Dtype(), pa.uint8(): pd.UInt8Dtype(), pa.uint16(): pd.UInt16Dtype(),
                    pa.uint32(): pd.UInt32Dtype(), pa.uint64(): pd.UInt64Dtype(), pa.bool_(): pd.BooleanDtype()}


def _nullable(t: pa.DataType) -> object:
    return _PANDAS_NULLABLE.get(t)


# ---------------------------------------------------------------- normalising values (the comparison)


def _unit_ns(t: pa.DataType) -> int:
    if pa.types.is_date32(t):
        return _DAY * 10 ** 9
    if pa.types.is_date64(t):
        return 10 ** 6
    return _NS[t.unit]


def _plain(v: object) -> object:
    if isinstance(v, float):
        return "NaN" if math.isnan(v) else v
    if isinstance(v, dict):
        if set(v) == {"key", "value"}:
            return (_plain(v["key"]), _plain(v["value"]))
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple, np.ndarray)):
        return [_plain(x) for x in v]
    if isinstance(v, bytearray):
        return bytes(v)
    return v


def norm(arr: pa.Array | pa.ChunkedArray, like: pa.DataType | None = None) -> list:
    """Comparable Python values: temporal as integer nanoseconds (dates as their midnight), floats with
    nulls and NaN alike ("NaN"), dictionaries decoded. ``like``: the oracle's type, for a reader that kept
    a temporal column's integers but not its type (e.g. DuckDB writes a duration as int64)."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks else pa.array([], arr.type)
    t = arr.type
    if pa.types.is_dictionary(t):
        arr = arr.cast(t.value_type)
        t = arr.type
    if pa.types.is_temporal(t) or (like is not None and pa.types.is_temporal(like) and pa.types.is_integer(t)):
        unit = _unit_ns(t if pa.types.is_temporal(t) else like)
        ints = arr.cast(pa.int32() if t.bit_width == 32 else pa.int64()).to_pylist()
        return [None if v is None else v * unit for v in ints]
    if pa.types.is_floating(t):
        return ["NaN" if v is None or math.isnan(v) else v for v in arr.cast(pa.float64()).to_pylist()]
    return [_plain(v) for v in arr.to_pylist()]


def _float_like(t: pa.DataType) -> bool:
    return pa.types.is_floating(t)


def check_values(got: list, want: list, what: str) -> None:
    assert len(got) == len(want), f"{what}: {len(got)} rows, pyarrow reads {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w or (g in (None, "NaN") and w in (None, "NaN")), f"{what} row {i}: got {g!r}, pyarrow reads {w!r}"


def _decimal_back(x: float, scale: int) -> decimal.Decimal:
    """A decimal of at most 15 digits from its float64 (the nearest double rounds back exactly)."""
    return round(decimal.Decimal(x), scale)


# ---------------------------------------------------------------- what each entry point must give


def expected_torch_dtype(t: pa.DataType) -> torch.dtype | None:
    if pa.types.is_dictionary(t):
        return expected_torch_dtype(t.value_type)
    if pa.types.is_boolean(t):
        return torch.bool
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return getattr(torch, str(np.dtype(t.to_pandas_dtype())))
    if pa.types.is_temporal(t):
        return torch.int64
    if pa.types.is_decimal(t):
        return torch.float64
    return None  # a list of Python values


def check_tensor_like(name: str, values: np.ndarray, valid: np.ndarray | None, oracle: pa.ChunkedArray,
                      what: str) -> None:
    """A numeric column: its non-null values equal pyarrow's, its nulls are marked in the mask."""
    t = oracle.type
    want_valid = np.asarray(oracle.is_valid().to_numpy(zero_copy_only=False), dtype=bool)
    if oracle.null_count:
        assert valid is not None, f"{what}: column {name} holds nulls but the batch has no {name}{MASK} mask"
    if valid is not None:
        assert np.array_equal(valid, want_valid), f"{what}: mask of {name} differs from pyarrow's nulls"
    keep = want_valid
    if pa.types.is_decimal(t):
        got = [_decimal_back(float(x), t.scale) for x in values[keep]]
        want = [v for v in oracle.to_pylist() if v is not None]
        check_values(got, want, f"{what} {name}")
        return
    want = [v for v in norm(oracle) if v is not None]
    if values.dtype.kind in "Mm":
        unit = np.datetime_data(values.dtype)[0]
        got = [int(v) * (_DAY * 10 ** 9 if unit == "D" else _NS[unit]) for v in values[keep].view(np.int64)]
    elif pa.types.is_temporal(t):
        got = [int(v) * _unit_ns(t) for v in values[keep]]
    elif values.dtype.kind == "f":
        got = ["NaN" if math.isnan(v) else float(v) for v in values[keep].astype(np.float64)]
        assert np.all(np.isnan(values[~keep].astype(np.float64))), f"{what}: a null of {name} is not NaN"
    else:
        got = [_plain(v.item()) for v in values[keep]]
    if pa.types.is_floating(t):
        want = ["NaN" if v is None else v for v in norm(oracle.filter(oracle.is_valid()))]
    check_values(got, want, f"{what} {name}")


def check_dataset(path: str, oracle: pa.Table, batch_size: int, fmt: str, columns: list[str]) -> None:
    """``ParquetDataset(path, format=fmt)`` against the oracle: values, nulls, and dtypes fixed per column."""
    ds = ParquetDataset(path, batch_size=batch_size, format=fmt, columns=columns)
    batches = list(ds)
    assert sum(len(b) if fmt in ("arrow", "pandas") else len(next(iter(b.values()))) for b in batches) \
        == oracle.num_rows, f"{fmt}: row count"
    off = 0
    seen: dict[str, object] = {}
    keys = None
    for b in batches:
        n = len(b) if fmt in ("arrow", "pandas") else len(next(iter(b.values())))
        part = oracle.slice(off, n)
        off += n
        if fmt == "arrow":
            for c in columns:
                assert b.schema.field(c).type == oracle.schema.field(c).type, f"arrow: type of {c}"
                check_values(norm(b.column(c)), norm(part.column(c)), f"arrow {c}")
            continue
        if fmt == "pandas":
            assert list(b.columns) == columns
            for c in columns:
                dt = str(b[c].dtype)
                assert seen.setdefault(c, dt) == dt, f"pandas: dtype of {c} changed from {seen[c]} to {dt}"
                check_pandas_column(b[c], part.column(c), f"pandas {c}")
            continue
        ks = sorted(b)
        assert keys is None or ks == keys, f"{fmt}: the batch keys changed from {keys} to {ks}"
        keys = ks
        for c in columns:
            v = b[c]
            oc = part.column(c)
            t = oc.type
            valid = b.get(c + MASK)
            if isinstance(v, list) or (isinstance(v, np.ndarray) and v.dtype == object):
                assert valid is None, f"{fmt}: {c} is a list of values, its nulls are None: no mask"
                vals = list(v)
                if pa.types.is_decimal(t):
                    check_values([_plain(x) for x in vals], oc.to_pylist(), f"{fmt} {c}")
                else:
                    check_values([_plain(x) for x in vals], norm(oc), f"{fmt} {c}")
                continue
            if fmt == "torch":
                assert isinstance(v, torch.Tensor), f"torch: {c} is a {type(v)}"
                assert v.dtype == expected_torch_dtype(t), f"torch: {c} ({t}) is {v.dtype}"
                arr = v.numpy()
                mask = valid.numpy() if valid is not None else None
            else:
                arr, mask = v, valid
            dt = str(arr.dtype)
            assert seen.setdefault(c, dt) == dt, f"{fmt}: dtype of {c} changed from {seen[c]} to {dt}"
            check_tensor_like(c, arr, mask, oc, f"{fmt}")


def check_pandas_column(s: pd.Series, oracle: pa.ChunkedArray, what: str) -> None:
    t = oracle.type
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        assert isinstance(s.dtype, pd.api.extensions.ExtensionDtype) or not oracle.null_count, \
            f"{what}: {s.dtype} cannot hold the nulls of a {t} column"
    if pa.types.is_decimal(t) or pa.types.is_map(t) or pa.types.is_nested(t) or pa.types.is_null(t):
        got = [None if v is None or (isinstance(v, float) and math.isnan(v)) else _plain(v) for v in s.tolist()]
        want = oracle.to_pylist() if pa.types.is_decimal(t) else norm(oracle)
        if pa.types.is_decimal(t) and s.dtype.kind == "f":  # a float column: the rounding must be undone exactly
            got = [None if v is None or math.isnan(v) else _decimal_back(v, t.scale) for v in s.tolist()]
        check_values(got, want, what)
        return
    arr = pa.Array.from_pandas(s)
    check_values(norm(arr, like=t), norm(oracle), what)


# ---------------------------------------------------------------- the differential check


def differential(tmp: str, files: list[pa.Table], writer: str, groups: list[int], batch_size: int) -> None:
    root = os.path.join(tmp, uuid.uuid4().hex[:8])
    write_files(root, files, writer, groups)
    oracle = pads.dataset(root, format="parquet", partitioning="hive").to_table()
    cols = oracle.column_names
    exact = [c for c in cols if not (pa.types.is_decimal(oracle.schema.field(c).type)
                                     and oracle.schema.field(c).type.precision > 15)]
    if oracle.num_rows == 0:
        return
    if len(exact) < len(cols):  # a decimal of more than 15 digits has no exact tensor: refused by name
        with pytest.raises(LossyColumnError):
            ParquetDataset(root, batch_size=batch_size)
    if exact:
        check_dataset(root, oracle, batch_size, "torch", exact)
    for fmt in ("numpy", "arrow", "pandas"):
        check_dataset(root, oracle, batch_size, fmt, cols)
    df = load_table(root)
    assert list(df.columns) == cols
    for c in cols:
        check_pandas_column(df[c], oracle.column(c), f"load_table {c}")
    out = os.path.join(tmp, uuid.uuid4().hex[:8] + "-export")
    try:
        export_parquet(root, out)
    except duckdb.ConversionException:  # DuckDB holds timestamps as microseconds: it refuses what overflows
        assert any(_beyond_duckdb(oracle.column(c)) for c in cols), "export_parquet refused values it can hold"
        return
    back = pq.read_table(out)
    for c in cols:
        want, got = norm(oracle.column(c)), norm(back.column(c), like=oracle.schema.field(c).type)
        far = _beyond_duckdb(oracle.column(c))
        if far:  # the int64 extremes of a s/ms timestamp are DuckDB's +-infinity: kept as integers, in us
            got = [g for g, bad in zip(got, far) if not bad]
            want = [w for w, bad in zip(want, far) if not bad]
        check_values(got, want, f"export_parquet read back {c}")


_US_LIMIT = (2 ** 63 - 1) * 1000  # nanoseconds


def _beyond_duckdb(col: pa.ChunkedArray) -> list[bool]:
    """Rows of a timestamp column that DuckDB's microseconds cannot hold (empty for other columns)."""
    if not pa.types.is_timestamp(col.type) or col.type.unit not in ("s", "ms"):
        return []
    return [v is not None and abs(v) >= _US_LIMIT for v in norm(col)]


@given(tables(), st.integers(1, 7))
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                       HealthCheck.too_slow,
                                                                       HealthCheck.data_too_large])
@pytest.mark.timeout(max(300, 2 * EXAMPLES))  # a second or two per table on a busy machine
def test_every_entry_point_reads_what_pyarrow_reads(tmp_path, spec, batch_size):
    files, writer, groups = spec
    differential(str(tmp_path), files, writer, groups, batch_size)


def _limits(name: str) -> list:
    typ = TYPES[name][0]
    if pa.types.is_integer(typ):
        lo, hi = (_signed(typ.bit_width) if pa.types.is_signed_integer(typ) else (0, 2 ** typ.bit_width - 1))
        return [lo, hi, 2 ** 53 + 1 if typ.bit_width == 64 else 0]
    table = {"float16": [65504.0, -65504.0, float("nan")], "float32": [3.4028234663852886e38, 1e-45, float("inf")],
             "float64": [1.7976931348623157e308, 5e-324, float("nan")], "bool": [True, False, True],
             "dec5_2": [decimal.Decimal("999.99"), decimal.Decimal("-999.99"), decimal.Decimal("0.01")],
             "dec15_3": [decimal.Decimal("999999999999.999"), decimal.Decimal("-0.001"), decimal.Decimal("0.1")],
             "dec38_10": [decimal.Decimal("9" * 28 + "." + "9" * 10), decimal.Decimal("-1e-10"),
                          decimal.Decimal("0")],
             "date32": [-(2 ** 31), 2 ** 31 - 1, 0], "ts_s": [-(_I64[1] // 1000), _I64[1] // 1000, 0],
             "ts_ms": [_I64[0], _I64[1], 1], "ts_us": [_I64[0], _I64[1], 1], "ts_ns": [_I64[0], _I64[1], 1],
             "ts_us_utc": [_I64[0], _I64[1], 1], "time32_s": [0, _DAY - 1, 1],
             "time32_ms": [0, _DAY * 1000 - 1, 1], "time64_us": [0, _DAY * 10 ** 6 - 1, 1],
             "time64_ns": [0, _DAY * 10 ** 9 - 1, 1], "dur_s": [_I64[0], _I64[1], 0], "dur_ns": [_I64[0], _I64[1], 0],
             "string": ["", "é\x00x", "z" * 50], "large_string": ["a", "", "b"], "binary": [b"\x00", b"", b"\xff"],
             "large_binary": [b"", b"\x01", b"x"], "dict_string": ["a", "bb", "a"],
             "struct": [{"a": _I64[1], "b": None}, {"a": None, "b": "x"}, {"a": 2 ** 53 + 1, "b": ""}],
             "list": [[_I64[1], None], [], [2 ** 53 + 1]], "large_list": [[127, -128], [], [0]],
             "fsl": [[2 ** 31 - 1, -(2 ** 31)], [0, 0], [1, 2]], "map": [[("k", _I64[1])], [], [("", 2 ** 53 + 1)]],
             "null": [None, None, None]}
    return table[name]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("writer", ["pyarrow", "duckdb"])
def test_every_type_at_its_limits_with_nulls_in_some_files(tmp_path, writer):
    """The whole type table at once: a file without nulls, one with a null in every column, one all null;
    ids past 2**53 (the issue's case: one null in a file turned 2**53+5 into 2**53+4 and 1.7e18+k into 1.7e18)."""
    names = [n for n, spec in TYPES.items() if writer in spec[3]]
    files = [pa.table({n: build_array(n, _limits(n)) for n in names}),
             pa.table({n: build_array(n, [_limits(n)[1], None, _limits(n)[2]]) for n in names}),
             pa.table({n: build_array(n, [None, None]) for n in names})]
    differential(str(tmp_path), files, writer, [2, 1, 2], 2)
    differential(str(tmp_path), files, writer, [3, 3, 3], 3)


def test_the_issue_case_ids_past_2_53_keep_their_value_and_dtype(tmp_path):
    pq.write_table(pa.table({"id": pa.array([2 ** 53 + 1, 2 ** 53 + 3], pa.int64())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"id": pa.array([None, 2 ** 53 + 5], pa.int64())}), tmp_path / "b.parquet")
    batches = list(ParquetDataset(str(tmp_path), batch_size=2))
    assert [b["id"].dtype for b in batches] == [torch.int64, torch.int64]
    assert [b["id"].tolist() for b in batches][0] == [2 ** 53 + 1, 2 ** 53 + 3]
    assert batches[1]["id"][1].item() == 2 ** 53 + 5
    assert [b["id" + MASK].tolist() for b in batches] == [[True, True], [False, True]]
    big = [int(1.7e18) + k for k in range(1, 5)]
    pq.write_table(pa.table({"id": pa.array(big + [None], pa.int64())}), tmp_path / "c.parquet")
    (b,) = list(ParquetDataset(str(tmp_path / "c.parquet"), batch_size=5))
    assert b["id"][:4].tolist() == big and b["id" + MASK].tolist() == [True] * 4 + [False]
