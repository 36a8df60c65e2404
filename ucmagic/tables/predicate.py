"""``filter=``: a row predicate for ParquetDataset, load_table and export_parquet.

A :class:`RowFilter` holds a pyarrow compute expression or a SQL predicate string in DuckDB's dialect. It is
applied exactly by the engine of its kind (pyarrow's ``Table.filter`` for an expression, DuckDB for a SQL
string: a row is kept where the predicate is true; null is not true) and, for pruning, as a pyarrow
expression over the row-group statistics and partition values (:meth:`RowFilter.groups_may_match`). A SQL
string is parsed by DuckDB (``json_serialize_sql``) and the parts of it that map to pyarrow (comparisons with
constants, ``IN``, ``BETWEEN``, ``IS [NOT] NULL``, ``AND``/``OR``/``NOT``) become the pruning expression; a
part that does not map only prunes less (the exact evaluation decides every row).

Call order: ``RowFilter.of(filter, schema_names)`` once (None when no filter); then, per file,
``groups_may_match(metadata, partition)`` (pure over a footer); per row group, ``keep(table)`` over a
table holding at least :attr:`columns`.
"""
from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np

from ..errors import ColumnNotFoundError, InvalidArgumentError

__all__ = ["RowFilter", "sql_to_expression"]

_ROW = "__ucmagic_row__"
_CMP = {"COMPARE_EQUAL": "==", "COMPARE_NOTEQUAL": "!=", "COMPARE_LESSTHAN": "<", "COMPARE_GREATERTHAN": ">",
        "COMPARE_LESSTHANOREQUALTO": "<=", "COMPARE_GREATERTHANOREQUALTO": ">="}
_FLIP = {"==": "==", "!=": "!=", "<": ">", ">": "<", "<=": ">=", ">=": "<="}


def _parse_sql(text: str) -> dict[str, Any]:
    """DuckDB's parse of ``SELECT * FROM t WHERE (text)``: its WHERE clause (refuses anything that is not one
    predicate over the row: a second statement, a subquery, an unbalanced parenthesis)."""
    import duckdb

    con = duckdb.connect()
    try:
        quoted = "SELECT * FROM ucmagic_rows WHERE (" + text + ")"  # noqa: S608 - parsed, never run
        got = con.execute("SELECT json_serialize_sql(?)", [quoted]).fetchall()[0][0]
    finally:
        con.close()
    tree = json.loads(got)
    stmts = tree.get("statements") or []
    if tree.get("error") or len(stmts) != 1:
        why = tree.get("error_message") or "not one predicate"
        raise InvalidArgumentError(f"filter {text!r} is not a SQL predicate DuckDB can parse ({why}): write it as "
                                   "a WHERE clause, e.g. \"label = 3 AND score > 0.5\"")
    node = stmts[0]["node"]
    if (node.get("type") != "SELECT_NODE" or node.get("from_table", {}).get("table_name") != "ucmagic_rows"
            or len(node.get("select_list") or []) != 1 or node.get("group_expressions") or node.get("having")
            or node.get("modifiers") or '"SUBQUERY"' in got):
        raise InvalidArgumentError(f"filter {text!r} must be one predicate over a row's columns (no subquery, "
                                   "no second statement): e.g. \"label = 3 AND score > 0.5\"")
    return dict(node["where_clause"])


def _columns_of(node: Any, out: set[str]) -> set[str]:
    if isinstance(node, dict):
        if node.get("type") == "COLUMN_REF" and node.get("column_names"):
            out.add(str(node["column_names"][-1]))
        for v in node.values():
            _columns_of(v, out)
    elif isinstance(node, list):
        for v in node:
            _columns_of(v, out)
    return out


def _literal(node: dict[str, Any]) -> tuple[bool, Any]:
    if node.get("type") != "VALUE_CONSTANT":
        return False, None
    lit = node.get("literal") or node.get("value") or {}
    kind, text = str(lit.get("kind") or lit.get("type", {}).get("id", "")).upper(), lit.get("text")
    if text is None:
        return False, None
    if "INT" in kind:
        return True, int(text)
    if kind in ("NUMERIC", "DECIMAL", "DOUBLE", "FLOAT"):
        return True, float(text)
    if kind in ("STRING", "VARCHAR"):
        return True, str(text)
    if kind == "BOOLEAN":
        return True, str(text).lower() == "true"
    return False, None


def _convert(node: dict[str, Any]) -> tuple[Any, bool]:
    """``(expression or None, exact)``: a pyarrow expression that holds wherever ``node`` holds (exact: and
    only there), or None when nothing of it maps."""
    import pyarrow.compute as pc

    t = node.get("type", "")

    def col(n: dict[str, Any]) -> Any:
        return pc.field(str(n["column_names"][-1])) if n.get("type") == "COLUMN_REF" else None

    if t in _CMP:
        left, right, op = node["left"], node["right"], _CMP[t]
        if col(left) is None:
            left, right, op = right, left, _FLIP[op]
        f = col(left)
        ok, v = _literal(right)
        if f is None or not ok:
            return None, False
        e = {"==": f == v, "!=": f != v, "<": f < v, ">": f > v, "<=": f <= v, ">=": f >= v}[op]
        return e, True
    if t == "COMPARE_BETWEEN":
        f = col(node["input"])
        (ok1, lo), (ok2, hi) = _literal(node["lower"]), _literal(node["upper"])
        return ((f >= lo) & (f <= hi), True) if f is not None and ok1 and ok2 else (None, False)
    if t == "COMPARE_IN":
        kids = node.get("children") or []
        f = col(kids[0]) if kids else None
        vals = [_literal(k) for k in kids[1:]]
        if f is None or not vals or not all(ok for ok, _ in vals):
            return None, False
        return f.isin([v for _, v in vals]), True
    if t in ("OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL"):
        f = col((node.get("children") or [{}])[0])
        if f is None:
            return None, False
        return (f.is_null() if t == "OPERATOR_IS_NULL" else f.is_valid()), True
    if t == "CONJUNCTION_AND":
        parts = [_convert(k) for k in node.get("children") or []]
        kept = [e for e, _ in parts if e is not None]
        if not kept:
            return None, False
        out = kept[0]
        for e in kept[1:]:
            out = out & e
        return out, len(kept) == len(parts) and all(x for _, x in parts)
    if t == "CONJUNCTION_OR":
        parts = [_convert(k) for k in node.get("children") or []]
        if not parts or any(e is None for e, _ in parts):
            return None, False
        out = parts[0][0]
        for e, _ in parts[1:]:
            out = out | e
        return out, all(x for _, x in parts)
    if t == "OPERATOR_NOT":
        e, exact = _convert((node.get("children") or [{}])[0])
        return (~e, True) if e is not None and exact else (None, False)
    return None, False


def sql_to_expression(text: str) -> Any:
    """The pyarrow expression that prunes for the SQL predicate ``text`` (None: it cannot prune)."""
    return _convert(_parse_sql(text))[0]


class RowFilter:
    """One ``filter=`` (see the module). ``columns``: the columns it reads (of the table's names)."""

    def __init__(self, spec: Any, names: Sequence[str]) -> None:
        import pyarrow.compute as pc

        self.spec = spec
        if isinstance(spec, str):
            where = _parse_sql(spec)
            self.sql: str | None = spec
            self.prune: Any = _convert(where)[0]
            used = _columns_of(where, set())
            lower = {n.lower(): n for n in names}  # DuckDB's names are case-insensitive
            missing = sorted(c for c in used if c not in names and c.lower() not in lower)
            if missing:
                raise ColumnNotFoundError(f"filter {spec!r} names column {missing[0]!r}, which the table lacks; "
                               f"columns: {', '.join(names)}")
            self.columns = [n for n in names if n in used or n.lower() in {c.lower() for c in used}]
            self.text = "sql:" + spec
        elif isinstance(spec, pc.Expression):
            self.sql, self.prune = None, spec
            shown = str(spec)  # the names it shows (a superset is fine: only more columns are read)
            self.columns = [n for n in names if n in shown]
            self.text = "arrow:" + shown
        else:
            raise InvalidArgumentError(f"filter must be a pyarrow compute expression (pyarrow.compute.field('label') "
                                       f"== 3) or a SQL predicate string (\"label = 3\"), got {type(spec).__name__}")

    @classmethod
    def of(cls, spec: Any, names: Sequence[str]) -> RowFilter | None:
        return None if spec is None else cls(spec, names)

    def __repr__(self) -> str:
        return f"RowFilter({self.text!r})"

    def __getstate__(self) -> dict[str, Any]:
        st = dict(self.__dict__)
        st["prune"] = None if self.sql is not None else st["prune"]  # rebuilt from the SQL text
        return st

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__dict__.update(st)
        if self.sql is not None:
            self.prune = sql_to_expression(self.sql)

    def keep(self, table: Any) -> np.ndarray:
        """Bool mask of the rows of ``table`` the predicate keeps (true; null is not)."""
        import pyarrow as pa

        n = table.num_rows
        t = table.select(self.columns).append_column(_ROW, pa.array(np.arange(n, dtype=np.int64)))
        rows = t.filter(self.spec).column(_ROW).to_numpy() if self.sql is None else _duckdb_rows(t, self.sql)
        mask = np.zeros(n, dtype=bool)
        mask[rows] = True
        return mask

    def apply(self, table: Any) -> Any:
        """The rows of ``table`` the predicate keeps, in order."""
        mask = self.keep(table)
        return table if mask.all() else table.filter(mask)

    def _prunes(self, schema: Any) -> bool:
        """Whether :attr:`prune` may rule out row groups of files of ``schema`` (see groups_may_match)."""
        return self.prune is not None and not (self.sql is not None and any(
            c in schema.names and _nan_ordered(schema.field(c).type) for c in self.columns))

    def prune_dataset(self, data: Any) -> Any:
        """A pyarrow file dataset without the row groups (and files) that cannot hold a kept row, by statistics
        and partition values only: no row is filtered here (the exact pass does that)."""
        import pyarrow.dataset as pads

        if not self._prunes(data.schema) or not isinstance(data, pads.FileSystemDataset):
            return data
        try:
            frags = [fr.subset(filter=self.prune, schema=data.schema) for fr in data.get_fragments()]
            return pads.FileSystemDataset([fr for fr in frags if fr.num_row_groups], data.schema, data.format,
                                          data.filesystem)
        except Exception:  # noqa: BLE001 - a predicate pyarrow cannot bind here prunes nothing (exact anyway)
            return data

    def groups_may_match(self, md: Any, file_schema: Any, partition: dict[str, Any] | None = None,
                         partition_schema: Any = None) -> list[bool]:
        """Row groups of a file (its footer ``md``) that may hold a kept row, by their statistics and the file's
        partition values; all True where the predicate does not prune (or pruning fails)."""
        n = md.num_row_groups
        if not self._prunes(file_schema):  # DuckDB orders NaN above every number; statistics leave NaN out
            return [True] * n
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.dataset as pads

        try:
            fields = list(file_schema)
            pexpr = None
            if partition:
                for k, v in partition.items():
                    typ = partition_schema.field(k).type if partition_schema is not None else pa.scalar(v).type
                    e = pc.field(k).is_null() if v is None else pc.field(k) == pa.scalar(v, typ)
                    pexpr = e if pexpr is None else pexpr & e
                    if k not in file_schema.names:
                        fields.append(pa.field(k, typ))
            sink = pa.BufferOutputStream()
            md.write_metadata_file(sink)
            frag = pads.ParquetFileFormat().make_fragment(pa.BufferReader(sink.getvalue()),
                                                          partition_expression=pexpr)
            kept = {rg.id for rg in frag.subset(filter=self.prune, schema=pa.schema(fields)).row_groups}
        except Exception:  # noqa: BLE001 - a predicate pyarrow cannot bind here prunes nothing (exact anyway)
            return [True] * n
        return [g in kept for g in range(n)]


def _nan_ordered(typ: Any) -> bool:
    """A type whose values may hold NaN (floats, also nested): DuckDB's comparisons see NaN, statistics do not."""
    import pyarrow as pa

    if pa.types.is_floating(typ):
        return True
    return any(_nan_ordered(typ.field(i).type) for i in range(typ.num_fields)) if typ.num_fields else False


def _duckdb_rows(table: Any, predicate: str) -> np.ndarray:
    """Row numbers (the ``_ROW`` column) of ``table`` where the SQL ``predicate`` is true, by DuckDB."""
    import duckdb

    from .sources import restrict_sql

    con = duckdb.connect()
    try:
        con.execute("SET threads TO 1")
        con.register("ucmagic_rows", table)
        restrict_sql(con)
        got = con.execute(f'SELECT "{_ROW}" FROM ucmagic_rows WHERE ({predicate})').fetchnumpy()  # noqa: S608 - parsed above: one predicate
        return np.asarray(got[_ROW], dtype=np.int64)
    finally:
        con.close()


def filtered_reader(reader: Any, rf: RowFilter) -> Any:
    """A RecordBatchReader of the rows of ``reader`` that ``rf`` keeps (batch by batch, in order)."""
    import pyarrow as pa

    def batches() -> Any:
        for batch in reader:
            t = rf.apply(pa.Table.from_batches([batch], schema=reader.schema))
            yield from t.to_batches()

    return pa.RecordBatchReader.from_batches(reader.schema, batches())


def spark_filter(df: Any, spec: Any) -> Any:
    """A Spark DataFrame filtered in Spark (a SQL string, Spark's dialect); an expression is refused."""
    if spec is None:
        return df
    if not isinstance(spec, str):
        raise InvalidArgumentError("a Spark source filters in Spark: pass filter= as a SQL string (\"label = 3\"), "
                                   "not a pyarrow expression")
    return df.filter(spec)


def filter_relation(con: Any, rel: Any, rf: RowFilter | None, reopen: Any) -> tuple[Any, Any]:
    """``rel`` (a DuckDB relation on ``con``) filtered by ``rf``: a SQL string by DuckDB (pushed down to the
    files), an expression on the rows read through a second connection (``reopen()`` gives a relation of the
    same source on it). Returns ``(relation, close)``; call ``close()`` when the relation is consumed."""
    if rf is None:
        return rel, lambda: None
    if rf.sql is not None:
        return rel.filter(rf.sql), lambda: None
    other, close = reopen()
    return con.from_arrow(filtered_reader(other.to_arrow_reader(1 << 16), rf)), close
