"""The admission rule of a budgeted cache (ucmagic.files.admission, issue 40 item 4): pure, checked on
its own and through a model of a loop over several streams (the oracle for "never deadlocks, stays
within the budget plus one file per stream")."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic.files.admission import (ADMIT, REFUSE, STALL, WAIT, Waiting, admit, must_count, next_delay,
                                     still_waiting)

entries = st.lists(st.tuples(st.integers(1, 1000), st.floats(0, 1e6, allow_nan=False)), max_size=12).map(
    lambda es: [(f"e{i}", n, t) for i, (n, t) in enumerate(es)])


@given(st.integers(1, 2000), st.integers(1, 2000), st.integers(0, 4000), entries, st.booleans(),
       st.integers(0, 2000), st.integers(0, 500))
def test_a_fill_is_refused_only_when_it_can_never_fit_and_admitted_within_the_budget_unless_the_loop_waits_on_it(
        size, limit, held, evictable, head, ahead, slack):
    d = admit(size, limit, held, evictable, head=head, ahead=ahead, slack=slack)
    if size > limit:
        assert d.verdict == REFUSE  # waiting would never end: the error names the size needed
        return
    assert d.verdict in (ADMIT, WAIT)
    if head:
        assert d.verdict == ADMIT  # the fill the loop waits for never waits: the loop always progresses
    chosen = {name for name in d.evict}
    sizes = {name: n for name, n, _ in evictable}
    assert chosen <= set(sizes) and d.freed == sum(sizes[n] for n in chosen)
    if chosen:  # least recently used first: nothing left behind is older than what goes
        oldest_kept = min((t for n, _, t in evictable if n not in chosen), default=float("inf"))
        assert max(t for n, _, t in evictable if n in chosen) <= oldest_kept
    if d.verdict == ADMIT and not d.over:
        assert held - d.freed + size + (0 if head else ahead) <= limit
    if d.over:  # over the budget only for the head, and only once everything evictable helps
        assert head and held - d.freed + size > limit
    if d.verdict == WAIT:  # no room even with every evictable entry gone: they all go before it waits
        assert held + ahead + size - sum(sizes.values()) > limit
    if d.verdict == WAIT or d.over:
        assert chosen == set(sizes)


def test_what_fits_is_admitted_without_evicting_and_room_goes_to_fills_waiting_earlier():
    assert admit(100, 1000, 900) == (ADMIT, (), 0, False)
    assert admit(100, 1000, 850, ahead=100).verdict == WAIT  # an earlier fill of the loop gets room first
    assert admit(100, 1000, 850, ahead=100, head=True).verdict == ADMIT
    d = admit(100, 1000, 950, [("new", 60, 2.0), ("old", 60, 1.0), ("older", 10, 0.5)])
    assert d.verdict == ADMIT and d.evict == ("older", "old") and d.freed == 70
    assert admit(600, 1000, 900, [("a", 100, 1.0)], head=True) == (ADMIT, ("a",), 100, True)
    assert admit(1001, 1000, 0, head=True).verdict == REFUSE


def test_a_fill_that_must_wait_first_evicts_what_its_count_found_unprotected():
    # the count that found these is not repeated for a moment: left in place, a head fill admitted over
    # the budget meanwhile (from the byte ledger, no list) goes over on top of them (the shard stream's
    # peak went from 11 to 16 chunks under a 4-chunk budget)
    d = admit(100, 1000, 1000, [("a", 30, 2.0), ("b", 20, 1.0)], ahead=100)
    assert d == (WAIT, ("b", "a"), 50, False)
    assert admit(100, 1000, 1000 - d.freed, head=True).over  # the head still goes over, on 50 bytes less


# ---------------------------------------------------------------- a loop over several streams, modelled

def run_loop(files: list[list[int]], limit: int, depth: int, schedule: list[int], slack: int) -> tuple[int, int]:
    """A consumer taking one item at a time round-robin from ``files[w]`` (stream ``w``'s file sizes, in
    its order), each stream filling up to ``depth`` items ahead of what the consumer took from it, every
    fill decided by :func:`admit`: consumed entries are evictable, the rest protected. ``schedule`` picks
    which stream's fills ask for room between the consumer's steps (``s // 2``), and in which order
    (odd: the later ones first, as racing threads may); after it runs out, every stream
    acts in turn, its fills in order. Returns (items consumed, peak bytes held); stops when no step changes anything."""
    streams = len(files)
    filled: list[dict[int, int]] = [{} for _ in files]  # per stream: position -> size held (present)
    consumed = [0] * streams
    waiting: list[list[int]] = [[] for _ in files]  # per stream: positions that asked for room, in order
    last_used: dict[tuple[int, int], float] = {}
    held = peak = clock = taken = 0
    turn = 0  # the stream the consumer takes from next
    order = list(schedule)
    total = sum(len(f) for f in files)

    def try_fills(w: int, backwards: bool) -> bool:
        """Every fill of stream ``w``'s read-ahead asks once (its threads race: ``backwards``, the later first)."""
        lo = consumed[w]
        todo = [p for p in range(lo, min(len(files[w]), lo + depth)) if p not in filled[w]]
        return any([try_fill(w, p) for p in (reversed(todo) if backwards else todo)])

    def try_fill(w: int, p: int) -> bool:
        nonlocal held, peak, clock
        if p in filled[w]:
            return False
        if p not in waiting[w]:
            waiting[w].append(p)
        ahead = sum(files[w][q] for q in waiting[w] if q < p and q not in filled[w])
        evictable = [(f"{v}:{q}", n, last_used[(v, q)]) for v in range(streams) for q, n in filled[v].items()
                     if q < consumed[v]]
        d = admit(files[w][p], limit, held, evictable, head=p == consumed[w], ahead=ahead, slack=slack)
        assert d.verdict != REFUSE
        for name in d.evict:
            v, q = map(int, name.split(":"))
            held -= filled[v].pop(q)
        if d.verdict != ADMIT:
            return bool(d.evict)
        filled[w][p] = files[w][p]
        waiting[w].remove(p)
        held += files[w][p]
        peak = max(peak, held)
        clock += 1
        last_used[(w, p)] = clock
        return True

    stuck = 0
    while taken < total and stuck <= 2 * streams * depth:
        progressed = False
        while turn < streams and consumed[turn] >= len(files[turn]):
            turn = (turn + 1) % streams
        if consumed[turn] in filled[turn]:  # the consumer takes its next item
            clock += 1
            last_used[(turn, consumed[turn])] = clock
            consumed[turn] += 1
            taken += 1
            turn = (turn + 1) % streams
            progressed = True
        for w, backwards in ([divmod(order.pop(0), 2)] if order else [(v, False) for v in range(streams)]):
            progressed = try_fills(w % streams, bool(backwards)) or progressed
        stuck = 0 if progressed or order else stuck + 1  # a stalled pass counts once every stream acts
    return taken, peak


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4).flatmap(lambda n: st.lists(st.lists(st.integers(1, 100), min_size=1, max_size=12),
                                                    min_size=n, max_size=n)),
       st.integers(0, 150), st.integers(1, 6), st.lists(st.integers(0, 7), max_size=60), st.integers(0, 50))
def test_a_loop_over_several_streams_never_deadlocks_and_stays_within_the_budget_plus_a_file_per_stream(
        files, extra, depth, schedule, slack):
    largest = max(max(f) for f in files)
    limit = largest + extra  # any budget of at least the largest file
    taken, peak = run_loop(files, limit, depth, schedule, slack)
    assert taken == sum(len(f) for f in files), "the loop stopped: a deadlock"
    assert peak <= limit + len(files) * largest


def test_two_streams_of_files_each_larger_than_half_the_budget_complete():
    # the case in small: 4 files of 512 MiB under 700 MB, 2 workers (before: BudgetTooSmallError)
    mib = 1 << 20
    taken, peak = run_loop([[512 * mib] * 2, [512 * mib] * 2], 700_000_000, 4, [], 0)
    assert taken == 4 and peak <= 700_000_000 + 2 * 512 * mib


# ---------------------------------------------------------------- while a fill waits (issue 43 item 4)

@given(st.lists(st.tuples(st.floats(0, 50, allow_nan=False), st.integers(0, 1000), st.none() | st.integers(0, 5)),
                min_size=1, max_size=40), st.floats(0.5, 100, allow_nan=False))
def test_a_waiting_fill_stalls_only_after_stall_s_without_room_freed_or_copying(steps, stall_s):
    """Any sequence of counts: a stall comes exactly when ``stall_s`` passed since the last count that
    showed progress (a lower count, or fills still copying), never earlier."""
    w, now, last_progress, best, copied = Waiting(), 0.0, 0.0, None, None
    for dt, held, copying in steps:
        now += dt
        w, verdict = still_waiting(w, now, held, copying, stall_s)
        progress = best is None or held < best or copying != copied
        if progress:
            best, copied, last_progress = held if best is None else min(best, held), copying, now
            assert verdict == WAIT and w.since == now
        else:
            assert verdict == (STALL if now - last_progress > stall_s else WAIT)
        if verdict == STALL:
            return
        assert w.best == best and w.copied == copied


@given(st.none() | st.integers(0, 2000), st.integers(1, 1000), st.integers(1, 2000),
       st.floats(0, 5, allow_nan=False), st.floats(0, 0.2, allow_nan=False))
def test_the_ledger_is_trusted_only_while_it_is_fresh_and_says_there_is_room(ledger, size, limit, since, scan_s):
    count = must_count(ledger, size, limit, since, scan_s)
    if ledger is None or since > max(1.0, 50 * scan_s):
        assert count  # unreadable or old: counted
    elif ledger + size <= limit:
        assert not count  # fresh and room: a fill needs no scan
    else:
        assert count == (since > max(0.02, 10 * scan_s))  # no room: counted again, but once per moment


def test_the_pause_between_asks_grows_to_50ms_and_follows_the_cost_of_a_count():
    d, seen = 0.005, []
    for _ in range(10):
        d = next_delay(d, 0.0001)
        seen.append(d)
    assert seen == sorted(seen) and seen[-1] == 0.05
    assert next_delay(0.005, 0.004) == 0.02  # never under 5 counts' cost
