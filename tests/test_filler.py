"""The one fill path (ucmagic.files.filler): whole files and byte ranges through a real cache, with a fake
volume that counts its reads and fails on demand; retries, counters, the skip policy, validation, progress."""
from __future__ import annotations

import errno
import os

import pytest

from ucmagic.errors import CacheFullError, FetchError, SourceChangedError
from ucmagic.files.cache import FileCache
from ucmagic.files.filler import CacheFiller, SkipPolicy, SourceChecks, copies_into, range_key
from ucmagic.files.volume import FileEntry, LocalVolume
from ucmagic.telemetry import SharedCounters
from ucmagic._shared import SharedBits


class FlakyVolume(LocalVolume):
    """A local volume whose copies fail ``fail`` times first (with ``error``) and are counted."""

    def __init__(self, root: str, fail: int = 0, error: BaseException | None = None) -> None:
        super().__init__(root)
        self.fail, self.error, self.copies, self.stats = fail, error, 0, 0

    def copy_to(self, rel, dest, *, expect=None):  # type: ignore[override]
        self.copies += 1
        if self.fail:
            self.fail -= 1
            raise self.error or OSError(errno.EIO, "flaky")
        return super().copy_to(rel, dest, expect=expect)

    def stat(self, rel):  # type: ignore[override]
        self.stats += 1
        return super().stat(rel)


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    data = bytes(range(256)) * 40  # 10240 bytes
    (d / "a.bin").write_bytes(data)
    return d, data, FileCache(str(tmp_path / "cache"))


def test_a_whole_file_fill_is_one_copy_then_hits_and_is_counted(src):
    d, data, cache = src
    vol, counters = FlakyVolume(str(d)), SharedCounters()
    f = CacheFiller(cache, retries=0, counters=counters)
    e = vol.stat("a.bin")
    path, fetched = f.fill_file(vol, e, rel=e.path, space="s")
    assert fetched and open(path, "rb").read() == data and path.endswith("a.bin")
    again, fetched = f.fill_file(vol, e, rel=e.path, space="s")
    assert again == path and not fetched and vol.copies == 1
    t = counters.totals()
    assert (t["misses"], t["hits"], t["bytes_fetched"]) == (1, 1, len(data))


def test_transient_errors_are_retried_and_counted_permanent_ones_name_the_file(src):
    d, data, cache = src
    counters = SharedCounters()
    vol = FlakyVolume(str(d), fail=2)
    path, fetched = CacheFiller(cache, retries=3, counters=counters).fill_file(vol, vol.stat("a.bin"))
    assert fetched and vol.copies == 3 and counters.totals()["retries"] == 2
    gone = FlakyVolume(str(d), fail=5, error=FileNotFoundError("gone"))
    e = FileEntry("b.bin", 3, 1.0)
    with pytest.raises(FetchError, match="b.bin") as info:
        CacheFiller(cache, retries=3).fill_file(gone, e)
    assert gone.copies == 1  # a missing file is not retried
    assert SkipPolicy(on_missing="skip").skippable(info.value)
    assert not SkipPolicy().skippable(info.value) and SkipPolicy(on_error="skip").skippable(info.value)
    assert not SkipPolicy(on_error="skip").skippable(CacheFullError("full"))  # every next file fails too


def test_a_full_cache_disk_is_a_cache_full_error_at_once_not_retried(src):
    d, _, cache = src
    vol = FlakyVolume(str(d), fail=5, error=OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(CacheFullError, match="a.bin"):
        CacheFiller(cache, retries=3).fill_file(vol, vol.stat("a.bin"))
    assert vol.copies == 1


def test_progress_is_told_a_probe_of_the_bytes_written_then_none(src):
    d, data, cache = src
    told: list[object] = []
    seen: list[object] = []

    def progress(probe):
        told.append(probe)
        if probe is not None:
            seen.append(probe())

    vol = FlakyVolume(str(d))
    CacheFiller(cache, progress=progress).fill_file(vol, vol.stat("a.bin"))
    assert len(told) == 2 and callable(told[0]) and told[1] is None and len(seen) == 1


def test_a_byte_range_is_filled_once_and_holds_exactly_its_bytes(src):
    d, data, cache = src
    vol, counters = FlakyVolume(str(d)), SharedCounters()
    f = CacheFiller(cache, counters=counters)
    e = vol.stat("a.bin")
    checked: set[str] = set()
    path, fetched = f.fill_range(vol, e, 1000, 5000, checked=checked)
    assert fetched and open(path, "rb").read() == data[1000:5000] and checked == {"a.bin"}
    stats = vol.stats
    again, fetched = f.fill_range(vol, e, 1000, 5000, checked=checked)
    assert again == path and not fetched and vol.stats == stats  # a hit: no stat, no copy
    other, _ = f.fill_range(vol, e, 0, 10, checked=checked)
    assert open(other, "rb").read() == data[:10] and other != path
    assert range_key(vol, e, 0, 10) != range_key(vol, e, 0, 11)
    t = counters.totals()
    assert (t["misses"], t["hits"], t["bytes_fetched"]) == (2, 1, 4010)


def test_a_source_rewritten_after_its_listing_is_refused_and_no_range_of_it_stays(src):
    d, data, cache = src
    vol = FlakyVolume(str(d))
    e = vol.stat("a.bin")
    (d / "a.bin").write_bytes(b"x" * len(data))
    os.utime(d / "a.bin", (e.mtime + 5, e.mtime + 5))
    with pytest.raises(SourceChangedError, match="a.bin"):
        CacheFiller(cache).fill_range(vol, e, 0, 100)
    assert cache.lookup(range_key(vol, e, 0, 100), ".range", 100) is None


def test_lazy_source_checks_mark_unchanged_files_and_refuse_a_changed_one(src):
    d, data, _ = src
    vol = FlakyVolume(str(d))
    e = vol.stat("a.bin")
    checks = SourceChecks(vol, SharedBits(4))
    checks.ahead([(0, e), (1, FileEntry("a.bin", 1, 1.0))])  # index 1: listed as another version
    assert 0 in checks.checked and 1 not in checks.checked
    checks.check(0, e, copied=False)  # checked already: no stat
    with pytest.raises(SourceChangedError, match="a.bin"):
        checks.check(1, FileEntry("a.bin", 1, 1.0), copied=False)
    assert 1 not in checks.checked


def test_a_fill_copies_into_its_descriptor_only_through_a_volume_s_own_pair_of_copies(src):
    """``copy_into`` saves a fill an open per file, but never bypasses a ``copy_to`` a subclass overrides."""
    d, data, cache = src

    class Into(LocalVolume):
        into = 0

        def copy_into(self, rel, fd, *, expect=None):  # type: ignore[override]
            self.into += 1
            return super().copy_into(rel, fd, expect=expect)

    class Both(Into):
        def copy_to(self, rel, dest, *, expect=None):  # type: ignore[override]
            return super().copy_to(rel, dest, expect=expect)

    assert copies_into(LocalVolume(str(d))) and not copies_into(FlakyVolume(str(d)))
    assert not copies_into(Both(str(d)))  # its copy_to is below the copy_into in force: always called
    patched = LocalVolume(str(d))
    patched.copy_to = lambda rel, dest, *, expect=None: 0  # type: ignore[method-assign]
    assert not copies_into(patched)
    vol = Into(str(d))
    assert copies_into(vol)
    e = vol.stat("a.bin")
    path, fetched = CacheFiller(cache, retries=0).fill_file(vol, e, rel=e.path, space="s")
    assert fetched and vol.into == 1 and open(path, "rb").read() == data
    flaky = FlakyVolume(str(d))
    (d / "b.bin").write_bytes(data[:100])
    e = flaky.stat("b.bin")
    path, fetched = CacheFiller(cache, retries=0).fill_file(flaky, e, rel=e.path, space="s")
    assert fetched and flaky.copies == 1 and open(path, "rb").read() == data[:100]
