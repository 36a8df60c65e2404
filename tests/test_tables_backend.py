"""Tables read through the volume registry (issue 43 item 3): a backend registered with ``register_volume``
serves ParquetDataset (footers, cached copies, uncached reads), load_table, exports written by ucmagic and
their reads back, and ucmagic's own reads of a Delta table (deletion vectors, data files).

The toy backend (tests/toy_backend.py) is neither a LocalVolume nor an FsspecVolume: a read that bypasses the
registry cannot open ``toy://`` at all, and it counts the calls it serves.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from toy_backend import toy_backend_fixture  # noqa: F401 - the toy_backend fixture
from ucmagic.files import volume as volume_mod
from ucmagic.tables import ParquetDataset, export_parquet, load_table


def _write_dir(root, files=3, rows=50):
    for i in range(files):
        part = root / f"label={i % 2}"
        part.mkdir(exist_ok=True)
        ids = np.arange(i * rows, (i + 1) * rows, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids * 0.5}), part / f"f{i}.parquet", row_group_size=20)
    return files * rows


def _ids(ds):
    return sorted(int(v) for b in ds for v in b["id"])


def test_parquet_dataset_and_load_table_read_a_registered_backend(toy_backend, tmp_path):
    n = _write_dir(toy_backend.root)
    url = toy_backend.url()
    ds = ParquetDataset(url, batch_size=16, cache_dir=str(tmp_path / "cache"))
    assert ds.columns == ["id", "x", "label"]
    assert _ids(ds) == list(range(n))
    assert toy_backend.served("copy_to") == 3  # the cache's fill went through the backend
    assert toy_backend.served("range_reader") >= 3  # footers: ranged reads
    uncached = ParquetDataset(url, batch_size=16, cache=False, columns=["id", "label"])
    assert _ids(uncached) == list(range(n))
    got = load_table(url)
    assert sorted(got["id"].tolist()) == list(range(n))
    assert sorted(set(got["label"].tolist())) == [0, 1]


def test_an_export_to_a_registered_backend_reads_back_through_it(toy_backend, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    n = _write_dir(src)
    dest = toy_backend.url("out")
    os.makedirs(toy_backend.root / "out")
    export_parquet(str(src), dest, target_file_size="1MB")
    assert toy_backend.served("upload", "write_bytes") >= 2  # data files and the manifest
    assert sorted(load_table(dest)["id"].tolist()) == list(range(n))
    assert _ids(ParquetDataset(dest, batch_size=32, cache_dir=str(tmp_path / "cache"))) == list(range(n))


class _CountingLocal(volume_mod.LocalVolume):
    """A local directory served without ``local_file`` (every read is a range read), counting them."""

    reads: list[str] = []

    @classmethod
    def from_path(cls, path, storage_options=None):
        return cls(volume_mod.existing_local(path)[0])

    def local_file(self, rel):
        return None

    def range_reader(self, rel):
        _CountingLocal.reads.append(rel)
        return super().range_reader(rel)


def test_delta_deletion_vectors_and_data_files_are_read_through_the_registered_volume(tmp_path):
    deltalake = pytest.importorskip("deltalake")
    import delta_fixtures as fx

    table = str(tmp_path / "t")
    deltalake.write_deltalake(table, pa.table({"id": np.arange(40, dtype=np.int64)}))
    add = fx.live_adds(table)[0]["path"]
    fx.delete_rows(table, {add: [1, 5, 7]}, storage="u")
    expect = [i for i in range(40) if i not in (1, 5, 7)]
    _CountingLocal.reads = []
    def under_table(p):
        return p.startswith(table)

    volume_mod.register_volume(under_table, _CountingLocal)
    try:
        ds = ParquetDataset(table, batch_size=8, cache=False)
        assert _ids(ds) == expect
        assert sorted(load_table(table)["id"].tolist()) == expect
    finally:
        volume_mod.unregister_volume(under_table)
    assert any(r.endswith(".parquet") for r in _CountingLocal.reads)  # data files (footers, row groups)
    assert any("deletion_vector_" in r for r in _CountingLocal.reads)  # the deletion vector
