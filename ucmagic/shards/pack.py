"""pack(): turn a tree of small files, or a table, into uncompressed tar shards of a target size.

The shards follow the WebDataset convention (members ``<key>.<ext>``; a sample is the run of
members sharing a key) with POSIX ustar headers (pax where a name or size needs it), so
``webdataset``, ``tar -tf`` and :mod:`ucmagic.shards` read them unchanged. ``index.json`` (the
format of :mod:`.index`) is written last and lists every member's data offset.

How a pack stays whole:

- the plan (which sample goes in which shard, at which offset) is a pure function of the sorted
  listing and the shard size, so a second run plans the same shards;
- each shard is written under a hidden temp name (``.ucpack-<pid>-<name>.tmp``), fsynced and
  renamed: it appears whole or not at all;
- ``.ucpack-state.json`` records each completed shard (size and a digest of its members' names,
  sizes and source mtimes); a killed pack run again keeps the shards whose digest and size still
  match and rewrites the rest;
- ``index.json`` is removed before any shard is rewritten and written again, atomically, last.

A sample bigger than ``shard_size`` gets a shard of its own (shards are never split inside a
sample). The source is never written to.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import tarfile
import threading
import time
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from .._util import DEFAULT_RETRIES, O_NOFOLLOW, atomic_write, is_remote_url
from ..errors import FetchError, PackError, SourceChangedError
from ..files.fetch import with_retries
from ..progress import Progress
from ..units import format_size, parse_size
from ..files.volume import FileEntry, Volume, copy_error, is_safe_rel, open_volume, resolve_local_path
from .index import INDEX_NAME, Member, ShardInfo, dumps_index, shard_info, split_key, write_index

BLOCK = tarfile.BLOCKSIZE    # 512
RECORD = tarfile.RECORDSIZE  # 10240: tar files end on a record boundary, as GNU tar and tarfile write them
SHARD_NAME = "shard-{:06d}.tar"
STATE_NAME = ".ucpack-state.json"
LOCK_NAME = ".ucpack.lock"   # held by the pack writing into the directory
TMP_PREFIX = ".ucpack-"
DEFAULT_WORKERS = 256        # reads in flight (the seeds' 256-way copy): a slow volume's latency hides behind them
READ_CHUNK = 8 << 20         # a member bigger than this is read in pieces of this size
MAX_AHEAD = 256 << 20        # bytes read ahead of the shard writers, in all
SHARD_WRITERS = 4            # shards written at once, each front to back
_SHARD_RE = re.compile(r"^shard-\d{6}\.tar$")


# ---------------------------------------------------------------- the plan (pure)

@dataclass(frozen=True)
class PlannedMember:
    """One tar member of the plan: its name, data size, header length and where the data comes from
    (``src``: a path relative to the source volume, or ``data``: bytes held in memory)."""

    name: str
    size: int
    hlen: int
    src: str | None = None
    data: bytes | None = None
    mtime: float = 0.0

    @classmethod
    def make(cls, name: str, size: int, *, src: str | None = None, data: bytes | None = None,
             mtime: float = 0.0) -> "PlannedMember":
        return cls(name, size, header_size(name, size), src, data, mtime)

    def header(self) -> bytes:
        return tar_header(self.name, self.size, self.mtime)

    @property
    def span(self) -> int:
        """Bytes this member takes in the tar: header, data, padding to the block."""
        return self.hlen + padded(self.size)


@dataclass(frozen=True)
class PlannedShard:
    """One shard of the plan: name, members in tar order (with header offsets), total size, digest."""

    name: str
    members: tuple[PlannedMember, ...]
    offsets: tuple[int, ...]  # offset of each member's header
    samples: int
    size: int
    digest: str

    def index_entry(self) -> ShardInfo:
        """The shard as :mod:`.index` records it (members with their data offsets)."""
        return shard_info(self.name, self.size, [_index_member(m.name, off + m.hlen, m.size)
                                                 for m, off in zip(self.members, self.offsets)])


def _index_member(name: str, data_offset: int, size: int) -> Member:
    ke = split_key(name)
    if ke is None:  # pack names every member <key>.<ext>
        raise AssertionError(f"member {name!r} has no key and extension")
    return Member(ke[0], ke[1], data_offset, size)


def padded(n: int) -> int:
    """``n`` rounded up to a whole number of 512-byte blocks."""
    return -(-n // BLOCK) * BLOCK


def tar_header(name: str, size: int, mtime: float = 0.0) -> bytes:
    """The header block(s) of a regular-file member (ustar; pax records where ustar cannot hold the
    name or size), with fixed owner and mode so equal inputs give equal bytes."""
    ti = tarfile.TarInfo(name)
    ti.size, ti.mtime, ti.mode, ti.type = size, int(max(0.0, mtime)), 0o644, tarfile.REGTYPE
    ti.uid = ti.gid = 0
    ti.uname = ti.gname = ""
    return ti.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")


def header_size(name: str, size: int) -> int:
    """``len(tar_header(name, size))`` (one block for a short ASCII name and a size under 8 GiB)."""
    if size < 8 ** 11 and len(name) <= 100 and name.isascii():
        return BLOCK
    return len(tar_header(name, size))


def tar_size(spans: Iterable[int]) -> int:
    """Size of a tar holding members of these spans: two zero blocks at the end, padded to a record."""
    return -(-(sum(spans) + 2 * BLOCK) // RECORD) * RECORD


def plan_boundaries(sample_spans: Sequence[int], shard_size: int) -> list[tuple[int, int]]:
    """``[start, stop)`` sample ranges, one per shard, filled greedily in order up to ``shard_size``
    bytes (counting the tar's end blocks). A sample that alone exceeds ``shard_size`` gets a shard of
    its own; no shard is empty."""
    out: list[tuple[int, int]] = []
    start, used = 0, 0
    for i, span in enumerate(sample_spans):
        if i > start and tar_size([used, span]) > shard_size:
            out.append((start, i))
            start, used = i, 0
        used += span
    if len(sample_spans) > start:
        out.append((start, len(sample_spans)))
    return out


def member_digest(m: PlannedMember) -> bytes:
    """What identifies a member's content without reading it: name, size and the source's mtime (or a
    CRC of in-memory data)."""
    tail = (f"{m.mtime!r}" if m.data is None else f"crc{zlib.crc32(m.data)}").encode()
    return m.name.encode("utf-8", "surrogateescape") + b"\0%d\0" % m.size + tail + b"\n"


def build_shard(index: int, samples: Sequence[Sequence[PlannedMember]]) -> PlannedShard:
    """The :class:`PlannedShard` holding ``samples`` (each a list of members) as shard ``index``."""
    members: list[PlannedMember] = []
    offsets: list[int] = []
    h = hashlib.sha256()
    off = 0
    for sample in samples:
        for m in sample:
            members.append(m)
            offsets.append(off)
            off += m.span
            h.update(member_digest(m))
    return PlannedShard(SHARD_NAME.format(index), tuple(members), tuple(offsets), len(samples), tar_size([off]),
                        h.hexdigest()[:32])


def plan_shards(samples: Sequence[Sequence[PlannedMember]], shard_size: int) -> list[PlannedShard]:
    """Cut ``samples`` (in order) into shards of at most ``shard_size`` bytes (see :func:`plan_boundaries`)."""
    spans = [sum(m.span for m in s) for s in samples]
    return [build_shard(i, samples[a:b]) for i, (a, b) in enumerate(plan_boundaries(spans, shard_size))]


@dataclass
class TreeSamples:
    """The samples of a file tree: members grouped by key, sorted; class names; files left out."""

    samples: list[list[PlannedMember]]
    classes: list[str] | None
    skipped: list[str]


def group_files(entries: Iterable[FileEntry], *, label_from_folder: bool = False) -> TreeSamples:
    """Group a listing into samples by key (the WebDataset convention: ``cat/0001.jpg`` and
    ``cat/0001.json`` are one sample ``cat/0001``), samples sorted by key and members by extension.

    With ``label_from_folder`` every sample gets a ``cls`` member holding the index (ASCII digits)
    of its top folder in the sorted list of top folders, as torchvision's ``ImageFolder`` numbers
    them. Files whose base name has no extension (``README``), hidden files and WebDataset
    metadata names are left out and listed in ``skipped``.
    """
    by_key: dict[str, list[tuple[str, FileEntry]]] = {}
    skipped: list[str] = []
    for e in entries:
        ke = split_key(e.path)
        if ke is None or any(p.startswith(".") for p in e.path.split("/")):
            skipped.append(e.path)
            continue
        by_key.setdefault(ke[0], []).append((ke[1], e))
    classes: list[str] | None = None
    if label_from_folder:
        flat = sorted(k for k in by_key if "/" not in k)
        if flat:
            raise PackError(f"label_from_folder: {len(flat)} samples sit directly in the source folder (e.g. "
                            f"{flat[0]!r}), so they have no class folder: move them into <class>/ folders or "
                            "pack without label_from_folder")
        classes = sorted({k.split("/", 1)[0] for k in by_key})
    class_index = {c: i for i, c in enumerate(classes or [])}
    samples: list[list[PlannedMember]] = []
    for key in sorted(by_key):
        members = sorted(by_key[key], key=lambda x: x[0])
        sample = [PlannedMember.make(f"{key}.{ext}", e.size, src=e.path, mtime=e.mtime) for ext, e in members]
        if classes is not None:
            if any(ext == "cls" for ext, _ in members):
                raise PackError(f"label_from_folder: sample {key!r} already has a .cls file; pack without "
                                "label_from_folder to keep its own label")
            label = str(class_index[key.split("/", 1)[0]]).encode()
            mtime = max(e.mtime for _, e in members)
            sample.append(PlannedMember.make(f"{key}.cls", len(label), data=label, mtime=mtime))
        samples.append(sample)
    return TreeSamples(samples, classes, sorted(skipped))


# ---------------------------------------------------------------- the summary

@dataclass
class PackSummary:
    """What :func:`pack` did; ``str()`` is a one-line summary."""

    source: str
    dest: str
    shards: int = 0            # shards in the pack
    written: int = 0           # ... written by this run
    kept: int = 0              # ... kept from an earlier, interrupted run (verified by size and digest)
    samples: int = 0
    files: int = 0             # tar members (source files, plus cls labels)
    bytes: int = 0             # shard bytes written by this run
    retries: int = 0           # source reads retried by this run (transient errors)
    total_bytes: int = 0       # bytes of all shards
    seconds: float = 0.0
    skipped: list[str] = field(default_factory=list)  # source files left out (no extension, hidden)
    classes: list[str] | None = None
    index: str = ""            # path of index.json

    @property
    def mb_per_s(self) -> float:
        """Shard bytes written per second, in MB (10^6 bytes)."""
        return self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0

    def __str__(self) -> str:
        rate = f", {self.mb_per_s:,.1f} MB/s" if self.bytes and self.seconds > 0 else ""
        s = (f"packed {self.samples:,} samples ({format_size(self.total_bytes)}) into {self.shards:,} shards in "
             f"{self.seconds:.1f} s{rate}; {self.written:,} written, {self.kept:,} kept from an earlier run -> "
             f"{self.dest}")
        if self.classes is not None:
            s += f"; {len(self.classes):,} classes"
        if self.retries:
            s += f"; {self.retries:,} reads retried"
        if self.skipped:
            s += f"; {len(self.skipped):,} files without an extension left out (e.g. {self.skipped[0]})"
        return s


# ---------------------------------------------------------------- destination and state

def _source_root(src: Any, vol: Volume | None) -> str | None:
    """The local directory behind the source, when there is one (for the nesting check)."""
    if vol is not None:
        return vol.local_root
    if isinstance(src, (str, os.PathLike)) and not is_remote_url(os.fspath(src)):
        p = os.fspath(src)
        return resolve_local_path(p[len("file://"):] if p.startswith("file://") else p)
    return None


def check_dest(src_root: str | None, dest: str) -> None:
    """Refuse a destination inside the source (or the source itself, or one holding the source)."""
    if src_root is None:
        return
    s, d = os.path.realpath(src_root), os.path.realpath(dest)
    if os.path.commonpath([s, d]) == s:
        raise PackError(f"destination {dest} is inside the source {src_root} (or is it): the pack would read "
                        "its own shards; pick a destination outside the source")
    if os.path.commonpath([s, d]) == d:
        raise PackError(f"source {src_root} is inside the destination {dest}: pick a destination outside the source")


def _temp_pid(name: str) -> int | None:
    """The pid in the name of a temp file of ours (a shard's, or the index's or state's atomic write), else None."""
    if name.startswith(TMP_PREFIX) and name.endswith(".tmp"):
        pid = name[len(TMP_PREFIX):].split("-", 1)[0]
    elif name.startswith((INDEX_NAME + ".tmp-", STATE_NAME + ".tmp-")):
        pid = name.split(".tmp-", 1)[1].split("-", 1)[0]
    else:
        return None
    return int(pid) if pid.isdigit() else None


def _is_ours(name: str) -> bool:
    return name in (INDEX_NAME, STATE_NAME, LOCK_NAME) or bool(_SHARD_RE.match(name)) or _temp_pid(name) is not None


def prepare_dest(dest: str) -> dict[str, dict[str, Any]]:
    """Create ``dest`` or check that it holds only an earlier pack; remove temp files of killed runs;
    return the completed shards recorded by an earlier run (name -> size, digest)."""
    os.makedirs(dest, exist_ok=True)
    names = _check_ours(dest)
    from ..files.locks import pid_running

    for n in names:  # temp files of a killed run (its pid no longer runs)
        pid = _temp_pid(n)
        if pid is not None and not pid_running(pid):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(dest, n))
    try:
        with open(os.path.join(dest, STATE_NAME), "rb") as f:
            doc = json.loads(f.read())
        done = doc.get("shards", {}) if isinstance(doc, dict) and doc.get("version") == 1 else {}
        return {k: v for k, v in done.items() if isinstance(v, dict)}
    except (OSError, ValueError):
        return {}


class _State:
    """``.ucpack-state.json``: the shards completed so far (updated after each rename, atomically)."""

    def __init__(self, dest: str, done: dict[str, dict[str, Any]]) -> None:
        self.path = os.path.join(dest, STATE_NAME)
        self.done = dict(done)
        self.mu = threading.Lock()

    def save(self) -> None:
        atomic_write(self.path, json.dumps({"version": 1, "shards": self.done}, sort_keys=True).encode(), sync=True)

    def complete(self, shard: PlannedShard) -> None:
        with self.mu:
            self.done[shard.name] = {"size": shard.size, "digest": shard.digest}
            self.save()


def is_complete(dest: str, done: Mapping[str, Mapping[str, Any]], name: str, size: int, digest: str) -> bool:
    """True when an earlier run completed shard ``name`` with this size and digest and its file is whole."""
    rec = done.get(name)
    if not rec or rec.get("size") != size or rec.get("digest") != digest:
        return False
    try:
        return os.stat(os.path.join(dest, name)).st_size == size
    except OSError:
        return False


def _tmp_name(dest: str, name: str) -> str:
    """A new temp name for shard ``name``: ``.ucpack-<pid>-<random>-<name>.tmp`` (no one can guess it)."""
    return os.path.join(dest, f"{TMP_PREFIX}{os.getpid()}-{os.urandom(6).hex()}-{name}.tmp")


def _open_new(path: str) -> Any:
    """``path`` opened for writing as a new file (``O_EXCL``), never through a symbolic link."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        return open(fd, "wb", buffering=1 << 20)  # the caller closes it (a module-level open: tests patch it)
    except BaseException:
        os.close(fd)
        raise


def _fsync_dir(path: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_index(dest: str, shards: Sequence[ShardInfo], classes: list[str] | None) -> str:
    """index.json through :mod:`.index`; with class names, its text plus the extra field ``classes``
    (readers of the format ignore fields they do not know)."""
    if classes is None:
        return write_index(dest, shards)
    doc = json.loads(dumps_index(shards))
    doc["classes"] = classes
    path = os.path.join(dest, INDEX_NAME)
    atomic_write(path, json.dumps(doc, separators=(",", ":")).encode(), sync=True)
    return path


# ---------------------------------------------------------------- writing shards of a file tree

def _read_piece(vol: Volume, m: PlannedMember, offset: int, size: int) -> bytearray:
    """``size`` bytes of member ``m``'s source file from ``offset`` (one read stream, its own handle)."""
    buf = bytearray(size)
    view = memoryview(buf)
    reader = vol.range_reader(m.src or "")
    try:
        got = 0
        while got < size:
            n = reader.readinto_at(offset + got, view[got:])
            if not n:
                raise SourceChangedError(f"{vol.display(m.src or '')} is shorter than listed ({m.size} bytes): it "
                                         "changed while packing; run pack again")
            got += n
    finally:
        reader.close()
    return buf


def _pieces(shard: PlannedShard) -> Iterator[tuple[PlannedMember, int, int]]:
    """``(member, offset, size)`` of every source read the shard needs, in tar order."""
    for m in shard.members:
        if m.src is not None:
            for off in range(0, m.size, READ_CHUNK):
                yield m, off, min(READ_CHUNK, m.size - off)


class _Stopped(Exception):  # noqa: N818 - internal signal, never raised to the caller
    """Another shard's writer failed: stop this one."""


@dataclass
class _Reads:
    """Source reads: retried by the one retry policy (:func:`ucmagic.files.fetch.with_retries`, as the
    datasets' fills are) up to ``retries`` times each; ``retried`` counts the retries made."""

    retries: int
    retried: int = 0
    mu: threading.Lock = field(default_factory=threading.Lock)

    def count(self, _exc: BaseException) -> None:
        with self.mu:
            self.retried += 1


def _write_tree_shard(vol: Volume, shard: PlannedShard, dest: str, state: _State, pool: ThreadPoolExecutor,
                      ahead_bytes: int, reads: _Reads, prog: Progress, stop: threading.Event) -> None:
    """Write one shard front to back (volumes such as ``/Volumes`` take only sequential writes) while
    its reads run ahead on ``pool``, up to ``ahead_bytes``; fsync, rename, record it."""

    def read(job: tuple[PlannedMember, int, int]) -> Any:
        m, off, n = job
        try:
            return with_retries(lambda _: _read_piece(vol, m, off, n), None, reads.retries, on_retry=reads.count)
        except (FetchError, PackError):
            raise
        except OSError as exc:
            raise copy_error(vol, m.src or m.name, exc) from exc

    todo = _pieces(shard)
    window: deque[tuple[int, Future[Any]]] = deque()
    queued = 0

    def top_up() -> None:
        nonlocal queued
        while queued < ahead_bytes:
            job = next(todo, None)
            if job is None:
                return
            window.append((job[2], pool.submit(read, job)))
            queued += job[2]

    tmp = _tmp_name(dest, shard.name)
    f = _open_new(tmp)  # closed below on every path
    try:
        top_up()
        written = 0
        for m in shard.members:
            f.write(m.header())
            if m.src is None:
                f.write(m.data or b"")
            else:
                for _ in range(0, m.size, READ_CHUNK):
                    if stop.is_set():
                        raise _Stopped
                    n, fut = window.popleft()
                    f.write(fut.result())
                    queued -= n
                    top_up()
                    prog.update(0, n)
            f.write(bytes(padded(m.size) - m.size))
            written += m.span
            if m.src is not None:  # a source file (a cls label is no file of the source)
                prog.update(1)
        f.write(bytes(shard.size - written))  # the end blocks and the record padding
        f.flush()
        os.fsync(f.fileno())
        f.close()
        os.replace(tmp, os.path.join(dest, shard.name))
    except BaseException:
        for _, fut in window:
            fut.cancel()
        f.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    state.complete(shard)


def _write_tree_shards(vol: Volume, todo: Sequence[PlannedShard], dest: str, state: _State, workers: int,
                       reads: _Reads, prog: Progress) -> None:
    """Write ``todo`` shards, up to SHARD_WRITERS at once (in plan order), their reads on ``workers``
    threads. The first failure stops every writer; complete shards stay, temp files go."""
    if not todo:
        return
    writers = min(SHARD_WRITERS, len(todo))
    ahead = max(READ_CHUNK, MAX_AHEAD // writers)
    stop = threading.Event()
    order = iter(todo)
    mu = threading.Lock()

    def writer() -> None:
        while not stop.is_set():
            with mu:
                shard = next(order, None)
            if shard is None:
                return
            try:
                _write_tree_shard(vol, shard, dest, state, pool, ahead, reads, prog, stop)
            except BaseException as exc:
                if stop.is_set():  # stopped by another writer's failure (or Ctrl-C): not the cause
                    raise _Stopped from exc
                stop.set()
                raise

    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="ucmagic-pack")
    wpool = ThreadPoolExecutor(writers, thread_name_prefix="ucmagic-pack-writer")
    futs = [wpool.submit(writer) for _ in range(writers)]
    try:
        wait(futs, return_when=FIRST_EXCEPTION)
        if stop.is_set():  # a writer failed: drop the queued reads, let the others stop, raise the cause
            pool.shutdown(wait=False, cancel_futures=True)
            wait(futs)
            errors = [e for e in (f.exception() for f in futs) if e is not None]
            raise next((e for e in errors if not isinstance(e, _Stopped)), errors[0])
        for f in futs:
            f.result()
    except BaseException:  # Ctrl-C too: stop the writers, drop queued reads, let reads in flight end
        stop.set()
        pool.shutdown(wait=False, cancel_futures=True)
        wait(futs)
        raise
    finally:
        wpool.shutdown(wait=True)
        pool.shutdown(wait=True, cancel_futures=True)


# ---------------------------------------------------------------- writing shards of a table

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
        self.tmp = _tmp_name(dest, self.name)
        self.f: Any = None if verify else _open_new(self.tmp)  # closed in finish()/discard()

    def add(self, sample: Sequence[PlannedMember]) -> None:
        for m in sample:
            self.members.append(_index_member(m.name, self.used + m.hlen, m.size))
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

    def finish(self, state: _State) -> None:
        """Complete the temp file (end blocks), fsync it, rename it into place, record it."""
        self.f.write(bytes(self.size - self.used))  # end blocks and record padding, written (append only)
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, os.path.join(self.dest, self.name))
        with state.mu:
            state.done[self.name] = {"size": self.size, "digest": self.digest}
            state.save()

    def discard(self) -> None:
        if self.f is not None:
            with contextlib.suppress(OSError):
                self.f.close()
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)

    def info(self) -> ShardInfo:
        return ShardInfo(self.name, self.size, self.samples, tuple(self.members))


class _MismatchError(Exception):
    """An earlier run's shard differs from the one planned now (internal)."""

    def __init__(self, index: int) -> None:
        self.index = index


def _table_pass(samples: Iterable[Sequence[PlannedMember]], target: int, dest: str, done: Mapping[str, Any],
                rewrite_from: int | None, state: _State, prog: Progress) -> tuple[list[ShardInfo], int, int]:
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

def _is_table(src: Any, kind: str | None) -> bool:
    if kind is not None:
        if kind not in ("files", "table"):
            raise PackError(f"kind must be 'files' or 'table', got {kind!r}")
        return kind == "table"
    if not isinstance(src, (str, os.PathLike)):
        return True
    from ..tables import classify_source

    return bool(classify_source(os.fspath(src)) == "table")


def pack(src: Any, dest: str | os.PathLike[str], shard_size: int | str = "1GB", *,
         label_from_folder: bool = False, pattern: str | None = None, workers: int | None = None,
         columns: Sequence[str] | Mapping[str, str] | None = None, key_column: str | None = None,
         kind: str | None = None, retries: int = DEFAULT_RETRIES, progress: bool | str = True,
         storage_options: dict[str, Any] | None = None, follow_symlinks: str = "inside",
         allow_shared_dest: bool = False) -> PackSummary:
    """Pack a tree of small files, or a table, into uncompressed tar shards of about ``shard_size``.

    Args:
        src: a directory, ``/Volumes/...`` path or fsspec URL of files (samples grouped by key: the same
            stem with different extensions, ``0001.jpg`` + ``0001.json``); or a table: a pandas/pyarrow
            table, a Parquet/CSV path or a Delta directory (one sample per row, a member per column).
        dest: local or mounted directory for the shards (created; must not be inside ``src``). An
            earlier, interrupted pack there is resumed: its complete shards are kept.
        shard_size: target size of each shard (``"1GB"``, bytes). A sample bigger than this gets a shard
            of its own.
        label_from_folder: files: add a ``cls`` member per sample, the index of its top folder in the
            sorted folder names (as ``ImageFolder``); the names go to ``index.json`` as ``classes``.
        pattern: files: glob over relative paths (``"**/*.jpg"``).
        workers: files: reads in flight (default 256).
        columns: table: the columns to pack (default all), or a mapping column -> extension
            (``{"image": "jpg", "label": "cls"}``).
        key_column: table: a column of unique keys (default: the row number as nine digits).
        kind: ``"files"`` or ``"table"`` to override the guess for a path.
        retries: retries of a failing read (transient errors), with backoff: the datasets' policy and default
            (14: a volume failing 1 open in 3 leaves under 1% odds that any of 100,000 files runs out).
        progress: ``True`` (widget in a notebook, else text), ``"text"``, ``"widget"`` or ``False``.
        storage_options: fsspec options for a URL source.
        follow_symlinks: files: a linked file is packed only when it points inside ``src`` (``"inside"``,
            default; others are left out with one warning naming them), always (``"all"``) or never (``"none"``).
        allow_shared_dest: write into a destination of another user's or one others may write to
            (refused by default; docs/reliability.md, "Threat model").

    Returns:
        :class:`PackSummary` (shards, samples, bytes, seconds, MB/s). Raises :class:`PackError` for bad
        input, :class:`EmptyListingError` for an empty source and :class:`FetchError` when a file cannot
        be read (complete shards are kept: run again to resume).

    Example::

        ucmagic.pack("/Volumes/main/default/imagenet/train", "/Volumes/main/default/shards/train",
                     shard_size="1GB", label_from_folder=True)
    """
    t0 = time.monotonic()
    target = parse_size(shard_size)
    if not target or target < RECORD:
        raise PackError(f"shard_size must be at least {RECORD} bytes, got {shard_size!r}")
    if workers is not None and workers < 1:
        raise PackError(f"workers must be >= 1, got {workers}")
    dest_s = os.fspath(dest)
    if is_remote_url(dest_s):
        raise PackError(f"destination {dest_s} is a URL: pack writes to a local or mounted directory "
                        "(a /Volumes path on Databricks); copy the shards up afterwards")
    dest_root = resolve_local_path(dest_s[len("file://"):] if dest_s.startswith("file://") else dest_s)
    table = _is_table(src, kind)
    if table:
        if label_from_folder or pattern is not None:
            raise PackError("label_from_folder and pattern apply to a tree of files, not to a table "
                            "(label columns of a table are packed as members)")
        check_dest(_source_root(src, None) if isinstance(src, (str, os.PathLike)) else None, dest_root)
        with _dest_lock(dest_root, allow_shared_dest):
            return _pack_table(src, dest_root, target, columns, key_column, progress, t0)
    if columns is not None or key_column is not None:
        raise PackError("columns and key_column apply to a table, not to a tree of files")
    if follow_symlinks not in ("inside", "all", "none"):
        raise PackError(f"follow_symlinks must be 'inside', 'all' or 'none', got {follow_symlinks!r}")
    vol = open_volume(src, storage_options)
    vol.follow_symlinks = follow_symlinks  # a file link out of the tree: left out, with one warning naming it
    check_dest(_source_root(src, vol), dest_root)
    with _dest_lock(dest_root, allow_shared_dest):
        return _pack_tree(vol, dest_root, target, label_from_folder, pattern, workers, retries, progress, t0)


@contextlib.contextmanager
def _dest_lock(dest: str, allow_shared: bool = False) -> Iterator[None]:
    """One pack at a time per destination: a second one waits for the first, then finds its shards.
    A destination of another user's or writable by others is refused unless ``allow_shared``."""
    from ..files.locks import check_write_dest, file_lock

    _check_ours(dest)  # before the lock file is made: a refused directory is left as it was
    os.makedirs(dest, exist_ok=True)
    check_write_dest(dest, allow_shared=allow_shared, what="pack destination")
    with file_lock(os.path.join(dest, LOCK_NAME)):
        yield


def _check_ours(dest: str) -> list[str]:
    """The names in ``dest`` (none if it does not exist yet); PackError if it is a file or holds other files."""
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise PackError(f"destination {dest} is a file: pass a directory")
    names = os.listdir(dest) if os.path.isdir(dest) else []
    foreign = sorted(n for n in names if not _is_ours(n))
    if foreign:
        raise PackError(f"destination {dest} is not empty and holds no earlier pack (e.g. {foreign[0]!r}): "
                        "pick an empty or new directory")
    return names


def _pack_tree(vol: Volume, dest_root: str, target: int, label_from_folder: bool, pattern: str | None,
               workers: int | None, retries: int, progress: bool | str, t0: float) -> PackSummary:
    tree = group_files(vol.list(pattern), label_from_folder=label_from_folder)
    if not tree.samples:
        raise PackError(f"no samples under {vol.display()}: every file lacks an extension (e.g. "
                        f"{tree.skipped[0]!r}); samples are files named <key>.<ext>")
    plan = plan_shards(tree.samples, target)
    done = prepare_dest(dest_root)
    keep = {s.name for s in plan if is_complete(dest_root, done, s.name, s.size, s.digest)}
    todo = [s for s in plan if s.name not in keep]
    res = PackSummary(vol.display(), dest_root, shards=len(plan), kept=len(keep), written=len(todo),
                      samples=sum(s.samples for s in plan), files=sum(len(s.members) for s in plan),
                      total_bytes=sum(s.size for s in plan), skipped=tree.skipped, classes=tree.classes)
    state = _begin(dest_root, {n: done[n] for n in keep}, bool(todo) or set(done) != keep)
    reads = _Reads(retries)
    prog = Progress(total=sum(m.src is not None for s in todo for m in s.members), desc="pack", mode=progress,
                    total_bytes=sum(m.size for s in todo for m in s.members if m.src is not None))  # source files
    try:
        _write_tree_shards(vol, todo, dest_root, state, workers or DEFAULT_WORKERS, reads, prog)
    except BaseException as exc:
        prog.close()
        _raise_if_disk_full(exc, dest_root)
        raise
    res.bytes = sum(s.size for s in todo)
    res.retries = reads.retried
    res.index = _end(dest_root, [s.index_entry() for s in plan], state, tree.classes)
    res.seconds = time.monotonic() - t0
    prog.close(text=str(res))
    return res


def _raise_if_disk_full(exc: BaseException, dest: str) -> None:
    """For a full disk, an OSError saying what to do instead of the bare ENOSPC."""
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        raise OSError(errno.ENOSPC, f"no space left on the destination {dest}: free space (or pick another "
                                    "destination) and run pack again; the complete shards are kept") from exc


def _begin(dest: str, kept: dict[str, dict[str, Any]], changes: bool) -> _State:
    """Record which shards are kept; when anything will change, remove index.json first so that no
    reader sees an index over half-rewritten shards."""
    state = _State(dest, kept)
    if changes:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(dest, INDEX_NAME))
        state.save()
    return state


def _end(dest: str, shards: Sequence[ShardInfo], state: _State, classes: list[str] | None) -> str:
    """Remove shards an earlier plan had beyond this one, then write index.json (last)."""
    names = {s.name for s in shards}
    for n in os.listdir(dest):
        if _SHARD_RE.match(n) and n not in names:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(dest, n))
    if set(state.done) - names:
        state.done = {k: v for k, v in state.done.items() if k in names}
        state.save()
    _fsync_dir(dest)
    return _write_index(dest, shards, classes)


def _pack_table(src: Any, dest: str, target: int, columns: Sequence[str] | Mapping[str, str] | None,
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
            state = _begin(dest, dict(done), True)
            try:
                samples = table_samples(_table_batches(src, cols, 4096), exts, key_column)
                shards, written, nbytes = _table_pass(samples, target, dest, done, rewrite_from, state, prog)
                break
            except _MismatchError as m:
                rewrite_from = m.index
                done = {k: v for k, v in done.items() if _shard_number(k) < m.index}
    except BaseException as exc:
        prog.close()
        _raise_if_disk_full(exc, dest)
        raise
    what = src if isinstance(src, (str, os.PathLike)) else type(src).__name__
    if not shards:
        raise PackError(f"the table {what} has no rows to pack")
    res = PackSummary(os.fspath(what) if isinstance(what, os.PathLike) else str(what), dest, shards=len(shards),
                      written=written, kept=len(shards) - written, samples=sum(s.samples for s in shards),
                      files=sum(len(s.members) for s in shards), bytes=nbytes,
                      total_bytes=sum(s.size for s in shards))
    res.index = _end(dest, shards, state, None)
    res.seconds = time.monotonic() - t0
    prog.close(text=str(res))
    return res


def _shard_number(name: str) -> int:
    return int(name[len("shard-"):-len(".tar")]) if _SHARD_RE.match(name) else -1


__all__ = ["pack", "PackSummary", "PackError", "parse_columns", "plan_boundaries", "plan_shards", "group_files",
           "tar_header", "tar_size"]
