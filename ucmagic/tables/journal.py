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
"""
from __future__ import annotations

import contextlib
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
           "roll_back", "journal_path", "JOURNAL_PREFIX"]


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
    """Roll back the appends of ``dest`` whose process is gone; ``(rolled back, files of the rest)``."""
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
