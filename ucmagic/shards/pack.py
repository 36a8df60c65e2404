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
import os
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

from .._util import DEFAULT_RETRIES, is_remote_url
from ..errors import FetchError, PackError, SourceChangedError
from ..files.fetch import with_retries
from ..progress import Progress
from ..units import parse_size
from ..files.locks import replace_held, unlink_held
from ..files.volume import Volume, copy_error, open_volume, resolve_local_path
# The pack's parts, by concern (all names stay importable from here)
from .pack_plan import (BLOCK, RECORD, SHARD_NAME, PlannedMember, PlannedShard, TreeSamples, build_shard, group_files,
                        header_size, index_member, member_digest, padded, plan_boundaries, plan_shards, tar_header,
                        tar_size)
from .pack_state import (LOCK_NAME, SHARD_RE, STATE_NAME, TMP_PREFIX, PackState, PackSummary, begin_run, check_dest,
                         dest_lock, end_run, is_complete, open_new, prepare_dest, raise_if_disk_full, source_root,
                         tmp_name)
from .pack_tables import is_table, pack_table, parse_columns, table_samples

DEFAULT_WORKERS = 256        # reads in flight (the seeds' 256-way copy): a slow volume's latency hides behind them
READ_CHUNK = 8 << 20         # a member bigger than this is read in pieces of this size
MAX_AHEAD = 256 << 20        # bytes read ahead of the shard writers, in all
SHARD_WRITERS = 4            # shards written at once, each front to back


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


def _write_tree_shard(vol: Volume, shard: PlannedShard, dest: str, state: PackState, pool: ThreadPoolExecutor,
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

    tmp = tmp_name(dest, shard.name)
    f = open_new(tmp)  # closed below on every path
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
        replace_held(tmp, os.path.join(dest, shard.name))  # through the destination's descriptor
    except BaseException:
        for _, fut in window:
            fut.cancel()
        f.close()
        with contextlib.suppress(OSError):
            unlink_held(tmp)
        raise
    state.complete(shard)


def _write_tree_shards(vol: Volume, todo: Sequence[PlannedShard], dest: str, state: PackState, workers: int,
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
    table = is_table(src, kind)
    if table:
        if label_from_folder or pattern is not None:
            raise PackError("label_from_folder and pattern apply to a tree of files, not to a table "
                            "(label columns of a table are packed as members)")
        check_dest(source_root(src, None) if isinstance(src, (str, os.PathLike)) else None, dest_root)
        with dest_lock(dest_root, allow_shared_dest):
            return pack_table(src, dest_root, target, columns, key_column, progress, t0)
    if columns is not None or key_column is not None:
        raise PackError("columns and key_column apply to a table, not to a tree of files")
    if follow_symlinks not in ("inside", "all", "none"):
        raise PackError(f"follow_symlinks must be 'inside', 'all' or 'none', got {follow_symlinks!r}")
    vol = open_volume(src, storage_options)
    vol.follow_symlinks = follow_symlinks  # a file link out of the tree: left out, with one warning naming it
    check_dest(source_root(src, vol), dest_root)
    with dest_lock(dest_root, allow_shared_dest):
        return _pack_tree(vol, dest_root, target, label_from_folder, pattern, workers, retries, progress, t0)


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
    state = begin_run(dest_root, {n: done[n] for n in keep}, bool(todo) or set(done) != keep)
    reads = _Reads(retries)
    prog = Progress(total=sum(m.src is not None for s in todo for m in s.members), desc="pack", mode=progress,
                    total_bytes=sum(m.size for s in todo for m in s.members if m.src is not None))  # source files
    try:
        _write_tree_shards(vol, todo, dest_root, state, workers or DEFAULT_WORKERS, reads, prog)
    except BaseException as exc:
        prog.close()
        raise_if_disk_full(exc, dest_root)
        raise
    res.bytes = sum(s.size for s in todo)
    res.retries = reads.retried
    res.index = end_run(dest_root, [s.index_entry() for s in plan], state, tree.classes)
    res.seconds = time.monotonic() - t0
    prog.close(text=str(res))
    return res


__all__ = ["pack", "PackSummary", "PackError", "parse_columns", "plan_boundaries", "plan_shards", "group_files",
           "tar_header", "tar_size", "header_size", "PlannedMember", "PlannedShard", "TreeSamples", "build_shard",
           "member_digest", "index_member", "padded", "table_samples", "is_complete", "check_dest", "prepare_dest",
           "BLOCK", "RECORD", "SHARD_NAME", "STATE_NAME", "LOCK_NAME", "TMP_PREFIX", "SHARD_RE", "DEFAULT_WORKERS",
           "READ_CHUNK", "MAX_AHEAD", "SHARD_WRITERS"]
