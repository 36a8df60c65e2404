"""ucmagic.telemetry (record keeping and the one percentile) and ucmagic._shared (shared memory and its
pickling rule): what the loader's stats, the panel and the dataset's counters rely on."""
from __future__ import annotations

import math
import multiprocessing as mp
import pickle

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic import telemetry
from ucmagic._shared import SharedInt, SharedInts
from ucmagic.telemetry import BatchRecorder, ItemLog, SharedCounters, p50_p99, percentiles


# ------------------------------------------------------------------ percentiles (the one home)

def test_percentiles_interpolate_linearly_and_are_nan_when_empty():
    assert all(math.isnan(v) for v in percentiles([]).values())
    assert percentiles([1.0], (99,)) == {"p99": 1.0}
    assert percentiles([0.0, 10.0], (50,))["p50"] == 5.0
    vals = [float(i) for i in range(101)]
    assert percentiles(vals)["p99"] == pytest.approx(99.0)
    assert percentiles(list(reversed(vals)))["p90"] == pytest.approx(90.0)  # order does not matter
    assert p50_p99([3.0, 1.0, 2.0]) == (2.0, pytest.approx(2.98))


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentiles_stay_within_the_values(values, q):
    (v,) = percentiles(values, (q,)).values()
    assert min(values) - 1e-6 <= v <= max(values) + 1e-6


# ------------------------------------------------------------------ per-batch timings

def test_batch_recorder_totals_and_stall_fraction():
    rec = BatchRecorder()
    assert rec.stall_fraction() == 0.0 and rec.fetch_array().size == 0
    rec.record(0.3, 0.1)
    rec.extend([0.1, 0.2], [0.1, 0.2])
    assert len(rec) == 3 and rec.fetch_array().tolist() == [0.3, 0.1, 0.2]
    assert rec.fetch_array(2).tolist() == [0.1, 0.2] and rec.compute_array(1).tolist() == [0.2]
    assert rec.stall_fraction() == pytest.approx(0.6 / 1.0)
    rec.reset()
    assert len(rec) == 0 and rec.fetch_total == 0.0


# ------------------------------------------------------------------ shared memory and its pickling rule

def test_a_plain_pickle_carries_a_snapshot_into_memory_of_its_own():
    c = SharedCounters()
    c.add(hits=3, misses=2, bytes_fetched=100)
    c.record_latency(0.25)
    n, arr = SharedInt(7), SharedInts(3)
    arr[1] = 5
    c2, n2, arr2 = (pickle.loads(pickle.dumps(x)) for x in (c, n, arr))
    assert c2.totals() == c.totals() and c2.latencies().tolist() == [0.25]
    assert n2.value == 7 and [arr2[i] for i in range(len(arr2))] == [0, 5, 0]
    c2.add(hits=1)
    n2.value = 8
    arr2[0] = 9
    assert c.totals()["hits"] == 3 and n.value == 7 and arr[0] == 0  # the copies do not share memory


def test_a_fetched_file_counts_as_one_miss_its_bytes_and_its_latency():
    one, two = SharedCounters(), SharedCounters()
    for nbytes, secs in ((100, 0.5), (7, 0.25)):
        one.fetched(nbytes, secs)
        two.add(misses=1, bytes_fetched=nbytes)
        two.record_latency(secs)
    assert one.totals() == two.totals() and one.totals()["misses"] == 2
    assert one.latencies().tolist() == two.latencies().tolist() == [0.5, 0.25]


def _bump(c: SharedCounters, n: SharedInt, arr: SharedInts) -> None:
    c.add(misses=4)
    n.value = 42
    arr[2] = 11


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_process_writes_the_parents_shared_memory(method):
    c, n, arr = SharedCounters(), SharedInt(0), SharedInts(3)
    p = mp.get_context(method).Process(target=_bump, args=(c, n, arr))
    p.start()
    p.join(60)
    assert p.exitcode == 0
    assert c.totals()["misses"] == 4 and n.value == 42 and arr[2] == 11


# ------------------------------------------------------------------ per-item records

def test_item_log_keeps_8_bytes_per_item_and_stops_at_its_cap():
    log = ItemLog(cap=10)
    idx = np.arange(4, dtype=np.int32).tobytes()
    f = np.full(4, 0.1, dtype=np.float32).tobytes()
    for _ in range(3):
        log.add(0, 1, idx, f, 400)
    assert len(log) == 3 and len(log.index) == 8 and log.truncated  # the third batch kept its totals only
    assert log.count[2] == 4 and log.items(2)[0].size == 0 and log.items(1)[0].tolist() == [0, 1, 2, 3]
    held = sum(a.itemsize * len(a) for a in (log.start, log.count, log.epoch, log.worker, log.rank, log.misses,
                                             log.nbytes, log.index, log.fetch))
    assert held == 8 * 8 + 3 * (8 + 4 + 4 + 2 + 2 + 4 + 8)


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


def test_a_pinned_batch_keeps_its_item_records():
    items = telemetry.BatchItems({"label": [1, 2], "name": "b0"}, 3, b"\x01\x00\x00\x00", b"\x00\x00\x80\x3f", 7)
    pinned = items.pin_memory()  # no tensors inside: torch's pin-memory walk hands the data back as is
    assert pinned.batch == {"label": [1, 2], "name": "b0"}
    assert (pinned.worker, pinned.index, pinned.fetch, pinned.nbytes) == (3, items.index, items.fetch, 7)


# ------------------------------------------------------------------ issue 52: what a batch weighs, what the machine had

def test_batch_bytes_counts_arrays_and_bytes_in_nested_batches():
    import numpy as np
    import torch

    from ucmagic.telemetry import batch_bytes

    assert batch_bytes(torch.zeros(32, 3, 224, 224)) == 32 * 3 * 224 * 224 * 4
    assert batch_bytes({"x": torch.zeros(4, dtype=torch.int64), "y": [b"abc", np.zeros(2)], "k": "name"}) == 32 + 3 + 16
    assert batch_bytes(["/a/path"] * 10) == 0
    many = [torch.zeros(1)] * 1000  # past the fanout: the walked part scaled to the whole
    assert batch_bytes(many, fanout=64) == 4000


def test_idle_seconds_read_from_proc_stat_per_core():
    from ucmagic.telemetry import parse_idle

    stat = ("cpu  100 0 50 9000 100 0 0 0 0 0\n"
            "cpu0 50 0 25 4000 60 0 0 0 0 0\n"
            "cpu1 50 0 25 5000 40 0 0 0 0 0\n"
            "intr 12345\n")
    assert parse_idle(stat) == pytest.approx((4000 + 60 + 5000 + 40) / 100)
    assert parse_idle(stat, [1]) == pytest.approx(50.4)
    assert parse_idle(stat, [7]) is None and parse_idle("garbage") is None
    assert parse_idle(stat, [0], hz=1000) == pytest.approx(4.06)


def test_a_workers_cpu_clock_is_read_at_most_every_50_ms_and_never_in_the_main_process():
    import math

    from ucmagic import telemetry

    assert math.isnan(telemetry.worker_cpu(None, 1.0))
    info = object()
    first = telemetry.worker_cpu(info, 100.0)
    assert first >= 0 and telemetry.worker_cpu(info, 100.01) == first  # too soon: the last read
    other = object()  # a new worker process (a forked one starts its own mark)
    assert telemetry.worker_cpu(other, 100.01) >= first
