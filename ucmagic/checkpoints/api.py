"""Checkpoints on volumes: ``save_checkpoint`` / ``load_checkpoint`` / ``list_checkpoints``.

``save_checkpoint(root, model=..., optimizer=..., step=N)`` writes ``root/step_<N>/`` with torch
DCP through :class:`UCVolumeWriter` (every rank writes its shard locally, uploads in parallel, the
coordinator commits), or with one ``torch.save`` file from rank 0 (``single_file=True``, for small
models). ``load_checkpoint`` restores in place and returns ``(step, extra)``; ``"latest"`` is the
highest *committed* step. ``keep=N`` deletes older committed steps once the new one is committed.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .format import FORMAT_SINGLE, SINGLE_FILE_NAME, CheckpointInfo, make_commit, step_dirname, to_delete
from .commit import begin_save, clean_checkpoints, commit_save, read_commit
from .exit import track_pending_save
from .reader import UCVolumeReader
from .writer import UCVolumeWriter
from ..dist import barrier, dist_info, settle
from ..files.locks import hold_dir, release_dir
from ..errors import (CheckpointCorruptError, CheckpointError, CheckpointExistsError, CheckpointInProgressError,
                      CheckpointMismatchError, CheckpointNotCommittedError, CheckpointUploadError, NoCheckpointError,
                      UnsafeCheckpointError)
from .restore import load_dcp, load_single, load_torch_file
from .steps import (checkpoint_root, credentials_error, foreign_dcp, list_checkpoints, naming_credentials, resolve_step,
                    retain)
from .torch_state import dcp_state, quiet_dcp, unwrap_error, unwrapping

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInProgressError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointNotCommittedError",
    "CheckpointUploadError",
    "NoCheckpointError",
    "UCVolumeReader",
    "UCVolumeWriter",
    "UnsafeCheckpointError",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
    "resolve_step",
]


# ---------------------------------------------------------------- save

def _save_single(path: str, state: dict[str, Any], info: dict[str, Any], writer_kw: dict[str, Any],
                 async_: bool, cancel: Any = None) -> Future[None] | None:
    """Rank 0: torch.save to local staging, upload, commit. Returns a Future when ``async_``."""
    import uuid

    import torch

    from . import transfer as xfer

    save_id = str(uuid.uuid4())
    staging = xfer.make_staging_dir(writer_kw.get("staging_dir"), f"single-{save_id}")
    local = os.path.join(staging, SINGLE_FILE_NAME)
    held = False
    try:
        with open(local, "wb", opener=xfer.new_file_opener) as f:  # new, by the staging folder's descriptor
            torch.save(state, f)
        hold_dir(path, shared_ok=bool(writer_kw.get("allow_shared_dest", False)),  # written by its descriptor
                 what="checkpoint directory")
        held = True
        begin_save(path, save_id)  # readers refuse from here on; an older save of this step is un-committed
    except BaseException as e:
        xfer.release_staging_dir(staging)
        if held:
            release_dir(path)
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise xfer.destination_error(e, path) from None
        raise

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise CheckpointError("the checkpoint save was cancelled (Ctrl-C)")

    def upload() -> None:
        try:
            rec = xfer.upload_file(local, os.path.join(path, SINGLE_FILE_NAME), verify=writer_kw.get("verify", "size"),
                                   check=check)
            check()
            marker = make_commit(kind=FORMAT_SINGLE, save_id=save_id, files={SINGLE_FILE_NAME: rec}, info=info)
            commit_save(path, save_id, marker)  # only if no newer save of this step began meanwhile
        finally:
            xfer.release_staging_dir(staging)
            release_dir(path)

    if not async_:
        upload()
        return None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucmagic-ckpt")
    fut = pool.submit(upload)
    pool.shutdown(wait=False)
    return fut


@naming_credentials
def save_checkpoint(root: str | os.PathLike[str], *, model: Any, optimizer: Any = None, step: int,
                    extra: dict[str, Any] | None = None, async_: bool = False, keep: int | None = None,
                    single_file: bool = False, **writer_kw: Any) -> str | Future[str]:
    """Save ``model`` (and ``optimizer``) to ``root/step_<step>/`` and commit it; every rank calls this.

    ``extra`` is a JSON-able dict (e.g. ``{"loader": loader.state_dict()}``) returned by
    :func:`load_checkpoint`. ``async_=True`` returns a ``concurrent.futures.Future`` as soon as the
    state is copied; it resolves to the checkpoint path once the checkpoint is durable, committed
    and retention has run, and raises upload errors. ``keep=N`` keeps the N highest committed steps.
    ``single_file=True``: rank 0 writes one ``torch.save`` file (small models). Other keyword
    arguments go to :class:`UCVolumeWriter`. A local ``root`` another user owns or may write to (or below a
    folder another user may write to) is refused (``UnsafeDirectoryError``) unless ``allow_shared_dest=True``.
    Returns the checkpoint directory (or the Future).
    """
    name = step_dirname(step)
    to_delete([], keep, step)  # validates keep before anything is written
    info = {"step": step, "extra": extra}
    make_commit(kind=FORMAT_SINGLE, save_id="", files={}, info=info)  # validates extra is JSON-able
    root_path = checkpoint_root(root, create=True, storage_options=writer_kw.get("storage_options"),
                                allow_shared=bool(writer_kw.get("allow_shared_dest", False)))
    path = os.path.join(root_path, name)

    def finish() -> str:
        if dist_info(from_env=False).rank == 0:
            retain(root_path, keep, step)
            with contextlib.suppress(OSError, CheckpointError):  # the new checkpoint is committed regardless
                clean_checkpoints(root_path)  # killed saves' directories (their owner here is gone)
        return path

    if single_file:
        return _save_single_file(path, root_path, model, optimizer, info, writer_kw, async_, finish)
    return _save_dcp(path, root_path, model, optimizer, info, writer_kw, async_, finish)


def _save_single_file(path: str, root_path: str, model: Any, optimizer: Any, info: dict[str, Any],
                      writer_kw: dict[str, Any], async_: bool, finish: Callable[[], str]) -> str | Future[str]:
    """``save_checkpoint(single_file=True)``: rank 0 writes one ``torch.save`` file; ``finish`` runs retention."""
    from . import transfer as xfer

    state = {"model": model.state_dict()}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    fut = None
    out: Future[str] = Future()
    pending = track_pending_save(path, out) if async_ else None
    try:
        if dist_info(from_env=False).rank == 0:
            try:
                xfer.makedirs(path, root=root_path)  # step_<N> is never a link (one planted would be followed)
            except OSError as e:
                raise xfer.destination_error(e, path) from None
            fut = _save_single(path, state, info, writer_kw, async_, pending.cancel if pending else None)
    except BaseException as e:
        out.set_exception(e)  # nothing is pending at exit
        raise
    if not async_:
        barrier()
        return finish()
    if fut is None:
        out.set_result(path)
        return out
    fut.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else _settle(out, finish))
    return out


def _save_dcp(path: str, root_path: str, model: Any, optimizer: Any, info: dict[str, Any],
              writer_kw: dict[str, Any], async_: bool, finish: Callable[[], str]) -> str | Future[str]:
    """``save_checkpoint`` through torch DCP and :class:`UCVolumeWriter`; ``finish`` runs retention."""
    import torch.distributed.checkpoint as dcp

    from . import transfer as xfer

    state = dcp_state(model, optimizer)
    try:
        xfer.makedirs(path, root=root_path)  # step_<N> is never a link (the writer is given it as its own folder)
    except OSError as e:
        raise xfer.destination_error(e, path) from None
    writer = UCVolumeWriter(path, commit_info=info, **{"warn_overwrite": False, **writer_kw})
    if not async_:
        with unwrapping(), quiet_dcp():
            dcp.save(state, storage_writer=writer)
        barrier()  # DCP's own collectives are freed before this returns (torch < 2.8: see ucmagic.dist.settle)
        return finish()
    with unwrapping(), quiet_dcp():
        # a concurrent Future (AsyncSaveResponse only with async_stager options, which are never passed)
        f: Any = dcp.async_save(state, storage_writer=writer)
        deadline = time.monotonic() + 60  # torch warns from its save thread: stay quiet until it is past that
        while not f.done() and not writer.wait_started(0.05) and time.monotonic() < deadline:
            pass
    out: Future[str] = Future()
    track_pending_save(path, out)

    def done(f: Any) -> None:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            out.set_exception(credentials_error(e, path) or unwrap_error(e))
            return
        settle()  # a caller waiting in result() holds no GIL: DCP's collectives are freed first (torch < 2.8)
        _settle(out, finish)

    f.add_done_callback(done)
    return out


def _settle(out: Future[str], fn: Any) -> None:
    try:
        out.set_result(fn())
    except BaseException as e:  # noqa: BLE001
        out.set_exception(e)


@naming_credentials
def load_checkpoint(root: str | os.PathLike[str], step: int | str = "latest", *, model: Any, optimizer: Any = None,
                    map_location: Any = None, **reader_kw: Any) -> tuple[int, Any]:
    """Restore ``model`` (and ``optimizer``) in place from ``root/step_<step>/``; return ``(step, extra)``.

    ``step="latest"`` picks the highest committed step, skipping unfinished saves. Every rank calls
    this. Raises :class:`SourceNotFoundError` for a missing root, ``NoCheckpointError`` when nothing
    is committed, ``CheckpointNotCommittedError`` for an unfinished step, ``CheckpointCorruptError``
    for a damaged file and ``CheckpointMismatchError`` when the keys differ from the model's.
    """
    from . import transfer as xfer

    chosen, path = resolve_step(root, step, storage_options=reader_kw.get("storage_options"))
    if xfer.isfile(path):  # a torch.save file in the root
        load_torch_file(path, model, optimizer, map_location, reader_kw)
        return chosen, None
    try:
        commit = read_commit(path)  # raises CheckpointNotCommittedError for an unfinished save
    except CheckpointInProgressError:
        raise
    except CheckpointNotCommittedError:
        if foreign_dcp(path, os.path.basename(path)) is None:
            raise
        load_dcp(path, model, optimizer, reader_kw)  # written by torch's FileSystemWriter or another tool
        return chosen, None
    if commit["format"] == FORMAT_SINGLE:
        load_single(path, commit, model, optimizer, map_location, reader_kw)
    else:
        load_dcp(path, model, optimizer, reader_kw)
    step_saved = commit.get("step")  # an int or None: parse_commit checked it
    return (chosen if step_saved is None else int(step_saved)), commit.get("extra")
