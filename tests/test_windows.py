"""Protection windows and read-ahead sized to fit a budget (ucmagic.files.windows): pure, no I/O
(but for one check of how a dataset passes its lease_items on)."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucmagic import UCVolumeDataset
from ucmagic.errors import BudgetTooSmallError
from ucmagic.files.windows import DEFAULT_LEASE_ITEMS, MIN_WINDOW, Sizing, WindowPolicy
from ucmagic.testing import make_files
from ucmagic.units import format_size


@st.composite
def policy(draw: st.DrawFn) -> WindowPolicy:
    """A dataset's rules: lease_items left at its default, or set by the user (then the least window)."""
    lease = draw(st.integers(1, 2048))
    return WindowPolicy(lease, draw(st.integers(1, 1 << 24)), draw(st.integers(1, 1 << 20)),
                        least_window=draw(st.sampled_from([None, lease])))


policies = policy()


@given(policies, st.integers(1, 1 << 40), st.integers(1, 64))
def test_a_budget_too_small_for_the_least_window_fails_at_once_and_names_the_size(p, budget, streams):
    """Without consumption reports the handed-out files a loop may still open stay protected: each
    stream's share must hold its least window."""
    least = p.least(False, streams)
    if budget // streams >= least * p.typical:
        s = p.protection(budget, streams, False)
        assert s.window >= least and s.read_ahead_bytes >= 1
    else:
        with pytest.raises(BudgetTooSmallError, match="set cache_limit to at least"):
            p.protection(budget, streams, False)


@given(policies, st.integers(0, 1 << 24), st.integers(1, 1 << 40), st.integers(1, 64))
def test_with_reports_any_budget_of_at_least_the_largest_file_works_for_any_number_of_streams(
        p, extra, budget, streams):
    """Issue 40 item 4: fills beyond the budget wait for room in the loop's order (ucmagic.files.admission),
    so a budget below one file per stream is fine; only one below the largest file can never progress."""
    p = WindowPolicy(p.lease_items, p.typical, p.files, p.least_window, largest=p.typical + extra)
    if budget >= p.largest:
        s = p.protection(budget, streams, True)
        assert s.window == p.lease_items and s.read_ahead_bytes >= 1
    else:
        with pytest.raises(BudgetTooSmallError, match=f"largest file .*at least {format_size(p.largest)}"):
            p.protection(budget, streams, True)


@given(policies, st.integers(1, 1 << 40), st.integers(1, 16))
def test_an_unreported_window_is_between_the_least_and_lease_items(p, budget, streams):
    least = p.least(False, streams)
    if budget // streams < least * p.typical:
        return
    s = p.protection(budget, streams, False)
    assert least <= s.window <= p.lease_items
    # the window and the read-ahead fit the stream's share (the least window aside)
    share = budget // streams
    if s.window > least:
        assert s.window * p.typical + s.read_ahead_bytes <= share + p.typical


@given(policies, st.integers(1, 1 << 40), st.integers(1, 16))
def test_what_an_unreported_loop_holds_fits_its_share_even_at_the_least_window(p, budget, streams):
    """The window, its release step, the files in flight and the cached files covered ahead of the loop
    all stay protected: together they fit the share, where it holds the window and three files more."""
    if budget // streams < p.least(False, streams) * p.typical:
        return
    s = p.protection(budget, streams, False)
    assert s.release is not None and s.cover is not None and s.release >= 1 and s.cover >= 1
    files = budget // streams // p.typical
    held = s.window + s.release + s.read_ahead_bytes // p.typical + s.cover
    assert held <= max(files, s.window + 3)


@given(policies, st.integers(1, 1 << 40), st.integers(1, 8), st.integers(2, 64))
def test_a_share_with_other_processes_holds_window_step_read_ahead_and_cover(p, budget, streams, extra):
    live = streams + extra
    s = p.sized(budget, streams, False, live)
    # never below the least window: files handed to a torch loader's queue are still to be opened
    assert s.window >= p.least(False, streams)
    files = budget // live // p.typical
    if files >= 8 and s.window > p.least(False, streams):  # room beyond the least window: every part gets its fraction
        held = s.window + (s.release or 0) + s.read_ahead_bytes // p.typical + (s.cover or 0)
        assert held <= files


def test_the_least_window_is_64_files_unless_lease_items_was_set(tmp_path):
    assert WindowPolicy(DEFAULT_LEASE_ITEMS, 1000, 10).least(False) == MIN_WINDOW
    assert WindowPolicy(96, 1000, 10).least(False) == MIN_WINDOW  # a loader's choice: not a least window
    assert WindowPolicy(96, 1000, 10, least_window=96).least(False) == 96
    assert WindowPolicy(4, 1000, 10).least(False) == 4
    assert WindowPolicy(96, 1000, 10, least_window=96).least(True) == 1
    make_files(str(tmp_path / "src"), 3, 10)
    ds = UCVolumeDataset(str(tmp_path / "src"), cache_dir=str(tmp_path / "cache"))
    assert ds.lease_items == DEFAULT_LEASE_ITEMS and ds.window_policy().least(False) == MIN_WINDOW
    ds.lease_items = 96  # (prefetch_factor + 1) * batch_size for torch's loader, as docs/cache.md says
    assert ds.window_policy().least(False) == 96
    ds.configure(batch_quantum=32, lease_items=7 * 32)  # what ucmagic.DataLoader sets: it reports consumption
    assert ds.lease_items == 224 and ds.window_policy().least(False) == MIN_WINDOW


def test_other_processes_joining_never_shrink_a_window_below_the_least():
    # the case: 50 KiB files, 14 MB, two processes of 2 torch workers each (a share of 70 files)
    p = WindowPolicy(DEFAULT_LEASE_ITEMS, 50 * 1024, 400)
    assert p.protection(14_000_000, 2, False, live=4).window == MIN_WINDOW
    torch_queue = WindowPolicy(96, 50 * 1024, 400, least_window=96)  # lease_items set to the loader's queue
    assert torch_queue.protection(14_000_000, 2, False, live=4).window == 96
    with pytest.raises(BudgetTooSmallError, match=r"96 files \(the protection window .*lease_items\)"):
        torch_queue.protection(9_000_000, 2, False)


def test_no_budget_keeps_lease_items_and_the_given_read_ahead():
    assert WindowPolicy(256, 1000, 10).protection(None, 4, False, unbudgeted_bytes=123) == Sizing(256, 123)


def test_reports_need_the_largest_file_and_the_window_is_lease_items():
    p = WindowPolicy(lease_items=160, typical=1000, files=100, largest=1200)
    s = p.protection(budget=3000, streams=2, reported=True)
    assert s.window == 160 and s.read_ahead_bytes == 1500
    # the case: 4 files of 512 MiB, 700 MB, 2 workers (before: "cannot hold one file ... for each of 2")
    big = WindowPolicy(DEFAULT_LEASE_ITEMS, 512 << 20, 4, largest=512 << 20)
    assert big.protection(700_000_000, 2, True).read_ahead_bytes == 350_000_000
    with pytest.raises(BudgetTooSmallError, match="at least 536.9 MB"):
        big.protection(500_000_000, 2, True)


def test_the_least_window_is_never_more_than_a_stream_hands_out():
    """10 files of 1 MB under a 30 MB budget: a plain loop or torch's loader needs no window of 64
    files (it used to ask for a budget of 64 MB, and 13.4 GB for one 200 MB file)."""
    few = WindowPolicy(DEFAULT_LEASE_ITEMS, 1_000_000, 10)
    assert few.least(False, 1) == 10 and few.least(False, 4) == 3 and few.least(True, 1) == 1
    assert few.protection(30_000_000, 1, False).window == 10
    with pytest.raises(BudgetTooSmallError, match="at least 10.0 MB"):
        few.protection(9_000_000, 1, False)
    one = WindowPolicy(DEFAULT_LEASE_ITEMS, 200_000_000, 1)
    assert one.protection(300_000_000, 1, False).window == 1
