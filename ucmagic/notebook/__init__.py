"""The notebook layer: the ``%ucload`` / ``%ucstage`` / ``%ucckpt`` magics (:mod:`.magics`), the live
loader panel and its text fallback (:mod:`.panel`), the fetch-latency explorer (:mod:`.explorer`) and
matplotlib figures (:mod:`.plots`).

It sits on the engine and holds no engine logic. The engine never imports it: importing this package
registers the presenters of ``DataLoader.monitor()``, ``LoaderStats.plot()``,
``LoaderStats.explore()`` and the progress bar of ``Progress`` with :mod:`ucmagic.presenters` (the
one hook; see docs/architecture.md).
Importing it imports nothing else (the presenters import their module when called).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..presenters import register_presenter

if TYPE_CHECKING:
    from ..loading.loader import DataLoader
    from ..loading.loader_stats import LoaderStats
    from .explorer import Explorer
    from .panel import Monitor, ProgressBar


def monitor(loader: DataLoader, **kw: Any) -> Monitor:
    """``loader.monitor()``: the live panel (or text line) attached to ``loader``."""
    from .panel import attach_monitor

    return attach_monitor(loader, **kw)


def plot(stats: LoaderStats, **kw: Any) -> Any:
    """``stats.plot()``: the fetch-latency figure of a :class:`~ucmagic.loading.loader_stats.LoaderStats`."""
    from .plots import latency_figure

    title = kw.pop("title", None) or (f"DataLoader fetch latency: {stats.count} batches, "
                                      f"{stats.stall_fraction:.1%} of the time waiting for data")
    return latency_figure(stats.fetch_seconds, stats.compute_seconds, title=title, **kw)


def explore(stats: LoaderStats, **kw: Any) -> Explorer:
    """``stats.explore()``: the interactive explorer of a :class:`~ucmagic.loading.loader_stats.LoaderStats`."""
    from .explorer import Explorer

    return Explorer(stats, **kw)


def progress_bar(desc: str, total: int | None) -> ProgressBar:
    """``Progress(mode="widget")``: the ipywidgets bar of stage(), listing and export."""
    from .panel import ProgressBar

    return ProgressBar(desc, total)


register_presenter("monitor", monitor)
register_presenter("progress_bar", progress_bar)
register_presenter("plot", plot)
register_presenter("explore", explore)
