import os
import subprocess
import sys
import threading
import time

import pytest

from hypothesis import given
from hypothesis import strategies as st

from ucmagic._util import DaemonPool, RetryPolicy
from ucmagic.errors import FetchTimeoutError

from waits import PATIENCE, JumpClock, module_with, wait_until

from ucmagic.files.fetch import (CALL_S, MAX_BATCH, Window, backoff_delays, batch_size, read_ahead, restart_timeout,
                                 tune_window, with_retries)


def _counting(fn, sleep):
    """``fn`` wrapped to sleep ``sleep(i)`` s while counted as in flight; returns (wrapped, peak)."""
    active, peak = [0], [0]
    mu = threading.Lock()

    def call(i):
        with mu:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(sleep(i))
        with mu:
            active[0] -= 1
        return fn(i)

    return call, peak


def test_results_come_in_input_order_with_concurrency():
    """The first calls wait until five are in flight at once (proof that they overlap, on any machine: a
    read-ahead that ran them one at a time would wait PATIENCE and fail), later ones take varied times."""
    active, mu, overlapped = [0], threading.Lock(), threading.Event()

    def call(i):
        with mu:
            active[0] += 1
            if active[0] >= 5:
                overlapped.set()
        try:
            if i < 5:
                assert overlapped.wait(PATIENCE), "the first calls never ran five at a time"
            time.sleep(0.01 * (i % 3))
        finally:
            with mu:
                active[0] -= 1
        return i * 2

    assert list(read_ahead(call, range(60), depth=16)) == [i * 2 for i in range(60)]
    assert overlapped.is_set()


def test_depth_bounds_calls_in_flight():
    started = []
    gen = read_ahead(lambda i: started.append(i) or i, range(1000), depth=8)
    assert next(gen) == 0
    time.sleep(0.05)
    assert len(started) <= 9
    gen.close()


def test_retries_transient_errors_then_succeeds():
    calls = []

    def flaky(x):
        calls.append(x)
        if len(calls) < 3:
            raise OSError(5, "EIO")
        return "ok"

    retried = []
    assert with_retries(flaky, 1, 5, on_retry=retried.append) == "ok"
    assert len(calls) == 3 and len(retried) == 2


def test_permanent_errors_are_not_retried():
    calls = []

    def missing(x):
        calls.append(x)
        raise FileNotFoundError(x)

    with pytest.raises(FileNotFoundError):
        with_retries(missing, "f", 5)
    assert calls == ["f"]


def test_gives_up_after_retries():
    with pytest.raises(OSError):
        with_retries(lambda x: (_ for _ in ()).throw(OSError("down")), 0, 2)


def test_backoff_grows_and_is_capped():
    d = backoff_delays(10, base=0.01, cap=1.0, jitter=0.0)
    assert d[0] == 0.01 and d[1] == 0.02 and max(d) == 1.0
    assert d == sorted(d)


@pytest.mark.parametrize("n, hung, depth", [
    (5, 2, 4),  # one item per call
    (1000, 700, 64),  # quick items: the hung one is inside a run
])
def test_a_hung_call_times_out_naming_the_item_after_the_items_before_it(monkeypatch, n, hung, depth):
    """The read-ahead's clock jumps an hour once the hung item is in its call and the loop took every
    item before it: the timeout fires then, never on an earlier item a loaded machine was slow to run."""
    from ucmagic.files import fetch

    ev, entered = threading.Event(), threading.Event()
    got = []

    def hang(i):
        if i == hung:
            entered.set()
            ev.wait(60)
        return i

    monkeypatch.setattr(fetch, "time", JumpClock(lambda: entered.is_set() and len(got) == hung))
    pool = _CountingPool()
    try:
        with pytest.raises(FetchTimeoutError, match=f"item-{hung} made no progress"):
            for x in read_ahead(hang, range(n), depth=depth, timeout=60, describe=lambda i: f"item-{i}", pool=pool):
                got.append(x)
    finally:
        ev.set()
    assert got == list(range(hung))
    if hung > 100:
        assert pool.calls < hung // 4  # it was inside a run


@pytest.mark.parametrize("n, bad, depth, inline", [
    (10, 5, 4, False),  # one item per call
    (3000, 1234, 64, False),  # quick items: the error is inside a run of them
    (5000, 2500, 64, True),  # quick items on a local disk: called on the consumer's thread
])
def test_errors_surface_in_order_after_the_items_before_them(n, bad, depth, inline):
    def f(i):
        if i == bad:
            raise ValueError(f"bad {bad}")
        return i

    got = []
    with pytest.raises(ValueError, match=f"bad {bad}"):
        for x in read_ahead(f, range(n), depth=depth, inline=inline):
            got.append(x)
    assert got == list(range(bad))


def test_window_grows_while_the_consumer_waits_and_growth_pays():
    w = Window(8)
    for rate in (100.0, 200.0, 400.0, 800.0, 1600.0):  # a high-latency volume: every doubling doubles the rate
        w = tune_window(w, rate, wait_share=0.9, floor=4, ceiling=128)
    assert w.size == 128


def test_window_goes_back_when_growth_does_not_pay_then_tries_fewer():
    w = tune_window(Window(8), 1000.0, wait_share=0.5, floor=4, ceiling=128)
    assert w.size == 16
    w = tune_window(w, 1020.0, wait_share=0.5, floor=4, ceiling=128)  # CPU-bound fills: no gain
    assert w.size == 8 and w.down
    w = tune_window(w, 1000.0, wait_share=0.5, floor=4, ceiling=128)  # measured at 8 again, then halved on trial
    assert (w.size, w.prev_size) == (4, 8)
    w = tune_window(w, 990.0, wait_share=0.5, floor=4, ceiling=128)  # as fast with 4: kept, and the floor rests
    assert w.size == 4 and w.hold > 0


def test_a_smaller_window_that_costs_rate_goes_back_and_rests_before_growing():
    w = Window(16, prev_size=32, prev_rate=1000.0)  # a shrink on trial
    w = tune_window(w, 600.0, wait_share=0.5, floor=4, ceiling=128)  # a latency-bound volume: fewer calls, less rate
    assert w.size == 32 and w.hold > 0
    for _ in range(w.hold):  # rests at the size that served best, then tries to grow again
        w = tune_window(w, 1000.0, wait_share=0.5, floor=4, ceiling=128)
        assert w.size == 32
    assert tune_window(w, 1000.0, wait_share=0.5, floor=4, ceiling=128).size == 64


@pytest.mark.parametrize("volume, settles", [
    (lambda n: 1000.0, {4, 8}),  # CPU-bound fills (a local disk): the fewest calls do it all
    (lambda n: 50.0 * n, {128}),  # latency-bound (a remote volume): every call adds rate
    (lambda n: min(50.0 * n, 1600.0), {16, 32, 64}),  # saturated at 32 calls: around there
])
def test_the_window_settles_where_the_volume_serves_the_most_with_the_fewest_calls(volume, settles):
    w, seen = Window(32), []
    for _ in range(80):
        w = tune_window(w, volume(w.size), wait_share=0.5, floor=4, ceiling=128)
        seen.append(w.size)
    assert set(seen[-20:]) <= settles, seen[-20:]


def test_window_shrinks_when_the_consumer_does_not_wait():
    w = Window(64)
    for _ in range(50):
        w = tune_window(w, 500.0, wait_share=0.0, floor=4, ceiling=128)
    assert w.size == 4


@pytest.mark.parametrize("latency", [0.1, 0.02])
def test_a_consumer_slower_than_a_high_latency_volume_keeps_the_calls_that_hide_the_latency(latency):
    # images decoded at 145/s from a volume with `latency` s per open: the consumer does not wait with
    # at least 145 * latency calls in flight, and waits in every period with fewer. Without `busy` the
    # window shrank by a quarter until the consumer waited, doubled, and shrank again: it waited in 41
    # of 150 periods.
    consumer = 145.0
    w, waited = Window(32), 0
    for period in range(200):
        served = w.size / latency
        rate, wait = min(consumer, served), max(0.0, 1.0 - served / consumer)
        waited += period >= 50 and wait >= 0.05
        w = tune_window(w, rate, wait, floor=4, ceiling=64, busy=rate * latency)
    assert waited <= 3
    assert w.size >= consumer * latency


@pytest.mark.full
def test_a_slow_loop_over_a_high_latency_volume_keeps_enough_calls_in_flight_to_never_wait_long():
    # 50 ms per call, a loop that spends 2 ms per item (at most 500 items/s: up to 25 calls busy; on a
    # slow machine fewer). Before, the window shrank to its floor of 4 whenever the loop did not wait.
    # Timed (a loaded machine's slower loop needs fewer calls): --full only; the default suite checks the
    # same rule on simulated rates (test_a_consumer_slower_than_a_high_latency_volume_keeps_the_calls...).
    active, mu = [0], threading.Lock()

    def call(i):
        with mu:
            active[0] += 1
        time.sleep(0.05)
        with mu:
            active[0] -= 1
        return i

    in_flight = []
    for i in read_ahead(call, range(800), depth=64):
        time.sleep(0.002)
        if 300 <= i < 700:  # steady state, away from both ends
            in_flight.append(active[0])
    assert min(in_flight) >= 6, sorted(in_flight)[:20]


def test_quick_fills_behind_a_slow_consumer_still_shrink_to_the_floor():
    w = Window(32)
    for _ in range(50):  # 500 items/s of 0.1 ms fills: well under one call busy at a time
        w = tune_window(w, 500.0, wait_share=0.0, floor=4, ceiling=128, busy=500.0 * 1e-4)
    assert w.size == 4


@given(size=st.integers(1, 256), rate=st.floats(0, 1e6), wait=st.floats(0, 1), prev=st.integers(0, 256),
       prev_rate=st.floats(0, 1e6), hold=st.integers(0, 5), floor=st.integers(1, 16), ceiling=st.integers(16, 256),
       busy=st.floats(0, 1e4))
def test_window_stays_between_floor_and_ceiling(size, rate, wait, prev, prev_rate, hold, floor, ceiling, busy):
    size = min(max(size, floor), ceiling)
    w = tune_window(Window(size, min(prev, ceiling), prev_rate, hold), rate, wait, floor=floor,
                    ceiling=ceiling, busy=busy)
    assert floor <= w.size <= ceiling


def test_slow_calls_get_more_than_the_starting_window():
    slow, peak = _counting(lambda i: i, lambda i: 0.02)
    assert list(read_ahead(slow, range(600), depth=64)) == list(range(600))
    assert peak[0] > 16  # latency-bound calls: the window grew past its start of 8


# ------------------------------------------------------------------ the one retry policy



def _flaky(failures: list[BaseException]):
    calls = [0]

    def fn():
        calls[0] += 1
        if failures:
            raise failures.pop(0)
        return "ok"

    return fn, calls


def test_retry_policy_retries_transient_errors_and_raises_permanent_ones_at_once():
    fast = RetryPolicy(3, (FileNotFoundError,), base=0.0)
    fn, calls = _flaky([OSError("blip"), OSError("blip")])
    seen = []
    assert fast.call(fn, on_retry=seen.append) == "ok" and calls[0] == 3 and len(seen) == 2
    fn, calls = _flaky([FileNotFoundError("gone"), OSError()])
    with pytest.raises(FileNotFoundError):
        fast.call(fn)
    assert calls[0] == 1
    fn, calls = _flaky([OSError()] * 5)
    with pytest.raises(OSError):
        fast.call(fn)
    assert calls[0] == 4  # one try and three retries


def test_retry_policy_leaves_errors_outside_its_transient_set_alone():
    only_os = RetryPolicy(3, (), transient=(OSError,), base=0.0)
    fn, calls = _flaky([ValueError("bug")])
    with pytest.raises(ValueError):
        only_os.call(fn)
    assert calls[0] == 1


@given(st.integers(0, 20), st.floats(0.001, 1.0), st.floats(1.0, 8.0), st.floats(0.01, 10.0), st.floats(0.0, 1.0))
def test_retry_delays_grow_and_stay_under_the_cap_plus_jitter(retries, base, factor, cap, jitter):
    d = RetryPolicy(retries, base=base, factor=factor, cap=cap, jitter=jitter).delays()
    assert len(d) == retries
    assert all(0 <= x <= cap * (1 + jitter) + 1e-12 for x in d)
    nominal = [min(cap, base * factor ** i) for i in range(retries)]
    assert all(lo <= x <= lo * (1 + jitter) + 1e-12 for lo, x in zip(nominal, d))


def test_fetch_backoff_is_the_shared_policy():
    import random

    assert backoff_delays(4, rng=random.Random(1)) == RetryPolicy(4).delays(random.Random(1))


def test_timeout_counts_only_time_without_progress(monkeypatch):
    """A copy that shows progress at every look of the stall check never times out, however long it takes
    (ten looks: five timeouts); one that stops showing progress does. The read-ahead's clock is the number
    of looks (a second each), so a loaded machine that looks less often, or a copy thread slow to start,
    sees the same."""
    from ucmagic.files import fetch
    from ucmagic.files.fetch import watch_progress

    looks = [0]
    monkeypatch.setattr(fetch, "time", module_with(monotonic=lambda: float(looks[0]), perf_counter=time.perf_counter))
    release = threading.Event()

    def copy(item: str) -> str:
        if item == "big":
            def grown() -> int:  # the size of the file being written: it grew since the last look
                looks[0] += 1
                return looks[0]

            watch_progress(grown)
            wait_until(lambda: looks[0] >= 10, "ten looks at the copy")
        elif item == "hung":
            def same() -> int:  # stops writing
                looks[0] += 1
                return 0

            watch_progress(same)
            release.wait(PATIENCE)
        return item

    assert list(read_ahead(copy, ["big", "small"], depth=2, timeout=2)) == ["big", "small"]
    looks[0] = 0
    try:
        with pytest.raises(FetchTimeoutError, match="hung.*made no progress for 2 s"):
            list(read_ahead(copy, ["hung"], depth=1, timeout=2))
    finally:
        release.set()


def test_closing_a_read_ahead_stops_its_calls_still_waiting():
    waiting = threading.Semaphore(0)
    stopped: list[str] = []

    def fn(i):
        if i == 0:
            return i
        waiting.release()
        try:
            while True:  # e.g. a fill waiting for cache room: it calls restart_timeout as it waits
                restart_timeout()
                time.sleep(0.01)
        except BaseException as e:
            stopped.append(type(e).__name__)
            raise

    g = read_ahead(fn, range(3), depth=3)
    assert next(g) == 0
    assert waiting.acquire(timeout=PATIENCE) and waiting.acquire(timeout=PATIENCE)
    g.close()  # the loop broke off
    wait_until(lambda: len(stopped) == 2, "both waiting calls stopped")


def test_a_call_that_raises_a_timeout_error_of_its_own_is_not_waited_on_forever():
    def fn(i):
        raise TimeoutError(f"socket timed out on {i}")  # the call's own error, not a wait that timed out

    with pytest.raises(TimeoutError, match="socket timed out on 0"):
        list(read_ahead(fn, range(2), depth=2, timeout=None))


class _CountingPool:
    """A pool that counts the calls submitted to it (each runs on a plain thread)."""

    def __init__(self):
        self.calls = 0

    def submit(self, fn, *args):
        from concurrent.futures import Future

        self.calls += 1
        fut = Future()

        def run():
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(*args))
                except BaseException as exc:  # noqa: BLE001 - handed over through the future
                    fut.set_exception(exc)

        threading.Thread(target=run, daemon=True).start()
        return fut


def test_quick_items_go_to_threads_in_runs_and_still_come_out_in_order():
    pool = _CountingPool()
    assert list(read_ahead(lambda i: i * 3, range(2000), depth=64, pool=pool)) == [i * 3 for i in range(2000)]
    assert pool.calls < 2000 // 4  # a thread hand-off per run of items, not per item


def test_slow_items_go_one_per_call():
    pool = _CountingPool()
    assert list(read_ahead(lambda i: time.sleep(0.005) or i, range(60), depth=16, pool=pool)) == list(range(60))
    assert pool.calls == 60  # each waits on its own (a high-latency volume wants them all at once)


def test_closing_a_read_ahead_stops_a_run_before_its_next_item():
    """A run of items on a pool thread, closed while it is on one item, finishes that item and starts no
    other. Driven by events only: the run is held on its second item until the read-ahead is closed."""
    from concurrent.futures import ThreadPoolExecutor

    from ucmagic.files import fetch

    closed, on_second, release = threading.Event(), threading.Event(), threading.Event()
    called = []

    def f(i):
        called.append(i)
        if i == 1:
            on_second.set()
            assert release.wait(60)
        return i

    task = fetch._Task([0, 1, 2, 3], [0, 0, 0, 0], closed, threading.Lock())
    with ThreadPoolExecutor(1) as pool:
        fut = pool.submit(fetch._run, f, task)
        assert on_second.wait(60)
        closed.set()  # what closing the read-ahead sets
        release.set()
        fut.result(60)  # the call ends; its stop is no error (no one takes what a closed read-ahead left)
    assert task.done and task.error is None
    assert called == [0, 1] and task.results == [0, 1]  # item 1 finished, item 2 never started


def test_a_failed_call_lets_go_of_what_its_frames_held_once_its_task_goes_without_a_collection():
    """A call's error keeps its traceback (the consumer raises it); once the task is dropped, nothing of
    the call (the cache and dataset its frames name) waits for the garbage collector: a dataset
    Ctrl-C'd while a fill failed is gone at once, and its cache_limit with it."""
    import gc
    import weakref

    from ucmagic.files import fetch

    class Held:
        pass

    def f(i):
        held = Held()
        refs.append(weakref.ref(held))
        raise OSError("the volume failed")

    refs: list = []
    task = fetch._Task([0], [0], threading.Event(), threading.Lock())
    gc.disable()
    try:
        call = threading.Thread(target=fetch._run, args=(f, task))  # a pool thread (lets go of its args)
        call.start()
        call.join(60)
        assert isinstance(task.error, OSError)
        del task
        assert refs[0]() is None
    finally:
        gc.enable()


def test_a_closed_read_ahead_calls_nothing_beyond_its_window():
    """After the loop leaves at item 480, no item beyond the ``depth`` in flight then is ever called,
    however far ahead of (or behind) the loop the pool threads were."""
    ran = []
    lock = threading.Lock()

    def f(i):
        with lock:
            ran.append(i)
        return i

    depth = 64
    g = read_ahead(f, range(100_000), depth=depth)
    for x in g:
        if x == 480:
            break
    g.close()
    time.sleep(0.2)  # lets a broken stop show itself; a slow machine only makes the check weaker
    with lock:
        assert max(ran) <= 480 + depth


@given(st.one_of(st.none(), st.floats(1e-9, 10)), st.integers(1, 512), st.integers(1, 1024))
def test_runs_are_one_item_for_slow_items_and_keep_the_window_within_depth(per_item, window, depth):
    k = batch_size(per_item, window, depth)
    assert 1 <= k <= MAX_BATCH
    if per_item is None or per_item * 2 >= CALL_S:
        assert k == 1
    elif depth >= window:
        assert k * window <= depth


def test_quick_items_on_a_local_disk_are_called_on_the_consumers_own_thread():
    me = threading.get_ident()
    on_me = []

    def f(i):
        on_me.append(threading.get_ident() == me)
        restart_timeout()  # a fill waiting for room calls it: fine on the consumer's thread too
        return i * 2

    assert list(read_ahead(f, range(3000), depth=64, inline=True)) == [i * 2 for i in range(3000)]
    assert sum(on_me) > 2000  # once the window is at one call and items are known to be quick
    on_me.clear()
    assert list(read_ahead(f, range(3000), depth=64)) == [i * 2 for i in range(3000)]
    assert not any(on_me)  # a volume that may hang: always on pool threads, under the timeout


def test_slow_items_are_never_called_on_the_consumers_thread():
    me = threading.get_ident()
    on_me = []

    def f(i):
        on_me.append(threading.get_ident() == me)
        time.sleep(0.004)
        return i

    assert list(read_ahead(f, range(200), depth=16, inline=True)) == list(range(200))
    assert not any(on_me)


@pytest.mark.timeout(300)
def test_a_run_hands_out_its_first_results_while_a_later_item_waits_on_their_consumption():
    # a fill under a tight budget waits for room that only the loop's consumption of earlier files frees
    taken = [0]

    def f(i):
        if i and i % 100 == 0:
            deadline = time.monotonic() + PATIENCE
            while taken[0] < i and time.monotonic() < deadline:
                restart_timeout()
                time.sleep(0.005)
            assert taken[0] >= i, f"item {i} waited for the loop to take {i} items; it took {taken[0]}"
        return i

    pool = _CountingPool()
    for x in read_ahead(f, range(1000), depth=64, timeout=PATIENCE, pool=pool):
        assert x == taken[0]
        taken[0] += 1
    assert taken[0] == 1000
    assert pool.calls < 1000 // 4  # in runs


class _LateFuturePool:
    """Runs each call at once on the caller's thread, and completes its future a moment later: the
    results are all there before the call's future is done, as when a pool thread is preempted
    between appending its last result and returning."""

    def submit(self, fn, *args):
        import concurrent.futures
        import threading

        fut = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        fn(*args)
        threading.Timer(0.05, fut.set_result, args=(None,)).start()
        return fut


def test_read_ahead_hands_out_every_result_when_a_call_ends_after_its_results_were_taken():
    # before: the consumer took a call's last result while its future was still running, then spun
    # for good on the finished call (seen as a cold epoch of bench/coldwarm.py that never ended)
    from ucmagic.files.fetch import read_ahead

    items = list(range(6))
    assert list(read_ahead(lambda i: i * 10, items, depth=1, pool=_LateFuturePool())) == [i * 10 for i in items]
    assert list(read_ahead(lambda i: i * 10, items, depth=3, pool=_LateFuturePool())) == [i * 10 for i in items]


def test_a_daemon_pool_runs_every_call_and_reuses_the_threads_that_wait_instead_of_starting_more():
    pool = DaemonPool(8, "test")
    go, started, done = threading.Event(), threading.Semaphore(0), threading.Semaphore(0)

    def call() -> None:
        started.release()
        assert go.wait(PATIENCE)
        done.release()

    for _ in range(4):  # four calls in flight at once: four threads
        pool.post(call)
    for _ in range(4):
        assert started.acquire(timeout=PATIENCE)
    go.set()
    for _ in range(4):
        assert done.acquire(timeout=PATIENCE)
    idle = pool._idle  # one token per thread waiting for a call
    wait_until(lambda: idle.qsize() == 4, "four threads waiting")
    for i in range(20):  # calls one after another: a waiting thread takes each, none is started
        assert pool.submit(lambda i=i: i * i).result(timeout=PATIENCE) == i * i
        wait_until(lambda: idle.qsize() == 4, "the thread back to waiting")
    assert len(pool._threads) == 4
    futures = [pool.submit(lambda i=i: i * i) for i in range(40)]  # a burst: up to max_workers threads
    assert [f.result(timeout=PATIENCE) for f in futures] == [i * i for i in range(40)]
    assert 4 <= len(pool._threads) <= 8
    pool.shutdown()
    with pytest.raises(RuntimeError):
        pool.post(call)


_POOL_AT_EXIT = """
import os, sys, threading, time
import numpy as np, torch
from ucmagic._util import DaemonPool
LOG = sys.argv[1]
pool = DaemonPool(1, "exit")
running = threading.Event()
def in_flight():
    running.set()
    deadline = time.monotonic() + 60
    while not pool._exiting and time.monotonic() < deadline:  # still running when the exit stops the pool
        time.sleep(0.01)
    batch = {"x": torch.from_numpy(np.arange(1000))}  # the call's last reference to a tensor from numpy
    with open(LOG, "a") as f:
        f.write("ended\\n")
    del batch
def queued():
    with open(LOG, "a") as f:
        f.write("queued ran\\n")
hung = DaemonPool(1, "hung")
hung.post(time.sleep, 600)  # a read stuck in a hung mount
pool.post(in_flight)
pool.post(queued)
running.wait(60)
"""

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_at_exit_a_pool_call_in_flight_ends_before_the_interpreter_is_finalized_and_queued_calls_are_dropped(tmp_path):
    """A pool thread that frees a tensor made from numpy while the interpreter is finalized aborts the process
    ("terminate called without an active exception"; 1 exit in 20 of a table scan left mid-epoch): the exit
    waits for the call in flight, drops the queued one, and does not wait for a call stuck in a hung read."""
    log = tmp_path / "log"
    script = tmp_path / "child.py"
    script.write_text(_POOL_AT_EXIT)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.run([sys.executable, str(script), str(log)], capture_output=True, text=True, env=env,
                       timeout=120)  # the hung call would end after 600 s
    assert p.returncode == 0 and "terminate called" not in p.stderr, p.stderr
    assert log.read_text().splitlines() == ["ended"]
