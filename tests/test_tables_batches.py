"""Batches that span row groups are cut on the calling thread (issue 51 item 6: torch.cat's intra-op threads
waited for cores pyarrow's decoding held), exactly: every dtype, dtype= casts (bfloat16 has no numpy type),
masks, in the main process and in workers."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from ucmagic.tables import ParquetDataset
from ucmagic.tables.batching import _cat


def test_cat_equals_torch_cat_for_every_dtype():
    for dt in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
               torch.int8, torch.uint8, torch.bool):
        a, b = torch.arange(7).to(dt), torch.arange(3, 8).to(dt)
        got = _cat([a[2:], b[:4]])
        assert got.dtype == dt and torch.equal(got, torch.cat([a[2:], b[:4]]))
    two = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    assert torch.equal(_cat([two[:2], two[3:]]), torch.cat([two[:2], two[3:]]))


@pytest.mark.parametrize("workers", [0, 2])
def test_batches_across_row_groups_hold_every_row_exactly(tmp_path, workers):
    n = 1000
    ids = np.arange(n, dtype=np.int64)
    t = pa.table({"id": ids, "x": pa.array(ids * 0.25), "m": pa.array([None if i % 7 == 0 else i for i in ids],
                                                                         pa.int32()),
                  "f": pa.array(ids.astype(np.float32))})
    pq.write_table(t, tmp_path / "t.parquet", row_group_size=97)
    ds = ParquetDataset(str(tmp_path / "t.parquet"), batch_size=64, dtype={"f": torch.bfloat16})
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=workers)
    got = list(loader)
    if workers == 0:
        assert [len(b["id"]) for b in got] == [64] * (n // 64) + [n % 64]
    else:  # each worker's stream of full batches and a short last one, streams interleaved
        assert sum(len(b["id"]) for b in got) == n and sum(len(b["id"]) < 64 for b in got) <= workers
    cat = {k: torch.cat([b[k] for b in got]) for k in got[0]}
    order = torch.argsort(cat["id"])
    cat = {k: v[order] for k, v in cat.items()}
    assert torch.equal(cat["id"], torch.from_numpy(ids))
    assert torch.equal(cat["x"], torch.from_numpy(ids * 0.25))
    assert cat["f"].dtype == torch.bfloat16 and torch.equal(cat["f"], torch.from_numpy(ids.astype(np.float32))
                                                            .to(torch.bfloat16))
    mask = [k for k in cat if k.startswith("m") and k != "m"]
    assert len(mask) == 1 and cat[mask[0]].tolist() == [i % 7 != 0 for i in range(n)]
    assert [int(v) for v, ok in zip(cat["m"], cat[mask[0]]) if ok] == [i for i in range(n) if i % 7]


@pytest.mark.parametrize("compression", ["snappy", "none"])
@pytest.mark.parametrize("cache", [False, True])
def test_batches_are_writable_and_own_their_memory(tmp_path, compression, cache):
    """Batches are handed out without a copy of the decoded values where Arrow says that memory is the decode's
    own (mutable); writing into a batch never changes the files, the cache or a later epoch (a memory-mapped,
    uncompressed, plain-encoded file included), and torch gets writable arrays (no warning)."""
    import warnings

    n = 5000
    ids = np.arange(n, dtype=np.int64)
    pq.write_table(pa.table({"id": ids, "x": ids * 0.5, "i": ids.astype(np.int32)}), tmp_path / "t.parquet",
                   row_group_size=700, compression=compression, use_dictionary=False)
    ds = ParquetDataset(str(tmp_path / "t.parquet"), batch_size=512, cache=cache,
                        cache_dir=str(tmp_path / "cache") if cache else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "The given NumPy array is not writable"
        for b in ds:
            for v in b.values():
                v.mul_(0)
    got = {k: torch.cat([b[k] for b in ds]) for k in ("id", "x", "i")}
    assert torch.equal(got["id"], torch.from_numpy(ids))
    assert torch.equal(got["x"], torch.from_numpy(ids * 0.5))
    assert torch.equal(got["i"], torch.from_numpy(ids.astype(np.int32)))
    assert int(ds.rows[n - 1]["id"]) == n - 1
