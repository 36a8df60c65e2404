"""A checkpoint directory's state: its local path, its commit marker, its save-in-progress record.

The formats live in :mod:`.format`; this module does the I/O: the reads, in the order that makes a
save beginning or ending between them visible; the record a save writes before it withdraws the
previous checkpoint (owner host, pid and start time: :func:`ucmagic.files.locks.process_tag`, the one
owner check), marks failed when it fails and removes at its commit; and the reclaiming of
directories whose saver was killed.

Overlapping saves into one directory in one process: the newest one begun is the directory's
current save; :func:`commit_save` commits only the current save (under a lock shared with
:func:`begin_save`), an older one raises :class:`CheckpointSupersededError` and commits nothing.
"""
from __future__ import annotations

import contextlib
import json
import os
import socket
import stat as stat_mod
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .._util import is_remote_url
from . import transfer as xfer
from .format import (
    COMMIT_NAME,
    METADATA_NAME,
    SAVING_NAME,
    in_progress_message,
    parse_step_dirname,
    is_committed_by,
    make_saving_record,
    not_committed,
    parse_commit,
    parse_saving_record,
)
from ..errors import (
    CheckpointAbandonedError,
    CheckpointError,
    CheckpointInProgressError,
    CheckpointSupersededError,
)
from ..files.locks import process_tag, tag_alive
from ..files.volume import resolve_local_path

# A record from another host, or without its owner's start time (older ucmagic), cannot be checked
# against a live process: it counts as abandoned once it is this old (``ckpt clean --force``: at once).
ABANDONED_AFTER_S = 24 * 3600.0
# An empty step_<N> folder, or an empty record, this old is a killed save's (a save writes its record at once).
EMPTY_AFTER_S = 60.0


def volume_dir(path: str | os.PathLike[str]) -> str:
    """The directory of a checkpoint path: local (``/Volumes/...`` resolved) or an fsspec URL (``s3://...``)."""
    p = os.fspath(path)
    if is_remote_url(p):
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

    A save in progress raises :class:`CheckpointInProgressError`, whatever marker is there; a save
    whose owner process on this host is gone raises :class:`CheckpointAbandonedError` (a subclass).

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
                raise in_progress_error(path, record) from None
            if xfer.exists(commit_path):
                continue  # a save committed between the two reads: read its marker
            raise not_committed(path) from None
        commit = parse_commit(data, path)
        record = read_saving_record(path)
        if record is not None and not is_committed_by(commit.get("save_id"), record):
            raise in_progress_error(path, record)
        return commit


# ---------------------------------------------------------------- owners

def owner_state(record: Mapping[str, Any], *, host: str, alive: Callable[[str], bool]) -> str:
    """Whose a save-in-progress record is: ``"running"`` (its owner process on this host lives),
    ``"dead"`` (that process is gone), ``"unknown"`` (another host, or no owner start time: an older
    record). Pure but for ``alive`` (:func:`ucmagic.files.locks.tag_alive`)."""
    owner = record.get("owner")
    if record.get("host") != host or not isinstance(owner, str) or not owner:
        return "unknown"
    return "running" if alive(owner) else "dead"


def reclaimable(record: Mapping[str, Any], *, state: str, age_s: float, force: bool = False,
                max_age_s: float = ABANDONED_AFTER_S) -> bool:
    """May the directory of an uncommitted save with this record (``state`` from :func:`owner_state`,
    ``age_s`` since it started) be removed? A dead owner's: yes; a running one's: never; one that
    cannot be checked (other host, older record): with ``force`` or once older than ``max_age_s``."""
    if state == "dead":
        return True
    if state == "running":
        return False
    return force or age_s >= max_age_s


def in_progress_error(path: str, record: Mapping[str, Any], *,
                      waited: float | None = None) -> CheckpointInProgressError:
    """The error for a directory whose save has not committed: abandoned when its owner here is gone."""
    empty_age = _empty_record_age(path, record, time.time())
    if empty_age is not None and empty_age >= EMPTY_AFTER_S:
        return CheckpointAbandonedError(
            f"{path}: a save into this directory was killed as it began (its save-in-progress record is empty "
            f"and over {EMPTY_AFTER_S:.0f} s old), so it will never commit; nothing there is loadable: load another "
            "step, save again, or remove it (the next save_checkpoint in its root does, as does "
            "`python -m ucmagic ckpt clean ROOT`)")
    if not record.get("failed") and owner_state(record, host=socket.gethostname(), alive=tag_alive) == "dead":
        since = record.get("since")
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(since)) if isinstance(since, (int, float)) else "?"
        return CheckpointAbandonedError(
            f"{path}: the save into this directory that started at {when} by pid {record.get('pid')} on "
            f"{record.get('host')} was killed (that process is gone), so it will never commit; nothing there is "
            "loadable: load another step, save again, or remove it (the next save_checkpoint or keep= in its "
            "root does, as does `python -m ucmagic ckpt clean ROOT`)")
    return CheckpointInProgressError(in_progress_message(path, record, waited=waited))


# ---------------------------------------------------------------- saves: begin, commit

_latest: dict[str, str] = {}  # directory -> id of the newest save begun into it by this process
_dir_locks: dict[str, threading.Lock] = {}
_dir_locks_mu = threading.Lock()


def _dir_lock(path: str) -> threading.Lock:
    with _dir_locks_mu:
        return _dir_locks.setdefault(path, threading.Lock())


def begin_save(path: str, save_id: str) -> None:
    """Write the save-in-progress record of ``save_id`` into ``path``, then withdraw the checkpoint there.

    In this order, so that a reader between the two steps sees the save (see :func:`read_commit`).
    From here on ``save_id`` is the directory's current save: an older one still running in this
    process does not commit (:func:`commit_save`).
    """
    record = make_saving_record(save_id=save_id, host=socket.gethostname(), pid=os.getpid(), owner=process_tag())
    with _dir_lock(path):
        _latest[path] = save_id
        xfer.write_bytes(os.path.join(path, SAVING_NAME), record)
        xfer.remove_quietly(os.path.join(path, COMMIT_NAME))
        xfer.remove_quietly(os.path.join(path, METADATA_NAME))


def superseded(path: str, save_id: str) -> bool:
    """True when a newer save into ``path`` began in this process after ``save_id`` (which then never commits)."""
    return _latest.get(path, save_id) != save_id


def superseded_error(path: str) -> CheckpointSupersededError:
    """The error of a save that a newer save into the same directory ``path`` overtook."""
    return CheckpointSupersededError(
        f"{path}: this save did not commit because a newer save into the same directory started before it "
        "finished (the newest save started is the one a load returns once it commits); wait for a save's "
        "future before saving into the same directory again if every save must commit")


def commit_save(path: str, save_id: str, marker: bytes | Callable[[], bytes], *,
                before: Callable[[], None] | None = None, after: Callable[[], None] | None = None) -> None:
    """Commit save ``save_id`` of ``path``: ``before()`` (e.g. write ``.metadata``), the marker (its bytes,
    or a function that makes them after ``before``), ``after()`` (e.g. drop older shards), then remove the
    record; only while ``save_id`` is the directory's current save.

    Raises :class:`CheckpointSupersededError` (writing nothing) when a newer save began into ``path``
    (in this process, or its record replaced this one's on the volume); a newer save's begin waits
    for a commit in progress, so the newest save started is the one that ends up committed.
    """
    with _dir_lock(path):
        record = read_saving_record(path)
        mine = record is not None and record.get("save_id") == save_id
        if superseded(path, save_id) or not mine:
            raise superseded_error(path)
        if before is not None:
            before()
        xfer.write_bytes(os.path.join(path, COMMIT_NAME), marker if isinstance(marker, bytes) else marker())
        if after is not None:
            with contextlib.suppress(OSError):
                after()
        xfer.remove_quietly(os.path.join(path, SAVING_NAME))  # last: the new commit is in place
        if _latest.get(path) == save_id:
            del _latest[path]


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


# ---------------------------------------------------------------- reclaiming killed saves

def _record_age(path: str, record: Mapping[str, Any], now: float) -> float:
    since = record.get("since")
    if isinstance(since, (int, float)):
        return now - float(since)
    try:
        return now - xfer.stat_file(os.path.join(path, SAVING_NAME))[1]
    except OSError:
        return 0.0


def reclaim_dir(path: str) -> None:
    """Remove the uncommitted checkpoint directory ``path``: ``.metadata`` first, the record last, so that
    an interrupted removal still leaves a directory that is refused (never one that looks complete). An empty
    folder is removed only while it is empty (``rmdir``: a save that wrote into it meanwhile keeps it)."""
    names = xfer.list_names(path)
    if not names and not is_remote_url(path):
        os.rmdir(path)
        return
    first = [n for n in names if n == METADATA_NAME]
    rest = [n for n in names if n not in (METADATA_NAME, SAVING_NAME)]
    for name in first + rest:
        full = os.path.join(path, name)
        if is_remote_url(full) or not os.path.isdir(full):
            xfer.remove_quietly(full)
        else:
            xfer.remove_tree(full)
    xfer.remove_quietly(os.path.join(path, SAVING_NAME))
    xfer.remove_tree(path)


def abandoned_dirs(root: str, *, force: bool = False, now: float | None = None) -> list[str]:
    """The directories under checkpoint root ``root`` (a local path or URL) holding a save that will never
    commit: its record's owner on this host is gone (or, with ``force`` or after :data:`ABANDONED_AFTER_S`,
    one that cannot be checked), or an empty ``step_<N>`` folder or empty record a save killed before its first
    write left (:data:`EMPTY_AFTER_S` old, or with ``force``). Committed checkpoints and running saves are never
    among them."""
    now = time.time() if now is None else now
    host = socket.gethostname()

    def check(name: str) -> str | None:
        d = os.path.join(root, name)
        if not is_remote_url(d) and os.path.islink(d):
            return None  # never removed through a link: what it points to is not this root's
        try:
            record = read_saving_record(d)
        except (OSError, CheckpointError):
            return None
        if record is None:  # a save killed between making step_<N> and writing its record leaves it empty
            return d if _empty_step_dir(d, name, now, force) else None
        if _committed_by(d, record):
            return None
        state = owner_state(record, host=host, alive=tag_alive)
        empty_age = _empty_record_age(d, record, now)
        age, limit = ((_record_age(d, record, now), ABANDONED_AFTER_S) if empty_age is None
                      else (empty_age, EMPTY_AFTER_S))
        return d if reclaimable(record, state=state, age_s=age, force=force, max_age_s=limit) else None

    names = [n for n in xfer.list_names(root) if not n.startswith(".")]
    if not names:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        return sorted(d for d in pool.map(check, names) if d is not None)


def _empty_step_dir(path: str, name: str, now: float, force: bool) -> bool:
    """Whether ``path`` is an empty ``step_<N>`` folder (ucmagic's name) made at least :data:`EMPTY_AFTER_S` ago
    (``force``: at once): what a save killed before its first write leaves. A store has no empty folders."""
    if is_remote_url(path) or parse_step_dirname(name) is None:
        return False
    try:
        st = os.lstat(path)
        return stat_mod.S_ISDIR(st.st_mode) and not os.listdir(path) and (force or now - st.st_mtime >= EMPTY_AFTER_S)
    except OSError:
        return False


def _empty_record_age(path: str, record: Mapping[str, Any], now: float) -> float | None:
    """Seconds since the save-in-progress record of ``path`` (read as ``record``) was made, when it is an empty file
    (its save was killed between creating the record and its one write: it ages like an empty folder,
    :data:`EMPTY_AFTER_S`); else None."""
    if record:
        return None
    try:
        size, mtime = xfer.stat_file(os.path.join(path, SAVING_NAME))
    except OSError:
        return None
    return now - mtime if size == 0 else None


def _committed_by(path: str, record: Mapping[str, Any]) -> bool:
    """The record's save wrote the marker there (its process died between the marker and the record's removal)."""
    try:
        commit = parse_commit(xfer.read_bytes(os.path.join(path, COMMIT_NAME)), path)
    except (OSError, CheckpointError):
        return False
    return is_committed_by(commit.get("save_id"), record)


def clean_checkpoints(root: str | os.PathLike[str], *, force: bool = False,
                      storage_options: dict[str, Any] | None = None) -> list[str]:
    """Remove the directories of killed saves under checkpoint root ``root``; return their paths.

    A directory goes when its save-in-progress record belongs to a process on this host that is gone
    (pid and start time). Records from other hosts, or from an older ucmagic (no start time), are
    removed with ``force=True`` or once :data:`ABANDONED_AFTER_S` old. Committed checkpoints, foreign
    ones and saves still running are never touched. ``root`` may be an fsspec URL.
    """
    path = volume_dir(root)
    if is_remote_url(path):
        xfer.use_storage_options(path, storage_options)
    elif not os.path.isdir(path):
        from ..errors import SourceNotFoundError

        raise SourceNotFoundError(f"checkpoint root {os.fspath(root)} does not exist; check the path")
    gone = []
    for d in abandoned_dirs(path, force=force):
        with contextlib.suppress(OSError):
            reclaim_dir(d)
            gone.append(d)
    return gone
