"""The lease (ucmagic.files.lease): the pure span rule checked exhaustively, the consumption channel's named
layout, and a stream's lease driven through its call order with a fake cache that keeps records in memory."""
from __future__ import annotations

import errno

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic.errors import CacheFullError
from ucmagic.files.lease import (LAYOUT, NO_REPORTS, ChannelLayout, ConsumptionChannel, Cursor, LeaseRecord,
                                 StreamLease, UNBUDGETED_STEP, lease_span, released)
from ucmagic.files.windows import Sizing


# ---------------------------------------------------------------- the pure rule

@st.composite
def cursors(draw):
    n = draw(st.integers(0, 200))
    yielded = draw(st.integers(0, n))
    ahead = draw(st.integers(yielded, n))
    lo = draw(st.integers(0, yielded))
    hi = draw(st.integers(max(lo, ahead), n))  # the record covers what was looked up (the invariant kept)
    return Cursor(n, lo, hi, ahead, yielded, draw(st.booleans()))


@given(cursors(), st.none() | st.integers(0, 250), st.integers(1, 300), st.integers(1, 64),
       st.none() | st.integers(0, 250), st.booleans())
def test_a_span_keeps_every_item_the_loop_may_still_open_and_never_moves_back(c, consumed, window, chunk, want,
                                                                              retired):
    if want is not None:
        want = min(want, max(0, c.n - 1))
    lo, hi = lease_span(c, consumed, Sizing(window, 0), chunk=chunk, want=want, retired=retired)
    assert c.lo <= lo <= hi <= max(c.n, c.hi)  # the start never moves back; never past the stream
    free = released(c.yielded, consumed, window, retired=retired)
    assert free <= c.yielded
    assert lo == max(c.lo, free)  # exactly what the loop is done with is released
    if not c.finished:
        # every handed-out item not released stays covered, and what was looked up ahead too
        assert lo <= max(free, c.lo) and hi >= min(c.hi, max(c.yielded, lo))
        if want is not None and c.n and want >= c.hi:
            assert lo <= want < hi  # the position about to be looked up is named first
    else:
        assert hi <= max(lo, c.yielded)  # an ended stream keeps only what was handed out


def test_released_follows_reports_else_a_window_and_everything_once_retired():
    assert released(10, 4, 3) == 4
    assert released(10, 40, 3) == 10  # a report past what was handed out: all of it
    assert released(10, None, 3) == 7  # no reports: the last 3 handed out stay
    assert released(2, None, 3) == 0
    assert released(10, 0, 3, retired=True) == 10


def test_a_smaller_chunk_shrinks_the_span_to_what_was_looked_up():
    c = Cursor(100, 0, 50, 10, 5)
    assert lease_span(c, 0, Sizing(100, 0), chunk=8) == (0, 18)
    assert lease_span(c, 0, Sizing(100, 0), chunk=8, want=60) == (0, 68)


# ---------------------------------------------------------------- the channel

def test_the_channel_layout_is_named_and_a_stream_reads_its_slot_per_iteration():
    assert (LAYOUT.streams, LAYOUT.tracked, LAYOUT.generation, LAYOUT.size) == (64, 64, 65, 66)
    chan = ConsumptionChannel(layout=ChannelLayout(streams=2))
    r0, r5 = chan.reader(0), chan.reader(5)
    assert r0.consumed() is None and not r0.retired()  # nobody reports yet
    chan.reset(2)
    r0 = chan.reader(0)  # bound to this iteration
    chan[0] = 3
    chan[5] = 9  # past the slots: dropped
    assert r0.consumed() == 3 and r5.consumed() is None and not r0.retired()
    chan.retire()  # the loop left: the stream is stale, all it handed out counts as consumed
    assert r0.retired() and not chan.reader(0).retired()
    chan.reset(2)
    assert r0.retired() and chan.reader(1).consumed() == 0
    assert NO_REPORTS.consumed() is None and not NO_REPORTS.retired()


# ---------------------------------------------------------------- a stream's lease, with a fake cache

class FakeRecords:
    def __init__(self) -> None:
        self.records: dict[str, list[str]] = {}
        self.writes = 0
        self.full = False

    def record_path(self, owner, slot):
        return f"{owner}.{slot}.rec"

    def write_record(self, path, names):
        if self.full:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.writes += 1
        self.records[path] = list(names)

    def drop_record(self, path):
        self.records.pop(path, None)


class FakeKeeper:
    def disk_full(self, size):
        return CacheFullError(f"full: {size}")


class FakeCache:
    def __init__(self) -> None:
        self.records = FakeRecords()
        self.budget_keeper = FakeKeeper()


class Names:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def names(self, lo, hi):
        return [f"e{i}" for i in range(lo, hi)]


def _lease(n=100, **kw):
    cache = FakeCache()
    record = LeaseRecord(cache, "me", kw.pop("slot", 0))  # type: ignore[arg-type]
    kw.setdefault("quantum", 1)
    kw.setdefault("window", 4)
    kw.setdefault("chunk", 8)
    return cache, StreamLease(record, Names(n), **kw)


def test_a_lease_names_what_is_looked_up_and_releases_behind_a_window_without_reports():
    cache, lease = _lease(window=4, chunk=8)
    rec = cache.records.records
    lease.cover(0)
    assert rec["me.0.rec"] == [f"e{i}" for i in range(8)]
    for pos in range(70):
        lease.cover(pos)
        lease.handed(pos)
    names = rec["me.0.rec"]
    assert "e69" in names and "e65" in names  # the last window handed out stays named
    assert "e0" not in names  # released with the covers ahead (each write names the span anew)
    lease.finish()
    # no reports: the last window stays named (the loop may still hold those items), and writes stop
    assert rec["me.0.rec"] == ["e66", "e67", "e68", "e69"] and lease.record.stopped


def test_without_a_budget_items_handed_out_are_released_in_large_steps_between_covers():
    """Each release is a record write: without a budget (only the free-disk floor evicts) what was
    handed out past the window goes UNBUDGETED_STEP items at a time (a warm run's length), not per item."""
    n = 2 * UNBUDGETED_STEP
    cache, lease = _lease(n, window=4, chunk=n)
    rec = cache.records
    lease.cover(0)  # one cover names every item
    writes = rec.writes
    for pos in range(UNBUDGETED_STEP + 3):
        lease.handed(pos)
    assert rec.writes == writes and "e0" in rec.records["me.0.rec"]  # nothing released yet
    lease.handed(UNBUDGETED_STEP + 3)  # the window (4 items) and a whole step handed out
    assert rec.writes == writes + 1 and rec.records["me.0.rec"][0] == f"e{UNBUDGETED_STEP}"


def test_with_reports_exactly_the_unconsumed_stay_named_and_a_retired_loop_releases_all():
    chan = ConsumptionChannel()
    chan.reset(1)
    cache, lease = _lease(consumption=chan.reader(0), budgeted=True, window=1)
    rec = cache.records.records
    for pos in range(10):
        lease.cover(pos)
        lease.handed(pos)
    chan[0] = 6
    lease.refresh()
    assert rec["me.0.rec"][0] == "e6" and "e9" in rec["me.0.rec"]
    assert lease.may_exceed(6) and not lease.may_exceed(9)  # the loop waits on item 6 next
    lease.finish()
    assert rec["me.0.rec"] == ["e6", "e7", "e8", "e9"]  # handed out, not consumed: kept past the end
    chan.retire()
    assert lease.retired() and lease.may_exceed(50)
    lease.refresh()
    assert rec == {}
    lease.stop()


def test_an_abandoned_iteration_keeps_nothing_and_a_next_iteration_stops_the_last():
    cache, first = _lease()
    first.cover(3)
    first.finish(abandoned=True)
    assert cache.records.records == {}
    first.cover(40)  # dropped: no more writes
    assert cache.records.records == {}
    cache, first = _lease()
    first.cover(3)
    named = dict(cache.records.records)
    _lease()  # the next iteration of the stream (its record's path): the last one writes no more
    first.cover(40)
    assert cache.records.records == named


def test_a_last_iteration_never_drops_the_record_its_next_iteration_writes():
    """A DataLoader worker's next epoch writes the record its last epoch's refresher may still drop: once the next
    iteration took the path over (its record stops the last one's), the last one's drop leaves it. Before,
    the file was unlinked and its descriptor closed under the new writer (CI: EBADF in a worker's first write of
    an epoch, and that rank's training ended one step short: the other rank hung in DDP)."""
    cache = FakeCache()
    first = LeaseRecord(cache, "me", 0)  # type: ignore[arg-type]
    first.write(["a"])
    second = LeaseRecord(cache, "me", 0)  # type: ignore[arg-type]  # the next iteration: the last one stops
    second.write(["b"])
    first.drop()  # the last iteration's refresher, a moment late
    assert cache.records.records == {"me.0.rec": ["b"]}
    second.write(["c"])
    assert cache.records.records == {"me.0.rec": ["c"]}


def test_a_record_is_written_only_when_its_names_change_and_a_full_disk_says_so():
    cache = FakeCache()
    rec = LeaseRecord(cache, "me", "c")  # type: ignore[arg-type]
    rec.write(["a", "b"])
    rec.write(["a", "b"])
    assert cache.records.writes == 1
    cache.records.full = True
    with pytest.raises(CacheFullError):
        rec.write(["a", "b", "c"])
    assert cache.records.records["me.c.rec"] == ["a", "b"]  # the old names stay
    rec.drop()
    rec.write(["x"])  # dropped: stopped
    assert "me.c.rec" not in cache.records.records


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(1, 8), st.integers(1, 16), st.lists(st.integers(0, 3), max_size=80))
def test_a_stream_under_reports_never_unnames_an_item_handed_out_and_not_consumed(n, window, chunk, steps):
    """Random interleavings of look-ups ahead, hand-outs and consumption reports: at every step the
    record names each position the loop was handed and has not consumed, and each one being looked up."""
    chan = ConsumptionChannel()
    chan.reset(1)
    cache, lease = _lease(n, consumption=chan.reader(0), budgeted=True, window=window, chunk=chunk)
    ahead = handed = consumed = 0
    for s in steps:
        if s == 0 and ahead < n:
            lease.cover(ahead)
            assert f"e{ahead}" in cache.records.records.get("me.0.rec", [])
            ahead += 1
        elif s == 1 and handed < ahead:
            lease.handed(handed)
            handed += 1
        elif s == 2 and consumed < handed:
            consumed += 1
            chan[0] = consumed
        else:
            lease.refresh()
        named = set(cache.records.records.get("me.0.rec", []))
        assert {f"e{i}" for i in range(consumed, handed)} <= named
    lease.finish()
    named = set(cache.records.records.get("me.0.rec", []))
    assert {f"e{i}" for i in range(consumed, handed)} <= named
    lease.stop()
