"""The live panel's pure half: its state as plain data (:class:`Snapshot`) and the renderers of it
(text line, SVG sparkline, the epoch's stage bar, the status line), no widgets, no I/O."""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Sequence

from ..progress import format_duration
from ..units import format_size

PLOT_POINTS = 120  # points drawn in the sparkline


# ------------------------------------------------------------------ pure: state and rendering

@dataclass
class Snapshot:
    """What the display shows; plain data so the renderers are pure functions."""

    title: str = "ucmagic"
    state: str = "idle"  # idle | running | done | error
    epoch: int | None = None
    batches: int = 0
    total_batches: int | None = None
    items: int | None = 0  # None: unknown batch size
    elapsed_s: float = 0.0
    files: int | None = None  # None: the source has no file cache (e.g. Parquet)
    files_cached: int = 0
    bytes_total: int = 0
    bytes_cached: int = 0
    hit_rate: float | None = None
    waits_ms: list[float] = field(default_factory=list)
    p50_ms: float = math.nan
    p99_ms: float = math.nan
    error: str | None = None
    run_ms: list[float] = field(default_factory=list)  # the whole epoch, max per bucket (see RunSeries)
    hints: list[str] = field(default_factory=list)  # straggler hints, in the final state
    stages: dict[str, float] = field(default_factory=dict)  # the epoch's seconds per stage (stage_bar_svg)
    advice: list[str] = field(default_factory=list)  # stats.advise() lines, in the final state (--advise)
    advice_head: str = ""  # the measured run they compare with (advise.header)

    @property
    def batches_per_s(self) -> float:
        return self.batches / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def items_per_s(self) -> float | None:
        if self.items is None:
            return None
        return self.items / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def rate_known(self) -> bool:
        """Enough batches and time for a throughput and an ETA that mean something (not "0 items/s")."""
        from ..progress import MIN_RATE_S

        return self.batches >= 2 and self.elapsed_s >= MIN_RATE_S

    @property
    def eta_s(self) -> float | None:
        if self.total_batches is None or self.state != "running" or self.batches_per_s <= 0 or not self.rate_known:
            return None
        return max(0, self.total_batches - self.batches) / self.batches_per_s


def format_ms(ms: float) -> str:
    if not math.isfinite(ms):
        return "-"
    return f"{ms:.0f} ms" if ms >= 10 else f"{ms:.1f} ms"


def text_line(s: Snapshot) -> str:
    """One line for a terminal or a log: batches, cache fill, hit rate, latency, throughput, ETA.

    Starts with :func:`ucmagic.progress.format_progress`'s line (the one ``stage`` prints)."""
    from ..progress import format_progress

    if s.state == "starting":
        return f"{s.title}: {s.error or 'starting'}"
    head = format_progress(s.batches, s.total_batches if s.state == "running" else None, 0, s.elapsed_s,
                           desc=s.title, unit="batches")
    parts = [head]
    if s.files is not None:
        parts.append(f"cached {s.files_cached:,}/{s.files:,} files, {format_size(s.bytes_cached)}/"
                     f"{format_size(s.bytes_total)}")
    if s.hit_rate is not None:
        parts.append(f"hit {100 * s.hit_rate:.0f}%")
    parts.append(f"wait p50 {format_ms(s.p50_ms)} p99 {format_ms(s.p99_ms)}")
    ips = s.items_per_s
    if s.rate_known or s.state != "running":
        parts.append(f"{ips:,.0f} items/s" if ips is not None else f"{s.batches_per_s:,.1f} batches/s")
    if s.state == "done":
        parts.append("done")
    elif s.state == "error":
        parts.append(f"FAILED: {s.error}")
    return "  ".join(parts)


def sparkline_svg(waits_ms: Sequence[float], p50_ms: float, p99_ms: float, *, width: int = 360,
                  height: int = 70, points: int = PLOT_POINTS, color: str = "#1f77b4") -> str:
    """An inline SVG of per-batch waits (ms) with dashed p50 and p99 lines: the values span the plot's
    width from its left edge (the epoch so far), the first at the left.

    Pure string building (tens of microseconds). The y axis runs from 0 to the larger of the
    highest point and 1.15 x p99, labelled in ms; when the highest point (a cold first batch) is
    over 20 x p50 the axis is logarithmic, so the spike and the steady state both stay readable.
    """
    vals = list(waits_ms)[-points:]
    pad_l, pad_r, pad_t, pad_b = 4, 64, 6, 14
    pw, ph = width - pad_l - pad_r, height - pad_t - pad_b
    top = max([*vals, (p99_ms * 1.15) if math.isfinite(p99_ms) else 0.0, 1e-3])
    floor = max(min([v for v in vals if v > 0], default=top) * 0.8, top * 1e-4)
    log = bool(vals) and math.isfinite(p50_ms) and p50_ms > 0 and top > 20 * p50_ms

    def y_of(v: float) -> float:
        if log:
            frac = math.log(max(v, floor) / floor) / math.log(top / floor) if top > floor else 0.0
        else:
            frac = min(v, top) / top
        return pad_t + ph - ph * min(1.0, max(0.0, frac))

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" style="font:10px sans-serif">',
           f'<rect x="{pad_l}" y="{pad_t}" width="{pw}" height="{ph}" fill="none" stroke="#8884"/>']
    if vals:
        step = pw / max(1, len(vals) - 1)
        pts = " ".join(f"{pad_l + i * step:.1f},{y_of(v):.1f}" for i, v in enumerate(vals))
        out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="1.5"/>')
    for label, v, c in (("p50", p50_ms, "#2ca02c"), ("p99", p99_ms, "#d62728")):
        if math.isfinite(v):
            y = y_of(v)
            out.append(f'<line x1="{pad_l}" x2="{pad_l + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="{c}" '
                       f'stroke-dasharray="4 3"/>')
            out.append(f'<text x="{pad_l + pw + 4}" y="{y + 3:.1f}" fill="{c}">'
                       f'{label} {html.escape(format_ms(v))}</text>')
    out.append(f'<text x="{pad_l}" y="{height - 2}" fill="currentColor" opacity="0.7">'
               f'wait per batch, whole epoch (max {html.escape(format_ms(top))}{", log scale" if log else ""})</text>')
    out.append("</svg>")
    return "".join(out)


def summary_html(s: Snapshot) -> str:
    """The status line under the plot: throughput, ETA or final state (red on error), then hints."""
    if s.state == "starting":
        return f"<i>{html.escape(s.error or 'starting')}</i>"
    bits = [f"<b>{s.batches}</b>{'/' + str(s.total_batches) if s.total_batches is not None else ''} batches"]
    if s.rate_known or s.state != "running":
        bits.append(f"{s.batches_per_s:.1f} batches/s")
        if s.items_per_s is not None:
            bits.insert(1, f"{s.items_per_s:,.0f} items/s")
    if s.hit_rate is not None:
        bits.append(f"hit rate {100 * s.hit_rate:.0f}%")
    if s.state == "running":
        bits.append(f"ETA {format_duration(s.eta_s) if s.eta_s is not None else '-'}")
    elif s.state == "done":
        bits.append(f"<span style='color:#2ca02c'>done in {format_duration(s.elapsed_s)}</span>")
    elif s.state == "error":
        bits.append(f"<span style='color:#d62728'><b>failed:</b> {html.escape(str(s.error))}</span>")
    hints = "".join(f"<div>&#9656; {html.escape(h)}</div>" for h in s.hints)
    advice = "".join(f"<div>{i}. {html.escape(a)}</div>" for i, a in enumerate(s.advice, 1))
    head = f" <span style='opacity:0.8'>against {html.escape(s.advice_head)}</span>" if s.advice_head else ""
    return " &middot; ".join(bits) + hints + (f"<div><b>advice</b>{head}{advice}</div>" if advice else "")


class RunSeries:
    """The waits of a whole epoch in at most ``points`` values: each is the max of a bucket of
    batches, and buckets double in width when full, so the first (cold) spike is never dropped."""

    def __init__(self, points: int = PLOT_POINTS) -> None:
        self.points = points
        self.clear()

    def clear(self) -> None:
        self.values: list[float] = []
        self.width = 1  # batches per value
        self.n = 0

    def add(self, v: float) -> None:
        if self.n // self.width < len(self.values):
            self.values[-1] = max(self.values[-1], v)
        else:
            self.values.append(v)
        self.n += 1
        if len(self.values) > self.points:  # bucket k of width 2w holds buckets 2k and 2k+1 of width w
            vals = self.values
            self.values = [max(vals[i:i + 2]) for i in range(0, len(vals), 2)]
            self.width *= 2


STAGE_COLORS = {"compute": "#9e9e9e", "fetch": "#ff7f0e", "user": "#9467bd", "collate": "#2ca02c"}
STAGE_LABELS = {"compute": "loop compute", "fetch": "fetch", "user": "your code", "collate": "collate"}
BAR_LABELS = ("the loop", "making batches")  # the two bars' labels: short enough for LABEL_W at 11 px
LABEL_W = 100


def stage_bar_svg(stages: dict[str, float], *, width: int = 360) -> str:
    """Two stacked bars of an epoch's seconds (``LoaderStats.breakdown()``'s keys): the loop's time
    (compute, then the wait split over the stages of the batches waited on), and beside it the seconds
    spent making batches per stage (in workers they overlap the loop), with one line of their totals
    under them."""
    loop = [("compute", stages.get("compute", 0.0))] + [(k, stages.get(f"wait_{k}", 0.0))
                                                        for k in ("fetch", "user", "collate")]
    made = [(k, stages.get(k, 0.0)) for k in ("fetch", "user", "collate")]
    scale = max(sum(v for _, v in loop), sum(v for _, v in made), 1e-9)
    bar_w = width - LABEL_W

    def bar(y: int, parts: list[tuple[str, float]], label: str) -> str:
        x, out = float(LABEL_W), [f"<text x='0' y='{y + 11}' font-size='11'>{html.escape(label)}</text>"]
        for k, v in parts:
            w = bar_w * v / scale
            if w > 0:
                out.append(f"<rect x='{x:.1f}' y='{y}' width='{w:.1f}' height='14' fill='{STAGE_COLORS[k]}'>"
                           f"<title>{STAGE_LABELS[k]}: {v:.3g} s</title></rect>")
            x += w
        return "".join(out)

    total = sum(v for _, v in loop)
    legend = " ".join(f"<tspan fill='{STAGE_COLORS[k]}'>&#9632;</tspan> {STAGE_LABELS[k]}" for k in STAGE_COLORS)
    wait = stages.get("wait", 0.0)
    line = (f"the loop {total:.2f} s, waiting {100 * wait / total:.0f}%" if total > 0 else "the loop") + (
        "; making batches: " + ", ".join(f"{STAGE_LABELS[k]} {v:.2f} s" for k, v in made))
    return (f"<svg xmlns='http://www.w3.org/2000/svg' width='{width}' height='58' class='ucmagic-stages'>"
            + bar(0, loop, BAR_LABELS[0]) + bar(20, made, BAR_LABELS[1])
            + f"<text x='0' y='52' font-size='10'>{legend}</text></svg>"
            + f"<div class='ucmagic-stages-line' style='font-size:11px'>{html.escape(line)}</div>")


def stage_text(stages: dict[str, float]) -> str:
    """The epoch's breakdown as one line (the text display's final state); "" before any batch."""
    if not stages.get("batches"):
        return ""
    loop = stages.get("compute", 0.0) + stages.get("wait", 0.0)
    waits = ", ".join(f"{STAGE_LABELS[k]} {stages.get(f'wait_{k}', 0.0):.2f}" for k in ("fetch", "user", "collate"))
    made = ", ".join(f"{STAGE_LABELS[k]} {stages.get(k, 0.0):.2f}" for k in ("fetch", "user", "collate"))
    return (f"loop {loop:.2f} s: compute {stages.get('compute', 0.0):.2f}, wait {stages.get('wait', 0.0):.2f} "
            f"({waits}); producing processes: {made} s")
