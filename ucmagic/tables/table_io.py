"""Every read of a table's files opens through the volume registry (:func:`ucmagic.files.volume.open_volume`).

A backend added with :func:`ucmagic.register_volume` therefore serves ``ParquetDataset`` (footers, cached
copies, ranged row-group reads), Delta logs, deletion vectors and data files, ``load_table`` and exports
written by ucmagic. Only an engine's own I/O (deltalake scanning, Spark writing) stays the engine's.

Call order of :class:`TableFiles`: build it with the table's root (or None) and storage options; then
``stat`` / ``open`` / ``copy_to`` any file path of the table, from any thread (volumes are opened once per
folder and shared); it pickles without its open volumes (a worker opens its own).
"""
from __future__ import annotations

import os
import threading
from typing import Any

from .._util import is_url
from ..errors import SourceNotFoundError
from ..files.ranged import RangedFile
from ..files.volume import FileEntry, Volume, open_volume

__all__ = ["TableFiles", "VolumeFile", "arrow_filesystem"]

_PROC_FD = os.path.isdir("/proc/self/fd")  # a descriptor of this process's own can be opened again by name there


def _split(path: str) -> tuple[str, str]:
    """``(folder, name)`` of a file path or URL."""
    if is_url(path):
        head, _, name = path.rstrip("/").rpartition("/")
        return head, name
    return os.path.dirname(path) or ".", os.path.basename(path)


def _missing(path: str, exc: OSError) -> SourceNotFoundError:
    """The error for a file of the table that is not there (a ``FileNotFoundError`` still)."""
    return SourceNotFoundError(f"{path}, a file of the table, does not exist ({exc.strerror or exc}): the table "
                               "changed while being read, or its log names a file that is gone")


class VolumeFile(RangedFile):
    """A seekable read-only file over :meth:`Volume.range_reader`: pyarrow reads a Parquet footer and the
    column chunks it needs as byte ranges, never the whole file."""

    def __init__(self, vol: Volume, rel: str, size: int) -> None:
        super().__init__(vol.range_reader(rel), size)


class TableFiles:
    """The files of one table (or file list), opened through the registered volume of their folder:
    the table's ``root`` when they lie under it, else each file's own folder."""

    def __init__(self, root: str | None, storage_options: dict[str, Any] | None = None) -> None:
        self.root = root.rstrip("/") if root and root.rstrip("/") else root
        self.storage_options = storage_options
        self._pid = os.getpid()
        self._vols: dict[str, Volume] = {}
        self._mu = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"root": self.root, "storage_options": self.storage_options}

    def __setstate__(self, st: dict[str, Any]) -> None:
        self.__init__(st["root"], st["storage_options"])  # type: ignore[misc]

    def _volume(self, folder: str) -> Volume:
        if self._pid != os.getpid():  # a forked child opens its own volumes (a parent's lock may be held)
            self._pid, self._vols, self._mu = os.getpid(), {}, threading.Lock()
        with self._mu:
            vol = self._vols.get(folder)
        if vol is None:
            vol = open_volume(folder, self.storage_options)
            if folder != self.root:  # a file named by itself (the user's, or an allowed Delta path): as named
                vol.follow_symlinks = "all"
            with self._mu:
                self._vols[folder] = vol
        return vol

    def locate(self, path: str) -> tuple[Volume, str]:
        """The volume that serves ``path`` and its relative path there."""
        root = self.root
        if root:
            sep = "/" if is_url(root) else os.sep
            if path.startswith(root + sep):
                rel = path[len(root) + 1:]
                return self._volume(root), rel.replace(os.sep, "/") if sep != "/" else rel
        folder, name = _split(path)
        return self._volume(folder), name

    def stat(self, path: str) -> FileEntry:
        vol, rel = self.locate(path)
        try:
            return vol.stat(rel)
        except FileNotFoundError as exc:
            raise _missing(path, exc) from None

    def local_file(self, path: str) -> str | None:
        """A local path to read ``path`` from directly, or None where reads go through the volume."""
        vol, rel = self.locate(path)
        return vol.local_file(rel)

    def open(self, path: str, size: int | None = None) -> Any:
        """A seekable binary file of ``path`` (plain reads where the volume has a local file, else ranged
        reads through the volume); the caller closes it."""
        vol, rel = self.locate(path)
        try:
            fd = vol.open_local(rel)  # a table's file is checked when opened: never a link out of the table
        except FileNotFoundError as exc:
            raise _missing(path, exc) from None
        if fd is not None:
            return open(fd, "rb")
        return VolumeFile(vol, rel, vol.stat(rel).size if size is None else size)  # unbuffered: exact ranges

    def open_arrow(self, path: str, size: int | None = None) -> Any:
        """A file of ``path`` for pyarrow to decode from; the caller closes it. Where the volume has a local file,
        a native one (``pa.OSFile`` over the checked descriptor's ``/proc/self/fd`` name: the very file
        :meth:`open` checked), whose reads never wait for the interpreter lock: through a Python file each read of
        a column chunk does, and the decodes of the row groups in flight queue behind the thread that cuts batches
        (a warm 30 M-row scan ran at one core's speed). Elsewhere (no ``/proc``, a remote volume) :meth:`open`'s
        file. Where the volume can tell (:attr:`Volume.checks_native_opens`), the native file is opened by name
        first and kept where it is the file :meth:`open` would check (:meth:`Volume.opened_as_checked`): one open,
        not two (through a mount each open is a round trip; a cold 30-file scan through slowvol opened each file
        three times with the footers' open)."""
        import pyarrow as pa

        vol, rel = self.locate(path)
        local = vol.local_file(rel) if _PROC_FD and vol.checks_native_opens else None
        if local is not None:
            try:
                first = pa.OSFile(local)
            except OSError:  # missing, a folder, ...: :meth:`open` says what
                pass
            else:
                if vol.opened_as_checked(rel, first.fileno()):
                    return first
                first.close()  # not the file a checked open gives (a link): open it the checked way
        f = self.open(path, size)
        if not _PROC_FD or not hasattr(f, "fileno"):
            return f

        try:
            fd = f.fileno()
            native = pa.OSFile(f"/proc/self/fd/{fd}")
        except OSError:  # a descriptor /proc cannot reopen: plain reads
            return f
        try:
            same = os.fstat(native.fileno())
            mine = os.fstat(fd)
            equal = (same.st_dev, same.st_ino) == (mine.st_dev, mine.st_ino)
        except OSError:
            equal = False
        if not equal:
            native.close()  # not the file checked (never seen; /proc mounted elsewhere?): the checked one
            return f
        f.close()
        return native

    def read_range(self, path: str, offset: int, length: int) -> bytes:
        with self.open(path) as f:
            f.seek(offset)
            return bytes(f.read(length))

    def copy_to(self, path: str, dest: str, expect: FileEntry | None = None) -> int:
        """Copy ``path`` to the local ``dest`` (the volume's fill: ranged for big files, checked against
        ``expect``, whose ``path`` may be the full path: it is made relative here)."""
        vol, rel = self.locate(path)
        return vol.copy_to(rel, dest, expect=None if expect is None else expect._replace(path=rel))


def arrow_filesystem(files: TableFiles) -> Any:
    """A read-only ``pyarrow.fs`` filesystem over :class:`TableFiles` (for pyarrow datasets of a table's files:
    ``load_table`` and exports read URL sources through the registered volume)."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    class _Handler(pafs.FileSystemHandler):
        def __eq__(self, other: Any) -> bool:
            return self is other

        def __ne__(self, other: Any) -> bool:
            return self is not other

        def get_type_name(self) -> str:
            return "ucmagic-volume"

        def normalize_path(self, path: str) -> str:
            return path

        def get_file_info(self, paths: list[str]) -> list[Any]:
            out = []
            for p in paths:
                try:
                    e = files.stat(p)
                    out.append(pafs.FileInfo(p, pafs.FileType.File, size=e.size))
                except FileNotFoundError:
                    out.append(pafs.FileInfo(p, pafs.FileType.NotFound))
            return out

        def get_file_info_selector(self, selector: Any) -> list[Any]:
            raise NotImplementedError("list through the volume (ucmagic.files.volume.open_volume)")

        def open_input_stream(self, path: str) -> Any:
            return pa.PythonFile(files.open(path), mode="r")

        def open_input_file(self, path: str) -> Any:
            return pa.PythonFile(files.open(path), mode="r")

        def _read_only(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError("a table's files are read here; exports write through the volume")

        create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _read_only
        delete_file = move = copy_file = open_output_stream = open_append_stream = _read_only

    return pafs.PyFileSystem(_Handler())
