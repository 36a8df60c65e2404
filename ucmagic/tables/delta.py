"""One reading of a Delta table: the snapshot Delta defines, for every tables entry point.

:func:`open_snapshot` resolves a table version once: the data files in log order (only ``add`` actions:
never ``_change_data``, checkpoints or logs), each with its partition values (typed, nulls included) and
its deletion vector descriptor, the logical schema (column mapping ``name``/``id`` resolved), and the
reader features checked. deltalake's engine provides the version, schema, protocol, configuration,
the authoritative file set and typed partition values (``DeltaTable.get_add_actions``); the log replay
here only adds what deltalake 1.6.6 does not expose per file: log order and deletion-vector descriptors.

:meth:`DeltaSnapshot.logical` turns what a data file stores into the table's rows (logical names,
columns added later as nulls, partition columns, the table's types), and :func:`load_deleted_rows`
reads one file's deletion vector (inline Z85 or a DV file: version byte, big-endian size, CRC-32,
then the RoaringBitmapArray with its magic number) when that file is read, so a reader holds one mask
at a time. ParquetDataset streams with these per row group; :meth:`DeltaSnapshot.reader` is the
whole-table stream (load_table, export_parquet) in the same order.
"""
from __future__ import annotations

import io
import json
import os
import re
from dataclasses import dataclass, field
from typing import IO, Any, Iterator, Sequence
from urllib.parse import unquote

import numpy as np

from .._util import is_url
from ..errors import (ColumnNotFoundError, SourceNotFoundError, UnsafeSourceError, UnsupportedTableFeatureError,
                      import_extra)
from ..files.volume import Volume, open_volume
from .deletion_vectors import (DeletionVector, decode_dv, join_path, deleted_in, filter_rows, keep_mask, live_counts,  # noqa: F401 - re-exported
                               live_span, load_deleted_rows, z85_decode)
from .table_io import TableFiles

__all__ = ["DeletionVector", "DeltaFile", "DeltaSnapshot", "open_snapshot", "load_deleted_rows", "decode_dv",
           "z85_decode", "HANDLED_READER_FEATURES"]

# Reader features whose meaning this reader implements (the rest raise UnsupportedTableFeatureError).
HANDLED_READER_FEATURES = frozenset({
    "deletionVectors", "columnMapping", "timestampNtz", "v2Checkpoint", "vacuumProtocolCheck",
    "typeWidening", "typeWidening-preview",
})
# Listed by some writers without being used; refused only when the schema has such a column.
_INACTIVE_UNLESS_USED = {"variantType": "variant", "variantType-preview": "variant",
                         "variantShredding-preview": "variant", "variantShredding": "variant"}

OUTSIDE_ENV = "UCMAGIC_DELTA_OUTSIDE_PATHS"  # "1": a log may name data files outside its table (opt-in)


def data_file_path(root: str, path: str, allow_outside: bool = False) -> str:
    """Where a log's (URL-encoded) data file ``path`` lies: relative to the table ``root``, or as given
    when absolute. A path that leaves the table (``..``, or an absolute path or URI outside ``root``)
    raises :class:`UnsafeSourceError` unless ``allow_outside`` (``$UCMAGIC_DELTA_OUTSIDE_PATHS=1``): a
    log someone else wrote must not make ucmagic read the user's other files."""
    raw = unquote(path)
    absolute = is_url(raw) or os.path.isabs(raw)
    full = raw if absolute else join_path(root, raw)
    if allow_outside:
        return full
    if is_url(root) or is_url(full):
        base = root.rstrip("/") + "/"
        inside = full.startswith(base) and ".." not in full[len(base):].split("/")
    else:
        rel = os.path.relpath(os.path.normpath(full), os.path.normpath(root))
        inside = rel != os.pardir and not rel.startswith(os.pardir + os.sep) and not os.path.isabs(rel)
    if not inside:
        raise UnsafeSourceError(f"Delta table {root}: its log names the data file {raw!r}, outside the table; "
                                f"set {OUTSIDE_ENV}=1 if you trust this table's log")
    return full


# ---------------------------------------------------------------- the snapshot

@dataclass(frozen=True)
class DeltaFile:
    """One data file of the snapshot."""

    path: str  # local path or URL of the file
    size: int
    partition: tuple[tuple[str, Any], ...] = ()  # logical name -> value (None: null partition)
    dv: DeletionVector | None = None
    num_records: int | None = None


@dataclass
class DeltaSnapshot:
    """The rows a Delta table version defines: files in log order plus how to read each."""

    root: str
    version: int
    name: str
    schema: Any  # pyarrow.Schema, logical names and the table's types
    files: list[DeltaFile]
    partition_columns: list[str]
    mapping_mode: str = "none"
    fields: dict[str, dict[str, Any]] = field(default_factory=dict)  # logical name -> schema JSON field
    storage_options: dict[str, Any] | None = None

    @property
    def data_columns(self) -> list[str]:
        return [n for n in self.schema.names if n not in self.partition_columns]

    @property
    def has_deletion_vectors(self) -> bool:
        return any(f.dv is not None for f in self.files)

    def deleted_rows(self, f: DeltaFile) -> np.ndarray:
        """Sorted row indices that ``f``'s deletion vector removes (empty without one)."""
        if f.dv is None:
            return np.zeros(0, np.int64)
        try:
            return load_deleted_rows(f.dv, self.root, self.storage_options)
        except (OSError, ValueError) as e:
            raise UnsupportedTableFeatureError(
                f"Delta table {self.name}: cannot read the deletion vector of {f.path}: {e}; "
                "check that the table is complete (was it vacuumed while being read?)") from e

    def file_columns(self, file_schema: Any, columns: Sequence[str]) -> dict[str, str | None]:
        """Logical data column -> the column that holds it in a file with ``file_schema`` (None: absent)."""
        names = set(file_schema.names)
        out: dict[str, str | None] = {}
        by_id: dict[int, str] = {}
        if self.mapping_mode == "id":
            for fld in file_schema:
                fid = (fld.metadata or {}).get(b"PARQUET:field_id")
                if fid is not None:
                    by_id[int(fid)] = fld.name
        for c in columns:
            meta = self.fields.get(c, {}).get("metadata", {})
            if self.mapping_mode == "id" and "delta.columnMapping.id" in meta:
                out[c] = by_id.get(int(meta["delta.columnMapping.id"]))
                continue
            phys = meta.get("delta.columnMapping.physicalName") if self.mapping_mode != "none" else None
            name = phys or c
            out[c] = name if name in names else None
        return out

    def logical(self, data: Any, f: DeltaFile, columns: Sequence[str], file_cols: dict[str, str | None],
                mask: np.ndarray | None = None) -> Any:
        """The table's rows of ``columns`` from ``data`` (a pyarrow Table read from ``f``): logical names,
        partition values, nulls for columns the file predates, the table's types, ``mask`` applied."""
        import pyarrow as pa

        if mask is not None:
            data = filter_rows(data, mask)
        n = data.num_rows
        parts = dict(f.partition)
        arrays = []
        for c in columns:
            target = self.schema.field(c).type
            if c in self.partition_columns:
                value = parts.get(c)
                arrays.append(pa.nulls(n, type=target) if value is None
                              else pa.repeat(pa.scalar(value, type=target), n))
                continue
            src = file_cols.get(c)
            if src is None:
                arrays.append(pa.nulls(n, type=target))
                continue
            col = data.column(src)
            if self.mapping_mode != "none":
                col = pa.chunked_array([_rename_nested(ch, self.fields[c]["type"], self.mapping_mode)
                                        for ch in col.chunks], type=None) if col.num_chunks else col
            arrays.append(col if col.type == target else _cast(col, target, c, self.name))
        return pa.Table.from_arrays(arrays, schema=pa.schema([self.schema.field(c) for c in columns]))

    def reader(self, columns: Sequence[str] | None = None, *, batch_rows: int = 65536) -> Any:
        """A pyarrow RecordBatchReader of the snapshot's rows, files in log order, row groups in file order
        (the next row group decodes on a thread while one is consumed)."""
        import pyarrow as pa

        from ..files.fetch import read_ahead

        cols = list(columns) if columns is not None else list(self.schema.names)
        bad = [c for c in cols if c not in self.schema.names]
        if bad:
            raise ColumnNotFoundError(f"Delta table {self.name} has no column {bad[0]!r}; columns: "
                                      f"{', '.join(self.schema.names)}")
        schema = pa.schema([self.schema.field(c) for c in cols])
        files = self.files

        opened: dict[int, tuple[Any, Any]] = {}  # file -> (open_parquet, ParquetFile): each file opened once
        tfiles = TableFiles(self.root, self.storage_options)

        def units() -> Iterator[tuple[int, int]]:
            for i, f in enumerate(files):
                ctx = open_parquet(f.path, self.storage_options, tfiles)
                pf = ctx.__enter__()
                opened[i] = (ctx, pf)
                yield from ((i, j) for j in range(pf.metadata.num_row_groups))

        state: dict[str, Any] = {"fi": -1}

        def read(unit: tuple[int, int]) -> Any:  # read_ahead(depth=1): one call at a time, in order
            i, j = unit
            f = files[i]
            pf = opened[i][1]
            if state["fi"] != i:  # one file's mask at a time
                for k in [k for k in opened if k < i]:
                    opened.pop(k)[0].__exit__(None, None, None)
                md = pf.metadata
                state.update(fi=i, deleted=self.deleted_rows(f), cols=self.file_columns(pf.schema_arrow, cols),
                             starts=np.concatenate([[0], np.cumsum([md.row_group(k).num_rows
                                                                     for k in range(md.num_row_groups)])]))
            fc = state["cols"]
            lo, hi = int(state["starts"][j]), int(state["starts"][j + 1])
            mask = keep_mask(state["deleted"], lo, hi)
            data = pf.read_row_group(j, columns=sorted({v for v in fc.values() if v is not None}))
            return self.logical(data, f, cols, fc, mask)

        def batches() -> Iterator[Any]:
            try:
                for t in read_ahead(read, units(), depth=1, describe=lambda u: f"{files[u[0]].path}#rg{u[1]}"):
                    yield from t.to_batches(max_chunksize=batch_rows)
            finally:
                for ctx, _ in list(opened.values()):
                    ctx.__exit__(None, None, None)
                opened.clear()

        return pa.RecordBatchReader.from_batches(schema, batches())


class open_parquet:  # noqa: N801 - used as a function (a context manager)
    """``with open_parquet(path) as pf``: a pyarrow ParquetFile of a local path or URL (INT96 read as us), opened
    through the registered volume (``files``: the table's, else the file's folder's)."""

    def __init__(self, path: str, storage_options: dict[str, Any] | None = None,
                 files: TableFiles | None = None) -> None:
        self.path, self.storage_options = path, storage_options
        self.files = files if files is not None else TableFiles(None, storage_options)
        self._f: Any = None

    def __enter__(self) -> Any:
        import pyarrow.parquet as pq

        self._f = self.files.open(self.path)  # closed in __exit__
        return pq.ParquetFile(self._f, coerce_int96_timestamp_unit="us")

    def __exit__(self, *exc: Any) -> None:
        self._f.close()


def _cast(col: Any, target: Any, name: str, table: str) -> Any:
    try:
        return col.cast(target)
    except Exception as e:  # pyarrow raises ArrowInvalid / ArrowNotImplementedError
        raise UnsupportedTableFeatureError(
            f"Delta table {table}: column {name!r} is stored as {col.type} in a data file, which does not "
            f"convert to the table's type {target} ({e})") from e


def _rename_nested(arr: Any, jtype: Any, mode: str) -> Any:
    """Physical struct field names inside ``arr`` -> logical ones (column mapping, nested types)."""
    import pyarrow as pa

    if not isinstance(jtype, dict):
        return arr
    kind = jtype.get("type")
    if kind == "struct" and pa.types.is_struct(arr.type):
        by_phys = {}
        for fj in jtype["fields"]:
            meta = fj.get("metadata", {})
            by_phys[meta.get("delta.columnMapping.physicalName", fj["name"])] = fj
        names, children = [], []
        for k, kid in enumerate(arr.flatten()):  # children with the parent's offset applied
            child = arr.type.field(k)
            fj = by_phys.get(child.name)
            names.append(fj["name"] if fj else child.name)
            children.append(_rename_nested(kid, fj["type"] if fj else None, mode))
        return pa.StructArray.from_arrays(children, names=names, mask=arr.is_null() if arr.null_count else None)
    if kind == "array" and (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        vals = _rename_nested(arr.values, jtype.get("elementType"), mode)
        cls = pa.LargeListArray if pa.types.is_large_list(arr.type) else pa.ListArray
        return cls.from_arrays(arr.offsets, vals, mask=arr.is_null() if arr.null_count else None)
    if kind == "map" and pa.types.is_map(arr.type):
        keys = _rename_nested(arr.keys, jtype.get("keyType"), mode)
        items = _rename_nested(arr.items, jtype.get("valueType"), mode)
        return pa.MapArray.from_arrays(arr.offsets, keys, items, mask=arr.is_null() if arr.null_count else None)
    return arr


# ---------------------------------------------------------------- opening

def _check_features(name: str, protocol: Any, schema_json: dict[str, Any]) -> None:
    features = list(getattr(protocol, "reader_features", None) or [])
    text = json.dumps(schema_json)
    for feat in features:
        if feat in HANDLED_READER_FEATURES:
            continue
        kind = _INACTIVE_UNLESS_USED.get(feat)
        if kind is not None and f'"type": "{kind}"' not in text:
            continue  # listed, not used by any column
        raise UnsupportedTableFeatureError(
            f"Delta table {name} needs the reader feature {feat!r}, which ucmagic cannot honour: read it with "
            "Spark (spark.read.table / toPandas) or export it to Parquet there")
    if protocol.min_reader_version > 3:
        raise UnsupportedTableFeatureError(
            f"Delta table {name} needs reader version {protocol.min_reader_version} (ucmagic reads up to 3): "
            "read it with a newer Delta engine")


def _arrow_schema(dt: Any) -> Any:
    import pyarrow as pa

    s = pa.schema(dt.schema().to_arrow())
    fields = []
    for f in s:  # deltalake may hand out view types; the table's rows use the plain ones
        fields.append(pa.field(f.name, _plain(f.type), f.nullable))
    return pa.schema(fields)


def _plain(t: Any) -> Any:
    import pyarrow as pa

    if pa.types.is_string_view(t):
        return pa.string()
    if pa.types.is_binary_view(t):
        return pa.binary()
    if pa.types.is_list_view(t) or pa.types.is_list(t):
        return pa.list_(pa.field(t.value_field.name, _plain(t.value_type), t.value_field.nullable))
    if pa.types.is_large_list_view(t) or pa.types.is_large_list(t):
        return pa.large_list(pa.field(t.value_field.name, _plain(t.value_type), t.value_field.nullable))
    if pa.types.is_map(t):
        return pa.map_(_plain(t.key_type), pa.field(t.item_field.name, _plain(t.item_type), t.item_field.nullable))
    if pa.types.is_struct(t):
        return pa.struct([pa.field(t.field(i).name, _plain(t.field(i).type), t.field(i).nullable)
                          for i in range(t.num_fields)])
    return t


_CHECKPOINT_RE = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?(?:\.([0-9a-fA-F-]{36}))?\.(parquet|json)$")


class _Log:
    """The ``_delta_log`` directory of a table: a local one read with plain file reads, a URL one through
    its :class:`~ucmagic.files.volume.Volume` (``list_names``, ``read_bytes``: a commit or a checkpoint is
    read whole, in one request, as the log replay reads all of it but the checkpoints' statistics)."""

    def __init__(self, root: str, storage_options: dict[str, Any] | None) -> None:
        self.dir = join_path(root, "_delta_log")
        self.vol: Volume | None = open_volume(self.dir, storage_options) if is_url(root) else None

    def names(self) -> list[str]:
        if self.vol is None:
            return os.listdir(self.dir)
        return self.vol.list_names("")

    def open(self, *parts: str) -> IO[bytes]:
        """A binary file of ``parts`` under the log (:class:`FileNotFoundError` if missing); the caller closes it."""
        if self.vol is None:
            return open(os.path.join(self.dir, *parts), "rb")
        return io.BytesIO(self.vol.read_bytes("/".join(parts)))


def _checkpoint_adds(log: _Log, names: list[str], version: int) -> tuple[int, list[dict[str, Any]]]:
    """(checkpoint version, its add actions in order) of the newest complete checkpoint <= ``version``."""
    import pyarrow.parquet as pq

    found: dict[int, list[tuple[str, str, str | None]]] = {}
    for n in names:
        m = _CHECKPOINT_RE.match(n)
        if m and int(m.group(1)) <= version:
            found.setdefault(int(m.group(1)), []).append((n, m.group(5), m.group(3)))
    for v in sorted(found, reverse=True):
        entries = found[v]
        parts = sorted(e for e in entries if e[2] is not None)
        if parts and len(parts) != int(parts[0][2] or 0):
            continue  # an incomplete multi-part checkpoint
        chosen = parts if parts else [entries[0]]
        adds: list[dict[str, Any]] = []
        try:
            for n, fmt, _ in chosen:
                adds += _actions_of(log, n, fmt, "add")
                for sc in _actions_of(log, n, fmt, "sidecar"):  # v2 checkpoint: adds live in sidecar files
                    path = unquote(sc["path"])
                    sc_parts = ("_sidecars", path) if "/" not in path else (path,)
                    with log.open(*sc_parts) as f:
                        adds += _parquet_actions(pq.ParquetFile(f), "add")
        except FileNotFoundError:
            continue
        return v, adds
    return -1, []


def _rows(table: Any, col: str) -> list[dict[str, Any]]:
    if col not in table.column_names:
        return []
    return [r for r in table.column(col).to_pylist() if r is not None]


def _parquet_actions(pf: Any, kind: str) -> list[dict[str, Any]]:
    """The ``kind`` actions of a Parquet checkpoint or sidecar; of ``add`` only the path and the deletion
    vector are read (not the statistics)."""
    if kind not in pf.schema_arrow.names:
        return []
    if kind == "add":
        sub = {f.name for f in pf.schema_arrow.field("add").type}
        cols = ["add.path"] + (["add.deletionVector"] if "deletionVector" in sub else [])
        return _rows(pf.read(columns=cols), "add")
    return _rows(pf.read(columns=[kind]), kind)


def _actions_of(log: _Log, name: str, fmt: str, kind: str) -> list[dict[str, Any]]:
    import pyarrow.parquet as pq

    if fmt == "json":
        with log.open(name) as f:
            return [a[kind] for a in map(json.loads, f.read().decode().splitlines()) if a and kind in a]
    with log.open(name) as f:
        pf = pq.ParquetFile(f)
        if kind not in pf.schema_arrow.names:
            return []
        return _parquet_actions(pf, kind)


def _replay(root: str, version: int, storage_options: dict[str, Any] | None) -> dict[str, tuple[int, Any]]:
    """Log replay for what deltalake does not expose per file: path -> (log position, DV descriptor)."""
    log = _Log(root, storage_options)
    names = log.names()
    cp, adds = _checkpoint_adds(log, names, version)
    live: dict[tuple[str, str], tuple[int, Any]] = {}
    pos = 0

    def dv_id(a: dict[str, Any]) -> str:
        d = a.get("deletionVector")
        return DeletionVector.from_json(d).unique_id if d else ""

    for a in adds:
        live[(a["path"], dv_id(a))] = (pos, a.get("deletionVector"))
        pos += 1
    for v in range(cp + 1, version + 1):
        try:
            with log.open(f"{v:020d}.json") as f:
                lines = f.read().decode().splitlines()
        except FileNotFoundError:
            raise UnsupportedTableFeatureError(
                f"Delta table {root}: commit {v} is missing and no checkpoint covers it "
                "(log cleaned up past this version?)") from None
        acts = [json.loads(x) for x in lines if x.strip()]
        for a in acts:  # removes first: a commit may re-add a path with a new deletion vector
            if "remove" in a:
                live.pop((a["remove"]["path"], dv_id(a["remove"])), None)
        for a in acts:
            if "add" in a:
                live[(a["add"]["path"], dv_id(a["add"]))] = (pos, a["add"].get("deletionVector"))
                pos += 1
    return {path: val for (path, _), val in live.items()}


def open_snapshot(root: str, *, version: int | None = None, name: str | None = None,
                  storage_options: dict[str, Any] | None = None) -> DeltaSnapshot:
    """Resolve a Delta table version into a :class:`DeltaSnapshot` (raises for features it cannot honour)."""
    import pyarrow as pa

    DeltaTable = import_extra("deltalake", feature="reading a Delta table").DeltaTable  # noqa: N806 - a class
    what = name or root
    try:
        dt = DeltaTable(root, version=version, storage_options=storage_options)
    except Exception as e:  # deltalake raises its own types
        if "not supported" in str(e).lower() or "unsupported" in str(e).lower():
            raise UnsupportedTableFeatureError(
                f"Delta table {what} needs a feature deltalake (ucmagic's Delta engine) cannot read ({e}): "
                "read it with Spark (spark.read.table / toPandas) or export it to Parquet there") from e
        raise SourceNotFoundError(f"cannot open Delta table {what} (version {version}): {e}") from e
    schema_json = json.loads(dt.schema().to_json())
    _check_features(what, dt.protocol(), schema_json)
    meta = dt.metadata()
    config = dict(meta.configuration or {})
    mode = config.get("delta.columnMapping.mode", "none") or "none"
    if mode not in ("none", "name", "id"):
        raise UnsupportedTableFeatureError(f"Delta table {what}: unknown column mapping mode {mode!r}")
    schema = _arrow_schema(dt)
    pcols = list(meta.partition_columns or [])
    v = int(dt.version())
    actions = pa.table(dt.get_add_actions(flatten=False))
    paths = actions.column("path").to_pylist()
    sizes = actions.column("size_bytes").to_pylist()
    nrec = actions.column("num_records").to_pylist() if "num_records" in actions.column_names else [None] * len(paths)
    parts = (actions.column("partition").to_pylist() if pcols and "partition" in actions.column_names
             else [{}] * len(paths))
    replay = _replay(root, v, storage_options)
    missing = [p for p in paths if p not in replay]
    if missing:
        raise UnsupportedTableFeatureError(
            f"Delta table {what}: deltalake lists {missing[0]} but the log replay does not find it; "
            "the log holds an action layout ucmagic does not read")
    files = []
    for p, size, n, pv in zip(paths, sizes, nrec, parts):
        pos, dv = replay[p]
        full = data_file_path(root, p, os.environ.get(OUTSIDE_ENV) == "1")
        part = tuple((c, (pv or {}).get(c)) for c in pcols)
        files.append((pos, DeltaFile(full, int(size), part, DeletionVector.from_json(dv) if dv else None,
                                     None if n is None else int(n))))
    files.sort(key=lambda x: x[0])
    fields = {fj["name"]: fj for fj in schema_json["fields"]}
    return DeltaSnapshot(root, v, what, schema, [f for _, f in files], pcols, mode, fields, storage_options)
