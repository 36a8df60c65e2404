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
local staging for large shards), verifying size and CRC, and feeds them to torch as they arrive.
Non-tensor entries are checked with ``torch.load(weights_only=True)``.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import pickle
import queue
import socket
import sys
import threading
import time
import uuid
import warnings
from collections.abc import Iterator
from concurrent.futures import Future as CFuture
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import (
    FileSystem,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from .. import _torch_compat as compat
from . import transfer as xfer
from .format import (
    COMMIT_NAME,
    FORMAT_DCP,
    METADATA_NAME,
    SAVING_NAME,
    FileRecord,
    check_record,
    in_progress_message,
    is_committed_by,
    make_commit,
    make_saving_record,
    missing_or_short,
    not_committed,
    parse_commit,
    parse_saving_record,
    split_buckets,
    stale_files,
)
from .._util import error_line
from ..dist import dist_info
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointInProgressError,
    CheckpointOverwrittenError,
    UnsafeCheckpointError,
)
from ..units import parse_size
from ..volume import resolve_local_path

log = logging.getLogger("ucmagic")

DCP_VERSION = "1.0.0"
_MANIFEST_FQN = "__ucmagic_files__"
FILE_TARGET_BYTES = 16 << 20
MAX_AUTO_FILES = 32


def auto_file_count(nbytes: int) -> int:
    """Shard files for ``nbytes`` of tensors: one per ~16 MB (uploads run in parallel), 1 to 32."""
    return max(1, min(MAX_AUTO_FILES, -(-nbytes // FILE_TARGET_BYTES)))


def volume_dir(path: str | os.PathLike) -> str:
    """The local directory of a checkpoint path (``/Volumes/...`` resolved); refuses URLs."""
    p = os.fspath(path)
    p = p.removeprefix("file://")
    if "://" in p:
        raise CheckpointError(f"{p}: checkpoints go to a directory (a local disk or a mounted volume such as "
                              "/Volumes/...), not a URL; mount the storage or use its /Volumes path")
    return resolve_local_path(p)


def read_saving_record(path: str) -> dict[str, Any] | None:
    """The save-in-progress record of checkpoint directory ``path``, or None when there is none."""
    try:
        return parse_saving_record(xfer.read_bytes(os.path.join(path, SAVING_NAME)))
    except FileNotFoundError:
        return None


def read_commit(path: str) -> dict[str, Any]:
    """The parsed commit marker of checkpoint directory ``path``; raises when it is not committed.

    A save in progress (or killed) raises :class:`CheckpointInProgressError`, whatever marker is there.

    The marker is read before the record: a save writes its record before it withdraws the old
    marker, and writes its marker before it removes its record, so a save that begins or ends
    between the two reads is still seen (read the other way round, a save beginning in between
    looked like a directory that was never committed).
    """
    commit_path = os.path.join(path, COMMIT_NAME)
    while True:
        try:
            data = xfer.read_bytes(commit_path)
        except FileNotFoundError:
            record = read_saving_record(path)
            if record is not None:
                raise CheckpointInProgressError(in_progress_message(path, record)) from None
            if os.path.exists(commit_path):
                continue  # a save committed between the two reads: read its marker
            raise not_committed(path) from None
        commit = parse_commit(data, path)
        record = read_saving_record(path)
        if record is not None and not is_committed_by(commit.get("save_id"), record):
            raise CheckpointInProgressError(in_progress_message(path, record))
        return commit


# ---------------------------------------------------------------- saves pending at interpreter exit

class _Pending:
    """One asynchronous save: what it writes, its completion future, the thread that runs it.

    ``cancel`` stops its uploads at their next 8 MB (set when Ctrl-C abandons the save at exit).
    """

    def __init__(self, what: str, fut: CFuture) -> None:
        self.what = what
        self.fut = fut
        self.thread: threading.Thread | None = None
        self.cancel = threading.Event()
        self.since = time.monotonic()
        self.watch_thread = False
        self.pid = os.getpid()  # a forked child (a DataLoader worker) does not own its parent's saves


_pending: list[_Pending] = []
_pending_mu = threading.Lock()
_exit_hook_installed = False


def track_pending_save(what: str, fut: CFuture, *, writer: bool = False) -> _Pending:
    """Make interpreter exit wait for ``fut`` (an asynchronous save of ``what``) and report if it fails.

    The wait runs among ``threading``'s exit hooks, before ``concurrent.futures`` stops accepting
    work, so the save can still use thread pools; one line on stderr says what is waited for.
    ``writer=True``: ``fut`` is a writer's own, completed from torch's save thread (which the writer
    records), so a thread that ends, or never starts, without completing it means the save is lost;
    otherwise ``fut`` follows another future that always completes.
    """
    global _exit_hook_installed
    entry = _Pending(what, fut)
    entry.watch_thread = writer
    with _pending_mu:
        _pending.append(entry)
        if not _exit_hook_installed:
            _exit_hook_installed = _register_early_exit_hook(_finish_pending_saves)
    fut.add_done_callback(lambda _f: _untrack(entry))
    return entry


def _untrack(entry: _Pending) -> None:
    with _pending_mu:
        if entry in _pending:
            _pending.remove(entry)


def _register_early_exit_hook(fn: Any) -> bool:
    """Run ``fn`` at exit before non-daemon threads are joined and before concurrent.futures shuts down.

    ``threading._register_atexit`` (Python >= 3.9) is the only hook that runs that early; without it,
    ``atexit`` still reports lost saves (the thread pools may then refuse the uploads).
    """
    import atexit

    early = getattr(threading, "_register_atexit", None)
    if early is not None:
        try:
            early(fn)
            return True
        except RuntimeError:  # the interpreter is already shutting down
            pass
    atexit.register(fn)
    return True


NEVER_STARTED_S = 30.0  # an async save whose thread never called the writer this long after staging is lost


def _stopped(p: _Pending) -> str | None:
    """Why pending save ``p`` can no longer complete its future, or None while it still may."""
    if not p.watch_thread:
        return None
    if p.thread is not None:
        return None if p.thread.is_alive() else "the save stopped before committing (another rank or torch failed)"
    if time.monotonic() - p.since > NEVER_STARTED_S:
        return "the save never started after its state was copied"
    return None


def _finished_before_exit(p: _Pending) -> bool:
    """The save's thread ended before the exit began without completing ``p`` (torch or another rank
    failed it): its error went to torch's future, which the caller could wait for; it was not pending."""
    return p.watch_thread and p.thread is not None and not p.thread.is_alive()


def _finish_pending_saves() -> None:
    with _pending_mu:
        waiting = [p for p in _pending if not p.fut.done() and p.pid == os.getpid() and not _finished_before_exit(p)]
    if not waiting:
        return
    paths = sorted({p.what for p in waiting})
    print(f"ucmagic: waiting for {len(paths)} checkpoint save(s) to finish before exit (Ctrl-C abandons "
          f"them): {', '.join(paths)}", file=sys.stderr, flush=True)
    lost: list[tuple[_Pending, Any]] = []
    try:
        for p in waiting:
            why = None
            while not p.fut.done() and why is None:
                futures_wait([p.fut], timeout=0.2)
                why = None if p.fut.done() else _stopped(p)
            if p.fut.cancelled():
                continue
            err = p.fut.exception() if p.fut.done() else RuntimeError(why)
            if err is not None:
                lost.append((p, err))
    except KeyboardInterrupt:
        _abandon(waiting)
        return
    if lost:
        lost = list({p.what: (p, err) for p, err in lost}.values())
        for p, err in lost:
            print(f"ucmagic: checkpoint NOT saved: {p.what}: {error_line(err)}", file=sys.stderr)
        print("ucmagic: exiting with status 1 because a checkpoint save was lost", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


def _abandon(waiting: list[_Pending]) -> None:
    """Ctrl-C while waiting at exit: stop the saves' uploads, let them mark their directories failed, exit 130."""
    for p in waiting:
        p.cancel.set()
    deadline = time.monotonic() + 10
    with contextlib.suppress(KeyboardInterrupt):
        for p in waiting:
            while not p.fut.done() and _stopped(p) is None and time.monotonic() < deadline:
                futures_wait([p.fut], timeout=0.1)
    for p in waiting:
        if not (p.fut.done() and not p.fut.cancelled() and p.fut.exception() is None):
            print(f"ucmagic: checkpoint NOT saved: {p.what}: interrupted (Ctrl-C); the directory is not "
                  "loadable until a new save into it commits", file=sys.stderr)
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(130)


# ---------------------------------------------------------------- restricted unpickling of .metadata

_ALLOWED_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` but refuses any global that is not a DCP metadata type."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _ALLOWED_GLOBALS or (module, name) in compat.DCP_METADATA_GLOBALS \
                    or module == "torch.distributed.checkpoint.metadata":
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
        return pickle.loads(data)  # noqa: S301 - the caller trusts this checkpoint (allow_unsafe_pickle=True)
    return _MetadataUnpickler(io.BytesIO(data)).load()


# ---------------------------------------------------------------- writer

class _UploadSession:
    """Per-save state: staging dir, uploader pool, one future per staged file, the errors of torch's
    writer threads (they would otherwise only be printed), and the files written on the volume."""

    def __init__(self, staging: str, threads: int, verify: str, cancel: threading.Event) -> None:
        self.staging = staging
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ucmagic-upload")
        self.verify = verify
        self.cancel = cancel
        self.uploads: dict[str, CFuture] = {}
        self.direct: set[str] = set()  # written straight to the volume (a replaced writer.fs)
        self.remotes: list[str] = []
        self.errors: list[BaseException] = []
        self.mu = threading.Lock()
        self.closed = False

    def check(self) -> None:
        if self.cancel.is_set():
            raise CheckpointError("the checkpoint save was cancelled (Ctrl-C or a failure elsewhere in it)")

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
                                                  check=self.check)

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
        try:
            session.check()
            with open(local, mode) as stream:
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
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
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

    Args:
        path: checkpoint directory (local, a mount, or ``/Volumes/...``).
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

    def __init__(self, path: str | os.PathLike, *, staging_dir: str | None = None, upload_threads: int = 16,
                 files_per_rank: int | None = None, thread_count: int | None = None, verify: str = "size",
                 min_free: int | str = "512MB", overwrite: bool = True, commit_info: dict[str, Any] | None = None,
                 warn_overwrite: bool = True, **kwargs: Any) -> None:
        kwargs.setdefault("sync_files", False)  # durability comes from fsync on the volume copy
        if thread_count is None:
            thread_count = min(4, os.cpu_count() or 1)
        super().__init__(volume_dir(path), thread_count=max(1, thread_count), **kwargs)
        xfer.check_destination(os.fspath(self.path))
        if verify not in ("size", "full"):
            raise ValueError(f"verify must be 'size' or 'full', got {verify!r}")
        compat.install_filesystem(self, _StagingFileSystem())
        if not getattr(self, "save_id", None):  # torch < 2.4 has no save id
            self.save_id = uuid.uuid4().hex
        self.overwrite = bool(overwrite)
        self.warn_overwrite = bool(warn_overwrite)
        self.staging_dir = staging_dir
        self.upload_threads = max(1, int(upload_threads))
        self.files_per_rank = None if files_per_rank is None else max(1, int(files_per_rank))
        self.verify = verify
        self.min_free = parse_size(min_free) or 0
        self.commit_info = dict(commit_info or {})
        self._begun: str | None = None  # the directory this save's record was written into
        self._coordinator = True
        self._pending: _Pending | None = None
        self._started = threading.Event()
        self._replaced: str | None = None  # the directory whose checkpoint this save withdrew

    # -- pickling (torch's process-based async checkpointer ships the writer to another process)
    def __getstate__(self) -> dict[str, Any]:
        if self._pending is not None and not self._pending.fut.done():
            self._pending.fut.cancel()  # the other process owns the save now; this one cannot wait for it
        state = dict(self.__dict__)
        state["_pending"] = None
        state["_started"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._started = threading.Event()

    # -- the save-in-progress record
    def _checkpoint_present(self) -> bool:
        return any(os.path.exists(os.path.join(self.path, n)) for n in (COMMIT_NAME, METADATA_NAME))

    def _begin(self) -> None:
        """Write the save-in-progress record, then withdraw the previous checkpoint (idempotent per save)."""
        path = os.fspath(self.path)
        if self._begun == path:
            return
        if not self.overwrite and self._checkpoint_present():
            return  # refused in prepare_local_plan, the way torch's writer does it
        os.makedirs(path, exist_ok=True)
        self.save_id = uuid.uuid4().hex  # fresh per save, also when a writer object is reused
        record = make_saving_record(save_id=self.save_id, host=socket.gethostname(), pid=os.getpid())
        present = self._checkpoint_present()
        xfer.write_bytes(os.path.join(path, SAVING_NAME), record)
        xfer.remove_quietly(os.path.join(path, COMMIT_NAME))
        xfer.remove_quietly(os.path.join(path, METADATA_NAME))
        self._replaced = path if present else None
        self._begun = path

    def _fail(self, exc: BaseException) -> BaseException:
        """``exc`` as the one-line ucmagic error it means (an OSError on the volume), noted as this save's failure."""
        err = xfer.destination_error(exc, os.fspath(self.path)) if isinstance(exc, OSError) \
            and not isinstance(exc, CheckpointError) else exc
        self._failed(err)
        return err

    def _cancel_event(self) -> threading.Event:
        p = self._pending
        return p.cancel if p is not None and not p.fut.done() else threading.Event()

    def _failed(self, exc: BaseException) -> None:
        """Note a failure in the record (readers say the save failed) and in the pending-at-exit future."""
        if self._begun is not None:
            with contextlib.suppress(Exception):
                rec = parse_saving_record(xfer.read_bytes(os.path.join(self._begun, SAVING_NAME)))
                if rec.get("save_id") == self.save_id:
                    first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
                    first = first if len(first) <= 400 else "..." + first[-400:]  # the cause is at the end
                    rec["failed"] = first
                    xfer.write_bytes(os.path.join(self._begun, SAVING_NAME), json.dumps(rec).encode())
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
        if dist_info(from_env=False).rank == 0:
            try:
                self._begin()
            except BaseException as e:  # noqa: BLE001 - re-raised as the ucmagic error it means
                raise self._fail(e) from None
        return staged

    def wait_started(self, timeout: float) -> bool:
        """Block until torch's save thread has called into this writer (True), or ``timeout`` passed."""
        return self._started.wait(timeout)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        save_id = self.save_id
        super().reset(volume_dir(checkpoint_id) if checkpoint_id else None)
        if checkpoint_id:
            xfer.check_destination(os.fspath(self.path))
        if self._begun is not None:
            self.save_id = save_id  # the record carries this id; the commit must carry the same

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" not in os.fspath(checkpoint_id) or os.fspath(checkpoint_id).startswith("file://")

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = bool(is_coordinator)
        if self._pending is not None:
            self._pending.thread = threading.current_thread()
        if self._started is not None:
            self._started.set()
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
            os.makedirs(self.path, exist_ok=True)
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
        if not self._coordinator and p is not None and not p.fut.done():
            p.fut.set_result(os.fspath(self.path))  # this rank's part is durable; the coordinator commits
        return out

    def _write_data_staged(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix = plan.storage_data.prefix
        items = list(plan.items)
        need = sum(_item_size(i) for i in items)
        if self.single_file_per_rank:
            n_files = self.files_per_rank or auto_file_count(need)
            buckets = split_buckets(n_files, items, _item_size, is_bytes=lambda i: i.type == WriteItemType.BYTE_IO)
        else:
            buckets = [[i] for i in items]
        staging = xfer.make_staging_dir(self.staging_dir, f"save-{self.save_id}-{prefix.strip('_') or 'r'}")
        session = _UploadSession(staging, self.upload_threads, self.verify, self._cancel_event())
        own_fs = self.fs
        staged = isinstance(own_fs, _StagingFileSystem)
        file_queue: queue.Queue = queue.Queue()
        try:
            if staged:
                xfer.check_free_space(staging, int(need * 1.05) + (1 << 20), self.min_free)
            names = []
            for n, bucket in enumerate(buckets):
                name = f"{prefix}{n}.distcp"
                names.append(name)
                file_queue.put((os.path.join(self.path, name), name, bucket))
            if staged:
                own_fs.session = session
            else:  # a test replaced writer.fs: write through it, as torch's writer would, noting its errors
                self.fs = _RecordingFileSystem(own_fs, session)  # type: ignore[assignment]
            try:
                results = list(compat.write_files(self, planner, file_queue).value())
            except BaseException as e:  # noqa: BLE001 - re-raised as the one-line error it means
                raise _staging_error(session.errors[0] if session.errors else e, staging if staged else None) \
                    from None
            finally:
                if staged:
                    own_fs.session = None
                else:
                    self.fs = own_fs
            if session.errors:
                raise _staging_error(session.errors[0], staging if staged else None)
            missing = [n for n in names if n not in session.uploads and n not in session.direct]
            if missing:
                raise CheckpointError(f"torch's writer threads stopped without writing checkpoint shards {missing} "
                                      "and without an error; save again")
            files = {}
            for name in names:
                if name in session.direct:
                    files[name] = tuple(xfer.file_crc(os.path.join(self.path, name)))
                else:
                    files[name] = tuple(session.uploads[name].result())
        except BaseException:
            with contextlib.suppress(queue.Empty):
                while True:  # torch's other writer threads find nothing more to write
                    file_queue.get_nowait()
            session.abort()
            raise
        session.close()
        results.append(WriteResult(index=MetadataIndex(f"{_MANIFEST_FQN}{prefix}"), size_in_bytes=0,
                                   storage_data={"files": files}))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._commit(metadata, results)
        except BaseException as e:  # noqa: BLE001 - re-raised as the ucmagic error it means
            if self._begun is not None:  # not committed: every rank's shards are garbage now
                for wr_list in results:
                    for wr in wr_list:
                        if isinstance(wr.index, MetadataIndex) and wr.index.fqn.startswith(_MANIFEST_FQN):
                            for name in wr.storage_data["files"]:
                                with contextlib.suppress(OSError):
                                    xfer.remove_quietly(os.path.join(self.path, name))
                for name in (COMMIT_NAME, METADATA_NAME):
                    with contextlib.suppress(OSError):
                        xfer.remove_quietly(os.path.join(self.path, name))
            raise self._fail(e) from None
        p = self._pending
        if p is not None and not p.fut.done():
            p.fut.set_result(os.fspath(self.path))

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
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
        if hasattr(metadata, "storage_meta") and hasattr(self, "storage_meta"):
            metadata.storage_meta = self.storage_meta()
        files[METADATA_NAME] = xfer.write_bytes(os.path.join(self.path, METADATA_NAME), pickle.dumps(metadata))
        marker = make_commit(kind=FORMAT_DCP, save_id=self.save_id, files=files, info=self.commit_info)
        self._cancel_event_check()
        xfer.write_bytes(os.path.join(self.path, COMMIT_NAME), marker)
        self._begun = None  # committed from here on: a failure below must not remove its files
        with contextlib.suppress(OSError):
            for name in stale_files(os.listdir(self.path), files):  # shards of an older save of this directory
                xfer.remove_quietly(os.path.join(self.path, name))
        xfer.remove_quietly(os.path.join(self.path, SAVING_NAME))  # last: the new commit is in place

    def _cancel_event_check(self) -> None:
        p = self._pending
        if p is not None and p.cancel.is_set():
            raise CheckpointError("the checkpoint save was cancelled (Ctrl-C) before its commit")


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


# ---------------------------------------------------------------- reader

_foreign_logged: set[str] = set()


def _log_foreign_once(path: str) -> None:
    if path not in _foreign_logged:
        _foreign_logged.add(path)
        log.info("ucmagic: %s has no ucmagic commit marker (written by torch's FileSystemWriter or another tool); "
                 "its .metadata and every file it references are present, loading it without checksums", path)


def _set_load_id(metadata: Metadata, reader: Any) -> None:
    meta = getattr(metadata, "storage_meta", None)
    if meta is not None and hasattr(reader, "load_id"):
        meta.load_id = reader.load_id


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
        xfer.release_staging_dir(self.staging)


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
                yield io.BytesIO(got)  # shares the bytes, no copy
            finally:
                session.release(len(got))
            return
        try:
            with open(got, "rb") as stream:
                yield stream
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
    """``torch.distributed.checkpoint`` StorageReader for checkpoints on volumes.

    Loads a checkpoint committed by :class:`UCVolumeWriter` (verifying each file's size and CRC),
    or one written by torch's ``FileSystemWriter`` or any other DCP file-system writer (no ucmagic
    file in the directory, a readable ``.metadata``, every file it references present and long
    enough). Refuses, at construction, a save in progress, a killed or torn save, and an incomplete
    directory. Downloads only the files this rank's load plan needs, ``download_threads`` at a time.

    Args:
        path: checkpoint directory.
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

    def __init__(self, path: str | os.PathLike, *, wait: float | None = None, staging_dir: str | None = None,
                 download_threads: int = 16, memory_budget: int | str = "1GB", require_commit: bool | None = None,
                 allow_unsafe_pickle: bool = False, min_free: int | str = "512MB", **kwargs: Any) -> None:
        super().__init__(volume_dir(path), **kwargs)
        compat.install_filesystem(self, _DownloadedFileSystem())
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
        if not os.path.isdir(path):
            from ..errors import SourceNotFoundError

            raise SourceNotFoundError(f"checkpoint directory {path} does not exist; check the path")
        self._metadata: tuple[str, Metadata] | None = None
        self._foreign_stamp = None
        start = time.monotonic()
        while True:
            try:
                self.commit = read_commit(path)
                return
            except CheckpointInProgressError:
                waited = time.monotonic() - start
                if self.wait is None or waited >= self.wait:
                    record = read_saving_record(path)
                    if record is None:  # committed in the meantime
                        continue
                    raise CheckpointInProgressError(
                        in_progress_message(path, record, waited=waited if self.wait else None)) from None
                time.sleep(min(0.05 * (1 + waited), 1.0, max(0.0, self.wait - waited)))
            except CheckpointError:
                if os.path.exists(os.path.join(path, COMMIT_NAME)) or self.require_commit:
                    raise  # a torn marker, or the caller asked for ucmagic checkpoints only
                waited = time.monotonic() - start
                if self.wait and waited < self.wait and not os.path.exists(os.path.join(path, METADATA_NAME)):
                    time.sleep(min(0.05 * (1 + waited), 1.0, self.wait - waited))  # nothing there yet
                    continue
                self.commit = None
                if self.require_commit is None:
                    self._check_foreign(path)
                return

    def _check_foreign(self, path: str) -> None:
        """A directory without ucmagic files: load it when its .metadata and every file it names are there."""
        md_path = os.path.join(path, METADATA_NAME)
        try:
            st = os.stat(md_path)
            metadata = self.read_metadata()
        except FileNotFoundError:
            raise not_committed(path) from None
        except (pickle.UnpicklingError, EOFError, ValueError, AttributeError, ImportError, IndexError) as e:
            raise CheckpointCorruptError(f"{path}: {METADATA_NAME} cannot be read ({type(e).__name__}: {e}); the "
                                         "checkpoint is damaged or unfinished: save it again") from None
        needed: dict[str, int] = {}
        for index in (metadata.storage_data or {}):
            name, offset, length = compat.storage_location(metadata.storage_data, index)
            needed[name] = max(needed.get(name, 0), offset + length)
        sizes: dict[str, int | None] = {}
        for name in needed:
            try:
                sizes[name] = os.stat(os.path.join(path, name)).st_size
            except FileNotFoundError:
                sizes[name] = None
        problems = missing_or_short(needed, sizes)
        if problems:
            raise CheckpointCorruptError(f"{path} is not a complete checkpoint: {'; '.join(problems[:5])}; its save "
                                         "did not finish or files were removed: save it again or load another")
        self._foreign_stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
        _log_foreign_once(path)

    def _check_unchanged(self) -> None:
        """After a load of a foreign checkpoint: no save may have started in the directory meanwhile."""
        if self._foreign_stamp is None:
            return
        path = os.fspath(self.path)
        try:
            st = os.stat(os.path.join(path, METADATA_NAME))
            same = (st.st_ino, st.st_size, st.st_mtime_ns) == self._foreign_stamp
        except FileNotFoundError:
            same = False
        if not same or os.path.exists(os.path.join(path, SAVING_NAME)):
            raise self._overwritten_error()

    def _overwritten(self) -> bool:
        """True when a save into this directory started after this reader checked its commit."""
        path = os.fspath(self.path)
        if self.commit is None:
            try:
                st = os.stat(os.path.join(path, METADATA_NAME))
                same = (st.st_ino, st.st_size, st.st_mtime_ns) == self._foreign_stamp
            except FileNotFoundError:
                same = False
            return self._foreign_stamp is not None and (not same or os.path.exists(os.path.join(path, SAVING_NAME)))
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

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        old = os.fspath(self.path)
        super().reset(volume_dir(checkpoint_id) if checkpoint_id else None)
        if os.fspath(self.path) != old:
            self._check_commit()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isdir(volume_dir(checkpoint_id))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        with self._naming_overwrites():
            return self._read_metadata()

    def _read_metadata(self) -> Metadata:
        cached = getattr(self, "_metadata", None)
        if cached is not None and cached[0] == os.fspath(self.path):
            _set_load_id(cached[1], self)
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
        meta = getattr(metadata, "storage_meta", None)
        if self.commit is not None and meta is not None and getattr(meta, "save_id", None) not in (
                None, self.commit["save_id"]):
            raise CheckpointCorruptError(f"{path}: {METADATA_NAME} belongs to another save than the commit "
                                         "marker; re-save this checkpoint")
        _set_load_id(metadata, self)
        self._metadata = (path, metadata)
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        path = os.fspath(self.path)
        names: list[str] = []
        seen: set[str] = set()
        for item in plan.items:
            name = compat.storage_location(self.storage_data, item.storage_index)[0]
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
            with self._naming_overwrites():
                out = super().read_data(plan, safe_planner)
            self._check_unchanged()
            return out
        threads = min(self.download_threads, len(names))
        staging = xfer.make_staging_dir(self.staging_dir, f"load-{getattr(self, 'load_id', None) or id(self)}")
        session = _DownloadSession(staging, threads, self.memory_budget)
        try:
            in_memory = {n for n in names if n in expected and expected[n].size <= self.memory_budget // threads}
            need = sum(expected[n].size for n in names if n in expected and n not in in_memory)
            if need:
                xfer.check_free_space(staging, need, self.min_free)
            ticket = 0
            for name in names:  # same order torch reads them in, so the first file arrives first
                fut: CFuture[bytes | str]
                if name in in_memory:
                    fut = session.pool.submit(self._fetch, session, ticket, name, expected[name])
                    ticket += 1
                else:
                    fut = session.pool.submit(self._download, name, os.path.join(staging, name), expected.get(name))
                session.downloads[name] = fut
            self.fs.session = session
            with self._naming_overwrites():
                out = super().read_data(plan, safe_planner)
            self._check_unchanged()
            return out
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
