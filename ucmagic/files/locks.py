"""Locks shared by threads and processes, and the process identities that own them.

:func:`file_lock` (``flock`` on a file of its own) is the lock every module uses across processes
(epochs, listings, the cache's eviction lock, shard packing); :class:`KeyLocks` are the cache's
per-key single-flight locks; :func:`process_tag` / :func:`tag_alive` name a process so that a later
one reusing its pid is not mistaken for it (records, temp files and journals carry the tag).
"""
from __future__ import annotations

import contextlib
import os
import struct
import threading
from typing import Any, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


@contextlib.contextmanager
def file_lock(path: str, shared: bool = False) -> Iterator[None]:
    """Lock shared by threads and processes: ``flock`` on a file of its own (exclusive by default).

    Each call opens its own descriptor, so threads of one process exclude each other too. A
    blocked caller sleeps in the kernel (no polling, no GIL held).
    """
    if fcntl is None:  # pragma: no cover - not POSIX
        import filelock

        with filelock.FileLock(path):
            yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None) if fcntl is not None else None
_FLOCK_FMT = "hhqqi4x"  # struct flock on Linux (64-bit off_t): type, whence, start, len, pid, padding


def key_offset(key: str) -> int:
    """The byte of the shared fill-lock file that stands for ``key`` (60 bits of its hash)."""
    return int(key[:15], 16)


class KeyLocks:
    """Exclusive per-key locks across threads and processes without a lock file per key.

    Threads of a process wait on an in-process lock per key; processes exclude each other with an
    open-file-description lock on one byte of ``path`` (Linux ``F_OFD_SETLKW``: owned by the
    descriptor, released when it closes, so a killed process holds nothing; no deadlock detection
    to misfire across threads). The file stays empty. Elsewhere: ``flock`` on a file per key prefix.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mu = threading.Lock()
        self._held: dict[str, list[Any]] = {}  # key -> [threading.Lock, users]
        self._fd = -1
        self._pid = 0

    def _file(self) -> int:
        pid = os.getpid()
        if self._pid != pid:  # a forked child shares the parent's description: open its own
            self._fd, self._pid = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600), pid
        return self._fd

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        if _OFD_SETLKW is None:  # pragma: no cover - not Linux
            with file_lock(os.path.join(os.path.dirname(self.path), key[:4] + ".lock")):
                yield
            return
        with self._mu:
            slot = self._held.get(key)
            if slot is None:
                slot = self._held[key] = [threading.Lock(), 0]
            slot[1] += 1
        try:
            with slot[0]:
                fd = self._file()
                off = key_offset(key)
                fcntl.fcntl(fd, _OFD_SETLKW, struct.pack(_FLOCK_FMT, fcntl.F_WRLCK, os.SEEK_SET, off, 1, 0))
                try:
                    yield
                finally:
                    fcntl.fcntl(fd, _OFD_SETLKW, struct.pack(_FLOCK_FMT, fcntl.F_UNLCK, os.SEEK_SET, off, 1, 0))
        finally:
            with self._mu:
                slot[1] -= 1
                if not slot[1]:
                    del self._held[key]


# ---------------------------------------------------------------- process identities

def pid_running(pid: int) -> bool:
    """True when process ``pid`` exists on this machine (someone else's counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def _start_time(pid: int, fields: list[bytes] | None = None) -> int:
    """Start time of ``pid`` in clock ticks since boot (``/proc``; ``fields``: its stat already read),
    else via psutil in ms; 0 if unknown."""
    fields = fields if fields is not None else _proc_stat(pid)
    if fields is not None and len(fields) > 19 and fields[19].isdigit():
        return int(fields[19])
    try:
        import psutil

        return int(psutil.Process(pid).create_time() * 1000)
    except Exception:  # noqa: BLE001 - any failure means: start time unknown (identity falls back to the pid)
        return 0


_tags: dict[int, str] = {}


def process_tag(pid: int | None = None) -> str:
    """``"<pid>-<start time>"``: a process identity that a later process reusing the pid does not share."""
    pid = os.getpid() if pid is None else pid
    tag = _tags.get(pid)
    if tag is None:
        tag = _tags[pid] = f"{pid}-{_start_time(pid)}"
    return tag


def tag_alive(tag: str) -> bool:
    """True while the process named by a :func:`process_tag` is running (the same process, not a reuse)."""
    try:
        pid_s, start_s = tag.split("-", 1)
        pid = int(pid_s)
    except ValueError:
        return False
    if not pid_running(pid):
        return False
    fields = _proc_stat(pid)
    if fields is not None and fields and fields[0] in (b"Z", b"X"):
        return False  # exited, not yet reaped by its parent (in a container without an init, never)
    return start_s == "0" or str(_start_time(pid, fields)) == start_s
