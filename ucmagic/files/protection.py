"""Protection records: per stream, the cache entries a live process has not consumed yet.

A record is ``prot/<owner>@<writer>.<slot>.rec`` (owner: the consuming process's tag, writer: the
process that writes it, e.g. a DataLoader worker), one entry name per line. Eviction skips every
entry named in a record whose owner is alive; records of a dead owner are dropped at once.
"""
from __future__ import annotations

import atexit
import contextlib
import os
from typing import Iterable, Protocol

from .cache_layout import CacheLayout, KeptOpen, listdir
from .locks import process_tag, tag_alive


def parse_record_name(name: str) -> tuple[str, str] | None:
    """``(owner_tag, writer_tag)`` of a protection record file name, else None."""
    if not name.endswith(".rec") or "@" not in name:
        return None
    owner, rest = name[:-4].split("@", 1)
    return owner, rest.rsplit(".", 1)[0]


RECORD_SLACK = 64 * 1024
"""Bytes of NUL padding a record that shrank may keep (or up to its own size) before it is truncated."""


class ProtectionRecords:
    """The protection records of one cache directory: written, dropped, read."""

    def __init__(self, layout: CacheLayout, kept: KeptOpen) -> None:
        self.prot = layout.prot
        self.layout = layout
        self.kept = kept

    def record_path(self, owner: str, slot: int | str) -> str:
        """Where the writing process keeps its protection record for stream ``slot`` on behalf of ``owner``."""
        return os.path.join(self.prot, f"{owner}@{process_tag()}.{slot}.rec")

    def write_record(self, path: str, names: Iterable[str]) -> None:
        """Atomically replace the protection record at ``path`` with ``names`` (entry file names).

        Taken under the shared eviction lock: once this returns, no eviction that has not seen the
        record is still running, so an entry found present afterwards stays until released.
        """
        data = "\n".join(names).encode("utf-8", "surrogateescape")  # names are paths: any bytes
        with self.layout.evicting(shared=True):
            # Rewritten in place on a descriptor kept open: a rename over an existing file makes
            # ext4 flush it first (auto_da_alloc, ~5 ms a call), and evictions, which read records
            # under the exclusive lock, never see a half-written one. A process killed between the
            # two calls leaves the new names plus a tail of old ones: more protection, never less.
            # A record that grows gets its room first: on a full disk a write stops short (silently,
            # the names past that point lost), while a failed allocation leaves the old record whole.
            # A record that shrinks a little keeps its size, its tail overwritten with NUL bytes (readers stop
            # at the first): cutting allocated blocks off with ftruncate cost ~80 us a call, 8% of a warm
            # epoch of 200,000 small files, where each record grows and shrinks by a name every few items.
            try:
                fd = self.kept.fd(path)
            except FileNotFoundError:  # the cache directory removed by hand, another process making it anew
                self.layout.ensure()  # (locks/ made, prot/ not yet): made here too, then opened again
                fd = self.kept.fd(path)
            size = os.fstat(fd).st_size
            payload = data + b"\n"  # the names end with a separator: an older reader sees the NULs as one name
            cut = size - len(payload) > max(RECORD_SLACK, len(payload))  # shrunk by half or more: give room back
            if not cut and len(payload) < size:
                payload += bytes(size - len(payload))
            grow = len(payload) - size
            if grow > 0 and hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, size, grow)
            view, done = memoryview(payload), 0
            while done < len(payload):
                done += os.pwrite(fd, view[done:], done)
            if cut:
                os.ftruncate(fd, len(payload))

    def drop_record(self, path: str) -> None:
        self.kept.close(path)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    def drop_records(self, owner: str, *, dead_writers_only: bool = True) -> int:
        """Remove records owned by ``owner`` (by default only those whose writing process is gone)."""
        n = 0
        for name in listdir(self.prot):
            parsed = parse_record_name(name)
            if parsed is None or parsed[0] != owner:
                continue
            if dead_writers_only and (parsed[1] == process_tag() or tag_alive(parsed[1])):
                continue
            self.drop_record(os.path.join(self.prot, name))
            n += 1
        return n

    def protected_names(self, *, reap: bool = True, except_owner: str | None = None) -> set[str]:
        """Entry names protected by live owners (but ``except_owner``); records of dead owners are
        dropped (``reap``)."""
        names: set[str] = set()
        alive: dict[str, bool] = {}
        for name in listdir(self.prot):
            full = os.path.join(self.prot, name)
            parsed = parse_record_name(name)
            if parsed is None or parsed[0] == except_owner:
                continue
            owner = parsed[0]
            if owner not in alive:
                alive[owner] = tag_alive(owner)
            if not alive[owner]:
                if reap:
                    self.drop_record(full)
                continue
            try:
                with open(full, "rb") as f:
                    raw = f.read()
                end = raw.find(b"\0")  # the padding of a record that shrank (write_record)
                names.update((raw if end < 0 else raw[:end]).decode("utf-8", "surrogateescape").split("\n"))
            except FileNotFoundError:
                continue
        names.discard("")
        return names

    def reap(self) -> tuple[set[str], int]:
        """Drop the records of dead owners: ``(names still protected, records dropped)``."""
        before = len(listdir(self.prot))
        protected = self.protected_names(reap=True)
        return protected, before - len(listdir(self.prot))

    def live_streams(self) -> int:
        """How many protection records (:meth:`record_path`, one per stream) have a live owner, this
        process's included: the streams of every process sharing this cache. Reads names only."""
        alive: dict[str, bool] = {}
        n = 0
        for name in listdir(self.prot):
            parsed = parse_record_name(name)
            if parsed is None:
                continue
            owner = parsed[0]
            if owner not in alive:
                alive[owner] = owner == process_tag() or tag_alive(owner)
            n += alive[owner]
        return n


class Rooted(Protocol):
    """Anything with a cache ``root`` (a :class:`~ucmagic.files.cache.FileCache`)."""

    @property
    def root(self) -> str: ...


_cleanup_owners: set[str] = set()


def release_at_exit(cache: Rooted, owner: str) -> None:
    """Remove the records ``owner`` (this process) holds in ``cache`` when it exits normally.

    A process killed outright leaves them behind; every other process drops them at its next
    eviction or :meth:`FileCache.reap`, since their owner is gone.
    """
    key = cache.root + "\0" + owner
    if key in _cleanup_owners:
        return
    _cleanup_owners.add(key)
    atexit.register(_drop_if_owner, cache.root, owner, os.getpid())


def _drop_if_owner(root: str, owner: str, pid: int) -> None:
    if os.getpid() != pid:  # atexit handlers are inherited by forked children
        return
    prot = os.path.join(root, "prot")
    for name in listdir(prot):
        parsed = parse_record_name(name)
        if parsed and parsed[0] == owner:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(prot, name))
