"""Packing a table: one sample per row, one tar member per column (encoded bytes), written in one pass
with the shard boundaries decided as rows arrive."""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from ..errors import PackError
from ..progress import Progress
from ..files.volume import is_safe_rel
from .index import Member, ShardInfo, split_key
from .pack_plan import SHARD_NAME, PlannedMember, index_member, member_digest, padded, tar_size
from ..files.locks import replace_held, unlink_held
from .pack_state import (SHARD_RE, PackState, PackSummary, begin_run, end_run, is_complete, open_new, prepare_dest,
                         raise_if_disk_full, tmp_name)


def _encode(value: Any) -> bytes | None:
    """A table cell as member bytes: bytes as they are, text as UTF-8, numbers as ASCII (``b"3"``,
    as WebDataset writes ``cls``), lists and dicts as JSON; None leaves the member out."""
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, bool):
        return b"1" if value else b"0"
    if isinstance(value, (int, float)):
        if isinstance(value, float) and math.isnan(value):
            return None
        return str(value).encode()
    if hasattr(value, "item") and not hasattr(value, "__len__"):  # a numpy scalar
        return _encode(value.item())
    if hasattr(value, "tolist"):
        value = value.tolist()
    return json.dumps(value, default=str).encode()


def _table_batches(src: Any, columns: Sequence[str] | None, batch_rows: int) -> Iterator[Any]:
    """Record batches of a pandas/arrow table, a Parquet/CSV path or a Delta directory, in order."""
    import pyarrow as pa

    from ..tables import arrow_dataset, resolve_source

    source = resolve_source(src)
    cols = list(columns) if columns is not None else None
    if source.kind == "delta":  # the rows its snapshot defines, as a RecordBatchReader
        for batch in arrow_dataset(source, cols):
            for start in range(0, batch.num_rows, batch_rows):
                yield batch.slice(start, batch_rows)
        return
    if source.kind in ("parquet", "csv"):
        yield from arrow_dataset(source).to_batches(columns=cols, batch_size=batch_rows)
        return
    obj = source.obj
    if source.kind == "pandas":
        obj = pa.Table.from_pandas(obj if cols is None else obj[cols], preserve_index=False)
    elif source.kind != "arrow":
        raise PackError(f"pack reads pandas and pyarrow tables, Parquet/CSV paths and Delta directories, not a "
                        f"{source.kind} source: write it as Parquet first (ucmagic.export_parquet)")
    if isinstance(obj, pa.RecordBatch):
        obj = pa.Table.from_batches([obj])
    if isinstance(obj, pa.RecordBatchReader):
        obj = obj.read_all()
    if cols is not None:
        obj = obj.select(cols)
    yield from obj.to_batches(max_chunksize=batch_rows)


def parse_columns(text: str | None) -> list[str] | dict[str, str] | None:
    """The ``--columns`` option of the CLI and ``%ucstage --pack``: ``"image,label"`` -> a list,
    ``"image=jpg,label=cls"`` -> a mapping column -> extension (a bare name keeps its own)."""
    if not text:
        return None
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not any("=" in p for p in parts):
        return parts
    return {c.strip(): (e.strip() if sep else c.strip()) for c, sep, e in (p.partition("=") for p in parts)}


def _check_ext(col: str, ext: str) -> str:
    if not ext or ext.startswith(".") or "/" in ext or "\0" in ext:
        raise PackError(f"column {col!r}: extension {ext!r} cannot name a tar member; pass columns={{column: ext}} "
                        "with extensions such as 'jpg' or 'cls'")
    return ext


def table_samples(batches: Iterable[Any], exts: Mapping[str, str] | None, key_column: str | None
                  ) -> Iterator[list[PlannedMember]]:
    """One sample per row, in row order: a member ``<key>.<ext>`` per non-null column (``exts`` maps
    columns to extensions; default: the column name). The key is ``key_column``'s value, or the row
    number as nine digits."""
    row = 0
    seen: set[str] = set()
    for batch in batches:
        names = list(batch.schema.names)
        if key_column is not None and key_column not in names:
            raise PackError(f"key_column {key_column!r} is not a column of the table (columns: {', '.join(names)})")
        cols = [c for c in names if c != key_column and (exts is None or c in exts)]
        exts_of = {c: _check_ext(c, (exts or {}).get(c, c)) for c in cols}
        if len(set(exts_of.values())) < len(exts_of):
            raise PackError(f"two columns map to one extension ({exts_of}): each member of a sample needs its own")
        data = {c: batch.column(c).to_pylist() for c in cols}
        keys = batch.column(key_column).to_pylist() if key_column is not None else None
        for i in range(batch.num_rows):
            key = str(keys[i]) if keys is not None else f"{row:09d}"
            if keys is not None:
                if split_key(key + ".x") != (key, "x") or not is_safe_rel(key):
                    raise PackError(f"key {key!r} (row {row}) cannot be a WebDataset key: keys hold no dot in "
                                    "their last part and no empty parts; pick another key_column or none")
                if key in seen:
                    raise PackError(f"key {key!r} appears twice in {key_column!r} (row {row}): keys must be unique")
                seen.add(key)
            sample = []
            for c in cols:
                payload = _encode(data[c][i])
                if payload is not None:
                    name = f"{key}.{exts_of[c]}"
                    sample.append(PlannedMember.make(name, len(payload), data=payload))
            if not sample:
                raise PackError(f"row {row} has no non-null value to pack: drop empty rows first")
            yield sample
            row += 1


class _TableShard:
    """A shard of a table pack being assembled row by row: written to its temp file as rows come
    (``verify=False``), or only digested to check an earlier run's file (``verify=True``)."""

    def __init__(self, index: int, dest: str, verify: bool) -> None:
        self.name = SHARD_NAME.format(index)
        self.dest, self.verify = dest, verify
        self.used = 0
        self.samples = 0
        self.members: list[Member] = []
        self.h = hashlib.sha256()
        self.tmp = tmp_name(dest, self.name)
        self.f: Any = None if verify else open_new(self.tmp)  # closed in finish()/discard()

    def add(self, sample: Sequence[PlannedMember]) -> None:
        for m in sample:
            self.members.append(index_member(m.name, self.used + m.hlen, m.size))
            self.h.update(member_digest(m))
            if self.f is not None:
                self.f.write(m.header())
                self.f.write(m.data or b"")
                self.f.write(bytes(padded(m.size) - m.size))
            self.used += m.span
        self.samples += 1

    @property
    def size(self) -> int:
        return tar_size([self.used])

    @property
    def digest(self) -> str:
        return self.h.hexdigest()[:32]

    def finish(self, state: PackState) -> None:
        """Complete the temp file (end blocks), fsync it, rename it into place, record it."""
        self.f.write(bytes(self.size - self.used))  # end blocks and record padding, written (append only)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        replace_held(self.tmp, os.path.join(self.dest, self.name))  # through the destination's descriptor
        with state.mu:
            state.done[self.name] = {"size": self.size, "digest": self.digest}
            state.save()

    def discard(self) -> None:
        if self.f is not None:
            with contextlib.suppress(OSError):
                self.f.close()
            with contextlib.suppress(OSError):
                unlink_held(self.tmp)

    def info(self) -> ShardInfo:
        return ShardInfo(self.name, self.size, self.samples, tuple(self.members))


class _MismatchError(Exception):
    """An earlier run's shard differs from the one planned now (internal)."""

    def __init__(self, index: int) -> None:
        self.index = index


def _table_pass(samples: Iterable[Sequence[PlannedMember]], target: int, dest: str, done: Mapping[str, Any],
                rewrite_from: int | None, state: PackState, prog: Progress) -> tuple[list[ShardInfo], int, int]:
    """One pass over the rows: ``(shards, written, bytes written)``. A shard an earlier run recorded
    (and not at or past ``rewrite_from``) is checked instead of written; a mismatch raises
    :class:`_MismatchError` with its index."""
    shards: list[ShardInfo] = []
    written = nbytes = 0
    cur: _TableShard | None = None

    def close(sh: _TableShard) -> None:
        nonlocal written, nbytes
        if sh.verify:
            if not is_complete(dest, done, sh.name, sh.size, sh.digest):
                raise _MismatchError(len(shards))
            state.done[sh.name] = dict(done[sh.name])
        else:
            sh.finish(state)
            written, nbytes = written + 1, nbytes + sh.size
        shards.append(sh.info())
        prog.update(1, sh.size)

    try:
        for s in samples:
            span = sum(m.span for m in s)
            if cur is not None and cur.samples and tar_size([cur.used, span]) > target:
                close(cur)
                cur = None
            if cur is None:
                i = len(shards)
                name = SHARD_NAME.format(i)
                verify = (rewrite_from is None or i < rewrite_from) and name in done \
                    and os.path.isfile(os.path.join(dest, name))
                cur = _TableShard(i, dest, verify)
            cur.add(s)
        if cur is not None:
            close(cur)
            cur = None
    finally:
        if cur is not None:
            cur.discard()
    return shards, written, nbytes


# ---------------------------------------------------------------- the API

def is_table(src: Any, kind: str | None) -> bool:
    if kind is not None:
        if kind not in ("files", "table"):
            raise PackError(f"kind must be 'files' or 'table', got {kind!r}")
        return kind == "table"
    if not isinstance(src, (str, os.PathLike)):
        return True
    from ..tables import classify_source

    return bool(classify_source(os.fspath(src)) == "table")


def pack_table(src: Any, dest: str, target: int, columns: Sequence[str] | Mapping[str, str] | None,
                key_column: str | None, progress: bool | str, t0: float) -> PackSummary:
    """Tables stream in row order (Arrow decodes on its own threads) into one shard after the other,
    holding one batch of rows in memory. On resume a shard recorded complete is re-planned from the
    rows and kept when its digest and size match; at the first mismatch the rows are read again and
    every shard from there on is rewritten."""
    exts = dict(columns) if isinstance(columns, Mapping) else None
    cols: list[str] | None = list(columns) if columns is not None else None
    if cols is not None and key_column is not None and key_column not in cols:
        cols.append(key_column)
    done = prepare_dest(dest)
    rewrite_from: int | None = None
    prog = Progress(total=None, desc="pack", unit="shards", mode=progress)
    try:
        while True:
            state = begin_run(dest, dict(done), True)
            try:
                samples = table_samples(_table_batches(src, cols, 4096), exts, key_column)
                shards, written, nbytes = _table_pass(samples, target, dest, done, rewrite_from, state, prog)
                break
            except _MismatchError as m:
                rewrite_from = m.index
                done = {k: v for k, v in done.items() if _shard_number(k) < m.index}
    except BaseException as exc:
        prog.close()
        raise_if_disk_full(exc, dest)
        raise
    what = src if isinstance(src, (str, os.PathLike)) else type(src).__name__
    if not shards:
        raise PackError(f"the table {what} has no rows to pack")
    res = PackSummary(os.fspath(what) if isinstance(what, os.PathLike) else str(what), dest, shards=len(shards),
                      written=written, kept=len(shards) - written, samples=sum(s.samples for s in shards),
                      files=sum(len(s.members) for s in shards), bytes=nbytes,
                      total_bytes=sum(s.size for s in shards))
    res.index = end_run(dest, shards, state, None)
    res.seconds = time.monotonic() - t0
    prog.close(text=str(res))
    return res


def _shard_number(name: str) -> int:
    return int(name[len("shard-"):-len(".tar")]) if SHARD_RE.match(name) else -1
