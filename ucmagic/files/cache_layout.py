"""Where things sit under a cache directory: keys, entry names, the mapping of source paths into
entries, the directory layout (made private to the user) and the reaping of what dead writers and
the old layout left.

Layout under the cache root (private to the user, mode 0700)::

    files/<space>/<rel>                cached copies, one file each: a dataset root's space (a hash of
                                       its volume URI) holding each file at its relative path
                                       (map_relpath), so folders are shared; the file's mtime is a
                                       stamp of its version (version_stamp: key = a hash of volume,
                                       path, size, mtime) and its atime its last use
    files/<space>~<key16>/<rel>        another version of a file whose place in the space is taken (a
                                       rewritten source while the old copy is still cached)
    files/k/<key>-<size><.ext>         entries of an opaque key (chunks of big files, Parquet files)
    tmp/<key>.<tag>.<n>.<size>.dir     old-layout entries being removed (renamed out of files/, then deleted)
    tmp/<key>.<tag>.<n>.<size>.part    budgeted fills in progress (the room they hold)
    locks/fill.lock, evict.lock        single-flight (one byte per key, OFD lock) and eviction (flock) locks
    prot/<owner>@<writer>.<slot>.rec   protection records: entry names a live process has not consumed yet
                                       (a dataset's slot: <worker>-<the dataset object's number in the writer>)
    usage                              the byte ledger of budgeted fills (a hint, re-counted often)
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import os
import re
import shutil
import threading
import time
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from ..errors import CacheDirError, UnsafeCacheError
from .locks import CheckedDir, check_own_entries, file_lock, open_private, private_dir, process_tag, tag_alive

TMP_STALE_S = 6 * 3600.0  # a temp file whose writer cannot be identified is dropped after this long
SUBDIRS = ("files", "tmp", "locks", "prot")
INDEXES = "row-index"  # indexes built from entries (rebuilt when missing): not entries, removed by clear()
OLD_DATA = "data"  # the layout before entries kept source names (data/<xx>/<key><ext>): reaped, never served
OPAQUE = "k"  # files/k/: entries of opaque keys
SPACE = "v"  # files/v<16 hex>: a dataset root's entries (and v<16 hex>~<16 hex>: other versions)
_SPACE_RE = re.compile(r"v[0-9a-f]{16}(?:~[0-9a-f]{16})?")
STAMP_S_BITS = 30  # a version stamp's whole seconds stay below 2**30 (before 2004: never "in the future")
_SUFFIX_RE = re.compile(r"\.[A-Za-z0-9_\-]{1,16}$")


# ---------------------------------------------------------------- keys

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


def space_of(volume_uri: str) -> str:
    """The folder under ``files/`` that holds a dataset root's entries: ``v`` + 16 hex of a hash of its URI."""
    return SPACE + hashlib.blake2b(volume_uri.encode("utf-8", "surrogateescape"), digest_size=8).hexdigest()


def version_stamp(key: str) -> int:
    """The mtime (ns) an entry of ``key`` carries: 60 bits of the key, as whole seconds below
    2**30 (a date before 2004, so reads never refresh the atime that records last use) and
    nanoseconds. A lookup trusts a file only if its mtime is this stamp (to what the file system keeps)."""
    return (int(key[:8], 16) & ((1 << STAMP_S_BITS) - 1)) * 1_000_000_000 + int(key[8:16], 16) % 1_000_000_000


def version_stamps(digests: np.ndarray) -> list[int]:
    """:func:`version_stamp` of many keys at once, from their 20-byte digests (rows of ``digests``,
    uint8): a warm run's stamps without a hex parse per file."""
    if not len(digests):
        return []
    words = np.frombuffer(np.ascontiguousarray(digests[:, :8]).tobytes(), dtype=">u4").astype(np.int64)
    stamps: list[int] = ((words[0::2] & ((1 << STAMP_S_BITS) - 1)) * 1_000_000_000
                         + words[1::2] % 1_000_000_000).tolist()
    return stamps


def old_entry_name(key: str, size: int) -> str:
    """An entry's directory name in the previous layout (``files/<key>-<size>/``): reaped, never served."""
    return f"{key}-{size}"


def parse_old_entry(name: str) -> tuple[str, int] | None:
    """``(key, size)`` of a previous layout's entry directory name, else None."""
    key, _, size = name.rpartition("-")
    return (key, int(size)) if len(key) == 40 and size.isascii() and size.isdigit() else None


def is_entry_top(name: str) -> bool:
    """Whether a folder directly under ``files/`` holds entries of this layout (a space or ``k``)."""
    return name == OPAQUE or _SPACE_RE.fullmatch(name) is not None


def entry_record_names(key: str, suffix: str, size: int) -> list[str]:
    """What a protection record lists to protect the entry of opaque ``key`` (``size`` bytes)."""
    return [entry_file(key, suffix, size)]


def protection_name(name: str) -> str:
    """The name protection records use for the entry at ``name`` (its path under ``files/``): the
    name itself, without another version's ``~<key16>`` (protecting a file protects each version)."""
    head, sep, rest = name.partition("/")
    return head.partition("~")[0] + sep + rest


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


def entry_file(key: str, suffix: str, size: int, rel: str | None = None, space: str | None = None) -> str:
    """Where an entry sits under ``files/``: ``<space>/<map_relpath(rel)>`` (a file shared folders
    with the others of its dataset root), or, for an opaque key (no ``rel``), ``k/<key>-<size><suffix>``."""
    if rel is None:
        return f"{OPAQUE}/{key}-{size}{suffix}"
    if space is None:
        raise ValueError("an entry with a relative path needs its space (space_of the volume URI)")
    return f"{space}/{map_relpath(rel)}"


def other_version_file(key: str, name: str) -> str:
    """Where the entry of ``key`` goes when its place ``name`` (:func:`entry_file`) holds another
    version or is blocked (a file where it needs a folder): ``<space>~<key16>/<rel>``."""
    head, _, rest = name.partition("/")
    return f"{head}~{key[:16]}/{rest}"


def entry_files(space: str, rels: Sequence[str], *, plain: bool = False) -> list[str]:
    """:func:`entry_file` of many source files of one space (the warm path's names, a chunk at a time).
    ``plain``: every path is known to map to itself (a node listing records it), so none is checked."""
    if plain:
        return [f"{space}/{r}" for r in rels]
    return [f"{space}/{map_relpath(r)}" for r in rels]


def default_cache_dir() -> str:
    """``$UCMAGIC_CACHE_DIR``, else ``$XDG_CACHE_HOME/ucmagic``, else ``~/.cache/ucmagic``."""
    env = os.environ.get("UCMAGIC_CACHE_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ucmagic")


def cache_root(root: str | None) -> str:
    """The cache directory a ``cache_dir=`` names: ``root`` made absolute, else :func:`default_cache_dir`."""
    return os.path.abspath(os.path.expanduser(root)) if root else default_cache_dir()


def parse_tmp_name(name: str) -> tuple[str, int] | None:
    """``(writer_tag, final size)`` of a fill's temp file (``.part``) or of an entry being removed
    (``.dir``), else None."""
    parts = name.split(".")
    if len(parts) != 5 or parts[-1] not in ("part", "dir") or not parts[3].isdigit():
        return None
    return parts[1], int(parts[3])


_serial = itertools.count()


def serial() -> int:
    """A number no earlier call in this process returned (temp and record names carry it)."""
    return next(_serial)


# ---------------------------------------------------------------- the directory

_T = TypeVar("_T")
_anchors: dict[str, CheckedDir] = {}  # cache root -> the root opened by this process
_anchors_mu = threading.Lock()
_retired: list[CheckedDir] = []  # roots removed by hand: kept open for fills in flight (one per removal)


def _forget_anchors() -> None:
    """In a forked child: its copies of the parent's root descriptors are closed; it opens and checks its own."""
    global _anchors_mu
    _anchors_mu = threading.Lock()
    for d in [*_anchors.values(), *_retired]:
        d.close()
    _anchors.clear()
    _retired.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_anchors)


class CacheLayout:
    """The directories of one cache root: made (private, checked) on creation; paths of entries and
    temp files; reaping of what dead writers and the old layout left. Fills create below the root
    through :meth:`anchor`, the root's descriptor (opened once per process and checked), never by path."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.entries = os.path.join(root, "files")
        self.tmp = os.path.join(root, "tmp")
        self.locks = os.path.join(root, "locks")
        self.prot = os.path.join(root, "prot")
        self.evict_lock = os.path.join(self.locks, "evict.lock")
        self.removals = os.path.join(self.locks, "removals")
        self.ledger = os.path.join(root, "usage")
        self.indexes = os.path.join(root, INDEXES)
        self.ensure()

    def ensure(self) -> None:
        """Make the root and its folders, private to this user; refuse another user's or an unusable one."""
        fix = "use a directory of your own with cache_dir= or $UCMAGIC_CACHE_DIR"
        try:
            if os.path.isfile(self.root) and not os.path.islink(self.root):  # a plain mistake, not an attack
                raise NotADirectoryError(errno.ENOTDIR, "it is a file, not a directory")
            # the root itself (never through a link): a folder of this user's that others could write
            # to is made 0700, and then nothing in it may be a link or another user's (planted meanwhile)
            private_dir(self.root, tighten=True, what="cache directory", fix=fix)
            check_own_entries(self.root, fix=f"remove it (or the whole cache directory), or {fix}")
            for sub in SUBDIRS:
                private_dir(os.path.join(self.root, sub), what="cache folder",
                            fix=f"remove it (or the whole cache directory {self.root}), or {fix}")
            if not os.access(self.root, os.W_OK | os.X_OK):  # e.g. a read-only mount (EROFS)
                raise PermissionError(errno.EACCES, "not writable")
        except UnsafeCacheError:
            raise
        except OSError as exc:
            raise self.unusable(exc) from exc

    def anchor(self, *, stale: int = -1) -> int:
        """The cache root's directory descriptor in this process, opened once and checked (a real folder of
        this user's that no one else may write to, nor to a folder above it: :class:`CheckedDir`): fills make
        their temp files, folders and names relative to it (``dir_fd``, no link followed), so a root renamed
        and replaced by a link afterwards cannot receive them. ``stale``: the descriptor that found the root
        (or ``tmp/``) removed; the directory is made anew and opened again, once for all the threads that
        found it so. The stale descriptor stays open (a fill in flight may still use it: closed, its number
        could be reused by another file under it)."""
        got = _anchors.get(self.root)  # no system call on the fill path: a forked child forgets the parent's
        if got is not None and got.fd != stale:
            return got.fd
        with _anchors_mu:
            got = _anchors.get(self.root)
            if got is not None and got.fd != stale:  # another thread made it anew meanwhile
                return got.fd
            if stale >= 0:
                self.ensure()
            fresh = CheckedDir.open(self.root, what="cache directory",
                                    fix="use a directory of your own with cache_dir= or $UCMAGIC_CACHE_DIR")
            _anchors[self.root] = fresh
            if got is not None:
                _retired.append(got)
            return fresh.fd

    def at_root(self, op: Callable[[int], _T]) -> _T:
        """``op(root descriptor)``; where it finds nothing (``FileNotFoundError``: ``tmp/`` or the whole cache
        directory removed by hand meanwhile), the directory is made anew, opened again and ``op`` retried once."""
        root = self.anchor()
        try:
            return op(root)
        except FileNotFoundError:
            return op(self.anchor(stale=root))

    @contextlib.contextmanager
    def evicting(self, shared: bool = False) -> Iterator[None]:
        """The eviction lock (``locks/evict.lock``; ``shared``: a record's writer). A cache directory
        removed by hand meanwhile is made again first, instead of failing on its missing lock file."""
        with contextlib.ExitStack() as stack:
            try:
                stack.enter_context(file_lock(self.evict_lock, shared=shared))
            except FileNotFoundError:
                self.ensure()
                stack.enter_context(file_lock(self.evict_lock, shared=shared))
            yield

    def unusable(self, exc: OSError) -> CacheDirError:
        """The error for a cache root that cannot be used (``exc``: why)."""
        reason = "it is a file, not a directory" if os.path.isfile(self.root) else (exc.strerror or str(exc))
        return CacheDirError(f"cannot use {self.root} as the cache directory: {reason}. Set cache_dir= (or "
                             "$UCMAGIC_CACHE_DIR) to a writable local directory")

    def data_path(self, key: str, suffix: str, size: int, rel: str | None = None, space: str | None = None) -> str:
        """Where the entry of ``key`` (``size`` bytes) is or will be: ``files/`` + :func:`entry_file`."""
        return self.entries + os.sep + entry_file(key, suffix, size, rel, space)

    def entry_of(self, path: str) -> str | None:
        """The name under ``files/`` of the entry whose file is ``path`` (a path a lookup returned),
        else None."""
        head = self.entries + os.sep
        path = os.path.abspath(path)
        if not path.startswith(head):
            return None
        name = path[len(head):]
        top, _, inner = name.partition(os.sep)
        return name if inner and is_entry_top(top) else None

    def drop_entry(self, name: str) -> bool:
        """Remove the entry ``name`` (under ``files/``), then its folders left empty."""
        path = self.entries + os.sep + name
        try:
            os.unlink(path)
        except (FileNotFoundError, NotADirectoryError):
            return False
        except IsADirectoryError:
            remove_tree(path)
        parent = os.path.dirname(path)
        while len(parent) > len(self.entries):
            try:
                os.rmdir(parent)  # a fill making this folder meanwhile retries its link (see FileCache._place)
            except OSError:
                break
            parent = os.path.dirname(parent)
        return True

    def tmp_path(self, key: str, size: int, kind: str) -> str:
        """A new name under ``tmp/`` for ``key`` (``kind``: ``part``, a fill's copy, or ``dir``, an
        entry being removed), carrying this process's tag and the final ``size`` (counts include it)."""
        return os.path.join(self.tmp, f"{key}.{process_tag()}.{serial()}.{size}.{kind}")

    def reap_tmp(self) -> int:
        """Remove temp files and removed entries of dead writers (or, unnamed, stale ones). Returns the count."""
        n = 0
        now = time.time()
        alive: dict[str, bool] = {}
        for de in scandir(self.tmp, dirs=True):
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
                    remove_tree(de.path)
                    n += 1
            except OSError:
                pass
        return n

    def reap_old_layout(self, protected: set[str]) -> int:
        """Remove the old layouts' entries (``data/<xx>/<key><ext>``, ``files/<key>-<size>/``: never
        served) that no live process of an older ucmagic protects, and ``data/``'s folders once
        empty. Returns the count."""
        old = os.path.join(self.root, OLD_DATA)
        n = 0
        for bucket in scandir(old, dirs=True):
            for de in scandir(bucket.path) if bucket.is_dir(follow_symlinks=False) else [bucket]:
                if de.name not in protected:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(de.path)
                        n += 1
            with contextlib.suppress(OSError):
                os.rmdir(bucket.path)
        with contextlib.suppress(OSError):
            os.rmdir(old)
        for de in scandir(self.entries, dirs=True):
            if parse_old_entry(de.name) is not None and de.name not in protected:
                gone = self.tmp_path(de.name, 0, "dir")  # renamed out whole, so no reader sees it half gone
                with contextlib.suppress(OSError):
                    os.rename(de.path, gone)
                    remove_tree(gone)
                    n += 1
        return n


class KeptOpen:
    """This process's descriptors of small files rewritten often (records, the removal token), kept
    open: reopened after a fork (a child must not write through its parent's) or once the file was
    removed. Each descriptor is kept with the identity (device, inode) of the file it opened: one that
    no longer names that file (closed elsewhere, and its number reused) is forgotten, never written
    through nor closed, and the file is opened again."""

    RETIRED_KEPT = 16
    """Descriptors of removed files kept open a while before they are closed: another thread may have taken one a
    moment ago and still be writing through it (a close under it made that write fail with EBADF, or land in
    whatever file next got the number); by the time 16 more were retired, no write that took it is running."""

    def __init__(self) -> None:
        self._fds: dict[str, tuple[int, int, int]] = {}  # path: (fd, st_dev, st_ino)
        self._retired: list[tuple[int, int, int]] = []  # descriptors of removed files, closed later (RETIRED_KEPT)
        self._pid = os.getpid()

    @staticmethod
    def _still_ours(got: tuple[int, int, int]) -> os.stat_result | None:
        """The descriptor's stat when it still names the file it opened; None when it was closed elsewhere
        (and its number maybe reused): not ours to write through or close."""
        fd, dev, ino = got
        try:
            st = os.fstat(fd)
        except OSError:
            return None
        return st if (st.st_dev, st.st_ino) == (dev, ino) else None

    def _current(self, path: str) -> int | None:
        """The kept descriptor of ``path`` if it still names the file it opened and that file is not removed."""
        got = self._fds.get(path)
        if got is None:
            return None
        st = self._still_ours(got)
        if st is None:
            if self._fds.get(path) == got:
                del self._fds[path]
            return None
        if st.st_nlink == 0:  # removed meanwhile (e.g. by clear_cache): forgotten now, closed later
            if self._fds.get(path) == got:
                del self._fds[path]
                self._retire(got)
            return None
        return got[0]

    def _retire(self, got: tuple[int, int, int]) -> None:
        """Keep ``got`` open until :data:`RETIRED_KEPT` newer ones are retired, then close the oldest (if it still
        names its file: a number reused elsewhere is not ours)."""
        self._retired.append(got)
        while len(self._retired) > self.RETIRED_KEPT:
            self._close_kept(self._retired.pop(0))

    def _close_kept(self, got: tuple[int, int, int]) -> None:
        """Close a kept descriptor if it still names the file it opened (a reused number is someone else's)."""
        if self._still_ours(got) is not None:
            with contextlib.suppress(OSError):
                os.close(got[0])

    def fd(self, path: str) -> int:
        """The open descriptor of ``path`` (created if missing; FileNotFoundError if its folder is gone)."""
        pid = os.getpid()
        if self._pid != pid:
            self._fds, self._retired, self._pid = {}, [], pid
        fd = self._current(path)
        if fd is None:
            fd = open_private(path)  # never through a link planted in its place
            st = os.fstat(fd)
            kept = self._fds.setdefault(path, (fd, st.st_dev, st.st_ino))  # shared by a process's datasets:
            if kept[0] != fd:  # another thread may have opened it meanwhile; one descriptor is kept
                os.close(fd)
                fd = kept[0]
        return fd

    def close(self, path: str) -> None:
        if self._pid == os.getpid():
            got = self._fds.pop(path, None)
            if got is not None:
                self._close_kept(got)


class RemovalToken:
    """A token that changes whenever an entry is removed from the cache (any process): a few random
    bytes in ``locks/removals``, rewritten before and after entries are unlinked."""

    def __init__(self, path: str, kept: KeptOpen) -> None:
        self.path = path
        self.kept = kept

    def read(self) -> bytes:
        """The current token; a different value each time the cache directory is made anew."""
        try:
            fd = self.kept.fd(self.path)  # reopened when the directory was removed under us
        except FileNotFoundError:
            return os.urandom(8)  # no cache directory: never equal to what was seen before
        token = os.pread(fd, 8, 0)
        if not token:  # a new file: a new token (another process may write one too)
            os.pwrite(fd, os.urandom(8), 0)
            token = os.pread(fd, 8, 0)
        return token

    def change(self) -> None:
        """Change the token: called before and after entries are unlinked."""
        with contextlib.suppress(FileNotFoundError):
            os.pwrite(self.kept.fd(self.path), os.urandom(8), 0)


# ---------------------------------------------------------------- directory reads that tolerate removal

def remove_tree(path: str) -> None:
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


def listdir(path: str) -> list[str]:
    """The names in ``path``; nothing if it is gone."""
    try:
        return os.listdir(path)
    except FileNotFoundError:
        return []


def scandir(path: str, *, dirs: bool = False) -> list[os.DirEntry[str]]:
    """The files directly in ``path`` (and its folders with ``dirs``); nothing if it is gone."""
    try:
        with os.scandir(path) as it:
            return [de for de in it if de.is_file(follow_symlinks=False) or (dirs and de.is_dir(follow_symlinks=False))]
    except FileNotFoundError:
        return []


def file_size(de: os.DirEntry[str]) -> int:
    """Apparent size of a file entry (0 for a folder or one gone meanwhile)."""
    try:
        return de.stat(follow_symlinks=False).st_size if de.is_file(follow_symlinks=False) else 0
    except FileNotFoundError:
        return 0
