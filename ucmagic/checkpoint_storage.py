"""torch.distributed.checkpoint storage for volumes: :class:`UCVolumeWriter` and :class:`UCVolumeReader`.

Writer: each rank writes its shards to a private local staging directory at disk speed; as each
file closes it is handed to a pool of uploader threads that copy it to the volume (CRC-32 on the
fly, ``fsync``, size check) and delete the staged copy. A rank's ``write_data`` returns once its
files are durable, carrying their sizes and checksums; the coordinator then writes ``.metadata``
and, last, the commit marker (the manifest). Before anyone writes, the coordinator removes an
existing marker and ``.metadata``, so an interrupted overwrite is refused rather than mixed.
Nothing is renamed on the volume.

Reader: refuses a directory without a valid marker, unpickles ``.metadata`` with an allow-list,
downloads only the files its load plan needs, in parallel (into memory under a byte budget, or to
local staging for large shards), verifying size and CRC, and feeds them to torch as they arrive. Non-tensor entries are checked with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue
import shutil
import threading
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterator

import torch
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import checkpoint_transfer as xfer
from .checkpoint_format import (
    COMMIT_NAME,
    FORMAT_DCP,
    METADATA_NAME,
    CheckpointCorruptError,
    CheckpointError,
    FileRecord,
    UnsafeCheckpointError,
    check_record,
    make_commit,
    not_committed,
    parse_commit,
    stale_files,
)
from .units import parse_size
from .volume import resolve_local_path

DCP_VERSION = "1.0.0"
_MANIFEST_FQN = "__ucmagic_files__"
FILE_TARGET_BYTES = 16 << 20
MAX_AUTO_FILES = 32


def auto_file_count(nbytes: int) -> int:
    """Shard files for ``nbytes`` of tensors: one per ~16 MB (uploads run in parallel), 1 to 32."""
    return max(1, min(MAX_AUTO_FILES, -(-nbytes // FILE_TARGET_BYTES)))


def _volume_path(path: str | os.PathLike) -> str:
    p = os.fspath(path)
    if p.startswith("file://"):
        p = p[len("file://"):]
    if "://" in p:
        raise CheckpointError(f"{p}: checkpoints go to a directory (a local disk or a mounted volume such as "
                              "/Volumes/...), not a URL; mount the storage or use its /Volumes path")
    return resolve_local_path(p)


def read_commit(path: str) -> dict[str, Any]:
    """The parsed commit marker of checkpoint directory ``path``; raises when it is not committed."""
    try:
        data = xfer.read_bytes(os.path.join(path, COMMIT_NAME))
    except FileNotFoundError:
        raise not_committed(path) from None
    return parse_commit(data, path)


# ---------------------------------------------------------------- restricted unpickling of .metadata

_ALLOWED_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` but refuses any global that is not a DCP metadata type."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _ALLOWED_GLOBALS or module == "torch.distributed.checkpoint.metadata":
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
                return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint .metadata refers to {module}.{name}, which is not checkpoint metadata; refusing to "
            "unpickle it (pass allow_unsafe_pickle=True to UCVolumeReader only if you trust this checkpoint)")


def load_metadata(data: bytes, *, allow_unsafe: bool = False) -> Metadata:
    """Unpickle DCP metadata, admitting only metadata classes unless ``allow_unsafe``."""
    if allow_unsafe:
        return pickle.loads(data)  # noqa: S301 - explicitly requested by the caller
    return _MetadataUnpickler(io.BytesIO(data)).load()


# ---------------------------------------------------------------- writer

class _UploadSession:
    """Per-save state: staging dir, uploader pool, one future per staged file."""

    def __init__(self, staging: str, threads: int, verify: str) -> None:
        self.staging = staging
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucmagic-upload")
        self.verify = verify
        self.uploads: dict[str, CFuture] = {}
        self.mu = threading.Lock()

    def staged(self, name: str, local: str, remote: str) -> None:
        fut = self.pool.submit(xfer.upload_file, local, remote, verify=self.verify)
        with self.mu:
            self.uploads[name] = fut

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        shutil.rmtree(self.staging, ignore_errors=True)


class _StagingFileSystem(FileSystem):
    """torch's FileSystem on the volume, except that data files are written to local staging and uploaded."""

    def __init__(self) -> None:
        super().__init__()
        self.session: _UploadSession | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        session = self.session
        if session is None or "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        name = os.path.basename(os.fspath(path))
        local = os.path.join(session.staging, name)
        with open(local, mode) as stream:
            yield stream  # type: ignore[misc]
        session.staged(name, local, os.fspath(path))


class UCVolumeWriter(FileSystemWriter):
    """``torch.distributed.checkpoint`` StorageWriter that stages shards locally and uploads them in parallel.

    Use with ``dcp.save`` / ``dcp.async_save``, with or without a process group. ``async_save``
    returns once the state is copied to memory; its future completes when every file is durable on
    the volume and the checkpoint is committed, and raises upload errors.

    Args:
        path: checkpoint directory (local, a mount, or ``/Volumes/...``).
        staging_dir: local directory for staged shards (default ``$UCMAGIC_STAGING_DIR`` or the temp dir).
        upload_threads: parallel uploads per rank.
        files_per_rank: shard files per rank (more files = more parallel uploads); default: one per
            ~16 MB of state, at most 32.
        thread_count: local writer threads (default: up to 4).
        verify: ``"size"`` (fsync + size check, CRC of the bytes sent) or ``"full"`` (also read back).
        min_free: local free space to keep beyond the staged bytes.
        commit_info: JSON-able dict stored in the commit marker (``save_checkpoint`` stores step and extra).
        **kwargs: passed to ``FileSystemWriter`` (``overwrite``, ``cache_staged_state_dict``, ...).
    """

    def __init__(self, path: str | os.PathLike, *, staging_dir: str | None = None, upload_threads: int = 16,
                 files_per_rank: int | None = None, thread_count: int | None = None, verify: str = "size",
                 min_free: int | str = "512MB", commit_info: dict[str, Any] | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("sync_files", False)  # durability comes from fsync on the volume copy
        if thread_count is None:
            thread_count = min(4, os.cpu_count() or 1)
        super().__init__(_volume_path(path), thread_count=max(1, thread_count), **kwargs)
        if verify not in ("size", "full"):
            raise ValueError(f"verify must be 'size' or 'full', got {verify!r}")
        self.fs = _StagingFileSystem()
        self.staging_dir = staging_dir
        self.upload_threads = max(1, int(upload_threads))
        self.files_per_rank = None if files_per_rank is None else max(1, int(files_per_rank))
        self.verify = verify
        self.min_free = parse_size(min_free) or 0
        self.commit_info = dict(commit_info or {})
        self._refuse_overwrite()

    def _refuse_overwrite(self) -> None:
        if not self.overwrite and os.path.exists(os.path.join(self.path, COMMIT_NAME)):
            raise CheckpointError(f"{self.path} already holds a committed checkpoint and overwrite=False; "
                                  "save to another directory or pass overwrite=True")

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(_volume_path(checkpoint_id) if checkpoint_id else None)
        self._refuse_overwrite()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in os.fspath(checkpoint_id) or os.fspath(checkpoint_id).startswith("file://")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        if not self.use_collectives:
            raise CheckpointError("UCVolumeWriter needs rank coordination to commit a checkpoint; "
                                  "call dcp.save without use_collectives=False")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        os.makedirs(self.path, exist_ok=True)
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # coordinator only, before any rank writes: un-commit what is there, so a torn overwrite is refused
        self._refuse_overwrite()
        xfer.remove_quietly(os.path.join(self.path, COMMIT_NAME))
        xfer.remove_quietly(os.path.join(self.path, METADATA_NAME))
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        from torch.distributed.checkpoint.filesystem import _item_size, _split_by_size_and_type

        prefix = plan.storage_data.prefix
        items = list(plan.items)
        need = sum(_item_size(i) for i in items if i.type != WriteItemType.BYTE_IO)
        if self.single_file_per_rank:
            n_files = self.files_per_rank or auto_file_count(need)
            buckets = [b for b in _split_by_size_and_type(n_files, items) if b] if items else []
        else:
            buckets = [[i] for i in items]
        staging = xfer.make_staging_dir(self.staging_dir, f"save-{self.save_id}-{prefix.strip('_') or 'r'}")
        session = _UploadSession(staging, self.upload_threads, self.verify)
        try:
            xfer.check_free_space(staging, int(need * 1.05) + (1 << 20), self.min_free)
            file_queue: queue.Queue = queue.Queue()
            names = []
            for n, bucket in enumerate(buckets):
                name = f"{prefix}{n}.distcp"
                names.append(name)
                file_queue.put((os.path.join(self.path, name), name, bucket))
            self.fs.session = session
            try:
                results = list(self._write_data(planner, file_queue).value())
            finally:
                self.fs.session = None
            missing = [n for n in names if n not in session.uploads]
            if missing:
                raise CheckpointError(f"writing checkpoint shards {missing} to local staging {staging} failed "
                                      "(see the thread errors above); check free space and permissions there")
            files = {}
            try:
                for name in names:
                    files[name] = tuple(session.uploads[name].result())
            except BaseException:
                for f in session.uploads.values():
                    f.cancel()
                raise
        finally:
            session.close()
        results.append(WriteResult(index=MetadataIndex(f"{_MANIFEST_FQN}{prefix}"), size_in_bytes=0,
                                   storage_data={"files": files}))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, FileRecord] = {}
        storage_md = {}
        for wr_list in results:
            for wr in wr_list:
                if isinstance(wr.index, MetadataIndex) and wr.index.fqn.startswith(_MANIFEST_FQN):
                    files.update({k: FileRecord(*v) for k, v in wr.storage_data["files"].items()})
                else:
                    storage_md[wr.index] = wr.storage_data
        metadata.version = DCP_VERSION
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        files[METADATA_NAME] = xfer.write_bytes(os.path.join(self.path, METADATA_NAME), pickle.dumps(metadata))
        marker = make_commit(kind=FORMAT_DCP, save_id=self.save_id, files=files, info=self.commit_info)
        xfer.write_bytes(os.path.join(self.path, COMMIT_NAME), marker)
        for name in stale_files(os.listdir(self.path), files):  # shards of an older save of this directory
            xfer.remove_quietly(os.path.join(self.path, name))


# ---------------------------------------------------------------- reader

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
        self.downloads: dict[str, CFuture] = {}
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
        shutil.rmtree(self.staging, ignore_errors=True)


class _DownloadedFileSystem(FileSystem):
    """Serves reads of downloaded files from memory or local staging (waiting for each), others from the volume."""

    def __init__(self) -> None:
        super().__init__()
        self.session: _DownloadSession | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        name = os.path.basename(os.fspath(path))
        session = self.session
        if session is None or "r" not in mode or name not in session.downloads:
            with super().create_stream(path, mode) as s:
                yield s
            return
        got = session.downloads[name].result()
        if isinstance(got, bytes):
            try:
                yield io.BytesIO(got)  # type: ignore[misc]  # shares the bytes, no copy
            finally:
                session.release(len(got))
            return
        try:
            with open(got, "rb") as stream:
                yield stream  # type: ignore[misc]
        finally:
            xfer.remove_quietly(got)


class _WeightsOnlyPlanner:
    """Delegates to a LoadPlanner, but first checks every non-tensor blob with a weights-only load."""

    def __init__(self, inner: LoadPlanner, where: str) -> None:
        self._inner = inner
        self._where = where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(io.BytesIO(value.getbuffer()), weights_only=True)
        except Exception as e:  # noqa: BLE001 - the weights-only unpickler raises several types
            raise UnsafeCheckpointError(
                f"{self._where}: entry {read_item.dest_index.fqn!r} is a pickled object that "
                f"torch.load(weights_only=True) refuses ({str(e).splitlines()[0]}); pass "
                "allow_unsafe_pickle=True to UCVolumeReader only if you trust this checkpoint") from None
        value.seek(0)
        self._inner.load_bytes(read_item, value)


class UCVolumeReader(FileSystemReader):
    """``torch.distributed.checkpoint`` StorageReader for checkpoints written by :class:`UCVolumeWriter`.

    Refuses (at construction) a directory without a commit marker, downloads only the files this
    rank's load plan needs, ``download_threads`` at a time, and verifies each file's size and CRC.

    Args:
        path: checkpoint directory.
        staging_dir: local directory for downloaded shards too big for memory (deleted after use).
        download_threads: parallel downloads per rank.
        memory_budget: bytes of downloaded shards held in memory at once; a shard larger than
            ``memory_budget / download_threads`` goes through ``staging_dir`` instead (0 = always disk).
        require_commit: set False to read a plain torch DCP directory (no marker, no verification).
        allow_unsafe_pickle: accept arbitrary pickled objects in the checkpoint (only if you trust it).
        min_free: local free space to keep beyond the downloaded bytes.
    """

    def __init__(self, path: str | os.PathLike, *, staging_dir: str | None = None, download_threads: int = 16,
                 memory_budget: int | str = "1GB", require_commit: bool = True, allow_unsafe_pickle: bool = False,
                 min_free: int | str = "512MB", **kwargs: Any) -> None:
        super().__init__(_volume_path(path), **kwargs)
        self.fs = _DownloadedFileSystem()
        self.staging_dir = staging_dir
        self.download_threads = max(1, int(download_threads))
        self.memory_budget = parse_size(memory_budget) or 0
        self.require_commit = require_commit
        self.allow_unsafe_pickle = allow_unsafe_pickle
        self.min_free = parse_size(min_free) or 0
        self.commit: dict[str, Any] | None = None
        self._check_commit()

    def _check_commit(self) -> None:
        path = os.fspath(self.path)
        if not os.path.isdir(path):
            from .errors import SourceNotFoundError

            raise SourceNotFoundError(f"checkpoint directory {path} does not exist; check the path")
        if self.require_commit:
            self.commit = read_commit(path)
        else:
            try:
                self.commit = read_commit(path)
            except CheckpointError:
                self.commit = None

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        old = os.fspath(self.path)
        super().reset(_volume_path(checkpoint_id) if checkpoint_id else None)
        if os.fspath(self.path) != old:
            self._check_commit()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isdir(_volume_path(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        cached = getattr(self, "_metadata", None)
        if cached is not None and cached[0] == os.fspath(self.path):
            cached[1].storage_meta.load_id = self.load_id
            return cached[1]
        path = os.fspath(self.path)
        md_path = os.path.join(path, METADATA_NAME)
        try:
            raw = xfer.read_bytes(md_path)
        except FileNotFoundError:
            if self.commit is not None:
                raise CheckpointCorruptError(f"{path}: {METADATA_NAME} is missing although the checkpoint is "
                                             "committed; re-save it or load another step") from None
            raise not_committed(path) from None
        if self.commit is not None:
            import zlib

            rec = self.commit["files"].get(METADATA_NAME)
            if rec is None:
                raise CheckpointCorruptError(f"{path}: the manifest does not list {METADATA_NAME}")
            check_record(METADATA_NAME, path, rec, len(raw), zlib.crc32(raw))
        metadata = load_metadata(raw, allow_unsafe=self.allow_unsafe_pickle)
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        if self.commit is not None and metadata.storage_meta.save_id not in (None, self.commit["save_id"]):
            raise CheckpointCorruptError(f"{path}: {METADATA_NAME} belongs to another save than the commit "
                                         "marker; re-save this checkpoint")
        metadata.storage_meta.load_id = self.load_id
        self._metadata = (path, metadata)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        path = os.fspath(self.path)
        names: list[str] = []
        seen: set[str] = set()
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            if name not in seen:
                seen.add(name)
                names.append(name)
        expected = self.commit["files"] if self.commit else {}
        if self.commit is not None:
            missing = [n for n in names if n not in expected]
            if missing:
                raise CheckpointCorruptError(f"{path}: files {missing} are not in the manifest; re-save it")
        safe_planner: Any = planner if self.allow_unsafe_pickle else _WeightsOnlyPlanner(planner, path)
        if not names:
            return super().read_data(plan, safe_planner)
        threads = min(self.download_threads, len(names))
        staging = xfer.make_staging_dir(self.staging_dir, f"load-{self.load_id}")
        session = _DownloadSession(staging, threads, self.memory_budget)
        try:
            in_memory = {n for n in names if n in expected and expected[n].size <= self.memory_budget // threads}
            need = sum(expected[n].size for n in names if n in expected and n not in in_memory)
            if need:
                xfer.check_free_space(staging, need, self.min_free)
            ticket = 0
            for name in names:  # same order torch reads them in, so the first file arrives first
                if name in in_memory:
                    fut = session.pool.submit(self._fetch, session, ticket, name, expected[name])
                    ticket += 1
                else:
                    fut = session.pool.submit(self._download, name, os.path.join(staging, name), expected.get(name))
                session.downloads[name] = fut
            self.fs.session = session
            return super().read_data(plan, safe_planner)
        finally:
            self.fs.session = None
            session.close()

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
