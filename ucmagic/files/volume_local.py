"""The built-in backend for local and mounted directories (``/Volumes/...``, NFS, FUSE): :class:`LocalVolume`."""
from __future__ import annotations

import builtins  # `list` in Volume annotations is the method
import os
import re
import stat as stat_mod
import time
from collections import deque
from functools import cached_property
from typing import Any, Iterator

from . import ranged
from .._util import (FILL_BUFFER, LOCAL_DISK_FS, DaemonPool, copy_fds, mount_fs_type, open_emptied, path_under,
                     wait_result)
from .locks import refuse_links_below
from ..errors import SourceNotADirectoryError, UnreadableDirectoryError, UnsafeSourceError
from .entries import DirScan, FileEntry, compile_pattern, filter_entries
from .local_files import (FdReader, local_names, local_put, local_remove, local_remove_tree, local_rename,
                          open_beneath, opened_beneath, writable_rel)
from .local_paths import existing_local
from .volume_base import Volume, check_unchanged


# A directory read faster than this (seconds: a fixed part plus one per entry) is "local and
# cached": the listing goes on reading on one thread, as threads contending for the GIL cost more
# than they save there. The first slower one (a network mount, an uncached disk) starts the pool.
FAST_DIR_S, FAST_ENTRY_S = 0.002, 20e-6


class LocalVolume(Volume):
    """A local or mounted directory (NFS, FUSE, ``/Volumes/...``)."""

    keeps_dir_mtimes = True

    atomic_rename = True

    def __init__(self, root: str, *, list_threads: int = 16) -> None:
        self.root = root
        self.local_root = root
        self.uri = "file://" + root
        self.list_threads = list_threads

    def __reduce__(self) -> tuple[Any, ...]:
        return (LocalVolume, (self.root,), {"list_threads": self.list_threads, **self._tuning()})

    @cached_property
    def local_disk(self) -> bool:
        """True where the directory lies on a disk file system of this machine (ext4, xfs, tmpfs...)
        and reads are this class's own plain copies; False on FUSE (``/Volumes``, the simulator), NFS,
        SMB, where the mount table is unknown, and for a subclass that copies its own way (it may
        wait on something else: it says so by setting ``local_disk`` itself)."""
        if type(self).copy_to is not LocalVolume.copy_to:
            return False
        return mount_fs_type(self.root) in LOCAL_DISK_FS

    @classmethod
    def from_path(cls, path: str, storage_options: dict[str, Any] | None = None) -> Volume:
        """A directory, ``/Volumes/...`` path (see :func:`resolve_local_path`) or ``file://`` URL."""
        if path.startswith("file://"):
            path = path[len("file://"):]
        real, is_dir = existing_local(path)
        if not is_dir:
            raise SourceNotADirectoryError(f"{path} is a file, not a directory: pass the directory that holds "
                                           "your files (use pattern= to pick some)")
        return cls(real)

    def display(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _scan_dir(self, rel: str, rx: re.Pattern[str] | None = None) -> tuple[list[FileEntry], list[str], int]:
        """One directory: its files (only those ``rx`` matches: the others are never stat-ed, which on a
        network mount is a round trip each), its folders and its mtime."""
        files: list[FileEntry] = []
        dirs: list[str] = []
        outside: builtins.list[str] = self.__dict__.setdefault("_outside_links", [])  # left out, reported by scan()
        where = os.path.join(self.root, rel) if rel else self.root
        try:
            mtime_ns = os.stat(where).st_mtime_ns  # before reading: a file added meanwhile changes it later
            with os.scandir(where) as it:
                for de in it:
                    name = de.name if not rel else rel + "/" + de.name
                    try:
                        if de.is_dir(follow_symlinks=False):
                            if name not in self.skip_dirs:
                                dirs.append(name)
                            continue
                        if rx is not None and not rx.match(name):
                            continue
                        st = de.stat()  # follows a symlink to a file; a dangling one raises
                        if stat_mod.S_ISREG(st.st_mode) and de.is_symlink() \
                                and not link_allowed(de.path, self.root, self.follow_symlinks):
                            outside.append(name)
                            continue
                    except OSError:
                        continue
                    if stat_mod.S_ISREG(st.st_mode):
                        files.append(FileEntry(name, st.st_size, st.st_mtime))
        except PermissionError as exc:
            if self.unreadable == "skip" and rel:
                import warnings

                warnings.warn(f"ucmagic: skipped directory {where} while listing: it cannot be read "
                              f"({exc.strerror})", stacklevel=2)
                return [], [], 0
            raise UnreadableDirectoryError(
                f"cannot read directory {where} while listing {self.root} ({exc.strerror}): give yourself read "
                "access to it, or pass on_error='skip' to leave it out") from exc
        return files, dirs, mtime_ns

    def scan(self, pattern: str | None = None) -> Iterator[DirScan]:
        """Directories yielded as read: on this thread while they read fast, then concurrently
        (each readdir on a network mount is slow) from the first slow one on. Symlinked files are
        listed per :attr:`follow_symlinks`; those left out are reported once, at the end."""
        self.__dict__["_outside_links"] = []
        yield from self._scan(pattern)
        report_outside_links(self.__dict__.pop("_outside_links", None) or [], self.root, self.follow_symlinks,
                             self.outside_links)

    def _scan(self, pattern: str | None = None) -> Iterator[DirScan]:
        rx = compile_pattern(pattern) if pattern else None
        todo = [""]  # directories found, not yet read

        def found(rel: str, got: list[FileEntry], dirs: list[str], mtime_ns: int) -> DirScan:
            todo.extend(dirs)
            return DirScan(rel, mtime_ns, got)  # got: only the files rx matches (_scan_dir)

        while todo:  # on this thread while directories read fast (200,000 local files listed in 3 s, not 8)
            d = todo.pop()
            t0 = time.perf_counter()
            got, dirs, mtime_ns = self._scan_dir(d, rx)
            slow = time.perf_counter() - t0 > FAST_DIR_S + FAST_ENTRY_S * (len(got) + len(dirs))
            yield found(d, got, dirs, mtime_ns)
            if slow and self.list_threads > 1:
                break
        if not todo:
            return
        pending: deque[tuple[str, Any]] = deque()
        ahead = 4 * self.list_threads  # bounded: results waiting for a slow consumer hold memory
        pool = DaemonPool(self.list_threads, "ucmagic-list")  # never joined: a hung readdir does not block exit
        try:
            while todo or pending:
                while todo and len(pending) < ahead:
                    d = todo.pop()
                    pending.append((d, pool.submit(self._scan_dir, d, rx)))
                rel, fut = pending.popleft()
                yield found(rel, *wait_result(fut))  # timed steps: Ctrl-C interrupts at once
        finally:
            for _, fut in pending:
                fut.cancel()
            pool.shutdown(wait=False)

    def list(self, pattern: str | None = None) -> list[FileEntry]:
        """Recursive listing (directories read as :meth:`scan` does)."""
        files: list[FileEntry] = []
        for d in self.scan(pattern):
            files.extend(d.files)
        return self._check_listing(filter_entries(files, pattern), pattern)

    def stat(self, rel: str) -> FileEntry:
        st = os.stat(os.path.join(self.root, rel))
        return FileEntry(rel, st.st_size, st.st_mtime)

    def copy_to(self, rel: str, dest: str, *, expect: FileEntry | None = None) -> int:
        if expect is not None and expect.size >= self.range_threshold:
            return self.ranged_copy(rel, dest, expect)
        fsrc = open_checked(self, rel)  # before the destination is made: a missing source leaves no file
        try:
            fdst = open_emptied(dest)
            try:
                return self._copy_fds(rel, fsrc, fdst, expect)
            finally:
                os.close(fdst)
        finally:
            os.close(fsrc)

    def copy_into(self, rel: str, fd: int, *, expect: FileEntry | None = None) -> int | None:
        if expect is not None and expect.size >= self.range_threshold:
            return None  # ranged copies write by path, on several threads
        fsrc = open_checked(self, rel)
        try:
            return self._copy_fds(rel, fsrc, fd, expect)
        finally:
            os.close(fsrc)

    def _copy_fds(self, rel: str, fsrc: int, fdst: int, expect: FileEntry | None) -> int:
        """Copy the open source ``fsrc`` of ``rel`` to ``fdst`` (the one local copy loop: copy_fds), then
        check the file this descriptor read against ``expect`` (a rename over it mid-copy leaves it intact).
        The source's descriptor is ours: checked when opened (open_checked), fstat-ed after the copy."""
        n = copy_fds(fsrc, fdst, size=None if expect is None else expect.size, buffer_size=FILL_BUFFER)[0]
        if expect is not None:
            st = os.fstat(fsrc)
            check_unchanged(self, expect, FileEntry(rel, st.st_size, st.st_mtime))
        return n

    def range_reader(self, rel: str) -> ranged.RangeReader:
        return FdReader(self._path(rel), fd=open_checked(self, rel))

    def open_local(self, rel: str) -> int | None:
        return None if self.local_file(rel) is None else open_checked(self, rel)

    @property
    def checks_native_opens(self) -> bool:
        return type(self).open_local is LocalVolume.open_local  # a subclass that opens its own way: through it

    def opened_as_checked(self, rel: str, fd: int) -> bool:
        return self.checks_native_opens and opened_beneath(fd, real_root(self), rel, self.follow_symlinks)

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def local_file(self, rel: str) -> str | None:
        return self._path(rel)

    def _target(self, rel: str, *, whole: bool = False) -> str:
        """The local path of ``rel`` to write or remove: refused (:class:`UnsafeDirectoryError`) when a
        folder on the way from the root (and ``rel`` itself with ``whole``) is a symbolic link, which
        could send the write anywhere (a checkpoint or export root others could write to). The last
        component of a file is replaced by a rename, never followed."""
        refuse_links_below(self.root, writable_rel(rel), whole=whole)
        return self._path(rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        local_put(self._target(rel), data)

    def upload(self, local_path: str, rel: str) -> None:
        local_put(self._target(rel), src=local_path)

    def read_bytes(self, rel: str) -> bytes:
        with open(open_checked(self, rel), "rb") as f:
            return f.read()

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._path(rel))

    def makedirs(self, rel: str) -> None:
        os.makedirs(self._target(rel, whole=True) if rel else self.root, exist_ok=True)

    def remove(self, rel: str, *, missing_ok: bool = True) -> None:
        local_remove(self._target(rel), missing_ok)

    def remove_tree(self, rel: str) -> None:
        local_remove_tree(self._target(rel))

    def rename(self, src_rel: str, dst_rel: str) -> None:
        local_rename(self._target(src_rel), self._target(dst_rel))

    def list_names(self, rel: str) -> builtins.list[str]:
        return local_names(self._path(rel))


def open_checked(vol: LocalVolume, rel: str) -> int:
    """A read descriptor of ``rel`` of ``vol``, checked as the listing checked it (:attr:`Volume.follow_symlinks`):
    under ``"inside"`` the file actually opened must lie inside the root (:func:`open_beneath`), on every copy."""
    return open_beneath(real_root(vol), rel, vol.follow_symlinks)


def real_root(vol: LocalVolume) -> str:
    """``vol``'s root with every link in its own path resolved (what an opened file lies under), kept."""
    root = vol.__dict__.get("_real_root")
    if root is None:
        root = vol.__dict__["_real_root"] = os.path.realpath(vol.root)
    return root


def link_allowed(path: str, root: str, follow_symlinks: str) -> bool:
    """Whether the symlinked file at ``path`` is listed under ``follow_symlinks`` (:attr:`Volume.follow_symlinks`)."""
    if follow_symlinks == "all":
        return True
    if follow_symlinks == "none":
        return False
    return path_under(path, root) not in (None, ".")


def report_outside_links(links: list[str], root: str, follow_symlinks: str, outside_links: str) -> None:
    """One warning (or :class:`UnsafeSourceError` where ``outside_links == "raise"``) for the symlinks a listing
    of ``root`` left out because they point outside it, naming them."""
    links = sorted(links)
    if not links or follow_symlinks == "none":
        return
    named = ", ".join(links[:5]) + (f" and {len(links) - 5} more" if len(links) > 5 else "")
    msg = (f"{len(links)} symlink(s) in {root} point outside it and were left out: {named}. "
           "Pass follow_symlinks='all' if you trust this tree")
    if outside_links == "raise":
        raise UnsafeSourceError(msg + ", or on_error='skip' to leave them out")
    import warnings

    warnings.warn("ucmagic: " + msg, stacklevel=3)
