"""The advisor (issue 45 item 3): one recorded/synthetic workload per bottleneck kind, the model's
arithmetic, and properties over generated stage times (hypothesis)."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ucmagic import DataLoader
from ucmagic.loading.advise import EpochTimes, Measured, advise, compute_after, epoch_model


def epoch(n=100, *, fetch=0.0, user=0.0, collate=0.0, compute=0.01, wait=0.0, misses=0, items=None, p99=None):
    """Per-batch seconds times ``n`` batches."""
    return EpochTimes(compute=compute * n, wait=wait * n, fetch=fetch * n, user=user * n, collate=collate * n,
                      batches=float(n), misses=misses, items=items if items is not None else 4 * n,
                      wait_p99=p99 if p99 is not None else wait, first_wait=wait)


def kinds(advice):
    return [a.kind for a in advice]


def test_loading_is_not_the_bottleneck_when_the_loop_hardly_waits():
    got = advise(Measured([epoch(fetch=0.004, compute=0.05, wait=0.001)], num_workers=2, prefetch_factor=4, cores=4))
    assert kinds(got) == ["none"] and "not the bottleneck" in str(got[0]) and "2%" in str(got[0])


def test_decode_bound_asks_for_workers_up_to_the_cores():
    # 1 worker, 40 ms of decoding per batch, the loop's own 10 ms: 4 workers on 4 cores keep up
    m = Measured([epoch(user=0.04, compute=0.01, wait=0.03)], num_workers=1, prefetch_factor=4, cores=4)
    top = advise(m)[0]
    assert top.kind == "workers" and top.settings == {"num_workers": 4}
    assert "decode-bound" in top.because and "your code 40.0 ms" in top.because and "4 cores" in top.because
    assert top.predicted_s == pytest.approx(100 * 0.04 / (4 - 0.25))  # the loop keeps a quarter of a core busy
    assert top.now_s == pytest.approx(4.0)


def test_io_bound_asks_for_more_workers_than_cores():
    m = Measured([epoch(fetch=0.08, user=0.001, compute=0.01, wait=0.03)], num_workers=2, prefetch_factor=4, cores=2)
    top = advise(m)[0]
    assert top.kind == "workers" and top.settings["num_workers"] > 2 and "I/O-bound" in top.because


def test_bursty_waits_with_workers_that_keep_up_ask_for_a_deeper_prefetch():
    m = Measured([epoch(fetch=0.01, user=0.005, compute=0.02, wait=0.01, p99=0.3)], num_workers=2,
                 prefetch_factor=2, cores=2)
    got = advise(m)
    assert "prefetch" in kinds(got)
    pf = got[kinds(got).index("prefetch")]
    assert pf.settings == {"prefetch_factor": 4} and "p99 300 ms" in pf.because


def test_refetches_ask_for_a_larger_cache_limit():
    cold = epoch(fetch=0.05, compute=0.01, wait=0.04, misses=400)
    later = epoch(fetch=0.05, compute=0.01, wait=0.04, misses=400)
    m = Measured([cold, later], num_workers=2, prefetch_factor=4, cores=2, cache_limit=10**9,
                 dataset_bytes=3 * 10**9, refetches=400, later_misses=400)
    got = advise(m)
    assert "cache_limit" in kinds(got)
    c = got[kinds(got).index("cache_limit")]
    assert "3.00 GB" in c.change and "now 1.00 GB" in c.change and "400 of 400" in c.because
    assert c.predicted_s < c.now_s


def test_a_cold_first_epoch_asks_for_warm():
    cold = epoch(fetch=0.1, compute=0.01, wait=0.09, misses=400)
    warm = epoch(fetch=0.001, compute=0.01, wait=0.0005, misses=0)
    got = advise(Measured([cold, warm], num_workers=2, prefetch_factor=4, cores=2))
    w = got[kinds(got).index("warm")]
    assert w.now_s == pytest.approx(10.0) and w.predicted_s < 2.0 and "missed 400 of 400" in w.because


def test_small_files_whose_opens_dominate_ask_for_packing():
    cold = epoch(fetch=0.2, compute=0.01, wait=0.19, misses=400)  # 50 ms per 16 KB file
    got = advise(Measured([cold], num_workers=2, prefetch_factor=4, cores=2, mean_file_bytes=16384))
    p = got[kinds(got).index("pack")]
    assert "16 KB" in p.because and "50.0 ms" in p.because and p.predicted_s < 0.5 * p.now_s


def test_decode_bound_on_every_core_says_so():
    m = Measured([epoch(user=0.04, compute=0.001, wait=0.02)], num_workers=2, prefetch_factor=4, cores=2)
    got = advise(m)
    assert kinds(got) == ["limit"] and "4 cores" in got[0].change
    assert got[0].settings == {"cores": 4, "num_workers": 4}  # what the prediction assumed, to follow it


def test_the_model_runs_everything_in_the_loop_without_workers():
    e = epoch(fetch=0.01, user=0.02, collate=0.001, compute=0.005)
    assert epoch_model(e, 0, 4) == pytest.approx(100 * 0.036)
    assert epoch_model(e, 4, 2) == pytest.approx(100 * max(0.005, 0.031 / 4, 0.021 / 2))


per_batch = st.floats(0.0, 0.2)


@given(st.lists(st.tuples(per_batch, per_batch, per_batch, per_batch, per_batch), min_size=1, max_size=3),
       st.integers(0, 8), st.sampled_from([2, 4]), st.integers(1, 16))
def test_every_advice_predicts_a_saving_and_they_come_best_first(epochs, workers, prefetch, cores):
    m = Measured([epoch(fetch=f, user=u, collate=k, compute=c, wait=w) for f, u, k, c, w in epochs],
                 num_workers=workers, prefetch_factor=prefetch, cores=cores)
    got = advise(m)
    last = m.epochs[-1]
    if last.total <= 0:
        assert got == []
        return
    assert got, "a measured epoch always gets an answer"
    changes = [a for a in got if a.kind not in ("none", "limit")]
    assert all(a.predicted_s < a.now_s for a in changes)
    savings = [a.now_s - a.predicted_s for a in changes]
    assert savings == sorted(savings, reverse=True)
    assert all(a.because and str(a).startswith(a.change) for a in got)


class _Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.01)
        return i


def test_recorded_stats_of_a_decode_bound_loop_ask_for_workers_also_from_the_cli(tmp_path):
    loader = DataLoader(_Slow(), batch_size=4, num_workers=0, log_to_mlflow=False)
    for _ in loader:
        pass
    got = loader.stats.advise()
    assert got[0].kind in ("workers", "limit") and "your code" in got[0].because
    path = loader.stats.save(tmp_path / "stats.json")
    out = subprocess.run([sys.executable, "-m", "ucmagic", "advise", path, "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert rows[0]["kind"] == got[0].kind and rows[0]["predicted_s"] == pytest.approx(got[0].predicted_s)


def test_no_warming_when_the_cache_cannot_hold_the_dataset():
    cold = epoch(fetch=0.1, compute=0.01, wait=0.09, misses=400)
    m = Measured([cold, cold], num_workers=2, prefetch_factor=4, cores=2, cache_limit=10**9,
                 dataset_bytes=4 * 10**9, refetches=400, later_misses=400)
    assert "warm" not in kinds(advise(m)) and "cache_limit" in kinds(advise(m))


def test_a_changed_first_epoch_keeps_only_the_startup_beyond_making_its_first_batch():
    cold = epoch(fetch=0.1, compute=0.01, wait=0.09, misses=400)
    cold.first_wait, cold.first_made = 2.5, 0.5  # 2 s of starting workers, 0.5 s making the batch
    warm = epoch(fetch=0.001, compute=0.01, wait=0.0005, misses=0)
    w = advise(Measured([cold, warm], num_workers=2, prefetch_factor=4, cores=2))
    top = w[kinds(w).index("warm")]
    # the warm epoch as measured (1.05 s beyond its own 0.5 ms startup) plus epoch 0's startup
    assert top.predicted_s == pytest.approx(100 * (0.01 + 0.0005) - 0.0005 + 2.0)


def test_merged_ranks_are_advised_on_the_rank_the_others_wait_for(tmp_path):
    from ucmagic import LoaderStats

    def part(rank, wait):
        n = 10
        return {"version": 1, "rank": rank, "fetch_s": [wait] * n, "compute_s": [0.01] * n, "count": [0] * n,
                "epoch": [0] * n, "worker": [0] * n, "misses": [0] * n, "nbytes": [0] * n, "item_index": [],
                "item_fetch_s": [], "files": {}, "counters": None, "truncated": False,
                "stage_fetch_s": [0.0] * n, "stage_user_s": [wait] * n, "stage_collate_s": [0.0] * n,
                "setup": {"cores": 4, "num_workers": 1, "prefetch_factor": 2}}

    merged = LoaderStats.merge([LoaderStats.from_dict(part(0, 0.001)), LoaderStats.from_dict(part(1, 0.04))])
    top = merged.advise()[0]
    assert top.kind == "workers" and top.now_s == pytest.approx(10 * 0.05)  # rank 1's epoch, not the sum


def test_taking_work_off_the_workers_gives_the_loop_its_cores_back():
    # the loop's compute took 10 ms per batch, 6 ms of it on the CPU: 4 ms waiting for a core the copies held
    e = epoch(fetch=0.05, user=0.001, collate=0.001, compute=0.010, wait=0.04, misses=400)
    e.compute_cpu = 0.006 * 100
    assert compute_after(e, e.fetch) == pytest.approx(e.compute)  # nothing changes: the measured compute
    assert compute_after(e, 0.0) == pytest.approx(100 * (0.006 + 0.004 * 0.002 / 0.052))
    e.compute_cpu = None  # unknown (no workers, stats saved before): the measured compute
    assert compute_after(e, 0.0) == pytest.approx(e.compute)


def test_a_larger_cache_limit_predicts_hits_with_the_loops_cpu_time_and_the_startup_only():
    tight = epoch(fetch=0.08, user=0.001, collate=0.0, compute=0.007, wait=0.04, misses=400)
    tight.compute_cpu = 0.005 * 100
    tight.first_wait, tight.first_made = 0.3, 0.25  # the first batch's wait: mostly copying it
    m = Measured([tight, tight], num_workers=2, prefetch_factor=4, cores=2, cache_limit=10**9,
                 dataset_bytes=2 * 10**9, refetches=400, later_misses=400)
    c = next(a for a in advise(m) if a.kind == "cache_limit")
    loop = 0.005 + 0.002 * 0.001 / 0.081  # per batch: the CPU time and what is left of the contention
    assert c.predicted_s == pytest.approx(100 * loop + 0.05)
    assert "7.0 ms per batch, 5.0 ms of it on the CPU" in c.because


def test_the_loops_cpu_per_epoch_is_recorded_saved_and_merged(tmp_path):
    from ucmagic import LoaderStats

    loader = DataLoader(list(range(64)), batch_size=8, num_workers=0, log_to_mlflow=False)
    for _ in range(2):
        for _ in loader:
            end = time.thread_time() + 0.002
            while time.thread_time() < end:
                pass
    cpu = loader.stats.setup["loop_cpu_s"]
    assert set(cpu) == {"0", "1"} and all(v >= 8 * 0.002 for v in cpu.values())
    again = LoaderStats.load(loader.stats.save(tmp_path / "s.json"))
    assert again.setup["loop_cpu_s"] == pytest.approx(cpu)
    other = LoaderStats.from_dict({**loader.stats.to_dict(), "rank": 1})
    other.setup["loop_cpu_s"] = {"0": 100.0}
    merged = LoaderStats.merge([again, other])
    assert merged.setup["loop_cpu_s"] == pytest.approx({"0": 100.0, "1": cpu["1"]})  # the busiest rank's
    loader.stats.reset()
    assert "loop_cpu_s" not in loader.stats.setup


def test_packing_predicts_one_open_per_shard_from_the_measured_copy_latency():
    # 2,400 files of 16 KB (39 MB), each copy took 100 ms: 2 workers stream 2 shards each
    cold = epoch(n=75, fetch=0.2, compute=0.005, wait=0.19, misses=2400, items=2400)
    m = Measured([cold], num_workers=2, prefetch_factor=4, cores=2, mean_file_bytes=16384,
                 dataset_bytes=2400 * 16384, miss_latency=0.1)
    p = next(a for a in advise(m) if a.kind == "pack")
    shard = 2400 * 16384 / 4
    assert p.settings == {"pack": True, "shard_size": int(shard)}
    assert "shards of 10MB" in p.change and "4 shards of 10 MB, each opened in 100 ms" in p.because
    per_worker = 2 * (0.1 - 16384 / 100e6 + shard / 100e6)  # two opens and two shards' bytes
    startup = 0.19  # the first batch's wait, nothing of it making the batch (no stage times here)
    assert p.predicted_s == pytest.approx(75 * max(0.005, per_worker * 2 / 75 / 2) + startup)


def test_the_measured_copy_latency_is_the_median_miss_of_the_first_epoch():
    import numpy as np

    from ucmagic.loading.stats_analysis import first_miss_latency
    from ucmagic.telemetry import ItemLog

    log = ItemLog()

    def batch(epoch, fetch):  # fetch seconds per item, negative for a hit
        log.add(epoch, 0, np.arange(len(fetch), dtype=np.int32).tobytes(), np.array(fetch, np.float32).tobytes())

    batch(0, [0.05, 0.04, -0.001])  # epoch 0: two misses of 50 and 40 ms, a hit
    batch(0, [0.06, -0.002])
    batch(1, [0.5, 0.5])  # later epochs do not count
    epochs = np.array([0, 0, 1])
    assert first_miss_latency(log.arrays(), epochs) == pytest.approx(0.05)
    hits = ItemLog()
    hits.add(0, 0, np.arange(2, dtype=np.int32).tobytes(), np.array([-0.001, -0.001], np.float32).tobytes())
    assert first_miss_latency(hits.arrays(), np.array([0])) is None  # no misses: unknown
    assert first_miss_latency(ItemLog().arrays(), np.array([], dtype=int)) is None
