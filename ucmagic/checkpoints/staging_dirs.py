"""The local staging folders of checkpoint saves and loads: where they live, how each is made (new, private,
held open while it is used: :func:`ucmagic.files.locks.hold_dir`), released and swept once its owner is gone."""
from __future__ import annotations

import contextlib
import os
import re
import shutil
import time

from ..errors import CheckpointError
from ..files.cache_layout import default_cache_dir
from ..files.locks import dir_problem, hold_dir, pid_running, private_dir, process_tag, release_dir, tag_alive
from ..units import format_size


def shared_staging_root() -> str:
    """``<cache root>/staging``: the staging root every saver of this user shares by default, inside
    the user's private cache directory (not a name in ``/tmp`` that another user could make first)."""
    return os.path.join(default_cache_dir(), "staging")


def default_staging_root() -> str:
    """``$UCMAGIC_STAGING_DIR`` or :func:`shared_staging_root`."""
    env = os.environ.get("UCMAGIC_STAGING_DIR")
    if env:
        return os.path.abspath(os.path.expanduser(env))
    return shared_staging_root()


STALE_AFTER_S = 600  # staging named by a bare pid (older ucmagic): swept once that pid is gone this long
_OWNER_SUFFIX = re.compile(r"@(\d+-\d+)(?:\.[0-9a-f]+)?$")  # <name>@<process_tag>.<random>: pid + start time
_PID_SUFFIX = re.compile(r"-(\d+)$")


def staging_owner_gone(name: str, mtime: float, now: float) -> bool:
    """True when the process that made staging directory ``name`` has exited (so its staging is garbage)."""
    m = _OWNER_SUFFIX.search(name)
    if m:
        return not tag_alive(m.group(1))
    legacy = _PID_SUFFIX.search(name)
    return legacy is not None and not pid_running(int(legacy.group(1))) and now - mtime >= STALE_AFTER_S


def sweep_stale(root: str, *, now: float | None = None) -> list[str]:
    """Delete staging directories in ``root`` whose owner process has exited (pid and start time)."""
    now = time.time() if now is None else now
    gone = []
    uid = os.getuid() if hasattr(os, "getuid") else None
    for name in os.listdir(root):
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)  # only a folder of this user's own (a shared root may hold others')
            if dir_problem(st, uid) is not None or not staging_owner_gone(name, st.st_mtime, now):
                continue
        except OSError:
            continue
        shutil.rmtree(path, ignore_errors=True)
        gone.append(name)
    return gone


def make_staging_dir(root: str | None, name: str) -> str:
    """Create a new private (0700) staging directory ``<root>/<name>@<pid>-<start time>.<random>``
    and return it (never one that exists already: another user cannot prepare it).

    ``root`` (default: ``$UCMAGIC_STAGING_DIR``, else :func:`shared_staging_root`) is made private
    to the user where missing; an existing one must be a real directory of the user's that no one
    else may write to, or one with the sticky bit such as ``/tmp`` (others cannot rename nor delete
    in it), else :class:`~ucmagic.errors.UnsafeDirectoryError`. Directories that exited processes
    of this user left in ``root`` are swept first.
    """
    root = root or default_staging_root()
    fix = "pass staging_dir= (or set $UCMAGIC_STAGING_DIR to) a folder of your own"
    while True:
        if root == shared_staging_root():
            private_dir(os.path.dirname(root), tighten=True, what="cache directory", fix=fix)
        private_dir(root, sticky_ok=True, what="checkpoint staging folder", fix=fix)
        sweep_stale(root)
        path = os.path.join(root, f"{name}@{process_tag()}.{os.urandom(6).hex()}")
        try:
            os.mkdir(path, mode=0o700)
        except FileExistsError:
            continue  # someone's folder of that name: never reuse it, draw another name
        except FileNotFoundError:
            continue  # another saver removed the (then empty) shared root in between: make it again
        hold_dir(path, shared_ok=False, what="checkpoint staging folder")  # its files: made by descriptor
        return path


def release_staging_dir(path: str) -> None:
    """Delete a staging directory, then its root if that is the shared default and now empty.

    ``rmdir`` only removes an empty directory, so another saver's staging in the root is never touched
    (and :func:`make_staging_dir` recreates a root removed under it).
    """
    release_dir(path)
    shutil.rmtree(path, ignore_errors=True)
    root = os.path.dirname(path)
    if root == shared_staging_root():
        with contextlib.suppress(OSError):
            os.rmdir(root)


def check_free_space(path: str, need: int, reserve: int) -> None:
    """Raise :class:`CheckpointError` unless ``path``'s disk has ``need + reserve`` bytes free."""
    free = shutil.disk_usage(path).free
    if free < need + reserve:
        raise CheckpointError(
            f"not enough local disk to stage the checkpoint in {path}: need {format_size(need)} "
            f"(+{format_size(reserve)} reserve), {format_size(free)} free; pass staging_dir= "
            "(or set UCMAGIC_STAGING_DIR) to a larger local disk, or free some space")
