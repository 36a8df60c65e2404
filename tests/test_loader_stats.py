"""ucmagic.loading.loader_stats (LoaderStats), stats_analysis and stats_file: straggler hints, save/load/merge,
snapshots, and the presenter hook behind plot() / explore() / monitor()."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from ucmagic import presenters
from ucmagic.loading import stats_analysis
from ucmagic.loading.loader_stats import LoaderStats


# ------------------------------------------------------------------ synthetic stats

def synth(fetch, *, compute=None, epoch=None, worker=None, rank=None, items=None, files=None,
          stages=None) -> LoaderStats:
    """LoaderStats from per-batch lists; ``items[b]`` is a list of ``(index, fetch_s, hit)``; ``stages[b]`` the
    producing process's ``(fetch, user, collate)`` seconds."""
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
    if stages is not None:
        for k, col in enumerate(("stage_fetch_s", "stage_user_s", "stage_collate_s")):
            d[col] = [s[k] for s in stages]
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
    cold = [h for h in hints if "batches with cache misses" in h]
    assert cold and "stats.advise()" in cold[0]
    assert not any("ds.warm()" in h for h in hints)  # one cold pass: warming first costs it the same copies


def test_no_cold_hint_when_loading_is_not_the_bottleneck():
    """Issue 52's panel (a loaded run): "100% of the wait is in batches with cache misses: warm the cache first"
    above "the loop waits for data only 5% of the time: data loading is not the bottleneck"."""
    fetch = [0.01] * 5 + [0.0001] * 35
    items = [[(b, 0.01, False)] for b in range(5)] + [[(b, 0.0001, True)] for b in range(5, 40)]
    hints = synth(fetch, items=items, compute=[0.5] * 40).hints()
    assert any("not the bottleneck" in h for h in hints)
    assert not any("cache misses" in h or "cold epoch" in h for h in hints), hints


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


def test_hint_names_no_file_when_every_open_costs_the_same():
    """Issue 52: "3 files account for 100% of the p99 wait" named the first batch's files when every open cost the
    same 250 ms; the startup batch is left out and a file is named only at 3x the median file's fetch."""
    n = 60
    fetch = [2.0] + [0.25 if b % 4 == 0 else 0.001 for b in range(1, n)]  # the first batch: the start
    items = [[(b * 4 + k, 0.25, False) for k in range(4)] for b in range(n)]
    hints = synth(fetch, items=items, compute=[0.05] * n, worker=[b % 2 for b in range(n)]).hints()
    assert not [h for h in hints if "p99 wait" in h]
    items[40][2] = (999, 1.5, False)  # one file 6x the median copy
    fetch[40] = 1.5
    hints = synth(fetch, items=items, compute=[0.05] * n, files={999: "/Volumes/m/d/v/slow.jpg"}).hints()
    hint = [h for h in hints if "p99 wait" in h]
    assert hint and hint[0].startswith("1 file accounts") and hint[0].endswith("slow.jpg")
    assert "3x+ the median" in hint[0]


def test_hint_names_a_worker_only_against_the_median_worker():
    """Issue 52: "worker 0's batches wait 491x longer ... it reads slow files" when no file was slower: the loop
    waits on the worker whose batch comes first in each round, though both make theirs alike."""
    n = 60
    fetch = [0.3 if b % 2 == 0 else 0.0005 for b in range(n)]  # the loop's waits alternate
    items = [[(b * 4 + k, 0.2, False) for k in range(4)] for b in range(n)]
    stages = [(0.28, 0.001, 0.0001)] * n  # both workers take as long to make a batch
    hints = synth(fetch, items=items, worker=[b % 2 for b in range(n)], stages=stages).hints()
    assert not [h for h in hints if h.startswith("worker")]
    slow = [(0.9, 0.001, 0.0001) if b % 3 == 1 else (0.28, 0.001, 0.0001) for b in range(n)]
    hints = synth(fetch, items=items, worker=[b % 3 for b in range(n)], stages=slow).hints()
    hint = [h for h in hints if h.startswith("worker")]
    assert hint == ["worker 1 takes 3.2x the median worker's time to make a batch (901 ms vs 281 ms): most of it "
                    "in its fetch"]
    slow_files = [[(b * 4 + k, 0.9 if b % 3 == 1 else 0.2, False) for k in range(4)] for b in range(n)]
    hints = synth(fetch, items=slow_files, worker=[b % 3 for b in range(n)], stages=slow).hints()
    assert any(h.startswith("worker 1 takes") and "it reads slow files (median fetch 900.0 ms vs 200.0 ms)" in h
               for h in hints)


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


# ------------------------------------------------------------------ save / load / merge

def test_save_load_roundtrip_keeps_batches_items_and_file_names(tmp_path):
    items = [[(0, 0.3, False), (1, 0.1, True)], [(2, 0.2, False)]]
    st0 = synth([0.5, 0.25], epoch=[0, 1], worker=[1, 0], items=items, files={0: "a.jpg", 1: "b.jpg", 2: "c.jpg"})
    path = st0.save(tmp_path / "stats.json")
    assert json.loads(open(path).read())["version"] == 1 and not (tmp_path / "stats.json.tmp").exists()
    st1 = LoaderStats.load(path)
    for k, v in st0.batches().items():
        assert np.array_equal(v, st1.batches()[k], equal_nan=v.dtype.kind == "f"), k
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




# ------------------------------------------------------------------ snapshot and analysis (pure)

def test_cache_fill_advances_a_measured_fill_by_the_misses_since_and_never_past_the_listing():
    base = {"files": 10, "bytes": 1000, "files_cached": 4, "bytes_cached": 400, "misses": 2, "bytes_fetched": 200}
    fill = stats_analysis.cache_fill({"hits": 6, "misses": 5, "bytes_fetched": 500}, base)
    assert fill == {"hits": 6, "misses": 5, "bytes_fetched": 500, "hit_rate": 6 / 11, "files": 10, "bytes": 1000,
                    "files_cached": 7, "bytes_cached": 700}
    full = stats_analysis.cache_fill({"hits": 0, "misses": 50, "bytes_fetched": 9000}, base)
    assert full["files_cached"] == 10 and full["bytes_cached"] == 1000 and full["hit_rate"] == 0.0
    none = stats_analysis.cache_fill({"hits": 0, "misses": 0, "bytes_fetched": 0}, {})
    assert np.isnan(none["hit_rate"]) and none["files"] == none["files_cached"] == 0


def test_slowest_and_select_filter_by_step_epoch_worker_and_rank():
    st = synth([0.1, 0.5, 0.3, 0.5, 0.2], epoch=[0, 0, 1, 1, 1], worker=[0, 1, 0, 1, 0])
    assert st.slowest_batches(2) == [1, 3]  # ties: the earlier first
    assert st.slowest_batches(5, epoch=1, worker=0) == [2, 4]
    assert st.slowest_batches(5, lo=2, hi=3) == [3, 2]
    assert LoaderStats.select(st.batches(), rank=1).sum() == 0


def test_summary_and_repr_of_loaded_stats():
    st = synth([0.01, 0.03], compute=[0.01, 0.01])
    s = st.summary()
    assert s["count"] == 2 and s["mean"] == pytest.approx(0.02) and s["max"] == pytest.approx(0.03)
    assert s["stall_fraction"] == pytest.approx(0.04 / 0.06) and "hits" not in s
    assert repr(st).startswith("LoaderStats(count=2, mean=20.00ms") and repr(LoaderStats()) == "LoaderStats(count=0)"


# ------------------------------------------------------------------ the presenter hook

def test_plot_and_explore_call_the_registered_presenters(monkeypatch):
    shown = []
    monkeypatch.setitem(presenters._registry, "plot", lambda stats, **kw: shown.append(("plot", stats, kw)))
    monkeypatch.setitem(presenters._registry, "explore", lambda stats, **kw: shown.append(("explore", stats, kw)))
    st = synth([0.1])
    st.plot(bins=5)
    st.explore()
    assert shown == [("plot", st, {"bins": 5}), ("explore", st, {})]


def test_an_unregistered_presenter_says_how_to_register_one():
    with pytest.raises(LookupError, match=r"register_presenter\('nope', fn\)"):
        presenters.presenter("nope")


def test_the_engine_loads_the_notebook_layer_only_when_something_is_shown():
    code = textwrap.dedent("""
        import sys
        import ucmagic.loading.loader, ucmagic.loading.loader_stats
        before = sorted(m for m in sys.modules if m.startswith("ucmagic.notebook"))
        from ucmagic.loading.loader_stats import LoaderStats
        fig = LoaderStats().plot()
        after = sorted(m for m in sys.modules if m.startswith("ucmagic.notebook"))
        print(before, after, type(fig).__name__)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["[]", "['ucmagic.notebook',", "'ucmagic.notebook.plots']", "Figure"]


def test_the_warm_stall_hint_names_the_measured_stage_when_there_is_one():
    """Issue 45: with stage times the hint says where the wait went (measured), not a guess that it is decoding."""
    n = 20
    st = synth([0.05] * n, compute=[0.01] * n, items=warm_items(n))
    d = st.to_dict()
    d.update(stage_fetch_s=[0.001] * n, stage_user_s=[0.002] * n, stage_collate_s=[0.04] * n)
    hint = [h for h in LoaderStats.from_dict(d).hints() if "warm cache" in h]
    assert hint == ["the loop waits for data 83% of the time with a warm cache, 93% of it on collate (measured): "
                    "see stats.advise()"]
    assert any("decoding is the bottleneck" in h for h in st.hints())  # no stage times: the old inference
