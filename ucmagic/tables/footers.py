"""The files of a ParquetDataset from their footers: row groups, rows a Delta deletion vector leaves, which
columns may hold nulls, the unified schema and Hive partition values. Footers are read through the volume
registry (:class:`~ucmagic.tables.table_io.TableFiles`): a remote file's footer is a ranged read."""
from __future__ import annotations

from typing import Any, Sequence

from ..errors import SchemaMismatchError
from ..files.fetch import read_ahead
from .deletion_vectors import live_counts
from .sources import hive_partitions
from .table_io import TableFiles

__all__ = ["TableFile", "footer_nulls", "read_footers", "add_partitions", "unify_schemas", "source_footers"]


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

    def copy(self) -> TableFile:
        """A copy that a reader may change (a filter's row index) without changing this one."""
        out = TableFile.__new__(TableFile)
        for k in self.__slots__:
            setattr(out, k, getattr(self, k))
        return out

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
    schema = unify_schemas([s for _, s in got], [f.path for f, _ in got], what)
    for f, s in got:  # a column this file lacks is null in all its rows
        absent = set(schema.names) - set(s.names)
        if absent:
            f.nulls = f.nulls | absent
    return [f for f, _ in got], schema


def unify_schemas(schemas: Sequence[Any], paths: Sequence[str], what: str) -> Any:
    """The one schema of a table's files (``ParquetDataset`` and ``load_table`` both read through it): the
    columns in the order the files first name them; a column's type promoted as pyarrow's ``unify_schemas``
    promotes it (``promote_options="permissive"``: a null-typed column takes the other files' type, ``int32``
    and ``int64`` give ``int64``, ``timestamp[ms]`` and ``[us]`` give ``[us]``, ``string`` and ``large_string``
    give ``large_string``, decimals widen), values converted exactly or not at all (a value the promoted type
    cannot hold is an error when read, never a changed value); a column some files lack is null in their rows.
    Types no promotion unifies raise :class:`~ucmagic.errors.SchemaMismatchError` naming the column and two
    files."""
    import pyarrow as pa

    if not schemas:
        return pa.schema([])
    first = schemas[0]
    if all(s.equals(first) for s in schemas[1:]):
        return first
    try:
        return pa.unify_schemas(list(schemas), promote_options="permissive").remove_metadata()
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
        seen: dict[str, tuple[Any, str]] = {}
        for s, path in zip(schemas, paths):
            for fld in s:
                if fld.name not in seen:
                    seen[fld.name] = (fld.type, path)
                    continue
                typ, other = seen[fld.name]
                try:
                    merged = pa.unify_schemas([pa.schema([pa.field(fld.name, typ)]), pa.schema([fld])],
                                              promote_options="permissive")
                    seen[fld.name] = (merged.field(0).type, other)
                except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
                    raise SchemaMismatchError(
                        f"{what}: column {fld.name!r} is {typ} in {other} and {fld.type} in {path}, which no "
                        "promotion unifies: write the files with one type for it (or read them apart)") from e
        raise SchemaMismatchError(f"{what}: the files' schemas do not unify ({e})") from e


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


def source_footers(src: Any, *, timeout: float | None = 300.0) -> tuple[list[TableFile], Any]:
    """The files of a ``parquet`` source from their footers and its schema (:func:`unify_schemas`, with Hive
    partition columns): read once per :class:`~ucmagic.tables.sources.Source` and kept on it (``src.footers``,
    ``src.schema``), so every reader of the source sees the same files and the same schema."""
    if src.footers is None:
        files, schema = read_footers(list(src.paths), None, TableFiles(src.root, src.storage_options),
                                     timeout=timeout, what=src.describe())
        src.footers, src.schema = files, add_partitions(src, schema, files)
    return [f.copy() for f in src.footers], src.schema
