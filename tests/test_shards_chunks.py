"""The ranged chunk cache: exact bytes, one fill per chunk across processes, budgets, protection."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucmagic.files.cache import FileCache
from ucmagic.errors import CacheFullError
from ucmagic.shards.chunks import ChunkedFile, ChunkReader
from ucmagic.telemetry import SharedCounters
from ucmagic.files.volume import FsspecVolume, LocalVolume

CHUNK = 4096


@given(size=st.integers(1, 100_000), chunk=st.integers(1, 5000), data=st.data())
def test_chunks_of_a_range_cover_it_exactly(size, chunk, data):
    f = ChunkedFile(LocalVolume("/"), _entry(size), chunk)
    off = data.draw(st.integers(0, size - 1))
    n = data.draw(st.integers(0, size - off))
    cs = f.chunks_of(off, n)
    assert f.span(cs[0])[0] <= off and (n == 0 or f.span(cs[-1])[1] >= off + n)
    assert all(f.span(c)[1] > off for c in cs) and cs[-1] < f.chunks
    assert sum(b - a for a, b in (f.span(c) for c in range(f.chunks))) == size


def _entry(size: int, path: str = "x", mtime: float = 1.0):
    from ucmagic.files.volume import FileEntry

    return FileEntry(path, size, mtime)


def test_a_new_source_version_gets_new_keys():
    vol = LocalVolume("/data")
    a, b = ChunkedFile(vol, _entry(10_000, mtime=1.0), CHUNK), ChunkedFile(vol, _entry(10_000, mtime=2.0), CHUNK)
    assert {a.key(c) for c in range(a.chunks)}.isdisjoint(b.key(c) for c in range(b.chunks))
    assert len({a.key(c) for c in range(a.chunks)}) == a.chunks


@pytest.fixture
def big(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(10 * CHUNK + 123)
    (src / "big.bin").write_bytes(data)
    return src, data, str(tmp_path / "cache")


@pytest.mark.parametrize("remote", [False, True])
def test_reads_at_any_offset_return_the_source_bytes(big, remote):
    src, data, cache = big
    vol = FsspecVolume(f"slow://{src}", {"open_ms": 0, "mbps": 0}) if remote else LocalVolume(str(src))
    f = ChunkedFile(vol, vol.stat("big.bin"), CHUNK)
    r = ChunkReader(FileCache(cache), [f], keep=2)
    for off, n in ((0, 1), (CHUNK - 1, 2), (5, 3 * CHUNK), (len(data) - 7, 7), (0, len(data)), (100, 0)):
        assert r.read(0, off, n) == data[off:off + n]
    r.close()


def test_prefetched_chunks_are_protected_until_released_then_evictable(big):
    src, data, cache_dir = big
    vol = LocalVolume(str(src))
    cache = FileCache(cache_dir, limit=3 * CHUNK)
    f = ChunkedFile(vol, vol.stat("big.bin"), CHUNK)
    counters = SharedCounters()
    r = ChunkReader(cache, [f], keep=8, counters=counters)
    r.prefetch([(0, 0), (0, 1)])
    assert r.read(0, 0, 2 * CHUNK) == data[:2 * CHUNK]
    assert cache.usage().protected_bytes == 2 * CHUNK
    r.release(r.held())
    assert cache.usage().protected_bytes == 0
    for c in range(2, 10):  # the budget holds 3 chunks: older unprotected ones go
        assert r.read(0, c * CHUNK, 10) == data[c * CHUNK:c * CHUNK + 10]
        r.release(r.held())
        assert cache.usage().bytes <= 3 * CHUNK
    assert counters.totals()["misses"] == 10
    r.close()
    assert not os.listdir(os.path.join(cache_dir, "prot"))  # closing drops the protection record


def test_a_read_is_a_miss_only_when_its_chunk_was_copied_from_the_volume(big):
    """Issue 52: a shard stream's warm epoch recorded a miss for every chunk it opened (found in the cache), so
    its records looked as cold as the epoch that copied them; ahead or on demand, a copy is a miss, a chunk
    found in the cache or held open is a hit."""
    src, data, cache_dir = big
    vol = LocalVolume(str(src))
    f = ChunkedFile(vol, vol.stat("big.bin"), CHUNK)

    def hits(r, chunks):
        out = []
        for c in chunks:
            r.begin()
            assert r.read(0, c * CHUNK, 10) == data[c * CHUNK:c * CHUNK + 10]
            out.append(r.last_hit)
        return out

    cold = ChunkReader(FileCache(cache_dir), [f], keep=8)
    cold.prefetch([(0, 2), (0, 3)])
    assert hits(cold, [0, 0, 2, 3]) == [False, True, False, False]  # on demand, held, copied ahead (twice)
    cold.close()
    warm = ChunkReader(FileCache(cache_dir), [f], keep=8)  # a new stream (the next epoch): the cache has them
    warm.prefetch([(0, 3)])
    assert hits(warm, [0, 2, 3, 4]) == [True, True, True, False]
    warm.close()


def test_a_budget_smaller_than_one_chunk_is_refused_with_a_hint(big):
    src, _, cache_dir = big
    vol = LocalVolume(str(src))
    r = ChunkReader(FileCache(cache_dir, limit=CHUNK // 2), [ChunkedFile(vol, vol.stat("big.bin"), CHUNK)])
    with pytest.raises(CacheFullError, match="cache_limit"):
        r.read(0, 0, 10)
    r.close()


CHILD = r"""
import sys
from ucmagic.files.cache import FileCache
from ucmagic.shards.chunks import ChunkedFile, ChunkReader
from ucmagic.files.volume import LocalVolume
vol = LocalVolume(sys.argv[1])
f = ChunkedFile(vol, vol.stat("big.bin"), 4096)
r = ChunkReader(FileCache(sys.argv[2]), [f])
data = open(sys.argv[1] + "/big.bin", "rb").read()
assert r.read(0, 0, len(data)) == data
print(r.fills)
"""


def test_two_processes_fill_each_chunk_once(big):
    src, _, cache = big
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(src), cache], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=100)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sum(int(o.strip()) for o in outs) == 11  # 10 whole chunks and a short last one, filled once
