"""Matplotlib figures of loader telemetry (headless-safe: no pyplot, no GUI backend needed)."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from ..telemetry import p50_p99


def latency_figure(fetch_s: Sequence[float] | np.ndarray, compute_s: Sequence[float] | np.ndarray | None = None, *,
                   title: str | None = None, bins: int = 50) -> Any:
    """Fetch latency per batch (with p50/p99 lines) and its histogram, side by side.

    ``fetch_s``/``compute_s`` are seconds per batch. Returns a ``matplotlib.figure.Figure`` built
    without pyplot, so it works under any backend (Agg included) and shows once in a notebook.
    """
    from ..errors import import_extra

    figure_cls = import_extra("matplotlib.figure", feature="stats.plot()").Figure

    fetch_ms = np.asarray(fetch_s, dtype=float) * 1000.0
    fig = figure_cls(figsize=(10, 3.6), layout="constrained")
    ax_line, ax_hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    x = np.arange(len(fetch_ms))
    if compute_s is not None and len(compute_s) == len(fetch_ms) and len(fetch_ms):
        ax_line.plot(x, np.asarray(compute_s, dtype=float) * 1000.0, color="0.75", lw=0.8, label="compute")
    ax_line.plot(x, fetch_ms, color="tab:blue", lw=0.9, label="fetch (wait)")
    ax_line.set_xlabel("batch")
    ax_line.set_ylabel("ms")
    ax_hist.set_xlabel("fetch latency (ms)")
    ax_hist.set_ylabel("batches")
    if len(fetch_ms):
        p50, p99 = p50_p99(fetch_ms)
        for ax, draw in ((ax_line, ax_line.axhline), (ax_hist, ax_hist.axvline)):
            draw(p50, color="tab:green", ls="--", lw=1, label=f"p50 {p50:.2f} ms")
            draw(p99, color="tab:red", ls="--", lw=1, label=f"p99 {p99:.2f} ms")
        ax_hist.hist(fetch_ms, bins=max(1, min(bins, len(fetch_ms))), color="tab:blue", alpha=0.8)
        ax_line.legend(loc="upper right", fontsize="small")
    else:
        ax_line.text(0.5, 0.5, "no batches yet", ha="center", va="center", transform=ax_line.transAxes)
    fig.suptitle(title or "DataLoader fetch latency")
    return fig
