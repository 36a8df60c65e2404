"""Moving checkpoint files between local staging and a volume, with CRC-32 on the fly.

Uploads read the staged file once, hash the bytes as they go out, ``fsync`` the volume copy and
check its size (``verify="full"`` also reads it back). Downloads hash as they come in and compare
with the manifest. CRC-32 (``zlib.crc32``, ~6 GB/s here, releases the GIL) is used rather than
SHA-256 (~1.8 GB/s): it guards against torn and bit-flipped files, not against tampering.
Checkpoint paths that are URLs (``s3://...``) go through their store's Volume instead (the last
section): one atomic put per file, the same records and checks. Local writes never go through a
symbolic link someone planted below the checkpoint root (:func:`makedirs`, :func:`no_link_written`).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat as stat_mod
import threading
import zlib
from typing import Any, Callable, Iterator, TypeVar

from .._util import (O_NOFOLLOW, RetryPolicy, copy_fds, is_remote_url, open_emptied, path_under,
                     write_all)
from ..files.entries import is_safe_rel
from ..files.local_files import open_beneath
from ..files.locks import check_write_dest, create_new, held, refuse_links_below
from ..files.volume import FsspecVolume, Volume, open_volume, volume_class
from .format import FileRecord
# the local staging folders of saves and loads live in .staging_dirs (re-exported: callers use xfer.<name>)
from .staging_dirs import (STALE_AFTER_S as STALE_AFTER_S, check_free_space as check_free_space,
                           default_staging_root as default_staging_root, make_staging_dir as make_staging_dir,
                           release_staging_dir as release_staging_dir, shared_staging_root as shared_staging_root,
                           staging_owner_gone as staging_owner_gone, sweep_stale as sweep_stale)
from ..errors import (
    CheckpointCorruptError,
    CheckpointDestinationError,
    CheckpointPathError,
    CheckpointError,
    CheckpointUploadError,
    SourceNotFoundError,
    UCMagicError,
    UnsafeDirectoryError,
    UnsafeSourceError,
)

_T = TypeVar("_T")

CHUNK = 8 << 20
RETRIES = 3


def new_file_opener(path: str, flags: int) -> int:
    """An ``opener=`` for ``open(path, "wb", opener=...)``: the file is made new (:func:`create_new`)."""
    return create_new(path)


def _open_write(path: str) -> int:
    """Local checkpoint file ``path`` opened for writing, emptied (:func:`~ucmagic._util.open_emptied`: never
    through a link at its name), through its folder's descriptor where the folder is held."""
    dir_fd, name = held(path)
    return open_emptied(name, 0o666, dir_fd=dir_fd)


def _nearest_existing(path: str) -> str:
    p = os.path.abspath(path)
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            break
        p = parent
    return p


def check_destination(path: str) -> None:
    """Raise :class:`CheckpointDestinationError` when checkpoint directory ``path`` cannot be written.

    Looks at the nearest existing ancestor (no write happens): a regular file there, or a directory
    this process may not write (a read-only mount, missing permission), is refused in one line; so is
    ``path`` when it is another user's symbolic link (:func:`checked_dir`, :class:`UnsafeDirectoryError`).
    A URL is not checked here: its store answers the first write.
    """
    if is_remote_url(path):
        return
    checked_dir(path)
    p = _nearest_existing(path)
    if not os.path.isdir(p):
        raise CheckpointDestinationError(
            f"cannot save a checkpoint to {path}: {p} is a file, not a directory; choose a checkpoint path "
            "whose parents are directories")
    if not os.access(p, os.W_OK | os.X_OK):
        raise destination_error(OSError(errno.EROFS if _read_only(p) else errno.EACCES, "not writable", p), path)


def _read_only(path: str) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except (OSError, AttributeError):
        return False


_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def destination_error(exc: BaseException, path: str) -> UCMagicError:
    """The one-line ucmagic error for an OS error while writing checkpoint ``path`` (others pass through,
    and so does a refusal to write through a symbolic link, :class:`UnsafeDirectoryError`)."""
    if isinstance(exc, UnsafeDirectoryError):
        return exc
    if is_remote_url(path) or is_remote_url(getattr(exc, "filename", None) or ""):
        return url_destination_error(exc, path)
    if isinstance(exc, CheckpointError) or not isinstance(exc, OSError):
        return exc if isinstance(exc, CheckpointError) else CheckpointUploadError(
            f"cannot save a checkpoint to {path}: {type(exc).__name__}: {exc}")
    where = exc.filename or path
    if exc.errno == errno.EROFS or (exc.errno in (errno.EACCES, errno.EPERM) and _read_only(_nearest_existing(where))):
        why, fix = "the file system is read-only", "save to a writable directory"
    elif exc.errno in (errno.EACCES, errno.EPERM):
        why, fix = "permission denied", "save to a directory you may write (on Databricks: WRITE VOLUME on the volume)"
    elif exc.errno in (errno.ENOTDIR, errno.EEXIST) and not os.path.isdir(_nearest_existing(where)):
        why = f"{_nearest_existing(where)} is a file, not a directory"
        fix = "choose a path whose parents are directories"
    elif exc.errno in _FULL:
        why, fix = "no space left on the volume", "free space there or save to another volume"
    else:
        return CheckpointUploadError(f"cannot write checkpoint {where}: {exc.strerror or exc}; check that the volume "
                                     "is mounted and writable and has space")
    at = f" ({where})" if os.path.abspath(where) != os.path.abspath(path) else ""
    return CheckpointDestinationError(f"cannot save a checkpoint to {path}: {why}{at}; {fix}")


def _copy(src_path: str, dst_path: str, *, sync: bool, check: Callable[[], None] | None = None) -> tuple[int, int]:
    """Copy the local file ``src_path`` to checkpoint file ``dst_path`` (:func:`_open_write`: through its
    folder's descriptor while a save holds it, never through a link) with a running CRC-32; (bytes, crc).
    ``check`` runs before each 8 MB and may raise (a cancelled save)."""
    fdst = _open_write(dst_path)
    try:
        fsrc = os.open(src_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            out = copy_fds(fsrc, fdst, crc=True, check=check, buffer_size=CHUNK)
        finally:
            os.close(fsrc)
        if sync:
            os.fsync(fdst)
        return out
    finally:
        os.close(fdst)


def file_crc(path: str) -> tuple[int, int]:
    """(size, CRC-32) of a file (a local one never read through a link at its name)."""
    if is_remote_url(path):
        data = read_bytes(path)
        return len(data), zlib.crc32(data)
    dir_fd, name = held(path)
    fd = os.open(name, os.O_RDONLY | O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        return _fd_crc(fd)
    finally:
        os.close(fd)


def _fd_crc(fd: int) -> tuple[int, int]:
    """(size, CRC-32) of the file open on ``fd``, read back from its start (positional reads)."""
    crc = n = 0
    while True:
        b = os.pread(fd, CHUNK, n)
        if not b:
            return n, crc
        crc = zlib.crc32(b, crc)
        n += len(b)


def _retry(what: str, fn: Callable[[], _T], retries: int = RETRIES) -> _T:
    return RetryPolicy(retries, CHECKPOINT_PERMANENT, transient=(OSError,), base=0.05, factor=4.0,
                       cap=float("inf"), jitter=0.0).call(fn)


# Errors another try will not fix (a checkpoint error is a verdict, not a hiccup).
CHECKPOINT_PERMANENT = (CheckpointError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def upload_file(local: str, remote: str, *, verify: str = "size", delete: bool = True,
                retries: int = RETRIES, check: Callable[[], None] | None = None) -> FileRecord:
    """Copy a staged file to the volume durably, verify it, delete the staged copy; return its record.

    ``check`` is called before each 8 MB and may raise to stop the upload (a cancelled save).
    """

    def once() -> FileRecord:
        if is_remote_url(remote):
            return _upload_url(local, remote, verify, check)
        with no_link_written(remote):
            n, crc = _copy(local, remote, sync=True, check=check)
        dir_fd, name = held(remote)  # through the step folder's descriptor while the save holds it
        size = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_size
        if size != n:
            raise OSError(f"{remote} has {size} bytes after upload, expected {n}")
        if verify == "full":
            n2, crc2 = file_crc(remote)
            if (n2, crc2) != (n, crc):
                raise OSError(f"{remote} reads back differently from what was uploaded")
        return FileRecord(n, crc)

    try:
        rec = _retry(f"upload {remote}", once, retries)
    except BaseException as e:
        if not isinstance(e, UnsafeDirectoryError):  # a refused link stays for the user to see
            with contextlib.suppress(OSError):
                remove_quietly(remote)  # a partial copy only takes space on the volume
        if isinstance(e, (CheckpointError, UnsafeDirectoryError)) or not isinstance(e, Exception):
            raise
        if isinstance(e, OSError):
            raise destination_error(e, os.path.dirname(remote)) from None
        raise CheckpointUploadError(f"cannot upload checkpoint file {local} to {remote}: {e}; check that the "
                                    "volume is mounted and writable and has space") from e
    if delete:
        os.unlink(local)
    return rec


def open_inside(where: str, name: str) -> int:
    """A read descriptor of the file ``name`` (a relative path read from the checkpoint's own records) in the
    local checkpoint folder ``where``, never through a link out of it (:func:`~ucmagic.files.local_files.
    open_beneath`): a name with ``..`` or an absolute start, or a link to elsewhere, raises
    :class:`~ucmagic.errors.CheckpointPathError` naming it."""
    if not is_safe_rel(name):
        raise CheckpointPathError(f"{where}: the checkpoint names the file {name!r}, outside its folder; it was "
                                  "not read (a checkpoint someone else wrote?)")
    try:
        fd = open_beneath(os.path.realpath(where), name, flags=os.O_NONBLOCK)  # a FIFO there: no hang
    except UnsafeSourceError as e:
        raise CheckpointPathError(f"{where}: {name} is a symbolic link out of the checkpoint folder ({e}); it was "
                                  "not read") from None
    except OSError as e:
        if e.errno in (errno.ENAMETOOLONG, errno.ENOTDIR):
            raise FileNotFoundError(e.errno, e.strerror, e.filename) from None
        raise
    if not stat_mod.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointCorruptError(f"{where}: {name} is not a regular file; it was not read")
    os.set_blocking(fd, True)  # a regular file: plain reads from here on (a FUSE server sees no O_NONBLOCK)
    return fd


def source_size(where: str, name: str) -> int | None:
    """The size of checkpoint file ``name`` in ``where`` (None when missing), checked as it will be read
    (:func:`open_inside`; on a store: its size there)."""
    if is_remote_url(where):
        try:
            return stat_file(f"{url_path(where)}/{name}")[0] if is_safe_rel(name) else None
        except FileNotFoundError:
            return None
    try:
        fd = open_inside(where, name)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def _copy_inside(where: str, name: str, local: str) -> tuple[int, int]:
    """Copy checkpoint file ``name`` of the local folder ``where`` (:func:`open_inside`) to ``local``, a new file
    in this load's private staging; ``(bytes, crc)``."""
    fsrc = open_inside(where, name)
    try:
        fdst = create_new(local)  # in the load's staging folder, through its descriptor
        try:
            return copy_fds(fsrc, fdst, crc=True, buffer_size=CHUNK)
        finally:
            os.close(fdst)
    finally:
        os.close(fsrc)


def download_file(remote: str, local: str, expected: FileRecord | None, *, name: str, where: str,
                  retries: int = RETRIES) -> FileRecord:
    """Copy checkpoint file ``name`` of folder ``where`` (``remote`` is ``where/name``) to the new local file
    ``local``, checking size and CRC against ``expected``. A local source is opened by :func:`open_inside`."""
    from .format import check_record

    def once() -> tuple[int, int]:
        if is_remote_url(remote):
            return _download_url(remote, local)
        remove_quietly(local)  # a retry's new file (O_EXCL)
        return _copy_inside(where, name, local)

    try:
        n, crc = _retry(f"download {remote}", once, retries)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where}: {name} is missing; the checkpoint is incomplete "
                                     "(re-save it or load another step)") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {remote}: {e}; check that the volume is mounted") from e
    if expected is not None:
        try:
            check_record(name, where, expected, n, crc)
        except CheckpointCorruptError:
            os.unlink(local)
            raise
    return FileRecord(n, crc)


def download_bytes(remote: str, expected: FileRecord, *, name: str, where: str, retries: int = RETRIES) -> bytes:
    """Read checkpoint file ``name`` of folder ``where`` (``remote`` is ``where/name``) into memory, checking size
    and CRC against ``expected``: at most one byte more than the manifest says is read (a longer file fails
    the size check; nothing is allocated for what a manifest claims beyond it)."""
    from .format import check_record

    try:
        data = _retry(f"read {remote}", lambda: read_head(remote, expected.size + 1, where=where, name=name),
                      retries)
    except CheckpointError:
        raise
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where}: {name} is missing; the checkpoint is incomplete "
                                     "(re-save it or load another step)") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {remote}: {e}; check that the volume is mounted") from e
    check_record(name, where, expected, len(data), zlib.crc32(data))
    return data


def write_bytes(remote: str, data: bytes) -> FileRecord:
    """Write a small file straight to the volume, fsync'd (on a store: one atomic put); return its record."""

    def once() -> None:
        if is_remote_url(remote):
            vol, rel = locate(remote)
            vol.write_bytes(rel, data)
            return
        with no_link_written(remote):
            fd = _open_write(remote)  # never through a link at the file's own name (O_NOFOLLOW)
        try:
            write_all(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    try:
        _retry(f"write {remote}", once)
    except OSError as e:
        raise destination_error(e, os.path.dirname(remote)) from None
    return FileRecord(len(data), zlib.crc32(data))


def read_bytes(remote: str) -> bytes:
    """Read a small file from the volume (retrying transient errors)."""

    def once() -> bytes:
        if is_remote_url(remote):
            vol, rel = locate(remote)
            return vol.read_bytes(rel)
        with open(remote, "rb") as f:
            return f.read()

    return _retry(f"read {remote}", once)


def remove_quietly(path: str) -> None:
    """Delete a file if present (through its folder's descriptor where the folder is held)."""
    if is_remote_url(path):
        vol, rel = locate(path)
        vol.remove(rel, missing_ok=True)
        return
    dir_fd, name = held(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


# ---------------------------------------------------------------- URL destinations (any fsspec store)
#
# A checkpoint path may be a URL (``s3://bucket/run/ckpts/step_5``). Its files then go through the
# :class:`~ucmagic.files.volume.Volume` of its store (one per ``scheme://bucket``; every ``rel`` is the
# key under it): shards and markers are written whole or not at all (``write_bytes``/``upload``), so
# the order the writer keeps (record, shards, ``.metadata``, marker last) gives the same guarantees
# as on a disk. Local paths keep the code above, unchanged.

_OPTIONS: dict[str, dict[str, Any]] = {}  # "s3://bucket" -> storage options a writer/reader was given
_VOLUMES: dict[tuple[str, str, type[Volume]], Volume] = {}  # a backend registered later is a new key
_VOLUMES_MU = threading.Lock()



def _store(url: str) -> tuple[str, str]:
    """``("s3://bucket", "run/ckpts/step_5")`` for ``s3://bucket/run/ckpts/step_5``."""
    scheme, rest = url.split("://", 1)
    head, _, rel = rest.partition("/")
    return f"{scheme}://{head}", rel.strip("/")


def use_storage_options(url: str, options: dict[str, Any] | None) -> None:
    """Use fsspec ``options`` (credentials, ``client_kwargs``...) for every checkpoint file on ``url``'s store.

    Without them, the store's own configuration applies (fsspec's config and environment variables,
    ``AWS_*``, as for torch's ``FsspecReader``).
    """
    if options is not None:
        with _VOLUMES_MU:
            _OPTIONS[_store(url)[0]] = dict(options)


def locate(url: str) -> tuple[Volume, str]:
    """The Volume of ``url``'s store and the key of ``url`` under it."""
    base, rel = _store(url)
    with _VOLUMES_MU:
        opts = _OPTIONS.get(base, {})
        key = (base, repr(sorted(opts.items())), volume_class(base))
        vol = _VOLUMES.get(key)
        if vol is None:
            try:
                vol = open_volume(base, opts or None)
            except SourceNotFoundError:  # cannot be listed (a bucket policy): writes may still work
                cls = volume_class(base)
                if not issubclass(cls, FsspecVolume):  # a registered backend's own from_path said no
                    raise
                vol = cls(base, opts or None)
            except ValueError as e:  # fsspec knows no such protocol
                raise CheckpointError(f"cannot open the store of checkpoint path {url}: {e}; pass a directory or "
                                      "an fsspec URL whose protocol is installed (s3://, gs://, ...)") from None
            _VOLUMES[key] = vol
    return vol, rel


def url_path(path: str | os.PathLike[str]) -> str:
    """A checkpoint URL in the one spelling every step uses (no trailing ``/``)."""
    return os.fspath(path).rstrip("/")


def exists(path: str) -> bool:
    """True when file or directory ``path`` exists (on a store: a key, or keys under it)."""
    if not is_remote_url(path):
        return os.path.exists(path)
    vol, rel = locate(path)
    return vol.exists(rel)


def isdir(path: str) -> bool:
    """True for a directory (on a store: a prefix with keys under it)."""
    if not is_remote_url(path):
        return os.path.isdir(path)
    return bool(list_names(path))


def isfile(path: str) -> bool:
    """True for a file (on a store: a key with nothing under it)."""
    if not is_remote_url(path):
        return os.path.isfile(path)
    return exists(path) and not list_names(path)


def list_names(path: str) -> list[str]:
    """Names directly in directory ``path`` (``os.listdir``; on a store ``[]`` when nothing is there)."""
    if not is_remote_url(path):
        return os.listdir(path)
    vol, rel = locate(path)
    return vol.list_names(rel)


def makedirs(path: str, root: str | None = None) -> None:
    """Create directory ``path`` and its parents (a no-op on an object store).

    Locally ``path`` is never made or used through a symbolic link that someone planted: with
    ``root`` (the checkpoint root the user named, ``path`` below it: ``save_checkpoint``'s
    ``root/step_<N>``) no folder below ``root`` on the way to ``path``, ``path`` included, may be a
    link, whoever made it (ucmagic names those folders); without it ``path`` (a folder the user named)
    may be a link only of the user's own (:func:`checked_dir`). Else :class:`UnsafeDirectoryError`
    names the link.
    """
    if is_remote_url(path):
        vol, rel = locate(path)
        vol.makedirs(rel)
        return
    below = None if root is None else _rel_below(root, path)
    if root is not None and below is not None:
        refuse_links_below(root, below, whole=True)
    os.makedirs(path, mode=0o755, exist_ok=True)  # never writable by others, whatever the umask
    if root is not None and below is not None:
        refuse_links_below(root, below, whole=True)  # one made while the folders were being made
    checked_dir(path)


def _rel_below(root: str, path: str) -> str | None:
    """``path`` relative to ``root`` (``/``-separated) when it lies below it (by name, links not resolved)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == os.curdir or rel == os.pardir or rel.startswith(os.pardir + os.sep):
        return None
    return rel.replace(os.sep, "/")


def checked_dir(path: str) -> None:
    """Refuse (:class:`UnsafeDirectoryError`) to write into local checkpoint directory ``path`` when it is a
    symbolic link of another user's (:func:`~ucmagic.files.locks.check_write_dest`); one of the user's own
    names the folder they mean. Nothing is checked when ``path`` is missing or not a link."""
    if os.path.islink(path):
        check_write_dest(path, allow_shared=True, what="checkpoint directory")


@contextlib.contextmanager
def no_link_written(path: str) -> Iterator[None]:
    """Around the local write of checkpoint file ``path``: refused when its folder is another user's link
    (:func:`checked_dir`); the write must open ``path`` with ``O_NOFOLLOW`` (``open_emptied``,
    ``copy_local``), and a link there fails it as :class:`UnsafeDirectoryError` naming the link."""
    checked_dir(os.path.dirname(path))
    try:
        yield
    except OSError as e:
        if e.errno != errno.ELOOP or not os.path.islink(path):
            raise
        raise UnsafeDirectoryError(f"ucmagic will not write checkpoint file {path}: it is a symbolic link (a write "
                                   "through it could land anywhere); remove it") from None


def outside_link(root: str, name: str) -> UnsafeSourceError | None:
    """The error for loading entry ``name`` of local checkpoint root ``root`` when it is a symbolic link
    whose target lies outside the root (a link someone who can write to the root planted would make a
    load read another place's data); None otherwise (a link inside the root, ``latest -> step_5``, is fine)."""
    if is_remote_url(root):
        return None
    path = os.path.join(root, name)
    if not os.path.islink(path) or path_under(path, root) not in (None, "."):
        return None
    target = os.path.realpath(path)
    return UnsafeSourceError(f"ucmagic will not load checkpoint {path}: it is a symbolic link to {target}, outside "
                             f"the checkpoint root {root}; load that checkpoint from its own root "
                             f"(load_checkpoint({os.path.dirname(target)!r}, ...)) if you trust it, or remove the link")


def remove_tree(path: str) -> None:
    """Delete directory ``path`` and everything in it, ignoring errors (as ``shutil.rmtree``'s)."""
    if not is_remote_url(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    vol, rel = locate(path)
    with contextlib.suppress(OSError):
        vol.remove_tree(rel)


def stat_file(path: str) -> tuple[int, float]:
    """``(size, mtime)`` of file ``path``; :class:`FileNotFoundError` when it is not there."""
    if not is_remote_url(path):
        st = os.stat(path)
        return st.st_size, st.st_mtime
    vol, rel = locate(path)
    entry = vol.stat(rel)
    return entry.size, entry.mtime


def read_tail(path: str, n: int) -> bytes:
    """The last ``n`` bytes of file ``path`` (all of it when shorter)."""
    size = stat_file(path)[0]
    if not is_remote_url(path):
        with open(path, "rb") as f:
            f.seek(max(0, size - n))
            return f.read(n)
    vol, rel = locate(path)
    reader = vol.range_reader(rel)
    try:
        buf = bytearray(min(n, size))
        got = reader.readinto_at(max(0, size - n), memoryview(buf))
        return bytes(buf[:got])
    finally:
        reader.close()


def read_head(path: str, n: int, *, where: str | None = None, name: str | None = None) -> bytes:
    """The first ``n`` bytes of file ``path`` (fewer when it is shorter); with ``where`` and ``name`` (``path``
    is ``where/name``) a local file is opened by :func:`open_inside`."""
    if not is_remote_url(path):
        with open(open_inside(where, name) if where is not None and name is not None else path, "rb") as f:
            return f.read(n)
    vol, rel = locate(path)
    reader = vol.range_reader(rel)
    try:
        buf = bytearray(n)
        got = reader.readinto_at(0, memoryview(buf))
        return bytes(buf[:got])
    finally:
        reader.close()


def _upload_url(local: str, remote: str, verify: str, check: Callable[[], None] | None) -> FileRecord:
    """One try of an upload to a store: CRC of the staged file (a local read), one atomic put, then its size
    (``verify="full"``: its bytes) read back. ``check`` runs once, before the put (a put cannot be paused)."""
    if check is not None:
        check()
    n, crc = file_crc(local)
    vol, rel = locate(remote)
    vol.upload(local, rel)
    if verify == "full":
        back = vol.read_bytes(rel)
        if (len(back), zlib.crc32(back)) != (n, crc):
            raise OSError(f"{remote} reads back differently from what was uploaded")
    else:
        size = vol.stat(rel).size
        if size != n:
            raise OSError(f"{remote} has {size} bytes after upload, expected {n}")
    return FileRecord(n, crc)


def _download_url(remote: str, local: str) -> tuple[int, int]:
    """Copy a checkpoint file from its store to the new local file ``local`` (made through its staging folder's
    descriptor: :func:`create_new`); ``(bytes, crc)`` of what arrived."""
    vol, rel = locate(remote)
    remove_quietly(local)  # a retry's new file
    fd = create_new(local, flags=os.O_RDWR)
    try:
        vol.copy_to(rel, f"/proc/self/fd/{fd}" if os.path.isdir("/proc/self/fd") else local)
        return _fd_crc(fd)
    finally:
        os.close(fd)


def url_destination_error(exc: BaseException, path: str) -> CheckpointError:
    """The one-line error for a failed write of checkpoint ``path`` on a store."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, PermissionError):
        return CheckpointDestinationError(f"cannot save a checkpoint to {path}: permission denied ({exc}); check "
                                          "the credentials and that they may write there")
    return CheckpointUploadError(f"cannot write checkpoint {path}: {type(exc).__name__}: {exc}; check the URL, the "
                                 "credentials and that the store is reachable")
