"""``ucmagic.mix``: seeded proportions, the same sequence every run, resumable, split under workers."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ucmagic
from ucmagic.shards import TokenWindows
from ucmagic.shards.mix import Schedule, choices


@pytest.fixture
def two(tmp_path):
    """Two token datasets whose windows tell where they came from: a holds 0..n, b holds 50000+."""
    for name, base, n in (("a", 0, 40_000), ("b", 50_000, 15_000)):
        (tmp_path / name).mkdir()
        (np.arange(n, dtype=np.uint32) + base).tofile(tmp_path / name / "t.bin")
    cache = str(tmp_path / "cache")

    def make(**kw):
        return [TokenWindows(tmp_path / n, block_size=10, dtype="uint32", target=False, cache_dir=cache,
                             chunk_size=4096).stream(**kw) for n in ("a", "b")]
    return make


def source(w: torch.Tensor) -> int:
    return int(w[0] >= 50_000)


def test_choices_follow_the_weights_and_are_pure():
    c = choices([0.7, 0.3], seed=1, epoch=0, start=0, count=20_000)
    assert abs(np.mean(c == 0) - 0.7) < 0.015
    assert np.array_equal(c[5000:6000], choices([0.7, 0.3], 1, 0, 5000, 1000))  # any window, same draws
    assert not np.array_equal(c[:1000], choices([0.7, 0.3], 1, 1, 0, 1000))  # epochs differ


def test_the_schedule_ends_before_a_source_runs_out():
    sch = Schedule([0.5, 0.5], seed=0, epoch=0, sizes=[10_000, 3000])
    c = choices([0.5, 0.5], 0, 0, 0, sch.total + 1)
    counts = np.bincount(c[:sch.total], minlength=2)
    assert counts[1] == 3000 and counts[0] <= 10_000 and c[sch.total] == 1  # the next one would need a 3001st
    for p in (0, 1, 4095, 4096, 5000, sch.total):
        assert sch.before(p).tolist() == np.bincount(c[:p], minlength=2).tolist()


def test_mix_proportions_deterministic_and_ending_at_the_first_exhausted(two):
    m = ucmagic.mix(two(), weights=[0.7, 0.3], seed=4)
    n = len(m)
    got = [source(w) for w in m]
    again = [source(w) for w in ucmagic.mix(two(), weights=[0.7, 0.3], seed=4)]
    assert got == again and len(got) == n
    share_b = sum(got) / len(got)
    assert abs(share_b - 0.3) < 0.03
    assert got.count(1) == 1500  # b (1,500 windows) ran out: the epoch ended there
    windows = [tuple(w.tolist()) for w in ucmagic.mix(two(), weights=[0.7, 0.3], seed=4)]
    assert len(set(windows)) == len(windows)  # no window twice


def test_mix_resumes_exactly_mid_epoch(two):
    full = [w.tolist() for w in ucmagic.mix(two(shuffle=True, seed=2), [0.6, 0.4], seed=1)]
    m = ucmagic.mix(two(shuffle=True, seed=2), [0.6, 0.4], seed=1)
    it = iter(m)
    head = [next(it).tolist() for _ in range(777)]
    state = json.loads(json.dumps(m.state_dict()))
    it.close()
    m2 = ucmagic.mix(two(shuffle=True, seed=2), [0.6, 0.4], seed=1)
    m2.load_state_dict(state)
    assert head + [w.tolist() for w in m2] == full


def test_mix_under_workers_is_one_split_order_and_resumes_with_other_workers(two):
    whole = sorted(tuple(w.tolist()) for w in ucmagic.mix(two(shuffle=True), weights=[0.5, 0.5], seed=0))
    dl = torch.utils.data.DataLoader(ucmagic.mix(two(shuffle=True), weights=[0.5, 0.5], seed=0),
                                     batch_size=None, num_workers=2)
    assert sorted(tuple(w.tolist()) for w in dl) == whole  # the workers split one order: nothing twice, no gap
    loader = ucmagic.DataLoader(ucmagic.mix(two(shuffle=True), [0.5, 0.5], seed=0), batch_size=16, num_workers=2,
                                log_to_mlflow=False)
    seen = []
    for n, batch in enumerate(loader):
        seen += [tuple(w.tolist()) for w in batch]
        if n == 20:
            break
    state = json.loads(json.dumps(loader.state_dict()))
    again = ucmagic.DataLoader(ucmagic.mix(two(shuffle=True), [0.5, 0.5], seed=0), batch_size=16, num_workers=3,
                               log_to_mlflow=False)
    again.load_state_dict(state)
    rest = [tuple(w.tolist()) for b in again for w in b]
    assert sorted(seen + rest) == whole


def test_mix_refuses_bad_weights_and_sources(two):
    with pytest.raises(ValueError, match="one weight per dataset"):
        ucmagic.mix(two(), weights=[1.0])
    with pytest.raises(ValueError, match=">= 0"):
        ucmagic.mix(two(), weights=[1.0, -1.0])
    with pytest.raises(TypeError, match="shard datasets"):
        ucmagic.mix([range(10)])
