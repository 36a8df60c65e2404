"""ucmagic.DataLoader: defaults, any dataset and start method, telemetry, MLflow, plots, exact resume."""
import json
import math
import os
import subprocess
import sys
import types

import numpy as np
import numpy.random  # imported before forking workers
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
import torch
from torch.utils.data import IterableDataset, get_worker_info

from ucmagic.files import plan
from ucmagic.files.dataset import UCVolumeDataset
from ucmagic.errors import ListingChangedError, ResumeLayoutError
from ucmagic.loading.loader import DataLoader
from ucmagic.loading.loader_stats import LoaderStats


def rel_of(path: str) -> str:
    with open(path, "rb") as f:
        return f.readline().decode().strip()


def rels(batches) -> list[str]:
    return [rel_of(p) for b in batches for p in b]


def flat(batches) -> list[str]:
    return [x for b in batches for x in b]


class WorkerStreams(IterableDataset):
    """Worker ``w`` yields ``(w, i)`` for ``i < lengths[w]`` (worker 0 alone without workers)."""

    def __init__(self, lengths):
        self.lengths = lengths

    def __iter__(self):
        info = get_worker_info()
        w = info.id if info else 0
        return iter([(w, i) for i in range(self.lengths[w])])


class Counting(IterableDataset):
    """0..n-1 split round-robin over workers; deterministic, so skip-resume is exact."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        w, k = (info.id, info.num_workers) if info else (0, 1)
        return iter(range(w, self.n, k))


# ------------------------------------------------------------------ L1: defaults, datasets, start methods

def test_defaults_are_tuned_and_every_explicit_argument_wins(tree):
    ds = torch.arange(10)
    d = DataLoader(ds)
    assert (d.num_workers, d.prefetch_factor, d.persistent_workers) == (min(6, len(os.sched_getaffinity(0))), 4, True)
    assert d.pin_memory == torch.cuda.is_available()
    assert isinstance(d, torch.utils.data.DataLoader)
    e = DataLoader(ds, 5, False, num_workers=2, prefetch_factor=2, persistent_workers=False, pin_memory=False)
    got = (e.batch_size, e.num_workers, e.prefetch_factor, e.persistent_workers, e.pin_memory)
    assert got == (5, 2, 2, False, False)
    z = DataLoader(ds, num_workers=0)
    assert (z.prefetch_factor, z.persistent_workers) == (None, False)
    assert [b.tolist() for b in z] == [[i] for i in range(10)]
    with pytest.raises(ValueError, match="UCVolumeDataset"):
        DataLoader(UCVolumeDataset(tree[0]), shuffle=True)


def test_defaults_follow_the_dataset_kind_parquet_runs_in_process_files_get_workers(tree, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ucmagic import ParquetDataset

    pq.write_table(pa.table({"id": list(range(300)), "x": [i / 2 for i in range(300)]}), tmp_path / "p.parquet",
                   row_group_size=100)
    ds = ParquetDataset(str(tmp_path), batch_size=64)
    d = DataLoader(ds, batch_size=None)
    assert (d.num_workers, d.prefetch_factor, d.persistent_workers) == (0, None, False)
    assert d.pin_memory == torch.cuda.is_available()
    assert sorted(int(i) for b in d for i in b["id"]) == list(range(300))
    e = DataLoader(ds, num_workers=2, persistent_workers=False, pin_memory=False)
    assert (e.num_workers, e.prefetch_factor, e.persistent_workers, e.pin_memory) == (2, 4, False, False)
    f = DataLoader(UCVolumeDataset(tree[0]))
    assert (f.num_workers, f.prefetch_factor, f.persistent_workers) == (min(6, len(os.sched_getaffinity(0))), 4, True)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_any_dataset_with_fork_and_spawn(tree, method):
    root, names = tree
    ds = UCVolumeDataset(root)
    loader = DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=method, collate_fn=list)
    assert sorted(rels(loader)) == sorted(names)
    assert sorted(rels(loader)) == sorted(names)  # persistent workers serve a second epoch
    assert ds.epoch == 1
    m = DataLoader(torch.arange(20), batch_size=6, shuffle=True, num_workers=1,
                   multiprocessing_context=method)
    assert sorted(torch.cat(list(m)).tolist()) == list(range(20))
    assert m.stats.count == 4


class FrozenInWorkers(IterableDataset):
    """Each worker yields how many objects it inherited frozen, and the cost of a full collection there."""

    def __iter__(self):
        import gc
        import time

        t0 = time.process_time()
        gc.collect()
        return iter([(gc.get_freeze_count(), time.process_time() - t0)])


@pytest.mark.parametrize("user_froze", [False, True])
def test_forked_workers_inherit_the_parents_objects_frozen_and_the_parent_gets_them_back(user_froze):
    """A full collection in a forked worker would write to every page of the objects it inherited (after
    importing torch: ~42 MB copied per worker, 0.2 CPU-s): they come frozen. The parent's own objects go
    back to collections once the workers are started; objects the caller froze stay frozen."""
    import gc

    keep = [object() for _ in range(10)]  # tracked objects, frozen by the caller where user_froze
    if user_froze:
        gc.freeze()
    frozen_before = gc.get_freeze_count()
    try:
        got = list(DataLoader(FrozenInWorkers(), batch_size=None, num_workers=2, multiprocessing_context="fork",
                              persistent_workers=False))
        assert len(got) == 2
        assert all(n > 10_000 for n, _ in got)  # everything the parent held (torch's modules included)
        # unfrozen again, or the caller's freeze kept: not thawed (0), nothing frozen on top; another thread of
        # the process (pytest-xdist's channel) may free a few frozen objects meanwhile
        assert frozen_before - 1000 <= gc.get_freeze_count() <= frozen_before
    finally:
        if user_froze:
            gc.unfreeze()
    del keep


def test_batches_are_the_same_with_and_without_a_profiler_and_a_running_profiler_still_sees_the_loader():
    """ucmagic.DataLoader takes batches without torch's per-batch profiler range when no profiler runs
    (_torch_compat.batch_puller); under torch.profiler the range is there, and the batches are the same."""
    plain = [b.tolist() for b in DataLoader(torch.arange(50), batch_size=8, num_workers=0)]
    with torch.profiler.profile() as prof:
        profiled = [b.tolist() for b in DataLoader(torch.arange(50), batch_size=8, num_workers=0)]
    assert plain == profiled == [list(range(i, min(i + 8, 50))) for i in range(0, 50, 8)]
    names = {e.name for e in prof.events()}
    assert any(n.startswith("enumerate(DataLoader)") for n in names), sorted(names)[:20]


def test_the_length_warning_of_an_iterable_dataset_that_yields_more_than_it_said_still_comes():
    class Longer(IterableDataset):
        def __len__(self):
            return 3

        def __iter__(self):
            return iter(range(5))

    loader = DataLoader(Longer(), batch_size=None, num_workers=0)
    assert len(loader) == 3
    with pytest.warns(UserWarning, match="reported to be 3"):
        assert list(loader) == list(range(5))


def test_plain_iterable_dataset_and_no_auto_batching():
    d = DataLoader(Counting(11), batch_size=None, num_workers=0)
    assert list(d) == list(range(11)) and d.stats.count == 11


@pytest.mark.parametrize("lengths,bs,drop_last,prefetch", [
    ([7, 7, 7], 2, False, 2),
    ([0, 5, 13, 2], 3, False, 1),
    ([9, 0, 4], 4, True, 3),
    ([1, 10, 3, 6], 2, False, 4),
    ([8, 8, 5], 4, False, 2),
    ([5, 5, 5, 5], 5, True, 1),
])
def test_torch_round_robin_matches_the_plan_model(lengths, bs, drop_last, prefetch):
    """Real multi-worker DataLoader over IterableDataset workers: the order batches reach the loop
    is the round-robin over non-exhausted workers that plan.items_delivered assumes."""
    loader = torch.utils.data.DataLoader(WorkerStreams(lengths), batch_size=bs, drop_last=drop_last,
                                         num_workers=len(lengths), prefetch_factor=prefetch,
                                         multiprocessing_context="fork", collate_fn=list)
    got = [0] * len(lengths)
    k = 0
    for batch in loader:
        k += 1
        w = batch[0][0]
        assert [i for _, i in batch] == list(range(got[w], got[w] + len(batch)))
        got[w] += len(batch)
        assert got == plan.items_delivered(lengths, bs, drop_last, k)
    assert k == sum(plan.batches_per_stream(lengths, bs, drop_last))


# ------------------------------------------------------------------ L2 / W2: telemetry, callbacks, plots

def test_stats_timings_snapshot_and_cache_counters(tree):
    root, names = tree
    ds = UCVolumeDataset(root)
    loader = DataLoader(ds, batch_size=10, num_workers=2, collate_fn=list)
    seen = []
    loader.add_batch_callback(lambda ld, st: seen.append((ld is loader, st.count, st.last_fetch_s)))
    for _ in loader:
        pass
    s = loader.stats
    assert isinstance(s, LoaderStats) and s.count == 12 and len(seen) == 12
    assert [c for _, c, _ in seen] == list(range(1, 13)) and all(ok for ok, _, _ in seen)
    assert 0 < s.p50 <= s.p90 <= s.p99 <= s.max and 0 < s.mean <= s.max
    assert 0 <= s.stall_fraction <= 1 and len(s.fetch_seconds) == len(s.compute_seconds) == 12
    assert (s.hits, s.misses, s.bytes_fetched) == (0, 120, 120 * 3000)
    snap = s.snapshot()
    assert snap["count"] == 12 and snap["epoch_count"] == 12 and len(snap["recent_fetch_s"]) == 12
    assert (snap["files"], snap["files_cached"], snap["bytes_cached"]) == (120, 120, 360000)
    assert snap["hit_rate"] == 0 and snap["p50_s"] <= snap["p99_s"]
    json.dumps(snap)
    summary = s.summary()
    assert summary["count"] == 12 and summary["misses"] == 120 and "p99" in summary
    assert "count=12" in repr(s)
    for _ in loader:  # second epoch: all hits, stats accumulate
        pass
    assert s.count == 24 and s.hits == 120 and s.snapshot()["epoch_count"] == 12


def test_plot_is_a_headless_figure_with_latency_and_histogram():
    loader = DataLoader(torch.arange(50), batch_size=5, num_workers=0)
    empty = loader.stats.plot()
    for _ in loader:
        pass
    fig = loader.stats.plot()
    from matplotlib.figure import Figure

    assert isinstance(fig, Figure) and isinstance(empty, Figure)
    line, hist = fig.axes
    assert len(line.lines) >= 3  # latency, p50, p99
    assert any("p99" in t.get_text() for t in line.get_legend().get_texts())
    assert len(hist.patches) > 0
    import io

    fig.savefig(io.BytesIO(), format="png")


def test_end_callbacks_on_finish_break_and_error():
    ends = []
    loader = DataLoader(torch.arange(9), batch_size=3, num_workers=0)
    loader.add_epoch_end_callback(lambda ld, st, err: ends.append(err))
    list(loader)
    for _ in loader:
        break
    assert ends == [None, None]

    class Boom(IterableDataset):
        def __iter__(self):
            yield 1
            raise OSError("volume went away")

    bad = DataLoader(Boom(), batch_size=1, num_workers=0)
    bad.add_epoch_end_callback(lambda ld, st, err: ends.append(err))
    with pytest.raises(OSError):
        list(bad)
    assert isinstance(ends[-1], OSError)
    assert bad.stats.count == 1


def test_monitor_imports_the_widget_lazily(monkeypatch):
    calls = []
    fake = types.ModuleType("ucmagic.notebook.panel")
    fake.attach_monitor = lambda loader, **kw: calls.append((loader, kw)) or "monitor"
    monkeypatch.setitem(sys.modules, "ucmagic.notebook.panel", fake)
    loader = DataLoader(torch.arange(3), num_workers=0)
    assert loader.monitor(mode="off") == "monitor" and calls == [(loader, {"mode": "off"})]


# ------------------------------------------------------------------ L2: MLflow

@pytest.fixture(scope="module")
def mlflow_store(tmp_path_factory):
    mlflow = pytest.importorskip("mlflow")
    old = mlflow.get_tracking_uri()
    uri = f"sqlite:///{tmp_path_factory.mktemp('mlflow')}/mlflow.db"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("ucmagic-loader-tests")
    yield mlflow
    while mlflow.active_run():
        mlflow.end_run()
    mlflow.set_tracking_uri(old)


def history(mlflow, run_id, key):
    return sorted((m.step, m.value) for m in mlflow.tracking.MlflowClient().get_metric_history(run_id, key))


def test_metrics_land_in_the_active_run_with_rank_keys_and_steps(mlflow_store, tree):
    mlflow = mlflow_store
    ds = UCVolumeDataset(tree[0])
    loader = DataLoader(ds, batch_size=10, num_workers=2, collate_fn=list, log_interval=3600)
    with mlflow.start_run() as run:
        list(loader)
        for i, _ in enumerate(loader):
            if i == 4:
                break  # a break flushes too
    rid = run.info.run_id
    fetch = history(mlflow, rid, "dataloader/fetch_seconds/rank_0")
    assert [s for s, _ in fetch] == [11, 16]  # one window per epoch here: logged at its last batch
    f = loader.stats.fetch_seconds
    assert [v for _, v in fetch] == pytest.approx([f[:12].mean(), f[12:].mean()])
    p50 = history(mlflow, rid, "dataloader/fetch_p50_seconds/rank_0")
    p99 = history(mlflow, rid, "dataloader/fetch_p99_seconds/rank_0")
    assert p50[0][1] <= p99[0][1] == pytest.approx(float(np.percentile(f[:12], 99)))
    assert [v for _, v in history(mlflow, rid, "dataloader/batches/rank_0")] == [12, 5]
    for key in ("compute_seconds", "fetch_max_seconds", "stall_fraction"):
        assert len(history(mlflow, rid, f"dataloader/{key}/rank_0")) == 2
    hit_rate = history(mlflow, rid, "dataloader/cache_hit_rate/rank_0")
    assert hit_rate[0][1] == 0.0 and hit_rate[-1][1] > 0


def test_writes_are_batched(mlflow_store, monkeypatch):
    from ucmagic.loading import mlflow_sink

    made = []
    real = mlflow_sink.MlflowSink.for_active_run.__func__

    def spy(cls, rank=0, **kw):
        sink = real(cls, rank, **kw)
        made.append(sink)
        return sink

    monkeypatch.setattr(mlflow_sink.MlflowSink, "for_active_run", classmethod(spy))
    with mlflow_store.start_run() as run:
        slow = DataLoader(torch.arange(600), batch_size=1, num_workers=0, log_interval=3600)
        list(slow)
        fast = DataLoader(torch.arange(6), batch_size=1, num_workers=0, log_interval=0)
        list(fast)
    assert made[0].calls == 1 and made[0].logged == len(mlflow_sink.WINDOW_NAMES)  # 600 batches, one write
    assert made[1].calls == 6  # interval 0: a write per batch
    steps = history(mlflow_store, run.info.run_id, "dataloader/fetch_seconds/rank_0")
    assert [s for s, _ in steps] == [0, 1, 2, 3, 4, 5, 599]  # each loader counts its own batches


def test_run_from_env_and_no_run_means_no_logging(mlflow_store, monkeypatch):
    mlflow = mlflow_store
    from ucmagic.loading.mlflow_sink import active_run_id

    assert mlflow.active_run() is None and active_run_id() is None
    loader = DataLoader(torch.arange(4), num_workers=0)
    assert loader._make_sink() is None
    list(loader)  # no run: nothing logged, nothing fails
    run = mlflow.tracking.MlflowClient().create_run(mlflow.get_experiment_by_name("ucmagic-loader-tests").experiment_id)
    monkeypatch.setenv("MLFLOW_RUN_ID", run.info.run_id)
    list(loader)
    assert [s for s, _ in history(mlflow, run.info.run_id, "dataloader/fetch_seconds/rank_0")] == [7]
    assert DataLoader(torch.arange(4), num_workers=0, log_to_mlflow=False)._make_sink() is None


def test_mlflow_errors_never_break_training(mlflow_store):
    class Broken:
        def log_batch(self, *a, **k):
            raise ConnectionError("tracking server down")

    from ucmagic.loading.mlflow_sink import MlflowSink

    sink = MlflowSink("run", 3, interval=0, client=Broken())
    with pytest.warns(UserWarning, match="could not log"):
        sink.add(0, 0.1, 0.2)
        sink.close()
    assert sink.keys["fetch_seconds"] == "dataloader/fetch_seconds/rank_3"


def test_mlflow_is_not_imported_without_a_run(tmp_path):
    code = ("import sys, torch, ucmagic\n"
            "from torch.utils.data import TensorDataset\n"
            "list(ucmagic.DataLoader(torch.arange(5), num_workers=0))\n"
            "assert 'mlflow' not in sys.modules\n")
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_RUN_ID"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


# ------------------------------------------------------------------ F7 / L3: resume

def run_until(loader, stop):
    """The first ``stop`` batches (cached paths are read at once: only recent items stay pinned)."""
    got = []
    for i, batch in enumerate(loader):
        got.append([rel_of(p) if isinstance(p, str) else p for p in batch] if isinstance(batch, list) else batch)
        if i + 1 == stop:
            break
    return got


RESUME_CHILD = r"""
import json, sys
from ucmagic import DataLoader, UCVolumeDataset
root, state_file, workers, bs = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
ds = UCVolumeDataset(root, shuffle=True, seed=11)
loader = DataLoader(ds, batch_size=bs, num_workers=workers, collate_fn=list)
with open(state_file) as f:
    loader.load_state_dict(json.load(f))
rest = []
for b in loader:
    for p in b:
        with open(p, "rb") as f:
            rest.append(f.readline().decode().strip())
print(json.dumps(rest))
"""


def test_interrupted_epoch_resumes_in_a_fresh_process_with_other_workers(tree, tmp_path):
    root, names = tree
    ds = UCVolumeDataset(root, shuffle=True, seed=11)
    loader = DataLoader(ds, batch_size=7, num_workers=3, collate_fn=list)
    before = flat(run_until(loader, 6))
    state = loader.state_dict()
    text = json.dumps(state)
    assert len(text) < 1000 and state["dataset"]["remaining"] == 120 - len(before) == 78
    (tmp_path / "state.json").write_text(text)
    out = subprocess.run([sys.executable, "-c", RESUME_CHILD, root, str(tmp_path / "state.json"), "2", "5"],
                         check=True, capture_output=True, text=True, timeout=120)
    after = json.loads(out.stdout)
    assert sorted(before + after) == sorted(names) and len(before + after) == 120


def test_elastic_resume_on_more_ranks(tree, monkeypatch):
    """Saved on one rank with 2 workers, resumed on 2 ranks (RANK/WORLD_SIZE) with 3 workers each."""
    root, names = tree
    loader = DataLoader(UCVolumeDataset(root, shuffle=True, seed=5), batch_size=4, num_workers=2, collate_fn=list)
    before = flat(run_until(loader, 9))
    state = json.loads(json.dumps(loader.state_dict()))
    after = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        d = DataLoader(UCVolumeDataset(root, shuffle=True, seed=5), batch_size=3, num_workers=3,
                       multiprocessing_context="fork", collate_fn=list)
        d.load_state_dict(state)
        mine = rels(d)
        assert len(mine) == 42  # 84 left: equal shares
        after += mine
    assert sorted(before + after) == sorted(names)


class _DoneWork:
    """What torch's ``all_gather(..., async_op=True)`` returns, for a faked gather that is already done."""

    def wait(self) -> bool:
        return True


def fake_all_gather(outs, t, group=None, async_op=False):
    """One process faking every rank: each rank's tensor is this one (torch's contract, ``async_op`` included)."""
    for o in outs:
        o.copy_(t)
    return _DoneWork() if async_op else None


def test_state_gathers_every_rank_and_resumes_on_one(tree, monkeypatch):
    """Two ranks (torch.distributed faked, num_workers=0) stop after 5 batches; one rank finishes."""
    root, names = tree
    dist = torch.distributed
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    before, states = [], []
    for rank in range(2):
        monkeypatch.setattr(dist, "get_rank", lambda group=None, r=rank: r)
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
        monkeypatch.setattr(dist, "all_gather", fake_all_gather)
        d = DataLoader(UCVolumeDataset(root, shuffle=True), batch_size=4, num_workers=0, collate_fn=list)
        before += flat(run_until(d, 5))
        states.append(d.state_dict())
    assert states[0] == states[1] and states[0]["dataset"]["remaining"] == 80
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    d = DataLoader(UCVolumeDataset(root, shuffle=True), batch_size=6, num_workers=2, collate_fn=list)
    d.load_state_dict(states[0])
    assert sorted(before + rels(d)) == sorted(names)


def test_world_size_without_process_group_says_how_to_fix(tree, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    d = DataLoader(UCVolumeDataset(tree[0]), batch_size=4, num_workers=0, collate_fn=list)
    run_until(d, 2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        d.state_dict()


def test_persistent_workers_pick_up_a_loaded_state_and_epochs_go_on(tree):
    root, names = tree
    ds = UCVolumeDataset(root, shuffle=True, seed=2)
    loader = DataLoader(ds, batch_size=8, num_workers=2, collate_fn=list)
    epoch0 = rels(loader)
    saved = loader.state_dict()
    assert saved["dataset"]["remaining"] == 0 and saved["dataset"]["epoch"] == 0
    part = flat(run_until(loader, 3))  # epoch 1, interrupted
    mid = loader.state_dict()
    assert mid["dataset"]["epoch"] == 1
    loader.load_state_dict(mid)  # same loader, live persistent workers
    rest = rels(loader)
    assert sorted(part + rest) == sorted(names) and part + rest != epoch0
    assert loader.state_dict()["dataset"] == {**mid["dataset"], "pool": [], "remaining": 0, "ended": True}
    fresh = DataLoader(UCVolumeDataset(root, shuffle=True, seed=2), batch_size=8, num_workers=1, collate_fn=list)
    fresh.load_state_dict(saved)  # a finished epoch: the next iteration is epoch 1, whole
    ref = UCVolumeDataset(root, shuffle=True, seed=2)
    ref.set_epoch(1)
    assert rels(fresh) == rels(DataLoader(ref, batch_size=8, num_workers=1, collate_fn=list))
    assert fresh.dataset.epoch == 1 and fresh.stats.count == 15


def test_unstarted_loader_state_round_trips(tree):
    root, names = tree
    d = DataLoader(UCVolumeDataset(root), batch_size=8, num_workers=0, collate_fn=list)
    s = d.state_dict()
    assert s["dataset"]["remaining"] == 120 and s["dataset"]["epoch"] == 0
    part = flat(run_until(d, 2))
    s = d.state_dict()
    e = DataLoader(UCVolumeDataset(root), batch_size=8, num_workers=0, collate_fn=list)
    e.load_state_dict(s)
    assert e.state_dict()["dataset"] == s["dataset"]  # saving again before iterating keeps the state
    assert sorted(part + rels(e)) == sorted(names)


def test_changed_listing_is_refused(tree):
    root, names = tree
    d = DataLoader(UCVolumeDataset(root), batch_size=8, num_workers=0, collate_fn=list)
    run_until(d, 2)
    state = d.state_dict()
    os.remove(os.path.join(root, names[0]))
    with pytest.raises(ListingChangedError, match="changed"):
        DataLoader(UCVolumeDataset(root), num_workers=0).load_state_dict(state)


def test_map_style_resume_replays_the_shuffled_order(monkeypatch):
    data = torch.arange(50)
    torch.manual_seed(0)
    ref = DataLoader(data, batch_size=4, shuffle=True, num_workers=0)
    first = [b.tolist() for b in ref]
    second = [b.tolist() for b in ref]
    assert sorted(sum(first, [])) == list(range(50)) and first != second
    torch.manual_seed(0)
    a = DataLoader(data, batch_size=4, shuffle=True, num_workers=2)
    list(a)
    got = [b.tolist() for b in run_until(a, 5)]
    assert got == second[:5]
    state = json.loads(json.dumps(a.state_dict()))
    b = DataLoader(data, batch_size=4, shuffle=True, num_workers=0)  # other workers, other seed
    b.load_state_dict(state)
    rest = [x.tolist() for x in b]
    assert got + rest == second
    assert b.state_dict()["complete"] is True
    with pytest.raises(ListingChangedError):
        DataLoader(torch.arange(49), batch_size=4, num_workers=0).load_state_dict(state)


def test_generic_iterable_resume_skips_delivered_batches():
    a = DataLoader(Counting(40), batch_size=3, num_workers=2, multiprocessing_context="fork")
    got = [b.tolist() for b in run_until(a, 4)]
    state = a.state_dict()
    b = DataLoader(Counting(40), batch_size=3, num_workers=2, multiprocessing_context="fork")
    b.load_state_dict(state)
    rest = [x.tolist() for x in b]
    assert sorted(sum(got + rest, [])) == list(range(40))
    assert b.state_dict()["batches"] == len(got) + len(rest)
    with pytest.raises(ResumeLayoutError, match="same num_workers"):
        DataLoader(Counting(40), batch_size=3, num_workers=1).load_state_dict(state)


def test_state_of_a_stats_less_loader_is_json_and_versioned():
    d = DataLoader(torch.arange(5), num_workers=0)
    s = d.state_dict()
    assert json.loads(json.dumps(s)) == s and s["batches"] == 0 and not s["complete"]
    with pytest.raises(ValueError, match="version"):
        d.load_state_dict({**s, "version": 99})
    assert math.isnan(d.stats.p50) and d.stats.snapshot()["count"] == 0


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # its loader's finaliser
def test_parquet_dataset_resumes_exactly_through_the_loader(tmp_path):
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from ucmagic import DataLoader, ParquetDataset

    path = tmp_path / "t"
    path.mkdir()
    pq.write_table(pa.table({"id": list(range(1000)), "x": [float(i) for i in range(1000)]}),
                   path / "part.parquet", row_group_size=128)
    ds = ParquetDataset(str(path), batch_size=50, shuffle=True, seed=4)
    loader = DataLoader(ds, num_workers=2)
    assert loader.batch_size is None
    before = []
    for i, batch in enumerate(loader):
        before += batch["id"].tolist()
        if i == 6:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    resumed = DataLoader(ParquetDataset(str(path), batch_size=50, shuffle=True, seed=4), num_workers=1)
    resumed.load_state_dict(state)
    after = [x for batch in resumed for x in batch["id"].tolist()]
    assert sorted(before + after) == list(range(1000)) and not set(before) & set(after)
    with pytest.raises(ValueError, match="whole batches"):
        DataLoader(ds, batch_size=32)


class _Decoding(IterableDataset):
    """The seeds' wrapper: the user's dataset over a UCVolumeDataset."""

    def __init__(self, ds):
        self.ds = ds

    def __iter__(self):
        yield from self.ds


@pytest.mark.parametrize("wrapped", [False, True])
def test_two_loaders_iterating_one_dataset_object_at_once_are_refused_and_one_at_a_time_is_fine(tmp_path, wrapped):
    """They would share the object's epoch count and consumption reports: zipped, one delivered 149
    distinct files of 200 (duplicates instead of the rest, silently), and an evaluation loop nested in
    training ended the training loop's protection (files evicted before they were read)."""
    from ucmagic.errors import InvalidArgumentError
    from ucmagic.testing import make_files

    root = str(tmp_path / "vol")
    make_files(root, 60, 500, per_dir=20)
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), shuffle=True)
    src = _Decoding(ds) if wrapped else ds
    a, b = (DataLoader(src, batch_size=4, num_workers=2, collate_fn=list) for _ in range(2))
    it = iter(a)
    next(it)
    with pytest.raises(InvalidArgumentError, match="already being iterated by another DataLoader.*its own dataset"):
        iter(b)
    rest = [p for batch in it for p in batch]
    assert len(rest) == 56  # the refusal changed nothing of a's epoch
    for loader in (a, b):  # one after the other: each epoch whole
        got = [ds.source_of(p).rel for batch in loader for p in batch]
        assert len(got) == len(set(got)) == 60
    inner = DataLoader(UCVolumeDataset(root, cache_dir=str(tmp_path / "c")), batch_size=4, num_workers=0)
    for i, _ in enumerate(a):  # an evaluation loop over its own dataset object, nested in training
        if i == 2:
            assert sum(len(x) for x in inner) == 60


# ------------------------------------------------------------------ issue 40: delivery after a resume

class _Items(torch.utils.data.Dataset):
    """A user map-style dataset whose items are their own index."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class _PathsToRel(IterableDataset):
    """The seeds' pattern: a user IterableDataset that wraps a ucmagic dataset and decodes each item."""

    def __init__(self, inner):
        self._inner = inner

    def __iter__(self):
        for p in self._inner:
            yield rel_of(p) if isinstance(p, str) else p


_MAP_RESUME_CHILD = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[4])
from test_loader import _Items
from ucmagic import DataLoader
state = json.load(open(sys.argv[1]))
loader = DataLoader(_Items(int(sys.argv[2])), batch_size=16, shuffle=True, num_workers=int(sys.argv[3]))
loader.load_state_dict(state)
print(json.dumps([int(i) for b in loader for i in b]))
"""


@pytest.mark.parametrize("workers_before,workers_after,shuffle,persistent", [
    (0, 1, False, True), (2, 2, True, True), (2, 3, True, False), (1, 0, True, True)])
def test_map_style_resume_with_workers_delivers_exactly_the_rest(workers_before, workers_after, shuffle, persistent):
    """Issue 40: 7 batches of 16 from 1,000 items, resumed with workers: the rest, not 1,112 items
    (torch asks the index sampler for an iterator twice when it starts workers; the skip went to the first)."""
    a = DataLoader(_Items(1000), batch_size=16, shuffle=shuffle, num_workers=workers_before,
                   persistent_workers=persistent and workers_before > 0)
    before = [int(i) for b in run_until(a, 7) for i in b]
    state = json.loads(json.dumps(a.state_dict()))
    b = DataLoader(_Items(1000), batch_size=16, shuffle=shuffle, num_workers=workers_after,
                   persistent_workers=persistent and workers_after > 0)
    b.load_state_dict(state)
    after = [int(i) for x in b for i in x]
    assert len(before) == 112 and len(after) == 888
    assert sorted(before + after) == list(range(1000))
    again = [int(i) for x in b for i in x]  # the next epoch is whole
    assert sorted(again) == list(range(1000))


def test_map_style_resume_in_a_new_process_with_workers(tmp_path):
    a = DataLoader(_Items(1000), batch_size=16, shuffle=True, num_workers=2)
    before = [int(i) for b in run_until(a, 7) for i in b]
    (tmp_path / "s.json").write_text(json.dumps(a.state_dict()))
    out = subprocess.run([sys.executable, "-c", _MAP_RESUME_CHILD, str(tmp_path / "s.json"), "1000", "2",
                          os.path.dirname(__file__)], check=True, capture_output=True, text=True, timeout=100)
    after = json.loads(out.stdout)
    assert len(after) == 888 and sorted(before + after) == list(range(1000))


def _epoch_of(loader):
    return [x for b in loader for x in b]


def _first(loader, n):
    """The items of the loader's first ``n`` batches (then ``break``)."""
    got = []
    for i, b in enumerate(loader):
        got += b
        if i + 1 == n:
            break
    return got


@pytest.mark.parametrize("workers_after", [2, 3, 0])
def test_wrapper_resumed_at_epoch_one_without_set_epoch_delivers_that_epochs_rest(tmp_path, workers_after):
    """Issue 40: the seeds' wrapper over a shuffled UCVolumeDataset, one epoch, 5 batches of epoch 1,
    resumed in a fresh loader (any num_workers): exactly epoch 1's other items, in epoch 1's order,
    not epoch 0's order minus 160 items."""
    from ucmagic.testing import make_files

    root = str(tmp_path / "vol")
    names = make_files(root, 300, 64, per_dir=50)

    def make(nw):
        return DataLoader(_PathsToRel(UCVolumeDataset(root, shuffle=True, seed=3)), batch_size=32, num_workers=nw,
                          collate_fn=list)

    a = make(2)
    epoch0 = _epoch_of(a)
    assert sorted(epoch0) == sorted(names)
    part = _first(a, 5)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["epoch"] == 1
    b = make(workers_after)
    b.load_state_dict(state)
    rest = _epoch_of(b)
    assert len(part) == 160 and sorted(part + rest) == sorted(names)
    ref = make(2)
    _epoch_of(ref)
    epoch1 = _epoch_of(ref)
    assert set(part) == set(epoch1[:160]) and part != epoch0[:160]
    assert sorted(_epoch_of(b)) == sorted(names)  # epoch 2 is whole


def test_wrapper_over_a_shuffled_sample_stream_resumes_epoch_one_elastically(tmp_path):
    from ucmagic import TarShards, pack
    from ucmagic.testing import make_files

    src, out = str(tmp_path / "src"), str(tmp_path / "tars")
    make_files(src, 400, 40, per_dir=100)
    pack(src, out, shard_size="16KB", progress=False)

    def make(nw):
        ds = TarShards(out, cache_dir=str(tmp_path / "c")).stream(shuffle=True, seed=1)
        return DataLoader(_PathsToRel(ds), batch_size=16, num_workers=nw, collate_fn=list)

    def key(s):
        return s["__key__"]

    a = make(2)
    whole = sorted(map(key, _epoch_of(a)))
    assert len(whole) == 400
    part = [key(x) for x in _first(a, 5)]
    state = json.loads(json.dumps(a.state_dict()))
    b = make(1)
    b.load_state_dict(state)
    rest = [key(x) for x in _epoch_of(b)]
    assert sorted(part + rest) == whole


def test_own_iterable_dataset_resumed_on_another_layout_is_refused_by_name():
    from ucmagic import ResumeLayoutError, UCMagicError

    a = DataLoader(Counting(40), batch_size=3, num_workers=2, multiprocessing_context="fork")
    run_until(a, 4)
    state = a.state_dict()
    with pytest.raises(ResumeLayoutError, match="num_workers=2") as err:
        DataLoader(Counting(40), batch_size=3, num_workers=1).load_state_dict(state)
    assert isinstance(err.value, UCMagicError) and not isinstance(err.value, NotImplementedError)


def test_tar_shards_map_style_shuffled_resume_with_workers_delivers_exactly_the_rest(tmp_path):
    from ucmagic import TarShards, pack
    from ucmagic.testing import make_files

    src, out = str(tmp_path / "src"), str(tmp_path / "tars")
    make_files(src, 300, 40, per_dir=100)
    pack(src, out, shard_size="16KB", progress=False)

    def make(nw):
        return DataLoader(TarShards(out, cache_dir=str(tmp_path / "c")), batch_size=16, shuffle=True,
                          num_workers=nw, collate_fn=list)

    a = make(2)
    _epoch_of(a)  # epoch 0, then 7 batches of epoch 1
    part = [s["__key__"] for s in _first(a, 7)]
    b = make(1)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    rest = [s["__key__"] for x in b for s in x]
    assert len(part) == 112 and len(rest) == 188 and len(set(part + rest)) == 300


def test_a_loader_rebuilt_from_anothers_attributes_keeps_its_workers_when_the_old_one_is_collected():
    """Lightning re-creates a loader to add a DistributedSampler and copies the attributes the old
    one's __init__ set into it; the old one's finaliser then stopped the new one's persistent workers
    (``Queue is closed`` at the next epoch, under DDP)."""
    import gc

    old = DataLoader(_Items(40), batch_size=8, num_workers=2)
    new = DataLoader(_Items(40), batch_size=8, num_workers=2)
    plain = set(vars(torch.utils.data.DataLoader(_Items(40), batch_size=8)))
    new.__dict__.update({k: v for k, v in vars(old).items() if k not in plain})
    assert sorted(int(i) for b in new for i in b) == list(range(40))
    del old
    gc.collect()
    assert sorted(int(i) for b in new for i in b) == list(range(40))


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_a_loader_over_a_wrapper_has_the_length_of_the_epoch_it_delivers(tmp_path, workers):
    """Trainers that count an epoch's steps (HF Trainer, Lightning) need a length; the wrapper has none."""
    from ucmagic.testing import make_files

    root = str(tmp_path / "vol")
    make_files(root, 101, 64, per_dir=50)
    loader = DataLoader(_PathsToRel(UCVolumeDataset(root, shuffle=True)), batch_size=8, num_workers=workers,
                        collate_fn=list)
    assert len(loader) == sum(1 for _ in loader)
    part = _first(loader, 3)
    state = loader.state_dict()
    again = DataLoader(_PathsToRel(UCVolumeDataset(root, shuffle=True)), batch_size=8, num_workers=workers,
                       collate_fn=list)
    again.load_state_dict(state)
    assert len(again) == len(loader)  # a whole epoch's, also while a resumed one delivers the rest
    assert len(part) + len(_epoch_of(again)) == 101


def test_what_other_code_reads_of_the_loader_is_the_users_collate_fn(tree):
    """HF Accelerate rebuilt loaders from ``loader.collate_fn``, which was ucmagic's record-carrying
    wrapper: ``TypeError: Can only concatenate tensors but got <class 'ucmagic.telemetry.BatchItems'>``."""
    root, names = tree
    loader = DataLoader(UCVolumeDataset(root), batch_size=8, num_workers=2, collate_fn=list)
    assert loader.collate_fn is list
    got = [b for b in loader]
    assert all(type(b) is list for b in got) and sorted(rels(got)) == sorted(names)
    assert loader.collate_fn is list
    assert sum(len(loader.stats.batch_files(b)) for b in range(len(got))) == 120  # the records still arrive


def test_under_lightning_the_batch_its_fetcher_holds_ahead_is_not_counted_as_received():
    """Lightning's fit loop takes one batch ahead of an unsized loader (to know which batch is last);
    a checkpoint then counted it as trained and the resume skipped it (one batch per rank lost)."""
    def start(loader):
        return iter(loader)

    from_lightning = types.FunctionType(start.__code__, {"__name__": "lightning.pytorch.utilities.combined_loader",
                                                         "__builtins__": __builtins__, "iter": iter})
    a = DataLoader(Counting(40), batch_size=4, num_workers=0)
    it = from_lightning(a)
    trained = [next(it).tolist() for _ in range(3)]
    next(it)  # fetched ahead, not trained yet
    state = a.state_dict()
    assert state["batches"] == 3
    b = DataLoader(Counting(40), batch_size=4, num_workers=0)
    b.load_state_dict(state)
    assert sorted(sum(trained, []) + [int(i) for x in b for i in x]) == list(range(40))
    plain = DataLoader(Counting(40), batch_size=4, num_workers=0)
    pit = iter(plain)
    for _ in range(4):
        next(pit)
    assert plain.state_dict()["batches"] == 4  # a plain loop has used every batch it received


# ------------------------------------------------------------------ issue 40: map-style resume on another world size

def _model_shares(order: list[int], world: int) -> list[list[int]]:
    """The pure model of one epoch of a map-style dataset under ucmagic.DataLoader: the epoch's order
    (one permutation on every rank) in contiguous shares, rank r the r-th; every rank the same count
    with several ranks (the short share is padded from the start of the order)."""
    n = len(order)
    if world == 1:
        return [list(order)]
    c = -(-n // world)
    return [[order[p % n] for p in range(r * c, (r + 1) * c)] if n else [] for r in range(world)]


def _run_ranks_map(monkeypatch, n, bs, world, workers, k, state=None):
    """One loader per simulated rank (RANK/WORLD_SIZE), each takes ``k`` batches (all with None);
    then every rank's state_dict(), its gather of what each rank received faked in-process."""
    from ucmagic.loading import loader as loader_mod

    loaders, got = [], []
    for r in range(world):
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        d = DataLoader(_Items(n), batch_size=bs, shuffle=True, num_workers=workers, persistent_workers=False,
                       multiprocessing_context="fork" if workers else None, generator=torch.Generator().manual_seed(9))
        if state is not None:
            d.load_state_dict(state)
        mine = []
        for i, b in enumerate(d):
            mine += [int(x) for x in b]
            if k is not None and i + 1 == k:
                break
        loaders.append(d)
        got.append(mine)
    if k is None:
        return got, None
    counts: list[int] = []
    for record in (True, False):
        for r, d in enumerate(loaders):
            monkeypatch.setenv("RANK", str(r))
            monkeypatch.setattr(loader_mod, "all_gather_ints",
                                lambda mine, w: (counts.extend(mine), mine * w)[1] if record else list(counts))
            state = d.state_dict()
    return got, json.loads(json.dumps(state))


@given(n=st.integers(1, 40), bs=st.integers(1, 5), world=st.integers(1, 3), world_after=st.integers(1, 3),
       workers=st.integers(0, 2), workers_after=st.integers(0, 2), data=st.data())
@settings(max_examples=int(os.environ.get("UCMAGIC_MAP_RESUME_EXAMPLES", "12")), deadline=None,
          suppress_health_check=list(HealthCheck))
def test_map_style_resume_on_another_world_size_delivers_exactly_the_rest(monkeypatch, n, bs, world, world_after,
                                                                          workers, workers_after, data):
    """Issue 40: a map-style dataset under ucmagic.DataLoader (no sampler=) saved on ``world`` ranks after
    ``k`` batches per rank and resumed on ``world_after`` ranks (other num_workers too) delivers exactly the
    items no rank received before, each once but for the padding that evens out the ranks; when nothing was
    left (saved at the last batch, the loop still running), the resumed iteration is the epoch's empty rest, as
    torchdata's StatefulDataLoader resumes. Checked against the pure model (_model_shares) of both epochs' split."""
    first, _ = _run_ranks_map(monkeypatch, n, 1, world, 0, None)  # the whole epoch, to learn its order
    order = [x for share in first for x in share][:n] if world > 1 else first[0]
    assert _model_shares(order, world) == first  # the split is the model's
    per_rank = -(-len(first[0]) // bs)
    k = data.draw(st.integers(1, max(1, per_rank)), label="batches per rank before the save")
    before, state = _run_ranks_map(monkeypatch, n, bs, world, workers, k)
    received = {x for share in _model_shares(order, world) for x in share[:k * bs]}
    assert {x for b in before for x in b} == received
    after, _ = _run_ranks_map(monkeypatch, n, bs, world_after, workers_after, None, state)
    rest = [x for x in order if x not in received]
    if not rest:  # saved at the epoch's last batch: the resumed iteration is its empty rest
        assert state["epoch"] == 0 and state["pool"] == [] and not state["complete"]
        assert after == [[] for _ in range(world_after)]
        return
    assert sorted(set(x for a in after for x in a)) == sorted(rest)
    assert _model_shares(rest, world_after) == after  # in the rest's order, split as a fresh epoch is


def test_map_style_with_your_own_sampler_on_another_world_size_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    sampler = torch.utils.data.DistributedSampler(_Items(30), num_replicas=2, rank=0, seed=1)
    a = DataLoader(_Items(30), batch_size=4, sampler=sampler, num_workers=0)
    run_until(a, 2)
    from ucmagic.loading import loader as loader_mod
    monkeypatch.setattr(loader_mod, "all_gather_ints", lambda mine, w: list(mine) * w)
    state = a.state_dict()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ResumeLayoutError, match="DistributedSampler.*resume on 2 ranks"):
        DataLoader(_Items(30), batch_size=4, sampler=torch.utils.data.DistributedSampler(
            _Items(30), num_replicas=3, rank=0), num_workers=0).load_state_dict(state)
