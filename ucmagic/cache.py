"""The persistent, machine-wide file cache.

Layout under the cache root (private to the user, mode 0700)::

    data/<k0k1>/<key><.ext>   cached copies, named by a hash of (volume, path, size, mtime)
    tmp/                      fills in progress (renamed into data/ when complete)
    locks/<k0k1k2k3>.lock     single-flight locks (flock, shared by threads and processes)
    pins/<pid>-<start>/...    hard links to entries handed to a training loop and not yet consumed

Guarantees: a file in ``data/`` is always complete (temp file + rename); one fill per file even
with many threads and processes asking at once; a changed source file (size or mtime) gets a new
key and is fetched again; eviction is least-recently-used, skips pinned entries, and never lets
the disk go below its free-space floor. A path handed out is a pin (a hard link), so it keeps
existing until released even if the entry is evicted meanwhile.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


from .errors import CacheFullError, UnsafeCacheError
from .units import format_size, parse_size

DEFAULT_MIN_FREE = 0.10
PIN_GRACE_S = 600.0  # pins of an exited process are kept this long (its consumer may still hold paths)
_SUFFIX_RE = re.compile(r"\.[A-Za-z0-9_\-]{1,16}$")


# ---------------------------------------------------------------- locking

@contextlib.contextmanager
def file_lock(path: str) -> Iterator[None]:
    """Exclusive lock shared by threads and processes: ``flock`` on a file of its own.

    Each call opens its own descriptor, so threads of one process exclude each other too. A
    blocked caller sleeps in the kernel (no polling, no GIL held). This is the fill path's hot
    spot: filelock costs ~1 ms of CPU per acquire/release here, this ~20 us.
    """
    if fcntl is None:  # pragma: no cover - not POSIX
        import filelock

        with filelock.FileLock(path):
            yield
        return
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# ---------------------------------------------------------------- pure helpers

def cache_key(volume_uri: str, rel: str, size: int, mtime: float) -> str:
    """Key of one source file version. Names never reach the filesystem, only this hash does."""
    h = hashlib.sha256()
    h.update(f"{volume_uri}\0{rel}\0{size}\0{mtime!r}".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:40]


def safe_suffix(rel: str) -> str:
    """The file's extension if it is short and plain (kept so decoders can sniff by extension)."""
    m = _SUFFIX_RE.search(rel.rsplit("/", 1)[-1])
    return m.group(0) if m else ""


def choose_victims(entries: Iterable[tuple[str, int, float]], bytes_to_free: int) -> list[str]:
    """LRU choice: the oldest (by last use) unpinned entries whose sizes add up to ``bytes_to_free``.

    ``entries`` are ``(path, size, last_used)`` of unpinned entries only.
    """
    victims: list[str] = []
    freed = 0
    for path, size, _ in sorted(entries, key=lambda e: e[2]):
        if freed >= bytes_to_free:
            break
        victims.append(path)
        freed += size
    return victims


def default_cache_dir() -> str:
    """``$UCMAGIC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ucmagic``, else ``~/.cache/ucmagic``."""
    env = os.environ.get("UCMAGIC_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ucmagic")


def _process_tag(pid: int) -> str:
    try:
        import psutil

        return f"{pid}-{int(psutil.Process(pid).create_time() * 1000)}"
    except Exception:
        return f"{pid}-0"


def _owner_alive(tag: str) -> bool:
    try:
        pid_s, start_s = tag.split("-", 1)
        pid = int(pid_s)
    except ValueError:
        return False
    try:
        import psutil

        if not psutil.pid_exists(pid):
            return False
        return start_s == "0" or str(int(psutil.Process(pid).create_time() * 1000)) == start_s
    except Exception:
        return True  # cannot tell: keep its pins


@dataclass
class CacheUsage:
    files: int
    bytes: int
    pinned_files: int
    pinned_bytes: int


class FileCache:
    """A directory of complete cached files shared by every process of the user on this machine.

    Args:
        root: cache directory; default :func:`default_cache_dir`.
        limit: byte budget (int or "50GB"); ``None`` means bounded only by the free-space floor.
        min_free: fraction of the disk always left free (default 10%).
    """

    def __init__(self, root: str | None = None, limit: int | str | None = None, min_free: float = DEFAULT_MIN_FREE) -> None:
        self.root = os.path.abspath(os.path.expanduser(root)) if root else default_cache_dir()
        self.limit = parse_size(limit)
        self.min_free = float(min_free)
        self._ensure_layout()
        self._mu = threading.Lock()
        self._est_bytes: int | None = None
        self._est_at = 0.0
        self._scan_s = 0.25
        self._pid = -1
        self._pin_dir = ""
        self._pins: dict[str, int] = {}
        self._can_link = True
        self._buckets: set[str] = set()  # data/<xx> directories known to exist
        # Set in DataLoader workers: their pins outlive them (the main process still holds batches).
        self.in_worker = False

    # pickles as its settings; each process rebuilds its own locks and pins
    def __getstate__(self):
        return {"root": self.root, "limit": self.limit, "min_free": self.min_free}

    def __setstate__(self, st):
        self.__init__(st["root"], st["limit"], st["min_free"])

    # ------------------------------------------------------------ layout and safety

    def _ensure_layout(self) -> None:
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        st = os.stat(self.root)
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise UnsafeCacheError(
                f"cache directory {self.root} belongs to another user (uid {st.st_uid}); "
                "use a directory of your own with cache_dir= or $UCMAGIC_CACHE_DIR"
            )
        if st.st_mode & 0o077:
            os.chmod(self.root, 0o700)
        for sub in ("data", "tmp", "locks", "pins"):
            os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)

    def data_path(self, key: str, suffix: str = "") -> str:
        return os.path.join(self.root, "data", key[:2], key + suffix)

    # ------------------------------------------------------------ lookups and fills

    def lookup(self, key: str, suffix: str, size: int) -> str | None:
        """Path of a complete, trusted entry of ``size`` bytes, marked as just used; else None."""
        path = self.data_path(key, suffix)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return None
        if st.st_size != size or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return None
        try:
            os.utime(path)  # last-use time drives LRU
        except OSError:
            return None
        return path

    def fill(self, key: str, suffix: str, size: int, write: Callable[[str], int]) -> tuple[str, bool]:
        """Return the entry for ``key``, calling ``write(tmp_path) -> nbytes`` once if it is missing.

        Returns ``(path, fetched)``. Concurrent callers (threads or processes) for one key wait for
        a single fill. ``write`` must produce exactly ``size`` bytes or the fill fails with OSError.
        """
        path = self.lookup(key, suffix, size)
        if path:
            return path, False
        with file_lock(os.path.join(self.root, "locks", key[:4] + ".lock")):
            path = self.lookup(key, suffix, size)
            if path:
                return path, False
            self.ensure_room(size)
            tmp = os.path.join(self.root, "tmp", f"{key}.{os.getpid()}.{uuid.uuid4().hex[:8]}.part")
            try:
                n = write(tmp)
                if n != size:
                    raise OSError(errno.EIO, f"copied {n} bytes, the listing says {size}: the file changed while being read")
                final = self.data_path(key, suffix)
                bucket = os.path.dirname(final)
                if bucket not in self._buckets:
                    os.makedirs(bucket, mode=0o700, exist_ok=True)
                    self._buckets.add(bucket)
                os.replace(tmp, final)
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        with self._mu:
            if self._est_bytes is not None:
                self._est_bytes += size
        return final, True

    def remove(self, paths: Iterable[str]) -> int:
        """Delete entries (pinned copies stay valid until released). Returns the number removed."""
        n = 0
        for p in paths:
            try:
                os.unlink(p)
                n += 1
            except FileNotFoundError:
                pass
        with self._mu:
            self._est_bytes = None
        return n

    # ------------------------------------------------------------ pins (leases)

    def _pins_root(self) -> str:
        pid = os.getpid()
        if pid != self._pid:  # first use in this process (or after a fork)
            self._pid = pid
            self._pins = {}
            self._pin_dir = os.path.join(self.root, "pins", _process_tag(pid))
            os.makedirs(self._pin_dir, mode=0o700, exist_ok=True)
            if not self.in_worker:
                _register_cleanup(self._pin_dir)
        return self._pin_dir

    def pin(self, path: str) -> str:
        """Lease ``path``: return a path to the same bytes that exists until :meth:`unpin`.

        The lease is a hard link, so eviction (which skips linked entries) and even a concurrent
        delete cannot take the bytes away from a consumer that has not used them yet.
        """
        if not self._can_link:
            return path
        with self._mu:
            pdir = self._pins_root()
            name = os.path.join(pdir, os.path.basename(path))
            count = self._pins.get(name, 0)
            if count == 0:
                try:
                    os.link(path, name)
                except FileExistsError:
                    pass
                except OSError as e:
                    if e.errno in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
                        self._can_link = False  # filesystem without hard links: hand out entries directly
                        return path
                    raise
            self._pins[name] = count + 1
            return name

    def unpin(self, pinned: str) -> None:
        with self._mu:
            self._pins_root()  # a forked child starts with no pins of its own
            count = self._pins.get(pinned, 0)
            if count <= 1:
                self._pins.pop(pinned, None)
                if count == 1:
                    try:
                        os.unlink(pinned)
                    except FileNotFoundError:
                        pass
            else:
                self._pins[pinned] = count - 1

    def unpin_all(self) -> None:
        for name in list(self._pins):
            while name in self._pins:
                self.unpin(name)

    # ------------------------------------------------------------ budget and eviction

    def _scan(self) -> tuple[list[tuple[str, int, float]], CacheUsage]:
        free: list[tuple[str, int, float]] = []
        usage = CacheUsage(0, 0, 0, 0)
        data = os.path.join(self.root, "data")
        for bucket in os.scandir(data):
            if not bucket.is_dir(follow_symlinks=False):
                continue
            for de in os.scandir(bucket.path):
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                usage.files += 1
                usage.bytes += st.st_size
                if st.st_nlink > 1:
                    usage.pinned_files += 1
                    usage.pinned_bytes += st.st_size
                else:
                    free.append((de.path, st.st_size, st.st_mtime))
        return free, usage

    def usage(self) -> CacheUsage:
        """Files and bytes in the cache (all datasets), and how much of it is pinned."""
        _, usage = self._scan()
        return usage

    def _reap(self) -> None:
        """Drop pins of processes gone for a while and temp files of abandoned fills.

        A DataLoader worker can exit while the main process still holds batches it produced (torch
        stops an exhausted worker as soon as it reports the end, even out of order), so a dead
        owner's pins stay for ``PIN_GRACE_S`` after its last pin or release.
        """
        pins = os.path.join(self.root, "pins")
        now = time.time()
        for de in os.scandir(pins):
            try:
                idle = now - de.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            if de.path != self._pin_dir and idle > PIN_GRACE_S and not _owner_alive(de.name):
                shutil.rmtree(de.path, ignore_errors=True)
        for de in os.scandir(os.path.join(self.root, "tmp")):
            try:
                parts = de.name.split(".")
                dead = len(parts) > 2 and parts[1].isdigit() and not pid_running(int(parts[1]))
                if dead or now - de.stat().st_mtime > 6 * 3600:
                    os.unlink(de.path)
            except OSError:
                pass

    def evict(self, bytes_to_free: int, *, keep_below: int | None = None) -> int:
        """Remove least-recently-used unpinned entries until ``bytes_to_free`` bytes are gone.

        With ``keep_below``, free what it takes to bring the cache (as scanned now, under the
        eviction lock) under that many bytes instead.
        """
        with file_lock(os.path.join(self.root, "locks", "evict.lock")):
            self._reap()
            free, usage = self._scan()
            if keep_below is not None:  # a fresh count: other processes' fills and evictions included
                bytes_to_free = usage.bytes - keep_below
            victims = choose_victims(free, bytes_to_free)
            sizes = {p: s for p, s, _ in free}
            freed = 0
            for p in victims:
                try:
                    os.unlink(p)
                    freed += sizes[p]
                except FileNotFoundError:
                    pass
            with self._mu:
                self._est_bytes = usage.bytes - freed
                self._est_at = time.monotonic()
            return freed

    def _estimated_bytes(self) -> int:
        with self._mu:
            est, at = self._est_bytes, self._est_at
        # Other processes fill too, unseen here: re-read often enough that a few processes filling at
        # once cannot overshoot the budget by much, but spend at most ~5% of the time scanning.
        if est is None or time.monotonic() - at > min(5.0, max(0.1, 20 * self._scan_s)):
            t0 = time.monotonic()
            _, usage = self._scan()
            with self._mu:
                self._est_bytes, self._est_at = usage.bytes, time.monotonic()
                self._scan_s = self._est_at - t0
            est = usage.bytes
        return est

    def ensure_room(self, size: int) -> None:
        """Make room for ``size`` more bytes within the budget and the free-disk floor, or raise."""
        if self.limit is not None:
            if size > self.limit:
                raise CacheFullError(
                    f"a {format_size(size)} file does not fit in cache_limit={format_size(self.limit)}; raise cache_limit"
                )
            est = self._estimated_bytes()
            if est + size > self.limit:
                # free down to 90% of the budget so eviction does not run on every fill
                self.evict(0, keep_below=int(self.limit * 0.9) - size)
        du = shutil.disk_usage(self.root)
        floor = int(du.total * self.min_free)
        slack = min(du.total // 50, 256 << 20)  # free a little extra: other fills run at the same time
        for _ in range(8):  # concurrent fills may take the room just freed: evict again while it helps
            if du.free - size >= floor:
                return
            if not self.evict(floor - (du.free - size) + slack):
                break
            du = shutil.disk_usage(self.root)
        if du.free - size < floor:
            raise CacheFullError(
                f"cache disk of {self.root} is full: {format_size(du.free)} free, {format_size(floor)} must stay free "
                f"and the rest is in use by files not yet consumed. Free disk space, set cache_dir= to a larger "
                f"disk, or lower min_free"
            )


def pid_running(pid: int) -> bool:
    """True when process ``pid`` exists on this machine (someone else's counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_cleanup_dirs: set[str] = set()


def _register_cleanup(pin_dir: str) -> None:
    """Remove a main process's pins when it exits.

    Not registered in DataLoader workers (``in_worker``): their pins may still be in batches the
    main process holds when they exit. Those are reaped once their owner has been gone for
    ``PIN_GRACE_S``.
    """
    if pin_dir in _cleanup_dirs:
        return
    _cleanup_dirs.add(pin_dir)
    import atexit

    atexit.register(_remove_if_owner, pin_dir, os.getpid())


def _remove_if_owner(pin_dir: str, pid: int) -> None:
    if os.getpid() == pid:  # atexit handlers are inherited by forked children
        shutil.rmtree(pin_dir, ignore_errors=True)
