"""The explorer widget (ucmagic.notebook.explorer) and the per-item records it shows, from real loaders."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from test_loader_stats import synth, warm_items

from ucmagic.errors import MissingExtraError, import_extra
from ucmagic.loading.loader_stats import LoaderStats


def plain(html: str) -> str:
    """A widget's HTML without the line-break hints (<wbr>) it puts after slashes in file names."""
    return html.replace("<wbr>", "")


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
    assert rels[SLOW] in plain(ex.files.value).split("</tr>")[1]  # first (slowest) row of the batch's files


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
    index_of = {p: i for i, (p, _) in enumerate(ds.files.cached())}
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
    png, table = ex.plot.value, plain(ex.table.value)
    assert "/v/cold.jpg" in table and "/v/cold.jpg" in plain(ex.files.value)  # slowest batch selected
    ex.range.value = (30, 59)
    table = plain(ex.table.value)
    assert ex.plot.value != png and "/v/cold.jpg" not in table and "/v/late.jpg" in table
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
    assert "<b>batch 7</b>" in plain(ex.files.value) and plain(ex.files.value).count("<tr>") == 5  # header + 4 files
    ex.slowest.value = 45
    assert "/v/late.jpg" in plain(ex.files.value)


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


# ------------------------------------------------------------------ issue 45: per-batch stages, the interactive chart

def test_chart_points_carry_each_batchs_stages_and_keep_the_slowest_when_thinned():
    from ucmagic.notebook.chart import chart_points

    st = _explorer_stats()
    b = st.batches()
    b["stage_fetch_s"][:] = 0.001
    b["stage_user_s"][:] = 0.004
    pts = chart_points(b, np.ones(60, dtype=bool))
    assert len(pts) == 60 and pts[5]["wait_ms"] == 800 and pts[5]["user_ms"] == 4 and pts[5]["collate_ms"] == 0
    thin = chart_points(b, np.ones(60, dtype=bool), max_points=6)
    assert len(thin) == 6 and {5, 45} <= {p["index"] for p in thin}  # each bucket's slowest batch


def test_the_chart_zooms_picks_and_names_files_and_replaces_the_png_once_shown():
    pytest.importorskip("ipywidgets")
    pytest.importorskip("anywidget")
    from ucmagic.notebook.chart import ASSET

    assert ASSET.is_file() and "export default" in ASSET.read_text()
    ex = _explorer_stats().explore()
    chart = ex.chart
    assert len(chart.points) == 60 and chart.selected == 5
    chart.view = [30, 59]  # a drag in the browser
    assert ex.range.value == (30, 59) and len(chart.points) == 30 and chart.selected == 45
    chart.view = []  # a double click
    assert ex.range.value == (0, 59)
    chart.hovered = 45
    assert "/v/late.jpg" in chart.hover_info and "miss" in chart.hover_info
    chart.selected = 5  # a click
    assert "/v/cold.jpg" in plain(ex.files.value)
    assert ex.plot.layout.display != "none"
    chart.rendered = True  # the browser loaded the widget's JavaScript
    assert ex.plot.layout.display == "none"


def test_the_explorer_shows_a_batchs_stages(tmp_path):
    pytest.importorskip("ipywidgets")
    import torch

    from ucmagic import DataLoader

    loader = DataLoader(torch.arange(12), batch_size=4, num_workers=0, log_to_mlflow=False)
    for _ in loader:
        pass
    ex = loader.stats.explore()
    assert "made in the main process: fetch" in plain(ex.files.value) and "your code" in plain(ex.table.value)
