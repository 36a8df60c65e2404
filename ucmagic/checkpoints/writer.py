"""The DCP storage writer for volumes: :class:`UCVolumeWriter`.

Each rank writes its shards to a private local staging directory at disk speed; as each file
closes it is handed to a pool of uploader threads that copy it to the volume (CRC-32 on the fly,
``fsync``, size check) and delete the staged copy. A rank's ``write_data`` returns once its files
are durable, carrying their sizes and checksums; the coordinator then writes ``.metadata`` and,
last, the commit marker (the manifest). Before anyone writes, the coordinator writes the
save-in-progress record and removes an existing marker and ``.metadata``, so an interrupted
overwrite is refused rather than mixed. Nothing is renamed on the volume. On a URL
(``s3://...``) each file is one atomic put on the store, in the same order.

Overlapping saves: shard names carry a per-save tag, so two saves into one directory never write
the same file; only the newest one begun commits (:func:`.commit.commit_save`), an older one raises
:class:`CheckpointSupersededError`. With a process group of more than one rank, saves run their
collective phase one at a time, in the order they started on each rank (:class:`_Turns`): torch
cannot run two saves' collectives at once on one group.
"""
from __future__ import annotations

import contextlib
import io
import os
import pickle
import queue
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _torch_compat as compat
from . import transfer as xfer
from .commit import begin_save, commit_save, mark_save_failed, superseded, superseded_error, volume_dir
from .exit import NEVER_STARTED_S, PendingSave, track_pending_save
from .urlfs import CheckpointFileSystem
from .format import (
    COMMIT_NAME,
    FORMAT_DCP,
    METADATA_NAME,
    FileRecord,
    make_commit,
    split_buckets,
    stale_files,
)
from .._util import is_remote_url, is_url
from ..dist import dist_info
from ..files.locks import Holding
from ..errors import CheckpointError, CheckpointExistsError, CheckpointSupersededError
from ..units import parse_size

DCP_VERSION = "1.0.0"
_MANIFEST_FQN = "__ucmagic_files__"
FILE_TARGET_BYTES = 16 << 20
MAX_AUTO_FILES = 32


def auto_file_count(nbytes: int) -> int:
    """Shard files for ``nbytes`` of tensors: one per ~16 MB (uploads run in parallel), 1 to 32."""
    return max(1, min(MAX_AUTO_FILES, -(-nbytes // FILE_TARGET_BYTES)))


class _Turn:
    """One save's place in :class:`_Turns`: over once its thread (torch's save thread) has ended, or it
    was marked done (failed before its thread started, handed to another process)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.thread: threading.Thread | None = None
        self.since = time.monotonic()

    def over(self) -> bool:
        if self.done.is_set():
            return True
        if self.thread is None:
            return time.monotonic() - self.since > NEVER_STARTED_S  # its save thread never started
        return not self.thread.is_alive()


class _Turns:
    """Saves that use collectives take turns, in the order they started on this rank: each waits, in its
    save thread (not the training loop), until the save before it has finished its collective phase.

    Every rank starts its saves in the same order (SPMD), so every rank runs them in that order, and
    two saves never have collectives in flight at once (two in flight on one group hang in torch).
    """

    def __init__(self) -> None:
        self._mu = threading.Lock()
        self._last: _Turn | None = None

    def take(self) -> tuple[_Turn | None, _Turn]:
        """A new turn, after the previous one; a synchronous save of this thread before it is over."""
        mine = _Turn()
        with self._mu:
            prev, self._last = self._last, mine
        if prev is not None and prev.thread is threading.current_thread():
            prev.done.set()  # that save ran in this very thread, which has moved on: it returned
        return prev, mine

    @staticmethod
    def wait(prev: _Turn | None, mine: _Turn) -> None:
        mine.thread = threading.current_thread()
        while prev is not None and not prev.over():
            prev.done.wait(0.05)


_turns = _Turns()


def _uses_collectives() -> bool:
    """True when saves coordinate ranks through collectives (a process group of more than one rank)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class _UploadSession:
    """Per-save state: staging dir, uploader pool, one future per staged file, the errors of torch's
    writer threads (they would otherwise only be printed), and the files written on the volume."""

    def __init__(self, staging: str, threads: int, verify: str, cancel: threading.Event,
                 overtaken: Any = None) -> None:
        self.staging = staging
        self.overtaken = overtaken  # () -> True once a newer save into the directory began: stop uploading
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucmagic-upload")
        self.verify = verify
        self.cancel = cancel
        self.uploads: dict[str, CFuture[Any]] = {}
        self.direct: set[str] = set()  # written straight to the volume (a replaced writer.fs)
        self.remotes: list[str] = []
        self.errors: list[BaseException] = []
        self.mu = threading.Lock()
        self.closed = False

    def check(self) -> None:
        if self.cancel.is_set():
            raise CheckpointError("the checkpoint save was cancelled (Ctrl-C or a failure elsewhere in it)")

    def check_upload(self) -> None:
        """Before each 8 MB uploaded: also stop once a newer save into the directory began (it never commits).
        Not in torch's writer threads, which would print the error: local staging costs the volume nothing."""
        self.check()
        if self.overtaken is not None and self.overtaken():
            raise CheckpointSupersededError("a newer save into the same directory began")

    def failed(self, exc: BaseException) -> None:
        with self.mu:
            self.errors.append(exc)

    def staged(self, name: str, local: str, remote: str) -> None:
        with self.mu:
            if self.closed or self.cancel.is_set():
                xfer.remove_quietly(local)
                return
            self.remotes.append(remote)
            self.uploads[name] = self.pool.submit(xfer.upload_file, local, remote, verify=self.verify,
                                                  check=self.check_upload)

    def wrote(self, name: str, remote: str) -> None:
        with self.mu:
            self.remotes.append(remote)
            self.direct.add(name)

    def close(self) -> None:
        with self.mu:
            self.closed = True
        self.pool.shutdown(wait=True, cancel_futures=True)
        xfer.release_staging_dir(self.staging)

    def abort(self) -> None:
        """Stop everything (uploads stop at their next 8 MB) and remove what reached the volume."""
        self.cancel.set()
        for f in list(self.uploads.values()):
            f.cancel()
        self.close()
        for remote in self.remotes:
            with contextlib.suppress(OSError):
                xfer.remove_quietly(remote)


class _StagingFileSystem(CheckpointFileSystem):
    """torch's FileSystem on the volume, except that data files are written to local staging and uploaded."""

    def __init__(self) -> None:
        super().__init__()
        self.session: _UploadSession | None = None

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        session = self.session
        if session is None or "w" not in mode:
            with super().create_stream(path, mode) as s:
                yield s
            return
        name = os.path.basename(os.fspath(path))
        local = os.path.join(session.staging, name)
        try:
            session.check()
            with open(local, mode, opener=xfer.new_file_opener) as stream:  # new, by the staging's descriptor
                yield stream  # type: ignore[misc]
        except BaseException as e:
            session.failed(e)
            raise
        session.staged(name, local, os.fspath(path))


class _RecordingFileSystem:
    """A FileSystem that replaced ``writer.fs`` (torch's tests do that), with its errors and files noted."""

    def __init__(self, inner: Any, session: _UploadSession) -> None:
        self.inner = inner
        self.session = session

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        if isinstance(path, str) and not is_url(path):
            path = Path(path)  # torch 2.4's FileSystem calls ``path.open()``: it takes Paths only
        try:
            self.session.check()
            with self.inner.create_stream(path, mode) as stream:
                yield stream
        except BaseException as e:
            self.session.failed(e)
            raise
        if "w" in mode:
            self.session.wrote(os.path.basename(os.fspath(path)), os.fspath(path))


class UCVolumeWriter(FileSystemWriter):
    """``torch.distributed.checkpoint`` StorageWriter that stages shards locally and uploads them in parallel.

    Use with ``dcp.save`` / ``dcp.async_save``, with or without a process group. ``async_save``
    returns once the state is copied to memory; its future completes when every file is durable on
    the volume and the checkpoint is committed, and raises upload errors.

    Never stale, never mixed: before ``async_save`` returns (or a sync save writes a byte), a
    save-in-progress record is written into the directory and the previous checkpoint's commit
    marker and ``.metadata`` are withdrawn, so readers fail loudly (or wait) until the new commit.
    Saves still running when the interpreter exits are completed first; one that cannot complete is
    reported on stderr and the process exits with status 1.

    Never through a planted link: a local ``path`` that is a symbolic link is used only when it is the
    user's own (never another user's), and every file in it is opened ``O_NOFOLLOW``; a link at a
    file's name fails the save with :class:`~ucmagic.errors.UnsafeDirectoryError` naming it
    (``save_checkpoint`` also refuses a ``step_<N>`` folder that is a link, whoever made it).

    Args:
        path: checkpoint directory (local, a mount, ``/Volumes/...``) or an fsspec URL (``s3://bucket/run/step_5``).
        storage_options: fsspec options for a URL path (credentials, ``client_kwargs``...); default: the
            store's own configuration (environment, fsspec config).
        staging_dir: local directory for staged shards (default ``$UCMAGIC_STAGING_DIR`` or the temp dir).
        upload_threads: parallel uploads per rank.
        files_per_rank: shard files per rank (more files = more parallel uploads); default: one per
            ~16 MB of state, at most 32.
        thread_count: local writer threads (default: up to 4).
        verify: ``"size"`` (fsync + size check, CRC of the bytes sent) or ``"full"`` (also read back).
        min_free: local free space to keep beyond the staged bytes.
        overwrite: replace a checkpoint already in ``path`` (default True, as torch). With False,
            ``dcp.save`` raises torch's ``CheckpointException`` ("Checkpoint already exists").
        commit_info: JSON-able dict stored in the commit marker (``save_checkpoint`` stores step and extra).
        warn_overwrite: warn, as torch's writer does, when the save replaces a checkpoint ("Detected an
            existing checkpoint in ..., overwriting"); ``save_checkpoint`` passes False.
        **kwargs: passed to ``FileSystemWriter`` (``cache_staged_state_dict``, ...).
    """

    fs: _StagingFileSystem  # installed by compat.install_filesystem in __init__

    def __init__(self, path: str | os.PathLike[str], *, staging_dir: str | None = None, upload_threads: int = 16,
                 files_per_rank: int | None = None, thread_count: int | None = None, verify: str = "size",
                 min_free: int | str = "512MB", overwrite: bool = True, commit_info: dict[str, Any] | None = None,
                 warn_overwrite: bool = True, storage_options: dict[str, Any] | None = None,
                 allow_shared_dest: bool = False, **kwargs: Any) -> None:
        kwargs.setdefault("sync_files", False)  # durability comes from fsync on the volume copy
        if thread_count is None:
            thread_count = min(4, os.cpu_count() or 1)
        where = volume_dir(path)
        self.storage_options = storage_options
        if is_remote_url(where):
            xfer.use_storage_options(where, storage_options)
        super().__init__(where, thread_count=max(1, thread_count), **kwargs)
        xfer.check_destination(os.fspath(self.path))
        if verify not in ("size", "full"):
            raise ValueError(f"verify must be 'size' or 'full', got {verify!r}")
        compat.install_filesystem(self, _StagingFileSystem())
        if is_remote_url(where):
            self.path = self.fs.init_path(where)  # torch's FileSystem made it a Path ("s3:/..."); a URL stays one
        self.overwrite = bool(overwrite)
        self.warn_overwrite = bool(warn_overwrite)
        self.staging_dir = staging_dir
        self.upload_threads = max(1, int(upload_threads))
        self.files_per_rank = None if files_per_rank is None else max(1, int(files_per_rank))
        self.verify = verify
        self.min_free = parse_size(min_free) or 0
        self.commit_info = dict(commit_info or {})
        self.allow_shared_dest = bool(allow_shared_dest)
        # from its first write to its end, this rank's files in the (local) directory are made through its
        # descriptor, opened once and checked (files.locks.hold_dir): the directory swapped for a link meanwhile
        # cannot redirect them; another user's, or one others may write to, is refused unless allow_shared_dest
        self._holding = Holding()
        self._begun: str | None = None  # the directory this save's record was written into
        self._coordinator = True
        self._pending: PendingSave | None = None
        self._started = threading.Event()
        self._replaced: str | None = None  # the directory whose checkpoint this save withdrew
        self._turn: tuple[_Turn | None, _Turn] | None = None  # taken at stage(), waited for in set_up

    # -- pickling (torch's process-based async checkpointer ships the writer to another process)
    def __getstate__(self) -> dict[str, Any]:
        if self._pending is not None and not self._pending.fut.done():
            self._pending.fut.cancel()  # the other process owns the save now; this one cannot wait for it
        if self._turn is not None:
            self._turn[1].done.set()  # the save runs in the other process, on its own process group
            self._turn = None
        state = dict(self.__dict__)
        state["_pending"] = None
        state["_started"] = None
        state["_turn"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._started = threading.Event()
        if is_remote_url(self.path):
            xfer.use_storage_options(os.fspath(self.path), self.__dict__.get("storage_options"))

    # -- the save-in-progress record
    def _checkpoint_present(self) -> bool:
        return any(xfer.exists(os.path.join(self.path, n)) for n in (COMMIT_NAME, METADATA_NAME))

    def _begin(self) -> None:
        """Write the save-in-progress record, then withdraw the previous checkpoint (idempotent per save)."""
        path = os.fspath(self.path)
        if self._begun == path:
            return
        if not self.overwrite and self._checkpoint_present():
            return  # refused in prepare_local_plan, the way torch's writer does it
        xfer.makedirs(path)
        self._holding.hold(path, shared_ok=self.allow_shared_dest, what="checkpoint directory")
        self.save_id = uuid.uuid4().hex  # fresh per save, also when a writer object is reused
        present = self._checkpoint_present()
        begin_save(path, self.save_id)
        self._replaced = path if present else None
        self._begun = path

    def _fail(self, exc: BaseException) -> BaseException:
        """``exc`` as the one-line ucmagic error it means (an OSError on the volume), noted as this save's failure."""
        path = os.fspath(self.path)
        if self._begun is not None and superseded(path, self.save_id):
            exc = superseded_error(path)  # whatever stopped it, this save could no longer commit
        err = xfer.destination_error(exc, path) if isinstance(exc, OSError) \
            and not isinstance(exc, CheckpointError) else exc
        self._failed(err)
        return err

    def _cancel_event(self) -> threading.Event:
        p = self._pending
        return p.cancel if p is not None and not p.fut.done() else threading.Event()

    def _failed(self, exc: BaseException) -> None:
        """Note a failure in the record (readers say the save failed) and in the pending-at-exit future."""
        if self._begun is not None:
            mark_save_failed(self._begun, self.save_id, exc)
        self._holding.release()
        p = self._pending
        if p is not None and not p.fut.done():
            p.fut.set_exception(exc)

    def stage(self, state_dict: Any) -> Any:
        """``async_save``'s first step (in the caller's thread): copy the state, then begin the save.

        A failure here is raised by ``dcp.async_save`` itself, as one ucmagic error, and completes the
        save's pending-at-exit future (so the interpreter does not wait for it).
        """
        staged = _unaliased(super().stage(state_dict), state_dict)
        if self._pending is None or self._pending.fut.done():
            self._pending = track_pending_save(os.fspath(self.path), CFuture(), writer=True)
        if _uses_collectives():
            self._turn = _turns.take()  # in call order: the training loop's thread
        if dist_info(from_env=False).rank == 0:
            try:
                self._begin()
            except BaseException as e:  # noqa: BLE001 - re-raised as the ucmagic error it means
                if self._turn is not None:
                    self._turn[1].done.set()  # dcp.async_save raises: this save never runs
                    self._turn = None
                raise self._fail(e) from None
        return staged

    def wait_started(self, timeout: float) -> bool:
        """Block until torch's save thread has called into this writer (True), or ``timeout`` passed."""
        return self._started.wait(timeout)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        save_id = self.save_id
        super().reset(volume_dir(checkpoint_id) if checkpoint_id else None)
        if checkpoint_id:
            xfer.check_destination(os.fspath(self.path))
        if self._begun is not None:
            self.save_id = save_id  # the record carries this id; the commit must carry the same

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        p = os.fspath(checkpoint_id)
        return "://" not in p or p.startswith("file://") or is_remote_url(p)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = bool(is_coordinator)
        if self._pending is not None:
            self._pending.thread = threading.current_thread()
        if self._started is not None:
            self._started.set()
        turn, self._turn = self._turn, None
        if turn is None and _uses_collectives():
            turn = _turns.take()  # a synchronous save: its turn starts now, in the caller's thread
        if turn is not None:
            _turns.wait(*turn)  # before this save's first collective
        super().set_up_storage_writer(is_coordinator, *args,
                                      **compat.set_up_writer_kwargs(super().set_up_storage_writer, kwargs))
        if not kwargs.get("use_collectives", True):
            exc = CheckpointError("UCVolumeWriter needs rank coordination to commit a checkpoint; "
                                  "call dcp.save without use_collectives=False")
            self._failed(exc)
            raise exc

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            present = self._checkpoint_present()
            if not self.overwrite and present:
                raise CheckpointExistsError(
                    f"Checkpoint already exists and overwrite=False: {self.path} holds a checkpoint; save to "
                    "another directory (e.g. one per step) or pass overwrite=True to UCVolumeWriter")
            if self.warn_overwrite and (present or self._replaced == os.fspath(self.path)):
                warnings.warn(f"Detected an existing checkpoint in {self.path}, overwriting since "
                              f"{self.overwrite=}. Pass overwrite=False to UCVolumeWriter to raise instead.",
                              stacklevel=2)
            xfer.makedirs(os.fspath(self.path))
            self._holding.hold(os.fspath(self.path), shared_ok=self.allow_shared_dest, what="checkpoint directory")
        except BaseException as e:  # noqa: BLE001 - re-raised as the ucmagic error it means
            raise self._fail(e) from None
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # coordinator only, after every rank planned and before any rank writes
        try:
            self._begin()
        except BaseException as e:  # noqa: BLE001 - re-raised as the ucmagic error it means
            raise self._fail(e) from None
        return super().prepare_global_plan(plans)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            out = self._write_data_staged(plan, planner)
        except BaseException as e:  # noqa: BLE001 - re-raised as the ucmagic error it means
            raise self._fail(e) from None
        p = self._pending
        if not self._coordinator:
            self._holding.release()  # this rank's part is written; the coordinator commits
            if p is not None and not p.fut.done():
                p.fut.set_result(os.fspath(self.path))  # this rank's part is durable
        return out

    def _write_data_staged(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        buckets, need = self._buckets(list(plan.items))
        staging = xfer.make_staging_dir(self.staging_dir, f"save-{self.save_id}-{prefix.strip('_') or 'r'}")
        path = os.fspath(self.path)
        session = _UploadSession(staging, self.upload_threads, self.verify, self._cancel_event(),
                                 overtaken=lambda: self._begun is not None and superseded(path, self.save_id))
        staged = isinstance(self.fs, _StagingFileSystem)
        file_queue: queue.Queue[Any] = queue.Queue()
        try:
            if staged:
                xfer.check_free_space(staging, int(need * 1.05) + (1 << 20), self.min_free)
            tag = uuid.uuid4().hex[:12]  # per save: two saves into one directory never write the same file
            names = [f"{prefix}{n}-{tag}.distcp" for n in range(len(buckets))]
            for name, bucket in zip(names, buckets):
                file_queue.put((os.path.join(self.path, name), name, bucket))
            results = self._write_files(session, planner, file_queue, staging if staged else None)
            files = self._durable_files(session, names)
        except BaseException:
            _drain(file_queue)  # torch's other writer threads find nothing more to write
            session.abort()
            raise
        session.close()
        results.append(WriteResult(index=MetadataIndex(f"{_MANIFEST_FQN}{prefix}"), size_in_bytes=0,
                                   storage_data={"files": files}))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _buckets(self, items: list[Any]) -> tuple[list[list[Any]], int]:
        """The write items grouped into shard files, and the bytes of their tensors."""
        need = sum(_item_size(i) for i in items)
        if not self.single_file_per_rank:
            return [[i] for i in items], need
        n_files = self.files_per_rank or auto_file_count(need)
        return split_buckets(n_files, items, _item_size, is_bytes=lambda i: i.type == WriteItemType.BYTE_IO), need

    def _write_files(self, session: _UploadSession, planner: SavePlanner, file_queue: queue.Queue[Any],
                     staging: str | None) -> list[WriteResult]:
        """torch's writer threads write ``file_queue`` through ``session`` (staged locally unless ``staging``
        is None: a replaced ``writer.fs``); the first error of any of them is raised as one line."""
        own_fs = self.fs
        if staging is not None:
            own_fs.session = session
        else:  # a test replaced writer.fs: write through it, as torch's writer would, noting its errors
            self.fs = _RecordingFileSystem(own_fs, session)  # type: ignore[assignment]
        try:
            results = list(compat.write_files(self, planner, file_queue).value())
        except BaseException as e:  # noqa: BLE001 - re-raised as the one-line error it means
            raise _staging_error(session.errors[0] if session.errors else e, staging) from None
        finally:
            if staging is not None:
                own_fs.session = None
            else:
                self.fs = own_fs
        if session.errors:
            raise _staging_error(session.errors[0], staging)
        return results

    def _durable_files(self, session: _UploadSession, names: list[str]) -> dict[str, tuple[Any, ...]]:
        """(size, CRC) of each shard once it is durable on the volume (waits for its upload)."""
        missing = [n for n in names if n not in session.uploads and n not in session.direct]
        if missing:
            raise CheckpointError(f"torch's writer threads stopped without writing checkpoint shards {missing} "
                                  "and without an error; save again")
        return {name: tuple(xfer.file_crc(os.path.join(self.path, name))) if name in session.direct
                else tuple(session.uploads[name].result()) for name in names}

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._commit(metadata, results)
        except BaseException as e:  # noqa: BLE001 - re-raised as the ucmagic error it means
            if self._begun is not None:  # not committed: every rank's shards are garbage now
                self._remove_uncommitted(results, markers=not isinstance(e, CheckpointSupersededError))
            raise self._fail(e) from None
        self._holding.release()
        p = self._pending
        if p is not None and not p.fut.done():
            p.fut.set_result(os.fspath(self.path))

    def _remove_uncommitted(self, results: list[list[WriteResult]], *, markers: bool = True) -> None:
        """Remove every rank's shards of this save and (``markers``, unless a newer save began) its
        ``.metadata`` and any marker (a failed commit)."""
        names = [name for manifest in _manifests(results) for name in manifest]
        if markers and not superseded(os.fspath(self.path), self.save_id):
            names += [COMMIT_NAME, METADATA_NAME]
        for name in names:
            with contextlib.suppress(OSError):
                xfer.remove_quietly(os.path.join(self.path, name))

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        files: dict[str, FileRecord] = {}
        storage_md = {}
        for wr_list in results:
            for wr in wr_list:
                if _is_manifest(wr):
                    files.update({k: FileRecord(*v) for k, v in wr.storage_data["files"].items()})
                else:
                    storage_md[wr.index] = wr.storage_data
        metadata.version = DCP_VERSION
        metadata.storage_data = storage_md
        metadata.storage_meta = self.storage_meta()
        path = os.fspath(self.path)
        raw = pickle.dumps(metadata)
        marker: list[bytes] = []

        def before() -> None:  # under the directory's commit lock, once this save is known to be current
            files[METADATA_NAME] = xfer.write_bytes(os.path.join(path, METADATA_NAME), raw)
            marker.append(make_commit(kind=FORMAT_DCP, save_id=self.save_id, files=files, info=self.commit_info))
            self._cancel_event_check()

        def after() -> None:  # committed: shards of older saves of this directory go
            self._begun = None  # a failure from here on must not remove this save's files
            for name in stale_files(xfer.list_names(path), files):
                xfer.remove_quietly(os.path.join(path, name))

        commit_save(path, self.save_id, lambda: marker[0], before=before, after=after)

    def _cancel_event_check(self) -> None:
        p = self._pending
        if p is not None and p.cancel.is_set():
            raise CheckpointError("the checkpoint save was cancelled (Ctrl-C) before its commit")


def _is_manifest(wr: WriteResult) -> bool:
    """A rank's list of its shard files (size, CRC), carried as a write result of its own."""
    return isinstance(wr.index, MetadataIndex) and wr.index.fqn.startswith(_MANIFEST_FQN)


def _manifests(results: list[list[WriteResult]]) -> list[dict[str, Any]]:
    """Each rank's ``{file name: (size, CRC)}`` from the write results the coordinator gathered."""
    return [wr.storage_data["files"] for wr_list in results for wr in wr_list if _is_manifest(wr)]


def _drain(file_queue: queue.Queue[Any]) -> None:
    with contextlib.suppress(queue.Empty):
        while True:
            file_queue.get_nowait()


def _staging_error(exc: BaseException, staging: str | None) -> BaseException:
    """The error of a shard write: one line for an OS error in local staging, else the error itself."""
    if staging is not None and isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
        return CheckpointError(f"cannot write checkpoint shards to local staging {staging}: {exc.strerror or exc}; "
                               "pass staging_dir= (or set UCMAGIC_STAGING_DIR) to a local disk with space")
    return exc


def _unaliased(staged: Any, original: Any) -> Any:
    """``staged`` with every plain tensor that still shares memory with ``original`` cloned.

    Older torch (2.4) "stages" CPU tensors without copying them, so training that goes on while the
    save runs would change what gets saved.
    """
    if isinstance(staged, dict) and isinstance(original, dict):
        return {k: _unaliased(v, original.get(k)) for k, v in staged.items()}
    if isinstance(staged, (list, tuple)) and isinstance(original, (list, tuple)) and len(staged) == len(original):
        return type(staged)(_unaliased(a, b) for a, b in zip(staged, original))
    if type(staged) is torch.Tensor and type(original) is torch.Tensor and staged.device.type == "cpu" \
            and staged.untyped_storage().data_ptr() == original.untyped_storage().data_ptr() and staged.numel():
        return staged.clone()
    return staged


def _item_size(item: Any) -> int:
    """Bytes of one DCP write item: a tensor's storage size, 0 for a pickled blob (size unknown before)."""
    td = getattr(item, "tensor_data", None)
    if td is None or item.type == WriteItemType.BYTE_IO:
        return 0
    n = 1
    for d in td.size:
        n *= int(d)
    return n * torch.empty((), dtype=td.properties.dtype).element_size()
