"""The persistent, machine-wide file cache.

The directory's layout (``files/``, ``tmp/``, ``locks/``, ``prot/``, the usage ledger) is described in
:mod:`.cache_layout`, which owns it.

Guarantees: an entry's file in ``files/`` is always complete (copied under ``tmp/``, stamped with
its version, then linked to its name, its folders made just before) and never replaced in place.
The path of an entry is stable: the same file version has the same path, ending with the file's
relative path, in every epoch and process, and it stays until a budget evicts it. One fill per file
even with many threads and processes asking at once; a changed source file (size or mtime) gets a
new key, and goes beside a cached older version (a new path). Entries of the old layouts
(``data/<k0k1>/<key><.ext>``, ``files/<key>-<size>/...``) are never served and are reaped.
Eviction is least-recently-used (by atime) and skips every entry named in a protection record whose
owner (pid + start time) is alive; records of a dead owner are dropped at once. With a budget,
fills wait for room instead of overshooting, except fills a blocked consumer needs next
(``may_exceed``), so the loop always makes progress.

This module holds :class:`FileCache`, the facade: lookup, fill and removal of entries. Its
parts, one job each: ``cache_layout`` (keys, entry names, source paths inside entries, the directory,
reaping of dead writers' temp files and the old layout), ``locks`` (``file_lock``, the per-key fill
locks, process identities), ``protection`` (protection records), ``budget`` (the budget in force,
the ledger, room for fills, eviction, the free-disk floor), ``cache_usage`` (what the directory holds)
and ``cache_report`` (the CLI's ``cache info|prune|clear``).
"""
from __future__ import annotations

import contextlib
import errno
import os
import time
from functools import cached_property
from stat import S_ISREG
from typing import Callable, Iterable, Sequence

import numpy as np

from .._shared import SharedBits
from ..errors import CacheDirError
from .budget import DEFAULT_MIN_FREE, BudgetKeeper, reap
from .._util import O_NOFOLLOW
from .cache_layout import (CacheLayout, RemovalToken, cache_root, entry_file, other_version_file,
                           STAMP_S_BITS, protection_name, serial, version_stamp)
from .cache_usage import CacheUsage
from .handles import key_locks, kept_open
from .locks import process_tag
from .protection import ProtectionRecords
from ..units import parse_size

TOUCH_EVERY_S = 300.0  # LRU resolution: a hit refreshes an entry's last-use time at most this often
FOLDERS_KEPT = 4096  # folders under files/ a cache remembers having made (a mkdir saved per fill in them)


class SeenEntries:
    """Which cache entries of ``n`` files (by index) this process found, a bit per file.

    A bit stands for "found since the cache's removal token (:meth:`FileCache.removals`) last
    changed and within the current touch window": nothing has been removed from the cache since
    (ucmagic removes entries only through :class:`FileCache`), so the entry is still there, and its
    last-use time was refreshed less than a window ago. Every bit is forgotten when the token changes
    or the window (``TOUCH_EVERY_S``) ends. Made by :meth:`FileCache.seen_entries`; n/8 bytes
    (a :class:`~ucmagic._shared.SharedBits`, kept per process: datasets do not pickle it).
    """

    def __init__(self, n: int, token: bytes) -> None:
        self._bits = SharedBits(n)
        self._token = token
        self._since = time.time()

    def sync(self, token: bytes, now: float) -> None:
        """Forget everything if the removal token is no longer the one seen, or the window ended."""
        if token != self._token or now - self._since > TOUCH_EVERY_S:
            self._bits.clear()
            self._token, self._since = token, now

    def known(self, indices: np.ndarray) -> np.ndarray:
        """A bool per index: found (and not forgotten since)."""
        return self._bits.known(indices)

    def add(self, indices: np.ndarray) -> None:
        self._bits.add_many(indices)

    def filled(self, index: int) -> None:
        """Entry ``index`` was just created by a fill of this process."""
        self._bits.add(index)  # a bit lost to a race is only a lookup more


class FileCache:
    """A directory of complete cached files shared by every process of the user on this machine.

    Args:
        root: cache directory; default :func:`default_cache_dir`.
        limit: byte budget for the whole directory (int or "50GB"); ``None``: only the free-space floor.
        min_free: fraction of the disk always left free (default 10%).
    """

    def __init__(self, root: str | None = None, limit: int | str | None = None,
                 min_free: float = DEFAULT_MIN_FREE) -> None:
        self.root = cache_root(root)
        self.limit = parse_size(limit)
        self.min_free = float(min_free)
        self.layout = CacheLayout(self.root)
        kept = kept_open()  # protection records and the removal token, kept open (one set per process)
        self.records = ProtectionRecords(self.layout, kept)
        self.removal_token = RemovalToken(self.layout.removals, kept)
        self.budget_keeper = BudgetKeeper(self.layout, self.records, self.removal_token, self.limit, self.min_free)
        self._entries = self.layout.entries
        self._keys = key_locks(os.path.join(self.layout.locks, "fill.lock"))
        # folders under files/ this process made or found (one mkdir less per fill); a link that finds one
        # gone (an eviction, the directory removed by hand) forgets them all
        self._folders: set[str] = set()

    # pickles as its settings; each process rebuilds its own state
    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "limit": self.limit, "min_free": self.min_free}

    def __setstate__(self, st: dict[str, object]) -> None:
        self.__init__(st["root"], st["limit"], st["min_free"])  # type: ignore[misc]

    # ------------------------------------------------------------ paths

    def data_path(self, key: str, suffix: str, size: int, rel: str | None = None, space: str | None = None) -> str:
        """Where the entry of ``key`` (``size`` bytes) goes first: ``files/`` + :func:`entry_file`
        (another version of the file may hold that place: then :meth:`lookup` finds it elsewhere)."""
        return self.layout.data_path(key, suffix, size, rel, space)

    def entry_name(self, path: str) -> str | None:
        """The name protection records give the entry whose file is ``path``, else None (not an entry)."""
        name = self.layout.entry_of(path)
        return None if name is None else protection_name(name.replace(os.sep, "/"))

    @cached_property
    def _quantum(self) -> int:
        """The step (ns) in which this cache's file system keeps mtimes (version stamps compare in it)."""
        return _mtime_quantum(self.layout)

    # ------------------------------------------------------------ lookups and fills

    def lookup(self, key: str, suffix: str, size: int, *, rel: str | None = None, space: str | None = None,
               touch: bool = True) -> str | None:
        """Path of a complete, trusted entry of ``size`` bytes, marked as used (``touch``); else None.

        ``rel``: the source file's relative path, which the entry's path ends with (see
        :func:`map_relpath`), in ``space`` (:func:`space_of` the volume URI); without it (an opaque
        key) the file is named ``<key>-<size><suffix>``. A file is trusted when it is this user's,
        of ``size`` bytes and stamped with this version (:func:`version_stamp`). No lock and one
        ``stat`` on a hit (plus a ``utime`` at most every ``TOUCH_EVERY_S``); a second where another
        version holds the first place.
        """
        return self._find(entry_file(key, suffix, size, rel, space), key, version_stamp(key), size, rel is not None,
                          touch)

    def _find(self, name: str, key: str, stamp: int, size: int, movable: bool, touch: bool = True) -> str | None:
        """:meth:`lookup` of the entry file ``name`` of ``key`` (version stamp ``stamp``); ``movable``: it
        may also lie at :func:`other_version_file`."""
        path = self._entries + os.sep + name
        if self._trusted(path, size, stamp, touch):
            return path
        if movable:
            path = self._entries + os.sep + other_version_file(key, name)
            if self._trusted(path, size, stamp, touch):
                return path
        return None

    def _trusted(self, path: str, size: int, stamp: int, touch: bool) -> bool:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        if st.st_size != size or not _stamped(st, stamp, self._quantum) \
                or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return False
        return not touch or time.time() - st.st_atime <= TOUCH_EVERY_S or self._touch(path, st)

    @staticmethod
    def _touch(path: str, st: os.stat_result) -> bool:
        """Mark the entry of file ``path`` as used now: its atime (its mtime is its version stamp)."""
        try:
            os.utime(path, ns=(time.time_ns(), st.st_mtime_ns))  # last-use time drives LRU
        except OSError:
            return False
        return True

    def lookup_run(self, names: Sequence[str], sizes: Sequence[int], stamps: Sequence[int],
                   indices: np.ndarray | None = None, seen: SeenEntries | None = None) -> list[str]:
        """Paths of the leading entries (:func:`entry_file` names, with their sizes and
        version stamps) found at their first place, stopping at the first one that is not:
        the warm path's lookup of a run of items, one ``stat`` each and no per-item call (an item
        it stops at goes through :meth:`lookup`, which also looks where another version moved it).

        With ``seen`` (and the items' ``indices`` in it), an entry this process found or filled since
        the cache last removed anything, within the touch window, is served with no system call
        (entries never change in place); the others are looked up and then remembered there.
        """
        files = self._entries + os.sep
        now = time.time()
        known: list[bool] | None = None
        if seen is not None and indices is not None and len(indices):
            seen.sync(self.removals(), now)  # after the caller protected the run: a removal since shows
            known_a = seen.known(indices)
            if known_a.all():
                return [files + name for name in names]
            known = known_a.tolist()
        uid = os.getuid() if hasattr(os, "getuid") else None
        stale_before = now - TOUCH_EVERY_S
        stat = os.stat
        q = self._quantum
        out: list[str] = []
        for i, (name, size, stamp) in enumerate(zip(names, sizes, stamps)):
            path = files + name
            if known is not None and known[i]:
                out.append(path)
                continue
            try:
                st = stat(path)
            except (FileNotFoundError, NotADirectoryError):
                break
            if st.st_size != size or not _stamped(st, stamp, q) or (uid is not None and st.st_uid != uid):
                break
            if st.st_atime < stale_before and not self._touch(path, st):
                break
            out.append(path)
        if seen is not None and indices is not None and out:
            seen.add(indices[:len(out)])
        return out

    def seen_entries(self, n: int) -> SeenEntries:
        """A fresh :class:`SeenEntries` for ``n`` files of this cache."""
        return SeenEntries(n, self.removals())

    def removals(self) -> bytes:
        """A token that changes whenever this cache removes an entry (any process): :meth:`remove`,
        evictions, :meth:`clear`. A different value each time the cache directory is made anew."""
        return self.removal_token.read()

    def fill(self, key: str, suffix: str, size: int, write: Callable[[str], int], *,
             may_exceed: Callable[[], bool] | None = None, on_wait: Callable[[], None] | None = None,
             looked_up: bool = False, rel: str | None = None, space: str | None = None,
             progress: Callable[[Callable[[], object] | None], None] | None = None,
             write_fd: Callable[[int], int | None] | None = None) -> tuple[str, bool]:
        """Return the entry for ``key``, calling ``write(tmp_path) -> nbytes`` once if it is missing.

        Returns ``(path, fetched)``. Concurrent callers (threads or processes) for one key wait for
        a single fill. ``write`` must produce exactly ``size`` bytes or the fill fails with OSError.
        Without room in the budget the fill waits (calling ``on_wait`` while it does) until
        consumers free some, unless ``may_exceed()`` says a consumer is blocked on this very file.
        ``looked_up``: the caller just found no entry, or expects none (a run of misses): the lookup
        before the lock is skipped (the one under the lock still runs, so a hit is still found).
        ``rel``, ``space``: the source's relative path, kept at the end of the entry's path, and the
        dataset root's space (see :meth:`lookup`). ``progress`` is told a probe of the bytes written
        while the copy runs, then None (e.g. :func:`ucmagic.files.fetch.watch_progress`; fills go
        through :class:`ucmagic.files.filler.CacheFiller`, which passes it). ``write_fd(fd) -> nbytes``, where
        given, is asked first to write into the fill's own descriptor (an empty file, at offset 0), which
        saves reopening it by path; where it returns ``None`` (it writes only to a path), ``write`` runs.
        The file is copied under ``tmp/``, stamped with its version and linked to its name in
        ``files/`` in one step once complete, so a reader never sees a partial file; an entry is
        never replaced in place (another version goes to its own place).
        """
        name = entry_file(key, suffix, size, rel, space)
        stamp, movable = version_stamp(key), rel is not None
        if not looked_up:
            path = self._find(name, key, stamp, size, movable)
            if path:
                return path, False
        # With a budget, room is held by a temp file under tmp/ whose name carries the size (every
        # process's count sees it), taken without the key's lock: a fill waiting for room must not
        # block another one. Without a budget only the free-disk floor is checked. Everything a fill
        # creates is made through the root's descriptor (layout.anchor): never by path, never via a link.
        tmp = None
        if self.budget() is not None:  # this process's cache_limit, or a smaller one of another live process
            tmp = self.layout.tmp_path(key, size, "part")
        held = self.budget_keeper.reserve(size, tmp or "", may_exceed=may_exceed, on_wait=on_wait)
        keys = self._keys
        try:
            lock = keys.acquire(key)  # one fill per key, machine-wide (a plain pair: it runs per file)
            try:
                path = self._find(name, key, stamp, size, movable)
                if path:
                    return path, False
                # without a budget the copy goes to an unnamed file (O_TMPFILE: a killed process leaves
                # nothing), else (or where there is none) to the named temp file that holds the room
                fd = _open_unnamed(self.layout) if held < 0 else held
                if fd < 0:
                    tmp = self.layout.tmp_path(key, size, "part")
                    fd = held = _create_tmp(self.layout, tmp)
                part = f"/proc/self/fd/{fd}" if _PROC_FD else (tmp or "")
                if progress is not None:
                    progress(lambda: _written(os.fstat(fd)))
                try:
                    n = None if write_fd is None else write_fd(fd)
                    _check_size(write(part) if n is None else n, size)
                    os.utime(fd, ns=(time.time_ns(), stamp))
                    # complete: its name appears in files/ at once (a link), then the temp name goes
                    path = self._place(key, name, movable, fd, part)
                finally:
                    if progress is not None:
                        progress(None)
                    if fd != held:
                        os.close(fd)
            finally:
                keys.release(key, lock)
        finally:
            if held >= 0:
                os.close(held)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(_tmp_rel(tmp), dir_fd=self.layout.anchor())
        return path, True

    def _place(self, key: str, name: str, movable: bool, fd: int, part: str) -> str:
        """Link the complete, stamped copy (open on ``fd``: an unnamed file or the named temp file ``part``) to
        ``files/<name>`` through the root's descriptor, making its folders first, and return its path. Called
        under the key's lock. Where ``name`` holds another version or is blocked by another file's path (a
        file where a folder is needed), a ``movable`` entry goes to :func:`other_version_file` instead. A
        file at the place that claims this version but that lookup did not trust (wrong size or owner) is
        replaced; a folder removed meanwhile (an eviction) is made again."""
        target = name
        root = self.layout.anchor()
        folders = self._folders
        for attempt in range(4):
            rel = _FILES + target
            folder = rel.rpartition("/")[0]
            try:
                if folder not in folders:
                    _make_dirs(root, rel)
                    if len(folders) >= FOLDERS_KEPT:  # a tree of many folders: bounded memory
                        folders.clear()
                    folders.add(folder)
                if _PROC_FD:
                    os.link(f"/proc/self/fd/{fd}", rel, src_dir_fd=root, dst_dir_fd=root, follow_symlinks=True)
                else:  # pragma: no cover - no /proc: the named temp file, by its name under tmp/
                    os.link(_tmp_rel(part), rel, src_dir_fd=root, dst_dir_fd=root, follow_symlinks=False)
                return self._entries + os.sep + target
            except FileNotFoundError:
                folders.clear()
                if attempt == 3:
                    raise
                if os.fstat(root).st_nlink == 0:  # the whole cache directory was removed: made anew
                    root = self.layout.anchor(stale=root)
                with contextlib.suppress(FileExistsError):  # files/ removed, or a folder evicted
                    os.mkdir(_FILES.rstrip("/"), 0o700, dir_fd=root)
            except OSError as e:
                if attempt == 3 or e.errno not in (errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                    raise
                path = self._entries + os.sep + target
                if movable and target == name and not self.claims(path, key):
                    target = other_version_file(key, name)  # another version's place, or blocked
                    continue
                self.removal_token.change()  # an untrusted file of this version: removed
                self.layout.drop_entry(target)
                self.removal_token.change()
        raise AssertionError("unreachable")

    def claims(self, path: str, key: str) -> bool:
        """Whether the file at ``path`` carries the version stamp of ``key`` (a folder or another
        version does not)."""
        try:
            st = os.stat(path)
        except OSError:
            return False
        return _stamped(st, version_stamp(key), self._quantum)

    def remove(self, paths: Iterable[str]) -> int:
        """Delete entries (``paths``: entries' files, as lookups return them). Returns the number removed."""
        n = 0
        self.removal_token.change()
        for p in paths:
            name = self.layout.entry_of(p)
            if name is not None and self.layout.drop_entry(name):
                n += 1
        self.removal_token.change()
        self.budget_keeper.ledger_stale()
        return n

    def remove_unprotected(self, paths: Iterable[str]) -> int:
        """:meth:`remove` of the entries among ``paths`` that no other live process protects (items its
        running loop has not consumed yet stay; this process's own loops are its caller's to judge),
        decided and done under the eviction lock. Returns the number removed."""
        with self.budget_keeper.eviction_lock():
            protected = self.records.protected_names(except_owner=process_tag())
            return self.remove(p for p in paths if (name := self.entry_name(p)) is not None and name not in protected)

    # ------------------------------------------------------------ budget, eviction, accounting (BudgetKeeper)

    def usage(self) -> CacheUsage:
        """Every byte under the cache directory, by kind (entries, protection records, temp files, other)."""
        return self.budget_keeper.scan(self.records.protected_names(reap=False))[1]

    def reap(self) -> dict[str, int]:
        """Drop protection records of dead owners, temp files and half-removed entries of dead writers, and
        entries of the old layout (``data/``) no live process protects. Returns counts."""
        return reap(self.layout, self.records)

    def eviction_lock(self) -> contextlib.AbstractContextManager[None]:
        """The machine-wide lock under which entries are evicted and budgets reserved."""
        return self.budget_keeper.eviction_lock()

    def evict(self, bytes_to_free: int = 0, *, keep_below: int | None = None) -> int:
        """Remove least-recently-used unprotected entries: see :meth:`BudgetKeeper.evict`."""
        return self.budget_keeper.evict(bytes_to_free, keep_below=keep_below)

    def budget(self, *, fresh: bool = False) -> int | None:
        """The byte budget fills honour: the smallest ``cache_limit`` of any live process using this directory
        (``fresh``: read the records now, not the figure of the last second)."""
        return self.budget_keeper.budget(fresh=fresh)

    # ------------------------------------------------------------ whole-cache maintenance

    def clear(self) -> dict[str, int]:
        """Remove every unprotected entry, orphaned record, abandoned temp file and built index (a
        ParquetDataset's row index: built again when next needed). Returns counts."""
        keeper = self.budget_keeper
        with keeper.eviction_lock():
            reaped = self.reap()
            free, _ = keeper.scan(self.records.protected_names(reap=False))
            n = self.remove(p for p, _, _ in free)
            keeper.write_ledger(keeper.scan(set())[1].total_bytes)
            indexes = 0
            with contextlib.suppress(FileNotFoundError):
                for de in os.scandir(self.layout.indexes):  # read whole when opened: safe to unlink under a reader
                    if de.is_file(follow_symlinks=False):
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(de.path)
                            indexes += 1
        return {"entries": n, **reaped, "indexes": indexes}


def _make_dirs(root: int, rel: str) -> None:
    """Make the folders of ``rel`` (``files/...``) under the cache root's descriptor ``root`` (present ones are
    fine), from the deepest up: one failed ``mkdir`` where they exist (the common case: a folder other files
    made). A file in the way is not checked for here: the link that follows fails with ENOTDIR."""
    parts = rel.split("/")[:-1]
    made = len(parts)
    while made > 1:  # find the deepest folder that exists (files/ itself is made by the cache)
        try:
            os.mkdir("/".join(parts[:made]), 0o700, dir_fd=root)
            break
        except FileNotFoundError:
            made -= 1
        except FileExistsError:
            return
    for k in range(made + 1, len(parts) + 1):
        with contextlib.suppress(FileExistsError):  # made meanwhile by another fill
            os.mkdir("/".join(parts[:k]), 0o700, dir_fd=root)


def _stamped(st: os.stat_result, stamp: int, q: int) -> bool:
    """Whether ``st`` is a file whose mtime is the version stamp ``stamp``, to the step ``q`` (ns)
    its file system keeps (:func:`_mtime_quantum`)."""
    return S_ISREG(st.st_mode) and st.st_mtime_ns // q == stamp // q


_QUANTA = (1, 1_000, 1_000_000, 1_000_000_000, 2_000_000_000)


def _mtime_quantum(layout: CacheLayout) -> int:
    """The step (ns) in which the file system of the cache keeps a file's mtime: a probe file under its
    ``tmp/`` is stamped with a time that has odd seconds and nanoseconds, and read back."""
    want = ((1 << STAMP_S_BITS) - 1) * 1_000_000_000 + 987_654_321  # odd seconds, as late as a stamp goes
    fd = _open_unnamed(layout)
    path = None
    if fd < 0:
        path = os.path.join(layout.tmp, f"probe.{process_tag()}.{serial()}.0.part")
        fd = _create_tmp(layout, path)
    try:
        os.utime(fd, ns=(want, want))
        got = os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
        if path is not None:
            with contextlib.suppress(OSError):
                os.unlink(_tmp_rel(path), dir_fd=layout.anchor())
    for q in _QUANTA:
        if got // q == want // q:
            return q
    raise CacheDirError(f"the file system of {layout.tmp} does not keep file times ({want} ns stored, {got} read "
                        "back), which the cache uses to tell file versions apart: set cache_dir= (or "
                        "$UCMAGIC_CACHE_DIR) to a directory on a local disk")


def _written(st: os.stat_result) -> tuple[int, int]:
    """What a fill has written so far: size and allocated blocks (ranged copies write out of order)."""
    return st.st_size, st.st_blocks


def _check_size(n: int, size: int) -> None:
    if n != size:
        raise OSError(errno.EIO, f"copied {n} bytes, the listing says {size}: the file changed while being read")


_PROC_FD = os.path.isdir("/proc/self/fd")  # a descriptor of this process's own has a name there
_unnamed = {"ok": hasattr(os, "O_TMPFILE") and _PROC_FD}
_FILES = "files/"  # entries, relative to the cache root
_TMP = "tmp"


def _tmp_rel(tmp: str) -> str:
    """The name under the cache root of the temp file at ``tmp`` (a :meth:`CacheLayout.tmp_path`)."""
    return _TMP + "/" + os.path.basename(tmp)


def _create_tmp(layout: CacheLayout, tmp: str) -> int:
    """Make the new temp file ``tmp`` (a :meth:`CacheLayout.tmp_path`) through the cache root's descriptor
    (:meth:`CacheLayout.at_root`): never one that exists, never through a link; its descriptor, open for writing."""
    name = _tmp_rel(tmp)
    return layout.at_root(lambda root: os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | os.O_CLOEXEC,
                                               0o600, dir_fd=root))


def _open_unnamed(layout: CacheLayout) -> int:
    """A new unnamed file (``O_TMPFILE``) in ``tmp/`` of the cache root, through its descriptor
    (:meth:`CacheLayout.at_root`: ``tmp/`` or the directory removed by hand is made anew), or -1 where the file
    system has none."""
    if not _unnamed["ok"]:
        return -1
    flags = os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC
    try:
        return layout.at_root(lambda root: os.open(_TMP, flags, 0o600, dir_fd=root))
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            _unnamed["ok"] = False  # e.g. a network file system: a named temp file instead
            return -1
        raise
