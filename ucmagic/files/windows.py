"""How much of the cache each stream may hold: its protection window and read-ahead under a budget.

Pure sizing (numbers in, a :class:`Sizing` out, tested without I/O): :class:`WindowPolicy` turns a
``cache_limit``, the streams sharing it and whether the loop's consumption is reported into each
stream's share; :class:`LiveSizing` asks the cache for the budget and the live streams now, for a
stream that re-sizes itself while it runs (a process joining or leaving the cache).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..errors import BudgetTooSmallError
from ..units import format_size
from .cache import FileCache

# Without consumption reports a stream keeps at least this many handed-out files protected, unless
# lease_items was set (then that many): the batch the loop holds and torch's prefetch queue (2 batches of 21)
MIN_WINDOW = 64
DEFAULT_LEASE_ITEMS = 1024  # a dataset's lease_items until someone sets it: the window without a budget
# Where other processes' streams share the budget, each stream's share holds its window and the
# window's release step (a quarter of it), its read-ahead in flight and the items its record covers
# ahead of the loop (other processes' copies among them stay protected): fractions of the share
SHARED_WINDOW, SHARED_AHEAD, SHARED_COVER = 0.5, 0.2, 0.15


class Sizing(NamedTuple):
    """A stream's protection: ``window`` (handed-out items kept without consumption reports), the
    bytes its read-ahead may hold in flight, how many items its record covers ahead at a time
    (None: the read-ahead depth) and how many handed-out items past the window it releases at a time
    (None: a quarter of the window)."""

    window: int
    read_ahead_bytes: int
    cover: int | None = None
    release: int | None = None


def release_step(window: int, files: int) -> int:
    """Items past the window released at a time: a quarter of the window (each release rewrites the
    record), fewer where the share of ``files`` files has little room beyond the window; at least 1."""
    return max(1, min(window // 4, (files - window) // 4))


@dataclass(frozen=True)
class WindowPolicy:
    """The sizing rules of one dataset: ``lease_items`` (the largest window), the listing's mean
    file size ``typical``, its number of ``files``, ``least_window``, the window a user set
    (``lease_items`` set by hand, say to a torch loader's whole queue), else None (:data:`MIN_WINDOW`),
    and the ``largest`` file's size (0: ``typical``)."""

    lease_items: int
    typical: int
    files: int
    least_window: int | None = None
    largest: int = 0

    def least(self, reported: bool, streams: int = 0) -> int:
        """Files a stream must hold at once: with reports the one the loop waits for, else a window
        (``least_window``, else :data:`MIN_WINDOW` or ``lease_items`` if smaller), never more than
        one of ``streams`` streams hands out (10 big files need no window of 64)."""
        if reported:
            return 1
        least = max(1, self.least_window) if self.least_window is not None else min(self.lease_items, MIN_WINDOW)
        return min(least, max(1, -(-self.files // streams))) if streams > 0 and self.files else least

    def protection(self, budget: int | None, streams: int, reported: bool, live: int = 0, *,
                   unbudgeted_bytes: int = 1) -> Sizing:
        """The :class:`Sizing` of one of ``streams`` streams of this process: the items it keeps
        protected after handing them out when the loop's consumption is not ``reported`` (torch's
        DataLoader, a wrapper dataset, a plain loop), and the bytes it may hold in flight
        (``unbudgeted_bytes`` without a budget).

        Under a budget each stream's share holds both: a third for the window (sized by the mean file
        size, at most ``lease_items``); the rest for its release step (:func:`release_step`), then half
        each for the files in flight and the cached files covered ahead of the loop, so the protected
        files fit in ``cache_limit`` and a small budget slows the loop down instead of stopping it. The window
        holds at least :meth:`least` files (64, or the ``lease_items`` a user set); a share that cannot
        hold that many files of the mean size is :class:`BudgetTooSmallError` now, at the first item,
        naming the size needed. With reports any budget of at least the largest file makes progress
        (:func:`~ucmagic.files.admission.admit`: fills beyond it wait for room in the loop's order, the
        one the loop waits for may go over), so only a smaller one is refused.

        ``live`` streams of every process share the cache (:meth:`ProtectionRecords.live_streams`): where
        there are more than this process's ``streams``, the budget is split over all of them, and a
        window with its release step, the read-ahead and the items covered ahead of it (which protect
        what other processes fetched) fit the smaller share. The window never goes below the least
        one (:meth:`least`): files a loop may still open are not evicted to keep the budget, which
        the windows then exceed by what they hold beyond it. The first-item check is on this
        process's own share: a process joining never makes another fail.
        """
        if budget is None:
            return Sizing(self.lease_items, unbudgeted_bytes)
        self.check_share(budget, streams, reported)
        return self.sized(budget, streams, reported, live)

    def check_share(self, budget: int, streams: int, reported: bool) -> None:
        """:class:`BudgetTooSmallError` where the budget can never make progress: with reports, one smaller
        than the largest file (a fill of it could never start); without, where one of ``streams``
        shares cannot hold the least window (handed-out files a loop may still open stay protected)."""
        if reported:
            largest = max(self.largest, self.typical)
            if self.files and budget < largest:
                raise BudgetTooSmallError(
                    f"cache_limit={format_size(budget)} cannot hold the largest file of the dataset, "
                    f"{format_size(largest)}: set cache_limit to at least {format_size(largest)} (fills beyond it "
                    "wait for room as the loop consumes)")
            return
        least = self.least(reported, streams)
        if self.files and budget // max(1, streams) < least * self.typical:
            what = f"{least} files (the protection window without ucmagic.DataLoader" + (
                ")" if self.least_window is None else ", lease_items)")
            raise BudgetTooSmallError(
                f"cache_limit={format_size(budget)} cannot hold {what} of ~{format_size(self.typical)} for each "
                f"of {streams} stream(s): set cache_limit to at least "
                f"{format_size(least * self.typical * max(1, streams))}"
                + (" or use fewer DataLoader workers" if streams > 1 else "")
                + ("" if reported else "; ucmagic.DataLoader reports what the loop consumed and needs less"))

    def sized(self, budget: int, streams: int, reported: bool, live: int = 0) -> Sizing:
        """The protection of one stream under ``budget`` shared by ``max(streams, live)`` streams (no check)."""
        total = max(1, streams, live)
        share = budget // total
        files = share // self.typical
        # the window takes a third of the share (released in steps of a quarter of it where there is room)
        least = self.least(reported, max(1, streams))
        window = self.lease_items if reported else max(least, min(self.lease_items, files // 3))
        if total > streams:  # shared with other processes' streams, which protect what this one fetched:
            # the window, its release step, the read-ahead and the items covered ahead fit the share, the
            # window never below the least: a torch loader's queue holds handed-out files not yet opened
            if not reported:
                window = max(least, min(window, int(files * SHARED_WINDOW)))
            return Sizing(window, max(self.typical, int(share * SHARED_AHEAD)), max(1, int(files * SHARED_COVER)),
                          None if reported else release_step(window, files))
        if reported:  # cached items covered ahead of the loop stay protected: half the share's files at most
            return Sizing(window, max(1, share), max(1, files // 2))  # (big files: the one in flight)
        # what the loop has not reported stays protected: the window and its release step, the files
        # in flight and the cached files covered ahead of the loop (a later epoch's hits) all fit the
        # share, half each of what the window and its step leave (a least window aside: then a file each)
        release = release_step(window, files)
        rest = files - window - release
        ahead = max(1, rest // 2)
        return Sizing(window, max(self.typical, ahead * self.typical), max(1, rest - ahead), release)


@dataclass(frozen=True)
class LiveSizing:
    """A running stream's sizing for the cache's budget and live streams now (None: no budget)."""

    policy: WindowPolicy
    cache: FileCache
    streams: int
    reported: bool

    def __call__(self) -> Sizing | None:
        budget = self.cache.budget()
        return None if budget is None else self.policy.sized(budget, self.streams, self.reported,
                                                             self.cache.records.live_streams())
