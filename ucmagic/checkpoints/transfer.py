"""Moving checkpoint files between local staging and a volume, with CRC-32 on the fly.

Uploads read the staged file once, hash the bytes as they go out, ``fsync`` the volume copy and
check its size (``verify="full"`` also reads it back). Downloads hash as they come in and compare
with the manifest. CRC-32 (``zlib.crc32``, ~6 GB/s here, releases the GIL) is used rather than
SHA-256 (~1.8 GB/s): it guards against torn and bit-flipped files, not against tampering.
"""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import time
import zlib

from .._util import RetryPolicy, copy_local
from ..cache import pid_running
from .format import FileRecord
from ..errors import CheckpointCorruptError, CheckpointError, CheckpointUploadError
from ..units import format_size

CHUNK = 8 << 20
RETRIES = 3


def default_staging_root() -> str:
    """``$UCMAGIC_STAGING_DIR`` or ``<tmp>/ucmagic-ckpt-<uid>``."""
    env = os.environ.get("UCMAGIC_STAGING_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return os.path.join(tempfile.gettempdir(), f"ucmagic-ckpt-{uid}")


STALE_AFTER_S = 600
_PID_SUFFIX = re.compile(r"-(\d+)$")



def sweep_stale(root: str, *, now: float | None = None) -> list[str]:
    """Delete staging directories left by killed processes (dead pid suffix, untouched for 10 min)."""
    now = time.time() if now is None else now
    gone = []
    for name in os.listdir(root):
        m = _PID_SUFFIX.search(name)
        path = os.path.join(root, name)
        try:
            if not m or pid_running(int(m.group(1))) or now - os.path.getmtime(path) < STALE_AFTER_S:
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(name)
    return gone


def make_staging_dir(root: str | None, name: str) -> str:
    """Create a private (0700) staging directory ``<root>/<name>-<pid>`` and return it.

    Directories that killed processes left in ``root`` are swept first.
    """
    root = root or default_staging_root()
    os.makedirs(root, mode=0o700, exist_ok=True)
    sweep_stale(root)
    path = os.path.join(root, f"{name}-{os.getpid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


def check_free_space(path: str, need: int, reserve: int) -> None:
    """Raise :class:`CheckpointError` unless ``path``'s disk has ``need + reserve`` bytes free."""
    free = shutil.disk_usage(path).free
    if free < need + reserve:
        raise CheckpointError(
            f"not enough local disk to stage the checkpoint in {path}: need {format_size(need)} "
            f"(+{format_size(reserve)} reserve), {format_size(free)} free; pass staging_dir= "
            "(or set UCMAGIC_STAGING_DIR) to a larger local disk, or free some space")


def _copy(src_path: str, dst_path: str, *, sync: bool) -> tuple[int, int]:
    """Copy with a running CRC-32; return (bytes, crc)."""
    return copy_local(src_path, dst_path, crc=True, sync=sync, buffer_size=CHUNK)


def file_crc(path: str) -> tuple[int, int]:
    """(size, CRC-32) of a file."""
    crc = n = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            b = f.read(CHUNK)
            if not b:
                return n, crc
            crc = zlib.crc32(b, crc)
            n += len(b)


def _retry(what: str, fn, retries: int = RETRIES):
    return RetryPolicy(retries, CHECKPOINT_PERMANENT, transient=(OSError,), base=0.05, factor=4.0,
                       cap=float("inf"), jitter=0.0).call(fn)


# Errors another try will not fix (a checkpoint error is a verdict, not a hiccup).
CHECKPOINT_PERMANENT = (CheckpointError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)


def upload_file(local: str, remote: str, *, verify: str = "size", delete: bool = True,
                retries: int = RETRIES) -> FileRecord:
    """Copy a staged file to the volume durably, verify it, delete the staged copy; return its record."""

    def once() -> FileRecord:
        n, crc = _copy(local, remote, sync=True)
        size = os.stat(remote).st_size
        if size != n:
            raise OSError(f"{remote} has {size} bytes after upload, expected {n}")
        if verify == "full":
            n2, crc2 = file_crc(remote)
            if (n2, crc2) != (n, crc):
                raise OSError(f"{remote} reads back differently from what was uploaded")
        return FileRecord(n, crc)

    try:
        rec = _retry(f"upload {remote}", once, retries)
    except Exception as e:
        raise CheckpointUploadError(f"cannot upload checkpoint file {local} to {remote}: {e}; check that the "
                                    "volume is mounted and writable and has space") from e
    if delete:
        os.unlink(local)
    return rec


def download_file(remote: str, local: str, expected: FileRecord | None, *, name: str, where: str,
                  retries: int = RETRIES) -> FileRecord:
    """Copy a checkpoint file from the volume to local disk, checking size and CRC against ``expected``."""
    from .format import check_record

    try:
        n, crc = _retry(f"download {remote}", lambda: _copy(remote, local, sync=False), retries)
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
    """Read a checkpoint file from the volume into memory, checking size and CRC against ``expected``."""
    from .format import check_record

    try:
        data = _retry(f"read {remote}", lambda: read_bytes(remote), retries)
    except FileNotFoundError:
        raise CheckpointCorruptError(f"{where}: {name} is missing; the checkpoint is incomplete "
                                     "(re-save it or load another step)") from None
    except OSError as e:
        raise CheckpointError(f"cannot read {remote}: {e}; check that the volume is mounted") from e
    check_record(name, where, expected, len(data), zlib.crc32(data))
    return data


def write_bytes(remote: str, data: bytes) -> FileRecord:
    """Write a small file straight to the volume, fsync'd; return its record."""

    def once() -> None:
        with open(remote, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    try:
        _retry(f"write {remote}", once)
    except OSError as e:
        raise CheckpointUploadError(f"cannot write {remote}: {e}; check that the volume is mounted and writable") from e
    return FileRecord(len(data), zlib.crc32(data))


def read_bytes(remote: str) -> bytes:
    """Read a small file from the volume (retrying transient errors)."""

    def once() -> bytes:
        with open(remote, "rb") as f:
            return f.read()

    return _retry(f"read {remote}", once)


def remove_quietly(path: str) -> None:
    """Delete a file if present."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
