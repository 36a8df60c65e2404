"""stage(): copy a tree of many small files from a slow volume to local disk, in parallel.

The documented recipe is ``find . -type f -print0 | xargs -0 -P 256 -I {} cp --parents "{}" /tmp/``.
:func:`stage` does the same job faster (one listing, plain-read copies into a reused buffer on threads spread
over a few processes, no process per file) and safely: files already staged and unchanged are
skipped, every file lands atomically (temp file + rename), transient errors are retried, and
failures are reported per file instead of scrolling past.
"""
from __future__ import annotations

import contextlib
import errno
import multiprocessing as mp
import os
import stat as stat_mod
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Sequence

from ._util import O_NOFOLLOW, copy_fds, open_emptied, path_under
from .errors import FetchError, StagingError, UnsafeDirectoryError
from .files.fetch import with_retries
from .files.locks import dir_problem, parents_problem, shared_by_local_users
from .progress import Progress
from .units import format_size
from .files.volume import FileEntry, Volume, copy_error, open_volume

MTIME_TOLERANCE = 1e-3  # seconds: staged copy counts as unchanged when its mtime is this close
MAX_PROCESSES = 4
MIN_FILES_PER_PROCESS = 128  # below this, another process costs more to start than it saves
TMP_PREFIX = ".ucstage-"  # a copy in progress: .ucstage-<pid>-<random>.tmp beside its final name
FOLLOW_SYMLINKS = ("inside", "all", "none")  # what a symlink in the source tree may point at (docs/reliability.md)
DIR_MODE = 0o755  # folders stage makes (the umask may narrow it; never group- or other-writable)



@dataclass(frozen=True)
class StageFailure:
    """A file that could not be staged, and why."""

    path: str
    reason: str


@dataclass
class StageResult:
    """What :func:`stage` did. ``ok`` is True when no file failed; ``str()`` is a one-line summary."""

    source: str
    dest: str
    files: int = 0  # copied this time
    bytes: int = 0  # bytes copied this time
    seconds: float = 0.0
    skipped: int = 0  # already staged and unchanged
    skipped_bytes: int = 0
    failed: list[StageFailure] = field(default_factory=list)
    total: int = 0  # files in the listing
    processes: int = 1
    threads: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed

    def __str__(self) -> str:
        rate = f", {format_size(self.bytes / self.seconds)}/s" if self.seconds > 0 and self.bytes else ""
        s = (f"staged {self.files:,} files ({format_size(self.bytes)}) in {self.seconds:.1f} s{rate}; "
             f"{self.skipped:,} unchanged skipped; {len(self.failed):,} failed -> {self.dest}")
        for f in self.failed[:5]:
            s += f"\n  failed: {f.path}: {f.reason}"
        if len(self.failed) > 5:
            s += f"\n  ... and {len(self.failed) - 5} more (see result.failed)"
        return s

    def raise_for_failures(self) -> "StageResult":
        """Raise :class:`ucmagic.errors.FetchError` naming the failed files, if any; else return self."""
        if self.failed:
            raise FetchError(f"{len(self.failed)} of {self.total} files could not be staged:\n" + "\n".join(
                f"  {f.path}: {f.reason}" for f in self.failed[:20]))
        return self


# ---------------------------------------------------------------- pure helpers

def check_not_nested(src_root: str, dest: str) -> None:
    """Refuse a destination inside the source (the copy would copy itself) and vice versa."""
    inside = path_under(dest, src_root)
    if inside == ".":
        raise StagingError(f"source and destination are the same directory ({os.path.realpath(src_root)}): pick "
                           "another destination")
    if inside is not None:
        raise StagingError(f"destination {dest} is inside the source {src_root}: staging would copy its own output; "
                           "pick a destination outside the source")
    if path_under(src_root, dest) is not None:
        raise StagingError(f"source {src_root} is inside the destination {dest}: staged files would land in the "
                           "source tree; pick a destination outside the source")


def is_unchanged(entry: FileEntry, st: os.stat_result | None) -> bool:
    """True when a staged copy with stat ``st`` matches the source entry by size and mtime."""
    return st is not None and st.st_size == entry.size and abs(st.st_mtime - entry.mtime) <= MTIME_TOLERANCE


def split_balanced(entries: Sequence[FileEntry], parts: int, *, open_cost: int = 1 << 20) -> list[list[FileEntry]]:
    """Split ``entries`` into ``parts`` lists of about equal cost (one open ~ ``open_cost`` bytes).

    Greedy largest-first onto the cheapest part; the order inside a part follows the listing.
    """
    parts = max(1, min(parts, len(entries))) if entries else 1
    loads = [0] * parts
    owner: dict[int, int] = {}
    for i in sorted(range(len(entries)), key=lambda i: -entries[i].size):
        j = min(range(parts), key=loads.__getitem__)
        loads[j] += open_cost + entries[i].size
        owner[i] = j
    out: list[list[FileEntry]] = [[] for _ in range(parts)]
    for i, e in enumerate(entries):
        out[owner[i]].append(e)
    return out


def plan_workers(n_files: int, concurrency: int, processes: int | None, cpus: int | None = None) -> tuple[int, int]:
    """``(processes, threads per process)`` for ``n_files`` copies with ``concurrency`` in flight.

    Default: one process per 2 cores, up to 4, and fewer for small jobs (starting a process costs
    more than it saves there). On a 2-core machine one process with 256 threads measured as fast
    as 2 or 4 (copies spend their time in syscalls, outside the GIL, and a FUSE server needs the
    other core); on bigger machines more processes keep Python's per-file work off one core.
    """
    concurrency = max(1, int(concurrency))
    if processes is None:
        cpus = cpus or os.cpu_count() or 1
        processes = min(MAX_PROCESSES, max(1, cpus // 2), max(1, n_files // MIN_FILES_PER_PROCESS),
                        max(1, concurrency // 16))
    processes = max(1, min(int(processes), max(1, n_files)))
    return processes, max(1, -(-concurrency // processes))


def dest_path(dest_root: str, rel: str) -> str:
    return os.path.join(dest_root, *rel.split("/"))


def staged_mode(src_mode: int | None) -> int:
    """The mode of a staged copy of a file with mode ``src_mode`` (None: unknown, a remote file): the
    source's read and write bits, at most 0644, and 0600 when the source is not readable by everyone
    (a copy never widens who may read it)."""
    if src_mode is None:
        return 0o644
    return stat_mod.S_IMODE(src_mode) & 0o644 if src_mode & 0o004 else 0o600


def dest_problem(st: os.stat_result, uid: int | None, allow_shared: bool) -> str | None:
    """Why stage may not write into a destination folder with ``lstat`` result ``st`` (None: it may):
    never through a symbolic link; nor, unless ``allow_shared``, into a folder of another user's or
    one others may write to (they could swap what is in it for a link meanwhile)."""
    if stat_mod.S_ISLNK(st.st_mode):
        return "it is a symbolic link (stage never writes through one)"
    if not stat_mod.S_ISDIR(st.st_mode):
        return "it is not a directory"
    return None if allow_shared else dir_problem(st, uid)


# ---------------------------------------------------------------- the destination, by directory descriptors

class DestTree:
    """The destination's folders, opened one component at a time from the root with ``O_NOFOLLOW``
    (a symbolic link planted anywhere in the tree is never followed: its files fail instead) and kept
    open per process; missing folders are made ``DIR_MODE``. Files are created and renamed relative to
    these descriptors."""

    def __init__(self, root: str, allow_shared: bool = False) -> None:
        self.root = root
        self.allow_shared = allow_shared
        self._fds: dict[str, int] = {}
        self._pid = 0
        self._mu = threading.Lock()

    def __getstate__(self) -> dict[str, object]:
        return {"root": self.root, "allow_shared": self.allow_shared}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__init__(str(state["root"]), bool(state["allow_shared"]))  # type: ignore[misc]

    def _open(self, parent: int | None, name: str, path: str, create: bool) -> int:
        if create:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name if parent is not None else path, DIR_MODE, dir_fd=parent)
        try:
            fd = os.open(name if parent is not None else path,
                         os.O_RDONLY | os.O_DIRECTORY | O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except OSError as exc:
            if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                st = os.lstat(name if parent is not None else path, dir_fd=parent)
                raise UnsafeDirectoryError(f"destination folder {path}: "
                                           f"{dest_problem(st, None, True) or 'not a directory'}") from exc
            raise
        problem = dest_problem(os.fstat(fd), os.getuid() if hasattr(os, "getuid") else None, self.allow_shared)
        if problem is None and parent is None and not self.allow_shared:  # the root: and the folders above it
            found = parents_problem(path)
            problem = None if found is None else f"the folder above it {found[0]} is not safe ({found[1]})"
        if problem is not None:
            os.close(fd)
            raise UnsafeDirectoryError(f"stage will not write into {path}: {problem}; pick a destination of "
                                       "your own, or pass allow_shared_dest=True if you trust everyone who can "
                                       "write there")
        return fd

    def folder(self, rel_dir: str, create: bool = True) -> int:
        """The descriptor of folder ``rel_dir`` (``""``: the root), made where missing (``create``)."""
        with self._mu:
            if self._pid != os.getpid():  # a forked worker: its own descriptors (spawned ones start empty)
                self._fds, self._pid = {}, os.getpid()
            fd = self._fds.get(rel_dir)
            if fd is not None:
                return fd
            parts = [p for p in rel_dir.split("/") if p] if rel_dir else []
            cur = self._fds.get("")
            if cur is None:
                cur = self._fds[""] = self._open(None, "", self.root, create)
            for k, part in enumerate(parts):
                key = "/".join(parts[:k + 1])
                nxt = self._fds.get(key)
                if nxt is None:
                    nxt = self._fds[key] = self._open(cur, part, dest_path(self.root, key), create)
                cur = nxt
            return cur

    def lstat(self, rel: str) -> os.stat_result | None:
        """``lstat`` of file ``rel`` through its folder's descriptor; None where it or its folder is missing."""
        head, _, name = rel.rpartition("/")
        try:
            return os.lstat(name, dir_fd=self.folder(head, create=False))
        except (OSError, UnsafeDirectoryError):
            return None

    def close(self) -> None:
        with self._mu:
            if self._pid == os.getpid():
                for fd in self._fds.values():
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._fds = {}


# ---------------------------------------------------------------- copying one file

def sweep_temp_files(tree: DestTree, rel_dirs: set[str]) -> int:
    """Remove hidden temp files (``.ucstage-<pid>-<random>.tmp``) that a killed earlier run left in the
    destination folders; those of a running process stay. Returns the number removed."""
    from .files.locks import pid_running

    n = 0
    for rel in rel_dirs | {""}:
        try:
            fd = tree.folder(rel, create=False)
            names = os.listdir(fd)
        except (OSError, UnsafeDirectoryError):
            continue
        for name in names:
            if not (name.startswith(TMP_PREFIX) and name.endswith(".tmp")):
                continue
            pid = name[len(TMP_PREFIX):].split("-", 1)[0]
            if pid.isdigit() and not pid_running(int(pid)):
                try:
                    os.unlink(name, dir_fd=fd)
                    n += 1
                except OSError:
                    pass
    return n


def fetch_to(vol: Volume, rel: str, dest: str) -> int:
    """Copy ``rel`` of ``vol`` to the local path ``dest`` (plain reads where the volume's files are local paths,
    from a descriptor the volume checked when it opened it: a file swapped for a link out of the tree after
    the listing is refused, :class:`~ucmagic.errors.UnsafeSourceError`)."""
    fsrc = vol.open_local(rel)
    if fsrc is None:
        return vol.copy_to(rel, dest)
    try:
        fdst = open_emptied(dest, 0o666)
        try:
            return copy_fds(fsrc, fdst)[0]
        finally:
            os.close(fdst)
    finally:
        os.close(fsrc)


def source_mode(vol: Volume, rel: str) -> int | None:
    """The mode of ``rel`` where the volume's files are local paths, else None."""
    src = vol.local_file(rel)
    if src is None:
        return None
    try:
        return os.stat(src).st_mode
    except OSError:
        return None


class _SizeMismatchError(OSError):
    pass


def copy_one(vol: Volume, entry: FileEntry, tree: DestTree, verify: str | None, retries: int) -> int:
    """Copy one file atomically (a new temp file in the same folder, then rename); return bytes copied.

    Everything happens relative to the folder's descriptor: the temp file is new (``O_EXCL``, an
    unguessable name, never through a link) and the rename replaces whatever is at the final name
    (a symbolic link there is replaced, not followed)."""
    head, _, name = entry.path.rpartition("/")
    folder = tree.folder(head)
    mode = staged_mode(source_mode(vol, entry.path))

    def attempt(_: Any) -> int:
        tmp = f"{TMP_PREFIX}{os.getpid()}-{os.urandom(8).hex()}.tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=folder)
        try:
            n = fetch_to(vol, entry.path, f"/proc/self/fd/{fd}")  # writes into our descriptor, by name
            if verify == "size" and n != entry.size:
                raise _SizeMismatchError(f"listed {entry.size} bytes but read {n}: the source changed while staging; "
                                         "run stage again")
            os.fchmod(fd, mode)
            # an odd remote mtime: the copy is fine, only skip-unchanged is lost
            with contextlib.suppress(OverflowError, OSError, ValueError):
                ns = int(round(entry.mtime * 1e9))
                os.utime(fd, ns=(ns, ns))
            os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
            return n
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=folder)
            raise
        finally:
            os.close(fd)

    return with_retries(attempt, None, retries)


def _reason(vol: Volume, entry: FileEntry, exc: BaseException) -> str:
    if isinstance(exc, _SizeMismatchError):
        return str(exc)
    return str(copy_error(vol, entry.path, exc))


def _copy_many(vol: Volume, entries: Sequence[FileEntry], tree: DestTree, verify: str | None, retries: int,
               threads: int, on_done: Any) -> list[tuple[str, str]]:
    """Copy ``entries`` on ``threads`` threads; call ``on_done(nbytes, failed)`` per file; return failures."""
    failures: list[tuple[str, str]] = []

    def one(e: FileEntry) -> None:
        try:
            n = copy_one(vol, e, tree, verify, retries)
        except Exception as exc:  # noqa: BLE001 - reported per file
            failures.append((e.path, _reason(vol, e, exc)))
            on_done(0, 1)
            return
        on_done(n, 0)

    if threads <= 1 or len(entries) <= 1:
        for e in entries:
            one(e)
        return failures
    with ThreadPoolExecutor(min(threads, len(entries)), thread_name_prefix="ucmagic-stage") as pool:
        for f in [pool.submit(one, e) for e in entries]:
            f.result()
    return failures


# ---------------------------------------------------------------- worker processes

_shared: Any = None  # (files, bytes, failed) counters in shared memory, set in each worker process


def _init_worker(counters: Any) -> None:
    global _shared
    _shared = counters


def _count(nbytes: int, failed: int) -> None:
    with _shared.get_lock():
        _shared[0] += 1
        _shared[1] += nbytes
        _shared[2] += failed


def _worker_run(vol: Volume, entries: list[FileEntry], tree: DestTree, verify: str | None, retries: int,
                threads: int) -> list[tuple[str, str]]:
    return _copy_many(vol, entries, tree, verify, retries, threads, _count)


def _mp_context() -> Any:
    """fork where available (no re-import; ~ms per process), else spawn."""
    method = (os.environ.get("UCMAGIC_STAGE_START_METHOD")
              or ("fork" if "fork" in mp.get_all_start_methods() else "spawn"))
    return mp.get_context(method)


def _run_processes(vol: Volume, todo: list[FileEntry], tree: DestTree, verify: str | None, retries: int,
                   nproc: int, threads: int, prog: Progress) -> list[tuple[str, str]]:
    ctx = _mp_context()
    counters = ctx.Array("q", 3)
    parts = split_balanced(todo, nproc)
    failures: list[tuple[str, str]] = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        pool = ProcessPoolExecutor(len(parts), mp_context=ctx, initializer=_init_worker, initargs=(counters,))
    try:
        futs = [pool.submit(_worker_run, vol, part, tree, verify, retries, threads) for part in parts]
        pending = set(futs)
        while pending:
            _, pending = wait(pending, timeout=0.1)
            prog.set(counters[0], counters[1], counters[2])
        for f in futs:
            failures.extend(f.result())
        prog.set(counters[0], counters[1], counters[2])
    except BaseException:
        for p in list(getattr(pool, "_processes", {}).values()):  # interrupted: stop copying now
            p.terminate()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    return failures


# ---------------------------------------------------------------- the API

def _normalise_verify(verify: Any) -> str | None:
    if verify in (None, False, "none"):
        return None
    if verify == "size":
        return "size"
    raise StagingError(f"verify must be 'size' or None, got {verify!r}")


def _check_arguments(concurrency: Any, processes: Any, retries: Any, follow_symlinks: Any) -> None:
    for name, value, low in (("concurrency", concurrency, 1), ("processes", processes, 1), ("retries", retries, 0)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise StagingError(f"{name} must be an integer >= {low}, got {value!r}")
    if follow_symlinks not in FOLLOW_SYMLINKS:
        raise StagingError(f"follow_symlinks must be one of {FOLLOW_SYMLINKS}, got {follow_symlinks!r}")


def _plan_copies(entries: Sequence[FileEntry], tree: DestTree,
                 res: StageResult) -> tuple[list[FileEntry], list[tuple[str, str]]]:
    """The entries to copy, and (path, why) of those whose destination folder is refused; the unchanged
    ones (same size and mtime as a staged copy) are counted as skipped in ``res``."""
    todo: list[FileEntry] = []
    for e in entries:
        st = tree.lstat(e.path)
        if st is not None and stat_mod.S_ISREG(st.st_mode) and is_unchanged(e, st):
            res.skipped += 1
            res.skipped_bytes += e.size
        else:
            todo.append(e)
    unsafe: dict[str, str] = {}  # folder -> why no file is written there
    for folder in sorted({e.path.rpartition("/")[0] for e in todo}):
        try:
            tree.folder(folder)
        except (UnsafeDirectoryError, OSError) as exc:
            unsafe[folder] = str(exc)
    blocked = [(e.path, unsafe[e.path.rpartition("/")[0]]) for e in todo if e.path.rpartition("/")[0] in unsafe]
    return [e for e in todo if e.path.rpartition("/")[0] not in unsafe], blocked


def stage(src: Any, dest: str | os.PathLike[str], *, pattern: str | None = None, concurrency: int = 256,
          verify: str | None = "size", progress: bool | str = True, retries: int = 3,
          processes: int | None = None, storage_options: dict[str, Any] | None = None,
          follow_symlinks: str = "inside", allow_shared_dest: bool = False) -> StageResult:
    """Copy the files under ``src`` to ``dest`` in parallel, keeping relative paths.

    Args:
        src: directory, ``/Volumes/<catalog>/<schema>/<volume>/...`` path or fsspec URL.
        dest: local directory (created if needed); must not be inside ``src`` nor contain it.
        pattern: glob over relative paths (``"**/*.jpg"``; no ``/`` matches names at any depth).
        concurrency: copies in flight in total (threads, spread over ``processes``).
        verify: ``"size"`` checks each copy's size against the listing; ``None`` skips the check.
        progress: ``True`` (widget in a notebook, else a text line; ``$UCMAGIC_PROGRESS`` overrides), ``"text"``,
            ``"widget"`` or ``False``.
        retries: retries of a failing copy (transient errors only), with exponential backoff.
        processes: worker processes (default: one per 2 cores, up to 4, fewer for small jobs;
            1 = threads in this process).
        storage_options: fsspec options for URLs.
        follow_symlinks: a symlinked file in the source is copied only when it points inside ``src``
            (``"inside"``, the default; one pointing outside is left out with one warning naming it),
            always (``"all"``: for a tree you trust) or never (``"none"``). Symlinked folders are not walked.
        allow_shared_dest: write into a destination folder that belongs to another user or that others
            may write to (refused by default: they could swap a folder for a link to your files meanwhile).
            A symbolic link inside the destination is never written through either way.

    Returns:
        :class:`StageResult` with files and bytes copied, seconds, files skipped as unchanged (same size
        and mtime as the source; staged copies get the source's mtime) and failures with reasons.
        Failures do not raise: check ``result.ok`` or call ``result.raise_for_failures()``.
        Staged files keep the source's mode, at most 0644, and 0600 when the source is not readable by everyone.

    Example::

        res = ucmagic.stage("/Volumes/main/default/images/train", "/local_disk0/train", pattern="*.jpg")
        print(res)   # staged 120,000 files (18.0 GB) in 95.2 s, ...
    """
    t0 = time.monotonic()
    _check_arguments(concurrency, processes, retries, follow_symlinks)
    verify = _normalise_verify(verify)
    vol = open_volume(src, storage_options)
    vol.follow_symlinks = follow_symlinks
    dest_root = os.path.abspath(os.path.expanduser(os.fspath(dest)))
    if os.path.islink(dest_root) and os.lstat(dest_root).st_uid == (os.getuid() if hasattr(os, "getuid") else 0):
        dest_root = os.path.realpath(dest_root)  # a link of the user's own names the folder they mean
    if vol.local_root is not None:
        check_not_nested(vol.local_root, dest_root)
    if os.path.exists(dest_root) and not os.path.isdir(dest_root):
        raise StagingError(f"destination {dest_root} is a file: pass a directory")
    entries = vol.list(pattern)
    os.makedirs(os.path.dirname(dest_root), mode=DIR_MODE, exist_ok=True)
    # owners and modes matter on this machine's own disks; on a mount (/Volumes) the service decides
    tree = DestTree(dest_root, allow_shared_dest or not shared_by_local_users(dest_root))
    tree.folder("")  # the destination itself: made, or refused (UnsafeDirectoryError) before any copy
    sweep_temp_files(tree, {os.path.dirname(e.path) for e in entries})

    res = StageResult(source=vol.display(), dest=dest_root, total=len(entries))
    todo, blocked = _plan_copies(entries, tree, res)

    nproc, threads = plan_workers(len(todo), concurrency, processes)
    res.processes, res.threads = nproc, threads
    prog = Progress(total=len(todo), total_bytes=sum(e.size for e in todo), desc="stage", mode=progress)
    try:
        if not todo:
            failures: list[tuple[str, str]] = []
        elif nproc == 1:
            failures = _copy_many(vol, todo, tree, verify, retries, threads,
                                  lambda n, failed: prog.update(1, n, failed))
        else:
            failures = _run_processes(vol, todo, tree, verify, retries, nproc, threads, prog)
    except BaseException:
        prog.close()
        raise
    finally:
        tree.close()
    res.seconds = time.monotonic() - t0
    res.files = len(todo) - len({p for p, _ in failures})
    res.failed = sorted((StageFailure(p, r) for p, r in blocked + failures), key=lambda f: f.path)
    res.bytes = prog.nbytes
    prog.close(text=str(res).split("\n", 1)[0])
    return res


__all__ = ["stage", "StageResult", "StageFailure", "StagingError"]


