"""``ucmagic.mix``: seeded proportions, the same sequence every run, resumable, split under workers."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ucmagic
from ucmagic.shards import TokenWindows
from ucmagic.shards.mix import choices


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
    c = choices([0.7, 0.3], seed=1, epoch=0, stream=0, start=0, count=20_000)
    assert abs(np.mean(c == 0) - 0.7) < 0.015
    assert np.array_equal(c[5000:6000], choices([0.7, 0.3], 1, 0, 0, 5000, 1000))  # any window, same draws
    assert not np.array_equal(c[:1000], choices([0.7, 0.3], 1, 1, 0, 0, 1000))  # epochs differ
    assert not np.array_equal(c[:1000], choices([0.7, 0.3], 1, 0, 1, 0, 1000))  # streams differ


@pytest.mark.timeout(60)
def test_mix_proportions_deterministic_and_ending_at_the_first_exhausted(two):
    m = ucmagic.mix(two(), weights=[0.7, 0.3], seed=4)
    got = [source(w) for w in m]
    again = [source(w) for w in ucmagic.mix(two(), weights=[0.7, 0.3], seed=4)]
    assert got == again
    share_b = sum(got) / len(got)
    assert abs(share_b - 0.3) < 0.03
    assert min(got.count(0), got.count(1)) in (4000, 1500)  # one source ran out: the epoch ended there


@pytest.mark.timeout(60)
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


@pytest.mark.timeout(120)
def test_mix_under_dataloader_workers_splits_each_source(two):
    m = ucmagic.mix(two(), weights=[0.5, 0.5], seed=0)
    dl = torch.utils.data.DataLoader(m, batch_size=None, num_workers=2)
    got = [tuple(w.tolist()) for w in dl]
    assert len(got) == len(set(got))  # no window twice: each worker reads its own part of each source
    assert abs(sum(w[0] >= 50_000 for w in got) / len(got) - 0.5) < 0.05


def test_mix_refuses_bad_weights(two):
    with pytest.raises(ValueError, match="one weight per dataset"):
        ucmagic.mix(two(), weights=[1.0])
    with pytest.raises(ValueError, match=">= 0"):
        ucmagic.mix(two(), weights=[1.0, -1.0])
