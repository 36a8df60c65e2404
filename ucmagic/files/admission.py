"""Whether a fill may take room in a budgeted cache now (pure: plain numbers in, a decision out).

The budget keeper (:class:`ucmagic.files.budget.BudgetKeeper`) does the I/O: locks, counts, removals,
sleeps. Every decision it takes is here: admit, wait, evict whom (:func:`admit`), re-count or trust the
ledger (:func:`must_count`), stall (:func:`still_waiting`) and how long to pause (:func:`next_delay`).

The rule (:func:`admit`), for a fill of ``size`` bytes under a budget ``limit``, the directory
holding ``held`` bytes (entries, fills in progress at their final size, records) and ``ahead`` bytes
of fills earlier in the loop's order still waiting for room:

- ``size > limit``: **refuse** -- the file can never fit, so waiting would never end; the error
  names ``size`` as the budget needed. Any budget of at least the largest file makes progress.
- ``held + ahead + size <= limit``: **admit**.
- else the least-recently-used entries no live loop protects (``evictable``) are chosen, oldest
  first, until they free ``need = held + ahead + size - limit`` (plus ``slack``, so the next fills
  find room without a count): where they free ``need``, **admit** after evicting them.
- else, the fill the loop waits for next (``head``: the next item of its stream that the consumer
  takes) is **admitted over the budget**, after evicting what there is to evict: the loop always
  makes progress, and only a head fill goes over, so the directory stays within ``limit`` plus one
  file per stream whose loop waits on it.
- else **wait**, after evicting what there is to evict (all of it is needed, by this fill or by one
  earlier in the loop's order): room comes as the loop consumes (consumed entries lose their
  protection and become evictable), and fills waiting earlier in the loop's order (``ahead``) get it
  first. Evicting before waiting matters: the count that found those entries is not repeated for a
  moment, and a head fill admitted over the budget meanwhile would go over on top of them.

No deadlock: every stream's protected entries are items its loop has not consumed yet, and the
consumer takes them in its order; the fill it waits for is a head fill, which never waits, so it
completes, is consumed, and so on (``tests/test_admission.py`` drives this rule through a model of a
loop over several streams and checks that every epoch ends, within ``limit`` plus one file per stream).
"""
from __future__ import annotations

from typing import Iterable, NamedTuple

ADMIT, WAIT, REFUSE = "admit", "wait", "refuse"


class Admission(NamedTuple):
    """A decision of :func:`admit`: ``verdict`` (:data:`ADMIT`, :data:`WAIT` or :data:`REFUSE`), the
    entries to evict first (names, oldest first), the bytes they free, and whether the fill goes over
    the budget (a head fill)."""

    verdict: str
    evict: tuple[str, ...] = ()
    freed: int = 0
    over: bool = False


def admit(size: int, limit: int, held: int, evictable: Iterable[tuple[str, int, float]] = (), *,
          head: bool = False, ahead: int = 0, slack: int = 0) -> Admission:
    """The decision for a fill of ``size`` bytes (see the module's rule).

    ``evictable``: ``(name, size, last used)`` of the entries no live loop protects (empty when they
    were not counted); ``head``: the consumer waits for this very fill next; ``ahead``: bytes of
    fills earlier in the loop's order still waiting; ``slack``: bytes to free beyond the need when
    evicting anyway.
    """
    if size > limit:
        return Admission(REFUSE)
    need = held + (0 if head else ahead) + size - limit
    if need <= 0:
        return Admission(ADMIT)
    victims: list[str] = []
    freed = 0
    for name, nbytes, _ in sorted(evictable, key=lambda e: e[2]):
        if freed >= need + slack:
            break
        victims.append(name)
        freed += nbytes
    if freed >= need:
        return Admission(ADMIT, tuple(victims), freed)
    if head:
        return Admission(ADMIT, tuple(victims), freed, over=True)
    return Admission(WAIT, tuple(victims), freed)  # the room it frees is this fill's, or an earlier one's


# ---------------------------------------------------------------- while a fill waits (pure)

STALL = "stall"


class Waiting(NamedTuple):
    """What a waiting fill remembers between counts: the lowest count seen (``best``; None: none yet),
    since when (``since``), and what fills in progress had written at the last count (``copied``)."""

    best: int | None = None
    since: float = 0.0
    copied: int | None = None


def still_waiting(w: Waiting, now: float, held: int, copying: int | None, stall_s: float) -> tuple[Waiting, str]:
    """``(next state, WAIT or STALL)`` for a fill that found no room at time ``now`` with ``held`` bytes
    counted and ``copying`` (what fills in progress have written; None: not counted this time).

    Room freed (a lower count) or fills still copying (a big file on its way, not a deadlock) start the
    stall clock over; a fill that saw neither for ``stall_s`` seconds stalls: the caller raises."""
    if w.best is None or held < w.best or copying != w.copied:
        return Waiting(held if w.best is None else min(held, w.best), now, copying), WAIT
    if now - w.since > stall_s:
        return w, STALL
    return w, WAIT


def must_count(ledger: int | None, size: int, limit: int, since: float, scan_s: float) -> bool:
    """Whether a waiting fill re-counts the directory now instead of trusting the byte ledger
    (``ledger``: its figure, None when unreadable; ``since``: seconds since the last count of this
    process; ``scan_s``: what a count costs). The ledger is a hint: re-counted before deciding there is
    no room, but once per moment per process, not once per waiting thread (they would queue on the
    lock behind each other's scans, the head of the loop among them)."""
    if ledger is None or since > max(1.0, 50 * scan_s):
        return True
    return ledger + size > limit and since > max(0.02, 10 * scan_s)


def next_delay(delay: float, scan_s: float) -> float:
    """The pause before a waiting fill asks again: growing by half up to 50 ms, never under 5 counts' cost."""
    return min(0.05, max(delay * 1.5, 5 * scan_s))
