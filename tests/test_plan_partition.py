"""Property tests of the partition plan: no overlap, no gap, equal ranks, stable shuffles."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic import plan


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
