"""Atomic local writes and reads under a volume root (shared by :class:`LocalVolume` and fsspec volumes of local
files): whole-or-nothing puts, removes, renames synced in their folder, a ranged read stream, and the one checked
open of a file beneath a root (:func:`open_beneath`: a source is checked when it is opened, not only when listed)."""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import shutil

from .._util import O_NOFOLLOW, atomic_target, atomic_write, copy_local, fsync_dir
from ..errors import UnsafeSourceError
from .entries import is_safe_rel


def writable_rel(rel: str) -> str:
    """``rel`` itself when it names something under the root (never the root, never outside it)."""
    if not is_safe_rel(rel):
        raise ValueError(f"{rel!r} is not a relative path under the volume root (no '..', '.' or empty parts)")
    return rel


def local_put(path: str, data: bytes | None = None, *, src: str | None = None) -> None:
    """Write ``data`` (or copy the local file ``src``) to a synced temp file beside ``path``, rename it
    over ``path`` and sync the folder (created if needed): ``path`` appears whole or not at all, and a
    failed write leaves nothing."""
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
    if src is None:
        atomic_write(path, data or b"", sync=True)
    else:
        with atomic_target(path) as tmp:
            copy_local(src, tmp, sync=True)
    fsync_dir(folder)


def local_remove(path: str, missing_ok: bool) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


def local_remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
    except NotADirectoryError:
        local_remove(path, True)
    except FileNotFoundError:
        pass


def local_rename(src: str, dst: str) -> None:
    folder = os.path.dirname(dst)
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
    os.replace(src, dst)
    fsync_dir(folder)
    if os.path.dirname(src) != folder:
        fsync_dir(os.path.dirname(src))


def local_names(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


class FdReader:
    """A read stream on a local or mounted file: its own descriptor (``fd``: one opened for it, which it
    closes), ``os.preadv`` at each offset."""

    def __init__(self, path: str, fd: int | None = None) -> None:
        self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC) if fd is None else fd

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        return os.preadv(self.fd, [buf], offset)

    def close(self) -> None:
        os.close(self.fd)


# ---------------------------------------------------------------- the checked open of a source file

_RESOLVE_NO_SYMLINKS = 0x04  # openat2(2): fail (ELOOP) on a symbolic link anywhere in the path


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def _openat2() -> object | None:
    """The ``syscall`` function for ``openat2(AT_FDCWD, path, how)`` (Linux 5.6+, where its number is the
    generic one), else None: then :func:`open_beneath` checks each open with a ``readlink``."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "aarch64", "arm64", "riscv64"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    fn.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t]
    return fn


_OPENAT2: list[object] = []  # [the syscall function, or None], probed on first use
_HOW: dict[int, _OpenHow] = {}  # open flags -> its open_how (read-only once made: shared by threads)
_HOW_SIZE = ctypes.sizeof(_OpenHow)
_AT_FDCWD, _SYS_OPENAT2 = -100, 437


def _open_no_links(path: str, flags: int) -> int:
    """A descriptor of ``path`` (``flags``) with no symbolic link followed anywhere on it: ``openat2`` (one system
    call, as ``open``), or -1 where the kernel has none (ENOSYS, or refused by a seccomp filter). A link
    on the way raises ``OSError(ELOOP)``."""
    if not _OPENAT2:
        _OPENAT2.append(_openat2())
    fn = _OPENAT2[0]
    if fn is None:
        return -1
    how = _HOW.get(flags)
    if how is None:
        how = _HOW.setdefault(flags, _OpenHow(flags, 0, _RESOLVE_NO_SYMLINKS))
    fd = int(fn(_SYS_OPENAT2, _AT_FDCWD, os.fsencode(path), ctypes.addressof(how), _HOW_SIZE))  # type: ignore[operator]
    if fd >= 0:
        return fd
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EPERM, errno.E2BIG):  # no openat2 here: check each open after it instead
        _OPENAT2[0] = None
        return -1
    raise OSError(err, os.strerror(err), path)


def open_beneath(root: str, rel: str, follow_symlinks: str = "inside", *, flags: int = 0) -> int:
    """A read descriptor of the file ``rel`` under the local directory ``root`` (a real path: no link in it),
    checked when it is opened, as a listing checks it: ``"inside"`` (the default) opens it only when the file
    actually opened lies under ``root`` (a file swapped for a link to elsewhere after the listing, or a folder
    on the way swapped for one, is refused), ``"none"`` only when no link is on the way, ``"all"`` follows
    every link. Else :class:`~ucmagic.errors.UnsafeSourceError` naming it.

    The common case (no link) costs one system call, as a plain ``open``: ``openat2`` with no link followed.
    A link inside the tree is followed, then the descriptor's own path (``/proc/self/fd``) must lie under
    ``root``; where ``openat2`` is missing every open is checked that way. ``flags`` are added to
    ``O_RDONLY | O_CLOEXEC`` (``O_NONBLOCK``: a FIFO put there does not block the open)."""
    path = root + "/" + rel if rel else root
    flags |= os.O_RDONLY | os.O_CLOEXEC
    if follow_symlinks == "all":
        return os.open(path, flags)
    try:
        fd = _open_no_links(path, flags)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        fd = -2  # a link on the way
    if fd >= 0:
        return fd
    if fd == -1:  # no openat2: a link at the final name shows as ELOOP here, one on the way only after
        try:
            fd = os.open(path, flags | O_NOFOLLOW)
            if _opened_under(fd, root, path):
                return fd
            os.close(fd)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
    if follow_symlinks == "none":
        raise UnsafeSourceError(f"ucmagic will not read {path}: a symbolic link is on its way and "
                                "follow_symlinks='none'; pass follow_symlinks='inside' or 'all' to follow links")
    fd = os.open(path, flags)
    if not _opened_under(fd, root, path):
        where = _fd_path(fd)
        os.close(fd)
        raise UnsafeSourceError(f"ucmagic will not read {path}: it resolves to {where}, outside {root} (a link "
                                "there, or on its way, points out of the tree: was it swapped after the listing?); "
                                "pass follow_symlinks='all' if you trust this tree")
    return fd


def opened_beneath(fd: int, root: str, rel: str, follow_symlinks: str = "inside") -> bool:
    """Whether ``fd``, opened by name on ``root/rel`` with every link followed (an engine's own open, e.g.
    ``pyarrow.OSFile``), is a file :func:`open_beneath` would have opened: under ``"inside"`` the file
    the kernel opened lies under ``root`` (a real path), under ``"none"`` it is ``root/rel`` itself (no link
    on the way resolves to its own name), ``"all"`` any. Only the descriptor's own path (``/proc``) counts:
    where there is none, False (open with :func:`open_beneath` instead)."""
    if follow_symlinks == "all":
        return True
    where = _fd_path(fd)
    if where == "?":
        return False
    if follow_symlinks == "none":
        return where == (root + "/" + rel if rel else root)
    return _lies_under(where, root)


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return "?"


def _opened_under(fd: int, root: str, path: str) -> bool:
    """Whether the file open on ``fd`` lies under ``root``: its path as the kernel resolved it (``/proc``), or,
    where there is no ``/proc``, ``path`` resolved now."""
    where = _fd_path(fd)
    if where == "?":
        where = os.path.realpath(path)
    return _lies_under(where, root)


def _lies_under(where: str, root: str) -> bool:
    """Whether the resolved path ``where`` lies under the real path ``root``."""
    return where.startswith(root.rstrip("/") + "/")
