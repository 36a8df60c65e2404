"""The explorer's interactive batch chart: an anywidget whose JavaScript (``static/batch_chart.js``,
shipped in the package, no CDN) draws each batch's wait as a stacked bar of its stages, shows the
batch and its slowest files on hover, zooms on drag and picks a batch on click.

Without anywidget (or where custom widgets do not load) the explorer keeps its PNG: the chart says
when it has rendered (``rendered``), and only then does the explorer hide the PNG.
"""
from __future__ import annotations

import functools
import math
import pathlib
from typing import Any

import numpy as np

MAX_POINTS = 1500  # bars drawn; more batches in view: the slowest of each bucket of steps
ASSET = pathlib.Path(__file__).parent / "static" / "batch_chart.js"


def chart_points(b: dict[str, np.ndarray], mask: np.ndarray, max_points: int = MAX_POINTS) -> list[dict[str, Any]]:
    """The bars of the batches in ``mask`` (a batch table, ``LoaderStats.batches()``): one dict per
    batch with ``index`` (its position), ``step``, ``epoch``, ``worker``, ``wait_ms``, the stage
    milliseconds ``fetch_ms``, ``user_ms``, ``collate_ms`` (0 when not measured), ``misses`` and ``items``;
    over ``max_points`` batches, the slowest of each run of consecutive steps."""
    pos = np.flatnonzero(mask)
    if len(pos) > max_points:
        width = math.ceil(len(pos) / max_points)
        keep = [int(chunk[np.argmax(b["fetch_s"][chunk])]) for chunk in
                (pos[i:i + width] for i in range(0, len(pos), width))]
        pos = np.asarray(keep, dtype=np.int64)

    def ms(col: str, i: int) -> float:
        v = float(b[col][i])
        return 0.0 if math.isnan(v) else round(v * 1e3, 3)

    return [{"index": int(i), "step": int(b["step"][i]), "epoch": int(b["epoch"][i]), "worker": int(b["worker"][i]),
             "wait_ms": ms("fetch_s", i), "fetch_ms": ms("stage_fetch_s", i), "user_ms": ms("stage_user_s", i),
             "collate_ms": ms("stage_collate_s", i), "misses": int(b["misses"][i]), "items": int(b["items"][i])}
            for i in pos.tolist()]


@functools.lru_cache(maxsize=1)
def _chart_class() -> Any:
    try:
        import anywidget
        import traitlets as t
    except ImportError:
        return None

    class BatchChart(anywidget.AnyWidget):
        """Stacked bars of the wait per batch; ``view`` (zoom, steps), ``selected``/``hovered`` (batch positions)."""

        _esm = ASSET
        points: Any = t.List().tag(sync=True)
        view: Any = t.List().tag(sync=True)
        selected = t.Int(-1).tag(sync=True)
        hovered = t.Int(-1).tag(sync=True)
        hover_info = t.Unicode("").tag(sync=True)
        rendered = t.Bool(False).tag(sync=True)

    return BatchChart


def new_chart() -> Any:
    """A new chart widget, or None when anywidget is not installed (the explorer keeps its PNG)."""
    cls = _chart_class()
    return cls() if cls is not None else None
