"""``filter=``: a row predicate for ParquetDataset, load_table and export_parquet.

A :class:`RowFilter` holds a SQL predicate string in DuckDB's dialect or a pyarrow compute expression. It is
applied exactly by the engine of its kind (DuckDB for a SQL string, over the rows in memory as Arrow; pyarrow's
``Table.filter`` for an expression): a row is kept where the predicate is true; null is not true.

A SQL string is parsed by DuckDB (``json_serialize_sql``) once. Its column references are resolved as DuckDB
resolves them: the first part names a column (case-insensitively), the next parts fields of a struct (``st.a``
is field ``a`` of ``st``, never a top-level ``a``); a name the table lacks is a ``ColumnNotFoundError``. A
volatile function (``random()``, ``uuid()``) is refused by name: a filter decides once which rows a dataset has
(its row index, its resume state). With the table's schema the predicate is bound by DuckDB at once, over an
empty table of those types, so a predicate DuckDB refuses (types it cannot compare, a literal it cannot
convert) is a :class:`~ucmagic.errors.FilterError` before any row is read, and so is an error while evaluating.

Pruning (:meth:`RowFilter.groups_may_match`): a row group is skipped only where its statistics prove that no row
can match (:mod:`ucmagic.tables.pruning`: the literal compared in the column's own type by DuckDB itself).
``UCMAGIC_FILTER_PRUNING=off`` switches pruning off (every row group is read and evaluated), for checking.

Call order: ``RowFilter.of(filter, names, schema)`` once (None when no filter); then, per file,
``groups_may_match(metadata, file_schema, partition)`` (or ``files_may_match`` for many at once); per batch of
rows, ``keep(table, rows)`` over a table holding at least :attr:`columns`.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any, Sequence

import numpy as np

from ..errors import ColumnNotFoundError, FilterError, InvalidArgumentError
from .deletion_vectors import filter_rows
from .owned import duckdb_cursor
from .pruning import GroupStats, PrunePlan, concat_stats, file_group_stats

__all__ = ["RowFilter", "PRUNING_ENV", "pruning_on"]

_ROW = "__ucmagic_row__"
PRUNING_ENV = "UCMAGIC_FILTER_PRUNING"


def pruning_on() -> bool:
    """False when ``$UCMAGIC_FILTER_PRUNING`` is ``off`` (or 0/false/no): every row group is read."""
    return os.environ.get(PRUNING_ENV, "").strip().lower() not in ("off", "0", "false", "no")


def _sandbox(db: Any) -> None:
    db.execute("SET enable_external_access = false")


def _connect() -> Any:
    """This thread's DuckDB cursor for filters (:func:`~ucmagic.tables.owned.duckdb_cursor`: one database per
    process, closed at exit): one thread, no file access at all (a predicate reads the row's columns only).
    Never closed by its user; tables registered on it are unregistered after use."""
    return duckdb_cursor("filter", _sandbox)


def _parse_sql(text: str) -> dict[str, Any]:
    """DuckDB's parse of ``SELECT * FROM ucmagic_rows WHERE (text)``: the statement (refuses anything that is not
    one predicate over the row: a second statement, a subquery, an unbalanced parenthesis)."""
    quoted = "SELECT * FROM ucmagic_rows WHERE (" + text + ")"  # noqa: S608 - parsed, never run
    got = _connect().execute("SELECT json_serialize_sql(?)", [quoted]).fetchall()[0][0]
    tree = json.loads(got)
    stmts = tree.get("statements") or []
    if tree.get("error") or len(stmts) != 1:
        why = tree.get("error_message") or "not one predicate"
        raise InvalidArgumentError(f"filter {text!r} is not a SQL predicate DuckDB can parse ({why}): write it as "
                                   "a WHERE clause, e.g. \"label = 3 AND score > 0.5\"")
    node = stmts[0]["node"]
    if (node.get("type") != "SELECT_NODE" or node.get("from_table", {}).get("table_name") != "ucmagic_rows"
            or len(node.get("select_list") or []) != 1 or node.get("group_expressions") or node.get("having")
            or node.get("modifiers") or '"SUBQUERY"' in got or '"PARAMETER"' in got):
        raise InvalidArgumentError(f"filter {text!r} must be one predicate over a row's columns (no subquery, "
                                   "no parameter, no second statement): e.g. \"label = 3 AND score > 0.5\"")
    return dict(stmts[0])


@functools.lru_cache(maxsize=1)
def _stability() -> dict[str, str]:
    """DuckDB's functions by name (lower case) and their stability: CONSISTENT, VOLATILE, CONSISTENT_WITHIN_QUERY."""
    rows = _connect().execute("SELECT function_name, stability FROM duckdb_functions()").fetchall()
    out: dict[str, str] = {}
    for name, stab in rows:
        key = str(name).lower()
        if out.get(key) != "VOLATILE":  # an overload that is volatile makes the name volatile
            out[key] = str(stab)
    return out


class _Names:
    """Column references of one predicate, resolved against a table's names (and schema, when known)."""

    def __init__(self, text: str, names: Sequence[str], schema: Any) -> None:
        self.text, self.names, self.schema = text, list(names), schema
        self.lower: dict[str, str] = {}
        for n in self.names:
            self.lower.setdefault(n.lower(), n)
        self.functions = _stability()

    def _top(self, name: str) -> str | None:
        return name if name in self.names else self.lower.get(name.lower())

    def resolve(self, parts: list[str]) -> tuple[tuple[str, ...], Any] | None:
        """``(path, Arrow type or None)`` of a column reference; None when it names no column (a function
        DuckDB calls without parentheses, ``current_date``). Raises ColumnNotFoundError for an unknown name."""
        import pyarrow as pa

        top = self._top(parts[0]) if parts else None
        if top is None:
            if len(parts) == 1 and parts[0].lower() in self.functions:
                return None
            raise ColumnNotFoundError(f"filter {self.text!r} names column {'.'.join(parts)!r}, which the table "
                                      f"lacks; columns: {', '.join(self.names)}")
        if self.schema is None or top not in self.schema.names:
            return (top, *parts[1:]), None
        path, t = [top], self.schema.field(top).type
        for name in parts[1:]:
            if not pa.types.is_struct(t):
                return (*path, *parts[len(path):]), None  # DuckDB decides (and refuses) what this is
            fields = [t.field(i).name for i in range(t.num_fields)]
            got = name if name in fields else next((f for f in fields if f.lower() == name.lower()), None)
            if got is None:
                raise ColumnNotFoundError(f"filter {self.text!r} names field {'.'.join(parts)!r}, which the table "
                                          f"lacks: {path[-1]!r} has the fields {', '.join(fields)}")
            path.append(got)
            t = t.field(got).type
        return tuple(path), t

    def scan(self, node: Any, params: frozenset[str] = frozenset()) -> tuple[set[str], set[str]]:
        """``(columns, functions)`` a subtree uses: top-level column names, function names (lower case)."""
        cols: set[str] = set()
        funcs: set[str] = set()

        def walk(n: Any, bound: frozenset[str]) -> None:
            if isinstance(n, list):
                for v in n:
                    walk(v, bound)
                return
            if not isinstance(n, dict):
                return
            t = n.get("type")
            if t == "LAMBDA":  # its parameters are no columns inside its body
                names = {str(c["column_names"][0]) for c in _refs(n.get("lhs"))}
                walk(n.get("expr"), bound | names)
                return
            if t == "COLUMN_REF":
                parts = [str(p) for p in n.get("column_names") or []]
                if parts and parts[0] not in bound:
                    got = self.resolve(parts)
                    if got is None:
                        funcs.add(parts[0].lower())
                    else:
                        cols.add(got[0][0])
                return
            if t == "FUNCTION" and n.get("function_name"):
                funcs.add(str(n["function_name"]).lower())
            for k, v in n.items():
                if k != "literal":
                    walk(v, bound)

        walk(node, params)
        return cols, funcs

    def constant(self, node: Any) -> bool:
        """A subtree with no column and only functions that give the same value every time."""
        cols, funcs = self.scan(node)
        return not cols and all(self.functions.get(f, "CONSISTENT") == "CONSISTENT" for f in funcs)


def _refs(node: Any) -> list[dict[str, Any]]:
    """The COLUMN_REF nodes of a subtree."""
    out: list[dict[str, Any]] = []
    if isinstance(node, dict):
        if node.get("type") == "COLUMN_REF":
            out.append(node)
        for v in node.values():
            out += _refs(v)
    elif isinstance(node, list):
        for v in node:
            out += _refs(v)
    return out


class RowFilter:
    """One ``filter=`` (see the module). ``columns``: the top-level columns it reads (of the table's names);
    ``cacheable``: its rows depend on the data only (no ``now()``), so a row index of it may be kept."""

    def __init__(self, spec: Any, names: Sequence[str], schema: Any = None) -> None:
        import pyarrow.compute as pc

        self.spec = spec
        self.schema = schema
        self.cacheable = True
        self._plan: PrunePlan | None = None
        if isinstance(spec, str):
            self.sql: str | None = spec
            self._statement = _parse_sql(spec)
            resolver = _Names(spec, names, schema)
            used, funcs = resolver.scan(self._statement["node"]["where_clause"])
            volatile = sorted(f for f in funcs if resolver.functions.get(f) == "VOLATILE")
            if volatile:
                raise InvalidArgumentError(
                    f"filter {spec!r} calls {volatile[0]}(), which gives another value each time it runs: a filter "
                    "decides once which rows a dataset has (its row index, its resume state). Use a deterministic "
                    "expression instead, e.g. \"hash(id) % 100 < 10\" for a 10% sample")
            self.cacheable = all(resolver.functions.get(f, "CONSISTENT") == "CONSISTENT" for f in funcs)
            self.columns = [n for n in names if n in used]
            self.text = "sql:" + spec
            self._resolver: _Names | None = resolver
            if schema is not None:
                self._check_binds()
        elif isinstance(spec, pc.Expression):
            self.sql, self._statement, self._resolver = None, {}, None
            shown = str(spec)  # the names it shows (a superset is fine: only more columns are read)
            self.columns = [n for n in names if n in shown]
            self.text = "arrow:" + shown
        else:
            raise InvalidArgumentError(f"filter must be a pyarrow compute expression (pyarrow.compute.field('label') "
                                       f"== 3) or a SQL predicate string (\"label = 3\"), got {type(spec).__name__}")

    @classmethod
    def of(cls, spec: Any, names: Sequence[str], schema: Any = None) -> RowFilter | None:
        return None if spec is None else cls(spec, names, schema)

    def __repr__(self) -> str:
        return f"RowFilter({self.text!r})"

    def __getstate__(self) -> dict[str, Any]:
        st = dict(self.__dict__)
        st["_resolver"] = None  # rebuilt from the SQL text (it holds DuckDB's function list)
        return st

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__dict__.update(st)
        if self.sql is not None:
            self._resolver = _Names(self.sql, list(self.schema.names) if self.schema is not None else self.columns,
                                    self.schema)

    def _error(self, exc: BaseException, when: str) -> FilterError:
        from .._util import error_line

        return FilterError(f"filter {self.spec!r} {when}: {error_line(exc)}. Fix the predicate (DuckDB's dialect: "
                           "compare a column with a value of its type, or CAST it)")

    def _check_binds(self) -> None:
        """Bind the predicate over an empty table of the filter's columns (DuckDB's refusals, before any read)."""
        import duckdb
        import pyarrow as pa

        if self.sql is None or self.schema is None:
            return
        empty = pa.table({c: pa.array([], self.schema.field(c).type) for c in self.columns
                          if c in self.schema.names})
        try:
            self._duckdb_rows(empty, 0)
        except FilterError:
            raise
        except (duckdb.Error, pa.ArrowException) as e:
            raise self._error(e, "cannot run over this table") from e

    # ------------------------------------------------------------ the exact pass

    def keep(self, table: Any, rows: int | None = None) -> np.ndarray:
        """Bool mask of the ``rows`` rows of ``table`` (default: its row count; a table of no column, for a filter
        naming none, has rows but no length) the predicate keeps (true; null is not)."""
        import pyarrow as pa

        n = table.num_rows if rows is None else int(rows)
        t = table.select(self.columns) if self.columns else pa.table({})
        if self.sql is None:
            t = t.append_column(_ROW, pa.array(np.arange(n, dtype=np.int64)))
            kept = t.filter(self.spec).column(_ROW).to_numpy()
        else:
            kept = self._duckdb_rows(t, n)
        mask = np.zeros(n, dtype=bool)
        mask[kept] = True
        return mask

    def _duckdb_rows(self, table: Any, n: int) -> np.ndarray:
        """Row numbers of ``table`` (``n`` rows) where the SQL predicate is true, by DuckDB."""
        import duckdb
        import pyarrow as pa

        rows = pa.array(np.arange(n, dtype=np.int64))
        t = pa.table({_ROW: rows}) if not table.num_columns else table.append_column(_ROW, rows)
        con = _connect()
        try:
            con.register("ucmagic_rows", t)
            got = con.execute(f'SELECT "{_ROW}" FROM ucmagic_rows WHERE ({self.sql})').fetchnumpy()  # noqa: S608 - parsed above: one predicate
            return np.asarray(got[_ROW], dtype=np.int64)
        except (duckdb.Error, pa.ArrowException) as e:
            raise self._error(e, "failed") from e
        finally:
            con.unregister("ucmagic_rows")

    def apply(self, table: Any) -> Any:
        """The rows of ``table`` the predicate keeps, in order."""
        mask = self.keep(table)
        return table if mask.all() else filter_rows(table, mask)

    # ------------------------------------------------------------ pruning

    def plan(self) -> PrunePlan | None:
        """How this SQL filter prunes (None: a pyarrow expression, or no schema)."""
        if self.sql is None or self.schema is None or self._resolver is None:
            return None
        if self._plan is None:
            self._plan = PrunePlan.build(self._statement, self._resolver.resolve, self._resolver.constant, _connect)
        return self._plan

    def files_may_match(self, files: Sequence[tuple[Any, Any, dict[str, Any] | None, Any]]) -> list[list[bool]]:
        """:meth:`groups_may_match` of several files ``(footer, file_schema, partition, partition_schema)`` at once
        (one evaluation for all of them)."""
        counts = [md.num_row_groups for md, _, _, _ in files]
        plan = self.plan() if pruning_on() else None
        if self.sql is None and pruning_on():
            return [self._arrow_may_match(*f) for f in files]
        if plan is None or not plan.prunes:
            return [[True] * c for c in counts]
        try:
            stats = concat_stats([self._stats(plan, *f) for f in files], plan.types)
            may = plan.may_match(stats, _connect)
        except Exception:  # noqa: BLE001 - statistics that cannot be compared prune nothing (exact pass decides)
            return [[True] * c for c in counts]
        out, at = [], 0
        for c in counts:
            out.append([bool(v) for v in may[at:at + c]])
            at += c
        return out

    def groups_may_match(self, md: Any, file_schema: Any, partition: dict[str, Any] | None = None,
                         partition_schema: Any = None) -> list[bool]:
        """Row groups of a file (its footer ``md``) that may hold a kept row, by their statistics and the file's
        partition values; all True where nothing is proven."""
        return self.files_may_match([(md, file_schema, partition, partition_schema)])[0]

    def _stats(self, plan: PrunePlan, md: Any, file_schema: Any, partition: dict[str, Any] | None,
               partition_schema: Any) -> GroupStats:
        import pyarrow as pa

        consts: dict[str, tuple[Any, Any]] = {}
        for k, v in (partition or {}).items():
            typ = partition_schema.field(k).type if partition_schema is not None else pa.scalar(v).type
            consts[k] = (v, typ)
        return file_group_stats(md, file_schema, plan.paths, plan.types, consts)

    def _arrow_may_match(self, md: Any, file_schema: Any, partition: dict[str, Any] | None,
                         partition_schema: Any) -> list[bool]:
        """A pyarrow expression's pruning: pyarrow's own statistics guarantees (its evaluator is pyarrow), over
        the columns whose statistics compare exactly there (no floats: NaN; no decimals: pyarrow compares them
        with a float literal through its own rounding)."""
        import pyarrow as pa
        import pyarrow.compute as pc
        import pyarrow.dataset as pads

        n = md.num_row_groups
        if any(c in file_schema.names and not _arrow_prunable(file_schema.field(c).type) for c in self.columns):
            return [True] * n
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
            kept = {rg.id for rg in frag.subset(filter=self.spec, schema=pa.schema(fields)).row_groups}
        except Exception:  # noqa: BLE001 - a predicate pyarrow cannot bind here prunes nothing (exact anyway)
            return [True] * n
        return [g in kept for g in range(n)]


def _arrow_prunable(typ: Any) -> bool:
    import pyarrow as pa

    return (pa.types.is_integer(typ) or pa.types.is_string(typ) or pa.types.is_large_string(typ)
            or pa.types.is_boolean(typ) or pa.types.is_date(typ) or pa.types.is_timestamp(typ))


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
