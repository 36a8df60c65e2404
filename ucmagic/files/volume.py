"""Volumes: resolve a path or URL, list its files with size and mtime, copy one file out.

A volume is a storage backend: a local or mounted directory (``/Volumes/...`` on Databricks, NFS, a
FUSE mount) or an fsspec URL (``s3://``, ``memory://``...). Datasets and staging only read from it;
checkpoints and exports write through its atomic write side (:meth:`Volume.write_bytes`...).
"""
from __future__ import annotations

import abc
import builtins  # `list` in Volume annotations is the method
import contextlib
import errno
import hashlib
import itertools
import os
import re
import shutil
import stat as stat_mod
import time
from collections import deque
from functools import cached_property, lru_cache
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Sequence, Union

from . import ranged
from .._util import (FILL_BUFFER, LOCAL_DISK_FS, DaemonPool, atomic_target, atomic_write, copy_fds, copy_file_to_path,
                     copy_local, is_remote_url, mount_fs_type, open_emptied, path_under, wait_result)
from .locks import refuse_links_below
from ..errors import (EmptyListingError, FetchError, InvalidArgumentError, SourceChangedError, SourceNotADirectoryError,
                      SourceNotFoundError, UnreadableDirectoryError, UnsafeSourceError)

# A directory read faster than this (seconds: a fixed part plus one per entry) is "local and
# cached": the listing goes on reading on one thread, as threads contending for the GIL cost more
# than they save there. The first slower one (a network mount, an uncached disk) starts the pool.
FAST_DIR_S, FAST_ENTRY_S = 0.002, 20e-6


def _register_protocols() -> None:
    """Fallback for ``slow://`` when ucmagic's fsspec entry point is missing.

    ``slow://`` (the simulator, :mod:`ucmagic.testing`) reaches fsspec through the entry point in
    pyproject.toml (``[project.entry-points."fsspec.specs"]``). Its metadata is absent when ucmagic runs
    from a source tree on ``PYTHONPATH`` or from an install made before the entry point existed
    (``pip install -e .`` adds it); spawned DataLoader workers need the protocol then too, and every
    process that unpickles a volume imports this module. A class path string: nothing is imported."""
    import fsspec

    if "slow" not in fsspec.available_protocols():
        fsspec.register_implementation("slow", "ucmagic.testing.SlowFileSystem")


_register_protocols()


class FileEntry(NamedTuple):
    """One file of a listing: path relative to the volume root (POSIX separators), size, mtime."""

    path: str
    size: int
    mtime: float


class DirScan(NamedTuple):
    """One step of a streaming listing (:meth:`Volume.scan`): the files found in one directory.

    ``dir`` is relative to the volume root (``""`` for the root); ``mtime_ns`` is the directory's
    mtime taken *before* it was read (``-1`` where the volume keeps no directory mtimes);
    ``files`` are the matching files directly in it, with paths relative to the root.
    """

    dir: str
    mtime_ns: int
    files: list[FileEntry]


# ---------------------------------------------------------------- glob patterns (pure)

@lru_cache(maxsize=128)
def compile_pattern(pattern: str, *, anchored: bool = False) -> re.Pattern[str]:
    """Translate a glob into a regex over relative POSIX paths.

    ``*`` and ``?`` stay inside one path segment, ``**`` spans segments (``**/`` also matches
    nothing), ``[abc]`` is a character class. A pattern without ``/`` matches the file name at any
    depth (``"*.jpg"`` finds every JPEG in the tree), like ``.gitignore``; with ``anchored`` it
    matches from the root only, as a shell (and fsspec's ``glob``) does.
    """
    pat = pattern.strip().lstrip("/") if pattern.startswith("/") else pattern.strip()
    if "/" not in pat and not anchored:
        pat = "**/" + pat
    out: list[str] = []
    i, n = 0, len(pat)
    while i < n:
        c = pat[i]
        if pat.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pat.startswith("**", i):
            out.append(".*")
            i += 2
        elif c == "*":
            out.append("[^/]*")
            i += 1
        elif c == "?":
            out.append("[^/]")
            i += 1
        elif c == "[":
            j = pat.find("]", i + 2 if pat[i + 1:i + 2] in ("!", "]") else i + 1)
            if j < 0:
                out.append(re.escape(c))
                i += 1
                continue
            body = pat[i + 1:j]
            if body.startswith("!"):
                body = "^" + body[1:]
            out.append("[" + body.replace("\\", "\\\\") + "]")
            i = j + 1
        else:
            out.append(re.escape(c))
            i += 1
    return re.compile("".join(out) + r"\Z")


def filter_entries(entries: Iterable[FileEntry], pattern: str | None) -> list[FileEntry]:
    """Keep the entries matching ``pattern`` (all when None), sorted by path."""
    rx = compile_pattern(pattern) if pattern else None
    return sorted((e for e in entries if rx is None or rx.match(e.path)), key=lambda e: e.path)


def is_safe_rel(rel: str) -> bool:
    """True for a relative path whose parts are plain names (no ``..``, ``.``, empty part or NUL).

    Some object stores accept keys such as ``a/../../x``; joined to a destination directory they
    would point outside it, so listings drop them.
    """
    return bool(rel) and "\0" not in rel and not rel.startswith("/") and \
        all(part not in ("", ".", "..") for part in rel.split("/"))


def fingerprint_rows(chunks: Iterable[tuple[Sequence[bytes], Sequence[int]]]) -> str:
    """The listing fingerprint (one home): SHA-256 of ``path\\0size\\n`` rows, 16 hex digits. Fed in
    chunks of (UTF-8 paths, sizes), each joined into one buffer: one hash update per chunk, not two per
    file (the listing feeds its Arrow columns 64K rows at a time)."""
    h = hashlib.sha256()
    for paths, sizes in chunks:
        h.update(b"".join([p + b"\0%d\n" % s for p, s in zip(paths, sizes)]))
    return h.hexdigest()[:16]


def listing_fingerprint(entries: Iterable[FileEntry]) -> str:
    """A short stable hash of a listing's paths and sizes (resume states carry it)."""
    rows = iter(entries)

    def chunks() -> Iterator[tuple[list[bytes], list[int]]]:
        while part := list(itertools.islice(rows, 1 << 16)):
            yield [e.path.encode("utf-8", "surrogateescape") for e in part], [e.size for e in part]
    return fingerprint_rows(chunks())


# ---------------------------------------------------------------- path resolution

def _volume_parts(p: str) -> tuple[str, str, str, list[str]] | None:
    """(catalog, schema, volume, rest) of an absolute ``/Volumes/<catalog>/<schema>/<volume>/...`` path."""
    parts = p.split(os.sep)
    if len(parts) >= 5 and parts[0] == "" and parts[1] == "Volumes" and all(parts[2:5]):
        return parts[2], parts[3], parts[4], parts[5:]
    return None


def _catalog_volume_dir(catalog: str, schema: str, volume: str) -> str | None:
    root = os.environ.get("UCMAGIC_CATALOG_ROOT")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), catalog, schema, "volumes", volume) if root else None


def resolve_local_path(path: str) -> str:
    """Map ``/Volumes/<catalog>/<schema>/<volume>/...`` to a real path, leniently (never raises).

    The path itself wins when it or its volume exists (on Databricks ``/Volumes`` is a FUSE mount);
    otherwise it resolves under ``$UCMAGIC_CATALOG_ROOT/<catalog>/<schema>/volumes/<volume>/...``
    when that variable is set. Other paths are returned absolute and user-expanded.
    """
    p = os.path.abspath(os.path.expanduser(path))
    vol = _volume_parts(p)
    if vol is None or os.path.exists(p) or os.path.isdir(os.sep.join(p.split(os.sep)[:5])):
        return p
    mapped = _catalog_volume_dir(*vol[:3])
    return os.path.join(mapped, *vol[3]) if mapped else p


def local_path(path: str | os.PathLike[str]) -> str:
    """The real local path of ``path``, for code that opens files itself (``torch.save``, Hugging Face).

    ``/Volumes/<catalog>/<schema>/<volume>/...`` is returned unchanged where the volume is mounted
    (Databricks); elsewhere it maps under ``$UCMAGIC_CATALOG_ROOT/<catalog>/<schema>/volumes/<volume>/``.
    The file itself need not exist (glob patterns work too), but its volume must:
    :class:`SourceNotFoundError` says which directory is missing and what to set. Other paths come
    back absolute and user-expanded::

        torch.save(state, ucmagic.local_path("/Volumes/main/default/ckpt/model.pt"))
    """
    given = os.fspath(path)
    vol = _volume_parts(os.path.abspath(os.path.expanduser(given)))
    if vol is not None:
        catalog, schema, volume, _ = vol
        mapped = _catalog_volume_dir(catalog, schema, volume)
        if not os.path.isdir(f"/Volumes/{catalog}/{schema}/{volume}") and not (mapped and os.path.isdir(mapped)):
            raise SourceNotFoundError(f"{given}: volume not found; {missing_path_hint(given)}")
    return resolve_local_path(given)


def missing_path_hint(path: str) -> str:
    """What to do about a missing ``path``: for ``/Volumes/...``, which directory was looked for and why."""
    vol = _volume_parts(os.path.abspath(os.path.expanduser(path)))
    if vol is None:
        return "check the path"
    catalog, schema, volume, _ = vol
    mapped = _catalog_volume_dir(catalog, schema, volume)
    if mapped is None:
        return (f"/Volumes/{catalog}/{schema}/{volume} is not mounted here (outside Databricks); set "
                "UCMAGIC_CATALOG_ROOT to a local directory that holds <catalog>/<schema>/volumes/<volume>/")
    if not os.path.isdir(mapped):
        return (f"UCMAGIC_CATALOG_ROOT is set, but the volume directory {mapped} does not exist: create it "
                f"(mkdir -p {mapped}) or check the catalog, schema and volume names")
    return f"the volume maps to {mapped}, which exists; check the rest of the path"


def existing_local_path(path: str) -> str:
    """:func:`resolve_local_path`, or :class:`SourceNotFoundError` naming ``path`` and the fix."""
    real = resolve_local_path(path)
    if not os.path.exists(real):
        raise SourceNotFoundError(f"{path} does not exist: {missing_path_hint(path)}")
    return real


class Volume(abc.ABC):
    """A storage backend: list files, copy one to a local path, and write (checkpoints, exports).

    ``uri`` identifies the volume; every ``rel`` is a POSIX path relative to its root. A backend is
    one subclass plus one :func:`register_volume` call (docs/backends.md). Copies of files of at
    least ``range_threshold`` bytes read ``range_size`` ranges on several streams at once
    (:mod:`ucmagic.files.ranged`); set these attributes on an instance to tune them.
    """

    uri: str
    range_threshold: int = ranged.THRESHOLD
    range_size: int = ranged.RANGE_SIZE
    range_chunk: int = ranged.CHUNK
    range_retries: int = 3
    keeps_dir_mtimes = False  # True where adding or removing a file changes its directory's mtime
    unreadable = "raise"  # a directory under the root that cannot be read: "raise" or "skip" (with a warning)
    # A symlinked file in the tree: listed only when it points inside the root ("inside"), always
    # ("all") or never ("none"); one pointing outside is left out with one warning per listing naming
    # it, or raises UnsafeSourceError where outside_links = "raise". Symlinked folders are never walked.
    follow_symlinks = "inside"
    outside_links = "warn"
    # Folders under the root (relative paths) that listings leave out: a dataset's own cache
    # directory when it lies inside the dataset's root (its copies are not data).
    skip_dirs: frozenset[str] = frozenset()
    atomic_rename = False  # True where rename() is atomic; else it is a copy then a delete
    # The local directory that holds the files where they live on this machine (staging refuses a
    # destination inside it); None for remote storage.
    local_root: str | None = None

    @property
    def local_disk(self) -> bool:
        """True where reads come from this machine's own disks or memory (see ``LOCAL_DISK_FS``): a
        read cannot hang on a network or a server, so quick fills may run on the loop's own thread."""
        return False

    def local_file(self, rel: str) -> str | None:
        """A local path to read ``rel`` from directly with plain reads, or None where reads must go
        through :meth:`copy_to` (remote storage, and the simulator, whose reads carry its latency)."""
        return None

    @classmethod
    def from_path(cls, path: str, storage_options: dict[str, Any] | None = None) -> Volume:
        """The volume at ``path`` (how :func:`open_volume` builds a registered backend). Raise
        :class:`SourceNotFoundError` when it does not exist and :class:`SourceNotADirectoryError` when it is
        a file. Default: ``cls(path, storage_options)``."""
        return cls(path, storage_options)  # type: ignore[call-arg]

    @abc.abstractmethod
    def list(self, pattern: str | None = None) -> builtins.list[FileEntry]:
        """Every file under the root matching ``pattern``, sorted by path; :class:`EmptyListingError` if none."""

    def scan(self, pattern: str | None = None) -> Iterator[DirScan]:
        """Streaming, unsorted listing: one :class:`DirScan` per directory as it is read (an empty
        volume yields nothing). Volumes without a streaming scan yield their whole listing once."""
        try:
            files = self.list(pattern)
        except EmptyListingError:
            return
        yield DirScan("", -1, files)

    @abc.abstractmethod
    def copy_to(self, rel: str, dest: str, *, expect: FileEntry | None = None) -> int:
        """Copy ``rel`` to the local path ``dest``; return the number of bytes written.

        With ``expect`` (the listing's entry for ``rel``): a file of at least ``range_threshold``
        bytes is copied by parallel ranged reads, and a source whose size or mtime no longer match
        ``expect`` after the copy raises :class:`SourceChangedError` (``dest`` may then hold mixed
        bytes: discard it).
        """

    @abc.abstractmethod
    def stat(self, rel: str) -> FileEntry:
        """The file's current size and mtime (never from a cached listing)."""

    @abc.abstractmethod
    def range_reader(self, rel: str) -> ranged.RangeReader:
        """A new read stream on ``rel`` for :func:`ucmagic.files.ranged.ranged_copy`."""

    # ------------------------------------------------ the write side (checkpoints, exports)

    @abc.abstractmethod
    def write_bytes(self, rel: str, data: bytes) -> None:
        """Create or replace ``rel`` with ``data`` atomically: it appears whole or not at all."""

    @abc.abstractmethod
    def upload(self, local_path: str, rel: str) -> None:
        """Copy the local file ``local_path`` to ``rel`` atomically (as :meth:`write_bytes`)."""

    @abc.abstractmethod
    def read_bytes(self, rel: str) -> bytes:
        """The whole content of ``rel`` (:class:`FileNotFoundError` if it does not exist)."""

    @abc.abstractmethod
    def exists(self, rel: str) -> bool:
        """True when ``rel`` is a file or a directory (asked now, never from a cached listing)."""

    @abc.abstractmethod
    def makedirs(self, rel: str) -> None:
        """Create directory ``rel`` and its parents (present ones are fine); a no-op where directories do not
        exist (object stores)."""

    @abc.abstractmethod
    def remove(self, rel: str, *, missing_ok: bool = True) -> None:
        """Delete the file ``rel``; a missing one raises :class:`FileNotFoundError` only when not ``missing_ok``."""

    @abc.abstractmethod
    def remove_tree(self, rel: str) -> None:
        """Delete ``rel`` and everything under it (nothing there is fine)."""

    @abc.abstractmethod
    def rename(self, src_rel: str, dst_rel: str) -> None:
        """Move ``src_rel`` to ``dst_rel``, replacing a file there: atomic where :attr:`atomic_rename`,
        else a copy then a delete (a reader may see both names for a moment, never a partial file)."""

    @abc.abstractmethod
    def list_names(self, rel: str) -> builtins.list[str]:
        """Names (files and directories) directly under ``rel``, sorted; ``[]`` when it does not exist."""

    def ranged_copy(self, rel: str, dest: str, expect: FileEntry) -> int:
        """Copy ``rel`` (listed as ``expect``) by parallel ranged reads, refusing a source that changed."""
        check_unchanged(self, expect, self.stat(rel))  # changed since the listing: copy nothing
        try:
            n = ranged.ranged_copy(lambda: self.range_reader(rel), expect.size, dest, range_size=self.range_size,
                                   chunk=self.range_chunk, retries=self.range_retries)
        except Exception as exc:
            try:
                now: FileEntry | None = self.stat(rel)
            except OSError:
                now = None
            if now is not None:
                check_unchanged(self, expect, now, cause=exc)
            raise
        check_unchanged(self, expect, self.stat(rel))
        return n

    def display(self, rel: str = "") -> str:
        return self.uri.rstrip("/") + ("/" + rel if rel else "")

    def _tuning(self) -> dict[str, Any]:
        """Range settings set on this instance (they travel with it to worker processes)."""
        return {k: v for k, v in vars(self).items() if k.startswith("range_")}

    def empty_listing_error(self, pattern: str | None) -> EmptyListingError:
        """The error for a listing of this volume that matched nothing."""
        what = f"matching {pattern!r} " if pattern else ""
        return EmptyListingError(
            f"no files {what}under {self.display()}: check the path and the pattern "
            "(patterns are globs such as '**/*.jpg'; a pattern without '/' matches file names at any depth)"
        )

    def _check_listing(self, entries: builtins.list[FileEntry], pattern: str | None) -> builtins.list[FileEntry]:
        if not entries:
            raise self.empty_listing_error(pattern)
        return entries


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
        real = existing_local_path(path)
        if not os.path.isdir(real):
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
        outside = self._outside
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
                        if stat_mod.S_ISREG(st.st_mode) and de.is_symlink() and not self._link_allowed(de.path):
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

    @property
    def _outside(self) -> builtins.list[str]:
        """Symlinks left out of the listing in progress (pointing outside the root)."""
        got: builtins.list[str] = self.__dict__.setdefault("_outside_links", [])
        return got

    def _link_allowed(self, path: str) -> bool:
        """Whether the symlinked file at ``path`` is listed under :attr:`follow_symlinks`."""
        if self.follow_symlinks == "all":
            return True
        if self.follow_symlinks == "none":
            return False
        return path_under(path, self.root) not in (None, ".")

    def _report_outside(self) -> None:
        """One warning (or :class:`UnsafeSourceError`) for the links a listing left out, naming them."""
        links = sorted(self.__dict__.pop("_outside_links", None) or [])
        if not links or self.follow_symlinks == "none":
            return
        named = ", ".join(links[:5]) + (f" and {len(links) - 5} more" if len(links) > 5 else "")
        msg = (f"{len(links)} symlink(s) in {self.root} point outside it and were left out: {named}. "
               "Pass follow_symlinks='all' if you trust this tree")
        if self.outside_links == "raise":
            raise UnsafeSourceError(msg + ", or on_error='skip' to leave them out")
        import warnings

        warnings.warn("ucmagic: " + msg, stacklevel=3)

    def scan(self, pattern: str | None = None) -> Iterator[DirScan]:
        """Directories yielded as read: on this thread while they read fast, then concurrently
        (each readdir on a network mount is slow) from the first slow one on. Symlinked files are
        listed per :attr:`follow_symlinks`; those left out are reported once, at the end."""
        self.__dict__["_outside_links"] = []
        yield from self._scan(pattern)
        self._report_outside()

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
        # the descriptors stay ours: the source's is fstat-ed after the copy (the one local copy loop: copy_fds)
        fsrc = os.open(os.path.join(self.root, rel), os.O_RDONLY | os.O_CLOEXEC)
        try:
            fdst = open_emptied(dest)
            try:
                n = copy_fds(fsrc, fdst, size=None if expect is None else expect.size, buffer_size=FILL_BUFFER)[0]
            finally:
                os.close(fdst)
            if expect is not None:  # the file this handle read (a rename over it mid-copy leaves it intact)
                st = os.fstat(fsrc)
                check_unchanged(self, expect, FileEntry(rel, st.st_size, st.st_mtime))
        finally:
            os.close(fsrc)
        return n

    def range_reader(self, rel: str) -> ranged.RangeReader:
        return _FdReader(os.path.join(self.root, rel))

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    def local_file(self, rel: str) -> str | None:
        return self._path(rel)

    def _target(self, rel: str, *, whole: bool = False) -> str:
        """The local path of ``rel`` to write or remove: refused (:class:`UnsafeDirectoryError`) when a
        folder on the way from the root (and ``rel`` itself with ``whole``) is a symbolic link, which
        could send the write anywhere (a checkpoint or export root others could write to). The last
        component of a file is replaced by a rename, never followed."""
        refuse_links_below(self.root, _writable(rel), whole=whole)
        return self._path(rel)

    def write_bytes(self, rel: str, data: bytes) -> None:
        _local_put(self._target(rel), data)

    def upload(self, local_path: str, rel: str) -> None:
        _local_put(self._target(rel), src=local_path)

    def read_bytes(self, rel: str) -> bytes:
        with open(self._path(rel), "rb") as f:
            return f.read()

    def exists(self, rel: str) -> bool:
        return os.path.exists(self._path(rel))

    def makedirs(self, rel: str) -> None:
        os.makedirs(self._target(rel, whole=True) if rel else self.root, exist_ok=True)

    def remove(self, rel: str, *, missing_ok: bool = True) -> None:
        _local_remove(self._target(rel), missing_ok)

    def remove_tree(self, rel: str) -> None:
        _local_remove_tree(self._target(rel))

    def rename(self, src_rel: str, dst_rel: str) -> None:
        _local_rename(self._target(src_rel), self._target(dst_rel))

    def list_names(self, rel: str) -> builtins.list[str]:
        return _local_names(self._path(rel))


# ---------------------------------------------------------------- local write side (LocalVolume, local fsspec)

def _writable(rel: str) -> str:
    """``rel`` itself when it names something under the root (never the root, never outside it)."""
    if not is_safe_rel(rel):
        raise ValueError(f"{rel!r} is not a relative path under the volume root (no '..', '.' or empty parts)")
    return rel


def _fsync_dir(path: str) -> None:
    """Make a rename or creation in directory ``path`` durable (a no-op where directories cannot be synced)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _local_put(path: str, data: bytes | None = None, *, src: str | None = None) -> None:
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
    _fsync_dir(folder)


def _local_remove(path: str, missing_ok: bool) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


def _local_remove_tree(path: str) -> None:
    try:
        shutil.rmtree(path)
    except NotADirectoryError:
        _local_remove(path, True)
    except FileNotFoundError:
        pass


def _local_rename(src: str, dst: str) -> None:
    folder = os.path.dirname(dst)
    if not os.path.isdir(folder):
        os.makedirs(folder, exist_ok=True)
    os.replace(src, dst)
    _fsync_dir(folder)
    if os.path.dirname(src) != folder:
        _fsync_dir(os.path.dirname(src))


def _local_names(path: str) -> list[str]:
    try:
        return sorted(os.listdir(path))
    except (FileNotFoundError, NotADirectoryError):
        return []


def info_mtime(info: dict[str, Any]) -> float:
    """A file's modification time from an fsspec ``info()`` dict, whichever key the backend uses."""
    for k in ("mtime", "LastModified", "last_modified", "modified", "created", "updated"):
        v = info.get(k)
        if v is None:
            continue
        if hasattr(v, "timestamp"):
            return float(v.timestamp())
        try:
            return float(v)
        except (TypeError, ValueError):
            continue
    # No time known: fall back to the content tag so a changed object still gets a new cache key.
    tag = str(info.get("ETag") or info.get("etag") or info.get("md5") or "")
    return float(int(hashlib.sha1(tag.encode(), usedforsecurity=False).hexdigest()[:12], 16)) if tag else 0.0


class FsspecVolume(Volume):
    """Any fsspec filesystem (``s3://bucket/prefix``, ``memory://``, ``slow://`` ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.url = url
        self.storage_options = dict(storage_options or {})
        self.root: str
        proto = url.split("://", 1)[0]
        if "::" not in url and proto.lower() not in fsspec.available_protocols():
            raise InvalidArgumentError(
                f"cannot open {url}: no file system handles {proto}://. Give a local directory, a /Volumes/... "
                "path or a URL of a file system fsspec knows (s3://, gs://, abfs://, ...), or register a backend "
                "for it with ucmagic.register_volume (docs/backends.md)")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(url, **self.storage_options)
        except ImportError as exc:  # the protocol's fsspec implementation is not installed
            extra = {"s3": "s3", "s3a": "s3"}.get(proto)
            how = (f"pip install 'ucmagic[{extra}]'" if extra
                   else f"install the fsspec implementation of {proto}:// (see the fsspec docs)")
            raise ImportError(f"cannot open {url}: {exc}: {how}") from exc
        self.root = self.root.rstrip("/")
        proto = self.fs.protocol[0] if isinstance(self.fs.protocol, (tuple, list)) else self.fs.protocol
        self.uri = f"{proto}://{self.root}"
        from fsspec.implementations.local import LocalFileSystem

        if isinstance(self.fs, LocalFileSystem):  # local files behind fsspec (``slow://``, ``local://``)
            self.local_root = "/" + self.root.lstrip("/")
            self.atomic_rename = True

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.url, self.storage_options), self._tuning())

    @classmethod
    def from_path(cls, path: str, storage_options: dict[str, Any] | None = None) -> Volume:
        """An fsspec URL naming a directory (a prefix on object stores)."""
        vol = cls(path, storage_options)
        try:
            exists, isdir = vol.fs.exists(vol.root), vol.fs.isdir(vol.root)
        except Exception as e:  # a backend that cannot answer: let listing report the real error
            raise SourceNotFoundError(f"cannot reach {path}: {e}") from e
        if not exists:
            raise SourceNotFoundError(f"{path} does not exist: check the URL and your credentials")
        if not isdir:
            raise SourceNotADirectoryError(f"{path} is a file, not a directory: "
                                           "pass the directory that holds your files")
        return vol

    def list(self, pattern: str | None = None) -> list[FileEntry]:
        found = self.fs.find(self.root, detail=True)
        prefix = self.root + "/" if self.root else ""
        files = []
        for full, info in found.items():
            if info.get("type", "file") != "file":
                continue
            full = full.rstrip("/")
            rel = full[len(prefix):] if full.startswith(prefix) else full.split(self.root, 1)[-1].lstrip("/")
            if self.skip_dirs and any(rel.startswith(d + "/") for d in self.skip_dirs):
                continue
            if not is_safe_rel(rel):
                import warnings

                warnings.warn(f"ucmagic: ignoring {self.display(rel)!r}: its name has '..', '.' or empty parts "
                              "and could point outside a destination directory", stacklevel=2)
                continue
            files.append(FileEntry(rel, int(info.get("size") or 0), info_mtime(info)))
        return self._check_listing(filter_entries(files, pattern), pattern)

    range_chunk = 4 << 20  # a read call is a request to the store: fewer, bigger ones

    def stat(self, rel: str) -> FileEntry:
        full = self.root + "/" + rel
        self.fs.invalidate_cache(full)  # a listing cache (s3fs keeps one) would hide a change
        info = self.fs.info(full)
        return FileEntry(rel, int(info.get("size") or 0), info_mtime(info))

    def copy_to(self, rel: str, dest: str, *, expect: FileEntry | None = None) -> int:
        if expect is not None and expect.size >= self.range_threshold:
            return self.ranged_copy(rel, dest, expect)
        with self.fs.open(self.root + "/" + rel, "rb") as fsrc:
            n = copy_file_to_path(fsrc, dest, buffer_size=FILL_BUFFER)
        if expect is not None:  # one look after the copy sees a change made before or during it
            check_unchanged(self, expect, self.stat(rel))
        return n

    def range_reader(self, rel: str) -> ranged.RangeReader:
        full = self.root + "/" + rel
        try:  # each read is one ranged request: no read-ahead cache past the range
            f = self.fs.open(full, "rb", cache_type="none")
        except TypeError:
            f = self.fs.open(full, "rb")
        return _FileObjReader(f)

    # The write side. On a filesystem of local files (``slow://``, ``local://``) it is LocalVolume's (temp
    # file, fsync, rename); on an object store one put (``pipe_file``/``put_file``: a single PUT, or a
    # multipart upload that only appears when completed) is atomic, and rename is a copy then a delete.

    def _full(self, rel: str) -> str:
        return self.root + "/" + rel if rel else self.root

    def write_bytes(self, rel: str, data: bytes) -> None:
        if self.local_root is not None:
            _local_put(self._local(_writable(rel)), data)
        else:
            self.fs.pipe_file(self._full(_writable(rel)), data)

    def upload(self, local_path: str, rel: str) -> None:
        if self.local_root is not None:
            _local_put(self._local(_writable(rel)), src=local_path)
        else:
            self.fs.put_file(local_path, self._full(_writable(rel)))

    def read_bytes(self, rel: str) -> bytes:
        return bytes(self.fs.cat_file(self._full(rel)))

    def exists(self, rel: str) -> bool:
        full = self._full(rel)
        self.fs.invalidate_cache(full)
        return bool(self.fs.exists(full))

    def makedirs(self, rel: str) -> None:
        if self.local_root is not None:
            os.makedirs(self._local(rel), exist_ok=True)

    def remove(self, rel: str, *, missing_ok: bool = True) -> None:
        full = self._full(_writable(rel))
        if self.local_root is not None:
            _local_remove(self._local(rel), missing_ok)
            return
        if not missing_ok and not self.exists(rel):  # S3 answers a delete of a missing key with success
            raise FileNotFoundError(errno.ENOENT, "no such file", self.display(rel))
        try:
            self.fs.rm_file(full)
        except FileNotFoundError:
            if not missing_ok:
                raise
        finally:
            self.fs.invalidate_cache(full)

    def remove_tree(self, rel: str) -> None:
        full = self._full(_writable(rel))
        if self.local_root is not None:
            _local_remove_tree(self._local(rel))
            return
        try:
            self.fs.rm(full, recursive=True)
        except FileNotFoundError:
            pass
        finally:
            self.fs.invalidate_cache(full)

    def rename(self, src_rel: str, dst_rel: str) -> None:
        src, dst = self._full(_writable(src_rel)), self._full(_writable(dst_rel))
        if self.local_root is not None:
            _local_rename(self._local(src_rel), self._local(dst_rel))
            return
        self.fs.copy(src, dst)
        self.fs.rm_file(src)
        self.fs.invalidate_cache(src)
        self.fs.invalidate_cache(dst)

    def list_names(self, rel: str) -> builtins.list[str]:
        if self.local_root is not None:
            return _local_names(self._local(rel))
        full = self._full(rel)
        self.fs.invalidate_cache(full)
        try:
            infos = self.fs.ls(full, detail=True)
        except (FileNotFoundError, NotADirectoryError):
            return []
        here = full.rstrip("/")  # the root came stripped of its protocol, as ls's names do
        names = {str(i["name"]).rstrip("/").rsplit("/", 1)[-1] for i in infos
                 if str(i["name"]).rstrip("/") != here}  # ls of a file answers the file itself
        return sorted(names)

    def _local(self, rel: str) -> str:
        root = self.local_root or ""
        return os.path.join(root, *rel.split("/")) if rel else root


def open_volume(path: Any, storage_options: dict[str, Any] | None = None) -> Volume:
    """Resolve ``path`` (directory, ``/Volumes/...`` path, ``file://`` or any fsspec URL) to a Volume.

    Raises :class:`SourceNotFoundError` for a missing path and :class:`SourceNotADirectoryError` when
    ``path`` is a file.
    """
    if isinstance(path, Volume):
        return path
    path = os.fspath(path)
    if isinstance(path, str) and not path.strip():  # "" would be the current directory, all of it
        raise InvalidArgumentError(f"path is empty ({path!r}): give a directory, a /Volumes/... path or a URL "
                                   "(for the current directory, say '.')")
    return volume_class(path).from_path(path, storage_options)


# ---------------------------------------------------------------- the backend registry

VolumeMatch = Union[str, Callable[[str], bool]]
_backends: builtins.list[tuple[VolumeMatch, Callable[[str], bool], type[Volume]]] = []  # latest first


def register_volume(scheme_or_predicate: VolumeMatch, cls: type[Volume]) -> None:
    """Make :func:`open_volume` (and so datasets, staging, tables and checkpoints) build ``cls`` for some paths.

    ``scheme_or_predicate`` is a URL scheme (``"az"`` matches ``az://...``) or a predicate on the path
    string. The latest registration that matches wins, so a scheme registered later overrides the
    built-ins (local paths and ``file://``: :class:`LocalVolume`; any other URL: :class:`FsspecVolume`);
    registering the same scheme again replaces its class. ``cls.from_path(path, storage_options)``
    builds the volume. Register where ``cls`` is defined: a worker process that unpickles a volume
    imports that module, and so has the registration too. See docs/backends.md.
    """
    if not (isinstance(cls, type) and issubclass(cls, Volume)):
        raise TypeError(f"register_volume needs a Volume subclass, got {cls!r}")
    if isinstance(scheme_or_predicate, str):
        scheme = scheme_or_predicate.lower().rstrip(":/")
        if not re.fullmatch(r"[a-z][a-z0-9+.\-]*", scheme):
            raise ValueError(f"{scheme_or_predicate!r} is not a URL scheme (letters, digits, '+', '.', '-')")
        prefix = scheme + "://"
        matches: Callable[[str], bool] = lambda path: path[:len(prefix)].lower() == prefix  # noqa: E731
        key: VolumeMatch = scheme
    elif callable(scheme_or_predicate):
        matches, key = scheme_or_predicate, scheme_or_predicate
    else:
        raise TypeError(f"register_volume needs a URL scheme or a predicate, got {scheme_or_predicate!r}")
    _backends[:] = [b for b in _backends if b[0] != key]
    _backends.insert(0, (key, matches, cls))


def unregister_volume(scheme_or_predicate: VolumeMatch) -> bool:
    """Undo :func:`register_volume` for this scheme (or this very predicate object); paths it matched go to
    the next registration that matches them again (the built-ins in the end). False when it was not registered."""
    key: VolumeMatch = (scheme_or_predicate.lower().rstrip(":/") if isinstance(scheme_or_predicate, str)
                        else scheme_or_predicate)
    kept = [b for b in _backends if b[0] != key]
    removed = len(kept) != len(_backends)
    _backends[:] = kept
    return removed


def volume_class(path: str) -> type[Volume]:
    """The registered backend class for ``path`` (the latest registration that matches)."""
    for _, matches, cls in _backends:
        if matches(path):
            return cls
    raise SourceNotFoundError(f"no volume backend handles {path!r}: register one with ucmagic.register_volume")


def _is_local_path(path: str) -> bool:
    return not is_remote_url(path)


# The two built-ins; later registrations (a scheme such as ``slow``, ``az``) take precedence.
register_volume(_is_local_path, LocalVolume)
register_volume(is_remote_url, FsspecVolume)


class _FdReader:
    """A read stream on a local or mounted file: its own descriptor, ``os.preadv`` at each offset."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY)

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        return os.preadv(self.fd, [buf], offset)

    def close(self) -> None:
        os.close(self.fd)


class _FileObjReader:
    """A read stream on an fsspec file object: seek when needed, then read."""

    def __init__(self, f: Any) -> None:
        self.f = f

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        if self.f.tell() != offset:
            self.f.seek(offset)
        readinto = getattr(self.f, "readinto", None)
        if readinto is not None:
            return int(readinto(buf))
        data = self.f.read(len(buf))
        buf[:len(data)] = data
        return len(data)

    def close(self) -> None:
        self.f.close()


def check_unchanged(vol: Volume, expect: FileEntry, now: FileEntry, *, cause: BaseException | None = None) -> None:
    """Raise :class:`SourceChangedError` naming the file when ``now`` (a fresh stat) differs from the listing's
    ``expect``."""
    if now.size == expect.size and now.mtime == expect.mtime:
        return
    err = SourceChangedError(
        f"{vol.display(expect.path)} changed after it was listed (listed {expect.size} bytes, mtime "
        f"{expect.mtime:.6f}; now {now.size} bytes, mtime {now.mtime:.6f}): its copy was discarded so that mixed "
        "versions are never served. A dataset keeps the listing it took; a new dataset object lists the "
        "files again and picks up the new version")
    raise err from cause


def copy_error(vol: Volume, rel: str, exc: BaseException) -> FetchError:
    """A FetchError naming the file and the likely fix for ``exc``."""
    where = vol.display(rel)
    if isinstance(exc, PermissionError):
        return FetchError(f"cannot read {where}: permission denied; "
                          "fix the file's permissions or exclude it with pattern=")
    if isinstance(exc, FileNotFoundError):
        return FetchError(f"{where} disappeared after the listing was taken; create the dataset again to refresh it")
    return FetchError(f"cannot copy {where}: {exc}")
