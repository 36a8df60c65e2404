"""Delta tables written the way real writers write them, for tests.

deltalake writes partitions, schema evolution, deletes (by rewriting files), time travel, checkpoints and
change data. What deltalake 1.6.6 does not write, these helpers write by following the Delta protocol
(delta-io/delta PROTOCOL.md): deletion vectors (the RoaringBitmapArray format with its magic number, inline
as Z85 or in a ``deletion_vector_<uuid>.bin`` file with its version byte, big-endian size and CRC-32 framing)
and column mapping (``delta.columnMapping.mode`` = ``name`` or ``id``: physical names and field ids in the
schema's metadata and in the Parquet files). Every fixture is checked against deltalake's own reading in
tests/test_delta.py.
"""
from __future__ import annotations

import json
import os
import struct
import time
import uuid
import zlib
from typing import Any, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

MAGIC = 1681511377
_Z85 = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#"


def z85_encode(data: bytes) -> str:
    """Z85 (ZeroMQ RFC 32), zero-padded to a multiple of 4 bytes as Delta's Base85Codec does."""
    data = data + b"\0" * (-len(data) % 4)
    out = []
    for i in range(0, len(data), 4):
        v = struct.unpack(">I", data[i:i + 4])[0]
        chunk = []
        for _ in range(5):
            v, r = divmod(v, 85)
            chunk.append(_Z85[r])
        out.append("".join(reversed(chunk)))
    return "".join(out)


# ---------------------------------------------------------------- RoaringBitmap (portable format)

def _roaring32(values: np.ndarray, runs: bool) -> bytes:
    """A 32-bit RoaringBitmap in the standard serialization (array, bitset and, with ``runs``, run containers)."""
    values = np.unique(values.astype(np.uint32))
    keys = np.unique(values >> 16)
    conts: list[tuple[int, str, np.ndarray]] = []
    for k in keys:
        low = (values[(values >> 16) == k] & 0xFFFF).astype(np.uint16)
        kind = "run" if runs and len(low) > 2 else ("array" if len(low) <= 4096 else "bitset")
        conts.append((int(k), kind, low))
    n = len(conts)
    out = bytearray()
    if runs:
        out += struct.pack("<I", 12347 | ((n - 1) << 16))
        bits = bytearray((n + 7) // 8)
        for i, (_, kind, _) in enumerate(conts):
            if kind == "run":
                bits[i // 8] |= 1 << (i % 8)
        out += bits
    else:
        out += struct.pack("<II", 12346, n)
    for k, _, low in conts:
        out += struct.pack("<HH", k, len(low) - 1)
    bodies = []
    for _, kind, low in conts:
        if kind == "array":
            bodies.append(low.astype("<u2").tobytes())
        elif kind == "bitset":
            words = np.zeros(1024, dtype="<u8")
            np.bitwise_or.at(words, low >> 6, np.left_shift(np.uint64(1), (low & 63).astype(np.uint64)))
            bodies.append(words.tobytes())
        else:
            starts = np.flatnonzero(np.diff(low.astype(np.int64), prepend=-2) != 1)
            ends = np.append(starts[1:], len(low)) - 1
            body = struct.pack("<H", len(starts))
            for s, e in zip(starts, ends):
                body += struct.pack("<HH", int(low[s]), int(low[e]) - int(low[s]))
            bodies.append(body)
    if not runs or n >= 4:  # offsets header (absent for run-cookie bitmaps of fewer than 4 containers)
        off = len(out) + 4 * n
        for b in bodies:
            out += struct.pack("<I", off)
            off += len(b)
    for b in bodies:
        out += b
    return bytes(out)


def serialize_dv(rows: Iterable[int], *, runs: bool = False) -> bytes:
    """Delta's deletion-vector bitmap: magic number + a 64-bit RoaringBitmapArray (portable format)."""
    arr = np.asarray(sorted(set(int(r) for r in rows)), dtype=np.uint64)
    buckets = np.unique(arr >> np.uint64(32))
    out = bytearray(struct.pack("<i", MAGIC))
    out += struct.pack("<q", len(buckets))
    for b in buckets:
        low = (arr[(arr >> np.uint64(32)) == b] & np.uint64(0xFFFFFFFF)).astype(np.uint32)
        out += struct.pack("<I", int(b)) + _roaring32(low, runs)
    return bytes(out)


def write_dv_file(table: str, dvs: Sequence[bytes], prefix: str = "") -> tuple[str, list[int]]:
    """A DV file (version byte 1, then per DV: big-endian size, bitmap, big-endian CRC-32).

    Returns the ``pathOrInlineDv`` (prefix + Z85 uuid) and each DV's offset."""
    u = uuid.uuid4()
    d = os.path.join(table, prefix) if prefix else table
    os.makedirs(d, exist_ok=True)
    offsets = []
    with open(os.path.join(d, f"deletion_vector_{u}.bin"), "wb") as f:
        f.write(b"\x01")
        for data in dvs:
            offsets.append(f.tell())
            f.write(struct.pack(">I", len(data)) + data + struct.pack(">I", zlib.crc32(data) & 0xFFFFFFFF))
    return prefix + z85_encode(u.bytes), offsets


# ---------------------------------------------------------------- log edits

def log_path(table: str, version: int) -> str:
    return os.path.join(table, "_delta_log", f"{version:020d}.json")


def read_actions(table: str, version: int) -> list[dict[str, Any]]:
    with open(log_path(table, version)) as f:
        return [json.loads(line) for line in f if line.strip()]


def last_version(table: str) -> int:
    return max(int(n.split(".")[0]) for n in os.listdir(os.path.join(table, "_delta_log")) if n.endswith(".json"))


def live_adds(table: str) -> list[dict[str, Any]]:
    """The add actions of the latest version, in log order (json commits only: fixtures have no checkpoint)."""
    adds: dict[str, dict[str, Any]] = {}
    for v in range(last_version(table) + 1):
        for a in read_actions(table, v):
            if "add" in a:
                adds[a["add"]["path"]] = a["add"]
            elif "remove" in a:
                adds.pop(a["remove"]["path"], None)
    return list(adds.values())


def commit(table: str, actions: list[dict[str, Any]], operation: str = "DELETE") -> int:
    v = last_version(table) + 1
    info = {"commitInfo": {"timestamp": int(time.time() * 1000), "operation": operation,
                           "operationParameters": {}, "engineInfo": "ucmagic-tests/protocol"}}
    with open(log_path(table, v), "x") as f:
        for a in [info, *actions]:
            f.write(json.dumps(a) + "\n")
    return v


def current_protocol(table: str) -> dict[str, Any]:
    protocol: dict[str, Any] = {}
    for v in range(last_version(table) + 1):
        for a in read_actions(table, v):
            protocol = a.get("protocol", protocol)
    return protocol


def enable_dv_protocol(table: str) -> None:
    """Add deletionVectors to the table's protocol (a protocol action keeping the features it had)."""
    p = current_protocol(table)
    readers = sorted({*(p.get("readerFeatures") or []), "deletionVectors"})
    writers = sorted({*(p.get("writerFeatures") or []), "deletionVectors"})
    commit(table, [{"protocol": {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": readers,
                                 "writerFeatures": writers}}], "SET TBLPROPERTIES")


def delete_rows(table: str, deleted: dict[str, Iterable[int]], *, storage: str = "u", runs: bool = False,
                prefix: str = "ab") -> int:
    """Delete rows (indices within each data file) through deletion vectors, like Spark's DELETE.

    ``deleted``: add path -> row indices deleted now (added to the file's existing DV, if any).
    ``storage``: ``"u"`` (one DV file for all, with a random prefix directory), ``"i"`` (inline Z85) or
    ``"p"`` (DV file referenced by absolute path)."""
    adds = {a["path"]: a for a in live_adds(table)}
    ts = int(time.time() * 1000)
    blobs: list[tuple[str, bytes, int]] = []
    for path, rows in deleted.items():
        add = adds[path]
        old = set(existing_deleted(table, add))
        allrows = old | {int(r) for r in rows}
        blobs.append((path, serialize_dv(allrows, runs=runs), len(allrows)))
    descs: dict[str, dict[str, Any]] = {}
    if storage == "i":
        for path, data, card in blobs:
            descs[path] = {"storageType": "i", "pathOrInlineDv": z85_encode(data), "sizeInBytes": len(data),
                           "cardinality": card}
    else:
        ref, offsets = write_dv_file(table, [b for _, b, _ in blobs], prefix if storage == "u" else "")
        for (path, data, card), off in zip(blobs, offsets):
            if storage == "u":
                descs[path] = {"storageType": "u", "pathOrInlineDv": ref, "offset": off, "sizeInBytes": len(data),
                               "cardinality": card}
            else:
                name = f"deletion_vector_{_uuid_of(ref)}.bin"
                descs[path] = {"storageType": "p", "pathOrInlineDv": "file://" + os.path.abspath(
                    os.path.join(table, name)), "offset": off, "sizeInBytes": len(data), "cardinality": card}
    actions = []
    for path, desc in descs.items():
        add = dict(adds[path])
        remove = {"path": path, "deletionTimestamp": ts, "dataChange": True, "extendedFileMetadata": True,
                  "partitionValues": add.get("partitionValues", {}), "size": add["size"]}
        if add.get("deletionVector"):
            remove["deletionVector"] = add["deletionVector"]
        add["deletionVector"] = desc
        add["modificationTime"] = ts
        actions += [{"remove": remove}, {"add": add}]
    return commit(table, actions)


def _uuid_of(ref: str) -> uuid.UUID:
    enc = ref[-20:]
    val = 0
    raw = b""
    for i in range(0, 20, 5):
        val = 0
        for ch in enc[i:i + 5]:
            val = val * 85 + _Z85.index(ch)
        raw += struct.pack(">I", val)
    return uuid.UUID(bytes=raw)


def existing_deleted(table: str, add: dict[str, Any]) -> list[int]:
    """Rows an add's current DV deletes (read through ucmagic's decoder: fixtures chain DELETEs)."""
    desc = add.get("deletionVector")
    if not desc:
        return []
    from ucmagic.tables.delta import DeletionVector, load_deleted_rows

    return load_deleted_rows(DeletionVector.from_json(desc), table).tolist()


def file_rows(table: str, path: str) -> int:
    return pq.read_metadata(os.path.join(table, path)).num_rows


# ---------------------------------------------------------------- column mapping

def write_column_mapped(table: str, data: pa.Table, *, mode: str = "name", partition_by: Sequence[str] = (),
                        files: int = 2, row_group_size: int | None = None) -> dict[str, str]:
    """A table with ``delta.columnMapping.mode`` = ``mode``, written like Databricks does: physical names
    ``col-<uuid>`` in the files and in ``physicalName``, field ids in ``id`` and in the Parquet field ids.
    Returns logical -> physical names."""
    os.makedirs(os.path.join(table, "_delta_log"), exist_ok=True)
    fields, phys, ids = [], {}, {}
    counter = [len(data.schema)]
    for i, f in enumerate(data.schema, start=1):
        phys[f.name] = f"col-{uuid.uuid4()}"
        ids[f.name] = i
        fields.append({"name": f.name, "type": _delta_type(f.type, counter), "nullable": True,
                       "metadata": {"delta.columnMapping.id": i, "delta.columnMapping.physicalName": phys[f.name]}})
    jtypes = {f["name"]: f["type"] for f in fields}
    schema = {"type": "struct", "fields": fields}
    meta = {"id": str(uuid.uuid4()), "format": {"provider": "parquet", "options": {}},
            "schemaString": json.dumps(schema), "partitionColumns": list(partition_by),
            "configuration": {"delta.columnMapping.mode": mode, "delta.columnMapping.maxColumnId": str(counter[0])},
            "createdTime": int(time.time() * 1000)}
    protocol = {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": ["columnMapping"],
                "writerFeatures": ["columnMapping"]}
    adds = []
    data_cols = [c for c in data.column_names if c not in partition_by]
    groups: list[tuple[dict[str, Any], pa.Table]] = []
    if partition_by:
        keys = data.select(list(partition_by)).to_pylist()
        uniq: list[dict[str, Any]] = []
        for k in keys:
            if k not in uniq:
                uniq.append(k)
        for k in uniq:
            mask = [r == k for r in keys]
            groups.append((k, data.filter(pa.array(mask))))
    else:
        step = -(-data.num_rows // files) if data.num_rows else 1
        groups = [({}, data.slice(i, step)) for i in range(0, max(data.num_rows, 1), step)]
    for k, part in groups:
        t = part.select(data_cols)
        cols = [_physical(t.column(c).combine_chunks(), jtypes[c]) for c in data_cols]
        t = pa.table(cols, schema=pa.schema([pa.field(phys[c], col.type,
                                                      metadata={b"PARQUET:field_id": str(ids[c]).encode()})
                                             for c, col in zip(data_cols, cols)]))
        name = f"{uuid.uuid4().hex[:2]}/part-{uuid.uuid4()}.c000.snappy.parquet"
        os.makedirs(os.path.join(table, os.path.dirname(name)), exist_ok=True)
        pq.write_table(t, os.path.join(table, name), row_group_size=row_group_size)
        pv = {phys[c]: (None if v is None else str(v)) for c, v in k.items()}
        adds.append({"add": {"path": name, "partitionValues": pv, "size": os.path.getsize(os.path.join(table, name)),
                             "modificationTime": int(time.time() * 1000), "dataChange": True,
                             "stats": json.dumps({"numRecords": t.num_rows})}})
    with open(log_path(table, 0), "x") as f:
        for a in [{"commitInfo": {"operation": "CREATE TABLE", "timestamp": int(time.time() * 1000)}},
                  {"protocol": protocol}, {"metaData": meta}, *adds]:
            f.write(json.dumps(a) + "\n")
    return phys


def _physical(arr: pa.Array, jtype: Any) -> pa.Array:
    """Struct children renamed to their physical names (as a column-mapping writer stores them)."""
    if isinstance(jtype, dict) and jtype.get("type") == "struct":
        kids = [_physical(arr.field(k), fj["type"]) for k, fj in enumerate(jtype["fields"])]
        names = [fj["metadata"]["delta.columnMapping.physicalName"] for fj in jtype["fields"]]
        return pa.StructArray.from_arrays(kids, names=names, mask=arr.is_null() if arr.null_count else None)
    return arr


def _delta_type(t: pa.DataType, counter: list[int] | None = None) -> Any:
    if pa.types.is_struct(t):
        counter = counter if counter is not None else [0]
        out = []
        for k in range(t.num_fields):
            counter[0] += 1
            out.append({"name": t.field(k).name, "type": _delta_type(t.field(k).type, counter), "nullable": True,
                        "metadata": {"delta.columnMapping.id": counter[0],
                                     "delta.columnMapping.physicalName": f"col-{uuid.uuid4()}"}})
        return {"type": "struct", "fields": out}
    if pa.types.is_int64(t):
        return "long"
    if pa.types.is_int32(t):
        return "integer"
    if pa.types.is_float64(t):
        return "double"
    if pa.types.is_boolean(t):
        return "boolean"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_date32(t):
        return "date"
    raise ValueError(f"no Delta type for {t} in this fixture writer")


# ---------------------------------------------------------------- v2 checkpoints

_DV_TYPE = pa.struct([("storageType", pa.string()), ("pathOrInlineDv", pa.string()), ("offset", pa.int32()),
                      ("sizeInBytes", pa.int32()), ("cardinality", pa.int64())])
_ADD_TYPE = pa.struct([("path", pa.string()), ("partitionValues", pa.map_(pa.string(), pa.string())),
                       ("size", pa.int64()), ("modificationTime", pa.int64()), ("dataChange", pa.bool_()),
                       ("stats", pa.string()), ("deletionVector", _DV_TYPE)])


def write_v2_checkpoint(table: str) -> int:
    """A UUID-named v2 checkpoint of the latest version (``v2Checkpoint`` enabled first, in its own commit):
    a JSON checkpoint holding checkpointMetadata, protocol, metaData and a sidecar action, the add actions in
    a Parquet sidecar under ``_delta_log/_sidecars``, and ``_last_checkpoint``."""
    protocol = current_protocol(table)
    meta: dict[str, Any] = {}
    for v in range(last_version(table) + 1):
        for a in read_actions(table, v):
            meta = a.get("metaData", meta)
    readers = sorted({*(protocol.get("readerFeatures") or []), "v2Checkpoint"})
    writers = sorted({*(protocol.get("writerFeatures") or []), "v2Checkpoint"})
    protocol = {"minReaderVersion": 3, "minWriterVersion": 7, "readerFeatures": readers, "writerFeatures": writers}
    version = commit(table, [{"protocol": protocol}], "SET TBLPROPERTIES")
    adds = live_adds(table)
    rows = [{**{k: a.get(k) for k in ("path", "size", "modificationTime", "dataChange", "stats", "deletionVector")},
             "partitionValues": list((a.get("partitionValues") or {}).items())} for a in adds]
    side = f"{uuid.uuid4()}.parquet"
    sdir = os.path.join(table, "_delta_log", "_sidecars")
    os.makedirs(sdir, exist_ok=True)
    pq.write_table(pa.table({"add": pa.array(rows, _ADD_TYPE)}), os.path.join(sdir, side))
    name = f"{version:020d}.checkpoint.{uuid.uuid4()}.json"
    actions = [{"checkpointMetadata": {"version": version}}, {"protocol": protocol}, {"metaData": meta},
               {"sidecar": {"path": side, "sizeInBytes": os.path.getsize(os.path.join(sdir, side)),
                            "modificationTime": int(time.time() * 1000)}}]
    with open(os.path.join(table, "_delta_log", name), "w") as f:
        for a in actions:
            f.write(json.dumps(a) + "\n")
    with open(os.path.join(table, "_delta_log", "_last_checkpoint"), "w") as f:
        json.dump({"version": version, "size": len(actions) + len(adds), "sizeInBytes": 0,
                   "numOfAddFiles": len(adds)}, f)
    return version


def split_checkpoint(table: str, parts: int = 2) -> int:
    """Turn the table's classic checkpoint (deltalake's ``create_checkpoint``) into a multi-part one
    (``<v>.checkpoint.<i>.<n>.parquet``), as older Spark versions write for large logs."""
    log = os.path.join(table, "_delta_log")
    with open(os.path.join(log, "_last_checkpoint")) as f:
        last = json.load(f)
    v = int(last["version"])
    classic = os.path.join(log, f"{v:020d}.checkpoint.parquet")
    t = pq.read_table(classic)
    step = -(-t.num_rows // parts)
    for i in range(parts):
        name = f"{v:020d}.checkpoint.{i + 1:010d}.{parts:010d}.parquet"
        pq.write_table(t.slice(i * step, step), os.path.join(log, name))
    os.unlink(classic)
    last["parts"] = parts
    with open(os.path.join(log, "_last_checkpoint"), "w") as f:
        json.dump(last, f)
    return v
