"""Locks shared by threads and processes, the process identities that own them, and the owner
checks of the places ucmagic keeps its own files in.

:func:`file_lock` (``flock`` on a file of its own) is the lock every module uses across processes
(epochs, listings, the cache's eviction lock, shard packing); :class:`KeyLocks` are the cache's
per-key single-flight locks; :func:`process_tag` / :func:`tag_alive` name a process so that a later
one reusing its pid is not mistaken for it (records, temp files and journals carry the tag).
:func:`private_dir` makes or checks a folder of ucmagic's own (private to the user, never a link
nor another user's) and :func:`open_private` opens a file in one without following a link.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat as stat_mod
import struct
import threading
from typing import Any, Iterator

from .._util import LOCAL_DISK_FS, O_NOFOLLOW, atomic_write, mount_fs_type
from ..errors import UnsafeDirectoryError

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX
    fcntl = None  # type: ignore[assignment]


# ---------------------------------------------------------------- private places


def _uid() -> int | None:
    return os.getuid() if hasattr(os, "getuid") else None


def dir_problem(st: os.stat_result, uid: int | None, *, sticky_ok: bool = False) -> str | None:
    """Why a folder with ``lstat`` result ``st`` may not hold files private to user ``uid`` (None: it may).

    It must be a real directory (not a symbolic link), belong to ``uid`` and be writable by no one
    else. ``sticky_ok``: a folder others may write to but not rename nor delete in (the sticky bit,
    as ``/tmp``) is fine too, for a caller that only makes new uniquely named folders in it.
    """
    if stat_mod.S_ISLNK(st.st_mode):
        return "it is a symbolic link"
    if not stat_mod.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if sticky_ok and st.st_mode & stat_mod.S_ISVTX and st.st_uid in (uid, 0):
        return None
    if uid is not None and st.st_uid != uid:
        return f"it belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"others may write to it (mode {stat_mod.S_IMODE(st.st_mode):04o})"
    return None


def parent_problem(st: os.stat_result, uid: int | None) -> str | None:
    """Why a folder above one of ucmagic's (``lstat`` result ``st``) lets another user replace what is below it
    (None: it does not): it must belong to this user or root, and no one else may write to it unless it is
    sticky (``/tmp``: others may not rename nor delete what is not theirs), as OpenSSH's StrictModes."""
    if stat_mod.S_ISLNK(st.st_mode) or not stat_mod.S_ISDIR(st.st_mode):
        return None  # a link on the way: its target's folders are checked (the resolved path's)
    if uid is not None and st.st_uid not in (uid, 0):
        return f"it belongs to another user (uid {st.st_uid}), who could rename what is in it"
    if st.st_mode & 0o022 and not st.st_mode & stat_mod.S_ISVTX:
        return (f"others may write to it (mode {stat_mod.S_IMODE(st.st_mode):04o}, no sticky bit) and so rename "
                "what is in it and put a link in its place")
    return None


def parents_problem(path: str) -> tuple[str, str] | None:
    """``(folder, why)`` for the first folder above ``path`` (by name, and above the folder it resolves to)
    that lets another user replace ``path`` (:func:`parent_problem`); None when none does. Only on this
    machine's own disks (:func:`shared_by_local_users`): on a network or FUSE mount the service decides."""
    uid = _uid()
    if uid is None:
        return None
    path = os.path.abspath(path)
    folders: list[str] = []
    for start in (os.path.dirname(path), os.path.realpath(os.path.dirname(path))):
        cur = start
        while True:
            folders.append(cur)
            up = os.path.dirname(cur)
            if up == cur:
                break
            cur = up
    for folder in dict.fromkeys(folders):
        try:
            st = os.lstat(folder)
        except OSError:
            continue  # not there (yet): made private by the caller, or not on the way
        problem = parent_problem(st, uid)
        if problem is not None and shared_by_local_users(folder):
            return folder, problem
    return None


def check_parents(path: str, *, what: str, fix: str) -> None:
    """:func:`parents_problem` as :class:`~ucmagic.errors.UnsafeDirectoryError` naming the folder, ``what``
    ``path`` is for and ``fix``."""
    found = parents_problem(path)
    if found is not None:
        raise UnsafeDirectoryError(f"ucmagic will not use {path} as its {what}: the folder above it {found[0]} is "
                                   f"not safe ({found[1]}); {fix}")


def private_dir(path: str, *, tighten: bool = False, sticky_ok: bool = False, what: str = "folder",
                fix: str = "remove it, or point ucmagic at a folder of your own", parents: bool = True) -> str:
    """Make ``path`` a folder private to this user (0700 whatever the umask), or check the one there.

    Missing parents are made 0700 too (never 0777 under umask 000). An existing ``path`` is used only
    if :func:`dir_problem` finds nothing wrong with its ``lstat`` (a symbolic link is never followed);
    ``tighten``: a real directory of this user's that others may write to is made 0700 instead (the
    caller then checks what it holds). With ``parents`` (the default) every folder above it must be
    safe too (:func:`check_parents`: another user who may write to a parent could rename ``path`` and
    put a link in its place). Else :class:`~ucmagic.errors.UnsafeDirectoryError` names it, ``what`` it
    is for and ``fix``. Returns ``path``.
    """
    uid = _uid()
    if parents:
        check_parents(path, what=what, fix=fix)
    missing = []
    parent = os.path.dirname(path)
    while parent and parent != os.path.dirname(parent) and not os.path.lexists(parent):
        missing.append(parent)
        parent = os.path.dirname(parent)
    for folder in reversed(missing):  # os.makedirs would make the upper levels 0777 minus the umask
        with contextlib.suppress(FileExistsError):
            _mkdir_private(folder)
    try:
        _mkdir_private(path)
        return path
    except FileExistsError:
        pass
    st = os.lstat(path)
    problem = dir_problem(st, uid, sticky_ok=sticky_ok)
    if problem is not None and tighten and stat_mod.S_ISDIR(st.st_mode) and (uid is None or st.st_uid == uid):
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.path.samestat(os.fstat(fd), st):  # the folder checked, not one swapped in meanwhile
                os.fchmod(fd, 0o700)
                problem = dir_problem(os.fstat(fd), uid)
        finally:
            os.close(fd)
    if problem is not None:
        raise UnsafeDirectoryError(f"ucmagic will not use {path} as its {what}: {problem}; {fix}")
    return path


class CheckedDir:
    """A local folder opened once as a directory descriptor (never through a link) and checked; what ucmagic
    creates below it goes through the descriptor with no link followed (``dir_fd``, ``O_NOFOLLOW``,
    ``O_EXCL``), so renaming the folder, or a link swapped in for it later, cannot redirect a write.

    Call order: :meth:`open` (checks the folder: a real directory, see :func:`dir_problem`, and its parents,
    :func:`parents_problem`), then any of :meth:`create`, :meth:`mkdir`, :meth:`subdir`, :meth:`replace`,
    :meth:`link_fd`, :meth:`unlink` with names relative to it, then :meth:`close` (or use it as a context
    manager). Not shared across a fork: a child opens its own.
    """

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, path: str, *, sticky_ok: bool = False, shared_ok: bool = False, what: str = "folder",
             fix: str = "pick a folder of your own") -> "CheckedDir":
        """Open the existing folder ``path`` and check it (``shared_ok``: another user's, or one others may write
        to, is accepted, never a link): else :class:`~ucmagic.errors.UnsafeDirectoryError`."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                why = "it is a symbolic link" if os.path.islink(path) else "it is not a directory"
                raise UnsafeDirectoryError(f"ucmagic will not write into the {what} {path}: {why}; {fix}") from None
            raise
        try:
            problem = None if shared_ok else dir_problem(os.fstat(fd), _uid(), sticky_ok=sticky_ok)
            if problem is None and not shared_ok:
                found = parents_problem(path)
                problem = None if found is None else f"the folder above it {found[0]} is not safe ({found[1]})"
            if problem is not None:
                raise UnsafeDirectoryError(f"ucmagic will not write into the {what} {path}: {problem}; {fix}")
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def __enter__(self) -> "CheckedDir":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    def create(self, name: str, flags: int = os.O_WRONLY, mode: int = 0o600) -> int:
        """A new file ``name`` (a plain name in this folder), ``O_EXCL`` and ``O_NOFOLLOW``: never one that is
        there already, never through a link."""
        return os.open(name, flags | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def mkdir(self, name: str, mode: int = 0o700) -> None:
        """A new folder ``name`` here (``FileExistsError`` when something is there)."""
        os.mkdir(name, mode, dir_fd=self.fd)

    def subdir(self, name: str, *, create: bool = False, mode: int = 0o700) -> "CheckedDir":
        """The folder ``name`` here (made with ``mode`` where missing and ``create``), opened without following
        a link: :class:`~ucmagic.errors.UnsafeDirectoryError` when it is one or not a folder."""
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, mode, dir_fd=self.fd)
        try:
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                raise UnsafeDirectoryError(f"ucmagic will not write into {os.path.join(self.path, name)}: it is a "
                                           "symbolic link or not a folder (a write through it could land "
                                           "anywhere); remove it") from None
            raise
        return CheckedDir(os.path.join(self.path, name), fd)

    def replace(self, src: str, dst: str) -> None:
        """Rename ``src`` over ``dst``, both in this folder (a link at ``dst`` is replaced, never followed)."""
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def link_fd(self, fd: int, name: str) -> None:
        """Give the open file ``fd`` (an unnamed ``O_TMPFILE`` one, or any) the new name ``name`` here."""
        os.link(f"/proc/self/fd/{fd}", name, src_dir_fd=self.fd, dst_dir_fd=self.fd, follow_symlinks=True)

    def unlink(self, name: str, *, missing_ok: bool = True) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def fsync(self) -> None:
        with contextlib.suppress(OSError):
            os.fsync(self.fd)


# ---------------------------------------------------------------- folders being written, by descriptor
#
# A local folder a job writes into for a while (a checkpoint save's step folder, a staging folder, a pack
# destination, an export's parent) is held open as a CheckedDir for as long as the job writes there: the
# writes that go through held() / create_new() / replace_held() / unlink_held() / write_atomically() use that
# descriptor with no link followed, so the folder renamed or swapped for a link meanwhile (by someone who may
# write above it) cannot redirect them. Elsewhere they fall back to the path (O_NOFOLLOW at the name).

_HELD: dict[str, list[Any]] = {}  # folder (normalised path) -> [CheckedDir, holders]
_HELD_MU = threading.Lock()


def _forget_held() -> None:
    global _HELD_MU
    _HELD_MU = threading.Lock()
    for d, _ in _HELD.values():
        d.close()  # the child's copies of its parent's descriptors
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_held)


def hold_dir(path: str | os.PathLike[str], *, shared_ok: bool = True, sticky_ok: bool = False,
             what: str = "folder", fix: str = "write to a folder of your own, or pass allow_shared_dest=True if you "
                                              "trust everyone who can write there") -> None:
    """Open the existing local folder ``path`` (a link of the user's own is followed to the folder it names,
    another user's refused) as a :class:`CheckedDir` that the writes of this module's helpers into it use
    until :func:`release_dir` (one hold per holder: calls nest). ``shared_ok=False``: the folder must also be
    private enough (:meth:`CheckedDir.open`; ``sticky_ok`` as in :func:`dir_problem`); on a network or FUSE
    mount the service decides who writes (accepted). A URL has no descriptor: not held."""
    path = os.fspath(path)
    if "://" in path:
        return
    key = os.path.normpath(path)
    with _HELD_MU:
        got = _HELD.get(key)
        if got is not None:
            got[1] += 1
            return
        target = key
        if os.path.islink(key):
            check_write_dest(key, allow_shared=True, what=what)  # another user's link: refused
            target = os.path.realpath(key)  # the user's own link: the folder they mean
        shared_ok = shared_ok or not shared_by_local_users(target)
        _HELD[key] = [CheckedDir.open(target, shared_ok=shared_ok, sticky_ok=sticky_ok, what=what, fix=fix), 1]


def release_dir(path: str | os.PathLike[str]) -> None:
    """One holder of :func:`hold_dir` is done with ``path``; the last one closes its descriptor."""
    key = os.path.normpath(os.fspath(path))
    with _HELD_MU:
        got = _HELD.get(key)
        if got is None:
            return
        got[1] -= 1
        if got[1] <= 0:
            del _HELD[key]
            got[0].close()


class Holding:
    """One holder's hold of a folder (:func:`hold_dir`): moved to another folder, or released, at most once
    each; picklable as "nothing held" (another process holds its own)."""

    def __init__(self) -> None:
        self.path: str | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": None}

    def hold(self, path: str, **kw: Any) -> None:
        if self.path != path:
            self.release()
            hold_dir(path, **kw)
            self.path = path

    def release(self) -> None:
        path, self.path = self.path, None
        if path is not None:
            release_dir(path)


def held(path: str) -> tuple[int | None, str]:
    """``(folder descriptor, name)`` of local file ``path`` when its folder is held (:func:`hold_dir`), else
    ``(None, path)``: pass them as ``os.open(name, ..., dir_fd=fd)``."""
    if _HELD:
        got = _HELD.get(os.path.normpath(os.path.dirname(path)))
        if got is not None:
            return got[0].fd, os.path.basename(path)
    return None, path


def create_new(path: str, mode: int = 0o600, *, flags: int = os.O_WRONLY) -> int:
    """A new local file ``path`` open with ``flags``: ``O_EXCL``, never through a link, through its folder's
    descriptor where the folder is held (:func:`hold_dir`)."""
    dir_fd, name = held(path)
    return os.open(name, flags | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)


def replace_held(src: str, dst: str) -> None:
    """Rename ``src`` over ``dst`` (both in one folder): through its descriptor where the folder is held."""
    src_fd, src_name = held(src)
    dst_fd, dst_name = held(dst)
    os.replace(src_name, dst_name, src_dir_fd=src_fd, dst_dir_fd=dst_fd)


def unlink_held(path: str) -> None:
    """Remove the file ``path`` if present: through its folder's descriptor where the folder is held."""
    dir_fd, name = held(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)


def write_atomically(path: str, data: bytes, *, sync: bool = False, mode: int = 0o644) -> None:
    """:func:`ucmagic._util.atomic_write` of ``path``, through its folder's descriptor where it is held."""
    dir_fd, name = held(path)
    atomic_write(name, data, sync=sync, mode=mode, dir_fd=dir_fd)


def check_own_entries(folder: str, *, fix: str = "remove it") -> None:
    """Raise :class:`~ucmagic.errors.UnsafeDirectoryError` when something directly in ``folder`` (a
    folder of ucmagic's own) is a symbolic link or belongs to another user: planted while others could
    write to ``folder``."""
    uid = _uid()
    try:
        with os.scandir(folder) as it:
            for de in it:
                st = de.stat(follow_symlinks=False)
                if stat_mod.S_ISLNK(st.st_mode) or (uid is not None and st.st_uid != uid):
                    why = "a symbolic link" if stat_mod.S_ISLNK(st.st_mode) else f"another user's (uid {st.st_uid})"
                    raise UnsafeDirectoryError(f"{de.path} is {why}, in a folder of ucmagic's own: {fix}")
    except FileNotFoundError:
        return


def shared_by_local_users(path: str) -> bool:
    """Whether ``path`` lies on a file system whose owners and modes are this machine's (a local disk,
    tmpfs, overlay; or unknown): where another local user is the one to guard against."""
    fs = mount_fs_type(path)
    return fs is None or fs in LOCAL_DISK_FS


def check_write_dest(path: str, *, allow_shared: bool = False, sticky_ok: bool = False,
                     what: str = "destination") -> None:
    """Refuse (:class:`~ucmagic.errors.UnsafeDirectoryError`) to write into the existing folder ``path``
    (a stage, pack, export or checkpoint destination) when it is a symbolic link of another user's, not a
    folder, or, unless ``allow_shared``, another user's or writable by others, or below a folder another
    user may write to (:func:`parents_problem`: they could swap what ucmagic writes for a link to the
    user's files); ``sticky_ok`` as in :func:`dir_problem`. Owners and modes
    are checked only on this machine's own disks (:func:`shared_by_local_users`): on a network or
    FUSE mount (``/Volumes``) the storage service decides who may write."""
    uid = _uid()
    allow_shared = allow_shared or not shared_by_local_users(path)
    st = os.lstat(path)
    if stat_mod.S_ISLNK(st.st_mode):
        if uid is not None and st.st_uid != uid:
            raise UnsafeDirectoryError(f"ucmagic will not write into the {what} {path}: it is a symbolic link of "
                                       f"another user's (uid {st.st_uid}); pass the folder it points to if you mean it")
        st = os.stat(path)  # a link of the user's own names the folder they mean
    problem = "it is not a directory" if not stat_mod.S_ISDIR(st.st_mode) else (
        None if allow_shared else dir_problem(st, uid, sticky_ok=sticky_ok))
    if problem is None and not allow_shared:
        found = parents_problem(path)
        problem = None if found is None else f"the folder above it {found[0]} is not safe ({found[1]})"
    if problem is not None:
        raise UnsafeDirectoryError(f"ucmagic will not write into the {what} {path}: {problem}; pick a folder of "
                                   "your own, or pass allow_shared_dest=True if you trust everyone who can write there")


def refuse_links_below(root: str, rel: str, *, whole: bool = False) -> None:
    """Refuse (:class:`~ucmagic.errors.UnsafeDirectoryError`, naming it) to write ``rel`` (``/``-separated)
    under ``root`` when a folder on the way down from ``root`` (``root`` itself not: the user named it),
    and ``rel`` itself with ``whole``, is a symbolic link: ucmagic named those folders, so a link there
    was planted, and a write through it could land anywhere. The walk ends at the first missing folder."""
    parts = rel.split("/")
    cur = root
    for part in parts if whole else parts[:-1]:
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if stat_mod.S_ISLNK(st.st_mode):
            raise UnsafeDirectoryError(f"ucmagic will not write {rel} under {root}: {cur} is a symbolic link (a write "
                                       "through it could land anywhere); remove it")


def _mkdir_private(path: str) -> None:
    """``mkdir`` with mode 0700 exactly (a umask may remove bits from the mode ``mkdir`` gets)."""
    os.mkdir(path, 0o700)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if stat_mod.S_IMODE(os.fstat(fd).st_mode) != 0o700:
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)


def open_private(path: str, flags: int = os.O_RDWR | os.O_CREAT, mode: int = 0o600, *,
                 dir_fd: int | None = None, what: str = "file") -> int:
    """``os.open`` of a file ucmagic keeps for itself, never through a symbolic link (``O_NOFOLLOW``),
    and only a regular file of this user's (a new one is made ``mode``, 0600 by default); else
    :class:`~ucmagic.errors.UnsafeDirectoryError`. Pass ``os.O_EXCL`` in ``flags`` for a file that must be new."""
    try:
        fd = os.open(path, flags | O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP or (exc.errno == errno.EEXIST and os.path.islink(path) and dir_fd is None):
            raise UnsafeDirectoryError(f"ucmagic will not open its {what} {path}: it is a symbolic link; "
                                       "remove it") from exc
        raise
    st = os.fstat(fd)
    uid = _uid()
    if not stat_mod.S_ISREG(st.st_mode) or (uid is not None and st.st_uid != uid):
        os.close(fd)
        why = ("it is not a regular file" if not stat_mod.S_ISREG(st.st_mode)
               else f"it belongs to another user (uid {st.st_uid})")
        raise UnsafeDirectoryError(f"ucmagic will not use its {what} {path}: {why}; remove it")
    return fd


@contextlib.contextmanager
def file_lock(path: str, shared: bool = False) -> Iterator[None]:
    """Lock shared by threads and processes: ``flock`` on a file of its own (exclusive by default).

    Each call opens its own descriptor, so threads of one process exclude each other too. A
    blocked caller sleeps in the kernel (no polling, no GIL held).
    """
    if fcntl is None:  # pragma: no cover - not POSIX
        import filelock

        with filelock.FileLock(path):
            yield
        return
    fd = open_private(path, what="lock file")
    try:
        fcntl.flock(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


_OFD_SETLKW = getattr(fcntl, "F_OFD_SETLKW", None) if fcntl is not None else None
_FLOCK_FMT = "hhqqi4x"  # struct flock on Linux (64-bit off_t): type, whence, start, len, pid, padding


def key_offset(key: str) -> int:
    """The byte of the shared fill-lock file that stands for ``key`` (60 bits of its hash)."""
    return int(key[:15], 16)


class KeyLocks:
    """Exclusive per-key locks across threads and processes without a lock file per key.

    Threads of a process wait on an in-process lock per key; processes exclude each other with an
    open-file-description lock on one byte of ``path`` (Linux ``F_OFD_SETLKW``: owned by the
    descriptor, released when it closes, so a killed process holds nothing; no deadlock detection
    to misfire across threads). The file stays empty. Elsewhere: ``flock`` on a file per key prefix.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._mu = threading.Lock()
        self._held: dict[str, list[Any]] = {}  # key -> [threading.Lock, users]
        self._fd = -1
        self._pid = 0

    def _file(self) -> int:
        pid = os.getpid()
        if self._pid != pid:  # a forked child shares the parent's description: open its own, once
            with self._mu:  # (two threads opening one each locked on one and unlocked on the other: a lock
                if self._pid != pid:  # left held by a description no one unlocks, another process waiting for good)
                    self._fd, self._pid = open_private(self.path, what="lock file"), pid
        return self._fd

    @contextlib.contextmanager
    def hold(self, key: str) -> Iterator[None]:
        """Hold the lock of ``key`` for the ``with`` block (see :meth:`acquire`)."""
        held = self.acquire(key)
        try:
            yield
        finally:
            self.release(key, held)

    def acquire(self, key: str) -> Any:
        """Take the lock of ``key``; give what it returns back to :meth:`release`. The plain pair costs a
        fill less than :meth:`hold`'s generator (it runs once per file filled)."""
        if _OFD_SETLKW is None:  # pragma: no cover - not Linux
            held = file_lock(os.path.join(os.path.dirname(self.path), key[:4] + ".lock"))
            held.__enter__()
            return held
        with self._mu:
            slot = self._held.get(key)
            if slot is None:
                slot = self._held[key] = [threading.Lock(), 0]
            slot[1] += 1
        try:
            slot[0].acquire()
            try:
                fd = self._file()
                fcntl.fcntl(fd, _OFD_SETLKW, struct.pack(_FLOCK_FMT, fcntl.F_WRLCK, os.SEEK_SET, key_offset(key), 1, 0))
            except BaseException:
                slot[0].release()
                raise
        except BaseException:
            self._forget(key, slot)
            raise
        return slot, fd

    def release(self, key: str, held: Any) -> None:
        """Give back the lock :meth:`acquire` took for ``key`` (on the descriptor it was taken on)."""
        if _OFD_SETLKW is None:  # pragma: no cover - not Linux
            held.__exit__(None, None, None)
            return
        slot, fd = held
        try:
            fcntl.fcntl(fd, _OFD_SETLKW, struct.pack(_FLOCK_FMT, fcntl.F_UNLCK, os.SEEK_SET, key_offset(key), 1, 0))
        finally:
            slot[0].release()
            self._forget(key, slot)

    def _forget(self, key: str, slot: list[Any]) -> None:
        with self._mu:
            slot[1] -= 1
            if not slot[1]:
                del self._held[key]


# ---------------------------------------------------------------- process identities

def pid_running(pid: int) -> bool:
    """True when process ``pid`` exists on this machine (someone else's counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _proc_stat(pid: int) -> list[bytes] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        return data[data.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def _start_time(pid: int, fields: list[bytes] | None = None) -> int:
    """Start time of ``pid`` in clock ticks since boot (``/proc``; ``fields``: its stat already read),
    else via psutil in ms; 0 if unknown."""
    fields = fields if fields is not None else _proc_stat(pid)
    if fields is not None and len(fields) > 19 and fields[19].isdigit():
        return int(fields[19])
    try:
        import psutil

        return int(psutil.Process(pid).create_time() * 1000)
    except Exception:  # noqa: BLE001 - any failure means: start time unknown (identity falls back to the pid)
        return 0


_tags: dict[int, str] = {}


def process_tag(pid: int | None = None) -> str:
    """``"<pid>-<start time>"``: a process identity that a later process reusing the pid does not share."""
    pid = os.getpid() if pid is None else pid
    tag = _tags.get(pid)
    if tag is None:
        tag = _tags[pid] = f"{pid}-{_start_time(pid)}"
    return tag


def tag_alive(tag: str) -> bool:
    """True while the process named by a :func:`process_tag` is running (the same process, not a reuse)."""
    try:
        pid_s, start_s = tag.split("-", 1)
        pid = int(pid_s)
    except ValueError:
        return False
    if not pid_running(pid):
        return False
    fields = _proc_stat(pid)
    if fields is not None and fields and fields[0] in (b"Z", b"X"):
        return False  # exited, not yet reaped by its parent (in a container without an init, never)
    return start_s == "0" or str(_start_time(pid, fields)) == start_s
