"""Whether a fill may take room in a budgeted cache now (pure: plain numbers in, a decision out).

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
