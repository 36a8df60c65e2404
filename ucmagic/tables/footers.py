"""The files of a ParquetDataset from their footers: row groups, rows a Delta deletion vector leaves, which
columns may hold nulls, the unified schema and Hive partition values. Footers are read through the volume
registry (:class:`~ucmagic.tables.table_io.TableFiles`): a remote file's footer is a ranged read."""
from __future__ import annotations

from typing import Any, Sequence

from ..files.fetch import read_ahead
from .deletion_vectors import live_counts
from .sources import hive_partitions
from .table_io import TableFiles

__all__ = ["TableFile", "footer_nulls", "read_footers", "add_partitions"]


class TableFile:
    """One Parquet file: ``group_rows`` are the rows each row group yields (after a Delta deletion vector and
    a filter); ``delta`` is its Delta add (None for plain Parquet), ``stored_rows`` the rows stored (with a DV
    or a filter); ``meta`` its footer (not pickled: a worker reads it again when it needs it)."""

    __slots__ = ("path", "size", "mtime", "group_rows", "delta", "stored_rows", "nulls", "partition", "meta", "kept")

    def __init__(self, path: str, size: int, mtime: float, group_rows: list[int], delta: Any = None,
                 stored_rows: list[int] | None = None, nulls: frozenset[str] = frozenset()) -> None:
        self.path, self.size, self.mtime, self.group_rows = path, size, mtime, group_rows
        self.delta, self.stored_rows = delta, stored_rows
        self.nulls = nulls  # columns that may hold nulls in this file (footer statistics; logical names)
        self.partition: dict[str, Any] = {}  # Hive partition values of a plain Parquet directory
        self.meta: Any = None
        self.kept: list[Any] | None = None  # with a filter: per row group, the packed bitmap of stored rows kept

    def __getstate__(self) -> tuple[Any, ...]:
        return tuple(getattr(self, k) if k != "meta" else None for k in self.__slots__)

    def __setstate__(self, st: tuple[Any, ...]) -> None:
        for k, v in zip(self.__slots__, st):
            setattr(self, k, v)


def footer_nulls(md: Any, names: Sequence[str]) -> set[str]:
    """Top-level columns (of ``names``, as the file names them) that may hold nulls: a null count above zero
    or no null count in a row group's statistics; a column the file lacks counts too."""
    may: set[str] = set()
    leaves = [md.schema.column(j).path for j in range(md.num_columns)]
    for name in names:
        cols = [j for j, p in enumerate(leaves) if p == name or p.startswith(name + ".")]
        if not cols:
            may.add(name)
            continue
        for g in range(md.num_row_groups):
            rg = md.row_group(g)
            if rg.num_rows and any((st := rg.column(j).statistics) is None or not st.has_null_count
                                   or st.null_count > 0 for j in cols):
                may.add(name)
                break
    return may


def read_footers(paths: list[str], snap: Any, files: TableFiles, *, timeout: float | None,
                 what: str) -> tuple[list[TableFile], Any]:
    """Footers of every file: row groups and (Delta) rows left per row group after its deletion vector,
    each vector read and dropped in turn; the schema (the Delta table's, or the files' unified)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    dfiles = snap.files if snap is not None else [None] * len(paths)

    def footer(item: tuple[str, Any]) -> tuple[TableFile, Any]:
        p, dfile = item
        entry = files.stat(p)
        with files.open(p, entry.size) as f:
            md = pq.read_metadata(f)
        rows = [md.row_group(i).num_rows for i in range(md.num_row_groups)]
        stored = None
        if snap is not None and dfile is not None and dfile.dv is not None:
            stored, rows = rows, live_counts(snap.deleted_rows(dfile), rows)
        arrow_schema = md.schema.to_arrow_schema()
        if snap is not None:  # logical names: absent columns and null partition values count as nulls
            cols = snap.file_columns(arrow_schema, snap.data_columns)
            phys = footer_nulls(md, [v for v in cols.values() if v is not None])
            nulls = {c for c, v in cols.items() if v is None or v in phys}
            nulls |= {c for c, v in (dfile.partition if dfile is not None else ()) if v is None}
        else:
            nulls = footer_nulls(md, arrow_schema.names)
        tf = TableFile(p, entry.size, entry.mtime, rows, dfile, stored, frozenset(nulls))
        tf.meta = md
        return tf, arrow_schema

    got = list(read_ahead(footer, list(zip(paths, dfiles)), depth=16, timeout=timeout, describe=lambda it: it[0]))
    if snap is not None:  # the table's schema: files may predate columns (nulls) or name them physically
        return [f for f, _ in got], snap.schema
    schema = got[0][1]
    for f, s in got[1:]:
        missing = [n for n in schema.names if n not in s.names]
        if missing:
            raise ValueError(f"{f.path} lacks column {missing[0]!r} that {got[0][0].path} has: "
                             "all files of a ParquetDataset need the same columns")
    if any(s != schema for _, s in got[1:]):  # e.g. string in one file, large_string in another
        try:
            schema = pa.unify_schemas([s for _, s in got], promote_options="permissive")
        except (pa.ArrowInvalid, pa.ArrowTypeError) as e:
            raise ValueError(f"the files of {what!r} have columns of incompatible types ({e}): "
                             "write them with one schema") from e
        schema = pa.schema([schema.field(n) for n in got[0][1].names])
    return [f for f, _ in got], schema


def add_partitions(src: Any, schema: Any, tfiles: list[TableFile]) -> Any:
    """Hive ``key=value/`` directories of a plain Parquet directory become columns (typed as pyarrow infers
    them), appended to the files' schema; each file keeps its values."""
    import pyarrow as pa

    parts, values = hive_partitions(src)
    if not len(parts):
        return schema
    clash = [f.name for f in parts if f.name in schema.names]
    if clash:
        raise ValueError(f"{src.describe()}: column {clash[0]!r} is both in the files and a partition "
                         f"directory ({clash[0]}=...): rename one of them")
    for f in tfiles:
        f.partition = {p.name: values.get(f.path, {}).get(p.name) for p in parts}
        f.nulls = f.nulls | {k for k, v in f.partition.items() if v is None}
    return pa.schema(list(schema) + list(parts))
