"""Robustness defaults as pure decisions: retries that survive a flaky volume, a timeout on stalls only."""
import random

from hypothesis import given
from hypothesis import strategies as st

from ucmagic._util import DEFAULT_RETRIES, RetryPolicy
from ucmagic.files.dataset import UCVolumeDataset
from ucmagic.files.fetch import PERMANENT, stall_check

import inspect


def exhaustion_odds(failure_rate: float, retries: int, files: int) -> float:
    """Chance that at least one of ``files`` copies fails all ``retries + 1`` tries when each try
    fails independently with ``failure_rate``."""
    return 1.0 - (1.0 - failure_rate ** (retries + 1)) ** files


def worst_case_wait(policy: RetryPolicy) -> float:
    """The longest total sleep before the last try (every delay at its full jitter)."""
    return sum(min(policy.cap, policy.base * policy.factor ** i) for i in range(policy.retries)) * (1 + policy.jitter)


def test_default_retries_survive_a_volume_failing_one_open_in_three():
    assert exhaustion_odds(1 / 3, DEFAULT_RETRIES, 100_000) < 0.01
    assert exhaustion_odds(1 / 3, 5, 2_000) > 0.5  # the old default did not
    assert inspect.signature(UCVolumeDataset).parameters["retries"].default == DEFAULT_RETRIES


def test_default_retries_give_up_within_a_bounded_time():
    policy = RetryPolicy(DEFAULT_RETRIES, PERMANENT)
    assert worst_case_wait(policy) < 30
    for seed in range(20):  # every drawn schedule stays within the bound, each sleep within the cap
        delays = policy.delays(random.Random(seed))
        assert len(delays) == DEFAULT_RETRIES and sum(delays) <= worst_case_wait(policy)
        assert max(delays) <= policy.cap * (1 + policy.jitter)


def test_a_copy_that_keeps_writing_never_times_out():
    since, seen = 0.0, None
    for step in range(1, 1000):  # 10 GiB at a slow 10 MB/s: ~1,000 s, far past the timeout
        now = step * 1.0
        expired, since = stall_check(now, since, 120.0, seen, (step * 10 << 20, 0))
        seen = (step * 10 << 20, 0)
        assert not expired and since == now


def test_a_hung_copy_times_out_after_the_timeout_without_progress():
    since, seen = 0.0, None
    expired, since = stall_check(0.5, since, 2.0, seen, (0, 0))  # first look: the baseline
    seen = (0, 0)
    assert not expired and since == 0.5
    assert stall_check(2.0, since, 2.0, seen, (0, 0)) == (False, 0.5)
    assert stall_check(2.6, since, 2.0, seen, (0, 0)) == (True, 0.5)


@given(st.floats(0, 1e4), st.floats(0, 1e4), st.floats(0.1, 1e3))
def test_without_a_probe_the_timeout_bounds_the_whole_call(since, elapsed, timeout):
    now = since + elapsed
    expired, new_since = stall_check(now, since, timeout, None, None)
    assert new_since == since and expired == (now - since > timeout)
