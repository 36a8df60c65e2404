"""Per-item fetch records, LoaderStats save/load/merge, straggler hints and the explorer widget."""
from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic import telemetry
from ucmagic.errors import MissingExtraError, import_extra
from ucmagic.loader_stats import LoaderStats
from ucmagic.telemetry import ItemLog


# ------------------------------------------------------------------ synthetic stats

def synth(fetch, *, compute=None, epoch=None, worker=None, rank=None, items=None, files=None) -> LoaderStats:
    """LoaderStats from per-batch lists; ``items[b]`` is a list of ``(index, fetch_s, hit)``."""
    n = len(fetch)
    items = items if items is not None else [[] for _ in range(n)]
    d = {"version": 1, "rank": 0, "fetch_s": list(map(float, fetch)),
         "compute_s": list(map(float, compute if compute is not None else [0.01] * n)),
         "count": [len(it) for it in items], "epoch": list(epoch or [0] * n), "worker": list(worker or [0] * n),
         "batch_rank": list(rank or [0] * n), "misses": [sum(1 for _, _, h in it if not h) for it in items],
         "nbytes": [100 * len(it) for it in items],
         "item_index": [i for it in items for i, _, _ in it],
         "item_fetch_s": [(-f if h else f) for it in items for _, f, h in it],
         "files": {str(k): [v, 100] for k, v in (files or {}).items()}, "counters": None, "truncated": False}
    return LoaderStats.from_dict(d)


def warm_items(n, per=4, fetch=1e-4):
    return [[(b * per + k, fetch, True) for k in range(per)] for b in range(n)]


# ------------------------------------------------------------------ hints, one test each

def test_hint_cold_epoch_says_warm_the_cache():
    n = 40
    fetch = [0.2] * 20 + [0.002] * 20
    items = [[(b, 0.2, False)] for b in range(20)] + [[(b, 0.001, True)] for b in range(20)]
    hints = synth(fetch, epoch=[0] * 20 + [1] * 20, items=items, compute=[0.5] * n).hints()
    cold = [h for h in hints if "cold epoch 0" in h]
    assert cold and cold[0].startswith("99% of the wait") and "ds.warm()" in cold[0]


def test_hint_cold_single_epoch_points_at_the_misses():
    fetch = [0.3] * 5 + [0.001] * 15
    items = [[(b, 0.3, False)] for b in range(5)] + [[(b, 0.001, True)] for b in range(5, 20)]
    hints = synth(fetch, items=items, compute=[0.5] * 20).hints()
    assert any("batches with cache misses" in h and "ds.warm()" in h for h in hints)


def test_hint_names_the_few_files_behind_p99():
    n = 200
    fetch = [0.002] * n
    fetch[50] = fetch[120] = 0.9
    items = warm_items(n)
    items[50][0] = (10_000, 0.85, False)
    items[120][1] = (10_001, 0.8, False)
    stats = synth(fetch, items=items, files={10_000: "/Volumes/m/d/v/slow_a.jpg", 10_001: "/Volumes/m/d/v/slow_b.jpg"},
                  compute=[0.05] * n)
    hint = [h for h in stats.hints() if "of the p99 wait" in h]
    assert hint and "/Volumes/m/d/v/slow_a.jpg" in hint[0] and "/Volumes/m/d/v/slow_b.jpg" in hint[0]


def test_hint_warm_cache_but_waiting_says_raise_num_workers():
    n = 50
    hints = synth([0.06] * n, compute=[0.04] * n, worker=[b % 2 for b in range(n)], items=warm_items(n)).hints()
    assert any(h.startswith("the loop waits for data 60% of the time") and "raise num_workers (now 2)" in h
               for h in hints)


def test_hint_one_slow_worker():
    n = 60
    fetch = [0.05 if b % 3 == 2 else 0.01 for b in range(n)]
    hints = synth(fetch, compute=[1.0] * n, worker=[b % 3 for b in range(n)], items=warm_items(n)).hints()
    assert any(h.startswith("worker 2's batches wait 5.0x longer") for h in hints)


def test_hint_one_slow_rank():
    n = 30
    parts = [synth([0.01] * n, compute=[1.0] * n), synth([0.01] * n, compute=[1.0] * n),
             synth([0.04] * n, compute=[1.0] * n)]
    merged = LoaderStats.merge(parts)
    assert any(h.startswith("rank 2 waits 4.0x the median rank") for h in merged.hints())


def test_hint_data_loading_is_not_the_bottleneck():
    n = 30
    hints = synth([0.001] * n, compute=[0.5] * n, items=warm_items(n)).hints()
    assert hints == ["the loop waits for data only 0% of the time: data loading is not the bottleneck"]


def test_no_batches_no_hints():
    assert LoaderStats().hints() == []


# ------------------------------------------------------------------ records structure

def test_item_log_keeps_8_bytes_per_item_and_stops_at_its_cap():
    log = ItemLog(cap=10)
    idx = np.arange(4, dtype=np.int32).tobytes()
    f = np.full(4, 0.1, dtype=np.float32).tobytes()
    for _ in range(3):
        log.add(0, 1, idx, f, 400)
    assert len(log) == 3 and len(log.index) == 8 and log.truncated  # the third batch kept its totals only
    assert log.count[2] == 4 and log.items(2)[0].size == 0 and log.items(1)[0].tolist() == [0, 1, 2, 3]
    assert log.memory_bytes() == 8 * 8 + 3 * (8 + 4 + 4 + 2 + 2 + 4 + 8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2**31 - 1), st.floats(0, 100, width=32), st.booleans()),
                         max_size=6), max_size=12))
def test_item_log_returns_each_batch_items_as_recorded(batches):
    log = ItemLog()
    for b in batches:
        idx = np.array([i for i, _, _ in b], dtype=np.int32).tobytes()
        f = np.array([(-x if h else x) for _, x, h in b], dtype=np.float32).tobytes()
        log.add(0, -1, idx, f, 0)
    for k, b in enumerate(batches):
        idx, fetch, hit = log.items(k)
        assert idx.tolist() == [i for i, _, _ in b]
        assert np.allclose(fetch, [x for _, x, _ in b]) and hit.tolist() == [h for _, _, h in b]
        assert log.misses[k] == sum(1 for _, _, h in b if not h)


def test_records_nobody_collects_stay_bounded():
    telemetry.drop_pending()
    for i in range(telemetry.PENDING_CAP + 5):
        telemetry.record_item(i, True, 0.0, 1)
    assert len(telemetry.take_items(10**9)[0]) // 4 < telemetry.PENDING_CAP
    assert telemetry.take_items(5) == (b"", b"", 0)


def test_collate_takes_only_the_batch_items():
    telemetry.drop_pending()
    for i in range(5):  # 2 left over from a drop_last batch, then a batch of 3
        telemetry.record_item(i, i % 2 == 0, 0.5, 10)
    out = telemetry.ItemCollate(lambda xs: sum(xs))([1, 2, 3])
    assert out.batch == 6 and out.worker == -1 and out.nbytes == 30
    assert np.frombuffer(out.index, dtype=np.int32).tolist() == [2, 3, 4]


# ------------------------------------------------------------------ real loaders

SLOW = 40  # the injected straggler: listing index of the slow file


def _slow_loader(tmp_path, **kw):
    from ucmagic import DataLoader, UCVolumeDataset
    from ucmagic.testing import make_files

    rels = make_files(str(tmp_path / "v"), 48, 500)
    ds = UCVolumeDataset(f"slow://{tmp_path / 'v'}", prefetch=2, storage_options={  # little read-ahead: it waits
        "open_ms": 1, "mbps": 0, "list_ms": 0, "slow_files": {rels[SLOW]: 800}})
    return DataLoader(ds, batch_size=4, log_to_mlflow=False, **kw), rels


def test_spawned_workers_send_every_item_record_and_the_explorer_names_the_slow_file(tmp_path):
    pytest.importorskip("ipywidgets")
    loader, rels = _slow_loader(tmp_path, multiprocessing_context="spawn")  # default num_workers
    for _ in range(2):
        for _ in loader:
            pass
    stats = loader.stats
    b = stats.batches()
    assert len(b["step"]) == 24 and b["items"].tolist() == [4] * 24
    assert sorted(set(b["worker"].tolist())) == list(range(loader.num_workers))
    assert b["misses"][b["epoch"] == 0].sum() == 48 and b["misses"][b["epoch"] == 1].sum() == 0
    for e in (0, 1):  # every file exactly once per epoch
        seen = sorted(r["index"] for i in np.flatnonzero(b["epoch"] == e) for r in stats.batch_files(int(i)))
        assert seen == list(range(48))
    [slow_batch] = [i for i in np.flatnonzero(b["epoch"] == 0) if SLOW in [r["index"] for r in stats.batch_files(i)]]
    top = stats.batch_files(slow_batch)[0]
    assert top["file"].endswith(rels[SLOW]) and not top["hit"] and top["fetch_s"] >= 0.8 and top["bytes"] == 500
    ex = stats.explore()  # how long the loop waited for that batch depends on the machine's load: not asserted
    ex.batch.value = int(slow_batch)
    assert rels[SLOW] in ex.files.value.split("</tr>")[1]  # first (slowest) row of the batch's files


def test_records_with_workers_in_the_main_process_and_drop_last(tmp_path):
    from ucmagic import DataLoader, UCVolumeDataset
    from ucmagic.testing import make_files

    make_files(str(tmp_path / "v"), 10, 100)
    loader = DataLoader(UCVolumeDataset(str(tmp_path / "v")), batch_size=4, num_workers=0, drop_last=True,
                        log_to_mlflow=False)
    for _ in range(2):
        for _ in loader:
            pass
    b = loader.stats.batches()
    assert b["items"].tolist() == [4, 4, 4, 4] and b["worker"].tolist() == [-1] * 4
    assert [r["index"] for r in loader.stats.batch_files(2)] != []
    assert sorted(r["index"] for r in loader.stats.batch_files(2)) == [0, 1, 2, 3]  # not the 2 dropped ones


def test_each_batch_records_exactly_its_own_files_in_cold_and_warm_epochs(tmp_path):
    from ucmagic import DataLoader, UCVolumeDataset
    from ucmagic.testing import make_files

    make_files(str(tmp_path / "v"), 37, 100)
    ds = UCVolumeDataset(str(tmp_path / "v"), cache_dir=str(tmp_path / "c"), shuffle=True)
    loader = DataLoader(ds, batch_size=5, num_workers=0, log_to_mlflow=False)
    delivered = [[list(b) for b in loader] for _ in range(3)]  # a cold epoch, then warm runs
    index_of = {p: i for i, (p, _) in enumerate(ds._cached_paths())}
    stats = loader.stats
    b = stats.batches()
    assert len(b["step"]) == 3 * 8
    for k, batch in enumerate(x for epoch in delivered for x in epoch):
        files = stats.batch_files(k)
        assert sorted(r["index"] for r in files) == sorted(index_of[p] for p in batch)
        assert all(r["hit"] for r in files) == (k >= 8)  # the warm epochs are all hits
    assert b["misses"].sum() == 37


def test_parquet_dataset_records_row_groups(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    from ucmagic import DataLoader, ParquetDataset

    pq.write_table(pa.table({"x": np.arange(1000, dtype=np.float32)}), tmp_path / "t.parquet", row_group_size=250)
    loader = DataLoader(ParquetDataset(str(tmp_path), batch_size=250), num_workers=0, log_to_mlflow=False)
    for _ in loader:
        pass
    b = loader.stats.batches()
    assert b["items"].tolist() == [1, 1, 1, 1] and b["bytes"].tolist() == [1000] * 4
    names = [loader.stats.batch_files(i)[0]["file"] for i in range(4)]
    assert [n.rsplit("#", 1)[1] for n in names] == ["rg0", "rg1", "rg2", "rg3"]


# ------------------------------------------------------------------ save / load / merge

def test_save_load_roundtrip_keeps_batches_items_and_file_names(tmp_path):
    items = [[(0, 0.3, False), (1, 0.1, True)], [(2, 0.2, False)]]
    st0 = synth([0.5, 0.25], epoch=[0, 1], worker=[1, 0], items=items, files={0: "a.jpg", 1: "b.jpg", 2: "c.jpg"})
    path = st0.save(tmp_path / "stats.json")
    assert json.loads(open(path).read())["version"] == 1 and not (tmp_path / "stats.json.tmp").exists()
    st1 = LoaderStats.load(path)
    for k, v in st0.batches().items():
        assert np.array_equal(v, st1.batches()[k]), k
    assert st1.batch_files(0) == st0.batch_files(0)
    assert st1.batch_files(0)[0] == {"file": "a.jpg", "index": 0, "bytes": 100, "fetch_s": pytest.approx(0.3),
                                     "hit": False}


def test_merge_keeps_each_rank_and_renumbers_files_by_name(tmp_path):
    a = synth([0.1, 0.2], items=[[(0, 0.1, False)], [(1, 0.2, True)]], files={0: "x.jpg", 1: "y.jpg"})
    b = synth([0.3], items=[[(0, 0.3, False)]], files={0: "z.jpg"})
    a.save(tmp_path / "r0.json")
    b.save(tmp_path / "r1.json")
    m = LoaderStats.merge([tmp_path / "r0.json", tmp_path / "r1.json"])
    bt = m.batches()
    assert bt["rank"].tolist() == [0, 0, 1] and bt["step"].tolist() == [0, 1, 0] and m.count == 3
    assert m.batch_files(2)[0]["file"] == "z.jpg" and m.batch_files(0)[0]["file"] == "x.jpg"
    assert m.slowest_batches(1, rank=0) == [1]


def test_load_rejects_unknown_versions(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="version 99"):
        LoaderStats.load(tmp_path / "s.json")


# ------------------------------------------------------------------ the explorer

def _explorer_stats():
    n = 60
    fetch = [0.002] * n
    fetch[5], fetch[45] = 0.8, 0.5
    items = warm_items(n)
    items[5][0] = (1000, 0.79, False)
    items[45][0] = (1001, 0.49, False)
    return synth(fetch, epoch=[0] * 30 + [1] * 30, worker=[b % 2 for b in range(n)], items=items,
                 files={1000: "/v/cold.jpg", 1001: "/v/late.jpg"}, compute=[0.05] * n)


def test_explorer_range_changes_plot_and_slowest_table():
    pytest.importorskip("ipywidgets")
    ex = _explorer_stats().explore()
    png, table = ex.plot.value, ex.table.value
    assert "/v/cold.jpg" in table and "/v/cold.jpg" in ex.files.value  # slowest batch selected
    ex.range.value = (30, 59)
    assert ex.plot.value != png and "/v/cold.jpg" not in ex.table.value and "/v/late.jpg" in ex.table.value
    assert ex.summary.value.startswith("30 batches in view")


def test_explorer_epoch_and_worker_selectors_filter():
    pytest.importorskip("ipywidgets")
    ex = _explorer_stats().explore()
    ex.epoch.value = 1
    assert ex.slowest_in_view(1) == [45]
    ex.worker.value = 0
    assert ex.slowest_in_view(1) != [45] and all(i % 2 == 0 and i >= 30 for i in ex.slowest_in_view())
    assert ex.rank.layout.display == "none"  # one rank: no rank selector


def test_selecting_any_batch_shows_its_files():
    pytest.importorskip("ipywidgets")
    ex = _explorer_stats().explore()
    ex.batch.value = 7
    assert "<b>batch 7</b>" in ex.files.value and ex.files.value.count("<tr>") == 5  # header + 4 files
    ex.slowest.value = 45
    assert "/v/late.jpg" in ex.files.value


def test_explorer_works_on_saved_and_merged_stats(tmp_path):
    pytest.importorskip("ipywidgets")
    path = _explorer_stats().save(tmp_path / "s.json")
    ex = LoaderStats.merge([path, path]).explore()
    assert ex.rank.layout.display is None and len(ex.rank.options) == 3
    ex.rank.value = 1
    assert all(ex.b["rank"][i] == 1 for i in ex.slowest_in_view())


# ------------------------------------------------------------------ optional extras

def test_missing_extra_says_which_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtraError, match=r'pip install "ucmagic\[notebook\]"'):
        synth([0.1]).plot()
    with pytest.raises(ModuleNotFoundError):  # still a ModuleNotFoundError for code that catches that
        import_extra("matplotlib.figure")


@pytest.mark.parametrize("module, extra", [("mlflow", "mlflow"), ("s3fs", "s3"), ("deltalake", "delta"),
                                           ("pyspark", "spark"), ("mfusepy", "fuse"), ("ipywidgets", "notebook")])
def test_every_extra_has_its_install_line(monkeypatch, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingExtraError, match=rf'pip install "ucmagic\[{extra}\]"'):
        import_extra(module)


def test_delta_without_deltalake_names_the_extra(monkeypatch, tmp_path):
    from ucmagic import tables

    monkeypatch.setitem(sys.modules, "deltalake", None)
    (tmp_path / "_delta_log").mkdir()
    with pytest.raises(MissingExtraError,
                       match=r'reading a Delta table needs deltalake.*pip install "ucmagic\[delta\]"'):
        tables.delta_files(tables.resolve_source(str(tmp_path)))
