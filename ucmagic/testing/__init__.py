"""A slow-volume simulator for tests, demos and benchmarks.

Two forms, same knobs (per-open latency, per-stream bandwidth, listing latency, every Nth open fails):

* ``slow://`` — an fsspec filesystem over a local directory, in-process, no privileges needed::

      UCVolumeDataset("slow:///data/train", storage_options={"open_ms": 20, "mbps": 200})

* :func:`mount_slow_volume` — a real FUSE mount (needs ``fuse3`` and ``mfusepy``), for benchmarks
  that must treat every reader, including other libraries, the same way.

Plus :func:`make_files`, which writes a tree of small files with deterministic content.
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

from fsspec.implementations.local import LocalFileOpener, LocalFileSystem

from ..files.volume import FsspecVolume, register_volume


class _Faults:
    """Counts opens across a process; every Nth one fails with EIO."""

    def __init__(self) -> None:
        self.mu = threading.Lock()
        self.opens = 0

    def should_fail(self, every: int) -> bool:
        if not every:
            return False
        with self.mu:
            self.opens += 1
            return self.opens % every == 0


_faults = _Faults()


class _ThrottledFile:
    """A read-only file whose reads are paced to ``bps`` bytes per second."""

    def __init__(self, f: Any, bps: float) -> None:
        self._f = f
        self._bps = bps

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        if self._bps and data:
            time.sleep(len(data) / self._bps)
        return data

    def readinto(self, b: Any) -> int:
        n = self._f.readinto(b)
        if self._bps and n:
            time.sleep(n / self._bps)
        return n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def __enter__(self) -> "_ThrottledFile":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._f)


class SlowFileSystem(LocalFileSystem):
    """fsspec ``slow://``: a local directory with the latency and bandwidth of remote storage.

    Storage options: ``open_ms`` (wait per open, default 20), ``mbps`` (read bandwidth per stream,
    MB/s, default 200, 0 = unlimited), ``list_ms`` (wait per listing, default 50), ``fail_every``
    (every Nth open in this process raises EIO, default 0 = never) and ``slow_files``
    (``{name substring: extra ms per open}``: a straggler file to find in the explorer).
    """

    protocol = ("slow",)
    root_marker = "/"

    def __init__(self, open_ms: float = 20.0, mbps: float = 200.0, list_ms: float = 50.0,
                 fail_every: int = 0, slow_files: dict[str, float] | None = None, **kw: Any) -> None:
        super().__init__(**kw)
        self.slow_files = dict(slow_files or {})
        self.open_s = open_ms / 1000.0
        self.bps = mbps * 1e6
        self.list_s = list_ms / 1000.0
        self.fail_every = int(fail_every)

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        if path.startswith("slow://"):
            path = path[len("slow://"):]
        return super()._strip_protocol(path)

    def unstrip_protocol(self, name: str) -> str:
        return "slow://" + name

    def ls(self, path: str, detail: bool = True, **kw: Any) -> list[dict[str, Any]] | list[str]:
        time.sleep(self.list_s)
        return super().ls(path, detail=detail, **kw)

    def _open(self, path: str, mode: str = "rb", **kw: Any) -> LocalFileOpener | _ThrottledFile:
        time.sleep(self.open_s + sum(ms for k, ms in self.slow_files.items() if k in path) / 1000.0)
        if _faults.should_fail(self.fail_every):
            raise OSError(errno.EIO, f"injected I/O error opening {path}")
        f = super()._open(path, mode=mode, **kw)
        return _ThrottledFile(f, self.bps) if "r" in mode and self.bps else f


class SlowVolume(FsspecVolume):
    """The simulator as a volume backend, and the worked example of docs/backends.md: one class, one
    :func:`~ucmagic.files.volume.register_volume` call. ``slow://<local dir>`` reads through
    :class:`SlowFileSystem` (storage options as there); listing, ranged copies and the write side
    (local files: temp file and rename) are :class:`~ucmagic.files.volume.FsspecVolume`'s. fsspec finds
    ``slow://`` through the entry point in pyproject.toml (volume.py registers it where that is missing)."""


register_volume("slow", SlowVolume)


def make_files(root: str, n: int = 100, size: int = 4096, *, depth: int = 2, per_dir: int = 50,
               ext: str = ".bin", seed: int = 0) -> list[str]:
    """Write ``n`` files of ``size`` bytes under ``root`` in nested folders; return relative paths.

    Each file's content starts with its own relative path, so a test can check that it read the
    right file, and the rest is deterministic pseudo-random bytes.
    """
    import random

    rng = random.Random(seed)  # noqa: S311 - reproducible test data, not security
    paths = []
    for i in range(n):
        group = i // per_dir
        parts = [f"part{group % 4}"] * max(0, depth - 1) + ([f"g{group:04d}"] if depth > 0 else [])
        rel = "/".join(parts + [f"f{i:06d}{ext}"])
        full = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        head = rel.encode() + b"\n"
        body = rng.randbytes(max(0, size - len(head))) if size > len(head) else b""
        with open(full, "wb") as f:
            f.write((head + body)[:size])
        paths.append(rel)
    return paths


# ---------------------------------------------------------------- FUSE mount (benchmarks)

def fuse_available() -> bool:
    """True when a FUSE mount can be made here (``/dev/fuse``, ``fusermount3`` and ``mfusepy``)."""
    import shutil

    try:
        import mfusepy  # noqa: F401
    except ImportError:
        return False
    return os.path.exists("/dev/fuse") and shutil.which("fusermount3") is not None


@contextlib.contextmanager
def mount_slow_volume(source: str, mountpoint: str, *, open_ms: float = 20, mbps: float = 200,
                      list_ms: float = 50, fail_every: int = 0, timeout: float = 20) -> Iterator[str]:
    """Mount ``source`` at ``mountpoint`` through FUSE with remote-storage latency; unmount on exit."""
    try:
        import mfusepy  # noqa: F401 - the mount runs in a child process; fail here with the fix
    except ImportError as exc:
        raise ImportError("mount_slow_volume needs mfusepy and the fuse3 system package: "
                          "pip install 'ucmagic[fuse]' and apt-get install fuse3") from exc
    try:
        os.stat(mountpoint)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:  # a dead FUSE server's mount left behind: detach it first
            _fusermount("-uz", mountpoint)
    os.makedirs(mountpoint, exist_ok=True)
    cmd = [sys.executable, "-m", "ucmagic.testing.slowfuse", source, mountpoint, "--open-ms", str(open_ms),
           "--mbps", str(mbps), "--list-ms", str(list_ms), "--fail-every", str(fail_every)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # noqa: S603 - our own module, fixed argv
    deadline = time.monotonic() + timeout
    try:
        while not os.path.ismount(mountpoint):
            if proc.poll() is not None:
                err = proc.stderr.read() if proc.stderr is not None else b""
                raise RuntimeError(f"FUSE mount of {source} failed: {err.decode(errors='replace')}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"FUSE mount at {mountpoint} did not appear within {timeout} s")
            time.sleep(0.05)
        yield mountpoint
    finally:
        busy = _fusermount("-u", mountpoint) != 0
        if busy:  # files still open under it (a leaked descriptor): detach now, the kernel ends it at their close
            _fusermount("-uz", mountpoint)
        try:
            proc.wait(timeout=1 if busy else 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _fusermount(flag: str, mountpoint: str) -> int:
    return subprocess.run(["fusermount3", flag, mountpoint], check=False,  # noqa: S603,S607 - the FUSE unmount tool, found on PATH as libfuse installs it
                          capture_output=True).returncode
