"""The advisor (issues 45 and 52, SPEC W4): advice that is right or silent. Pure tests over plain data
(one per rule of the model, properties over generated runs with hypothesis) and a few over real records."""
from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic import DataLoader
from ucmagic.loading import advise as adv
from ucmagic.loading import advise_model as model
from ucmagic.loading.advise import (Advice, EpochTimes, Measured, advise, baseline, compute_after, noise, replay,
                                   threshold)


def epoch(n=100, *, fetch=0.0, user=0.0, collate=0.0, compute=0.01, wait=0.0, misses=0, items=None, p99=None,
          **kw):
    """Per-batch seconds times ``n`` batches; its first batch waited as long as the others (no startup)."""
    return EpochTimes(compute=compute * n, wait=wait * n, fetch=fetch * n, user=user * n, collate=collate * n,
                      batches=float(n), misses=misses, items=items if items is not None else 4 * n,
                      wait_p99=p99 if p99 is not None else wait, first_wait=wait,
                      first_made=fetch + user + collate, **kw)


def kinds(advice):
    return [a.kind for a in advice]


def sure(advice):
    return [a for a in advice if a.sure and a.kind != "none"]


# ------------------------------------------------------------------ one rule each

def test_loading_is_not_the_bottleneck_when_the_loop_hardly_waits():
    got = advise(Measured([epoch(fetch=0.004, compute=0.05, wait=0.001)] * 2, num_workers=2, prefetch_factor=4,
                          cores=4))
    assert kinds(got) == ["none"] and "not the bottleneck" in str(got[0]) and "2%" in str(got[0])
    assert "run of 2 epochs: 10.2 s" in str(got[0])  # the baseline is stated


def test_decode_bound_asks_for_workers_up_to_the_free_cores():
    # 1 worker, 40 ms of your code per batch, the loop's own 10 ms, 4 cores: 4 workers keep up
    e = epoch(user=0.04, compute=0.01, wait=0.03)
    top = advise(Measured([e, e], num_workers=1, prefetch_factor=4, cores=4))[0]
    assert top.kind == "workers" and top.settings == {"num_workers": 4}
    assert "decode-bound: your code is 100% of making a batch" in top.because
    # the loop keeps a quarter of a core: 4 workers on 3.75 cores, each waiting for one 1/15 of the time
    assert top.predicted_s == pytest.approx(2 * 100 * 0.04 * (1 + 1 / 15) / 4)
    assert top.now_s == pytest.approx(8.0) and top.epochs == 2


def test_workers_are_bounded_by_the_cores_actually_free():
    """Other processes held 2 of the 4 cores while the epoch ran (measured: idle + the loader's own CPU)."""
    e = epoch(user=0.04, compute=0.01, wait=0.03, wall=4.0, cpu=0.5, workers_cpu=4.0, idle=3.5)
    top = advise(Measured([e, e], num_workers=1, prefetch_factor=4, cores=4))[0]
    assert model.cores_free(Measured([e], 1, 4, 4), e) == pytest.approx(2.0)
    assert top.kind == "workers" and top.settings == {"num_workers": 2}
    assert "2.0 of 4 cores free to the loader (measured)" in top.because


def test_more_workers_do_not_fetch_more_under_a_rank_read_ahead():
    """Issue 52: a cold pass whose copies set the pace; UCVolumeDataset's read-ahead is the rank's, so 4 or 6
    workers predict the same epoch (and are not advised), while per-stream read-ahead (shards) would speed up."""
    cold = epoch(n=94, fetch=0.156, user=0.001, compute=0.009, wait=0.071, misses=3000, items=3000,
                 miss_latency=0.3)
    m = Measured([cold], num_workers=2, prefetch_factor=4, cores=2, read_ahead="rank", mean_file_bytes=8192,
                 dataset_bytes=3000 * 8192, files=3000)
    p = model.parts(m, cold)
    assert p.fetch_bound and all(model.period(m, p, w) == pytest.approx(model.period(m, p, 2)) for w in (1, 4, 8, 16))
    assert "workers" not in kinds(advise(m))
    streams = Measured([cold], num_workers=2, prefetch_factor=4, cores=2, read_ahead="stream")
    assert model.period(streams, p, 4) == pytest.approx(model.period(streams, p, 2) / 2)


def test_one_cold_pass_never_gets_warm_first_and_warming_counts_its_own_time():
    cold = epoch(n=94, fetch=0.156, user=0.001, compute=0.009, wait=0.071, misses=3000, items=3000,
                 miss_latency=0.3)
    m = Measured([cold], num_workers=2, prefetch_factor=4, cores=2, read_ahead="rank", files=3000)
    assert adv._warm(m, baseline(m)) is None
    # three epochs: warming copies every file at epoch 0's pace first, so it does not pay
    warm = epoch(n=94, fetch=0.0003, user=0.001, compute=0.009, wait=0.0005, items=3000, hit_latency=1e-5)
    m3 = Measured([cold, warm, warm], num_workers=2, prefetch_factor=4, cores=2, read_ahead="rank", files=3000)
    w = adv._warm(m3, baseline(m3))
    assert w is not None and w.cost_s == pytest.approx(94 * 0.157 / 2, rel=0.01)
    assert w.predicted_s > w.now_s and "warm" not in kinds(advise(m3))


def test_every_line_of_a_list_compares_with_the_one_measured_run():
    """Issue 52: one list compared some advice with epoch 0 and some with epoch 1."""
    cold = epoch(n=75, fetch=0.2, compute=0.005, wait=0.19, misses=2400, items=2400, miss_latency=0.1)
    warm = epoch(n=75, fetch=0.001, user=0.03, compute=0.005, wait=0.02, items=2400, hit_latency=1e-5)
    m = Measured([cold, warm], num_workers=1, prefetch_factor=2, cores=4, read_ahead="rank", mean_file_bytes=16384,
                 dataset_bytes=2400 * 16384, files=2400, miss_latency=0.1)
    got = advise(m)
    assert len(got) >= 2 and all(a.now_s == pytest.approx(cold.total + warm.total) for a in got)
    assert all(f"run of 2 epochs {adv._s(a.now_s)} s" in str(a) for a in sure(got))


def test_the_run_is_the_epochs_asked_for_the_later_ones_warm_when_the_cache_holds_them():
    cold = epoch(n=50, fetch=0.2, compute=0.01, wait=0.19, misses=200, items=200, miss_latency=0.2)
    m = Measured([cold], num_workers=2, prefetch_factor=4, cores=2, read_ahead="rank", run_epochs=3,
                 dataset_bytes=200 * 8192, files=200, mean_file_bytes=8192)
    warm = model.warm_epoch(m, cold)
    assert warm < 0.2 * cold.total
    assert baseline(m) == pytest.approx(cold.total + 2 * warm)
    tight = Measured([cold], num_workers=2, prefetch_factor=4, cores=2, read_ahead="rank", run_epochs=3,
                     dataset_bytes=200 * 8192, files=200, mean_file_bytes=8192, cache_limit=100 * 8192)
    assert baseline(tight) == pytest.approx(3 * cold.total)  # a cache too small repeats the epoch as it was
    with pytest.raises(ValueError, match="epochs must be a positive int"):
        from ucmagic import LoaderStats

        LoaderStats().advise(epochs=0)


def test_a_saving_under_the_spread_of_the_warm_epochs_is_not_advised():
    # 1 worker makes a batch in 40 ms, the loop computes 36 and keeps 0.9 of the 2 cores busy: 2 workers share 1.1
    # cores, one every 36.4 ms: 0.73 s saved in all
    a, b = epoch(user=0.04, compute=0.036, wait=0.004), epoch(user=0.04, compute=0.036, wait=0.004)
    steady = Measured([a, b], num_workers=1, prefetch_factor=4, cores=2)
    top = advise(steady)[0]
    assert top.kind == "workers" and baseline(steady) - top.predicted_s == pytest.approx(200 * (0.04 - 0.08 / 2.2))
    b.wait += 0.6  # the second warm epoch took 0.6 s longer: a spread of 0.85 s over the run, more than it saves
    got = advise(Measured([a, b], num_workers=1, prefetch_factor=4, cores=2))
    assert not sure(got) and "the spread of its 2 warm epochs" in str(got[0])


def _shard_run(idle=True):
    """bench/advise.py's ``shards`` (a TarShards stream under a wrapper decoding each sample, 256 KiB shards, 100 ms
    per open, 2 workers, 94 batches of 32): its records, taken beside other work (idle cores made up where
    ``idle``: the run alone). The cold epoch copied 104 shards (a miss per shard: 3% of its samples)."""
    n = 94
    free = {"idle": 1.6 * 3.31} if idle else {"idle": 0.0}
    cold = epoch(n=n, fetch=0.0571, user=0.0095, collate=0.0003, compute=0.008, wait=0.0266, misses=104, items=3000,
                 miss_latency=0.055, wall=3.31, cpu=0.57, workers_cpu=1.04, compute_cpu=0.56, **free)
    warm = epoch(n=n, fetch=0.0017, user=0.0112, collate=0.0001, compute=0.009, wait=0.0026, items=3000,
                 hit_latency=1e-5, wall=1.1, cpu=0.54, workers_cpu=0.81, compute_cpu=0.53,
                 idle=1.0 if idle else 0.0)
    return Measured([cold, warm], num_workers=2, prefetch_factor=4, cores=2, dataset="SampleStream",
                    mean_file_bytes=8192, miss_latency=0.055, read_ahead="stream")


def test_a_shard_streams_cold_epoch_is_told_by_its_fetch_and_the_noise_is_the_warm_epochs_spread():
    """Issue 52: the shards run's cold epoch (104 shard copies over 3,000 samples: "few misses per item") was
    taken for a warm one, and its spread with the warm epoch (3.3 s against 1.1) for the noise, which silenced
    everything. Its shard reads are fetch: 57 ms a batch against 1.7 in the warm epoch."""
    m = _shard_run()
    cold, warm = m.epochs
    assert model.warm_epochs(m) == [warm]
    assert "warm epochs" not in threshold(m)[1] and noise(m) < 1.0
    again = epoch(n=94, fetch=0.0025, user=0.0112, collate=0.0001, compute=0.009, wait=0.0035, items=3000)
    steady = Measured([warm, again], num_workers=2, prefetch_factor=4, cores=2)  # warm epochs a little apart
    assert model.warm_epochs(steady) == [warm, again]
    few = epoch(n=94, fetch=0.0017, user=0.0112, compute=0.009, wait=0.0026, misses=100, items=3000)
    assert model.warm_epochs(Measured([warm, few], 2, 4, 2)) == [warm, few]  # a few misses, no more fetch: warm


def test_more_workers_for_a_shard_streams_cold_epoch_each_stream_reading_ahead():
    """The shards run, its cold epoch told apart: each worker's stream reads its shards ahead on its own, so 4
    workers copy twice as many at once; the advice says which epoch it saves in and why (its fetch), and the
    warm epoch's decode is no reason. Followed (beside other work): 2.90 s (1.85 + 1.05) for 4.79 s."""
    m = _shard_run()
    top = advise(m)[0]
    assert top.kind == "workers" and top.settings == {"num_workers": 4} and top.sure
    assert "epoch 0: I/O-bound (fetch): each worker stream reads ahead on its own" in top.because
    cold, warm = m.epochs
    assert model.predict(m, cold, 4) == pytest.approx(cold.total / 2, rel=0.1)  # the copies twice as wide
    assert model.predict(m, warm, 4) == pytest.approx(warm.total, rel=0.1)  # the warm epoch: as it was
    assert abs(top.predicted_s - 2.90) <= 0.25 * 2.90


def test_cores_or_cheaper_code_never_predicts_a_saving_in_a_fetch_bound_epoch():
    """Issue 52 (the reverted fix): "make your per-item code cheaper, or use 4 cores: 4.1 s -> 2.5 s" over a cold
    epoch whose copies set the pace. More cores and cheaper code do not copy faster: such an epoch stays as
    measured, and the advice stands only on the epochs the user's code makes."""
    e = epoch(n=94, fetch=0.1, user=0.0112, compute=0.009, wait=0.08, misses=3000, items=3000, miss_latency=0.3)
    busy = epoch(n=94, user=0.04, compute=0.001, wait=0.02, items=3000)
    m = Measured([e, busy], num_workers=2, prefetch_factor=4, cores=2, read_ahead="stream")  # a shard stream
    assert model.parts(m, e).fetch_bound and not model.parts(m, busy).fetch_bound
    lim = adv._limit(m, baseline(m))
    assert lim is not None and lim.predicted_s >= e.total + 0.9 * model.predict(m, busy, 4, cores=4.0)
    fetch_only = Measured([e, e], num_workers=2, prefetch_factor=4, cores=2, read_ahead="stream")
    assert "limit" not in kinds(advise(fetch_only))


def test_a_tiny_run_gets_no_advice():
    """Issue 52: the README's quick start (epochs of 15 ms) got two pieces of advice."""
    cold = epoch(n=4, fetch=0.05, compute=0.001, wait=0.04, misses=200, items=200, miss_latency=0.01)
    warm = epoch(n=4, fetch=0.001, compute=0.001, wait=0.002, items=200, hit_latency=1e-5)
    m = Measured([cold, warm, warm], num_workers=2, prefetch_factor=4, cores=2, read_ahead="rank",
                 mean_file_bytes=4096, dataset_bytes=200 * 4096, files=200, miss_latency=0.01)
    got = advise(m)
    assert not sure(got) and kinds(got) == ["none"] and threshold(m)[1] == "the least saving advised"


def test_cache_limit_advice_names_what_a_full_epoch_needs_not_the_data_size():
    """Issue 52: `cache_limit >= 0.16 GB` (exactly the data) still evicted 38 files an epoch."""
    e = epoch(n=38, fetch=0.05, compute=0.005, wait=0.04, misses=1200, items=1200, miss_latency=0.02)
    m = Measured([e, e, e], num_workers=2, prefetch_factor=4, cores=2, cache_limit=60 * 10**6,
                 dataset_bytes=157 * 10**6, files=1200, mean_file_bytes=157 * 10**6 / 1200, refetches=2400,
                 later_misses=2400, read_ahead="rank")
    c = next(a for a in advise(m) if a.kind == "cache_limit")
    need = model.working_set(m)
    assert need > 1.1 * 157 * 10**6 and c.settings == {"cache_limit": need}
    assert f"cache_limit >= {adv._size(need)} (now 0.06 GB)" == c.change and "plus 10% headroom" in c.because
    assert c.predicted_s == pytest.approx(e.total + 2 * model.warm_epoch(m, e))


def test_a_knob_just_followed_is_not_advised_again_unless_it_measured_a_saving():
    """Issue 52: prefetch_factor=8 was followed without a saving; it then advised 16."""
    made = [0.3 if i % 20 == 0 else 0.01 for i in range(200)]  # a slow batch every 20: bursts the depth absorbs
    comp = [0.0] + [0.04] * 199

    def run(prefetch, total):
        e = epoch(n=200, fetch=0.02, compute=0.04 * 199 / 200, wait=total / 200 - 0.04 * 199 / 200, made=made,
                  computes=comp)
        return Measured([e, e], num_workers=2, prefetch_factor=prefetch, cores=4)

    shallow = run(1, replay(made, comp, 2, 1))
    top = advise(shallow)[0]
    assert top.kind == "prefetch" and top.settings == {"prefetch_factor": 4}
    assert top.predicted_s == pytest.approx(2 * replay(made, comp, 2, 4))  # the pipeline replayed at depth 4
    followed = run(2, replay(made, comp, 2, 1))  # a deeper prefetch was followed, and the run was no faster
    assert "prefetch" in kinds(advise(followed))  # on its own, this run would be advised a deeper one again
    assert "prefetch" not in kinds(advise(followed, shallow, "prefetch"))
    helped = run(1, replay(made, comp, 2, 1) + 2.0)  # the run before took 2 s longer an epoch: it did help
    assert "prefetch" in kinds(advise(followed, helped, "prefetch"))


def test_decode_bound_and_cheaper_code_need_the_users_code_to_be_a_measured_share():
    """Issue 52: with 0 workers a loop whose code took 1 ms of 31 was called decode-bound; the panel said
    "make your per-item code cheaper" while showing "your code 0.0 ms"."""
    e = epoch(fetch=0.025, user=0.001, compute=0.005, wait=0.026, misses=100, items=400, miss_latency=0.05)
    for workers in (0, 2):
        got = advise(Measured([e, e], num_workers=workers, prefetch_factor=4 if workers else 0, cores=2))
        assert all("decode-bound" not in a.because for a in got) and "limit" not in kinds(got)
    busy = epoch(user=0.04, compute=0.001, wait=0.02)
    got = advise(Measured([busy, busy], num_workers=2, prefetch_factor=4, cores=2))
    assert kinds(got)[0] == "limit" and got[0].settings == {"cores": 4, "num_workers": 4}


def test_moving_big_batches_or_heavy_code_between_processes_is_unsure():
    """Issue 52: 19 MB batches cost 39-60 ms to cross from a worker, 8-11 ms in the loop's own process, and 2 workers
    copying them at once ran slower than predicted: the run measures one count only, so a change of workers with
    big batches is said to be unsure rather than predicted (small batches: predicted)."""
    big = epoch(user=0.3, collate=0.05, compute=0.005, wait=0.3, batch_bytes=19e6)
    got = advise(Measured([big, big], num_workers=1, prefetch_factor=4, cores=4))
    workers = [a for a in got if a.kind == "workers"]
    assert workers and all(a.predicted_s is None and "unsure" in str(a) and "19.0 MB" in a.because for a in workers)
    small = epoch(user=0.3, collate=0.05, compute=0.005, wait=0.3, batch_bytes=1e5)
    assert sure(advise(Measured([small, small], num_workers=1, prefetch_factor=4, cores=4)))[0].kind == "workers"
    threads = epoch(user=0.05, compute=0.005, wait=0.05, wall=5.5, cpu=9.0, idle=0.0)  # the main kept 1.6 cores
    got = advise(Measured([threads, threads], num_workers=0, prefetch_factor=0, cores=4))
    assert all(not a.sure for a in got if a.kind == "workers")


def test_the_model_runs_everything_in_the_loop_without_workers():
    e = epoch(fetch=0.01, user=0.02, collate=0.001, compute=0.005)
    m = Measured([e], num_workers=0, prefetch_factor=0, cores=4)
    p = model.parts(m, e)
    assert model.period(m, p, 0) == pytest.approx(0.005 + 0.01 + 0.021)  # compute, fetch and making, in turn


def test_without_workers_the_loops_wait_on_its_copies_moves_into_the_workers():
    """Issue 52's bench, ``no-workers`` (0 workers, 94 batches of 32 small files, 25 ms per copy, 2 cores): the
    model took the loop's whole cycle in the cold epoch (52 ms a batch: compute, waiting on the copies, your
    code) for the read-ahead's pace, so 2 workers kept that epoch as it was and the run was predicted at
    5.96 s; it took 4.16 s. The loop waited on the copying threads' CPU in its own process (its process used
    4.6 s of CPU in the cold epoch, 2.1 s in the warm one), not on the copies (128 in flight: 6 ms a batch);
    in workers each waits on its own. Figures: the stages of session 22's quiet run, the CPU of this session's."""
    n = 94
    cold = epoch(n=n, fetch=0.0299, user=0.0164, collate=0.0002, compute=0.0051, wait=0.0465, misses=3000,
                 items=3000, miss_latency=0.025, wall=4.85, cpu=4.6, idle=5.1, loop_cpu=2.1)
    warm = epoch(n=n, fetch=0.0006, user=0.0164, collate=0.0002, compute=0.0051, wait=0.0172, items=3000,
                 hit_latency=1e-6, wall=2.18, cpu=2.1, idle=2.26, loop_cpu=2.1)
    m = Measured([cold, warm], num_workers=0, prefetch_factor=0, cores=2, read_ahead="rank", dataset="UCVolumeDataset",
                 mean_file_bytes=8192, dataset_bytes=3000 * 8192, files=3000, miss_latency=0.025)
    p = model.parts(m, cold)
    assert not p.fetch_bound and p.fetch_rank == pytest.approx(3000 / n * 0.025 / 128)  # the copies' pace: the floor
    assert p.make == pytest.approx(4.6 / n - 0.0051)  # making a batch: the process's CPU less the loop's compute
    assert model.predict(m, cold, 0) == pytest.approx(cold.total)  # the run measured, as it was
    assert model.predict(m, cold, 2) < 0.6 * cold.total  # two workers share the copying threads' CPU too
    top = advise(m)[0]
    assert top.kind == "workers" and top.settings == {"num_workers": 2} and top.sure
    assert abs(top.predicted_s - 4.16) <= 0.25 * 4.16  # measured when followed (num_workers=2): 4.16 s
    # packing reads the files through the same copying threads: their CPU is not divided by more reads in flight
    assert "pack" not in kinds(advise(m))
    io = Measured([replace(cold, fetch=n * 0.2, wait=n * 0.2165, wall=n * 0.2216, miss_latency=0.8),
                   warm], num_workers=0, prefetch_factor=0, cores=2, read_ahead="rank", miss_latency=0.8)
    q = model.parts(io, io.epochs[0])  # copies of 800 ms each: 200 ms a batch with 128 in flight, at any workers
    assert q.fetch_bound and model.period(io, q, 2) == pytest.approx(model.period(io, q, 0), rel=0.05)


def test_taking_work_off_the_workers_gives_the_loop_its_cores_back():
    # the loop's compute took 10 ms per batch, 6 ms of it on the CPU: 4 ms waiting for a core the copies held
    e = epoch(fetch=0.05, user=0.001, collate=0.001, compute=0.010, wait=0.04, misses=400)
    e.compute_cpu = 0.006 * 100
    assert compute_after(e, e.fetch) == pytest.approx(e.compute)  # nothing changes: the measured compute
    assert compute_after(e, 0.0) == pytest.approx(100 * (0.006 + 0.004 * 0.002 / 0.052))
    e.compute_cpu = None  # unknown (no workers, stats saved before): the measured compute
    assert compute_after(e, 0.0) == pytest.approx(e.compute)


def test_packing_counts_its_own_time_and_one_open_per_shard():
    # 2,400 files of 16 KB (39 MB), each copy took 100 ms, 2 workers: 2 shards per worker stream
    cold = epoch(n=75, fetch=0.2, compute=0.005, wait=0.19, misses=2400, items=2400, miss_latency=0.1)
    m = Measured([cold], num_workers=2, prefetch_factor=4, cores=2, mean_file_bytes=16384, read_ahead="rank",
                 dataset_bytes=2400 * 16384, files=2400, miss_latency=0.1)
    p = next(a for a in advise(m) if a.kind == "pack")
    shard = int(2400 * 16384 / 4)
    assert p.settings == {"pack": True, "shard_size": shard} and "shards of 10MB" in p.change
    each = 0.2 * 75 / 2 / 2400  # the rank's pace per copy in epoch 0
    cost = adv.PACK_START_S + 2400 * max(each * 128 / 256, adv.PACK_FILE_S) + 2400 * 16384 / adv.WRITE_RATE
    assert p.cost_s == pytest.approx(cost)
    stream = 2 * (0.1 - 16384 / 100e6 + shard / 100e6)  # two opens and two shards' bytes per worker
    assert p.predicted_s == pytest.approx(cost + max(model.warm_epoch(m, cold), stream + 0.0))
    assert "of it the change itself" in str(p)


def test_replay_follows_torchs_pipeline():
    # one worker, one batch asked for ahead: each batch is asked for when the loop receives the one before
    assert replay([1.0, 1.0, 1.0], [0.0, 0.5, 0.5], 1, 1) == pytest.approx(3.0)
    # a slow batch every 4th: with 2 asked for ahead per worker the others are made meanwhile
    made, comp = [0.3, 0.01, 0.01, 0.01] * 5, [0.0] + [0.1] * 19
    shallow, deep = replay(made, comp, 2, 1), replay(made, comp, 2, 4)
    assert deep < shallow


@given(st.lists(st.tuples(st.floats(0, 0.5), st.floats(0, 0.2)), min_size=1, max_size=40), st.integers(1, 4),
       st.integers(1, 6), st.integers(1, 6))
def test_replay_never_slows_with_more_depth_and_is_never_faster_than_its_parts(batches, workers, d1, d2):
    made, comp = [m for m, _ in batches], [0.0] + [c for _, c in batches[1:]]
    lo, hi = sorted((d1, d2))
    assert replay(made, comp, workers, hi) <= replay(made, comp, workers, lo) + 1e-9
    t = replay(made, comp, workers, hi)
    assert t >= sum(comp) - 1e-9 and t >= sum(made) / workers - 1e-9 and t >= max(made) - 1e-9


per_batch = st.floats(0.0, 0.2)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(per_batch, per_batch, per_batch, per_batch, per_batch, st.floats(0, 1)), min_size=1,
                max_size=3),
       st.integers(0, 8), st.sampled_from([2, 4]), st.integers(1, 16), st.sampled_from([None, "rank", "stream"]),
       st.one_of(st.none(), st.integers(1, 5)))
def test_every_advice_saves_more_than_the_noise_against_one_baseline_best_first(epochs, workers, prefetch, cores,
                                                                              scope, run):
    m = Measured([epoch(fetch=f, user=u, collate=k, compute=c, wait=w, misses=int(400 * miss),
                        miss_latency=0.05 if miss else None) for f, u, k, c, w, miss in epochs],
                 num_workers=workers, prefetch_factor=prefetch, cores=cores, read_ahead=scope, run_epochs=run,
                 mean_file_bytes=16384, dataset_bytes=400 * 16384, files=400)
    got = advise(m)
    if all(e.total <= 0 for e in m.epochs):
        assert got == []
        return
    assert got, "a measured run always gets an answer"
    now = baseline(m)
    assert all(a.now_s == pytest.approx(now) and a.epochs == model.run_epochs(m) for a in got)
    changes = sure(got)
    assert all(now - a.predicted_s >= threshold(m)[0] + adv.COST_DOUBT * a.cost_s - 1e-9 for a in changes)
    assert [a.predicted_s for a in changes] == sorted(a.predicted_s for a in changes)
    assert all(not a.sure for a in got[len(changes):] if a.kind != "none")  # unsure ones after the sure ones
    assert all(a.because and str(a).startswith(a.change) for a in got)
    if model.run_epochs(m) == 1:
        assert "warm" not in kinds(got)


@settings(max_examples=100, deadline=None)
@given(st.floats(0.01, 0.5), st.integers(1, 16), st.integers(1, 16), st.floats(0, 0.05))
def test_a_rank_read_ahead_predicts_the_same_fetch_pace_for_any_workers_up_to_16(fetch, w0, w, decode):
    e = epoch(fetch=fetch, user=decode, compute=0.001, wait=fetch, misses=400, miss_latency=0.1)
    m = Measured([e], num_workers=w0, prefetch_factor=2, cores=2, read_ahead="rank")
    p = model.parts(m, e)
    if p.fetch_bound:  # 128 files in flight per rank, spread over the workers (a few lost to rounding)
        assert model.period(m, p, w) >= 0.9 * p.fetch_rank


@settings(max_examples=100, deadline=None)
@given(st.floats(0.0, 0.1), st.floats(0.0, 0.05), st.floats(0.001, 0.02), st.floats(0.5, 3.0), st.integers(0, 400),
       st.integers(1, 8))
def test_without_workers_the_model_keeps_the_measured_epoch_and_the_copies_floor(fetch, user, compute, cpu_ratio,
                                                                                misses, w):
    """0 workers: the model predicts the measured epoch at the measured setting, and no count of workers makes
    an epoch faster than its copies (misses x latency / files in flight) or the loop's own compute."""
    n = 100
    fetch += misses / n * 0.05 / 128  # the loop waited at least the copies' pace (128 in flight)
    e = epoch(n=n, fetch=fetch, user=user, compute=compute, wait=fetch + user, misses=misses, items=400,
              miss_latency=0.05 if misses else None, wall=n * (fetch + user + compute),
              cpu=cpu_ratio * n * (fetch + user + compute), idle=0.5 * n * (fetch + user + compute),
              loop_cpu=n * (user + compute))
    m = Measured([e], num_workers=0, prefetch_factor=0, cores=2, read_ahead="rank")
    assert model.predict(m, e, 0) == pytest.approx(e.total, rel=1e-6, abs=1e-9)
    floor = max(misses / n * 0.05 / model.in_flight(m, w), compute)
    assert model.predict(m, e, w) >= n * floor * (1 - 1e-6) - 1e-9


# ------------------------------------------------------------------ from real records

class _Slow(torch.utils.data.Dataset):
    def __len__(self):
        return 24

    def __getitem__(self, i):
        time.sleep(0.01)
        return i


def test_recorded_stats_give_the_same_advice_from_the_cli(tmp_path):
    loader = DataLoader(_Slow(), batch_size=4, num_workers=0, log_to_mlflow=False)
    for _ in range(2):
        for _ in loader:
            pass
    got = loader.stats.advise()
    assert got and all(isinstance(a, Advice) for a in got)
    path = loader.stats.save(tmp_path / "stats.json")
    out = subprocess.run([sys.executable, "-m", "ucmagic", "advise", path, "--json"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout)
    assert [r["kind"] for r in rows] == kinds(got)
    assert [r["predicted_s"] for r in rows] == [pytest.approx(a.predicted_s) if a.sure else None for a in got]
    text = subprocess.run([sys.executable, "-m", "ucmagic", "advise", path], capture_output=True, text=True,
                          timeout=120)
    assert text.returncode == 0 and "the measured run: 2 epochs" in text.stdout


def test_merged_ranks_are_advised_on_the_rank_the_others_wait_for(tmp_path):
    from ucmagic import LoaderStats

    def part(rank, wait):
        n = 10
        return {"version": 1, "rank": rank, "fetch_s": [wait] * n, "compute_s": [0.01] * n, "count": [0] * n,
                "epoch": [0] * n, "worker": [0] * n, "misses": [0] * n, "nbytes": [0] * n, "item_index": [],
                "item_fetch_s": [], "files": {}, "counters": None, "truncated": False,
                "stage_fetch_s": [0.0] * n, "stage_user_s": [wait] * n, "stage_collate_s": [0.0] * n,
                "setup": {"cores": 4, "num_workers": 1, "prefetch_factor": 2}}

    merged = LoaderStats.merge([LoaderStats.from_dict(part(0, 0.001)), LoaderStats.from_dict(part(1, 0.4))])
    got = merged.advise()
    assert got[0].now_s == pytest.approx(10 * 0.41)  # rank 1's epoch, not the sum


def test_the_loops_cpu_and_the_machines_free_cores_are_recorded_saved_and_merged(tmp_path):
    from ucmagic import LoaderStats

    loader = DataLoader(list(range(64)), batch_size=8, num_workers=0, log_to_mlflow=False)
    for _ in range(2):
        for _ in loader:
            end = time.thread_time() + 0.002
            while time.thread_time() < end:
                pass
    cpu, res = loader.stats.setup["loop_cpu_s"], loader.stats.setup["resources"]
    assert set(cpu) == {"0", "1"} and all(v >= 8 * 0.002 for v in cpu.values())
    assert set(res) == {"0", "1"} and all(r["wall"] >= 8 * 0.002 and r["cpu"] >= 8 * 0.002 for r in res.values())
    assert all(r["batch_bytes"] == 8 * 8 for r in res.values())  # a batch: a tensor of 8 int64
    if sys.platform.startswith("linux"):
        assert all(r["idle"] is not None and r["idle"] >= 0 for r in res.values())
    again = LoaderStats.load(loader.stats.save(tmp_path / "s.json"))
    assert again.setup["loop_cpu_s"] == pytest.approx(cpu) and again.setup["resources"] == res
    other = LoaderStats.from_dict({**loader.stats.to_dict(), "rank": 1})
    other.setup["loop_cpu_s"] = {"0": 100.0}
    other.setup["resources"] = {"0": {**res["0"], "wall": 100.0}}
    merged = LoaderStats.merge([again, other])
    assert merged.setup["loop_cpu_s"] == pytest.approx({"0": 100.0, "1": cpu["1"]})  # the busiest rank's
    assert merged.setup["resources"]["0"]["wall"] == 100.0 and merged.setup["resources"]["1"] == res["1"]
    loader.stats.reset()
    assert "loop_cpu_s" not in loader.stats.setup and "resources" not in loader.stats.setup


def test_workers_report_their_cpu_with_their_batches():
    class Busy(torch.utils.data.Dataset):
        def __len__(self):
            return 32

        def __getitem__(self, i):
            end = time.thread_time() + 0.005
            while time.thread_time() < end:
                pass
            return i

    loader = DataLoader(Busy(), batch_size=4, num_workers=2, multiprocessing_context="fork", log_to_mlflow=False)
    for _ in loader:
        pass
    res = loader.stats.setup["resources"]["0"]
    assert res["workers_cpu"] >= 0.5 * 32 * 0.005  # its CPU clock is read at most every 50 ms: the last reads lag
    m = loader.stats  # the measured numbers reach the advisor
    from ucmagic.loading import stats_analysis

    got = stats_analysis.measured(m.batches(), m._setup_now(), None, m._item_log)
    assert got.epochs[0].workers_cpu == pytest.approx(res["workers_cpu"]) and got.epochs[0].wall == res["wall"]


def test_the_measured_copy_latency_is_the_median_miss_of_its_epoch():
    import numpy as np

    from ucmagic.loading.stats_analysis import first_miss_latency, item_latencies
    from ucmagic.telemetry import ItemLog

    log = ItemLog()

    def batch(epoch, fetch):  # fetch seconds per item, negative for a hit
        log.add(epoch, 0, np.arange(len(fetch), dtype=np.int32).tobytes(), np.array(fetch, np.float32).tobytes())

    batch(0, [0.05, 0.04, -0.001])  # epoch 0: two misses of 50 and 40 ms, a hit
    batch(0, [0.06, -0.002])
    batch(1, [0.5, 0.5, -0.003])
    epochs = np.array([0, 0, 1])
    assert first_miss_latency(log.arrays(), epochs) == pytest.approx(0.05)
    lat = item_latencies(log.arrays(), epochs)
    assert lat[0] == (pytest.approx(0.05), pytest.approx(0.0015))
    assert lat[1] == (pytest.approx(0.5), pytest.approx(0.003))
    hits = ItemLog()
    hits.add(0, 0, np.arange(2, dtype=np.int32).tobytes(), np.array([-0.001, -0.001], np.float32).tobytes())
    assert first_miss_latency(hits.arrays(), np.array([0])) is None  # no misses: unknown
    assert first_miss_latency(ItemLog().arrays(), np.array([], dtype=int)) is None


def test_the_none_line_and_unsure_lines_read_as_sentences():
    none = Advice("none", "data loading is not the bottleneck", None, 3.0, "the loop waited 1%", epochs=3)
    assert str(none) == "data loading is not the bottleneck (run of 3 epochs: 3 s; the loop waited 1%)"
    unsure = Advice("workers", "num_workers=0 (now 1)", None, 3.0, "batches of 19 MB would stop crossing")
    assert str(unsure) == "num_workers=0 (now 1): unsure, not predicted (batches of 19 MB would stop crossing)"
    assert not unsure.sure and math.isnan(float("nan"))
