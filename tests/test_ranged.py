"""Parallel ranged copies of big files: range planning (pure) and the copy with retries per range."""
import _thread
import contextlib
import errno
import itertools
import os
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic.files.ranged import plan_ranges, ranged_copy


@settings(deadline=None)  # a loaded machine must not fail a pure property
@given(st.integers(0, 1 << 40), st.integers(1, 1 << 32))
def test_ranges_cover_the_file_exactly_once_in_order(size, range_size):
    if size // range_size > 2_000:  # keep the example small; coverage is the same property
        size = range_size * 2_000 + size % range_size
    ranges = plan_ranges(size, range_size)
    assert sum(e - s for s, e in ranges) == size
    assert all(0 < e - s <= range_size for s, e in ranges)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous: no gap, no overlap
    assert (ranges[0][0], ranges[-1][1]) == (0, size) if size else ranges == []
    assert all(e - s == range_size for s, e in ranges[:-1])


def test_range_planning_refuses_nonsense():
    with pytest.raises(ValueError):
        plan_ranges(-1, 10)
    with pytest.raises(ValueError):
        plan_ranges(10, 0)


class BytesReader:
    """A read stream over bytes; ``fail_at`` offsets raise EIO once each (a flaky network read)."""

    def __init__(self, data: bytes, fail_at: set[int], log: list[str]) -> None:
        self.data, self.fail_at, self.log = data, fail_at, log
        log.append("open")

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        for bad in list(self.fail_at):
            if offset <= bad < offset + len(buf):
                self.fail_at.discard(bad)
                self.log.append("fail")
                raise OSError(errno.EIO, "injected read error")
        chunk = self.data[offset:offset + len(buf)]
        buf[:len(chunk)] = chunk
        return len(chunk)

    def close(self) -> None:
        self.log.append("close")


def test_a_read_failing_mid_range_is_retried_from_where_it_stopped(tmp_path):
    data = os.urandom(5 * 1000 + 7)
    log: list[str] = []
    fail_at = {2500, 2510, 4321}  # in the middle of ranges 2 and 4, twice in range 2
    lock = threading.Lock()

    def opener():
        with lock:
            return BytesReader(data, fail_at, log)

    dest = tmp_path / "out.bin"
    assert ranged_copy(opener, len(data), str(dest), range_size=1000, chunk=64, streams=3, retries=3) == len(data)
    assert dest.read_bytes() == data
    assert log.count("fail") == 3
    assert 1 + 3 <= log.count("open") <= 3 + 3  # the streams that took a range, plus one reopen per failure
    assert log.count("close") == log.count("open")


def test_a_range_failing_every_retry_fails_the_copy_and_closes_every_stream(tmp_path):
    data = os.urandom(8000)
    log: list[str] = []

    class Broken(BytesReader):
        def readinto_at(self, offset, buf):
            if offset >= 6000:
                raise OSError(errno.EIO, "the volume is gone")
            return super().readinto_at(offset, buf)

    with pytest.raises(OSError, match="the volume is gone"):
        ranged_copy(lambda: Broken(data, set(), log), len(data), str(tmp_path / "o"), range_size=1000, chunk=500,
                    streams=4, retries=2)
    assert log.count("close") == log.count("open")


def test_a_source_shorter_than_listed_is_an_error_not_a_short_file(tmp_path):
    data = os.urandom(2500)
    with pytest.raises(OSError, match="ended at byte 2500"):
        ranged_copy(lambda: BytesReader(data, set(), []), 3000, str(tmp_path / "o"), range_size=1000, retries=1)


def test_an_empty_file_copies_to_an_empty_file(tmp_path):
    dest = tmp_path / "o"
    assert ranged_copy(lambda: BytesReader(b"", set(), []), 0, str(dest)) == 0
    assert dest.read_bytes() == b""


def _open_fds(path) -> int:
    """How many of this process's descriptors are open on ``path``."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            n += os.readlink(f"/proc/self/fd/{fd}") == str(path)
    return n


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the open descriptors from /proc")
def test_ctrl_c_during_a_hung_range_read_returns_without_joining_it_and_the_last_stream_closes_the_file(tmp_path):
    data = os.urandom(4000)
    hung, release = threading.Event(), threading.Event()

    class Hanging(BytesReader):
        def readinto_at(self, offset, buf):
            if offset >= 3000:  # the last range: a read stuck in a hung mount
                hung.set()
                release.wait(120)  # longer than the test's timeout: joining it fails the test
            return super().readinto_at(offset, buf)

    def interrupt() -> None:
        if hung.wait(30):
            _thread.interrupt_main()  # Ctrl-C

    dest = tmp_path / "o"
    threading.Thread(target=interrupt, daemon=True).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            ranged_copy(lambda: Hanging(data, set(), []), len(data), str(dest), range_size=1000, chunk=500,
                        streams=2)
        assert not release.is_set() and hung.is_set()  # back while the read still hangs: it was not joined
        assert _open_fds(dest) == 1  # the file stays open for the stream that may still write to it
    finally:
        release.set()
    deadline = time.monotonic() + 20
    while _open_fds(dest) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _open_fds(dest) == 0  # closed by the last stream once it stopped, never under it


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads the open descriptors from /proc")
def test_ctrl_c_while_the_streams_start_never_closes_the_file_under_a_running_stream(tmp_path, monkeypatch):
    """Ctrl-C can land while the caller is still starting the streams (seen beside two busy processes: the
    streams ran ahead of the caller, one hung, and the interrupt came before the caller waited). The file must
    stay open for the stream already running: closed under it, its descriptor number goes to the next file
    opened, and the stream's late writes land in that file."""
    from ucmagic.files import ranged

    data = os.urandom(4000)
    hung, release = threading.Event(), threading.Event()

    class Hanging(BytesReader):
        def readinto_at(self, offset, buf):
            if offset == 0:  # the first stream's first read hangs (a hung mount), then writes its bytes
                hung.set()
                release.wait(120)
            return super().readinto_at(offset, buf)

    real = ranged.stream_pool()

    class InterruptedWhileStarting:
        """The first stream starts; Ctrl-C arrives while the caller starts the second."""
        calls = 0

        def submit(self, fn, *args):
            InterruptedWhileStarting.calls += 1
            if InterruptedWhileStarting.calls == 2:
                assert hung.wait(30)
                raise KeyboardInterrupt
            return real.submit(fn, *args)

    monkeypatch.setattr(ranged, "stream_pool", lambda: InterruptedWhileStarting())
    dest = tmp_path / "o"
    victim = tmp_path / "next-file"
    try:
        with pytest.raises(KeyboardInterrupt):
            ranged_copy(lambda: Hanging(data, set(), []), len(data), str(dest), range_size=1000, chunk=500,
                        streams=2)
        assert _open_fds(dest) == 1  # the running stream still holds it
        fd = os.open(victim, os.O_RDWR | os.O_CREAT, 0o600)  # the next file the process opens
    finally:
        release.set()
    try:
        deadline = time.monotonic() + 20
        while _open_fds(dest) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _open_fds(dest) == 0  # closed by the stream once it stopped
        assert os.fstat(fd).st_size == 0, "the stream wrote into another file through a reused descriptor"
    finally:
        os.close(fd)
