"""The built-in backend for URLs: :class:`FsspecVolume` over any fsspec filesystem (``s3://``, ``memory://``,
``slow://``...)."""
from __future__ import annotations

import builtins  # `list` in Volume annotations is the method
import errno
import hashlib
import os
from typing import Any

from . import ranged
from .._util import FILL_BUFFER, copy_file_to_path
from ..errors import InvalidArgumentError, SourceNotADirectoryError, SourceNotFoundError
from .entries import FileEntry, filter_entries, is_safe_rel
from .local_files import local_names, local_put, local_remove, local_remove_tree, local_rename, writable_rel
from .volume_base import Volume, check_unchanged


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
        try:  # one look (one request on a store): whether it is there and what it is, never two that a change splits
            kind = vol.fs.info(vol.root).get("type", "file")
        except FileNotFoundError:
            kind = None
        except Exception as e:  # a backend that cannot answer: let listing report the real error
            raise SourceNotFoundError(f"cannot reach {path}: {e}") from e
        if kind is None:
            raise SourceNotFoundError(f"{path} does not exist: check the URL and your credentials")
        if kind != "directory":
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
            local_put(self._local(writable_rel(rel)), data)
        else:
            self.fs.pipe_file(self._full(writable_rel(rel)), data)

    def upload(self, local_path: str, rel: str) -> None:
        if self.local_root is not None:
            local_put(self._local(writable_rel(rel)), src=local_path)
        else:
            self.fs.put_file(local_path, self._full(writable_rel(rel)))

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
        full = self._full(writable_rel(rel))
        if self.local_root is not None:
            local_remove(self._local(rel), missing_ok)
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
        full = self._full(writable_rel(rel))
        if self.local_root is not None:
            local_remove_tree(self._local(rel))
            return
        try:
            self.fs.rm(full, recursive=True)
        except FileNotFoundError:
            pass
        finally:
            self.fs.invalidate_cache(full)

    def rename(self, src_rel: str, dst_rel: str) -> None:
        src, dst = self._full(writable_rel(src_rel)), self._full(writable_rel(dst_rel))
        if self.local_root is not None:
            local_rename(self._local(src_rel), self._local(dst_rel))
            return
        self.fs.copy(src, dst)
        self.fs.rm_file(src)
        self.fs.invalidate_cache(src)
        self.fs.invalidate_cache(dst)

    def list_names(self, rel: str) -> builtins.list[str]:
        if self.local_root is not None:
            return local_names(self._local(rel))
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
