"""Protection windows and read-ahead sized to fit a budget (ucmagic.files.windows): pure, no I/O."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucmagic.errors import BudgetTooSmallError
from ucmagic.files.windows import MIN_WINDOW, Sizing, WindowPolicy

policies = st.builds(WindowPolicy, lease_items=st.integers(1, 2048), typical=st.integers(1, 1 << 24),
                     files=st.integers(1, 1 << 20))


@given(policies, st.integers(1, 1 << 40), st.integers(1, 64), st.booleans())
def test_a_budget_too_small_for_the_least_window_fails_at_once_and_names_the_size(p, budget, streams, reported):
    least = p.least(reported)
    if budget // streams >= least * p.typical:
        s = p.protection(budget, streams, reported)
        assert s.window >= least and s.read_ahead_bytes >= 1
    else:
        with pytest.raises(BudgetTooSmallError, match="set cache_limit to at least"):
            p.protection(budget, streams, reported)


@given(policies, st.integers(1, 1 << 40), st.integers(1, 16))
def test_an_unreported_window_is_between_the_least_and_lease_items(p, budget, streams):
    if budget // streams < p.least(False) * p.typical:
        return
    s = p.protection(budget, streams, False)
    assert min(p.lease_items, MIN_WINDOW) <= s.window <= p.lease_items
    # the window and the read-ahead fit the stream's share (the least window aside)
    share = budget // streams
    if s.window > p.least(False):
        assert s.window * p.typical + s.read_ahead_bytes <= share + p.typical


@given(policies, st.integers(1, 1 << 40), st.integers(1, 8), st.integers(2, 64))
def test_a_share_with_other_processes_holds_window_step_read_ahead_and_cover(p, budget, streams, extra):
    live = streams + extra
    s = p.sized(budget, streams, False, live)
    files = budget // live // p.typical
    if files >= 8:  # enough files for every part to get its fraction
        held = s.window + max(1, s.window // 4) + s.read_ahead_bytes // p.typical + (s.cover or 0)
        assert held <= files


def test_no_budget_keeps_lease_items_and_the_given_read_ahead():
    assert WindowPolicy(256, 1000, 10).protection(None, 4, False, unbudgeted_bytes=123) == Sizing(256, 123)


def test_reports_need_one_file_and_the_window_is_lease_items():
    p = WindowPolicy(lease_items=160, typical=1000, files=100)
    s = p.protection(budget=3000, streams=2, reported=True)
    assert s.window == 160 and s.read_ahead_bytes == 1500
