"""A checkpoint directory's state: its local path, its commit marker, its save-in-progress record.

The formats (and the pure decisions on them) live in :mod:`.format`; this module does the I/O: the
reads, in the order that makes a save beginning or ending between them visible, and the record a
save writes before it withdraws the previous checkpoint (and marks failed when it fails).
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
from typing import Any

from . import transfer as xfer
from .format import (
    COMMIT_NAME,
    METADATA_NAME,
    SAVING_NAME,
    in_progress_message,
    is_committed_by,
    make_saving_record,
    not_committed,
    parse_commit,
    parse_saving_record,
)
from ..errors import CheckpointError, CheckpointInProgressError
from ..files.volume import resolve_local_path


def volume_dir(path: str | os.PathLike[str]) -> str:
    """The directory of a checkpoint path: local (``/Volumes/...`` resolved) or an fsspec URL (``s3://...``)."""
    p = os.fspath(path)
    if xfer.is_url(p):
        return xfer.url_path(p)
    p = p.removeprefix("file://")
    if "://" in p:
        raise CheckpointError(f"{p}: not a checkpoint location; pass a directory (a local disk or a mounted "
                              "volume such as /Volumes/...) or an fsspec URL such as s3://bucket/run/ckpts")
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
            if xfer.exists(commit_path):
                continue  # a save committed between the two reads: read its marker
            raise not_committed(path) from None
        commit = parse_commit(data, path)
        record = read_saving_record(path)
        if record is not None and not is_committed_by(commit.get("save_id"), record):
            raise CheckpointInProgressError(in_progress_message(path, record))
        return commit


def begin_save(path: str, save_id: str) -> None:
    """Write the save-in-progress record of ``save_id`` into ``path``, then withdraw the checkpoint there.

    In this order, so that a reader between the two steps sees the save (see :func:`read_commit`).
    """
    record = make_saving_record(save_id=save_id, host=socket.gethostname(), pid=os.getpid())
    xfer.write_bytes(os.path.join(path, SAVING_NAME), record)
    xfer.remove_quietly(os.path.join(path, COMMIT_NAME))
    xfer.remove_quietly(os.path.join(path, METADATA_NAME))


def mark_save_failed(path: str, save_id: str, exc: BaseException) -> None:
    """Note ``exc`` in the save-in-progress record of ``save_id`` (readers then say the save failed).

    Best effort: a record that is gone, or belongs to another save, is left as it is.
    """
    with contextlib.suppress(Exception):
        rec = parse_saving_record(xfer.read_bytes(os.path.join(path, SAVING_NAME)))
        if rec.get("save_id") == save_id:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
            first = first if len(first) <= 400 else "..." + first[-400:]  # the cause is at the end
            rec["failed"] = first
            xfer.write_bytes(os.path.join(path, SAVING_NAME), json.dumps(rec).encode())
