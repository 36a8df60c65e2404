"""FUSE server behind :func:`ucmagic.testing.mount_slow_volume` (run as ``python -m ucmagic.testing.slowfuse``).

Pass-through to a source directory, read-write, with waits that cost no CPU: a wait on each open
(and create/unlink/rename/mkdir), per-stream bandwidth pacing on read and write, a wait per
directory listing, and optional EIO on every Nth open.
"""
from __future__ import annotations

import argparse
import errno
import os
import threading
import time

import mfusepy as fuse

_STAT_KEYS = ("st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink", "st_size", "st_uid")
_STATFS_KEYS = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
                "f_frsize", "f_namemax")


class Slow(fuse.Operations):
    def __init__(self, root: str, open_ms: float, mbps: float, list_ms: float, fail_every: int) -> None:
        self.root = os.path.realpath(root)
        self.wait_open = open_ms / 1e3
        self.wait_list = list_ms / 1e3
        self.bps = mbps * 1e6
        self.fail_every = fail_every
        self.count = 0
        self.mu = threading.Lock()

    def _real(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def _pace(self, n: int) -> None:
        if self.bps:
            time.sleep(n / self.bps)

    def getattr(self, path: str, fh: int | None = None) -> dict[str, float]:
        try:
            st = os.lstat(self._real(path))
        except FileNotFoundError:
            raise fuse.FuseOSError(errno.ENOENT) from None
        return {k: getattr(st, k) for k in _STAT_KEYS}

    def readdir(self, path: str, fh: int) -> list[str]:
        time.sleep(self.wait_list)
        return [".", "..", *os.listdir(self._real(path))]

    def statfs(self, path: str) -> dict[str, int]:
        sv = os.statvfs(self._real(path))
        return {k: getattr(sv, k) for k in _STATFS_KEYS}

    def open(self, path: str, flags: int) -> int:
        time.sleep(self.wait_open)
        if self.fail_every:
            with self.mu:
                self.count += 1
                failing = self.count % self.fail_every == 0
            if failing:
                raise fuse.FuseOSError(errno.EIO)
        return os.open(self._real(path), flags)

    def create(self, path: str, mode: int, fi: object = None) -> int:
        time.sleep(self.wait_open)
        return os.open(self._real(path), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        data = os.pread(fh, size, offset)
        self._pace(len(data))
        return data

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._pace(len(data))
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> None:
        os.truncate(self._real(path), length)

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        os.fsync(fh)
        return 0

    def unlink(self, path: str) -> None:
        time.sleep(self.wait_open)
        os.unlink(self._real(path))

    def mkdir(self, path: str, mode: int) -> None:
        time.sleep(self.wait_open)
        os.mkdir(self._real(path), mode)

    def rmdir(self, path: str) -> None:
        os.rmdir(self._real(path))

    def rename(self, old: str, new: str) -> None:
        time.sleep(self.wait_open)
        os.replace(self._real(old), self._real(new))

    def chmod(self, path: str, mode: int) -> None:
        os.chmod(self._real(path), mode)

    def utimens(self, path: str, times: tuple[float, float] | None = None) -> None:
        os.utime(self._real(path), times)


def main() -> None:
    ap = argparse.ArgumentParser(description="slow FUSE pass-through volume")
    ap.add_argument("source")
    ap.add_argument("mountpoint")
    ap.add_argument("--open-ms", type=float, default=20.0)
    ap.add_argument("--mbps", type=float, default=200.0)
    ap.add_argument("--list-ms", type=float, default=50.0)
    ap.add_argument("--fail-every", type=int, default=0)
    a = ap.parse_args()
    # libfuse 3 serves only 10 requests at once unless told otherwise: a network mount serves many.
    opts = dict(foreground=True, nothreads=False, allow_other=True, default_permissions=False, max_threads=1024)
    if fuse.fuse_version_major == 2:
        opts.update(big_writes=True, max_write=1 << 20)
    fuse.FUSE(Slow(a.source, a.open_ms, a.mbps, a.list_ms, a.fail_every), a.mountpoint, **opts)


if __name__ == "__main__":
    main()
