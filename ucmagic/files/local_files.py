"""Atomic local writes and reads under a volume root (shared by :class:`LocalVolume` and fsspec volumes of local
files): whole-or-nothing puts, removes, renames synced in their folder, and a ranged read stream."""
from __future__ import annotations

import os
import shutil

from .._util import atomic_target, atomic_write, copy_local, fsync_dir
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
    """A read stream on a local or mounted file: its own descriptor, ``os.preadv`` at each offset."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        return os.preadv(self.fd, [buf], offset)

    def close(self) -> None:
        os.close(self.fd)
