"""The persistent, machine-wide file cache.

Layout under the cache root (private to the user, mode 0700)::

    files/<key>-<size>/<rel>           cached copies: one directory per file version (key: a hash of
                                       volume, path, size, mtime), holding the file at its relative
                                       path (map_relpath), or at <key><.ext> for an opaque key
    tmp/<key>.<tag>.<n>.<size>.dir     entries being built (renamed into files/ whole when complete)
    tmp/<key>.<tag>.<n>.<size>.part    budgeted fills in progress (the room they hold)
    locks/fill.lock, evict.lock        single-flight (one byte per key, OFD lock) and eviction (flock) locks
    prot/<owner>@<writer>.<slot>.rec   protection records: entry names a live process has not consumed yet
    usage                              the byte ledger of budgeted fills (a hint, re-counted often)

Guarantees: an entry in ``files/`` is always complete (its directory is staged under ``tmp/`` and
renamed in whole), so the path of an entry is stable: the same file version has the same path, ending
with the file's relative path, in every epoch and process, and it stays until a budget evicts it
(whole: directory and file). One fill per file even with many threads and processes asking at once;
a changed source file (size or mtime) gets a new key, hence a new path. Entries of the old layout
(``data/<k0k1>/<key><.ext>``) are never served and are reaped. Eviction is least-recently-used and skips every entry
named in a protection record whose owner (pid + start time) is alive; records of a dead owner are
dropped at once. With a budget, fills wait for room instead of overshooting, except fills a blocked
consumer needs next (``may_exceed``), so the loop always makes progress.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import re
import shutil
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


from ..errors import CacheDirError, CacheFullError, UnsafeCacheError
from .fetch import watch_progress
from ..units import format_size, parse_size

DEFAULT_MIN_FREE = 0.10
TMP_STALE_S = 6 * 3600.0  # a temp file whose writer cannot be identified is dropped after this long
TOUCH_EVERY_S = 300.0  # LRU resolution: a hit refreshes an entry's last-use time at most this often
STALL_S = 120.0  # a fill no loop waits on gives up after this long without any room freed
LOOP_STALL_S = 60.0  # a fill of a loop (may_exceed given) likewise: its consumption reports never free room
SUBDIRS = ("files", "tmp", "locks", "prot")
OLD_DATA = "data"  # the layout before entries kept source names (data/<xx>/<key><ext>): reaped, never served
_SUFFIX_RE = re.compile(r"\.[A-Za-z0-9_\-]{1,16}$")


# ---------------------------------------------------------------- locking

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
        self._held: dict[str, list] = {}  # key -> [threading.Lock, users]
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


# ---------------------------------------------------------------- pure helpers

def cache_key_digest(volume_uri: str, rel: str, size: int, mtime: float) -> bytes:
    """The 20 bytes behind :func:`cache_key` (node listings store them: see ucmagic.files.listing)."""
    return hashlib.blake2b(f"{volume_uri}\0{rel}\0{size}\0{mtime!r}".encode("utf-8", "surrogateescape"),
                           digest_size=20).digest()


def cache_key(volume_uri: str, rel: str, size: int, mtime: float) -> str:
    """Key of one source file version. Names never reach the filesystem, only this hash does."""
    return cache_key_digest(volume_uri, rel, size, mtime).hex()


def safe_suffix(rel: str) -> str:
    """The file's extension if it is short and plain (kept so decoders can sniff by extension)."""
    m = _SUFFIX_RE.search(rel.rsplit("/", 1)[-1])
    return m.group(0) if m else ""


def safe_suffixes(rels: Iterable[str]) -> list[str]:
    """:func:`safe_suffix` of many paths (one regex search per distinct extension, not per file)."""
    memo: dict[str, str] = {}
    out = []
    for rel in rels:
        dot = rel.rfind(".")
        tail = rel[dot:] if dot > rel.rfind("/") else ""
        sfx = memo.get(tail)
        if sfx is None:
            sfx = memo[tail] = safe_suffix(tail)
        out.append(sfx)
    return out


def cache_keys(volume_uri: str, files: Sequence[tuple[str, int, float]]) -> list[tuple[str, str]]:
    """``(cache_key, safe_suffix)`` of many ``(rel, size, mtime)`` at once (node listings store the
    keys; this is for a dataset whose volume URI differs from its listing's)."""
    keys = [cache_key_digest(volume_uri, rel, size, mtime).hex() for rel, size, mtime in files]
    return list(zip(keys, safe_suffixes([f[0] for f in files])))


# ---------------------------------------------------------------- entry names and paths

ESCAPE = "%~"  # an escaped path component starts with this (and so does a kept one's escape)
NAME_MAX = 255  # bytes of one component on Linux file systems
REL_MAX = 3072  # bytes of a mapped relative path beyond which it becomes one hashed component
_CTRL = "".join(map(chr, [*range(32), 127]))
_BAD_CHAR = r"[\x00-\x1f\x7f\ud800-\udc7f\udd00-\udfff]"  # control characters, surrogates no name can hold
_UNPLAIN = re.compile(_BAD_CHAR + r"|(?:^|/)(?:\.{0,2}(?:/|$)|%~)")  # a component to map
_HAS_BAD = re.compile(_BAD_CHAR).search
_QUOTE = {ord(c): f"%{ord(c):02X}" for c in _CTRL + "%#"}
_UNQUOTE = re.compile(r"%([0-9A-F]{2})")


def entry_name(key: str, size: int) -> str:
    """The version id of an entry: its directory under ``files/`` (``<key>-<size>``).

    The size in the name lets a scan count an entry's bytes from one directory read."""
    return f"{key}-{size}"


def entry_record_names(key: str, suffix: str, size: int) -> list[str]:
    """What a protection record lists to protect the entry of ``key`` (``size`` bytes): its directory
    name under ``files/`` (:func:`entry_name`) and its file name ``<key><suffix>`` of the old layout."""
    return [key + suffix, entry_name(key, size)]


def parse_entry_name(name: str) -> tuple[str, int] | None:
    """``(key, size)`` of an entry directory's name, else None."""
    key, _, size = name.rpartition("-")
    return (key, int(size)) if key and size.isascii() and size.isdigit() else None


def _nbytes(s: str) -> int:
    return len(s) if len(s) * 4 <= NAME_MAX else len(s.encode("utf-8", "surrogateescape"))


def _hashed(part: str) -> str:
    """A long or unencodable component: a hash, keeping a plain extension (decoders sniff it)."""
    raw = part.encode("utf-8", "surrogatepass")
    return f"{ESCAPE}#{hashlib.blake2b(raw, digest_size=16).hexdigest()}{safe_suffix(part)}"


def _map_part(part: str) -> str:
    try:
        if part not in ("", ".", "..") and not part.startswith(ESCAPE) and _HAS_BAD(part) is None \
                and _nbytes(part) <= NAME_MAX:
            return part
        out = ESCAPE + part.translate(_QUOTE)
        return out if _nbytes(out) <= NAME_MAX else _hashed(part)
    except UnicodeEncodeError:  # a lone surrogate that no file name can hold
        return _hashed(part)


def map_relpath(rel: str) -> str:
    """The relative path of a source file inside its entry directory: ``rel`` itself when every
    component is a plain Linux file name, so the entry keeps the source's folders, name and extension.

    A component that is empty, ``.``, ``..``, holds a control character, or starts with ``%~`` becomes
    ``%~`` + the component with ``%``, ``#`` and control characters percent-encoded; one still over 255
    bytes (or not encodable) becomes ``%~#<hash><.ext>``; a path over :data:`REL_MAX` bytes becomes one
    such hashed component. The result never leaves the entry directory, and distinct paths map to
    distinct results (:func:`unmap_relpath` inverts all but the hashed ones). Each entry holds one
    file, so components of different files never collide (a name that is a file for one and a
    folder for another is fine).
    """
    if _UNPLAIN.search(rel) is None and _nbytes(rel) <= NAME_MAX:
        return rel  # the common case: one regex search
    try:
        out = "/".join(map(_map_part, rel.split("/")))
        if len(out.encode("utf-8", "surrogateescape")) <= REL_MAX:
            return out
    except UnicodeEncodeError:
        pass
    return _hashed(rel)


def unmap_relpath(mapped: str) -> str | None:
    """The source-relative path :func:`map_relpath` mapped to ``mapped``; None where it hashed a part."""
    parts = []
    for part in mapped.split("/"):
        if part.startswith(ESCAPE + "#"):
            return None
        if part.startswith(ESCAPE):
            part = _UNQUOTE.sub(lambda m: chr(int(m.group(1), 16)), part[len(ESCAPE):])
        parts.append(part)
    return "/".join(parts)


def entry_file(key: str, suffix: str, size: int, rel: str | None = None) -> str:
    """Where an entry's file sits under ``files/``: ``<key>-<size>/<map_relpath(rel)>``, or, for an
    opaque key (no ``rel``), ``<key>-<size>/<key><suffix>``."""
    return f"{key}-{size}/{key + suffix if rel is None else map_relpath(rel)}"


def entry_files(keys: Sequence[str], sizes: Sequence[int], rels: Sequence[str], *, plain: bool = False) -> list[str]:
    """:func:`entry_file` of many source files (the warm path's names, a chunk at a time).
    ``plain``: every path is known to map to itself (a node listing records it), so none is checked."""
    if plain:
        return [f"{k}-{s}/{r}" for k, s, r in zip(keys, sizes, rels)]
    return [f"{k}-{s}/{map_relpath(r)}" for k, s, r in zip(keys, sizes, rels)]


def choose_victims(entries: Iterable[tuple[str, int, float]], bytes_to_free: int) -> list[str]:
    """LRU choice: the oldest (by last use) entries whose sizes add up to ``bytes_to_free``.

    ``entries`` are ``(path, size, last_used)`` of unprotected entries only.
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


def pid_running(pid: int) -> bool:
    """True when process ``pid`` exists on this machine (someone else's counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (``/proc``), else via psutil in ms; 0 if unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return int(data[data.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        pass
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
    return start_s == "0" or str(_start_time(pid)) == start_s


def parse_record_name(name: str) -> tuple[str, str] | None:
    """``(owner_tag, writer_tag)`` of a protection record file name, else None."""
    if not name.endswith(".rec") or "@" not in name:
        return None
    owner, rest = name[:-4].split("@", 1)
    return owner, rest.rsplit(".", 1)[0]


def parse_limit_name(name: str) -> tuple[str, int] | None:
    """``(process tag, cache_limit bytes)`` of a budget record's name in ``locks/``, else None."""
    parts = name.split(".")
    if len(parts) != 4 or parts[0] != "limit" or not parts[3].isdigit():
        return None
    return parts[1], int(parts[3])


def _drop_limit_record(path: str, pid: int) -> None:
    if os.getpid() == pid:  # a forked child inherits the finaliser: only the creating process removes it
        with contextlib.suppress(OSError):
            os.unlink(path)


def parse_tmp_name(name: str) -> tuple[str, int] | None:
    """``(writer_tag, final size)`` of a fill's temp file (``.part``) or staged entry (``.dir``) name, else None."""
    parts = name.split(".")
    if len(parts) != 5 or parts[-1] not in ("part", "dir") or not parts[3].isdigit():
        return None
    return parts[1], int(parts[3])


@dataclass
class CacheUsage:
    """What is under a cache directory, in files and bytes (apparent sizes).

    ``files``/``bytes``: complete entries in ``data/``; ``protected_*``: those named by a live
    protection record; ``tmp_*``: fills in progress or abandoned; ``records_*``: protection records;
    ``other_bytes``: anything else (ledger, the node's listings, stray files).
    """

    files: int = 0
    bytes: int = 0
    protected_files: int = 0
    protected_bytes: int = 0
    tmp_files: int = 0
    tmp_bytes: int = 0
    records_files: int = 0
    records_bytes: int = 0
    other_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.bytes + self.tmp_bytes + self.records_bytes + self.other_bytes


_tmp_counter = itertools.count()


class SeenEntries:
    """Which cache entries of ``n`` files (by index) this process found, a bit per file.

    A bit stands for "found since the cache's removal token (:meth:`FileCache.removals`) last
    changed and within the current touch window": nothing has been removed from the cache since
    (ucmagic removes entries only through :class:`FileCache`), so the entry is still there, and its
    last-use time was refreshed less than a window ago. Every bit is forgotten when the token changes
    or the window (``TOUCH_EVERY_S``) ends. Made by :meth:`FileCache.seen_entries`; n/8 bytes.
    """

    def __init__(self, n: int, token: bytes) -> None:
        self._bits = bytearray((n + 7) // 8)
        self._view = np.frombuffer(self._bits, dtype=np.uint8)
        self._token = token
        self._since = time.time()

    def sync(self, token: bytes, now: float) -> None:
        """Forget everything if the removal token is no longer the one seen, or the window ended."""
        if token != self._token or now - self._since > TOUCH_EVERY_S:
            self._view[:] = 0
            self._token, self._since = token, now

    def known(self, indices: np.ndarray) -> np.ndarray:
        """A bool per index: found (and not forgotten since)."""
        return (self._view[indices >> 3] >> (indices & 7) & 1).astype(bool)

    def add(self, indices: np.ndarray) -> None:
        np.bitwise_or.at(self._view, indices >> 3, (1 << (indices & 7)).astype(np.uint8))

    def filled(self, index: int) -> None:
        """Entry ``index`` was just created by a fill of this process."""
        self._bits[index >> 3] |= 1 << (index & 7)  # a bit lost to a race is only a lookup more


class FileCache:
    """A directory of complete cached files shared by every process of the user on this machine.

    Args:
        root: cache directory; default :func:`default_cache_dir`.
        limit: byte budget for the whole directory (int or "50GB"); ``None``: only the free-space floor.
        min_free: fraction of the disk always left free (default 10%).
    """

    def __init__(self, root: str | None = None, limit: int | str | None = None,
                 min_free: float = DEFAULT_MIN_FREE) -> None:
        self.root = os.path.abspath(os.path.expanduser(root)) if root else default_cache_dir()
        self.limit = parse_size(limit)
        self.min_free = float(min_free)
        self._ensure_layout()
        self._mu = threading.Lock()
        self._entries = os.path.join(self.root, "files")
        self._tmp = os.path.join(self.root, "tmp")
        self._locks = os.path.join(self.root, "locks")
        self._prot = os.path.join(self.root, "prot")
        self._evict_lock = os.path.join(self._locks, "evict.lock")
        self._keys = KeyLocks(os.path.join(self._locks, "fill.lock"))
        self._ledger = os.path.join(self.root, "usage")
        self._scan_s = 0.001
        self._synced_at = 0.0
        self._free_at = 0.0
        self._free_est = 0
        self._floor = 0
        self._record_fds: dict[str, int] = {}  # protection records and the removal token, kept open
        self._fds_pid = os.getpid()
        self._removals = os.path.join(self._locks, "removals")
        self._budget, self._limits_at = self.limit, -1.0
        self._record_limit()

    # pickles as its settings; each process rebuilds its own state
    def __getstate__(self):
        return {"root": self.root, "limit": self.limit, "min_free": self.min_free}

    def __setstate__(self, st):
        self.__init__(st["root"], st["limit"], st["min_free"])

    # ------------------------------------------------------------ layout and safety

    def _ensure_layout(self) -> None:
        try:
            os.makedirs(self.root, mode=0o700, exist_ok=True)
            st = os.stat(self.root)
        except OSError as exc:
            raise self._unusable(exc) from exc
        if hasattr(os, "getuid") and st.st_uid != os.getuid():
            raise UnsafeCacheError(
                f"cache directory {self.root} belongs to another user (uid {st.st_uid}); "
                "use a directory of your own with cache_dir= or $UCMAGIC_CACHE_DIR"
            )
        try:
            if st.st_mode & 0o077:
                os.chmod(self.root, 0o700)
            for sub in SUBDIRS:
                os.makedirs(os.path.join(self.root, sub), mode=0o700, exist_ok=True)
            if not os.access(self.root, os.W_OK | os.X_OK):  # e.g. a read-only mount (EROFS)
                raise PermissionError(errno.EACCES, "not writable")
        except OSError as exc:
            raise self._unusable(exc) from exc

    def _unusable(self, exc: OSError) -> CacheDirError:
        reason = "it is a file, not a directory" if os.path.isfile(self.root) else (exc.strerror or str(exc))
        return CacheDirError(f"cannot use {self.root} as the cache directory: {reason}. Set cache_dir= (or "
                             "$UCMAGIC_CACHE_DIR) to a writable local directory")

    def data_path(self, key: str, suffix: str, size: int, rel: str | None = None) -> str:
        """Where the entry of ``key`` (``size`` bytes) is or will be: ``files/`` + :func:`entry_file`."""
        return self._entries + os.sep + entry_file(key, suffix, size, rel)

    def entry_dir(self, path: str) -> str | None:
        """The entry directory (``files/<key>-<size>``) that ``path`` lies in, else None."""
        head = self._entries + os.sep
        path = os.path.abspath(path)
        if not path.startswith(head):
            return None
        name = path[len(head):].split(os.sep, 1)[0]
        return head + name if parse_entry_name(name) else None

    # ------------------------------------------------------------ lookups and fills

    def lookup(self, key: str, suffix: str, size: int, *, rel: str | None = None) -> str | None:
        """Path of a complete, trusted entry of ``size`` bytes, marked as used; else None.

        ``rel``: the source file's relative path, which the entry's path ends with (see
        :func:`map_relpath`); without it (an opaque key) the file is named ``<key><suffix>``.
        No lock and one ``stat`` on a hit (plus a ``utime`` at most every ``TOUCH_EVERY_S``).
        """
        path = self.data_path(key, suffix, size, rel)
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if st.st_size != size or (hasattr(os, "getuid") and st.st_uid != os.getuid()):
            return None
        if time.time() - st.st_mtime > TOUCH_EVERY_S and not self._touch(path):
            return None
        return path

    def _touch(self, path: str) -> bool:
        """Mark the entry of file ``path`` as used now (its file and, for scans, its directory)."""
        try:
            os.utime(path)
            os.utime(path[:path.index(os.sep, len(self._entries) + 1)])  # last-use time drives LRU
        except (OSError, ValueError):
            return False
        return True

    def lookup_run(self, names: Sequence[str], sizes: Sequence[int], indices: np.ndarray | None = None,
                   seen: SeenEntries | None = None) -> list[str]:
        """Paths of the leading entries (:func:`entry_file` names with their sizes) that :meth:`lookup`
        would return, stopping at the first one it would not: the warm path's lookup of a run of items,
        one ``stat`` each and no per-item call.

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
        out: list[str] = []
        for i, (name, size) in enumerate(zip(names, sizes)):
            path = files + name
            if known is not None and known[i]:
                out.append(path)
                continue
            try:
                st = stat(path)
            except (FileNotFoundError, NotADirectoryError):
                break
            if st.st_size != size or (uid is not None and st.st_uid != uid):
                break
            if st.st_mtime < stale_before and not self._touch(path):
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
        try:
            fd = self._record_fd(self._removals)  # reopened when the directory was removed under us
        except FileNotFoundError:
            return os.urandom(8)  # no cache directory: never equal to what was seen before
        token = os.pread(fd, 8, 0)
        if not token:  # a new file: a new token (another process may write one too)
            os.pwrite(fd, os.urandom(8), 0)
            token = os.pread(fd, 8, 0)
        return token

    def _removing(self) -> None:
        """Change the removal token: called before and after entries are unlinked."""
        with contextlib.suppress(FileNotFoundError):
            os.pwrite(self._record_fd(self._removals), os.urandom(8), 0)

    def fill(self, key: str, suffix: str, size: int, write: Callable[[str], int], *,
             may_exceed: Callable[[], bool] | None = None, on_wait: Callable[[], None] | None = None,
             looked_up: bool = False, rel: str | None = None) -> tuple[str, bool]:
        """Return the entry for ``key``, calling ``write(tmp_path) -> nbytes`` once if it is missing.

        Returns ``(path, fetched)``. Concurrent callers (threads or processes) for one key wait for
        a single fill. ``write`` must produce exactly ``size`` bytes or the fill fails with OSError.
        Without room in the budget the fill waits (calling ``on_wait`` while it does) until
        consumers free some, unless ``may_exceed()`` says a consumer is blocked on this very file.
        ``looked_up``: the caller just found no entry, or expects none (a run of misses): the lookup
        before the lock is skipped (the one under the lock still runs, so a hit is still found).
        ``rel``: the source's relative path, kept at the end of the entry's path (see :meth:`lookup`).
        The entry is built under ``tmp/`` and renamed into ``files/`` whole, so a reader never sees
        a partial file or directory.
        """
        if not looked_up:
            path = self.lookup(key, suffix, size, rel=rel)
            if path:
                return path, False
        # With a budget, room is held by a temp file under tmp/ whose name carries the size (every
        # process's count sees it), taken without the key's lock: a fill waiting for room must not
        # block another one. Without a budget only the free-disk floor is checked.
        tmp = None
        if self.budget() is not None:  # this process's cache_limit, or a smaller one of another live process
            tmp = os.path.join(self._tmp, f"{key}.{process_tag()}.{next(_tmp_counter)}.{size}.part")
        self.reserve(size, tmp or "", may_exceed=may_exceed, on_wait=on_wait)
        staged = None
        try:
            with self._keys.hold(key):
                path = self.lookup(key, suffix, size, rel=rel)
                if path:
                    if tmp is not None:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(tmp)
                    return path, False
                inner = entry_file(key, suffix, size, rel)
                name, _, inner = inner.partition("/")
                # the entry directory is staged under tmp/ (its name carries the size and the writer,
                # so counts include it and a dead writer's is reaped) and renamed into files/ whole
                stage = os.path.join(self._tmp, f"{key}.{process_tag()}.{next(_tmp_counter)}.{size}.dir")
                # without a budget the copy goes to an unnamed file (O_TMPFILE: a killed process leaves
                # nothing), else (or where there is none) to the named temp file that holds the room
                anon = _open_unnamed(self._tmp) if tmp is None else -1
                if anon < 0 and tmp is None:
                    tmp = os.path.join(self._tmp, f"{key}.{process_tag()}.{next(_tmp_counter)}.{size}.part")
                part = f"/proc/self/fd/{anon}" if anon >= 0 else (tmp or "")
                watch_progress((lambda: _written(os.fstat(anon))) if anon >= 0 else (lambda: _written(os.stat(part))))
                try:
                    _check_size(write(part), size)
                    staged = self._stage(stage, inner)  # complete: moved into its entry directory
                    if anon >= 0:
                        _link_unnamed(anon, os.path.join(stage, inner))
                    else:
                        os.rename(part, os.path.join(stage, inner))
                        tmp = None
                finally:
                    watch_progress(None)
                    if anon >= 0:
                        os.close(anon)
                final = os.path.join(self._entries, name)
                self._install(stage, final)
                staged = None
        except BaseException:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
            raise
        return final + os.sep + inner, True

    def _stage(self, stage: str, inner: str) -> str:
        """Make the staged entry directory ``stage`` and the folders of ``inner`` in it; return it."""
        try:
            os.mkdir(stage, 0o700)
        except FileNotFoundError:  # tmp/ removed under us (a cleared cache directory)
            os.makedirs(self._tmp, mode=0o700, exist_ok=True)
            os.mkdir(stage, 0o700)
        at = stage
        for part in inner.split("/")[:-1]:
            at = os.path.join(at, part)
            os.mkdir(at, 0o700)
        return stage

    def _install(self, stage: str, final: str) -> None:
        """Rename the complete staged entry ``stage`` to ``final`` (replacing one lookup did not trust)."""
        try:
            os.rename(stage, final)
            return
        except FileNotFoundError:
            if not os.path.isdir(stage):
                raise
            os.makedirs(self._entries, mode=0o700, exist_ok=True)  # files/ removed under us
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            # an entry of this version that lookup did not trust (wrong size or owner, another name)
            self._removing()
            self._drop_entry(final)
            self._removing()
        os.rename(stage, final)

    def _drop_entry(self, entry: str) -> bool:
        """Remove the entry directory ``entry`` whole: renamed out of ``files/`` at once, then deleted."""
        gone = os.path.join(self._tmp, f"{os.path.basename(entry)}.{process_tag()}.{next(_tmp_counter)}.0.dir")
        try:
            os.rename(entry, gone)
        except FileNotFoundError:
            return False
        _remove_tree(gone)
        return True

    def remove(self, paths: Iterable[str]) -> int:
        """Delete entries, each whole (``paths``: an entry's file or directory). Returns the number removed."""
        n = 0
        self._removing()
        for p in paths:
            entry = self.entry_dir(p)
            if entry is not None and self._drop_entry(entry):
                n += 1
        self._removing()
        self._synced_at = 0.0  # the ledger is stale now
        return n

    # ------------------------------------------------------------ protection records

    def record_path(self, owner: str, slot: int | str) -> str:
        """Where the writing process keeps its protection record for stream ``slot`` on behalf of ``owner``."""
        return os.path.join(self._prot, f"{owner}@{process_tag()}.{slot}.rec")

    def write_record(self, path: str, names: Iterable[str]) -> None:
        """Atomically replace the protection record at ``path`` with ``names`` (entry file names).

        Taken under the shared eviction lock: once this returns, no eviction that has not seen the
        record is still running, so an entry found present afterwards stays until released.
        """
        data = "\n".join(names).encode()
        with file_lock(self._evict_lock, shared=True):
            # Rewritten in place on a descriptor kept open: a rename over an existing file makes
            # ext4 flush it first (auto_da_alloc, ~5 ms a call), and evictions, which read records
            # under the exclusive lock, never see a half-written one. A process killed between the
            # two calls leaves the new names plus a tail of old ones: more protection, never less.
            fd = self._record_fd(path)
            os.pwrite(fd, data, 0)
            os.ftruncate(fd, len(data))

    def _record_fd(self, path: str) -> int:
        """This process's open descriptor of the record (or the removal token) at ``path``, reopened
        after a fork or once the file was removed."""
        pid = os.getpid()
        if self._fds_pid != pid:
            self._record_fds, self._fds_pid = {}, pid  # a forked child must not write through the parent's
        fd = self._record_fds.get(path)
        if fd is not None and os.fstat(fd).st_nlink == 0:  # removed meanwhile (e.g. by clear_cache)
            self._close_record(path)
            fd = None
        if fd is None:
            fd = self._record_fds[path] = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        return fd

    def _close_record(self, path: str) -> None:
        if self._fds_pid == os.getpid():
            fd = self._record_fds.pop(path, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def drop_record(self, path: str) -> None:
        self._close_record(path)
        for p in (path, path + ".tmp"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def drop_records(self, owner: str, *, dead_writers_only: bool = True) -> int:
        """Remove records owned by ``owner`` (by default only those whose writing process is gone)."""
        n = 0
        for name in _listdir(self._prot):
            parsed = parse_record_name(name)
            if parsed is None or parsed[0] != owner:
                continue
            if dead_writers_only and (parsed[1] == process_tag() or tag_alive(parsed[1])):
                continue
            self.drop_record(os.path.join(self._prot, name))
            n += 1
        return n

    def protected_names(self, *, reap: bool = True) -> set[str]:
        """Entry names protected by live owners; records of dead owners are dropped (``reap``)."""
        names: set[str] = set()
        alive: dict[str, bool] = {}
        for name in _listdir(self._prot):
            full = os.path.join(self._prot, name)
            if name.endswith(".tmp"):
                parsed = parse_record_name(name[:-4])
                if parsed and reap and not alive.setdefault(parsed[1], tag_alive(parsed[1])):
                    self.drop_record(full[:-4])
                continue
            parsed = parse_record_name(name)
            if parsed is None:
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
                    names.update(f.read().decode().split("\n"))
            except FileNotFoundError:
                continue
        names.discard("")
        return names

    def live_streams(self) -> int:
        """How many protection records (:meth:`record_path`, one per stream) have a live owner, this
        process's included: the streams of every process sharing this cache. Reads names only."""
        alive: dict[str, bool] = {}
        n = 0
        for name in _listdir(self._prot):
            parsed = parse_record_name(name)
            if parsed is None:
                continue
            owner = parsed[0]
            if owner not in alive:
                alive[owner] = owner == process_tag() or tag_alive(owner)
            n += alive[owner]
        return n

    # ------------------------------------------------------------ accounting

    def usage(self) -> CacheUsage:
        """Every byte under the cache directory, by kind (entries, protection records, temp files, other)."""
        protected = self.protected_names(reap=False)
        return self._scan(protected)[1]

    def _scan(self, protected: set[str]) -> tuple[list[tuple[str, int, float]], CacheUsage]:
        """Unprotected entries ``(path, size, mtime)`` and the usage. Temp files count at their final
        size (the name carries it), so a fill in progress already holds its room."""
        t0 = time.monotonic()
        free: list[tuple[str, int, float]] = []
        u = CacheUsage()
        # an entry is a directory files/<key>-<size> (complete: renamed in whole); its size is in its
        # name and its mtime is its last use, so one directory read and a stat per entry count it
        for de in _scandir(self._entries, dirs=True):
            parsed = parse_entry_name(de.name)
            if parsed is None or not de.is_dir(follow_symlinks=False):
                u.other_bytes += _size(de)
                continue
            try:
                mtime = de.stat(follow_symlinks=False).st_mtime
            except FileNotFoundError:
                continue
            size = parsed[1]
            u.files += 1
            u.bytes += size
            if de.name in protected:
                u.protected_files += 1
                u.protected_bytes += size
            else:
                free.append((de.path, size, mtime))
        for bucket in _scandir(os.path.join(self.root, OLD_DATA), dirs=True):  # the old layout, until reaped
            for de in _scandir(bucket.path) if bucket.is_dir(follow_symlinks=False) else [bucket]:
                u.other_bytes += _size(de)
        for de in _scandir(self._tmp, dirs=True):
            parsed = parse_tmp_name(de.name)
            u.tmp_files += 1
            u.tmp_bytes += max(_size(de), parsed[1] if parsed else 0)
        for de in _scandir(self._prot):
            u.records_files += 1
            u.records_bytes += _size(de)
        for de in _scandir(self.root):
            if de.name not in SUBDIRS:
                u.other_bytes += _size(de)
        for sub in (self._locks, os.path.join(self.root, "listings")):  # lock files, the node's listings
            for de in _scandir(sub):
                u.other_bytes += _size(de)
        self._scan_s = 0.8 * self._scan_s + 0.2 * (time.monotonic() - t0)
        return free, u

    def reap(self) -> dict[str, int]:
        """Drop protection records of dead owners, temp files and staged entries of dead writers, and
        entries of the old layout (``data/``) no live process protects. Returns counts."""
        before = len(_listdir(self._prot))
        protected = self.protected_names(reap=True)
        records = before - len(_listdir(self._prot))
        old = self._reap_old_layout(protected)
        tmp = 0
        now = time.time()
        alive: dict[str, bool] = {}
        for de in _scandir(self._tmp, dirs=True):
            parsed = parse_tmp_name(de.name)
            try:
                if parsed is not None:
                    writer = parsed[0]
                    if writer not in alive:
                        alive[writer] = tag_alive(writer)
                    dead = not alive[writer]
                else:
                    dead = now - de.stat().st_mtime > TMP_STALE_S
                if dead:
                    _remove_tree(de.path)
                    tmp += 1
            except OSError:
                pass
        return {"records": records, "tmp": tmp, "old": old}

    def _reap_old_layout(self, protected: set[str]) -> int:
        """Remove the old layout's entries (``data/<xx>/<key><ext>``, never served) that no live
        process of an older ucmagic protects, and its directories once empty. Returns the count."""
        old = os.path.join(self.root, OLD_DATA)
        n = 0
        for bucket in _scandir(old, dirs=True):
            for de in _scandir(bucket.path) if bucket.is_dir(follow_symlinks=False) else [bucket]:
                if de.name not in protected:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(de.path)
                        n += 1
            with contextlib.suppress(OSError):
                os.rmdir(bucket.path)
        with contextlib.suppress(OSError):
            os.rmdir(old)
        return n

    # ------------------------------------------------------------ budget and eviction

    def eviction_lock(self) -> contextlib.AbstractContextManager[None]:
        """The machine-wide lock under which entries are evicted and budgets reserved."""
        return file_lock(self._evict_lock)

    def evict(self, bytes_to_free: int = 0, *, keep_below: int | None = None) -> int:
        """Remove least-recently-used unprotected entries until ``bytes_to_free`` bytes are gone.

        With ``keep_below``, free what it takes to bring the whole directory (as counted now, under
        the eviction lock) under that many bytes instead. Dead owners' records and temp files go too.
        """
        with file_lock(self._evict_lock):
            return self._evict_locked(bytes_to_free, keep_below)[0]

    def _evict_locked(self, bytes_to_free: int, keep_below: int | None) -> tuple[int, int]:
        """(bytes freed, usage total after) — caller holds the eviction lock."""
        self.reap()
        free, usage = self._scan(self.protected_names(reap=False))
        total = usage.total_bytes
        if keep_below is not None:
            bytes_to_free = total - keep_below
        freed = 0
        victims = choose_victims(free, bytes_to_free) if bytes_to_free > 0 else []
        if victims:
            sizes = {p: s for p, s, _ in free}
            self._removing()
            for p in victims:
                if self._drop_entry(p):  # the whole entry directory
                    freed += sizes[p]
            self._removing()
        self._write_ledger(total - freed)
        self._synced_at = time.monotonic()
        return freed, total - freed

    def _read_ledger(self) -> int | None:
        try:
            with open(self._ledger, "rb") as f:
                return int(f.read() or b"0")
        except (OSError, ValueError):
            return None

    def _write_ledger(self, value: int) -> None:
        fd = os.open(self._ledger, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, str(max(0, int(value))).encode().rjust(20))  # fixed width: the file's own size never changes
        finally:
            os.close(fd)

    def reserve(self, size: int, tmp: str, *, may_exceed: Callable[[], bool] | None = None,
                on_wait: Callable[[], None] | None = None) -> None:
        """Hold room for ``size`` bytes at ``tmp`` (created empty; its name carries the size), within the
        budget and the free-disk floor. Waits for room while others consume; raises when a file can
        never fit or the disk is full of protected files and this fill must not wait."""
        limit = self.budget()
        if limit is not None and tmp:
            if size > limit:
                raise CacheFullError(
                    f"a {format_size(size)} file does not fit in {self._budget_name(limit)}: "
                    f"raise cache_limit above {format_size(size)} (plus what the loop holds at once)"
                )
            self._reserve_budget(size, tmp, may_exceed, on_wait)
        # without a budget the temp file appears when the copy starts (one open less per fill)
        self._ensure_disk(size, may_exceed, on_wait)

    def _reserve_budget(self, size: int, tmp: str, may_exceed: Callable[[], bool] | None,
                        on_wait: Callable[[], None] | None) -> None:
        delay = 0.005
        waited = 0.0
        best, best_at = None, time.monotonic()  # the lowest count seen while waiting, and since when
        while True:
            limit = self.budget()
            if limit is None:  # the process that set the only budget is gone: no limit now
                open(tmp, "wb").close()
                return
            # checked before the lock: a blocked consumer's fill may go over, after a moment for
            # other streams to release
            over = waited >= 0.05 and may_exceed is not None and may_exceed()
            with file_lock(self._evict_lock):
                total = self._read_ledger()
                since = time.monotonic() - self._synced_at
                # the ledger is a hint: re-count (and evict) before deciding there is no room, but
                # once per moment per process, not once per waiting thread (they would queue on the
                # lock behind each other's scans, the head of the loop among them)
                if total is None or since > max(1.0, 50 * self._scan_s) or (
                        total + size > limit and since > max(0.02, 10 * self._scan_s)):
                    # evict a little more than this file needs: the next fills find room without a scan
                    _, total = self._evict_locked(0, limit - size - min(limit // 16, 256 << 20))
                if total + size <= limit or over:
                    open(tmp, "wb").close()  # visible to every process's count from now on
                    self._write_ledger(total + size)
                    return
            if best is None or total < best:
                best, best_at = total, time.monotonic()
            elif may_exceed is None and time.monotonic() - best_at > STALL_S:
                # no loop of this process waits on this fill, and nothing was freed for a long time
                raise CacheFullError(
                    f"no room for a {format_size(size)} file in {self._budget_name(limit)} for {STALL_S:g} s: "
                    f"{format_size(total)} is held by files running loops have not consumed yet. Raise "
                    "cache_limit, or let those loops finish first")
            elif may_exceed is not None and time.monotonic() - best_at > LOOP_STALL_S:
                # a loop's fill, never allowed over and nothing freed: the loop's consumption reports
                # lag behind what it read (a wrapper that yields fewer items than it takes), a deadlock
                raise CacheFullError(
                    f"no room for a {format_size(size)} file in {self._budget_name(limit)} for {LOOP_STALL_S:g} s "
                    f"while the loop waits: {format_size(total)} is held by files it has not reported consumed "
                    "(a wrapper dataset that yields fewer items than it reads under-reports). Raise cache_limit "
                    "to hold a few batches per DataLoader worker, or set cache_limit=None")
            if on_wait is not None:
                on_wait()  # may raise: the loop that wanted this file is gone
            time.sleep(delay)
            waited += delay
            delay = min(0.05, max(delay * 1.5, 5 * self._scan_s))

    def disk_full(self, size: int, free: int | None = None, floor: int | None = None) -> CacheFullError:
        """The error of a fill of ``size`` bytes that the cache disk has no room for (``free`` and
        ``floor``: as measured, else measured now), naming the free space, the budget and the fixes."""
        if free is None or floor is None:
            try:
                du = shutil.disk_usage(self.root)
                free, floor = du.free, int(du.total * self.min_free)
            except OSError:
                free, floor = 0, 0
        limit = self.budget()
        try:
            held = self.usage().total_bytes  # an error path: a scan is fine
        except OSError:
            held = 0
        room = format_size(max(0, held + free - floor))  # what this cache can have on this disk
        budget = (f"{self._budget_name(limit)} is more than the disk holds: lower it to under {room}"
                  if limit is not None else f"set cache_limit= under {room} (what the disk holds)")
        return CacheFullError(
            f"cache disk of {self.root} is full: a {format_size(size)} file does not fit in {format_size(free)} free "
            f"({format_size(floor)} must stay free, min_free={self.min_free:g}; the cache holds {format_size(held)}, "
            f"none of it evictable now). Either {budget}, free disk space, or set cache_dir= (or "
            "$UCMAGIC_CACHE_DIR) to a larger disk")

    def budget(self) -> int | None:
        """The byte budget fills honour: the smallest ``cache_limit`` of any live process using this
        directory (this one's included; each records its own in ``locks/``), None when none set one.
        Re-read at most once a second; records of exited processes are removed on the way."""
        now = time.monotonic()
        if now - self._limits_at < 1.0:
            return self._budget
        best = self.limit
        for name in _listdir(self._locks):
            parsed = parse_limit_name(name)
            if parsed is None or (best is not None and parsed[1] >= best):
                continue
            if tag_alive(parsed[0]):
                best = parsed[1]
            else:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(self._locks, name))
        self._budget, self._limits_at = best, now
        return best

    def _budget_name(self, limit: int) -> str:
        own = self.limit is not None and limit >= self.limit
        return (f"cache_limit={format_size(limit)}" if own else
                f"cache_limit={format_size(limit)} (set by another live dataset using {self.root}, in this or "
                "another process: the smallest budget of any live one holds)")

    def _record_limit(self) -> None:
        """Let every process using this directory honour this object's ``cache_limit`` while it (and
        its process) lives: a record ``locks/limit.<process>.<n>.<bytes>``, removed when the object goes."""
        if self.limit is None:
            return
        path = os.path.join(self._locks, f"limit.{process_tag()}.{next(_tmp_counter)}.{self.limit}")
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
            weakref.finalize(self, _drop_limit_record, path, os.getpid())

    def _ensure_disk(self, size: int, may_exceed: Callable[[], bool] | None,

                     on_wait: Callable[[], None] | None) -> None:
        """Keep the free-disk floor. ``statvfs`` only when the estimate of free space runs low."""
        now = time.monotonic()
        margin = 64 << 20
        if now - self._free_at < 1.0 and self._free_est - size >= self._floor + margin:
            self._free_est -= size
            return
        waited = 0.0
        while True:
            du = shutil.disk_usage(self.root)
            floor = int(du.total * self.min_free)
            self._floor, self._free_at, self._free_est = floor, time.monotonic(), du.free - size
            if du.free - size >= floor:
                return
            slack = min(du.total // 50, 256 << 20)  # free a little extra: other fills run at the same time
            if self.evict(floor - (du.free - size) + slack):
                continue
            if may_exceed is None or may_exceed() or waited > 30.0:
                raise self.disk_full(size, du.free, floor)
            if on_wait is not None:
                on_wait()
            time.sleep(0.02)
            waited += 0.02

    # ------------------------------------------------------------ whole-cache maintenance

    def clear(self) -> dict[str, int]:
        """Remove every unprotected entry, orphaned record and abandoned temp file. Returns counts."""
        with file_lock(self._evict_lock):
            reaped = self.reap()
            free, _ = self._scan(self.protected_names(reap=False))
            n = self.remove(p for p, _, _ in free)
            self._write_ledger(self._scan(set())[1].total_bytes)
        return {"entries": n, **reaped}


def cache_command(action: str, root: str | None = None, *, limit: int | str | None = None) -> str:
    """``info``, ``prune`` or ``clear`` on a whole cache directory (``python -m ucmagic cache``); returns a report."""
    cache = FileCache(root)
    if action == "info":
        u = cache.usage()
        return (f"{cache.root}: {format_size(u.total_bytes)} in all\n"
                f"  entries            {u.files} files, {format_size(u.bytes)}\n"
                f"  protected now      {u.protected_files} files, {format_size(u.protected_bytes)}\n"
                f"  protection records {u.records_files} files, {format_size(u.records_bytes)}\n"
                f"  temp files         {u.tmp_files} files, {format_size(u.tmp_bytes)}\n"
                f"  other              {format_size(u.other_bytes)}")
    if action == "prune":
        with cache.eviction_lock():
            r = cache.reap()
        freed = 0
        if limit is not None:
            freed = cache.evict(keep_below=parse_size(limit))
        return (f"{cache.root}: dropped {r['records']} protection record(s) of exited processes, "
                f"{r['tmp']} abandoned temp file(s), {r['old']} old-layout entries, evicted {format_size(freed)}")
    if action == "clear":
        r = cache.clear()
        return (f"{cache.root}: removed {r['entries']} entries, {r['records']} protection record(s) and "
                f"{r['tmp']} temp file(s); entries protected by running loops stay")
    raise ValueError(f"unknown cache action {action!r}: use info, prune or clear")


def _written(st: os.stat_result) -> tuple[int, int]:
    """What a fill has written so far: size and allocated blocks (ranged copies write out of order)."""
    return st.st_size, st.st_blocks


def _check_size(n: int, size: int) -> None:
    if n != size:
        raise OSError(errno.EIO, f"copied {n} bytes, the listing says {size}: the file changed while being read")


_unnamed = {"ok": hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd"), "root": -1}


def _open_unnamed(folder: str) -> int:
    """A new unnamed file (``O_TMPFILE``) in ``folder``, or -1 where the file system has none."""
    if not _unnamed["ok"]:
        return -1
    try:
        return os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600)
    except FileNotFoundError:  # tmp/ removed under us (a cleared cache directory)
        os.makedirs(folder, mode=0o700, exist_ok=True)
        return os.open(folder, os.O_TMPFILE | os.O_WRONLY, 0o600)
    except OSError as e:
        if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            _unnamed["ok"] = False  # e.g. a network file system: a named temp file instead
            return -1
        raise


def _link_unnamed(fd: int, path: str) -> None:
    """Give the unnamed file ``fd`` the new name ``path``."""
    if _unnamed["root"] < 0:
        _unnamed["root"] = os.open("/", os.O_RDONLY)  # a directory fd makes os.link call linkat(FOLLOW)
    os.link(f"/proc/self/fd/{fd}", path, src_dir_fd=_unnamed["root"], follow_symlinks=True)


def _remove_tree(path: str) -> None:
    """Delete ``path``, a directory tree or a file (what is already gone is fine)."""
    try:
        shutil.rmtree(path)
    except NotADirectoryError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    except OSError:
        if os.path.islink(path) or os.path.isfile(path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def _scandir(path: str, *, dirs: bool = False) -> list[os.DirEntry]:
    """The files directly in ``path`` (and its folders with ``dirs``); nothing if it is gone."""
    try:
        with os.scandir(path) as it:
            return [de for de in it if de.is_file(follow_symlinks=False) or (dirs and de.is_dir(follow_symlinks=False))]
    except FileNotFoundError:
        return []


def _size(de: os.DirEntry) -> int:
    try:
        return de.stat(follow_symlinks=False).st_size if de.is_file(follow_symlinks=False) else 0
    except FileNotFoundError:
        return 0


_cleanup_owners: set[str] = set()


def release_at_exit(cache: FileCache, owner: str) -> None:
    """Remove the records ``owner`` (this process) holds in ``cache`` when it exits normally.

    A process killed outright leaves them behind; every other process drops them at its next
    eviction or :meth:`FileCache.reap`, since their owner is gone.
    """
    key = cache.root + "\0" + owner
    if key in _cleanup_owners:
        return
    _cleanup_owners.add(key)
    import atexit

    atexit.register(_drop_if_owner, cache.root, owner, os.getpid())


def _drop_if_owner(root: str, owner: str, pid: int) -> None:
    if os.getpid() != pid:  # atexit handlers are inherited by forked children
        return
    prot = os.path.join(root, "prot")
    for name in _listdir(prot):
        parsed = parse_record_name(name[:-4] if name.endswith(".tmp") else name)
        if parsed and parsed[0] == owner:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(prot, name))
