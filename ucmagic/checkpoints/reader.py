"""The DCP storage reader for volumes: :class:`UCVolumeReader`.

Refuses a directory without a valid commit marker (or, without any ucmagic file, one whose
``.metadata`` names a file that is missing or short), unpickles ``.metadata`` with an allow-list,
downloads only the files its load plan needs, in parallel (into memory under a byte budget, or to
local staging for large shards), verifying size and CRC, and feeds them to torch as they arrive.
Non-tensor entries are checked with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.futures import Future

from .._util import is_remote_url
from .. import _torch_compat as compat
from . import transfer as xfer
from .commit import in_progress_error, read_commit, read_saving_record, volume_dir
from .format import (
    COMMIT_NAME,
    METADATA_NAME,
    SAVING_NAME,
    FileRecord,
    check_record,
    is_committed_by,
    not_committed,
    parse_commit,
    storage_problem,
)
from .unpickle import WeightsOnlyPlanner, load_metadata
from .urlfs import CheckpointFileSystem
from ..errors import (
    CheckpointAbandonedError,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointInProgressError,
    CheckpointOverwrittenError,
    CheckpointPathError,
    SourceNotFoundError,
)
from ..units import parse_size

log = logging.getLogger("ucmagic")

_foreign_logged: set[str] = set()


def _log_foreign_once(path: str) -> None:
    if path not in _foreign_logged:
        _foreign_logged.add(path)
        log.info("ucmagic: %s has no ucmagic commit marker (written by torch's FileSystemWriter or another tool); "
                 "its .metadata and every file it references are present, loading it without checksums", path)


def check_storage(metadata: Metadata, where: str, sizes: Callable[[str], int | None]) -> None:
    """Every storage entry of ``metadata`` (read from a file someone else may have written) names a file inside
    the checkpoint folder ``where`` with a byte range inside that file (``sizes(name)``: its size, None when
    missing), before any byte is read, written or allocated for it; else :class:`CheckpointPathError` (a path
    out of the folder) or :class:`CheckpointCorruptError` naming the entry."""
    entries: dict[str, list[tuple[Any, Any, Any]]] = {}
    for index, info in metadata.storage_data.items():
        entry = compat.storage_entry(info)
        if entry is None:
            raise CheckpointCorruptError(f"{where}: {METADATA_NAME} gives {getattr(index, 'fqn', index)!r} the storage "
                                         f"entry {info!r}, not a file range; the checkpoint is damaged")
        name, offset, length, descriptors = entry
        if descriptors is not None and not (isinstance(descriptors, (list, tuple))
                                            and all(isinstance(d, str) for d in descriptors)):
            raise CheckpointCorruptError(f"{where}: {METADATA_NAME} gives {getattr(index, 'fqn', index)!r} the "
                                         f"transforms {descriptors!r}; the checkpoint is damaged")
        problem = storage_problem(name, offset, length, 0)
        if problem is not None and "outside" in problem:
            raise CheckpointPathError(f"{where}: {METADATA_NAME} {problem}; nothing was read or written (a "
                                      "checkpoint someone else wrote?)")
        entries.setdefault(name, []).append((getattr(index, "fqn", index), offset, length))
    problems = []
    for name, ranges in sorted(entries.items()):
        size = sizes(name)
        for fqn, offset, length in ranges:
            problem = storage_problem(name, offset, length, size)
            if problem is not None:
                problems.append(problem if size is None or "references" in problem else f"{fqn!r} {problem}")
                break
    if problems:
        raise CheckpointCorruptError(f"{where} is not a complete checkpoint: {'; '.join(problems[:5])}; its save did "
                                     "not finish, files were removed, or its .metadata is damaged: save it again or "
                                     "load another")


def _stamp(path: str) -> tuple[int, int, int]:
    """What identifies this version of file ``path``: (inode, size, mtime in ns); on a store (0, size, mtime)."""
    if is_remote_url(path):
        size, mtime = xfer.stat_file(path)
        return 0, size, int(mtime * 1e9)
    st = os.stat(path)
    return st.st_ino, st.st_size, st.st_mtime_ns


def _set_load_id(metadata: Metadata, load_id: str) -> None:
    from torch.distributed.checkpoint.metadata import StorageMeta

    meta = getattr(metadata, "storage_meta", None)  # None in metadata written before torch had it
    if isinstance(meta, StorageMeta):
        meta.load_id = load_id


class _DownloadSession:
    """Per-load state: downloader pool, one future per needed file, and a memory budget.

    Files up to ``budget / threads`` bytes are read into memory; the bytes held (downloaded, not yet
    consumed) stay under ``budget``. Tickets are taken in the order torch consumes files, so a
    download waiting for budget only waits on files that torch reads first: no deadlock. Larger
    files go to the local staging directory.
    """

    def __init__(self, staging: str, threads: int, budget: int) -> None:
        self.staging = staging
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucmagic-download")
        self.downloads: dict[str, CFuture[Any]] = {}
        self.budget = budget
        self.cv = threading.Condition()
        self.held = 0
        self.next_ticket = 0
        self.closed = False

    def acquire(self, ticket: int, size: int) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.closed or (ticket == self.next_ticket
                                                     and (self.held == 0 or self.held + size <= self.budget)))
            if self.closed:
                raise CheckpointError("load cancelled")
            self.held += size
            self.next_ticket += 1
            self.cv.notify_all()

    def release(self, size: int) -> None:
        with self.cv:
            self.held -= size
            self.cv.notify_all()

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()
        for f in self.downloads.values():
            f.cancel()
        self.pool.shutdown(wait=True, cancel_futures=True)
        xfer.release_staging_dir(self.staging)


class _DownloadedFileSystem(CheckpointFileSystem):
    """Serves reads of downloaded files from memory or local staging (waiting for each), others from the volume."""

    def __init__(self) -> None:
        super().__init__()
        self.session: _DownloadSession | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        key = os.fspath(path)  # the path torch joined from a storage entry: the download of that entry's file
        session = self.session
        if session is None or "r" not in mode or key not in session.downloads:
            with super().create_stream(path, mode) as s:
                yield s
            return
        got = session.downloads[key].result()
        if isinstance(got, bytes):
            try:
                yield io.BytesIO(got)  # shares the bytes, no copy
            finally:
                session.release(len(got))
            return
        try:
            with open(got, "rb") as stream:
                yield stream
        finally:
            xfer.remove_quietly(got)


class UCVolumeReader(FileSystemReader):
    """``torch.distributed.checkpoint`` StorageReader for checkpoints on volumes.

    Loads a checkpoint committed by :class:`UCVolumeWriter` (verifying each file's size and CRC),
    or one written by torch's ``FileSystemWriter`` or any other DCP file-system writer (no ucmagic
    file in the directory, a readable ``.metadata``, every file it references present and long
    enough). Refuses, at construction, a save in progress, a killed or torn save, and an incomplete
    directory. Downloads only the files this rank's load plan needs, ``download_threads`` at a time.

    Args:
        path: checkpoint directory, or an fsspec URL (``s3://bucket/run/step_5``).
        storage_options: fsspec options for a URL path (credentials, ``client_kwargs``...); default: the
            store's own configuration (environment, fsspec config).
        wait: seconds to wait for a save in progress in ``path`` to commit (default: fail at once).
        staging_dir: local directory for downloaded shards too big for memory (deleted after use).
        download_threads: parallel downloads per rank.
        memory_budget: bytes of downloaded shards held in memory at once; a shard larger than
            ``memory_budget / download_threads`` goes through ``staging_dir`` instead (0 = always disk).
        require_commit: None (default): a ucmagic checkpoint must be committed, others are checked for
            completeness; True: refuse anything without a ucmagic commit marker; False: read whatever
            ``.metadata`` describes, unverified.
        allow_unsafe_pickle: accept arbitrary pickled objects in the checkpoint (only if you trust it).
        min_free: local free space to keep beyond the downloaded bytes.
    """

    fs: _DownloadedFileSystem  # installed by compat.install_filesystem in __init__

    def __init__(self, path: str | os.PathLike[str], *, wait: float | None = None, staging_dir: str | None = None,
                 download_threads: int = 16, memory_budget: int | str = "1GB", require_commit: bool | None = None,
                 allow_unsafe_pickle: bool = False, min_free: int | str = "512MB",
                 storage_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        where = volume_dir(path)
        if is_remote_url(where):
            xfer.use_storage_options(where, storage_options)
        super().__init__(where, **kwargs)
        compat.install_filesystem(self, _DownloadedFileSystem())
        if is_remote_url(where):
            self.path = self.fs.init_path(where)  # torch's FileSystem made it a Path ("s3:/..."); a URL stays one
        self.wait = None if wait is None else max(0.0, float(wait))
        self.staging_dir = staging_dir
        self.download_threads = max(1, int(download_threads))
        self.memory_budget = parse_size(memory_budget) or 0
        self.require_commit = require_commit
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self.min_free = parse_size(min_free) or 0
        self.commit: dict[str, Any] | None = None
        self._foreign_stamp: tuple[int, int, int] | None = None
        self._check_commit()

    def _check_commit(self) -> None:
        path = os.fspath(self.path)
        if not xfer.isdir(path):
            raise SourceNotFoundError(f"checkpoint directory {path} does not exist; check the path")
        self._metadata: tuple[str, Metadata] | None = None
        self._foreign_stamp = None
        start = time.monotonic()
        while True:
            try:
                self.commit = read_commit(path)
                return
            except CheckpointAbandonedError:
                raise  # its saver is gone: waiting cannot help
            except CheckpointInProgressError:
                self._wait_for_save(path, time.monotonic() - start)
            except CheckpointError:
                if xfer.exists(os.path.join(path, COMMIT_NAME)) or self.require_commit:
                    raise  # a torn marker, or the caller asked for ucmagic checkpoints only
                if self._waited_for_files(path, time.monotonic() - start):
                    continue
                self.commit = None
                if self.require_commit is None:
                    self._check_foreign(path)
                return

    def _wait_for_save(self, path: str, waited: float) -> None:
        """A save is in progress in ``path``: wait a little longer for it, or raise when ``wait`` is over."""
        if self.wait is None or waited >= self.wait:
            record = read_saving_record(path)
            if record is None:  # committed in the meantime: read it
                return
            raise in_progress_error(path, record, waited=waited if self.wait else None) from None
        time.sleep(min(0.05 * (1 + waited), 1.0, max(0.0, self.wait - waited)))

    def _waited_for_files(self, path: str, waited: float) -> bool:
        """No commit marker and no ``.metadata`` in ``path`` yet: sleep a little (True) while ``wait`` lasts."""
        if self.wait and waited < self.wait and not xfer.exists(os.path.join(path, METADATA_NAME)):
            time.sleep(min(0.05 * (1 + waited), 1.0, self.wait - waited))  # nothing there yet
            return True
        return False

    def _check_foreign(self, path: str) -> None:
        """A directory without ucmagic files: load it when its .metadata and every file it names are there."""
        md_path = os.path.join(path, METADATA_NAME)
        try:
            stamp = _stamp(md_path)
            metadata = self.read_metadata()
        except FileNotFoundError:
            raise not_committed(path) from None
        except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError, IndexError) as e:
            raise CheckpointCorruptError(f"{path}: {METADATA_NAME} cannot be read ({type(e).__name__}: {e}); the "
                                         "checkpoint is damaged or unfinished: save it again") from None
        del metadata  # its entries were checked against the files there (check_storage)
        self._foreign_stamp = stamp
        _log_foreign_once(path)

    def _check_unchanged(self) -> None:
        """After a load of a foreign checkpoint: no save may have started in the directory meanwhile."""
        if self._foreign_stamp is not None and self._foreign_changed():
            raise self._overwritten_error()

    def _foreign_changed(self) -> bool:
        """The foreign checkpoint's ``.metadata`` is not the one checked, or a save has begun in the directory."""
        path = os.fspath(self.path)
        try:
            same = _stamp(os.path.join(path, METADATA_NAME)) == self._foreign_stamp
        except FileNotFoundError:
            same = False
        return not same or xfer.exists(os.path.join(path, SAVING_NAME))

    def _overwritten(self) -> bool:
        """True when a save into this directory started after this reader checked its commit."""
        path = os.fspath(self.path)
        if self.commit is None:
            return self._foreign_stamp is not None and self._foreign_changed()
        try:
            now = parse_commit(xfer.read_bytes(os.path.join(path, COMMIT_NAME)), path)
        except (OSError, CheckpointError):
            return True  # the marker was withdrawn (a save began) or is being replaced
        record = read_saving_record(path)
        return now.get("save_id") != self.commit.get("save_id") or (
            record is not None and not is_committed_by(self.commit.get("save_id"), record))

    def _overwritten_error(self) -> CheckpointOverwrittenError:
        path = os.fspath(self.path)
        record = read_saving_record(path)
        since = ""
        if record and isinstance(record.get("since"), (int, float)):
            since = " at " + time.strftime("%H:%M:%S", time.localtime(record["since"]))
        return CheckpointOverwrittenError(
            f"{path} was overwritten while it was being loaded (a new save into it started{since}); what was read "
            "is discarded: load again once that save commits (UCVolumeReader(path, wait=SECONDS) waits for it) "
            "or load another step")

    @contextlib.contextmanager
    def _naming_overwrites(self) -> Iterator[None]:
        """A damaged or missing file while loading, because a save is overwriting the directory, says so."""
        try:
            yield
        except CheckpointCorruptError:
            if self._overwritten():
                raise self._overwritten_error() from None
            raise

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        old = os.fspath(self.path)
        super().reset(volume_dir(checkpoint_id) if checkpoint_id else None)
        if os.fspath(self.path) != old:
            self._check_commit()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return xfer.isdir(volume_dir(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self._naming_overwrites():
            return self._read_metadata()

    def _read_metadata(self) -> Metadata:
        cached: tuple[str, Metadata] | None = getattr(self, "_metadata", None)
        if cached is not None and cached[0] == os.fspath(self.path):
            _set_load_id(cached[1], self.load_id)
            return cached[1]
        path = os.fspath(self.path)
        metadata = load_metadata(self._metadata_bytes(path), allow_unsafe=self.allow_unsafe_pickle)
        meta = getattr(metadata, "storage_meta", None)
        if self.commit is not None and meta is not None and getattr(meta, "save_id", None) not in (
                None, self.commit["save_id"]):
            raise CheckpointCorruptError(f"{path}: {METADATA_NAME} belongs to another save than the commit "
                                         "marker; re-save this checkpoint")
        if self.commit is not None:
            records = self.commit["files"]
            check_storage(metadata, path, lambda name: records[name].size if name in records else None)
        else:  # a foreign checkpoint: against the files there, opened as they will be read (no link out)
            check_storage(metadata, path, lambda name: xfer.source_size(path, name))
        _set_load_id(metadata, self.load_id)
        self._metadata = (path, metadata)
        return metadata

    def _metadata_bytes(self, path: str) -> bytes:
        """The bytes of ``.metadata``, checked against the manifest when the checkpoint is committed."""
        try:
            raw = xfer.read_bytes(os.path.join(path, METADATA_NAME))
        except FileNotFoundError:
            if self.commit is not None:
                raise CheckpointCorruptError(f"{path}: {METADATA_NAME} is missing although the checkpoint is "
                                             "committed; re-save it or load another step") from None
            raise not_committed(path) from None
        if self.commit is not None:
            rec = self.commit["files"].get(METADATA_NAME)
            if rec is None:
                raise CheckpointCorruptError(f"{path}: the manifest does not list {METADATA_NAME}")
            check_record(METADATA_NAME, path, rec, len(raw), zlib.crc32(raw))
        return raw

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        names = self._needed_files(plan)
        safe_planner: Any = planner if self.allow_unsafe_pickle else WeightsOnlyPlanner(planner, os.fspath(self.path))
        if not names:
            return self._read_checked(plan, safe_planner)
        threads = min(self.download_threads, len(names))
        staging = xfer.make_staging_dir(self.staging_dir, f"load-{self.load_id}")
        session = _DownloadSession(staging, threads, self.memory_budget)
        try:
            self._start_downloads(session, names, threads)
            self.fs.session = session
            return self._read_checked(plan, safe_planner)
        finally:
            self.fs.session = None
            session.close()

    def _needed_files(self, plan: LoadPlan) -> list[str]:
        """The files ``plan`` reads, in the order torch reads them; each must be in the manifest."""
        names = list(dict.fromkeys(compat.storage_location(self.storage_data, item.storage_index)[0]
                                   for item in plan.items))
        if self.commit is not None:
            missing = [n for n in names if n not in self.commit["files"]]
            if missing:
                raise CheckpointCorruptError(f"{self.path}: files {missing} are not in the manifest; re-save it")
        return names

    def _read_checked(self, plan: LoadPlan, planner: Any) -> Future[None]:
        """torch's read of ``plan``; a damaged file, or a save begun meanwhile, raises as an overwrite."""
        with self._naming_overwrites():
            out = super().read_data(plan, planner)
        self._check_unchanged()
        return out

    def _start_downloads(self, session: _DownloadSession, names: list[str], threads: int) -> None:
        """Submit one download per file: into memory when small enough for the budget, else to staging."""
        expected = self.commit["files"] if self.commit else {}
        in_memory = {n for n in names if n in expected and expected[n].size <= self.memory_budget // threads}
        need = sum(expected[n].size for n in names if n in expected and n not in in_memory)
        if need:
            xfer.check_free_space(session.staging, need, self.min_free)
        ticket = 0
        for i, name in enumerate(names):  # same order torch reads them in, so the first file arrives first
            fut: CFuture[bytes | str]
            if name in in_memory:
                fut = session.pool.submit(self._fetch, session, ticket, name, expected[name])
                ticket += 1
            else:  # staged under a name of its own: no name read from .metadata becomes a local path
                fut = session.pool.submit(self._download, name, os.path.join(session.staging, f"{i:06d}.part"),
                                          expected.get(name))
            session.downloads[os.fspath(self.fs.concat_path(self.path, name))] = fut

    def _fetch(self, session: _DownloadSession, ticket: int, name: str, rec: FileRecord) -> bytes:
        path = os.fspath(self.path)
        session.acquire(ticket, rec.size)
        try:
            return xfer.download_bytes(os.path.join(path, name), rec, name=name, where=path)
        except BaseException:
            session.release(rec.size)
            raise

    def _download(self, name: str, local: str, rec: FileRecord | None) -> str:
        path = os.fspath(self.path)
        xfer.download_file(os.path.join(path, name), local, rec, name=name, where=path)
        return local
