"""Small helpers with one home each: the URL test, the retry policy, the local copy loop and atomic writes.

Nothing here imports beyond the standard library, so every module may use it.
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import gc
import importlib
import itertools
import numbers
import os
import queue
import random
import re
import sys
import threading
import time
import weakref
import zlib
from concurrent.futures import Executor, Future
from concurrent.futures import wait as _wait_futures
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, TypeVar

R = TypeVar("R")

_URL_RE = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.\-]*://")


def is_url(path: str | os.PathLike[str]) -> bool:
    """True for ``scheme://...`` (``s3://``, ``file://``, ``slow://``...), False for local and ``/Volumes`` paths."""
    return bool(_URL_RE.match(os.fspath(path)))


def is_remote_url(path: str | os.PathLike[str]) -> bool:
    """A URL that is not ``file://``: read and written through its registered volume backend (fsspec's by
    default) rather than the local filesystem. The one URL test of checkpoints, staging, pack and datasets."""
    return is_url(path) and not os.fspath(path).startswith("file://")


# Retries of a failing file copy: enough that a volume failing 1 open in 3 leaves under 1% odds that
# any of 100,000 files exhausts them (0.3% at 14), with the backoff capped so a file that never
# succeeds fails within about 22 s of sleeps (tests/test_retry_defaults.py checks both).
DEFAULT_RETRIES = 14


@dataclass(frozen=True)
class RetryPolicy:
    """How to retry a call: which errors are final, which are worth another try, and how long to wait.

    ``permanent`` errors are raised at once; ``transient`` ones are retried up to ``retries`` times,
    sleeping ``min(cap, base * factor**i) * (1 + jitter * random())`` before retry ``i``; anything
    else is raised at once.
    """

    retries: int = 3
    permanent: tuple[type[BaseException], ...] = (FileNotFoundError, PermissionError,
                                                  IsADirectoryError, NotADirectoryError)
    transient: tuple[type[BaseException], ...] = (Exception,)
    base: float = 0.01
    factor: float = 2.0
    cap: float = 2.0
    jitter: float = 0.5

    def delays(self, rng: random.Random | None = None) -> list[float]:
        """The sleep before each retry."""
        return [self.delay(i, rng) for i in range(self.retries)]

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """The sleep before retry ``attempt`` (0-based)."""
        return min(self.cap, self.base * self.factor ** attempt) * (1 + self.jitter * (rng or random).random())

    def call(self, fn: Callable[[], R], on_retry: Callable[[BaseException], None] | None = None) -> R:
        """``fn()``, retried on transient errors per this policy."""
        for attempt in range(self.retries + 1):  # delays drawn only when needed: most calls succeed at once
            try:
                return fn()
            except self.permanent:
                raise
            except self.transient as e:
                if attempt >= self.retries:
                    raise
                if on_retry:
                    on_retry(e)
                time.sleep(self.delay(attempt))
        raise AssertionError("unreachable")  # pragma: no cover


def path_under(path: str, root: str) -> str | None:
    """Where ``path`` lies under ``root`` once both are resolved (symlinks, ``..``): its relative path
    with ``/`` separators, ``"."`` for ``root`` itself, None outside it."""
    try:
        rel = os.path.relpath(os.path.realpath(path), os.path.realpath(root))
    except ValueError:  # another drive
        return None
    return None if rel == os.pardir or rel.startswith(os.pardir + os.sep) else rel.replace(os.sep, "/")


LOCAL_DISK_FS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "f2fs", "zfs", "jfs", "reiserfs",
                           "bcachefs", "overlay", "ramfs", "vfat", "exfat", "hfsplus", "apfs"})
"""File systems whose reads come from this machine's own disks or memory: a read there cannot hang
on a network or a server process (FUSE, NFS, SMB, ... are not in it)."""


def mount_fs_type(path: str, mountinfo: str | None = None) -> str | None:
    """The file system type of the mount that holds ``path`` (``/proc/self/mountinfo``, or the text
    ``mountinfo``): the longest mount point above it; None where there is no mount table (not Linux)."""
    if mountinfo is None:
        try:
            with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
                mountinfo = f.read()
        except OSError:
            return None
        path = os.path.realpath(path)
    else:
        path = os.path.normpath(path)
    best, fs = -1, None
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 5:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])  # \040: a space
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) >= best:
            best, fs = len(point), line.split(" - ", 1)[1].split()[0]
    return fs


def is_integer(value: Any) -> bool:
    """True for an int or a numpy integer, never a bool (``True`` is an int to Python, not a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)  # 0 where the platform has none (Windows)
_buffers = threading.local()
COPY_BUFFER = 1 << 20
FILL_BUFFER = 256 << 10  # a cache fill's reads: FUSE serves up to 128 KiB per request; a buffer per fill thread


def open_emptied(path: str, mode: int = 0o600, *, dir_fd: int | None = None) -> int:
    """A descriptor of ``path`` (made if missing) open for writing at offset 0, the file empty; one
    already empty is not truncated. On ext4 a truncated file starts its writeback when it is closed
    (``auto_da_alloc``): the cache's fills reopen an empty unnamed file, and an ``O_TRUNC`` there
    doubled the kernel time of each small file's copy (docs/benchmarks.md). A symbolic link at
    ``path`` is never followed (``O_NOFOLLOW``: the open fails), except ``/proc/self/fd/<n>``, which
    names a descriptor of this process's own (the cache's unnamed fill files). ``dir_fd``: ``path`` is a
    name in that directory's descriptor (a checked folder: the write cannot be redirected by a rename)."""
    nofollow = 0 if path.startswith("/proc/self/fd/") else O_NOFOLLOW
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | nofollow, mode, dir_fd=dir_fd)
    try:
        if os.fstat(fd).st_size:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def copy_local(src: str, dest: str, *, crc: bool = False, sync: bool = False,
               buffer_size: int = COPY_BUFFER, check: Callable[[], None] | None = None) -> tuple[int, int]:
    """Copy a local or mounted file with plain reads into a reused per-thread buffer; ``(bytes, crc32)``.

    On a FUSE mount this is ~2x faster than ``os.sendfile`` (which splices the source page by page)
    and allocates nothing per file. ``crc=True`` computes the CRC-32 on the way (else 0);
    ``sync=True`` fsyncs ``dest`` before returning. ``check`` is called before each buffer and may
    raise to stop the copy (a cancelled save). The loop is :func:`copy_fds`.
    """
    fsrc = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fdst = open_emptied(dest, 0o666)
        try:
            out = copy_fds(fsrc, fdst, crc=crc, check=check, buffer_size=buffer_size)
            if sync:
                os.fsync(fdst)
        finally:
            os.close(fdst)
    finally:
        os.close(fsrc)
    return out


def copy_fds(fsrc: int, fdst: int, *, size: int | None = None, crc: bool = False,
             check: Callable[[], None] | None = None, buffer_size: int = COPY_BUFFER) -> tuple[int, int]:
    """The local copy loop, one home for every local copy: descriptor ``fsrc`` to ``fdst``; ``(bytes, crc32)``.

    Raw descriptors, no file objects (each costs an fstat, an ioctl and an lseek per file), plain
    reads into a reused per-thread buffer of ``buffer_size`` bytes. With ``size`` the copy stops
    there (a source that grew shows in the caller's size check). ``os.sendfile`` is not used: with
    reads the cache's fills measured 15-28% faster from FUSE mounts (``sendfile`` splices the source
    page by page) and no slower from local disk (docs/benchmarks.md).
    """
    n = c = 0
    buf = _thread_buffer(buffer_size)
    while size is None or n < size:
        if check is not None:
            check()
        got = os.readv(fsrc, [buf if size is None or size - n >= buffer_size else buf[:size - n]])
        if not got:
            break
        view = buf[:got]
        if crc:
            c = zlib.crc32(view, c)
        write_all(fdst, view)
        n += got
    return n, c


def copy_file_to_fd(fsrc: Any, fdst: int, *, buffer_size: int = COPY_BUFFER) -> int:
    """A readable file object (an fsspec file) to descriptor ``fdst``; the bytes copied. As
    :func:`copy_fds`: reads into the reused per-thread buffer (``readinto`` where the file has it), raw
    writes; ``shutil.copyfileobj`` allocates a new buffer per read and writes through a file object."""
    n = 0
    buf = _thread_buffer(buffer_size)
    readinto = getattr(fsrc, "readinto", None)
    while True:
        if readinto is not None:
            got = readinto(buf) or 0  # None: nothing to read now, as at the end
            view = buf[:got]
        else:
            view = memoryview(fsrc.read(buffer_size))
            got = len(view)
        if not got:
            return n
        write_all(fdst, view)
        n += got


def copy_file_to_path(fsrc: Any, dest: str, *, buffer_size: int = COPY_BUFFER) -> int:
    """A readable file object to the local file ``dest`` (made if missing, emptied: :func:`open_emptied`)
    through :func:`copy_file_to_fd`; the bytes copied."""
    fdst = open_emptied(dest)
    try:
        return copy_file_to_fd(fsrc, fdst, buffer_size=buffer_size)
    finally:
        os.close(fdst)


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to descriptor ``fd`` (a raw write may be partial)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _thread_buffer(size: int) -> memoryview:
    """This thread's reused copy buffer of ``size`` bytes (one per size and thread)."""
    bufs = getattr(_buffers, "bufs", None)
    if bufs is None:
        bufs = _buffers.bufs = {}
    buf = bufs.get(size)
    if buf is None:
        buf = bufs[size] = memoryview(bytearray(size))
    return buf


def error_line(exc: BaseException) -> str:
    """The one line a user sees for ``exc``: its message's first line (a KeyError's without the quotes
    ``str()`` adds; for torch's multi-line ``CheckpointException``, its first rank's error), else its type name."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:  # torch.distributed.checkpoint.CheckpointException
        inner = next(iter(failures.values()))
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        if isinstance(inner, BaseException) and inner is not exc:
            return error_line(inner)
    text = (str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)).strip()
    return text.splitlines()[0] if text else type(exc).__name__


POLL_S = 0.2  # how often a waiting caller looks up: Ctrl-C and cancellation are seen within this


POOL_EXIT_WAIT_S = 1.0
"""How long the interpreter's exit waits for pool threads to end the call they are in (a call's own work
ends in milliseconds once the read-aheads are closed; a read stuck in a hung mount is not waited for longer)."""

_live_pools: "weakref.WeakSet[DaemonPool]" = weakref.WeakSet()


class DaemonPool(Executor):
    """A thread pool whose threads are daemons, started on demand, and never joined for long.

    ``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so a
    call stuck in a hung mount (or waiting for cache room that no one will free) keeps the process
    alive for good; here such a call is abandoned and the interpreter exits. ``shutdown`` never waits.
    At exit (:func:`stop_pools_at_exit`, before the interpreter is finalized) calls still queued are
    dropped and the threads get :data:`POOL_EXIT_WAIT_S` to end the call they are in: a thread that
    drops the last reference to a batch of tensors while the interpreter is finalized ends the process
    with ``terminate called without an active exception`` (torch re-takes the GIL in the tensor's
    deleter; the GIL is gone, so the thread is unwound through C++ code).
    :meth:`post` runs a call without a Future, for a caller that gets its result another way (the
    read-ahead's tasks: a Future's condition variable costs more than the rest of a quick hand-off).
    """

    def __init__(self, max_workers: int, name: str = "ucmagic") -> None:
        self.max_workers = max(1, int(max_workers))
        self._name = name
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        # one token per thread that ended a call and waits for the next, put without a lock (with tens of
        # threads a lock taken after every call was contended) and taken by the call that claims it
        self._idle: queue.SimpleQueue = queue.SimpleQueue()
        self._mu = threading.Lock()  # posts and shutdown
        self._threads: list[threading.Thread] = []
        self._shut = False
        self._exiting = False  # the interpreter exits: queued calls are dropped, not run
        self.pid = os.getpid()  # the process whose threads these are (a forked child has none of them)
        _live_pools.add(self)

    def submit(self, fn: Callable[..., R], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        self._put((fut, fn, args, kwargs))
        return fut

    def post(self, fn: Callable[..., object], /, *args: Any) -> None:
        """Run ``fn(*args)`` on a pool thread, with no Future: ``fn`` hands its result (and any error)
        back itself; an error it lets out is dropped."""
        self._put((None, fn, args, {}))

    def _put(self, job: tuple[Future | None, Callable[..., Any], tuple[Any, ...], dict[str, Any]]) -> None:
        with self._mu:
            if self._shut:
                raise RuntimeError("cannot schedule new calls after shutdown")
            self._q.put(job)
            try:
                self._idle.get_nowait()  # a waiting thread takes it
                return
            except queue.Empty:
                pass
            if len(self._threads) < self.max_workers:
                t = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads) + 1}", daemon=True)
                self._threads.append(t)
                t.start()

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                self._q.put(None)  # wake the next thread: all of them stop
                return
            if self._exiting:
                del job  # dropped while the interpreter can still free what it holds
                continue
            fut, fn, args, kwargs = job
            del job
            if fut is None:
                with contextlib.suppress(BaseException):  # post(): the call hands back its own errors
                    fn(*args)
            elif fut.set_running_or_notify_cancel():
                try:
                    res = fn(*args, **kwargs)
                except BaseException as exc:  # noqa: BLE001 - handed to the caller through the future
                    fut.set_exception(exc)
                    del exc
                else:
                    fut.set_result(res)
                    del res
            del fut, fn, args, kwargs
            self._idle.put(None)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No new calls; threads stop once the queue is empty. Never joins (``wait`` is ignored)."""
        with self._mu:
            self._shut = True
        self._q.put(None)

    def stop_for_exit(self) -> list[threading.Thread]:
        """Drop the queued calls, stop the threads after the call they are in; the threads to wait for."""
        self._exiting = True
        self.shutdown(wait=False)
        with self._mu:
            return list(self._threads)


def stop_pools_at_exit(timeout: float = POOL_EXIT_WAIT_S) -> None:
    """At interpreter exit: every :class:`DaemonPool` of this process drops its queued calls, and its threads
    get ``timeout`` seconds in all to end the call they are in (registered with ``atexit`` on import of
    this module, so it runs after every ucmagic exit handler registered later: they may still use the pools)."""
    pid = os.getpid()
    threads = [t for pool in list(_live_pools) if pool.pid == pid for t in pool.stop_for_exit()]
    deadline = time.monotonic() + timeout
    with contextlib.suppress(KeyboardInterrupt):  # a second Ctrl-C: stop waiting
        for t in threads:
            if t.ident is not None and t is not threading.current_thread():
                t.join(max(0.0, deadline - time.monotonic()))


atexit.register(stop_pools_at_exit)


def wait_result(fut: Future, poll: float = POLL_S, on_poll: Callable[[], None] | None = None) -> Any:
    """``fut.result()`` waited for in steps of ``poll`` seconds, so Ctrl-C is seen at once and
    ``on_poll()`` (which may raise) runs between steps. An error of the call itself is raised as is,
    even a ``TimeoutError``."""
    wait_done(fut, poll, on_poll)
    return fut.result()


def wait_done(fut: Future, poll: float = POLL_S, on_poll: Callable[[], None] | None = None) -> None:
    """Wait until ``fut`` is done (its error is not raised), in steps of ``poll`` seconds: Ctrl-C is
    seen at once and ``on_poll()`` (which may raise) runs between steps."""
    while not _wait_futures([fut], timeout=poll).done:
        if on_poll is not None:
            on_poll()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block: for code that builds many acyclic objects at
    once (parsing a 70,000-member shard index: 0.05 s, 0.18-0.28 s with the collections it triggers
    scanning a heap that holds torch)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_settled: dict[int, bool] = {}


def settle_worker(trim: int = 64 << 20, mmap: int = 32 << 20) -> bool:
    """Tune a loader worker process for batches of big samples (once per process; later calls are free).

    - ``gc.freeze()``: the objects inherited from the parent are left out of later full collections,
      which would otherwise write to every page holding them (copy-on-write after fork: measured
      0.11 s per worker, once every few epochs).
    - glibc's malloc keeps up to ``trim`` freed bytes at the top of the heap and serves blocks under
      ``mmap`` bytes from it: by default a batch of big samples freed at once is returned to the kernel
      and the next batch faults every page in again (measured: 3x slower for batches of 32 samples of
      150 KiB).

    Returns whether the malloc part took effect (False without glibc)."""
    pid = os.getpid()
    if pid not in _settled:
        gc.freeze()
        try:
            fn = ctypes.CDLL(None).mallopt
            _settled[pid] = bool(fn(_M_MMAP_THRESHOLD, int(mmap)) and fn(_M_TRIM_THRESHOLD, int(trim)))
        except (OSError, AttributeError):
            _settled[pid] = False
    return _settled[pid]


@contextlib.contextmanager
def frozen_for_fork(on: bool = True) -> Iterator[None]:
    """The objects the garbage collector tracks left out of collections while worker processes are forked
    (``gc.freeze()`` right before fork, the recipe of Python's ``gc`` documentation): a forked worker
    inherits them frozen, so its full collections never write to the pages holding them. Measured after
    importing torch: one full collection in a DataLoader worker took 0.18-0.22 CPU-s and copied ~42 MB
    of pages (counted in the worker's memory, and in the parent's once every worker has its copy).
    The parent's objects go back to collections afterwards. Nothing is done (``on`` False) where objects
    are frozen already: the caller's own ``gc.freeze()`` stays as it is."""
    if not on or gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def release_free_heap() -> None:
    """Hand memory freed by the fetch threads back to the OS (glibc ``malloc_trim``; elsewhere a no-op).

    Each thread allocates from its own glibc arena; what a stream frees there stays mapped (and
    counted in the process's own memory) until trimmed, so without this a worker's memory grows
    with the number of items it fetched (measured: bench/listing.py, docs/scaling.md). The other
    half of the process-memory tuning, beside :func:`settle_worker`.
    """
    trim = _TRIM[0]
    if trim is None:
        trim = lambda: None  # noqa: E731 - the no-op
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL("libc.so.6").malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                trim = lambda: fn(0)  # noqa: E731
        _TRIM[0] = trim
    trim()


_TRIM: list[Callable[[], Any] | None] = [None]

_tmp_counter = itertools.count()


@contextlib.contextmanager
def atomic_target(path: str, tmp: str | None = None, *, dir_fd: int | None = None) -> Iterator[str]:
    """Yield a temp path beside ``path`` to write; rename it over ``path`` when the block succeeds.

    Readers see the old content or the new, never a part. ``tmp`` names the temp file (default
    ``<path>.tmp-<pid>-<n>-<random>``: not guessable by another user); it is removed when the block fails.
    ``dir_fd``: ``path`` (and the temp name) are names in that directory's descriptor.
    """
    tmp = tmp or f"{path}.tmp-{os.getpid()}-{next(_tmp_counter)}-{os.urandom(6).hex()}"
    try:
        yield tmp
        os.replace(tmp, path, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def atomic_write(path: str, data: bytes, *, tmp: str | None = None, sync: bool = False, mode: int = 0o644,
                 dir_fd: int | None = None) -> None:
    """Replace ``path`` with ``data`` atomically (see :func:`atomic_target`); ``sync=True`` fsyncs
    the temp file before the rename (durable across a crash). The temp file is made new (``O_EXCL``),
    never through a symbolic link; ``dir_fd``: ``path`` is a name in that directory's descriptor."""
    with atomic_target(path, tmp, dir_fd=dir_fd) as part:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | O_NOFOLLOW, mode, dir_fd=dir_fd)
        try:
            write_all(fd, data)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)


def fsync_dir(path: str) -> None:
    """Make a rename or creation in directory ``path`` durable (a no-op where directories cannot be synced)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def lazy_exports(package: str, exports: Mapping[str, str],
                 namespace: dict[str, Any]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module ``__getattr__`` and ``__dir__`` (PEP 562) for public names loaded on first use.

    ``exports`` maps each name to the submodule of ``package`` that defines it; a loaded name is
    kept in ``namespace`` (the package's ``globals()``), so each is imported once.
    """
    def getattr_(name: str) -> Any:
        mod = exports.get(name)
        if mod is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{mod}"), name)
        namespace[name] = value
        return value

    def dir_() -> list[str]:
        return sorted(set(namespace) | set(exports))

    return getattr_, dir_
