"""The :class:`Volume` contract every storage backend implements, and the errors shared by its copies.

Call order: ``from_path`` (via :func:`ucmagic.files.volume.open_volume`), then ``list``/``scan`` once, then
for each file ``stat`` / ``copy_to`` (or ``range_reader`` streams from :meth:`Volume.ranged_copy`); the write side
(``makedirs``, ``write_bytes``/``upload``, ``rename``, ``remove``...) serves checkpoints and exports.
"""
from __future__ import annotations

import abc
import builtins  # `list` in Volume annotations is the method
import os
from typing import Any, Iterator

from . import ranged
from ..errors import EmptyListingError, FetchError, SourceChangedError
from .entries import DirScan, FileEntry


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

    def open_local(self, rel: str) -> int | None:
        """A read descriptor of ``rel`` where :meth:`local_file` gives a local path (None elsewhere), opened
        the way every copy opens it: a backend whose files are local checks the opened file against
        :attr:`follow_symlinks` here (``LocalVolume``: it must lie inside the root), so a file swapped for a
        link after the listing is refused when it is read. Default: a plain open of :meth:`local_file`."""
        path = self.local_file(rel)
        return None if path is None else os.open(path, os.O_RDONLY | os.O_CLOEXEC)

    @property
    def checks_native_opens(self) -> bool:
        """True where :meth:`opened_as_checked` can vouch for a descriptor an engine opened by name on
        :meth:`local_file`'s path (``LocalVolume``, unless a subclass opens its own way); False (the default):
        an engine reads what :meth:`open_local` opened, and never opens by name first."""
        return False

    def opened_as_checked(self, rel: str, fd: int) -> bool:
        """Where :attr:`checks_native_opens`: whether ``fd``, opened by name on :meth:`local_file`'s path by an
        engine (links followed), is the file :meth:`open_local` would have opened, so it may be read in its
        place (one open, not two, on a mount where each costs a round trip). Default False."""
        return False

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

    def copy_into(self, rel: str, fd: int, *, expect: FileEntry | None = None) -> int | None:
        """Copy ``rel`` into ``fd``, a descriptor open for writing on an empty file at offset 0 (the
        cache's fill file), as :meth:`copy_to` does into a path; the bytes written. ``None`` where this
        backend copies only to a path (the default; for ``LocalVolume``, a file copied by ranges): the
        caller then calls :meth:`copy_to` on the descriptor's path. Saves the fill a second ``open``
        of its own file (and its ``fstat`` and ``close``) per file."""
        return None

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
        """Range settings and the link policy set on this instance (they travel with it to worker processes,
        which check each file they open against that policy)."""
        return {k: v for k, v in vars(self).items() if k.startswith("range_") or k == "follow_symlinks"}

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
