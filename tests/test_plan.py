"""Property tests of the resume math in ucmagic.files.plan: a resume on any layout delivers exactly the rest."""
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic.files import plan


def naive_round_robin(batches, delivered):
    """One batch at a time, cycling over the streams that still have batches (torch's in-order rule)."""
    taken = [0] * len(batches)
    cycle = itertools.cycle(range(len(batches)))
    for _ in range(delivered):
        if all(t >= b for t, b in zip(taken, batches)):
            break
        while True:
            i = next(cycle)
            if taken[i] < batches[i]:
                taken[i] += 1
                break
    return taken


def run_phase(pool, world, workers, mode, batch_size, drop_last, batches):
    """Positions every rank delivers after ``batches`` batches per rank (None: the whole epoch),
    and the per-stream item counts a DataLoader.state_dict() would gather."""
    total = plan.ranges_len(pool)
    spans = plan.stream_spans(total, world, workers, mode, batch_size)
    delivered, counts = [], []
    for r in range(world):
        lengths = [b - a for a, b in spans[r * workers:(r + 1) * workers]]
        k = 10**9 if batches is None else batches
        per_stream = plan.items_delivered(lengths, batch_size, drop_last, k)
        for w in range(workers):
            pos = plan.positions(plan.stream_positions(pool, world, r, workers, w, mode, batch_size))
            assert len(pos) == lengths[w]
            delivered.extend(pos[:per_stream[w]].tolist())
        counts.extend(per_stream)
    return delivered, counts


layout = st.tuples(st.integers(1, 5), st.integers(1, 6), st.integers(1, 9))  # world, workers, batch size


@settings(max_examples=400, deadline=None)
@given(batches=st.lists(st.integers(0, 12), min_size=1, max_size=8), delivered=st.integers(0, 120))
def test_round_robin_model_matches_a_step_by_step_simulation(batches, delivered):
    assert plan.round_robin_taken(batches, delivered) == naive_round_robin(batches, delivered)


@settings(max_examples=300, deadline=None)
@given(lengths=st.lists(st.integers(0, 40), min_size=1, max_size=6), bs=st.integers(1, 8),
       drop_last=st.booleans(), k=st.integers(0, 60))
def test_items_delivered_is_monotone_and_bounded(lengths, bs, drop_last, k):
    now = plan.items_delivered(lengths, bs, drop_last, k)
    nxt = plan.items_delivered(lengths, bs, drop_last, k + 1)
    assert all(0 <= a <= b <= n for a, b, n in zip(now, nxt, lengths))
    # one more batch adds exactly one batch (or nothing once the epoch is over)
    added = sum(b - a for a, b in zip(now, nxt))
    total_batches = sum(plan.batches_per_stream(lengths, bs, drop_last))
    assert added <= bs and (added > 0) == (k < total_batches)


@settings(max_examples=500, deadline=None)
@given(n=st.integers(0, 300), before=layout, after=layout, stop=st.integers(0, 80), data=st.data())
def test_resume_on_any_layout_delivers_exactly_the_rest_once(n, before, after, stop, data):
    """One rank per phase side or several; pad mode: every item at least once, duplicates only padding."""
    mode = data.draw(st.sampled_from(["pad", "drop"]))
    w1, nw1, bs1 = before
    w2, nw2, bs2 = after
    pool = [(0, n)]
    got1, counts = run_phase(pool, w1, nw1, mode, bs1, False, stop)
    rest = plan.remaining_pool(pool, w1, nw1, mode, bs1, counts)
    got2, _ = run_phase(rest, w2, nw2, mode, bs2, False, None)
    assert not set(got1) & set(got2)  # nothing delivered before comes again
    union = set(got1) | set(got2)
    if mode == "pad":
        assert union == set(range(n))
        dups = (len(got1) - len(set(got1))) + (len(got2) - len(set(got2)))
        assert dups <= (w1 - 1) + (w2 - 1)  # only wrap-around padding repeats
        if w1 == 1 and w2 == 1:
            assert sorted(got1 + got2) == list(range(n))
    else:
        assert len(got1) == len(set(got1)) and len(got2) == len(set(got2))
        assert union <= set(range(n))
        if w1 == 1 and w2 == 1:
            assert sorted(got1 + got2) == list(range(n))


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 200), layouts=st.lists(st.tuples(layout, st.integers(0, 30)), min_size=1, max_size=4),
       drop_last=st.booleans())
def test_chained_single_rank_resumes_cover_the_epoch_exactly_once(n, layouts, drop_last):
    """Save, resume elsewhere, save again...: one rank, any workers and batch sizes, no item twice."""
    pool = [(0, n)]
    seen: list[int] = []
    for (_, nw, bs), stop in layouts:
        got, counts = run_phase(pool, 1, nw, "pad", bs, drop_last, stop)
        seen.extend(got)
        pool = plan.remaining_pool(pool, 1, nw, "pad", bs, counts)
        assert plan.ranges_len(pool) == n - len(seen)
    got, _ = run_phase(pool, 1, 1, "pad", 1, False, None)  # finish the epoch
    seen.extend(got)
    assert sorted(seen) == list(range(n))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 200), lay=layout, drop_last=st.booleans())
def test_a_finished_epoch_leaves_nothing_but_dropped_partial_batches(n, lay, drop_last):
    w, nw, bs = lay
    pool = [(0, n)]
    got, counts = run_phase(pool, w, nw, "pad", bs, drop_last, None)
    rest = plan.remaining_pool(pool, w, nw, "pad", bs, counts)
    if not drop_last:
        assert rest == []
    else:  # each rank drops at most one short batch
        assert plan.ranges_len(rest) <= w * (bs - 1)


def test_remaining_pool_checks_the_number_of_streams():
    import pytest

    with pytest.raises(ValueError, match="delivered counts"):
        plan.remaining_pool([(0, 10)], 2, 2, "pad", 1, [0, 0, 0])


@given(pool=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 8)), max_size=5), world=st.integers(1, 3),
       nw=st.integers(1, 3), mode=st.sampled_from(plan.PARTITION_MODES), quantum=st.integers(1, 4), data=st.data())
def test_a_streams_rest_is_its_positions_after_the_delivered_ones(pool, world, nw, mode, quantum, data):
    """stream_rest: what one stream (a worker's own state under StatefulDataLoader) has left after delivering its
    first ``d`` items is exactly its positions from the ``d``-th on; delivered + rest is the whole stream."""
    pool = plan.normalize((a, a + k) for a, k in pool)
    rank, worker = data.draw(st.integers(0, world - 1)), data.draw(st.integers(0, nw - 1))
    mine = plan.positions(plan.stream_positions(pool, world, rank, nw, worker, mode, quantum)).tolist()
    d = data.draw(st.integers(0, len(mine) + 2))
    rest = plan.positions(plan.stream_rest(pool, world, rank, nw, worker, mode, quantum, d)).tolist()
    assert rest == mine[d:]


@given(total=st.integers(0, 200), world=st.integers(1, 4), nw=st.integers(1, 4),
       mode=st.sampled_from(plan.PARTITION_MODES), quantum=st.integers(1, 6), bs=st.integers(1, 6),
       drop_last=st.booleans(), data=st.data())
def test_a_ranks_batches_per_epoch_are_its_streams_batches(total, world, nw, mode, quantum, bs, drop_last, data):
    """rank_batches (the loader's length: the same before and after a resume) is what the rank's worker streams
    yield in batches of ``bs``, one stream's short batch each (dropped with drop_last)."""
    rank = data.draw(st.integers(0, world - 1))
    spans = plan.stream_spans(total, world, nw, mode, quantum)[rank * nw:(rank + 1) * nw]
    want = sum((b - a) // bs if drop_last else -(-(b - a) // bs) for a, b in spans)
    assert plan.rank_batches(total, world, rank, nw, mode, quantum, bs, drop_last) == want
