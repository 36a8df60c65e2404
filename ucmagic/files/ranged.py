"""Parallel ranged copy of one big file: several streams read disjoint byte ranges into one file.

A single read stream from a network volume or object store is capped (about 200 MB/s on a FUSE
mount); a big file is copied at volume speed by reading many ranges of it at once, each stream with
its own handle, writing each range at its offset of one destination file with ``os.pwrite``.

:func:`plan_ranges` is the pure range planning. :func:`ranged_copy` does the I/O: a failing read is
retried for its range only (with :func:`ucmagic.files.fetch.with_retries`, resuming at the byte it had
reached), and the file must end up exactly ``size`` bytes long. Every process runs at most
:data:`MAX_STREAMS` range streams at once, whatever the number of files being copied: the streams
run on one per-process pool of that many threads, taken first-come first-served with each file's
streams queued together, so the first file asked for finishes first.
"""
from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import Protocol

from .._util import DaemonPool, wait_result
from .fetch import with_retries
import contextlib

THRESHOLD = 64 << 20
"""Files of at least this many bytes are copied by ranges (``Volume.range_threshold``)."""
RANGE_SIZE = 16 << 20
"""Bytes per range."""
MAX_STREAMS = max(1, int(os.environ.get("UCMAGIC_RANGE_STREAMS", "32")))
"""Range streams per process, over all files (``$UCMAGIC_RANGE_STREAMS``)."""
CHUNK = 1 << 20
"""Bytes per read call within a range (the buffer each stream holds)."""


def plan_ranges(size: int, range_size: int = RANGE_SIZE) -> list[tuple[int, int]]:
    """Half-open byte ranges ``[start, end)`` covering ``[0, size)`` in order, ``range_size`` each
    (the last one shorter); no range for an empty file."""
    if size < 0 or range_size <= 0:
        raise ValueError(f"size must be >= 0 and range_size > 0, got {size} and {range_size}")
    return [(start, min(start + range_size, size)) for start in range(0, size, range_size)]


class RangeReader(Protocol):
    """One open read stream on a source file."""

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        """Read up to ``len(buf)`` bytes at ``offset`` into ``buf``; return the count (0 at end of file)."""

    def close(self) -> None:
        """Release the stream."""


_pool_mu = threading.Lock()
_pool: tuple[int, DaemonPool] | None = None
_submit_mu = threading.Lock()  # one file's streams enter the pool's queue together: files finish in order


def _after_fork() -> None:  # a lock held by a thread of the parent would stay held forever in the child
    global _pool_mu, _submit_mu, _pool
    _pool_mu, _submit_mu, _pool = threading.Lock(), threading.Lock(), None


os.register_at_fork(after_in_child=_after_fork)


def stream_pool() -> DaemonPool:
    """This process's pool of :data:`MAX_STREAMS` range-stream threads (a new one after fork; daemon
    threads, never joined: a range read stuck in a hung mount does not keep the interpreter alive)."""
    global _pool
    with _pool_mu:
        if _pool is None or _pool[0] != os.getpid():
            _pool = (os.getpid(), DaemonPool(MAX_STREAMS, "ucmagic-range"))
        return _pool[1]


def ranged_copy(open_reader: Callable[[], RangeReader], size: int, dest: str, *, range_size: int = RANGE_SIZE,
                streams: int = MAX_STREAMS, chunk: int = CHUNK, retries: int = 3) -> int:
    """Copy ``size`` bytes from the streams ``open_reader()`` opens into a new file ``dest``; return ``size``.

    Up to ``streams`` streams (each its own ``open_reader()`` handle) take the ranges of
    :func:`plan_ranges` in order. A failed read closes its stream and is retried ``retries`` times
    from the byte it had reached; the first range that still fails stops the other streams and its
    error is raised. A source shorter than ``size`` raises ``OSError(EIO)``.
    """
    ranges = plan_ranges(size, range_size)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    mu = threading.Lock()
    nxt = [0]
    stop = threading.Event()
    errors: list[BaseException] = []
    done = [0]

    def take() -> tuple[int, int] | None:
        with mu:
            if stop.is_set() or nxt[0] >= len(ranges):
                return None
            nxt[0] += 1
            return ranges[nxt[0] - 1]

    def stream() -> None:
        buf = memoryview(bytearray(min(chunk, range_size)))
        reader: list[RangeReader | None] = [None]

        def copy_rest(job: tuple[list[int], int]) -> None:
            pos, end = job
            try:
                rd = reader[0]
                if rd is None:
                    rd = reader[0] = open_reader()
                while pos[0] < end and not stop.is_set():
                    want = min(len(buf), end - pos[0])
                    n = rd.readinto_at(pos[0], buf[:want])
                    if n <= 0:
                        raise OSError(errno.EIO, f"the source ended at byte {pos[0]}, expected {size} bytes")
                    view, off = buf[:n], pos[0]
                    while view:  # pwrite may write less than asked
                        w = os.pwrite(fd, view, off)
                        view, off = view[w:], off + w
                    pos[0] += n
            except BaseException:
                _close(reader)
                raise

        try:
            while (r := take()) is not None:
                pos = [r[0]]
                with_retries(copy_rest, (pos, r[1]), retries)
                if pos[0] == r[1]:
                    with mu:
                        done[0] += r[1] - r[0]
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            with mu:
                errors.append(e)
            stop.set()
        finally:
            _close(reader)

    running = [0]  # streams still running: the last one to stop closes a file given up on
    close_fd = [True]

    def stopped(_: object) -> None:
        with mu:
            running[0] -= 1
            last = running[0] == 0 and not close_fd[0]
        if last:
            os.close(fd)

    try:
        pool = stream_pool()
        with _submit_mu:
            futures = [pool.submit(stream) for _ in range(min(max(1, streams), len(ranges)))]
        running[0] = len(futures)
        try:
            for f in futures:
                wait_result(f)  # timed steps: Ctrl-C interrupts at once
        except BaseException:
            stop.set()  # an interrupt: streams stop at their next chunk; a read stuck in a hung
            # mount is not waited for: the file is closed by the last stream, never under one
            with mu:
                close_fd[0] = running[0] == 0 or all(f.done() for f in futures)
            if not close_fd[0]:
                for f in futures:
                    f.add_done_callback(stopped)
            raise
        if errors:
            raise errors[0]
        if done[0] != size or os.fstat(fd).st_size != size:
            raise OSError(errno.EIO, f"ranged copy wrote {done[0]} bytes, expected {size}")
    finally:
        if close_fd[0]:
            os.close(fd)
    return size


def _close(reader: list[RangeReader | None]) -> None:
    if reader[0] is not None:
        with contextlib.suppress(OSError):
            reader[0].close()
        reader[0] = None
