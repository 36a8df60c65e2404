"""Property tests of the partition plan: no overlap, no gap, equal ranks, stable shuffles."""
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic import ResumeOrderError
from ucmagic.files import plan


def all_streams(pool, world, workers, mode, quantum):
    return [[plan.positions(plan.stream_positions(pool, world, r, workers, w, mode, quantum)).tolist()
             for w in range(workers)] for r in range(world)]


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 400), world=st.integers(1, 9), workers=st.integers(1, 7), quantum=st.integers(1, 33))
def test_single_rank_delivers_every_item_exactly_once(n, world, workers, quantum):
    streams = all_streams([(0, n)], 1, workers, "pad", quantum)[0]
    flat = sorted(p for s in streams for p in s)
    assert flat == list(range(n))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 400), world=st.integers(2, 9), workers=st.integers(1, 7), quantum=st.integers(1, 33),
       mode=st.sampled_from(["pad", "drop"]))
def test_ranks_are_equal_and_cover_without_overlap(n, world, workers, quantum, mode):
    streams = all_streams([(0, n)], world, workers, mode, quantum)
    per_rank = [sum(len(s) for s in r) for r in streams]
    assert len(set(per_rank)) == 1  # equal lengths: collectives cannot hang
    flat = [p for r in streams for s in r for p in s]
    if mode == "pad":
        assert set(flat) == set(range(n))  # no gap
        assert len(flat) - n < world  # padding is at most world-1 items
    else:
        assert len(flat) == len(set(flat)) == (n // world) * world  # no overlap, remainder dropped
    if mode == "pad" and n >= world:
        # with padding, only the wrap-around repeats items
        assert len(flat) - len(set(flat)) == len(flat) - n


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 500), workers=st.integers(1, 8), quantum=st.integers(1, 40))
def test_batches_align_so_only_one_short_batch_per_rank(n, workers, quantum):
    sizes = plan.split_counts(n, workers, quantum)
    assert sum(sizes) == n
    assert sum(1 for s in sizes if s % quantum) <= 1
    full = [s // quantum for s in sizes]
    assert max(full) - min(full) <= 1


@settings(max_examples=100, deadline=None)
@given(n=st.integers(0, 300), seed=st.integers(0, 2**31), epoch=st.integers(0, 50))
def test_shuffle_is_a_seeded_permutation_that_changes_per_epoch(n, seed, epoch):
    a = plan.epoch_order(n, seed=seed, epoch=epoch, shuffle=True)
    assert sorted(a.tolist()) == list(range(n))
    assert np.array_equal(a, plan.epoch_order(n, seed=seed, epoch=epoch, shuffle="global"))
    if n > 8:
        assert not np.array_equal(a, plan.epoch_order(n, seed=seed, epoch=epoch + 1, shuffle=True))


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 300), nodes=st.integers(2, 4), local=st.integers(1, 4), epoch=st.integers(0, 20))
def test_node_affine_shuffle_keeps_each_nodes_files_across_epochs(n, nodes, local, epoch):
    world = nodes * local
    blocks = plan.node_blocks(n, world, local, "pad")
    a = plan.epoch_order(n, seed=1, epoch=epoch, shuffle="node", blocks=blocks)
    b = plan.epoch_order(n, seed=1, epoch=epoch + 1, shuffle="node", blocks=blocks)
    assert sorted(a.tolist()) == list(range(n))
    for lo, hi in blocks:
        assert set(a[lo:hi].tolist()) == set(range(lo, hi)) == set(b[lo:hi].tolist())
    # and the node's ranks read (almost only) from the node's block
    c = plan.per_rank(n, world, "pad")
    for k, (lo, hi) in enumerate(blocks):
        for r in range(k * local, (k + 1) * local):
            pos = plan.positions(plan.stream_positions([(0, n)], world, r, 1, 0, "pad"))
            own = [p for p in pos.tolist() if lo <= p < hi]
            assert len(pos) - len(own) <= max(0, world * c - n)  # only padding leaves the node


def test_range_helpers():
    assert plan.normalize([(5, 7), (0, 2), (2, 3), (6, 9), (4, 4)]) == [(0, 3), (5, 9)]
    assert plan.subtract([(0, 10)], [(2, 4), (8, 20)]) == [(0, 2), (4, 8)]
    assert plan.take([(0, 3), (10, 13)], 2, 5) == [(2, 3), (10, 12)]
    assert plan.take_wrapped([(0, 3)], 2, 7) == [(2, 3), (0, 3), (0, 1)]
    assert plan.per_rank(10, 4, "pad") == 3 and plan.per_rank(10, 4, "drop") == 2 and plan.per_rank(10, 1) == 10


def test_round_robin_model_of_workers():
    # 3 workers with 1, 3 and 2 batches: w0 w1 w2 | w1 w2 | w1
    assert plan.round_robin_taken([1, 3, 2], 0) == [0, 0, 0]
    assert plan.round_robin_taken([1, 3, 2], 4) == [1, 2, 1]
    assert plan.round_robin_taken([1, 3, 2], 6) == [1, 3, 2]
    assert plan.items_delivered([10, 25, 20], 10, False, 4) == [10, 20, 10]


@settings(max_examples=100, deadline=None)
@given(n=st.integers(1, 300), nodes=st.integers(2, 5), local=st.integers(1, 3), every=st.integers(1, 3),
       epoch=st.integers(0, 12))
def test_node_slices_rotate_every_n_epochs(n, nodes, local, every, epoch):
    world = nodes * local
    blocks = plan.node_blocks(n, world, local, "pad")
    a = plan.epoch_order(n, seed=2, epoch=epoch, shuffle="node", blocks=blocks, reshuffle_every=every)
    assert sorted(a.tolist()) == list(range(n))  # still a permutation
    same = plan.epoch_order(n, seed=2, epoch=(epoch // every) * every, shuffle="node", blocks=blocks,
                            reshuffle_every=every)
    for lo, hi in blocks:  # within a rotation period, every node keeps its set of files
        assert set(a[lo:hi].tolist()) == set(same[lo:hi].tolist())
    nxt = plan.epoch_order(n, seed=2, epoch=(epoch // every + 1) * every, shuffle="node", blocks=blocks,
                           reshuffle_every=every)
    lo, hi = blocks[0]
    if 0 < hi - lo < n:
        assert set(nxt[lo:hi].tolist()) != set(a[lo:hi].tolist())  # and then the slices move on


# ---------------------------------------------------------------- array-free order (Feistel)

SPECIAL_N = [0, 1, 2, 3, 4, 5, 7, 8, 16, 17, 31, 32, 33, 64, 97, 127, 128, 129, 1023, 1024, 1025, 4099]
sizes = st.one_of(st.sampled_from(SPECIAL_N), st.integers(0, 3000))
seeds = st.integers(-(2**63), 2**64 - 1)


@settings(max_examples=300, deadline=None)
@given(n=sizes, seed=seeds, epoch=st.integers(0, 10**6))
def test_permute_is_a_permutation_for_every_n_seed_and_epoch(n, seed, epoch):
    perm = plan.permute(n, seed, epoch, np.arange(n))
    assert perm.dtype == np.int64 and sorted(perm.tolist()) == list(range(n))


def test_orders_differ_between_epochs_and_seeds_and_are_not_the_listing_order():
    n = 1000
    base = plan.permute(n, 0, 0, np.arange(n))
    assert base.tolist() != list(range(n))
    assert plan.permute(n, 0, 1, np.arange(n)).tolist() != base.tolist()
    assert plan.permute(n, 1, 0, np.arange(n)).tolist() != base.tolist()
    with pytest.raises(ValueError, match="positions"):
        plan.permute(n, 0, 0, np.array([n]))


def test_permute_is_the_same_in_another_process():
    code = ("import numpy as np, sys; from ucmagic.files import plan; "
            "sys.stdout.write(','.join(map(str, plan.permute(10007, 42, 3, np.arange(0, 10007, 13)))))")
    env = dict(os.environ, PYTHONHASHSEED="123")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout
    here = plan.permute(10007, 42, 3, np.arange(0, 10007, 13)).tolist()
    assert [int(x) for x in out.split(",")] == here


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 500), nodes=st.integers(1, 5), lws=st.integers(1, 3), epoch=st.integers(0, 9),
       every=st.sampled_from([None, 1, 2]), mode=st.sampled_from(["pad", "drop"]), seed=st.integers(0, 99))
def test_node_affine_order_keeps_each_nodes_files_like_the_array_order(n, nodes, lws, epoch, every, mode, seed):
    world = nodes * lws
    blocks = plan.node_blocks(n, world, lws, mode)
    new = plan.order_at(n, np.arange(n), seed=seed, epoch=epoch, shuffle="node", blocks=blocks,
                        reshuffle_every=every)
    old = plan.epoch_order(n, seed=seed, epoch=epoch, shuffle="node", blocks=blocks, reshuffle_every=every)
    assert sorted(new.tolist()) == list(range(n))
    for a, b in blocks:  # the same files on each node as before, in a new order
        assert sorted(new[a:b].tolist()) == sorted(old[a:b].tolist())
    if n and epoch == 0 and every is None:
        other = plan.order_at(n, np.arange(n), seed=seed, epoch=epoch + 1, shuffle="node", blocks=blocks)
        for a, b in blocks:  # a node keeps its slice from epoch to epoch
            assert sorted(other[a:b].tolist()) == sorted(new[a:b].tolist())


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 400), world=st.integers(1, 6), workers=st.integers(1, 4), quantum=st.integers(1, 9),
       shuffle=st.sampled_from([False, "global", "node"]), epoch=st.integers(0, 5), chunk=st.integers(1, 50),
       delivered=st.integers(0, 400))
def test_streams_over_order_chunks_deliver_every_file_once_and_resume_the_rest(n, world, workers, quantum, shuffle,
                                                                                epoch, chunk, delivered):
    blocks = plan.node_blocks(n, world, 1, "pad") if shuffle == "node" else None
    kw = {"seed": 7, "epoch": epoch, "shuffle": shuffle, "blocks": blocks}
    full = plan.order_at(n, np.arange(n), **kw)

    def stream_files(pool, r, w):
        rs = plan.stream_positions(pool, world, r, workers, w, "pad", quantum)
        parts = list(plan.order_chunks(n, rs, chunk=chunk, **kw))
        got = np.concatenate(parts).tolist() if parts else []
        assert got == full[plan.positions(rs)].tolist()  # chunked == indexing the whole order
        return got

    pool = [(0, n)]
    files = [f for r in range(world) for w in range(workers) for f in stream_files(pool, r, w)]
    assert set(files) == set(range(n))
    # resume after every stream delivered some items: the rest, on a single process, completes the epoch
    spans = plan.stream_spans(n, world, workers, "pad", quantum)
    done_counts = [min(delivered, b - a) for a, b in spans]
    done = {f for (r, w), k in zip([(r, w) for r in range(world) for w in range(workers)], done_counts)
            for f in stream_files(pool, r, w)[:k]}
    left = plan.remaining_pool(pool, world, workers, "pad", quantum, done_counts)
    rest = np.concatenate(list(plan.order_chunks(n, left, chunk=chunk, **kw)) or [np.zeros(0, np.int64)])
    assert done.isdisjoint(rest.tolist()) and done | set(rest.tolist()) == set(range(n))


def test_a_state_saved_under_the_old_order_is_refused():
    with pytest.raises(ResumeOrderError, match="set_epoch"):
        plan.check_order_version({"version": 1, "epoch": 3})
    with pytest.raises(ResumeOrderError):
        plan.check_order_version({"order_version": plan.ORDER_VERSION + 1})
    plan.check_order_version({"order_version": plan.ORDER_VERSION})  # the current order resumes
    with pytest.raises(ResumeOrderError):
        plan.check_order_version({"version": 1, "shuffle": True, "epoch": 3})
    plan.check_order_version({"version": 1, "shuffle": False, "epoch": 3})  # unshuffled: one order in every version
