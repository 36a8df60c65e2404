"""One contract, every dataset family: fill, protect, evict, resume state (issue 43 item 2).

Each family fills through the one filler (:class:`ucmagic.files.filler.CacheFiller`) and protects through
the one lease (:class:`ucmagic.files.lease.LeaseRecord`), so each passes the same suite. A family joins by
subclassing :class:`FamilyContract` (as fsspec's ``tests/abstract`` suites are subclassed per backend) and
implementing :meth:`FamilyContract.make`, which returns a :class:`Family` over a small source it writes
under ``tmp_path``. The files family (UCVolumeDataset) and the shard-chunks family (TarShards' ranged
chunk cache) run here; the Parquet family can join the same way.
"""
from __future__ import annotations

import io
import os
import tarfile
from typing import Any, Callable, Hashable, Iterable, Sequence


from ucmagic.files.cache import FileCache
from ucmagic.files.cache_layout import cache_key
from ucmagic.files.filler import CacheFiller
from ucmagic.files.lease import LeaseRecord
from ucmagic.files.locks import process_tag
from ucmagic.telemetry import SharedCounters


class Family:
    """What the contract needs of a family: its cache, the units it fills (a file, a chunk, a row
    group), their source bytes, a fill through the family's filler, a planned dataset to resume, and how
    to tell its items apart."""

    def __init__(self, cache: FileCache, units: int, source: Callable[[int], bytes],
                 fill: Callable[[CacheFiller, int], tuple[str, bool]], dataset: Callable[[], Any],
                 item_key: Callable[[Any], Hashable]) -> None:
        self.cache, self.units, self.source = cache, units, source
        self._fill, self.dataset, self.item_key = fill, dataset, item_key
        self.counters = SharedCounters()
        self.filler = CacheFiller(cache, retries=0, counters=self.counters)

    def fill(self, unit: int) -> tuple[str, bool]:
        return self._fill(self.filler, unit)

    def lease(self, slot: str = "contract") -> LeaseRecord:
        return LeaseRecord(self.cache, process_tag(), slot)

    def names(self, paths: Iterable[str]) -> list[str]:
        """The cache's own names of the entries at ``paths`` (what a lease names)."""
        out = [self.cache.entry_name(p) for p in paths]
        assert None not in out
        return [n for n in out if n is not None]


class FamilyContract:
    """The contract every family passes (subclass it; implement :meth:`make`)."""

    def make(self, tmp_path: Any) -> Family:
        raise NotImplementedError

    def test_a_unit_is_filled_once_with_exactly_its_source_bytes(self, tmp_path):
        fam = self.make(tmp_path)
        for u in range(fam.units):
            path, fetched = fam.fill(u)
            assert fetched and open(path, "rb").read() == fam.source(u)
        for u in range(fam.units):
            path, fetched = fam.fill(u)
            assert not fetched and open(path, "rb").read() == fam.source(u)
        t = fam.counters.totals()
        assert (t["misses"], t["hits"]) == (fam.units, fam.units)
        assert t["bytes_fetched"] == sum(len(fam.source(u)) for u in range(fam.units))

    def test_what_the_lease_names_survives_eviction_and_goes_once_released(self, tmp_path):
        fam = self.make(tmp_path)
        paths = [fam.fill(u)[0] for u in range(fam.units)]
        held, free = paths[:1], paths[1:]
        lease = fam.lease()
        lease.write(fam.names(held))
        fam.cache.evict(keep_below=0)
        assert all(os.path.exists(p) for p in held) and not any(os.path.exists(p) for p in free)
        lease.drop()
        fam.cache.evict(keep_below=0)
        assert not any(os.path.exists(p) for p in held)

    def test_an_evicted_unit_fills_again_with_the_same_bytes(self, tmp_path):
        fam = self.make(tmp_path)
        first = [fam.fill(u)[0] for u in range(fam.units)]
        fam.cache.evict(keep_below=0)
        for u, p in enumerate(first):
            path, fetched = fam.fill(u)
            assert fetched and path == p and open(path, "rb").read() == fam.source(u)  # a stable path

    def test_a_state_saved_mid_epoch_resumes_with_exactly_the_rest(self, tmp_path):
        fam = self.make(tmp_path)
        ds = fam.dataset()
        whole = [fam.item_key(x) for x in ds]
        ds = fam.dataset()
        it = iter(ds)
        head = [fam.item_key(next(it)) for _ in range(len(whole) // 3)]
        state = ds.state_dict()
        it.close()  # type: ignore[attr-defined]
        again = fam.dataset()
        again.load_state_dict(state)
        rest = [fam.item_key(x) for x in again]
        assert head + rest == whole


# ---------------------------------------------------------------- the files family

class TestFilesFamily(FamilyContract):
    def make(self, tmp_path):
        from ucmagic.files.dataset import UCVolumeDataset

        src = tmp_path / "files"
        src.mkdir()
        data = {f"d{i % 2}/f{i}.bin": bytes([i]) * (50 + 37 * i) for i in range(6)}
        for rel, b in data.items():
            os.makedirs(src / os.path.dirname(rel), exist_ok=True)
            (src / rel).write_bytes(b)
        cache_dir = str(tmp_path / "cache")

        def dataset():
            return UCVolumeDataset(str(src), cache_dir=cache_dir)

        ds = dataset()
        entries = [ds.listing.entry(i) for i in range(len(ds.listing))]

        def fill(filler, u):
            e = entries[u]
            return filler.fill_file(ds.volume, e, cache_key(ds.volume.uri, e.path, e.size, e.mtime), "",
                                    rel=e.path, space=ds.space)

        return Family(FileCache(cache_dir), len(entries), lambda u: data[entries[u].path], fill, dataset,
                      lambda p: os.path.relpath(p, os.path.join(cache_dir, "files")))


# ---------------------------------------------------------------- the shard-chunks family

CHUNK = 4096


def _write_tar(path: str, samples: Sequence[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, payload in samples:
            for ext, data in (("bin", payload), ("cls", key[-1:].encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


class TestShardChunksFamily(FamilyContract):
    def make(self, tmp_path):
        from ucmagic.shards import TarShards
        from ucmagic.shards.chunks import ChunkedFile, fill_chunk

        src = tmp_path / "shards"
        src.mkdir()
        for s in range(2):
            _write_tar(str(src / f"shard-{s}.tar"), [(f"{s}{i:03d}", bytes([i]) * (700 + 300 * i)) for i in range(8)])
        cache_dir = str(tmp_path / "cache")

        def dataset():
            return TarShards(str(src), cache_dir=cache_dir, chunk_size=CHUNK).stream()

        shards = TarShards(str(src), cache_dir=cache_dir, chunk_size=CHUNK)
        files: list[ChunkedFile] = shards.files
        units = [(f, c) for f in files for c in range(f.chunks)]

        def source(u):
            f, c = units[u]
            start, end = f.span(c)
            with open(os.path.join(str(src), f.entry.path), "rb") as fh:
                fh.seek(start)
                return fh.read(end - start)

        def fill(filler, u):
            f, c = units[u]
            return fill_chunk(filler.cache, f, c, filler=filler)

        return Family(FileCache(cache_dir), len(units), source, fill, dataset, lambda x: x["__key__"])
