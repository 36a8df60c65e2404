"""Volumes: resolve a path or URL, list its files with size and mtime, copy one file out.

A volume is anything files are read *from*: a local or mounted directory (``/Volumes/...`` on
Databricks, NFS, a FUSE mount) or an fsspec URL (``s3://``, ``memory://``...). Nothing here ever
writes to a volume.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import stat as stat_mod
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any, Iterable, NamedTuple

from .errors import EmptyListingError, FetchError, NotADirectoryErrorUC, SourceNotFoundError

COPY_CHUNK = 4 << 20


def _register_protocols() -> None:
    """Make ``slow://`` (the simulator in :mod:`ucmagic.testing`) resolvable in every process."""
    import fsspec

    fsspec.register_implementation("slow", "ucmagic.testing.SlowFileSystem", clobber=True)


_register_protocols()


class FileEntry(NamedTuple):
    """One file of a listing: path relative to the volume root (POSIX separators), size, mtime."""

    path: str
    size: int
    mtime: float


# ---------------------------------------------------------------- glob patterns (pure)

@lru_cache(maxsize=128)
def compile_pattern(pattern: str) -> re.Pattern[str]:
    """Translate a glob into a regex over relative POSIX paths.

    ``*`` and ``?`` stay inside one path segment, ``**`` spans segments (``**/`` also matches
    nothing), ``[abc]`` is a character class. A pattern without ``/`` matches the file name at any
    depth (``"*.jpg"`` finds every JPEG in the tree), like ``.gitignore``.
    """
    pat = pattern.strip().lstrip("/") if pattern.startswith("/") else pattern.strip()
    if "/" not in pat:
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


def listing_fingerprint(entries: Iterable[FileEntry]) -> str:
    """A short stable hash of a listing's paths and sizes (resume states carry it)."""
    h = hashlib.sha256()
    for e in entries:
        h.update(e.path.encode("utf-8", "surrogateescape"))
        h.update(b"\0%d\n" % e.size)
    return h.hexdigest()[:16]


# ---------------------------------------------------------------- path resolution

def resolve_local_path(path: str) -> str:
    """Map ``/Volumes/<catalog>/<schema>/<volume>/...`` to a real directory.

    The path itself wins when it exists (on Databricks it is a FUSE mount); otherwise it resolves
    under ``$UCMAGIC_CATALOG_ROOT/<catalog>/<schema>/volumes/<volume>/...`` when that variable is set.
    Other paths are returned absolute and user-expanded.
    """
    p = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(p):
        return p
    parts = p.split(os.sep)
    root = os.environ.get("UCMAGIC_CATALOG_ROOT")
    if root and len(parts) >= 5 and parts[1] == "Volumes":
        catalog, schema, volume = parts[2], parts[3], parts[4]
        return os.path.join(os.path.abspath(root), catalog, schema, "volumes", volume, *parts[5:])
    return p


def existing_local_path(path: str) -> str:
    """:func:`resolve_local_path`, or :class:`SourceNotFoundError` naming ``path`` and the fix."""
    real = resolve_local_path(path)
    if not os.path.exists(real):
        hint = ""
        if path.startswith("/Volumes/") and not os.environ.get("UCMAGIC_CATALOG_ROOT"):
            hint = (" (outside Databricks, set UCMAGIC_CATALOG_ROOT to map /Volumes/<catalog>/<schema>/<volume> "
                    "to a local directory)")
        raise SourceNotFoundError(f"{path} does not exist: check the path{hint}")
    return real


def _is_url(path: str) -> bool:
    return bool(re.match(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://", path))


class Volume:
    """Interface: list files and copy one file to a local path. ``uri`` identifies the volume."""

    uri: str

    def list(self, pattern: str | None = None) -> list[FileEntry]:
        raise NotImplementedError

    def copy_to(self, rel: str, dest: str, *, expect: FileEntry | None = None) -> int:
        """Copy ``rel`` to the local path ``dest``; return the number of bytes written.

        ``expect``: the listed version of the file (size, mtime) the copy is meant to match."""
        raise NotImplementedError

    def stat(self, rel: str) -> FileEntry:
        raise NotImplementedError

    def display(self, rel: str = "") -> str:
        return self.uri.rstrip("/") + ("/" + rel if rel else "")

    def _check_listing(self, entries: list[FileEntry], pattern: str | None) -> list[FileEntry]:
        if not entries:
            what = f"matching {pattern!r} " if pattern else ""
            raise EmptyListingError(
                f"no files {what}under {self.display()}: check the path and the pattern "
                "(patterns are globs such as '**/*.jpg'; a pattern without '/' matches file names at any depth)"
            )
        return entries


class LocalVolume(Volume):
    """A local or mounted directory (NFS, FUSE, ``/Volumes/...``)."""

    def __init__(self, root: str, *, list_threads: int = 16) -> None:
        self.root = root
        self.uri = "file://" + root
        self.list_threads = list_threads

    def __reduce__(self):
        return (LocalVolume, (self.root,), {"list_threads": self.list_threads})

    def display(self, rel: str = "") -> str:
        return os.path.join(self.root, rel) if rel else self.root

    def _scan_dir(self, rel: str) -> tuple[list[FileEntry], list[str]]:
        files: list[FileEntry] = []
        dirs: list[str] = []
        with os.scandir(os.path.join(self.root, rel) if rel else self.root) as it:
            for de in it:
                name = de.name if not rel else rel + "/" + de.name
                try:
                    if de.is_dir(follow_symlinks=False):
                        dirs.append(name)
                        continue
                    st = de.stat()  # follows a symlink to a file; a dangling one raises
                except OSError:
                    continue
                if stat_mod.S_ISREG(st.st_mode):
                    files.append(FileEntry(name, st.st_size, st.st_mtime))
        return files, dirs

    def list(self, pattern: str | None = None) -> list[FileEntry]:
        """Recursive listing, directories scanned concurrently (each readdir on a network mount is slow)."""
        files: list[FileEntry] = []
        with ThreadPoolExecutor(self.list_threads, thread_name_prefix="ucmagic-list") as pool:
            pending = [pool.submit(self._scan_dir, "")]
            while pending:
                fut = pending.pop()
                got, dirs = fut.result()
                files.extend(got)
                pending.extend(pool.submit(self._scan_dir, d) for d in dirs)
        return self._check_listing(filter_entries(files, pattern), pattern)

    def stat(self, rel: str) -> FileEntry:
        st = os.stat(os.path.join(self.root, rel))
        return FileEntry(rel, st.st_size, st.st_mtime)

    def copy_to(self, rel: str, dest: str, *, expect: FileEntry | None = None) -> int:
        src = os.path.join(self.root, rel)
        with open(src, "rb") as fsrc, open(dest, "wb") as fdst:
            n = 0
            try:  # zero-copy in the kernel; releases the GIL for the whole file
                while True:
                    sent = os.sendfile(fdst.fileno(), fsrc.fileno(), n, COPY_CHUNK)
                    if sent == 0:
                        break
                    n += sent
            except OSError as e:
                if n or e.errno not in (22, 38, 95):  # EINVAL/ENOSYS/EOPNOTSUPP: no sendfile here
                    raise
                shutil.copyfileobj(fsrc, fdst, COPY_CHUNK)
                n = fdst.tell()
        return n


def _info_mtime(info: dict[str, Any]) -> float:
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
    return float(int(hashlib.sha1(tag.encode()).hexdigest()[:12], 16)) if tag else 0.0


class FsspecVolume(Volume):
    """Any fsspec filesystem (``s3://bucket/prefix``, ``memory://``, ``slow://`` ...)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        import fsspec

        self.url = url
        self.storage_options = dict(storage_options or {})
        self.fs, self.root = fsspec.core.url_to_fs(url, **self.storage_options)
        self.root = self.root.rstrip("/")
        proto = self.fs.protocol[0] if isinstance(self.fs.protocol, (tuple, list)) else self.fs.protocol
        self.uri = f"{proto}://{self.root}"

    def __reduce__(self):
        return (FsspecVolume, (self.url, self.storage_options))

    def list(self, pattern: str | None = None) -> list[FileEntry]:
        found = self.fs.find(self.root, detail=True)
        prefix = self.root + "/" if self.root else ""
        files = []
        for full, info in found.items():
            if info.get("type", "file") != "file":
                continue
            full = full.rstrip("/")
            rel = full[len(prefix):] if full.startswith(prefix) else full.split(self.root, 1)[-1].lstrip("/")
            if not is_safe_rel(rel):
                import warnings

                warnings.warn(f"ucmagic: ignoring {self.display(rel)!r}: its name has '..', '.' or empty parts "
                              "and could point outside a destination directory", stacklevel=2)
                continue
            files.append(FileEntry(rel, int(info.get("size") or 0), _info_mtime(info)))
        return self._check_listing(filter_entries(files, pattern), pattern)

    def stat(self, rel: str) -> FileEntry:
        info = self.fs.info(self.root + "/" + rel)
        return FileEntry(rel, int(info.get("size") or 0), _info_mtime(info))

    def copy_to(self, rel: str, dest: str, *, expect: FileEntry | None = None) -> int:
        with self.fs.open(self.root + "/" + rel, "rb") as fsrc, open(dest, "wb") as fdst:
            shutil.copyfileobj(fsrc, fdst, COPY_CHUNK)
            return fdst.tell()


def open_volume(path: Any, storage_options: dict[str, Any] | None = None) -> Volume:
    """Resolve ``path`` (directory, ``/Volumes/...`` path, ``file://`` or any fsspec URL) to a Volume.

    Raises :class:`SourceNotFoundError` for a missing path and :class:`NotADirectoryErrorUC` when
    ``path`` is a file.
    """
    if isinstance(path, Volume):
        return path
    path = os.fspath(path)
    if _is_url(path) and not path.startswith("file://"):
        vol = FsspecVolume(path, storage_options)
        try:
            exists, isdir = vol.fs.exists(vol.root), vol.fs.isdir(vol.root)
        except Exception as e:  # a backend that cannot answer: let listing report the real error
            raise SourceNotFoundError(f"cannot reach {path}: {e}") from e
        if not exists:
            raise SourceNotFoundError(f"{path} does not exist: check the URL and your credentials")
        if not isdir:
            raise NotADirectoryErrorUC(f"{path} is a file, not a directory: pass the directory that holds your files")
        return vol
    if path.startswith("file://"):
        path = path[len("file://"):]
    real = existing_local_path(path)
    if not os.path.isdir(real):
        raise NotADirectoryErrorUC(
            f"{path} is a file, not a directory: pass the directory that holds your files (use pattern= to pick some)"
        )
    return LocalVolume(real)


def copy_error(vol: Volume, rel: str, exc: BaseException) -> FetchError:
    """A FetchError naming the file and the likely fix for ``exc``."""
    where = vol.display(rel)
    if isinstance(exc, PermissionError):
        return FetchError(f"cannot read {where}: permission denied; fix the file's permissions or exclude it with pattern=")
    if isinstance(exc, FileNotFoundError):
        return FetchError(f"{where} disappeared after the listing was taken; create the dataset again to refresh it")
    return FetchError(f"cannot copy {where}: {exc}")
