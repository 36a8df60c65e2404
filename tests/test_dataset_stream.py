"""A dataset's streams under a budget shared by several processes (issue 23 item 1): the smallest
cache_limit of any live process bounds the cache directory, with every process's streams counted."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from ucmagic import UCVolumeDataset
from ucmagic.errors import BudgetTooSmallError
from ucmagic.files.windows import MIN_WINDOW
from ucmagic.testing import make_files

from test_budget import dir_bytes

SIZE = 4096
FILES = 200
# one stream alone: a 64-file window, its release step and read-ahead fit with room to spare (108 of
# 120 files: a stream sized before the other joined holds no more than the budget until it resizes);
# two streams: 60 files each, less than that window
BUDGET = 120 * SIZE

# argv: role ("limit" sets the budget; "free" sets none), source, cache, work dir.
# "limit" creates its dataset first (its budget record is live before the other iterates), waits
# until "free" has handed out 70 files (its window sized for one stream), then iterates; after its
# first item it pauses past RESIZE_S so that "free" has seen the second stream join. Both read
# every path they are handed (a copy evicted under the loop would fail) at ~25 ms an item.
CHILD = r"""
import os, sys, time
from ucmagic import UCVolumeDataset
from ucmagic.files.dataset import RESIZE_S
role, src, cache, work = sys.argv[1:5]
def flag(name):
    open(os.path.join(work, name), "w").close()
def wait_for(name):
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(work, name)):
        assert time.monotonic() < deadline, name
        time.sleep(0.01)
if role == "limit":
    ds = UCVolumeDataset(src, cache_dir=cache, cache_limit=%d, shuffle=True, seed=1)
    flag("limit-ready")
    wait_for("free-running")
else:
    wait_for("limit-ready")
    ds = UCVolumeDataset(src, cache_dir=cache, shuffle=True, seed=2)
n = 0
for i, p in enumerate(ds):
    with open(p, "rb") as f:
        assert f.read(len("part")) == b"part", p
    n += 1
    if role == "free" and i == 70:
        flag("free-running")
    time.sleep(RESIZE_S * 1.5 if role == "limit" and i == 0 else 0.025)
print(n)
""" % BUDGET


@pytest.fixture
def source(tmp_path):
    src = str(tmp_path / "src")
    make_files(src, FILES, SIZE)
    return src


@pytest.mark.timeout(120)
def test_two_processes_on_one_cache_stay_within_the_smallest_budget(tmp_path, source):
    cache, work = str(tmp_path / "cache"), str(tmp_path / "work")
    os.makedirs(work)
    UCVolumeDataset(source, cache_dir=cache)  # the listing is written before the baseline is taken
    meta0 = dir_bytes(cache)
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, role, source, cache, work], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for role in ("limit", "free")]
    peak, deadline = 0, time.monotonic() + 100
    try:
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "the two loops did not finish"
            peak = max(peak, dir_bytes(cache))
            time.sleep(0.005)
        outs = [p.communicate(timeout=10) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
        assert out.split() == [str(FILES)]
    # protection records (~46 B per covered entry: a stream alone covers up to all 200 files here),
    # the usage ledger and lock files written while the loops run
    records = 16 * 1024
    bound = BUDGET + meta0 + records + 2 * SIZE  # the fill each stream's loop waits for may go over
    assert peak <= bound, f"cache directory peaked at {peak:,} B > {bound:,} B"


def test_a_window_shared_with_other_processes_fits_its_share(tmp_path, source):
    ds = UCVolumeDataset(source, cache_dir=str(tmp_path / "cache"))
    alone = ds.window_policy().protection(BUDGET, 1, False)
    assert alone.window == MIN_WINDOW
    shared = ds.window_policy().protection(BUDGET, 1, False, live=2)
    share_files = BUDGET // 2 // SIZE
    assert share_files < MIN_WINDOW
    # the window and its release step, the read-ahead in flight and the items covered ahead fit the share
    held = shared.window + max(1, shared.window // 4) + shared.read_ahead_bytes // SIZE + shared.cover
    assert held <= share_files
    grown = ds.window_policy().protection(BUDGET, 1, False, live=1)
    assert grown == alone


def test_the_first_item_check_is_on_this_process_s_own_share(tmp_path, source):
    ds = UCVolumeDataset(source, cache_dir=str(tmp_path / "cache"))
    ds.window_policy().protection(BUDGET, 1, False, live=8)
    with pytest.raises(BudgetTooSmallError, match="cache_limit"):
        ds.window_policy().protection(BUDGET, 2, False)
