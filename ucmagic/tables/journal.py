"""Appends to a Parquet directory, all or nothing for ucmagic's readers: the append journal.

``export_parquet(..., mode="append")`` writes its files in a hidden sibling staging directory, then
writes ``<dest>/_ucmagic_append-<id>.json`` (this journal: the owner process, the staging directory
and the final names) before renaming the files into ``dest``, and removes the journal once every
file is in place: that removal is the commit point.

- ucmagic's readers (every local Parquet directory goes through :func:`committed_listing`) never
  list a file named by a journal, so they see an append whole or not at all;
- a journal whose process is gone (killed, or a crash) is rolled back by :func:`recover_destination`
  at the next ucmagic call on the directory: the files it had renamed in, its staging and the journal
  are removed, so rerunning the killed append adds its rows once;
- outside readers (Spark, pyarrow, Hugging Face ``datasets``) skip ``_``/``.`` names, so they never see
  the journal or the staging; they see the new files appear during the final renames only.

Owners are identified by pid and start time (:func:`ucmagic.files.locks.process_tag`) and host name; a
journal from another host counts as running until it is :data:`FOREIGN_JOURNAL_TTL_S` old.

Export staging (and the old version an overwrite swaps out) lives beside ``dest`` as
``.<dest>.ucmagic-staging-<pid>-<start time>-<host>-<id>/`` (:func:`staging_path`); one whose owner is gone
is removed by :func:`sweep_staging`, which every ucmagic call that reads or writes ``dest`` runs (through
:func:`committed_listing` and ``export_parquet``), best-effort: never an error on a read-only mount.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import time
from typing import Any, Callable

from .._util import atomic_write
from ..files.locks import process_tag, tag_alive

JOURNAL_PREFIX = "_ucmagic_append-"
JOURNAL_SUFFIX = ".json"
FOREIGN_JOURNAL_TTL_S = 24 * 3600.0
LISTING_ATTEMPTS = 5

__all__ = ["recover_destination", "committed_listing", "pending_files", "write_journal", "remove_journal",
           "roll_back", "journal_path", "JOURNAL_PREFIX", "staging_path", "sweep_staging", "STAGING_KINDS"]

STAGING_KINDS = ("staging", "old")


def host_id(host: str | None = None) -> str:
    """A short name of this machine for file names (host names may hold ``-`` and ``.``)."""
    return hashlib.sha256((host or socket.gethostname()).encode()).hexdigest()[:8]


def staging_path(dest: str, kind: str, export_id: str) -> str:
    """``<parent>/.<name>.ucmagic-<kind>-<pid>-<start time>-<host>-<id>``: a hidden sibling of ``dest`` that
    names its owner (pid and start time: :func:`ucmagic.files.locks.process_tag`, and the host)."""
    parent, base = os.path.dirname(dest), os.path.basename(dest)
    return os.path.join(parent, f".{base}.ucmagic-{kind}-{process_tag()}-{host_id()}-{export_id}")


def staging_owner_alive(suffix: str, mtime: float, now: float | None = None) -> bool:
    """Whether the export that named a staging directory ``...ucmagic-<kind>-<suffix>`` may still run.

    ``suffix``: ``<pid>-<start>-<host>-<id>`` (an owner on another host counts as running for
    :data:`FOREIGN_JOURNAL_TTL_S` after ``mtime``), or an older release's ``<pid>-<id>`` (the pid alone)."""
    from ..files.locks import pid_running

    parts = suffix.split("-")
    if len(parts) == 4 and all(parts):
        pid, start, host = parts[:3]
        if host != host_id():
            return (time.time() if now is None else now) - mtime < FOREIGN_JOURNAL_TTL_S
        return tag_alive(f"{pid}-{start}")
    return len(parts) == 2 and parts[0].isdigit() and pid_running(int(parts[0]))


def sweep_staging(dest: str) -> int:
    """Remove the hidden staging/old directories beside ``dest`` whose export is gone (killed, crashed);
    best-effort: a directory this process may not change stays, silently. Returns how many went."""
    parent, base = os.path.dirname(os.path.abspath(dest)), os.path.basename(os.path.abspath(dest))
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    n = 0
    for name in names:
        for kind in STAGING_KINDS:
            prefix = f".{base}.ucmagic-{kind}-"
            if not name.startswith(prefix):
                continue
            path = os.path.join(parent, name)
            try:
                if os.path.islink(path) or staging_owner_alive(name[len(prefix):], os.stat(path).st_mtime):
                    continue
                shutil.rmtree(path)
                n += 1
            except OSError:  # gone meanwhile, or read-only: left as it is
                continue
    return n


def journal_path(dest: str, export_id: str) -> str:
    return os.path.join(dest, f"{JOURNAL_PREFIX}{export_id}{JOURNAL_SUFFIX}")


def write_journal(dest: str, export_id: str, staging: str, rels: list[str]) -> str:
    """Record an append before its first rename (durably: fsynced). Returns the journal's path."""
    path = journal_path(dest, export_id)
    doc = {"version": 1, "owner": process_tag(), "host": socket.gethostname(), "staging": staging,
           "files": list(rels), "started": time.time()}
    atomic_write(path, json.dumps(doc).encode(), sync=True)
    return path


def remove_journal(path: str) -> None:
    """Commit the append (its files stay) by removing its journal."""
    os.unlink(path)


def _journals(dest: str) -> list[tuple[str, dict[str, Any] | None]]:
    """``(path, content or None when unreadable)`` of each journal in ``dest``."""
    try:
        names = os.listdir(dest)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out: list[tuple[str, dict[str, Any] | None]] = []
    for name in sorted(names):
        if name.startswith(JOURNAL_PREFIX) and name.endswith(JOURNAL_SUFFIX):
            path = os.path.join(dest, name)
            try:
                with open(path, "rb") as f:
                    doc = json.loads(f.read().decode())
                out.append((path, doc if isinstance(doc, dict) else None))
            except FileNotFoundError:  # committed or rolled back meanwhile
                continue
            except (OSError, ValueError):
                out.append((path, None))
    return out


def _owner_running(path: str, doc: dict[str, Any] | None) -> bool:
    if doc is None:  # unreadable: being written cannot be (atomic_write), so it is damaged; roll back
        return False
    if doc.get("host") != socket.gethostname():  # a pid means nothing here; trust it for a day
        try:
            return time.time() - os.stat(path).st_mtime < FOREIGN_JOURNAL_TTL_S
        except OSError:
            return False
    return tag_alive(str(doc.get("owner", "")))


def roll_back(dest: str, path: str, doc: dict[str, Any] | None) -> None:
    """Undo an append: remove the files it renamed into ``dest``, its staging, then its journal."""
    folders: set[str] = set()
    for rel in (doc or {}).get("files", []):
        if not isinstance(rel, str) or os.path.isabs(rel) or ".." in rel.split("/"):
            continue  # a journal names files inside dest only
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(dest, rel))
        folders.update("/".join(rel.split("/")[:i]) for i in range(1, rel.count("/") + 1))
    for folder in sorted(folders, key=len, reverse=True):  # partition folders the append created, now empty
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(dest, folder))
    staging = (doc or {}).get("staging")
    if isinstance(staging, str) and ".ucmagic-staging-" in os.path.basename(staging):  # never anything else
        shutil.rmtree(staging, ignore_errors=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _recover(dest: str) -> tuple[int, set[str]]:
    """Roll back the appends of ``dest`` whose process is gone and remove dead exports' staging beside it;
    ``(rolled back, files of the rest)``."""
    sweep_staging(dest)
    n, pending = 0, set()
    for jpath, doc in _journals(dest):
        if not _owner_running(jpath, doc):
            try:
                roll_back(dest, jpath, doc)
                n += 1
                continue
            except OSError:  # read-only: its files stay hidden from ucmagic's readers
                pass
        pending.update(_named(doc))
    return n, pending


def recover_destination(path: str | os.PathLike[str]) -> int:
    """Roll back the appends to the Parquet directory ``path`` whose process is gone (killed mid-append).

    Called by ``export_parquet`` and by ucmagic's readers (through :func:`committed_listing`) before
    they use the directory. Returns the number of appends rolled back; a directory this process may not
    write is left as it is (its readers still skip the unfinished append's files)."""
    return _recover(os.fspath(path))[0]


def _named(doc: dict[str, Any] | None) -> set[str]:
    return {r for r in (doc or {}).get("files", []) if isinstance(r, str)}


def pending_files(dest: str) -> set[str]:
    """Relative paths (``/``-separated) named by the journals in ``dest``: files of unfinished appends."""
    return {r for _, doc in _journals(dest) for r in _named(doc)}


def _mtime_ns(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return -1


def committed_listing(root: str, list_files: Callable[[str], list[str]]) -> list[str]:
    """``list_files(root)`` without the files of unfinished appends (rolled back first when their process
    is gone). The journals are read before and after the listing; a journal written or removed meanwhile
    changes the directory's mtime, and the listing is then taken again, so an append that starts and
    commits during one listing is seen whole or not at all."""
    before = _mtime_ns(root)
    rolled, skip = _recover(root)
    if rolled:
        before, skip = _mtime_ns(root), pending_files(root)
    files: list[str] = []
    for attempt in range(LISTING_ATTEMPTS):
        if attempt:
            before, skip = _mtime_ns(root), pending_files(root)
        files = list_files(root)
        skip |= pending_files(root)
        if _mtime_ns(root) == before:
            break
    if not skip:
        return files
    return [f for f in files if os.path.relpath(f, root).replace(os.sep, "/") not in skip]
