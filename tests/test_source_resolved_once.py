"""A source is resolved once (issue 51 item 7): the :class:`~ucmagic.tables.sources.Source` built at the entry
(``ucmagic.load``, ``describe_load``, ``load_table``, ``ParquetDataset``) carries its kind, paths, root, version,
snapshot, footers, schema and filter, and nothing below classifies, resolves or lists the source again (before:
a stream from ``ucmagic.load`` entered ``tables/sources.py`` ten times)."""
from __future__ import annotations

import sys
from collections import Counter

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ucmagic
from ucmagic.tables import ParquetDataset, load_table, sources

COUNTED = ("classify_source", "resolve_source", "resolve_path_source", "_local_dir_files", "delta_snapshot",
           "open_snapshot")


@pytest.fixture
def calls(monkeypatch):
    """Calls of each COUNTED function, wherever a module imported it by name (the modules that import them are
    imported first: one imported while the functions are wrapped would keep a wrapper)."""
    import importlib

    for name in ("api", "tables.api", "tables.parquet_dataset", "tables.footers", "tables.export",
                 "tables.volume_table", "tables.spark_source", "shards.pack_tables"):
        importlib.import_module(f"ucmagic.{name}")
    import ucmagic.tables.delta as delta_mod

    seen: Counter[str] = Counter()
    originals = {name: getattr(sources, name, None) or getattr(delta_mod, name) for name in COUNTED}

    def counted(name, fn):
        def wrapper(*a, **k):
            seen[name] += 1
            return fn(*a, **k)
        return wrapper

    for mod in [m for n, m in list(sys.modules.items()) if n.startswith("ucmagic") and m is not None]:
        for name, fn in originals.items():
            if getattr(mod, name, None) is fn:
                monkeypatch.setattr(mod, name, counted(name, fn))
    return seen


def _parquet(root):
    root.mkdir()
    for k in range(3):
        ids = np.arange(k * 100, (k + 1) * 100, dtype=np.int64)
        pq.write_table(pa.table({"id": ids, "x": ids * 0.5}), root / f"part-{k}.parquet", row_group_size=25)
    return str(root)


def _delta(root):
    deltalake = pytest.importorskip("deltalake")
    deltalake.write_deltalake(str(root), pa.table({"id": np.arange(300, dtype=np.int64)}))
    deltalake.write_deltalake(str(root), pa.table({"id": np.arange(300, 310, dtype=np.int64)}), mode="append")
    return str(root)


def _at_most_once(calls):
    assert calls["classify_source"] <= 1 and calls["resolve_source"] <= 1, calls
    assert calls["resolve_path_source"] <= 1 and calls["_local_dir_files"] <= 1, calls  # one listing
    assert calls["open_snapshot"] <= 1, calls  # one Delta log replay


@pytest.mark.parametrize("kind", ["parquet", "delta"])
def test_ucmagic_load_resolves_the_source_once(tmp_path, calls, kind):
    path = _parquet(tmp_path / "t") if kind == "parquet" else _delta(tmp_path / "t")
    calls.clear()
    df = ucmagic.load(path, where="id % 10 = 3")
    assert sorted(df["id"]) == [i for i in range(300 if kind == "parquet" else 310) if i % 10 == 3]
    _at_most_once(calls)
    assert calls["classify_source"] == 1 and calls["resolve_source"] == 1

    calls.clear()
    loader = ucmagic.load(path, stream=True, where="id >= 250", batch_size=16)
    got = sorted(int(v) for b in loader for v in b["id"])
    assert got == list(range(250, 300 if kind == "parquet" else 310))
    _at_most_once(calls)
    assert calls["classify_source"] == 1 and calls["resolve_source"] == 1

    calls.clear()
    plan = ucmagic.describe_load(path, stream=True, where="id < 7")
    assert plan.rows == 7
    _at_most_once(calls)


def test_load_table_and_parquet_dataset_resolve_once(tmp_path, calls):
    path = _parquet(tmp_path / "t")
    calls.clear()
    assert len(load_table(path, filter="id BETWEEN 10 AND 19")) == 10
    _at_most_once(calls)
    assert calls["resolve_source"] == 1

    calls.clear()
    ds = ParquetDataset(path, batch_size=50, filter="x > 100")
    assert sorted(int(v) for b in ds for v in b["id"]) == list(range(201, 300))
    assert int(ds.rows[0]["id"]) == 201
    _at_most_once(calls)
    assert calls["resolve_source"] == 1


def test_a_resolved_source_passes_through_with_its_filter(tmp_path, calls):
    src = sources.resolve_source(_parquet(tmp_path / "t"))
    src.filter = "id < 3"
    calls.clear()
    assert list(load_table(src)["id"]) == [0, 1, 2]
    assert sorted(int(v) for b in ParquetDataset(src) for v in b["id"]) == [0, 1, 2]
    assert sum(calls.values()) == 0, calls
    with pytest.raises(ValueError, match="version"):
        load_table(src, version=3)


def test_every_reader_of_a_resolved_source_keeps_its_filter(tmp_path):
    """A Source an entry point resolved with a filter is read with that filter by every reader it is handed to:
    ``load_table``, ``ParquetDataset``, ``files_from_table`` and ``export_parquet`` (before: the export wrote every
    row); a reader's own different ``filter=`` beside it is refused, never one of the two dropped."""
    from ucmagic.tables import export_parquet, files_from_table

    root = _parquet(tmp_path / "t")
    src = sources.resolve_source(root)
    src.filter = "id < 30"
    assert sorted(load_table(src)["id"]) == list(range(30))
    assert sum(len(b["id"]) for b in ParquetDataset(src, batch_size=7)) == 30
    res = export_parquet(src, str(tmp_path / "out"))
    assert res.rows == 30
    assert sorted(pq.read_table(str(tmp_path / "out"))["id"].to_pylist()) == list(range(30))
    files = tmp_path / "files"
    files.mkdir()
    for i in range(3):
        (files / f"f{i}.bin").write_bytes(b"x" * (i + 1))
    names = sources.resolve_source(pa.table({"path": ["f0.bin", "f1.bin", "f2.bin"], "k": [0, 1, 2]}))
    names.filter = "k >= 1"
    ds = files_from_table(names, root=str(files), cache_dir=str(tmp_path / "cache"))
    assert sorted(item["k"] for item in ds) == [1, 2]
    assert load_table(src, filter="id < 30")["id"].tolist() == list(range(30))  # the same filter again: fine
    with pytest.raises(ValueError, match="pass one filter"):
        load_table(src, filter="id > 5")
    with pytest.raises(ValueError, match="pass one filter"):
        export_parquet(src, str(tmp_path / "out2"), filter="id > 5")
