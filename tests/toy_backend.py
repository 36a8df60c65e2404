"""A toy storage backend for tests: ``toy://<absolute local dir>``, a :class:`Volume` that is *not* a
``LocalVolume`` nor an ``FsspecVolume``, so a path that bypasses the volume registry cannot read it.

It stores files in a local directory but declares itself remote (no ``local_root``, no ``local_file``,
``atomic_rename = False`` as on object stores), and counts every call it serves per root, so a test can
prove that a path went through it::

    from toy_backend import toy_backend_fixture  # noqa: F401  (the ``toy_backend`` fixture)

    def test_x(toy_backend):
        (toy_backend.root / "a.bin").write_bytes(b"...")
        ds = UCVolumeDataset(toy_backend.url())
        ...
        assert toy_backend.calls["copy_to"] >= 1

``registered()`` registers the scheme for a ``with`` block; the ``toy_backend`` fixture uses it and gives a
fresh directory under pytest's ``tmp_path``. Counts live in this process only (use ``num_workers=0``).
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest

from ucmagic.errors import SourceNotADirectoryError, SourceNotFoundError
from ucmagic.files.local_files import FdReader  # a stream on a local file (the toy keeps its files locally)
from ucmagic.files.volume import (FileEntry, Volume, check_unchanged, filter_entries, register_volume,
                                  unregister_volume)

SCHEME = "toy"

# absolute local path served (the root plus the call's ``rel``) -> method name -> calls, in this process
CALLS: dict[str, Counter[str]] = {}


class ToyVolume(Volume):
    """``toy://<dir>``: the files of a local directory, served only through the Volume methods."""

    atomic_rename = False

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        root = url.split("://", 1)[1] if "://" in url else url
        self.root = os.path.normpath("/" + root.lstrip("/")) if root else "/"
        self.uri = f"{SCHEME}://{self.root}"

    @classmethod
    def from_path(cls, path: str, storage_options: dict[str, Any] | None = None) -> Volume:
        vol = cls(path, storage_options)
        vol._count("from_path")
        if not os.path.exists(vol.root):
            raise SourceNotFoundError(f"{path} does not exist: create the directory {vol.root} first")
        if not os.path.isdir(vol.root):
            raise SourceNotADirectoryError(f"{path} is a file, not a directory")
        return vol

    # ------------------------------------------------------------ bookkeeping

    def _count(self, what: str, rel: str = "") -> None:
        CALLS.setdefault(self._path(rel), Counter())[what] += 1

    def _path(self, rel: str) -> str:
        rel = rel.strip("/")
        if rel.startswith("../") or rel == ".." or "/../" in rel:
            raise ValueError(f"{rel!r} leaves the volume")
        return os.path.join(self.root, *rel.split("/")) if rel else self.root

    # ------------------------------------------------------------ the read side

    def list(self, pattern: str | None = None) -> list[FileEntry]:
        self._count("list")
        entries = []
        for d, dirs, files in os.walk(self.root):
            dirs.sort()
            for name in files:
                full = os.path.join(d, name)
                st = os.stat(full)
                entries.append(FileEntry(os.path.relpath(full, self.root).replace(os.sep, "/"), st.st_size,
                                         st.st_mtime))
        entries.sort(key=lambda e: e.path)
        return self._check_listing(filter_entries(entries, pattern), pattern)

    def stat(self, rel: str) -> FileEntry:
        self._count("stat", rel)
        st = os.stat(self._path(rel))
        return FileEntry(rel, st.st_size, st.st_mtime)

    def copy_to(self, rel: str, dest: str, *, expect: FileEntry | None = None) -> int:
        self._count("copy_to", rel)
        if expect is not None and expect.size >= self.range_threshold:
            return self.ranged_copy(rel, dest, expect)
        with open(self._path(rel), "rb") as src, open(dest, "wb") as out:
            n = out.write(src.read())
        if expect is not None:
            check_unchanged(self, expect, self.stat(rel))
        return n

    def range_reader(self, rel: str) -> FdReader:
        self._count("range_reader", rel)
        return FdReader(self._path(rel))

    # ------------------------------------------------------------ the write side

    def write_bytes(self, rel: str, data: bytes) -> None:
        self._count("write_bytes", rel)
        target = self._path(rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".toy-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)

    def upload(self, local_path: str, rel: str) -> None:
        self._count("upload", rel)
        with open(local_path, "rb") as f:
            data = f.read()
        self.write_bytes(rel, data)
        CALLS[self._path(rel)]["write_bytes"] -= 1  # counted once, as an upload

    def read_bytes(self, rel: str) -> bytes:
        self._count("read_bytes", rel)
        with open(self._path(rel), "rb") as f:
            return f.read()

    def exists(self, rel: str) -> bool:
        self._count("exists", rel)
        return os.path.exists(self._path(rel))

    def makedirs(self, rel: str) -> None:
        self._count("makedirs", rel)
        os.makedirs(self._path(rel), exist_ok=True)

    def remove(self, rel: str, *, missing_ok: bool = True) -> None:
        self._count("remove", rel)
        try:
            os.remove(self._path(rel))
        except FileNotFoundError:
            if not missing_ok:
                raise

    def remove_tree(self, rel: str) -> None:
        self._count("remove_tree", rel)
        path = self._path(rel)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.remove(path)

    def rename(self, src_rel: str, dst_rel: str) -> None:
        self._count("rename", src_rel)
        dst = self._path(dst_rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(self._path(src_rel), dst)  # a copy then a delete, as on an object store
        os.remove(self._path(src_rel))

    def list_names(self, rel: str) -> list[str]:
        self._count("list_names", rel)
        path = self._path(rel)
        return sorted(os.listdir(path)) if os.path.isdir(path) else []


@contextlib.contextmanager
def registered(scheme: str = SCHEME, cls: type[Volume] = ToyVolume) -> Iterator[None]:
    """``cls`` serves ``scheme://`` inside the block; the registration is undone after it."""
    register_volume(scheme, cls)
    try:
        yield
    finally:
        unregister_volume(scheme)


@dataclass
class ToyBackend:
    """The ``toy_backend`` fixture: a directory, its ``toy://`` URL and the calls its volumes served."""

    root: Path

    def url(self, rel: str = "") -> str:
        return f"{SCHEME}://{self.root}" + ("/" + rel.strip("/") if rel else "")

    @property
    def calls(self) -> Counter[str]:
        """Calls served on paths at or under :attr:`root` (whatever root the serving volume had)."""
        total: Counter[str] = Counter()
        for root, counts in CALLS.items():
            if root == str(self.root) or root.startswith(str(self.root) + os.sep):
                total.update(counts)
        return total

    def served(self, *methods: str) -> int:
        """Calls served of these methods (all methods when none are named)."""
        calls = self.calls
        return sum(calls[m] for m in methods) if methods else sum(calls.values())


@pytest.fixture(name="toy_backend")
def toy_backend_fixture(tmp_path: Path) -> Iterator[ToyBackend]:
    """``toy://`` registered for the test over a fresh directory ``tmp_path / "toy"``, unregistered after."""
    root = tmp_path / "toy"
    root.mkdir()
    with registered():
        yield ToyBackend(root)
    for key in [k for k in CALLS if k == str(root) or k.startswith(str(root) + os.sep)]:
        del CALLS[key]
