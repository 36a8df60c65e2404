"""The fetch-latency explorer: ``loader.stats.explore()`` (notebook layer; core ipywidgets + matplotlib).

Fetch wait per batch over the run (cold misses orange, warm hits blue) with p50/p99 lines, a
range slider to zoom into any stretch, epoch/worker/rank selectors, the straggler hints, a table of
the slowest batches in view with their slowest files, and the files of any selected batch (fetch
time, size, hit/miss). The plot is a PNG drawn by matplotlib's Agg canvas, so it renders in
JupyterLab, Notebook 7, VS Code and Databricks without a widget backend for matplotlib.
"""
from __future__ import annotations

import html
import io
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import import_extra
from ..telemetry import p50_p99
from ..units import format_size, short_name
from .chart import chart_points, new_chart

if TYPE_CHECKING:
    from ..loading.loader_stats import LoaderStats

ALL = "all"
SLOWEST = 10  # batches in the slowest-batches table
FILES_PER_BATCH = 3  # files shown per batch in that table
WRAP = "text-align:left;white-space:normal;overflow-wrap:anywhere"  # a cell of file names: wraps, never clips
NAME_WIDTH = 40  # characters of a file's name in the slowest-batches table (the end of it; all of it on hover)


def _ms(s: float) -> str:
    return f"{s * 1e3:.0f} ms" if s >= 0.01 else f"{s * 1e3:.2f} ms"


def _options(values: np.ndarray, label: str) -> list[tuple[str, Any]]:
    return [(f"all {label}s", ALL)] + [(f"{label} {int(v)}" if v >= 0 else "main process", int(v))
                                       for v in np.unique(values)]


def figure_png(step: np.ndarray, fetch_s: np.ndarray, misses: np.ndarray, items: np.ndarray, *,
               title: str = "", width: float = 9.0, height: float = 3.4) -> bytes:
    """PNG of the fetch wait per batch: orange where the batch had cache misses, blue when warm,
    grey without item records; dashed p50/p99 lines of the points shown; a log scale when the
    slowest batch is over 50 x p50."""
    figure_cls = import_extra("matplotlib.figure", feature="the explorer").Figure
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = figure_cls(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ms = fetch_s * 1e3
    groups = ((items > 0) & (misses > 0), (items > 0) & (misses == 0), items == 0)
    for mask, color, label in zip(groups, ("tab:orange", "tab:blue", "0.6"), ("cache miss", "cache hit", "batch")):
        if mask.any():
            ax.scatter(step[mask], ms[mask], s=9, color=color, label=f"{label} ({int(mask.sum())})", lw=0)
    if len(ms):
        p50, p99 = p50_p99(ms)
        ax.axhline(p50, color="tab:green", ls="--", lw=1, label=f"p50 {p50:.2f} ms")
        ax.axhline(p99, color="tab:red", ls="--", lw=1, label=f"p99 {p99:.2f} ms")
        ax.legend(loc="upper right", fontsize="small")
        ax.set_xlim(step.min() - 0.5, step.max() + 0.5)
        if ms.max() > 50 * max(p50, 1e-3):  # a cold spike would flatten the rest: log scale
            ax.set_yscale("log")
            ax.set_ylim(bottom=max(ms.min(), 1e-3) * 0.8)
    else:
        ax.text(0.5, 0.5, "no batches in this selection", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("batch")
    ax.set_ylabel("fetch wait (ms)")
    ax.set_title(title, fontsize="medium")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=80)
    return buf.getvalue()


def breakable(name: str) -> str:
    """``name`` as HTML that wraps after its slashes (then anywhere, as the cell's style says)."""
    return html.escape(name).replace("/", "/<wbr>")


def _stage_ms(b: dict[str, np.ndarray], key: str, i: int) -> str:
    v = float(b[key][i])
    return "-" if np.isnan(v) else _ms(v)


def _stage_cells(b: dict[str, np.ndarray], i: int) -> str:
    return "".join(f"<td>{_stage_ms(b, f'stage_{k}_s', i)}</td>" for k in ("fetch", "user", "collate"))


def stage_line(b: dict[str, np.ndarray], i: int) -> str:
    """``; made in ... : fetch .., your code .., collate ..`` of batch ``i`` ("" when not measured)."""
    if np.isnan(float(b["stage_fetch_s"][i])):
        return ""
    worker = "the main process" if int(b["worker"][i]) < 0 else f"worker {int(b['worker'][i])}"
    return (f"; made in {worker}: fetch {_stage_ms(b, 'stage_fetch_s', i)}, your code "
            f"{_stage_ms(b, 'stage_user_s', i)}, collate {_stage_ms(b, 'stage_collate_s', i)}")


def files_table(rows: list[dict[str, Any]]) -> str:
    """HTML table of a batch's files (slowest first)."""
    if not rows:
        return "<i>no item records for this batch</i>"
    body = "".join(
        f"<tr><td style='{WRAP}'>{breakable(r['file'])}</td>"
        f"<td>{format_size(r['bytes']) if r['bytes'] is not None else '-'}</td><td>{_ms(r['fetch_s'])}</td>"
        f"<td style='color:{'#1f77b4' if r['hit'] else '#ff7f0e'}'>{'hit' if r['hit'] else 'miss'}</td></tr>"
        for r in rows)
    return ("<table class='ucmagic-files'><tr><th style='text-align:left'>file</th><th>size</th><th>fetch</th>"
            f"<th>cache</th></tr>{body}</table>")


class Explorer:
    """The explorer widget of a :class:`~ucmagic.loading.loader_stats.LoaderStats`; display it as a cell's last value.

    Attributes for scripting: ``range`` (IntRangeSlider of batch steps), ``epoch``, ``worker``,
    ``rank`` (Dropdowns), ``slowest`` (Select of the slowest batches in view), ``batch`` (IntText:
    any batch position), ``plot`` (Image), ``table`` (HTML: slowest batches and their files),
    ``files`` (HTML: the selected batch's files), ``hints`` (HTML) and ``widget`` (the whole box).
    """

    def __init__(self, stats: LoaderStats, *, title: str | None = None) -> None:
        w = import_extra("ipywidgets", feature="the explorer")
        self.stats = stats
        self.b = stats.batches()
        b = self.b
        top = int(b["step"].max()) if len(b["step"]) else 0
        self.title = title or "fetch wait per batch"
        self.range = w.IntRangeSlider(value=(0, top), min=0, max=max(top, 1), description="batches",
                                      continuous_update=False, layout=w.Layout(width="300px"))
        self.epoch = w.Dropdown(options=_options(b["epoch"], "epoch"), value=ALL, description="epoch",
                                style={"description_width": "initial"}, layout=w.Layout(width="170px"))
        self.worker = w.Dropdown(options=_options(b["worker"], "worker"), value=ALL, description="worker",
                                 style={"description_width": "initial"}, layout=w.Layout(width="170px"))
        self.rank = w.Dropdown(options=_options(b["rank"], "rank"), value=ALL, description="rank",
                               style={"description_width": "initial"}, layout=w.Layout(width="170px"))
        self.rank.layout.display = None if len(np.unique(b["rank"])) > 1 else "none"
        self.summary = w.HTML()
        self.hints = w.HTML(self._hints_html())
        self.plot = w.Image(format="png")
        self.table = w.HTML()
        self.slowest = w.Select(options=[], rows=6, description="slowest", layout=w.Layout(width="380px"))
        self.batch = w.BoundedIntText(value=0, min=0, max=max(0, len(b["step"]) - 1), description="batch #",
                                      layout=w.Layout(width="180px"))
        self.files = w.HTML()
        self.chart = new_chart()  # interactive bars (anywidget); the PNG stays until the chart has rendered
        if self.chart is not None:
            self.chart.observe(self._zoomed, names="view")
            self.chart.observe(self._clicked, names="selected")
            self.chart.observe(self._hovered, names="hovered")
            self.chart.observe(self._chart_shown, names="rendered")
        for c in (self.range, self.epoch, self.worker, self.rank):
            c.observe(self._changed, names="value")
        self.slowest.observe(self._picked, names="value")
        self.batch.observe(self._typed, names="value")
        self.widget = w.VBox([
            w.HTML(f"<b>{html.escape(self.title)}</b>"), self.summary, self.hints,
            w.HBox([self.range, self.epoch, self.worker, self.rank], layout=w.Layout(flex_flow="row wrap")),
            *([self.chart] if self.chart is not None else []), self.plot,
            w.HTML("<b>slowest batches in view</b> (select one, or type any batch number, to see its files)"),
            self.table, w.HBox([self.slowest, self.batch], layout=w.Layout(flex_flow="row wrap")), self.files,
        ])
        self.widget.add_class("ucmagic-explorer")
        self.refresh()

    # -- state
    def _sel(self, c: Any) -> int | None:
        return None if c.value == ALL else int(c.value)

    def mask(self) -> np.ndarray:
        lo, hi = self.range.value
        return self.stats.select(self.b, lo=lo, hi=hi, epoch=self._sel(self.epoch), worker=self._sel(self.worker),
                                 rank=self._sel(self.rank))

    def slowest_in_view(self, n: int = SLOWEST) -> list[int]:
        lo, hi = self.range.value
        return self.stats.slowest_batches(n, lo=lo, hi=hi, epoch=self._sel(self.epoch),
                                          worker=self._sel(self.worker), rank=self._sel(self.rank))

    # -- drawing
    def refresh(self) -> None:
        """Redraw plot, summary, table and batch list for the current controls."""
        b, m = self.b, self.mask()
        f = b["fetch_s"][m]
        if len(f):
            p50, p99 = p50_p99(f)
            miss = int(b["misses"][m].sum())
            self.summary.value = (f"{int(m.sum()):,} batches in view &middot; wait p50 {_ms(p50)} &middot; p99 "
                                  f"{_ms(p99)} &middot; max {_ms(float(f.max()))} &middot; total {f.sum():.2f} s"
                                  f" &middot; {miss:,} cache misses")
        else:
            self.summary.value = "<i>no batches in this selection</i>"
        self.plot.value = figure_png(b["step"][m], f, b["misses"][m], b["items"][m], title=self.title)
        slow = self.slowest_in_view()
        if self.chart is not None:
            self.chart.points = chart_points(b, m)
            self.chart.selected = slow[0] if slow else -1
        rows = []
        for i in slow:
            files = self.stats.batch_files(i)[:FILES_PER_BATCH]
            names = "<br>".join(f"<span title='{html.escape(r['file'])}'>{_ms(r['fetch_s'])} "
                                f"{'hit' if r['hit'] else 'miss'}, "
                                f"{format_size(r['bytes']) if r['bytes'] is not None else '-'}: "
                                f"{breakable(short_name(r['file'], NAME_WIDTH))}</span>" for r in files) or "-"
            rows.append(f"<tr style='white-space:nowrap'><td>{i}</td><td>{int(b['epoch'][i])}</td>"
                        f"<td>{int(b['worker'][i])}</td><td>{_ms(float(b['fetch_s'][i]))}</td>{_stage_cells(b, i)}"
                        f"<td>{int(b['misses'][i])}/{int(b['items'][i])}</td>"
                        f"<td style='{WRAP}'>{names}</td></tr>")
        self.table.value = ("<table class='ucmagic-slowest' style='width:100%'>"
                            "<tr style='white-space:nowrap'><th>batch</th><th>epoch</th><th>worker</th><th>wait</th>"
                            "<th>fetch</th>"
                            "<th>your code</th><th>collate</th>"
                            "<th>misses</th><th style='text-align:left'>slowest files</th></tr>"
                            + "".join(rows) + "</table>") if rows else "<i>no batches in this selection</i>"
        self.slowest.options = [(f"batch {i}: {_ms(float(b['fetch_s'][i]))}", i) for i in slow]
        if slow:
            self.show_batch(slow[0])

    def show_batch(self, i: int) -> None:
        """Show the files of batch position ``i``."""
        b = self.b
        if not 0 <= i < len(b["step"]):
            self.files.value = f"<i>no batch {i}</i>"
            return
        head = (f"<b>batch {i}</b> (epoch {int(b['epoch'][i])}, worker {int(b['worker'][i])}, rank "
                f"{int(b['rank'][i])}, step {int(b['step'][i])}): waited {_ms(float(b['fetch_s'][i]))}"
                f"{stage_line(b, i)}<br>")
        self.files.value = head + files_table(self.stats.batch_files(i))

    def _hints_html(self) -> str:
        hs = self.stats.hints()
        return "".join(f"<div>&#9656; {html.escape(h)}</div>" for h in hs) if hs else ""

    # -- events
    def _changed(self, change: Any = None) -> None:
        self.refresh()

    def _zoomed(self, change: Any) -> None:  # the chart's drag (or double click: the whole run)
        view = change["new"]
        self.range.value = (int(view[0]), int(view[1])) if len(view) == 2 else (self.range.min, self.range.max)

    def _clicked(self, change: Any) -> None:
        if change["new"] is not None and change["new"] >= 0:
            self.show_batch(int(change["new"]))

    def _hovered(self, change: Any) -> None:
        i = int(change["new"])
        if self.chart is not None and 0 <= i < len(self.b["step"]):
            files = self.stats.batch_files(i)[:FILES_PER_BATCH]
            self.chart.hover_info = f"batch {i} files\nslowest files:\n" + "\n".join(
                f"  {short_name(r['file'], 60)} {_ms(r['fetch_s'])} {'hit' if r['hit'] else 'miss'}"
                for r in files) if files else f"batch {i} files\nno item records"

    def _chart_shown(self, change: Any) -> None:
        if change["new"]:
            self.plot.layout.display = "none"  # custom widgets load here: the chart replaces the PNG

    def _picked(self, change: Any) -> None:
        if change["new"] is not None:
            self.show_batch(int(change["new"]))

    def _typed(self, change: Any) -> None:
        self.show_batch(int(change["new"]))

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)

    def __repr__(self) -> str:
        return f"Explorer({self.stats!r})"
