"""An epoch of one stream (ucmagic.files.epoch_stream) built from its parts alone: fake items (a plain list
of files, no listing), a lease over a fake record keeper, a real cache and a volume that counts and fails
on demand. No dataset object anywhere: the contract is the parts."""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest

from ucmagic.files.cache import FileCache
from ucmagic.files.cache_layout import cache_key, entry_file, space_of, version_stamp
from ucmagic.files.epoch_stream import EpochParts, EpochStream, Retired
from ucmagic.files.filler import CacheFiller, SkipPolicy
from ucmagic.files.lease import ConsumptionChannel, LeaseRecord, StreamLease
from ucmagic.files.volume import FileEntry, LocalVolume
from ucmagic.telemetry import SharedCounters


class CountingVolume(LocalVolume):
    """A local volume that counts copies and fails those of the files named in ``broken``."""

    def __init__(self, root: str, broken: frozenset[str] = frozenset()) -> None:
        super().__init__(root)
        self.broken, self.copies = broken, 0

    def copy_to(self, rel, dest, *, expect=None):  # type: ignore[override]
        self.copies += 1
        if rel in self.broken:
            raise PermissionError(13, "denied", rel)
        return super().copy_to(rel, dest, expect=expect)


class FakeItems:
    """A stream's items as a plain list of entries (what StreamItems gives, without a listing)."""

    chunk = 4
    listing = None

    def __init__(self, vol: LocalVolume, entries: list[FileEntry]) -> None:
        self.entries, self.space = entries, space_of(vol.uri)
        self.keys = [cache_key(vol.uri, e.path, e.size, e.mtime) for e in entries]

    def __len__(self) -> int:
        return len(self.entries)

    def index(self, pos):
        return pos

    def entry(self, pos):
        return self.entries[pos]

    def size(self, pos):
        return self.entries[pos].size

    def key_at(self, pos):
        return self.keys[pos], ""

    def rel_at(self, pos):
        return self.entries[pos].path

    def file_at(self, pos):
        e = self.entries[pos]
        return entry_file(self.keys[pos], "", e.size, e.path, self.space)

    def fill_info(self, pos):
        return self.entries[pos], self.keys[pos], "", self.file_at(pos), pos

    def run(self, lo, hi):
        hi = min(hi, (lo // self.chunk + 1) * self.chunk)
        idx = list(range(lo, hi))
        return (np.array(idx), idx, [self.file_at(p) for p in idx], [self.size(p) for p in idx],
                [version_stamp(self.keys[p]) for p in idx])

    def names(self, lo, hi):
        return [self.file_at(p) for p in range(lo, hi)]


@pytest.fixture
def parts(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for i in range(10):
        (src / f"f{i}.bin").write_bytes(bytes([i]) * (100 + i))
    cache = FileCache(str(tmp_path / "cache"))

    def make(broken=frozenset(), skip=SkipPolicy(), consumption=None):
        vol = CountingVolume(str(src), broken)
        items = FakeItems(vol, [vol.stat(f"f{i}.bin") for i in range(10)])
        counters = SharedCounters()
        filler = CacheFiller(cache, retries=0, counters=counters, skip=skip)
        lease = StreamLease(LeaseRecord(cache, "me", "t"), items, quantum=2, window=4, chunk=8,
                            **({} if consumption is None else {"consumption": consumption}))
        seen = cache.seen_entries(len(items))
        return EpochParts(items, lease, filler, vol, items.space, seen), vol, counters  # type: ignore[arg-type]

    yield make
    cache.clear()


def _epoch(p, **kw):
    stream = EpochStream(p, main=True, depth=4, timeout=30.0)
    try:
        out = list(stream.run())
    finally:
        stream.end(abandoned=False)
    return out, stream


def test_every_item_is_handed_out_once_in_order_then_an_epoch_is_warm(parts):
    p, vol, counters = parts()
    paths, stream = _epoch(p)
    assert [open(x, "rb").read()[:1] for x in paths] == [bytes([i]) for i in range(10)]
    assert stream.handed == 10 and vol.copies == 10
    t = counters.totals()
    assert (t["misses"], t["delivered"]) == (10, 10)
    p2, vol2, counters2 = parts()
    again, _ = _epoch(p2)
    assert again == paths and vol2.copies == 0  # all from the warm lane's lookups
    assert counters2.totals()["hits"] == 10


def test_a_file_to_skip_is_left_out_counted_and_named_in_one_warning(parts):
    p, _, counters = parts(broken=frozenset({"f3.bin"}), skip=SkipPolicy(on_error="skip"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paths, stream = _epoch(p)
    assert len(paths) == 9 and not any(x.endswith("f3.bin") for x in paths) and stream.handed == 10
    assert counters.totals()["errors"] == 1
    assert any("skipped 1 file" in str(w.message) and "f3.bin" in str(w.message) for w in caught)


def test_an_error_not_to_skip_ends_the_epoch_naming_the_file(parts):
    p, _, _ = parts(broken=frozenset({"f3.bin"}))
    with pytest.raises(Exception, match="f3.bin"):
        _epoch(p)


def test_a_loop_that_left_retires_the_stream_and_its_protection_goes(parts):
    chan = ConsumptionChannel()
    chan.reset(1)
    p, _, _ = parts(consumption=chan.reader(0))
    stream = EpochStream(p, main=False, depth=4, timeout=30.0)
    it = stream.run()
    next(it)
    chan.retire()
    assert stream.lease.retired()
    with pytest.raises(Retired):
        stream.alive()
    stream.end(abandoned=True)
    assert not os.path.exists(stream.lease.record.path)
