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

import contextlib
import errno
import io
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Protocol

from .._util import DaemonPool, open_emptied, wait_result
from .fetch import with_retries

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
    fd = open_emptied(dest)
    copy = _RangedCopy(open_reader, size, fd, ranges, buf_size=min(chunk, range_size), retries=retries)
    try:
        copy.run(streams)
    finally:
        copy.close_fd()
    return size


class _Cursor:
    """A range being copied: ``pos`` moves on as bytes land, so a retry resumes where a failed read stopped."""

    __slots__ = ("pos", "end")

    def __init__(self, start: int, end: int) -> None:
        self.pos, self.end = start, end


class _Handle:
    """One stream's reader: opened on first use, and again after a failed read closed it."""

    __slots__ = ("_open", "_reader")

    def __init__(self, open_reader: Callable[[], RangeReader]) -> None:
        self._open = open_reader
        self._reader: RangeReader | None = None

    def get(self) -> RangeReader:
        if self._reader is None:
            self._reader = self._open()
        return self._reader

    def close(self) -> None:
        if self._reader is not None:
            with contextlib.suppress(OSError):
                self._reader.close()
            self._reader = None


class _RangedCopy:
    """One :func:`ranged_copy`. Its streams run on pool threads; what they share with each other and
    with the caller (the next range, the bytes done, the errors, the streams running, who closes the
    destination) goes under ``_mu``; ``_stop`` tells the streams to stop at their next chunk."""

    def __init__(self, open_reader: Callable[[], RangeReader], size: int, fd: int, ranges: list[tuple[int, int]],
                 *, buf_size: int, retries: int) -> None:
        self._open_reader, self._size, self._fd, self._ranges = open_reader, size, fd, ranges
        self._buf_size, self._retries = buf_size, retries
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._next = 0  # index of the next range to take
        self._done = 0  # bytes of the ranges copied whole
        self._errors: list[BaseException] = []
        self._running = 0  # streams that started and have not stopped
        self._caller_left = False  # the caller is done (or interrupted): the last stream to stop closes fd
        self._closed = False  # fd is closed: a stream that starts now does nothing

    def run(self, streams: int) -> None:
        """Run the streams and wait for them (the caller's thread); raise the first error. An interrupt
        (Ctrl-C) at any point returns at once: :meth:`close_fd` then stops the streams at their next chunk
        without waiting for them (a read stuck in a hung mount is not waited for)."""
        pool = stream_pool()
        futures: list[Future[None]] = []
        with _submit_mu:
            for _ in range(min(max(1, streams), len(self._ranges))):
                futures.append(pool.submit(self._stream))
        for f in futures:
            wait_result(f)  # timed steps: Ctrl-C interrupts at once
        self._check()

    def close_fd(self) -> None:
        """The caller is done, normally or not: the file is closed now if no stream runs, else by the last
        stream to stop, never under one (closed under it, its descriptor number would go to the next file the
        process opens, and the stream's late writes would land there). Always called, from a ``finally``."""
        with self._mu:
            self._caller_left = True
            mine = self._running == 0 and not self._closed
            if mine:
                self._closed = True
        if mine:
            os.close(self._fd)
        else:
            self._stop.set()  # streams still run: the caller left early

    def _check(self) -> None:
        """Every stream stopped: the first error, or the file short of ``size``, is raised."""
        with self._mu:
            error, done = (self._errors[0] if self._errors else None), self._done
        if error is not None:
            raise error
        if done != self._size or os.fstat(self._fd).st_size != self._size:
            raise OSError(errno.EIO, f"ranged copy wrote {done} bytes, expected {self._size}")

    def _take(self) -> tuple[int, int] | None:
        with self._mu:
            if self._stop.is_set() or self._next >= len(self._ranges):
                return None
            self._next += 1
            return self._ranges[self._next - 1]

    def _stream(self) -> None:
        """One range stream (a pool thread): copy ranges until none is left or the copy stops. Counted as
        running from its start (one that starts after the caller closed the file does nothing); the last
        to stop after the caller left closes the file."""
        with self._mu:
            if self._closed or self._stop.is_set():
                return
            self._running += 1
        handle = _Handle(self._open_reader)
        try:
            buf = memoryview(bytearray(self._buf_size))
            while (r := self._take()) is not None:
                cur = _Cursor(*r)
                with_retries(lambda c: self._copy_rest(handle, buf, c), cur, self._retries)
                if cur.pos == cur.end:
                    with self._mu:
                        self._done += r[1] - r[0]
        except BaseException as e:  # noqa: BLE001 - handed to the caller by _check
            with self._mu:
                self._errors.append(e)
            self._stop.set()
        finally:
            handle.close()
            with self._mu:
                self._running -= 1
                last = self._running == 0 and self._caller_left and not self._closed
                if last:
                    self._closed = True
            if last:
                os.close(self._fd)

    def _copy_rest(self, handle: _Handle, buf: memoryview, cur: _Cursor) -> None:
        """Copy the range from ``cur.pos`` on; a failed read closes the stream's reader."""
        try:
            rd = handle.get()
            while cur.pos < cur.end and not self._stop.is_set():
                n = rd.readinto_at(cur.pos, buf[:min(len(buf), cur.end - cur.pos)])
                if n <= 0:
                    raise OSError(errno.EIO, f"the source ended at byte {cur.pos}, expected {self._size} bytes")
                _pwrite_all(self._fd, buf[:n], cur.pos)
                cur.pos += n
        except BaseException:
            handle.close()
            raise


def _pwrite_all(fd: int, view: memoryview, off: int) -> None:
    while view:  # pwrite may write less than asked
        w = os.pwrite(fd, view, off)
        view, off = view[w:], off + w


class RangedFile(io.RawIOBase):
    """A seekable read-only file object over a ``readinto_at`` stream (a :class:`RangeReader`, what
    ``Volume.range_reader`` returns): a reader of the file's format (tar headers, a Parquet footer and its
    column chunks) reads only the byte ranges it asks for. ``bytes_read`` counts them. Subclasses that
    keep their bytes elsewhere override :meth:`readinto` and :meth:`close`."""

    def __init__(self, reader: Any, size: int) -> None:
        super().__init__()
        self._reader, self._size, self._pos = reader, int(size), 0
        self.bytes_read = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = max(0, base + int(offset))
        return self._pos

    def _want(self, size: int | None) -> int:
        """Bytes a read of ``size`` (None or negative: the rest) gets from the position: none past the end."""
        left = max(0, self._size - self._pos)
        return left if size is None or size < 0 else min(size, left)

    def readinto(self, buf: Any) -> int:
        view = memoryview(buf).cast("B")
        want = self._want(len(view))
        got = 0
        while got < want:
            n = self._reader.readinto_at(self._pos + got, view[got:want])
            if n <= 0:
                break
            got += n
        self._pos += got
        self.bytes_read += got
        return got

    def close(self) -> None:
        if not self.closed and self._reader is not None:
            self._reader.close()
        super().close()
