"""Stage times (issue 45 item 1): where each batch's time goes in the process that produces it —
ucmagic's fetch, the user's code, collate — measured against workloads with known sleeps in each,
under a user's wrapper of a UCVolumeDataset and with a map-style dataset, with and without workers.

Sleeps only give lower bounds (a busy machine makes them longer, never shorter), so each test puts
its sleeps where a stage must hold at least them, and checks that another stage did not take them."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch

from ucmagic import DataLoader, LoaderStats, UCVolumeDataset
from ucmagic.loading.mlflow_sink import window_metrics
from ucmagic.testing import make_files

N, BS = 8, 4  # items and batch size: two batches per epoch


class Decode(torch.utils.data.IterableDataset):
    """The seeds' pattern: a user's wrapper decoding what a UCVolumeDataset yields (``sleep`` s per item)."""

    def __init__(self, inner: UCVolumeDataset, sleep: float) -> None:
        self.inner, self.sleep = inner, sleep

    def __iter__(self):
        for path in self.inner:
            if self.sleep:
                time.sleep(self.sleep)
            yield len(path)


class MapSleep(torch.utils.data.Dataset):
    def __init__(self, n: int, sleep: float) -> None:
        self.n, self.sleep = n, sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        time.sleep(self.sleep)
        return i


class SlowCollate:
    def __init__(self, sleep: float) -> None:
        self.sleep = sleep

    def __call__(self, batch):
        if self.sleep:
            time.sleep(self.sleep)
        return batch


def _volume(tmp_path, open_ms: float) -> UCVolumeDataset:
    src = str(tmp_path / "src")
    make_files(src, N, 256, per_dir=50)
    return UCVolumeDataset(f"slow://{src}", cache_dir=str(tmp_path / "cache"), prefetch=1,
                           storage_options={"open_ms": open_ms, "mbps": 0, "list_ms": 0})


def _stages(loader: DataLoader, epochs: int = 1, compute: float = 0.0) -> dict[str, float]:
    for _ in range(epochs):
        for _ in loader:
            if compute:
                time.sleep(compute)
    return loader.stats.breakdown()


WORKERS = [pytest.param(0, None, id="main"), pytest.param(2, "fork", id="fork")]


@pytest.mark.parametrize("workers,ctx", WORKERS)
def test_a_wrappers_fetch_is_timed_inside_and_is_not_the_users(tmp_path, workers, ctx):
    """30 ms per open, one file in flight, nothing else slow: the wait is ucmagic's fetch (timed
    inside the wrapped dataset), not the wrapper's code (the records of a wrapper were dropped before)."""
    loader = DataLoader(Decode(_volume(tmp_path, 30), 0.0), batch_size=BS, num_workers=workers,
                        multiprocessing_context=ctx, collate_fn=list, log_to_mlflow=False)
    b = _stages(loader)
    assert b["batches"] == N / BS
    assert b["fetch"] >= 0.5 * N * 0.03  # every open waits 30 ms; one file in flight
    assert b["user"] < 0.5 * b["fetch"]
    assert sum(len(loader.stats.batch_files(i)) for i in range(2)) == N  # the wrapper's items have records
    assert loader.stats.misses == N


@pytest.mark.parametrize("workers,ctx", WORKERS)
def test_a_wrappers_decode_and_collate_land_in_their_own_stages(tmp_path, workers, ctx):
    loader = DataLoader(Decode(_volume(tmp_path, 0), 0.02), batch_size=BS, num_workers=workers,
                        multiprocessing_context=ctx, collate_fn=SlowCollate(0.03), log_to_mlflow=False)
    _stages(loader, epochs=2)
    b = loader.stats.breakdown(epoch=max(loader.stats.breakdown(per_epoch=True)))  # the warm epoch: fetch is lookups
    assert b["user"] >= N * 0.02 and b["collate"] >= 2 * 0.03
    assert b["fetch"] < 0.5 * b["user"]
    table = loader.stats.batches()
    assert (table["stage_collate_s"] >= 0.03).all() and (table["stage_user_s"] >= BS * 0.02).all()


@pytest.mark.parametrize("workers,ctx", WORKERS)
def test_a_map_style_getitem_is_the_users_code(workers, ctx):
    loader = DataLoader(MapSleep(N, 0.02), batch_size=BS, num_workers=workers, multiprocessing_context=ctx,
                        collate_fn=SlowCollate(0.03), log_to_mlflow=False)
    b = _stages(loader)
    assert b["user"] >= N * 0.02 and b["collate"] >= 2 * 0.03 and b["fetch"] == 0
    assert b["wait_user"] + b["wait_collate"] + b["wait_fetch"] == pytest.approx(b["wait"])


def test_a_workers_idle_time_is_in_no_stage():
    """The loop computes 150 ms per batch, the worker makes one in about 20: it waits for room in
    between, and that wait is no stage (it was counted as the user's code before the batch's start
    was marked where its index arrives)."""
    loader = DataLoader(MapSleep(6 * BS, 0.005), batch_size=BS, num_workers=1, multiprocessing_context="fork",
                        prefetch_factor=1, log_to_mlflow=False)
    _stages(loader, compute=0.15)
    user = loader.stats.batches()["stage_user_s"][2:]  # the first two were made before the loop computed
    assert np.median(user) < 0.1


def test_breakdown_per_epoch_and_a_batch_without_stage_times():
    st = LoaderStats.from_dict({
        "version": 1, "rank": 0, "fetch_s": [0.4, 0.1, 0.2], "compute_s": [0.0, 0.5, 0.5], "count": [0, 0, 0],
        "epoch": [0, 0, 1], "worker": [0, 1, 0], "batch_rank": [0, 0, 0], "misses": [0, 0, 0], "nbytes": [0, 0, 0],
        "item_index": [], "item_fetch_s": [], "files": {}, "counters": None, "truncated": False,
        "stage_fetch_s": [0.3, None, 0.0], "stage_user_s": [0.1, None, 0.2], "stage_collate_s": [0.0, None, 0.2]})
    per = st.breakdown(per_epoch=True)
    assert set(per) == {0, 1}
    assert per[0]["wait"] == pytest.approx(0.5) and per[0]["fetch"] == pytest.approx(0.3)
    assert per[0]["wait_fetch"] == pytest.approx(0.4 * 0.75 + 0.1)  # unmeasured batch: its wait is fetch
    assert per[1]["wait_user"] == pytest.approx(0.1) and per[1]["wait_collate"] == pytest.approx(0.1)
    whole = st.breakdown()
    assert whole["compute"] == pytest.approx(1.0) and whole["batches"] == 3
    assert st.breakdown(epoch=1)["user"] == pytest.approx(0.2)


def test_stage_times_survive_save_load_and_merge_with_the_cores(tmp_path):
    loader = DataLoader(MapSleep(N, 0.0), batch_size=BS, num_workers=0, log_to_mlflow=False)
    _stages(loader)
    path = loader.stats.save(tmp_path / "s.json")
    saved = json.loads(open(path).read())
    assert saved["setup"]["cores"] >= 1 and saved["setup"]["num_workers"] == 0
    assert len(saved["stage_user_s"]) == 2 and all(x is not None for x in saved["stage_user_s"])
    back = LoaderStats.load(path)
    assert back.breakdown() == pytest.approx(loader.stats.breakdown())
    merged = LoaderStats.merge([path, path])
    assert merged.breakdown()["user"] == pytest.approx(2 * loader.stats.breakdown()["user"])
    assert merged.setup["ranks"] == 2 and merged.setup["cores"] == saved["setup"]["cores"]
    old = {k: v for k, v in saved.items() if not k.startswith("stage_") and k != "setup"}  # a file from before
    assert LoaderStats.from_dict(old).breakdown()["fetch"] == 0


def test_mlflow_windows_carry_the_mean_stage_seconds():
    m = window_metrics([0.1, 0.3], [0.5, 0.5], [(0.1, 0.2, 0.01), (math.nan, math.nan, math.nan), (0.3, 0.4, 0.03)])
    assert m["stage_fetch_seconds"] == pytest.approx(0.2) and m["stage_user_seconds"] == pytest.approx(0.3)
    assert m["stage_collate_seconds"] == pytest.approx(0.02)
    assert "stage_fetch_seconds" not in window_metrics([0.1], [0.5])


def test_a_spawned_worker_turns_fetch_timing_on_when_it_unpickles_the_collate():
    """Under spawn nothing is inherited: the record-carrying collate_fn (unpickled in each worker
    before it iterates) turns the wrapped dataset's fetch timing on there (a fork inherits it). The
    whole spawn path costs seconds per run; the item records' spawn test covers its transport."""
    import inspect
    import pickle

    from ucmagic import telemetry

    telemetry.set_fetch_timing(False)
    try:
        plain = pickle.loads(pickle.dumps(telemetry.ItemCollate(list, telemetry.StageMode.PLANNED)))
        assert not inspect.isgenerator(telemetry.fetch_timed(iter([1])))  # untimed: the iterator itself
        wrapped = pickle.loads(pickle.dumps(telemetry.ItemCollate(list, telemetry.StageMode.WRAPPER)))
        it = telemetry.fetch_timed(iter([1, 2]))
        assert inspect.isgenerator(it) and list(it) == [1, 2]
        assert plain.mode == telemetry.StageMode.PLANNED and wrapped.inner is list
    finally:
        telemetry.set_fetch_timing(False)


def test_a_batch_start_mark_gives_the_worker_the_index_itself():
    import pickle

    from ucmagic import telemetry

    assert pickle.loads(pickle.dumps(telemetry.BatchStart([3, 1, 2]))) == [3, 1, 2]
    assert pickle.loads(pickle.dumps(telemetry.BatchStart(None))) is None


# ------------------------------------------------------------------ issue 52: shard reads are fetch under any wrapper

class Decoded(torch.utils.data.IterableDataset):
    """A user's wrapper over any stream of samples (its decode takes no time)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __iter__(self):
        for sample in self.inner:
            yield len(sample)


class ByIndex(torch.utils.data.Dataset):
    """A user's map-style dataset reading a shard dataset by index."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> int:
        return len(self.inner[i])


def _shards(tmp_path, name: str = "shards", n: int = N):
    """``n`` small files packed into shards of a few chunks, read through a volume with 30 ms per open."""
    from ucmagic import TarShards, pack

    src = tmp_path / f"{name}-src"
    make_files(str(src), n, 256, per_dir=50)
    pack(str(src), str(tmp_path / name), shard_size=10240, progress=False)
    return TarShards(f"slow://{tmp_path / name}", cache_dir=str(tmp_path / "cache"), chunk_size=4096,
                     storage_options={"open_ms": 30, "mbps": 0, "list_ms": 0})


SHARD_WAYS = {
    "stream under a wrapper": lambda tmp: Decoded(_shards(tmp).stream()),
    "map-style TarShards": lambda tmp: _shards(tmp),
    "a wrapper reading it by index": lambda tmp: ByIndex(_shards(tmp)),
    "a mix under a wrapper": lambda tmp: Decoded(__import__("ucmagic").mix([_shards(tmp, "a").stream(),
                                                                            _shards(tmp, "b").stream()])),
}


@pytest.mark.parametrize("workers,ctx", WORKERS)
@pytest.mark.parametrize("way", list(SHARD_WAYS))
def test_shard_reads_are_fetch_under_any_wrapper(tmp_path, way, workers, ctx):
    """Issue 52: under a wrapper of a TarShards stream the shard reads were "your code" and fetch 0. Every shard
    is a chunk read that waits 30 ms; the user's code takes none: the wait is fetch, in breakdown() and per batch."""
    loader = DataLoader(SHARD_WAYS[way](tmp_path), batch_size=BS, num_workers=workers, multiprocessing_context=ctx,
                        collate_fn=list, log_to_mlflow=False)
    b = _stages(loader)
    assert b["fetch"] >= 0.03 and b["user"] < 0.5 * b["fetch"], b
    table = loader.stats.batches()
    assert (table["stage_fetch_s"] > 0).any()
