"""What each Arrow type becomes in each output format: decided once from the type, never from the data.

A column's output dtype depends on its Arrow type only, never on whether a file or batch holds nulls, and
no conversion changes a non-null value (docs/tables.md, "Column types"):

- integers and booleans stay integers and booleans; where a column may hold nulls, the torch and numpy
  formats add a validity mask ``batch[name + MASK_SUFFIX]`` (a bool tensor/array, True where a value is
  present) and fill the nulls with 0/False; pandas gets nullable dtypes (``Int64``, ``UInt8``, ``boolean``);
- floats keep NaN for nulls (and the mask says which NaN was a null);
- temporal types are integers in their own unit (torch), datetime64/timedelta64 (numpy, pandas);
- decimals of at most 15 digits are float64, each the nearest double (:func:`decimal_float64`; it rounds back to
  the decimal exactly); wider
  ones are ``decimal.Decimal`` objects in numpy and pandas and a :class:`~ucmagic.errors.LossyColumnError`
  in torch unless ``dtype=`` asks for the rounding;
- strings, binary and nested values are Python values (``None`` for nulls); dictionaries as their values.

Pure functions over pyarrow types and arrays; imports no torch.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from ..errors import LossyColumnError

MASK_SUFFIX = "__valid"
EXACT_FLOAT_DIGITS = 15  # every decimal of at most this many digits survives a float64 round trip

__all__ = ["MASK_SUFFIX", "EXACT_FLOAT_DIGITS", "column_kind", "output_kind", "check_exact", "mask_key",
           "numeric_numpy", "numpy_column", "to_pandas", "pandas_type", "decimal_float64"]


def column_kind(t: Any) -> str:
    """How a column is handed out in torch: ``tensor`` (numbers, booleans), ``int64`` (temporal),
    ``float64`` (decimals of at most 15 digits), ``decode`` (dictionary) or ``list`` (Python values)."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        return "decode"
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return "tensor"
    if pa.types.is_temporal(t):
        return "int64"
    if pa.types.is_decimal(t):
        return "float64" if t.precision <= EXACT_FLOAT_DIGITS else "decimal"
    return "list"


def output_kind(t: Any) -> str:
    import pyarrow as pa

    return column_kind(t.value_type) if pa.types.is_dictionary(t) else column_kind(t)


def check_exact(name: str, t: Any, converted: bool, where: str) -> None:
    """Refuse a torch column that has no exact tensor form (a decimal wider than 15 digits), unless ``dtype=``
    converts it (``converted``): the user asked for the rounding."""
    if output_kind(t) == "decimal" and not converted:
        raise LossyColumnError(
            f"column {name!r} of {where} is {t}: a float64 tensor holds at most {EXACT_FLOAT_DIGITS} digits "
            f"exactly, so its values would be rounded. Pass dtype={{{name!r}: torch.float64}} to accept the "
            "rounding, leave it out with columns=, or read it exactly with format='numpy' / 'pandas' / 'arrow' "
            "(decimal.Decimal values)")


def mask_key(name: str) -> str:
    return name + MASK_SUFFIX


def _zero(t: Any) -> Any:
    import pyarrow as pa

    return pa.scalar(False if pa.types.is_boolean(t) else 0, type=t)


def numeric_numpy(col: Any) -> np.ndarray:
    """A numeric, boolean, temporal-as-integer or float64 column as a numpy array of its own dtype: nulls are 0
    or False (NaN for floats; the caller's mask says which)."""
    import pyarrow as pa

    if col.null_count and not pa.types.is_floating(col.type):
        col = col.fill_null(_zero(col.type))
    return np.asarray(col.to_numpy())


def decimal_float64(col: Any) -> Any:
    """A decimal column as float64: each value the double nearest to it (correctly rounded, as Python's
    ``float(Decimal)``), nulls kept. pyarrow's own cast divides in floating point and lands one ulp off for
    13-52% of values (``0.1269704`` -> ``0.12697039999999998``). Up to 15 digits (and a scale whose power of
    ten is exact) the integer mantissa and ``10**scale`` are both exact doubles, so one IEEE division is the
    nearest double; wider decimals go through their exact decimal text and a correctly rounded parse."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(col, pa.ChunkedArray):
        return pa.chunked_array([decimal_float64(c) for c in col.chunks], pa.float64())
    t = col.type
    if t.precision <= EXACT_FLOAT_DIGITS and -22 <= t.scale <= 22 and len(col):
        width = t.bit_width // 8
        raw = np.frombuffer(col.buffers()[1], dtype=np.int32 if width == 4 else np.int64)
        step = max(1, width // 8)  # the low 64 bits of a decimal128/256 hold a mantissa of 15 digits whole
        mant = raw[col.offset * step:(col.offset + len(col)) * step:step].astype(np.float64)
        vals = mant / 10.0 ** t.scale if t.scale >= 0 else mant * 10.0 ** -t.scale
        mask = None if not col.null_count else np.asarray(col.is_null().to_numpy(zero_copy_only=False), bool)
        return pa.array(vals, pa.float64(), mask=mask)
    return pc.cast(pc.cast(col, pa.string()), pa.float64())


def temporal_int64(col: Any) -> Any:
    """A date/time/timestamp/duration column as int64 in its own unit (days for date32, else the type's unit)."""
    import pyarrow as pa

    width = col.type.bit_width
    return col.cast(pa.int32() if width == 32 else pa.int64()).cast(pa.int64())


def numpy_column(col: Any) -> np.ndarray:
    """``format="numpy"``: numbers and booleans as arrays of their dtype (nulls 0/False, NaN for floats),
    dates and timestamps as datetime64, durations as timedelta64 (nulls NaT), times as int64 in their unit,
    decimals of at most 15 digits as float64, everything else (wider decimals, strings, binary, nested) as an
    object array of Python values (``None`` for nulls)."""
    import pyarrow as pa

    t = col.type
    if pa.types.is_dictionary(t):
        col = col.cast(t.value_type)
        t = col.type
    kind = column_kind(t)
    if kind == "float64":
        col = decimal_float64(col)
    elif pa.types.is_time(t):
        col = temporal_int64(col)
    if kind in ("tensor", "float64") or pa.types.is_time(t):
        return numeric_numpy(col)
    if pa.types.is_timestamp(t) or pa.types.is_date(t) or pa.types.is_duration(t):
        return np.asarray(col.to_numpy(zero_copy_only=False))
    out = np.empty(len(col), dtype=object)
    out[:] = col.to_pylist()
    return out


def pandas_type(t: Any) -> Any:
    """The pandas dtype an Arrow type maps to, or None for pyarrow's default: nullable integers and booleans,
    ``time64[ns]`` kept as an Arrow-backed dtype (``datetime.time`` has no nanoseconds)."""
    import pandas as pd  # type: ignore[import-untyped]
    import pyarrow as pa

    if pa.types.is_integer(t):
        return pd.api.types.pandas_dtype(("UInt" if pa.types.is_unsigned_integer(t) else "Int") + str(t.bit_width))
    if pa.types.is_boolean(t):
        return pd.BooleanDtype()
    if pa.types.is_time64(t) and t.unit == "ns":
        return pd.ArrowDtype(t)
    return None


def to_pandas(table: Any, nullable: Iterable[str] | None = None) -> Any:
    """A pyarrow Table as a DataFrame with no value changed: integers and booleans nullable (all of them, or
    only the columns in ``nullable``), decimals of at most 15 digits as float64 (wider ones ``Decimal``),
    dates as ``datetime64[ms]`` and timestamps/durations in their own unit (no nanosecond overflow)."""
    import pyarrow as pa

    keep = None if nullable is None else set(nullable)
    arrays, names = [], []
    for name, col in zip(table.column_names, table.columns):
        t = col.type
        if pa.types.is_dictionary(t):  # as its value type, never a pandas category
            col = col.cast(t.value_type)
            t = col.type
        if column_kind(t) == "float64":
            col = decimal_float64(col)
        arrays.append(col)
        names.append(name)
    fixed = pa.Table.from_arrays(arrays, names=names)

    def mapper(t: Any) -> Any:
        return pandas_type(t)

    def plain_numbers(t: Any) -> Any:  # a column without nulls: numpy integers and booleans
        return None if pa.types.is_integer(t) or pa.types.is_boolean(t) else pandas_type(t)

    import pandas as pd

    if keep is None:
        df = fixed.to_pandas(types_mapper=mapper, date_as_object=False)
    else:
        frames = [fixed.select([i]).to_pandas(types_mapper=mapper if name in keep else plain_numbers,
                                              date_as_object=False) for i, name in enumerate(names)]
        df = pd.concat(frames, axis=1) if frames else fixed.to_pandas()
    for i, col in enumerate(fixed.columns):  # nested values as Python objects: pandas would turn an int64
        if pa.types.is_nested(col.type):     # field with a null inside a struct or list into float64
            df.isetitem(i, pd.Series(col.to_pylist(), index=df.index, dtype=object))
    return df
