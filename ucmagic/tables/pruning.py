"""Sound pruning of a SQL ``filter=``: which row groups' statistics prove that no row can match.

A row is kept where the predicate is TRUE. For each row group this module computes, node by node of DuckDB's
parse of the predicate, which of TRUE, FALSE and NULL the node *may* take on some row of the group (Kleene
logic over sets: ``AND``, ``OR``, ``NOT`` combine them exactly); the group is skipped only where TRUE is
impossible. Anything it cannot reason about may be anything, so it is read (the exact pass decides every row).

A predicate with a part that may raise on some row (a ``CAST``, most functions, a string literal compared with an
expression) prunes nothing: DuckDB raises where a row reaches that part, so every row is read and the exact pass
raises the same error (``FilterError``), where skipping a group would have hidden it.

What it reasons about: a column (or a struct field, ``st.a``) compared with a constant (``=``, ``<>``, ``<``,
``<=``, ``>``, ``>=``, ``IN``, ``BETWEEN``), ``IS [NOT] NULL``, constant predicates (``1 = 1``, ``NULL``) and
boolean columns. The values are compared by DuckDB itself, the evaluator of the exact pass: each row group's
minimum and maximum become a one-row-per-group Arrow table *of the column's own type* (decimals as decimals,
timestamps in their unit and zone) and the comparison DuckDB parsed is evaluated with the minimum or maximum in
place of the column, so the constant is converted exactly as DuckDB converts it for the column. That is sound
when DuckDB's conversion of the column is monotone, so a comparison is used only for type pairs where it is
(numbers with numbers or a string literal; strings with strings; dates and timestamps of one kind with their
own kind or a string literal; ...), and ``IN``/``BETWEEN`` only when their constants share one type (DuckDB
converts all of them to a common type there, which a pairwise comparison would not follow). Floats: statistics
leave NaN out and DuckDB orders NaN above every number, so a float column's maximum is taken as NaN.

Call order: ``PrunePlan.build(where, resolve, schema, connect)`` once per filter (pure over the parse, one
DuckDB query for the constants' types); then ``plan.may_match(groups, connect)`` for any batch of row groups
(:class:`GroupStats` from :func:`file_group_stats`), one DuckDB query per batch. ``connect()`` gives a DuckDB
connection the caller owns (this module never closes it).
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import numpy as np

__all__ = ["PrunePlan", "GroupStats", "file_group_stats", "value_family"]

Path = tuple[str, ...]
_CMP = {"COMPARE_EQUAL": "=", "COMPARE_NOTEQUAL": "<>", "COMPARE_LESSTHAN": "<", "COMPARE_GREATERTHAN": ">",
        "COMPARE_LESSTHANOREQUALTO": "<=", "COMPARE_GREATERTHANOREQUALTO": ">="}
_TYPE = {v: k for k, v in _CMP.items()}
_FLIP = {"=": "=", "<>": "<>", "<": ">", ">": "<", "<=": ">=", ">=": "<="}
_NUMBERS = {"TINYINT", "SMALLINT", "INTEGER", "BIGINT", "HUGEINT", "UTINYINT", "USMALLINT", "UINTEGER", "UBIGINT",
            "UHUGEINT", "FLOAT", "DOUBLE"}
_TIMESTAMPS = {"TIMESTAMP", "TIMESTAMP_S", "TIMESTAMP_MS", "TIMESTAMP_NS"}


def value_family(t: Any) -> str | None:
    """The family of an Arrow type whose Parquet statistics this module compares (None: not compared)."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t) or (pa.types.is_decimal(t) and t.bit_width <= 128):
        return "num"
    if pa.types.is_float32(t) or pa.types.is_float64(t):
        return "float"
    if pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t):
        return "str"
    if (pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t)
            or pa.types.is_binary_view(t)):
        return "bin"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_date(t):
        return "date"
    if pa.types.is_timestamp(t):
        return "tstz" if t.tz else "ts"
    if pa.types.is_time(t):
        return "time"
    return None


def _accepts(family: str, ctype: str, literal: bool) -> bool:
    """Whether DuckDB compares a column of ``family`` with a constant of DuckDB type ``ctype`` (``literal``: a
    plain string literal, which DuckDB converts to the column's type) through a monotone conversion."""
    if family in ("num", "float"):
        return literal or ctype in _NUMBERS or ctype.startswith("DECIMAL")
    if family == "str":
        return ctype == "VARCHAR"
    if family == "bin":
        return literal or ctype == "BLOB"
    if family == "bool":
        return literal or ctype == "BOOLEAN"
    if family == "date":
        return literal or ctype in ("DATE", "TIMESTAMP")
    if family == "ts":
        return literal or ctype in _TIMESTAMPS or ctype == "DATE"
    if family == "tstz":
        return literal or ctype.startswith("TIMESTAMP WITH TIME ZONE") or ctype.startswith("TIMESTAMPTZ")
    if family == "time":
        return literal or ctype == "TIME"
    return False


# ---------------------------------------------------------------- statistics of row groups


@dataclass
class GroupStats:
    """The statistics of a batch of row groups for the plan's column paths: ``low[k]``/``high[k]`` Arrow arrays of
    the column's type (null: unknown), ``nulls[k]`` the nulls counted (-1: unknown), ``rows`` per group."""

    rows: np.ndarray
    low: list[Any] = field(default_factory=list)
    high: list[Any] = field(default_factory=list)
    nulls: list[np.ndarray] = field(default_factory=list)


def _leaf_type(schema: Any, path: Path) -> Any:
    """The Arrow type at ``path`` (a top-level column, then struct fields) of ``schema``; None if absent."""
    import pyarrow as pa

    if path[0] not in schema.names:
        return None
    t = schema.field(path[0]).type
    for name in path[1:]:
        if not pa.types.is_struct(t) or t.get_field_index(name) < 0:
            return None
        t = t.field(name).type
    return t


def _bounds(stats: Any, phys: str, logical: dict[str, Any], ftype: Any) -> tuple[Any, Any]:
    """``(min, max)`` of a column chunk's statistics as Python values or raw integers (see :func:`_array`)."""
    import pyarrow as pa

    if stats is None or not stats.has_min_max:
        return None, None
    t = ftype.value_type if pa.types.is_dictionary(ftype) else ftype
    if pa.types.is_date(t) or pa.types.is_timestamp(t) or pa.types.is_time(t):
        if phys not in ("INT32", "INT64"):  # INT96 timestamps: no trusted statistics
            return None, None
        return int(stats.min_raw), int(stats.max_raw)
    try:
        return stats.min, stats.max
    except (ValueError, UnicodeDecodeError, OverflowError, ArithmeticError):
        return None, None


_UNITS = {"MILLIS": "ms", "MICROS": "us", "NANOS": "ns", "milliseconds": "ms", "microseconds": "us",
          "nanoseconds": "ns"}


def _array(values: list[Any], ftype: Any, logical: dict[str, Any], want: Any) -> Any:
    """``values`` (bounds of one file's row groups) as an Arrow array of ``want`` (the table's type of the
    column): dates, times and timestamps from the raw integers in the unit the file's logical type names;
    an array of nulls where the values do not convert exactly."""
    import pyarrow as pa

    target = want.value_type if pa.types.is_dictionary(want) else want
    t = ftype.value_type if pa.types.is_dictionary(ftype) else ftype
    try:
        if pa.types.is_date(t):
            arr = pa.array(values, pa.int32()).cast(pa.date32())
        elif pa.types.is_timestamp(t) or pa.types.is_time(t):
            unit = _UNITS.get(str((logical.get("timeUnit") or "")).strip())
            if unit is None:
                unit = t.unit
            if pa.types.is_timestamp(t):
                arr = pa.array(values, pa.int64()).cast(pa.timestamp(unit, t.tz))
            else:
                arr = pa.array(values, pa.int32() if unit == "ms" else pa.int64()).cast(
                    pa.time32(unit) if unit == "ms" else pa.time64(unit))
        else:
            arr = pa.array(values, t)
        return arr if arr.type == target else arr.cast(target, safe=True)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError, OverflowError, TypeError, ValueError):
        return pa.nulls(len(values), target)


def file_group_stats(md: Any, file_schema: Any, paths: Sequence[Path], types: Sequence[Any],
                     constants: dict[str, tuple[Any, Any]] | None = None,
                     names: dict[Path, str] | None = None) -> GroupStats:
    """The statistics of every row group of one file (footer ``md``, its Arrow schema ``file_schema``; None: the
    statistics are not to be used) for the
    column ``paths`` (typed as ``types``, the table's). ``constants``: columns with one value in the whole
    file, ``{column: (value, Arrow type)}`` (Hive or Delta partition values; None is null). ``names``: a
    path's top-level name in the file where it differs (Delta column mapping). A column the file lacks is null."""
    import pyarrow as pa

    n = md.num_row_groups
    rows = np.array([md.row_group(j).num_rows for j in range(n)], dtype=np.int64)
    out = GroupStats(rows)
    leaves = {tuple(md.schema.column(i).path.split(".")): i for i in range(md.num_columns)}
    for path, want in zip(paths, types):
        target = want.value_type if pa.types.is_dictionary(want) else want
        top = path[0]
        if constants and top in constants and len(path) == 1:
            value, typ = constants[top]
            arr = _array([value] * n, typ, {}, want) if value is not None else pa.nulls(n, target)
            out.low.append(arr)
            out.high.append(arr)
            out.nulls.append(rows.copy() if value is None else np.zeros(n, dtype=np.int64))
            continue
        fpath = ((names or {}).get(path, top),) + tuple(path[1:])
        if file_schema is None:  # statistics that cannot be matched to the column (Delta column mapping)
            out.low.append(pa.nulls(n, target))
            out.high.append(pa.nulls(n, target))
            out.nulls.append(np.full(n, -1, dtype=np.int64))
            continue
        ftype = _leaf_type(file_schema, fpath)
        leaf = leaves.get(fpath)
        if ftype is None:  # the file predates the column: null in every row
            out.low.append(pa.nulls(n, target))
            out.high.append(pa.nulls(n, target))
            out.nulls.append(rows.copy())
            continue
        lows: list[Any] = []
        highs: list[Any] = []
        nulls = np.full(n, -1, dtype=np.int64)
        logical: dict[str, Any] = {}
        if leaf is not None:
            col = md.schema.column(leaf)
            try:
                logical = json.loads(col.logical_type.to_json())
            except (ValueError, AttributeError):
                logical = {}
            for j in range(n):
                meta = md.row_group(j).column(leaf)
                stats = meta.statistics if meta.is_stats_set else None
                lo, hi = _bounds(stats, col.physical_type, logical, ftype)
                lows.append(lo)
                highs.append(hi)
                if stats is not None and stats.has_null_count:
                    nulls[j] = stats.null_count
        else:  # a nested column that is no leaf of its own (a struct): nothing known
            lows, highs = [None] * n, [None] * n
        low, high = _array(lows, ftype, logical, want), _array(highs, ftype, logical, want)
        if value_family(want) == "float":  # statistics leave NaN out; DuckDB orders NaN above every number
            low = pa.array([None if v is not None and v != v else v for v in low.to_pylist()], target)
            high = pa.array([float("nan")] * n, target)
        out.low.append(low)
        out.high.append(high)
        out.nulls.append(nulls)
    return out


def concat_stats(parts: Sequence[GroupStats], types: Sequence[Any]) -> GroupStats:
    """One :class:`GroupStats` of the row groups of several files, in order."""
    import pyarrow as pa

    out = GroupStats(np.concatenate([p.rows for p in parts]) if parts else np.zeros(0, dtype=np.int64))
    for k, want in enumerate(types):
        target = want.value_type if pa.types.is_dictionary(want) else want
        out.low.append(pa.concat_arrays([p.low[k] for p in parts]) if parts else pa.array([], target))
        out.high.append(pa.concat_arrays([p.high[k] for p in parts]) if parts else pa.array([], target))
        out.nulls.append(np.concatenate([p.nulls[k] for p in parts]) if parts else np.zeros(0, np.int64))
    return out


# ---------------------------------------------------------------- the plan over DuckDB's parse

def _column(name: str) -> dict[str, Any]:
    return {"class": "COLUMN_REF", "type": "COLUMN_REF", "alias": "", "column_names": [name]}


def _compare(op: str, left: dict[str, Any], right: dict[str, Any]) -> dict[str, Any]:
    return {"class": "COMPARISON", "type": _TYPE[op], "alias": "", "left": left, "right": copy.deepcopy(right)}


def _literal_string(node: dict[str, Any]) -> bool:
    lit = node.get("literal") or {}
    return node.get("type") == "VALUE_CONSTANT" and str(lit.get("kind", "")).upper() in ("STRING", "VARCHAR")


_SAFE_FUNCTIONS = frozenset({"~~", "!~~", "~~*", "!~~*", "lower", "upper", "lcase", "ucase", "length", "strlen",
                              "starts_with", "ends_with", "contains", "prefix", "suffix", "isnan", "isinf", "isfinite"})
"""Functions that never raise on a value of their input types (LIKE, ILIKE, case, length, affixes, float tests)."""


def _may_raise(node: Any, constant: Callable[[dict[str, Any]], bool]) -> bool:
    """Whether evaluating ``node`` on some row may raise in DuckDB: a ``CAST`` (not ``TRY_CAST``: an overflow, a
    string that is no number), a function outside :data:`_SAFE_FUNCTIONS` (``abs`` of the least integer, integer
    overflow of ``+``), or a string literal compared with something other than a column (converted to that
    expression's type). Deterministic constants are folded once, before any row (their errors do not depend on
    the data), and are not looked into."""
    if isinstance(node, list):
        return any(_may_raise(n, constant) for n in node)
    if not isinstance(node, dict) or "class" not in node or constant(node):
        return False
    t = node.get("type", "")
    if t == "OPERATOR_CAST" and not node.get("try_cast"):
        return True
    if t == "FUNCTION" and str(node.get("function_name", "")).lower() not in _SAFE_FUNCTIONS:
        return True
    if t in _CMP or t in ("COMPARE_IN", "COMPARE_NOT_IN", "COMPARE_BETWEEN", "COMPARE_NOT_BETWEEN"):
        given = ([node.get("left"), node.get("right")] if t in _CMP else
                 [node.get("input"), node.get("lower"), node.get("upper")] if "BETWEEN" in t else
                 list(node.get("children") or []))
        operands: list[dict[str, Any]] = [o for o in given if isinstance(o, dict)]
        if any(_literal_string(o) for o in operands) and \
                any(not _literal_string(o) and o.get("type") != "COLUMN_REF" for o in operands):
            return True
    return any(_may_raise(v, constant) for k, v in node.items() if isinstance(v, (dict, list)) and k != "literal")


@dataclass
class PrunePlan:
    """How a SQL predicate prunes (see the module). ``paths``/``types``: the column paths whose statistics it
    reads and their Arrow types; ``tree``: the node plan; ``leaves``: DuckDB expressions over the statistics."""

    statement: dict[str, Any]
    paths: list[Path]
    types: list[Any]
    tree: tuple[Any, ...]
    leaves: list[dict[str, Any]]

    @property
    def prunes(self) -> bool:
        """Whether any part of the predicate can rule a row group out."""
        return self.tree[0] != "any"

    @classmethod
    def build(cls, statement: dict[str, Any], resolve: Callable[[list[str]], tuple[Path, Any] | None],
              constant: Callable[[dict[str, Any]], bool], connect: Callable[[], Any]) -> PrunePlan:
        """The plan of ``statement`` (DuckDB's parse of ``SELECT * FROM ucmagic_rows WHERE ...``).
        ``resolve(column_names)``: the column path and its Arrow type, or None (not a column of the table);
        ``constant(node)``: whether a subtree is a deterministic constant (no column, no volatile function)."""
        paths: list[Path] = []
        types: list[Any] = []
        consts: list[dict[str, Any]] = []  # constants whose DuckDB type decides whether a comparison prunes

        def path_of(node: dict[str, Any]) -> int | None:
            if node.get("type") != "COLUMN_REF":
                return None
            got = resolve(list(node.get("column_names") or []))
            if got is None or got[1] is None or value_family(got[1]) is None:
                return None
            if got[0] not in paths:
                paths.append(got[0])
                types.append(got[1])
            return paths.index(got[0])

        def const(node: dict[str, Any]) -> int:
            consts.append(node)
            return len(consts) - 1

        def walk(node: dict[str, Any]) -> tuple[Any, ...]:
            t = node.get("type", "")
            kids = node.get("children") or []
            if t in ("CONJUNCTION_AND", "CONJUNCTION_OR"):
                return ("and" if t == "CONJUNCTION_AND" else "or", [walk(k) for k in kids])
            if t == "OPERATOR_NOT" and len(kids) == 1:
                return ("not", walk(kids[0]))
            if t in _CMP:
                left, right, op = node["left"], node["right"], _CMP[t]
                k = path_of(left)
                if k is None:
                    left, right, op, k = right, left, _FLIP[op], path_of(right)
                if k is not None and constant(right):
                    return ("cmp", op, k, [const(right)])
            elif t == "COMPARE_IN" and kids:
                k = path_of(kids[0])
                if k is not None and len(kids) > 1 and all(constant(c) for c in kids[1:]):
                    return ("in", k, [const(c) for c in kids[1:]])
            elif t == "COMPARE_BETWEEN":
                k = path_of(node["input"])
                if k is not None and constant(node["lower"]) and constant(node["upper"]):
                    return ("between", k, [const(node["lower"]), const(node["upper"])])
            elif t in ("OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL") and len(kids) == 1:
                k = path_of(kids[0])
                if k is not None:
                    return ("isnull", k, t == "OPERATOR_IS_NOT_NULL")
            elif t == "COLUMN_REF":
                k = path_of(node)
                if k is not None and value_family(types[k]) == "bool":
                    true = {"class": "CONSTANT", "type": "VALUE_CONSTANT", "alias": "",
                            "literal": {"kind": "BOOLEAN", "text": "true"}}
                    return ("cmp", "=", k, [const(true)])
            if constant(node):
                return ("const", const(node))
            return ("any",)

        where = statement["node"]["where_clause"]
        # A part that may raise on some row prunes nothing: DuckDB raises where a row reaches it, and a group
        # skipped by its statistics would hide that error (the exact pass then raises it, as DuckDB does)
        tree = ("any",) if _may_raise(where, constant) else walk(where)
        ctypes = _constant_types(statement, consts, connect) if consts else []
        leaves: list[dict[str, Any]] = []

        def leaf(node: dict[str, Any]) -> int:
            leaves.append(node)
            return len(leaves) - 1

        def accepted(k: int, ids: list[int]) -> bool:
            fam = value_family(types[k])
            kinds = {(ctypes[i], _literal_string(consts[i])) for i in ids}
            if fam is None or len(kinds) != 1:  # IN / BETWEEN of mixed types: DuckDB picks a common type
                return False
            ctype, lit = next(iter(kinds))
            return _accepts(fam, ctype, lit)

        def bounds(k: int, c: dict[str, Any]) -> dict[str, int]:
            lo, hi = _column(f"lo_{k}"), _column(f"hi_{k}")
            return {"lo<": leaf(_compare("<", lo, c)), "lo<=": leaf(_compare("<=", lo, c)),
                    "lo=": leaf(_compare("=", lo, c)), "hi>": leaf(_compare(">", hi, c)),
                    "hi>=": leaf(_compare(">=", hi, c)), "hi=": leaf(_compare("=", hi, c))}

        def finish(p: tuple[Any, ...]) -> tuple[Any, ...]:
            kind = p[0]
            if kind in ("and", "or"):
                parts = [finish(x) for x in p[1]]
                return (kind, parts) if any(x[0] != "any" for x in parts) else ("any",)
            if kind == "not":
                inner = finish(p[1])
                return ("any",) if inner[0] == "any" else ("not", inner)
            if kind == "cmp":
                _, op, k, ids = p
                return ("cmp", op, k, bounds(k, consts[ids[0]])) if accepted(k, ids) else ("any",)
            if kind == "in":
                _, k, ids = p
                return ("in", k, [bounds(k, consts[i]) for i in ids]) if accepted(k, ids) else ("any",)
            if kind == "between":
                _, k, ids = p
                if not accepted(k, ids):
                    return ("any",)
                order = leaf(_compare("<=", consts[ids[0]], consts[ids[1]]))
                return ("between", k, bounds(k, consts[ids[0]]), bounds(k, consts[ids[1]]), order)
            if kind == "const":
                if ctypes[p[1]] not in ("BOOLEAN", '"NULL"'):
                    return ("any",)
                return ("const", leaf(copy.deepcopy(consts[p[1]])))
            return p

        return cls(statement, paths, types, finish(tree), leaves)

    # ------------------------------------------------------------ evaluation

    def may_match(self, stats: GroupStats, connect: Callable[[], Any]) -> np.ndarray:
        """Per row group of ``stats``: False where its statistics prove the predicate TRUE on no row."""
        n = len(stats.rows)
        if not self.prunes or n == 0:
            return np.ones(n, dtype=bool)
        vals = self._leaf_values(stats, connect) if self.leaves else []
        t, _, _ = self._eval(self.tree, stats, vals, n)
        return t

    def _leaf_values(self, stats: GroupStats, connect: Callable[[], Any]) -> list[np.ndarray]:
        """Each leaf over the statistics: an object array of True / False / None (unknown)."""
        import pyarrow as pa

        cols: dict[str, Any] = {"__n": pa.array(np.arange(len(stats.rows)))}
        for k in range(len(self.paths)):
            cols[f"lo_{k}"], cols[f"hi_{k}"] = stats.low[k], stats.high[k]
        sql = _select_sql(self.statement, self.leaves, "ucmagic_stats", connect)
        con = connect()
        try:
            con.register("ucmagic_stats", pa.table(cols))
            got = con.execute(sql).fetchall()
        finally:
            con.unregister("ucmagic_stats")
        out = []
        for i in range(len(self.leaves)):
            arr = np.empty(len(got), dtype=object)
            arr[:] = [row[i] for row in got]
            out.append(arr)
        return out

    def _eval(self, p: tuple[Any, ...], stats: GroupStats, vals: list[np.ndarray],
              n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(may be TRUE, may be FALSE, may be NULL)`` per row group for the plan node ``p``."""
        every = np.ones(n, dtype=bool)
        kind = p[0]
        if kind == "any":
            return every, every.copy(), every.copy()

        def maybe(i: int) -> np.ndarray:  # the leaf is not known to be false
            v = vals[i]
            return np.array([x is not False for x in v], dtype=bool)

        def surely(i: int) -> np.ndarray:  # the leaf is known to be true
            v = vals[i]
            return np.array([x is True for x in v], dtype=bool)

        if kind == "const":
            v = vals[p[1]]
            return (np.array([x is True for x in v], dtype=bool), np.array([x is False for x in v], dtype=bool),
                    np.array([x is None for x in v], dtype=bool))
        if kind in ("and", "or"):
            parts = [self._eval(x, stats, vals, n) for x in p[1]]
            t, f, nl = parts[0]
            for bt, bf, bn in parts[1:]:
                if kind == "and":
                    t, f, nl = t & bt, f | bf, (nl & (bt | bn)) | (bn & (t | nl))
                else:
                    t, f, nl = t | bt, f & bf, (nl & (bf | bn)) | (bn & (f | nl))
            return t, f, nl
        if kind == "not":
            t, f, nl = self._eval(p[1], stats, vals, n)
            return f, t, nl
        k = p[2] if kind == "cmp" else p[1]
        nulls, rows = stats.nulls[k], stats.rows
        may_null = nulls != 0  # -1: unknown
        all_null = nulls == rows
        some_value = ~all_null
        if kind == "isnull":
            t, f = may_null, some_value
            if p[2]:  # IS NOT NULL
                t, f = f, t
            return t.copy(), f.copy(), np.zeros(n, dtype=bool)
        if kind == "cmp":
            op, b = p[1], p[3]
            t, f = _compare_sets(op, b, maybe, surely)
        elif kind == "in":
            t = np.zeros(n, dtype=bool)
            same = np.zeros(n, dtype=bool)
            for b in p[2]:
                t |= maybe(b["lo<="]) & maybe(b["hi>="])
                same |= surely(b["lo="]) & surely(b["hi="])
            f = ~same
        else:  # between lo and hi: lo <= x AND x <= hi
            blo, bhi, order = p[2], p[3], p[4]
            t = maybe(blo["hi>="]) & maybe(bhi["lo<="]) & maybe(order)
            f = maybe(blo["lo<"]) | maybe(bhi["hi>"])
        return t & some_value, f & some_value, may_null.copy()


def _compare_sets(op: str, b: dict[str, int], maybe: Callable[[int], np.ndarray],
                  surely: Callable[[int], np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """``(may be TRUE, may be FALSE)`` of ``x op c`` for the non-null values ``x`` of a row group, from the leaves
    comparing its minimum (``lo``) and maximum (``hi``) with ``c`` (DuckDB's conversion is monotone)."""
    one = surely(b["lo="]) & surely(b["hi="])  # every value equals c
    if op == "=":
        return maybe(b["lo<="]) & maybe(b["hi>="]), ~one
    if op == "<>":
        return ~one, maybe(b["lo<="]) & maybe(b["hi>="])
    if op == "<":
        return maybe(b["lo<"]), maybe(b["hi>="])
    if op == "<=":
        return maybe(b["lo<="]), maybe(b["hi>"])
    if op == ">":
        return maybe(b["hi>"]), maybe(b["lo<="])
    return maybe(b["hi>="]), maybe(b["lo<"])  # >=


def _select_sql(statement: dict[str, Any], exprs: Iterable[dict[str, Any]], table: str,
                connect: Callable[[], Any]) -> str:
    """SQL text of ``SELECT exprs... FROM table`` (DuckDB's own serialisation of the expression trees)."""
    stmt = copy.deepcopy(statement)
    node = stmt["node"]
    node["select_list"] = list(exprs)
    node["where_clause"] = None
    node["from_table"]["table_name"] = table
    node["from_table"]["qualified_name"] = {"path": [table]}
    got = connect().execute("SELECT json_deserialize_sql(?)", [json.dumps({"error": False, "statements": [stmt]})])
    return str(got.fetchall()[0][0])


def _constant_types(statement: dict[str, Any], consts: list[dict[str, Any]], connect: Callable[[], Any]) -> list[str]:
    """DuckDB's type of each constant expression (``typeof``); ``"?"`` for each when they cannot be typed."""
    import pyarrow as pa

    exprs = [{"class": "FUNCTION", "type": "FUNCTION", "alias": "", "function_name": "typeof", "schema": "",
              "filter": None, "order_bys": {"type": "ORDER_MODIFIER", "orders": []}, "distinct": False,
              "is_operator": False, "export_state": False, "catalog": "",
              "arguments": [{"name": "", "expression": copy.deepcopy(c)}], "qualified_name": {"path": ["typeof"]},
              "is_legacy_function_call": False} for c in consts]
    try:
        sql = _select_sql(statement, exprs, "ucmagic_one", connect)
        con = connect()
        try:
            con.register("ucmagic_one", pa.table({"x": [0]}))
            return [str(v) for v in con.execute(sql).fetchall()[0]]
        finally:
            con.unregister("ucmagic_one")
    except Exception:  # noqa: BLE001 - a constant DuckDB cannot type prunes nothing (the exact pass reports it)
        return ["?"] * len(consts)
