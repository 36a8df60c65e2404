"""Live monitor of a loader: an ipywidgets panel in a notebook, one text line elsewhere.

The training loop drives it: the loader calls :meth:`Monitor.on_batch` from ``next()`` on the
main thread, and the monitor redraws at most ``rate_hz`` times per second (all changes of one
redraw go out as one message per widget). Background threads never touch it.

Only core ipywidgets are used (``HTML``, ``FloatProgress``, boxes), so the panel renders in
JupyterLab, Notebook 7, VS Code and Databricks. The latency plot is an inline SVG sparkline.
``UCMAGIC_PROGRESS=widget|text|off`` picks the display; the default is the widget in a notebook
frontend with ipywidgets, else text.

The engine never imports this module at import time; ``loader.monitor()`` imports it lazily.
"""
from __future__ import annotations

import contextlib
import dataclasses
import html
import math
import sys
import time
import weakref
from collections import deque
from typing import Any, Callable, TextIO

from ..progress import display_mode
from ..telemetry import p50_p99
from ..units import format_size
from .panel_render import PLOT_POINTS, RunSeries, Snapshot, format_ms, sparkline_svg, stage_bar_svg, stage_text, \
    summary_html, text_line

__all__ = ["Monitor", "Snapshot", "TextView", "WidgetView", "ProgressBar", "attach_monitor", "format_ms",
           "sparkline_svg", "text_line", "PLOT_POINTS"]

DEFAULT_RATE_HZ = 4.0
WINDOW = 256  # recent batches kept for the plot and the percentiles
LOG_INTERVAL_S = 10.0  # one line every this many seconds when the output is a log, not a terminal


# ------------------------------------------------------------------ choosing a display

def resolve_mode(mode: str | None = None) -> str:
    """``widget``, ``text`` or ``off`` (see :func:`ucmagic.progress.display_mode`, its one home)."""
    return display_mode(mode)


# ------------------------------------------------------------------ views

class TextView:
    """One ``\\r``-rewritten line on a terminal (or a notebook's stream); a line every
    ``interval_s`` seconds in a log file; always a final line."""

    def __init__(self, stream: TextIO | None = None, *, live: bool | None = None,
                 interval_s: float = LOG_INTERVAL_S) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.live = _is_live(self.stream) if live is None else live
        self.interval_s = interval_s
        self._last_print = -math.inf
        self._width = 0

    def show(self) -> None:
        pass

    def render(self, s: Snapshot, now: float) -> None:
        if s.state == "idle":  # nothing to say before the loop starts
            return
        line = text_line(s)
        if self.live:
            self._write("\r" + line.ljust(self._width))
            self._width = len(line)
        elif now - self._last_print >= self.interval_s:
            self._last_print = now
            self._write(line + "\n")

    def final(self, s: Snapshot) -> None:
        line = text_line(s)
        stages = stage_text(s.stages)
        self._write(("\r" + line.ljust(self._width) if self.live else line) + "\n"
                    + (f"  stages: {stages}\n" if stages else "")
                    + "".join(f"  hint: {h}\n" for h in s.hints)
                    + (f"  advice against {s.advice_head}\n" if s.advice and s.advice_head else "")
                    + "".join(f"  advice {i}: {a}\n" for i, a in enumerate(s.advice, 1)))
        self._width = 0

    def _write(self, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # closed stream: the display is best effort
            self.stream.write(text)
            self.stream.flush()


def _is_live(stream: Any) -> bool:
    try:
        if stream.isatty():
            return True
    except (AttributeError, ValueError):
        return False
    return type(stream).__module__.startswith("ipykernel")  # Jupyter renders \r in stream output


class ProgressBar:
    """The ipywidgets bar of :class:`ucmagic.progress.Progress` in a notebook (its ``"progress_bar"``
    presenter): shown when made, then drawn by the Progress."""

    def __init__(self, desc: str, total: int | None) -> None:
        from ..errors import import_extra

        w = import_extra("ipywidgets", feature="the progress bar")
        from IPython.display import display

        self.bar = w.IntProgress(value=0, min=0, max=max(1, total or 1), description=desc[:20], bar_style="info",
                                 layout=w.Layout(width="50%"))
        self.label = w.HTML(value="")
        display(w.HBox([self.bar, self.label]))

    def draw(self, done: int, total: int | None, text: str, *, final: bool, failed: int) -> None:
        """Show ``done`` of ``total`` and ``text``; the final state turns green, or red after failures."""
        self.bar.max = max(1, total or done or 1)
        self.bar.value = min(done, self.bar.max)
        if final:
            self.bar.bar_style = "danger" if failed else "success"
        self.label.value = text


class WidgetView:
    """The ipywidgets panel: title, cache fill bars, latency sparkline, status line."""

    def __init__(self, title: str) -> None:
        from ..errors import import_extra

        w = import_extra("ipywidgets", feature="the live panel")
        self._w = w
        layout = w.Layout(width="260px")
        self.title = w.HTML(f"<b>{html.escape(title)}</b>")
        self.files_bar = w.FloatProgress(value=0.0, min=0.0, max=1.0, description="files", bar_style="info",
                                         layout=layout)
        self.files_lbl = w.HTML()
        self.bytes_bar = w.FloatProgress(value=0.0, min=0.0, max=1.0, description="bytes", bar_style="info",
                                         layout=layout)
        self.bytes_lbl = w.HTML()
        self.batch_bar = w.FloatProgress(value=0.0, min=0.0, max=1.0, description="epoch", bar_style="",
                                         layout=layout)
        self.batch_lbl = w.HTML()
        self.plot = w.HTML()
        self.stages = w.HTML()
        self.status = w.HTML(layout=w.Layout(flex="1 1 auto", min_width="0"))  # long lines wrap beside the button
        self.explore_button = w.Button(description="explore", tooltip="open the fetch-latency explorer here",
                                       icon="search", layout=w.Layout(width="110px", min_width="110px",
                                                                      flex="0 0 auto", display="none"))
        self.explore_button.on_click(lambda _: self.on_explore())
        self.explorer_box = w.VBox([])
        self.cache_rows = w.VBox([w.HBox([self.files_bar, self.files_lbl]), w.HBox([self.bytes_bar, self.bytes_lbl])])
        self.box = w.VBox([self.title, self.cache_rows, w.HBox([self.batch_bar, self.batch_lbl]), self.plot,
                           self.stages, w.HBox([self.status, self.explore_button]), self.explorer_box])
        self.box.add_class("ucmagic-panel")
        self._displayed = False
        self.on_explore: Callable[[], None] = lambda: None  # set by the Monitor

    def show(self) -> None:
        if self._displayed:
            return
        self._displayed = True
        from IPython.display import display

        display(self.box)

    def starting(self, message: str) -> None:
        """Show the panel at once, before the dataset is listed (the first %ucload imports and lists)."""
        self._set(self.status, value=summary_html(Snapshot(state="starting", error=message)))
        self.show()

    def show_explorer(self, widget: Any) -> None:
        """Open an explorer inside the panel (the explore button, or ``--explore`` at the end)."""
        self.explorer_box.children = (widget,)

    def _set(self, widget: Any, **values: Any) -> None:
        changed = {k: v for k, v in values.items() if getattr(widget, k) != v}
        if changed:
            with widget.hold_sync():
                for k, v in changed.items():
                    setattr(widget, k, v)

    def render(self, s: Snapshot, now: float = 0.0) -> None:
        style = {"error": "danger", "done": "success"}.get(s.state, "info")
        self._set(self.status, value=summary_html(s))  # first: a final state never shows a running status
        if s.files is None:
            self._set(self.cache_rows.layout, display="none")
        else:
            self._set(self.files_bar, value=s.files_cached / s.files if s.files else 0.0, bar_style=style)
            self._set(self.files_lbl, value=f"{s.files_cached:,} / {s.files:,} cached")
            self._set(self.bytes_bar, value=s.bytes_cached / s.bytes_total if s.bytes_total else 0.0,
                      bar_style=style)
            self._set(self.bytes_lbl, value=f"{format_size(s.bytes_cached)} / {format_size(s.bytes_total)}")
        frac = s.batches / s.total_batches if s.total_batches else (1.0 if s.state == "done" else 0.0)
        self._set(self.batch_bar, value=min(1.0, frac), bar_style=style if s.state != "running" else "")
        ep = f"epoch {s.epoch}: " if s.epoch is not None else ""
        of = f"/{s.total_batches:,}" if s.total_batches is not None else ""
        self._set(self.batch_lbl, value=f"{ep}{s.batches:,}{of} batches")
        self._set(self.plot, value=sparkline_svg(s.run_ms or s.waits_ms, s.p50_ms, s.p99_ms))
        self._set(self.stages, value=stage_bar_svg(s.stages) if s.stages.get("batches") else "")
        self._set(self.explore_button.layout, display=None if s.batches else "none")

    def final(self, s: Snapshot) -> None:
        self.render(s)


class NullView:
    def show(self) -> None:
        pass

    def render(self, s: Snapshot, now: float = 0.0) -> None:
        pass

    def final(self, s: Snapshot) -> None:
        pass


# ------------------------------------------------------------------ the monitor

class Monitor:
    """Collects per-batch waits from the training loop and redraws a view at most ``rate_hz`` times a second.

    :func:`attach_monitor` wires it to a :class:`ucmagic.DataLoader` (batch and epoch-end callbacks);
    any other loop can call :meth:`on_batch` once per batch and :meth:`finish` at the end (with the
    exception that stopped it, if any). A batch after :meth:`finish` starts a new epoch display.
    Cache fill and hit rate come from ``loader.stats.snapshot()`` when the loader has one.
    """

    def __init__(self, loader: Any = None, *, mode: str | None = None, rate_hz: float = DEFAULT_RATE_HZ,
                 title: str | None = None, view: Any = None, clock: Callable[[], float] = time.monotonic,
                 stream: TextIO | None = None, explore: bool = False, advise: bool = False) -> None:
        self.loader = loader
        self.explore_at_end = explore
        self.advise_at_end = advise
        self.explorer: Any = None
        self.mode = "custom" if view is not None else resolve_mode(mode)
        self.period = 1.0 / rate_hz if rate_hz > 0 else 0.0
        self.clock = clock
        self.title = title or _title(loader)
        if view is None:
            view = {"widget": lambda: WidgetView(self.title), "text": lambda: TextView(stream),
                    "off": NullView}[self.mode]()
        self.view = view
        if hasattr(view, "on_explore"):
            view.on_explore = self.open_explorer
        self.renders = 0  # how many times the view was redrawn (tests check the throttle)
        self._waits: deque[float] = deque(maxlen=WINDOW)
        self._run = RunSeries()
        self._last_render = -math.inf
        self._start: float | None = None
        self._batches = 0
        self._items: int | None = 0
        self._state = "idle"
        self._error: str | None = None
        self._shown = False
        self._final: Snapshot | None = None
        self._seen = 0  # batches over all epochs; _seen_at_cell: at the start of the current IPython cell
        self._seen_at_cell = 0
        self._cell_hooks: tuple[Any, ...] = ()
        self._mark_counters()

    # -- driven by the loop
    def on_batch(self, wait_s: float, items: int | None = None) -> None:
        """Record one batch that waited ``wait_s`` seconds; redraw if the last redraw is old enough."""
        now = self.clock()
        if self._state != "running":
            self._begin(now)
        self._batches += 1
        self._seen += 1
        n = items if items is not None else _batch_size(self.loader)
        self._items = None if n is None or self._items is None else self._items + n
        self._waits.append(wait_s * 1000.0)
        self._run.add(wait_s * 1000.0)
        total = _total_batches(self.loader)
        if total is not None and self._batches >= total:  # the last batch: end the line before the loop's own output
            self.finish()
        elif now - self._last_render >= self.period:
            self._render(now)

    def finish(self, error: BaseException | str | None = None) -> None:
        """Final redraw: green when the epoch completed, red with the message on error."""
        if self._state in ("done", "error"):
            return
        if self._start is None:
            self._start = self.clock()
        self._state = "error" if error is not None else "done"
        self._error = _describe(error) if error is not None else None
        refresh = getattr(getattr(self.loader, "stats", None), "refresh_cache_fill", None)
        if callable(refresh):  # exact cache fill once per epoch (O(files))
            with contextlib.suppress(Exception):  # the display is best effort
                refresh()
        snap = self._final = self.snapshot()
        hints = getattr(getattr(self.loader, "stats", None), "hints", None)
        if callable(hints):
            with contextlib.suppress(Exception):  # the display is best effort
                snap.hints = hints()
        if self.advise_at_end:
            with contextlib.suppress(Exception):  # the display is best effort
                from ..loading.advise import header

                got = self.loader.stats.advise()
                snap.advice, snap.advice_head = [str(a) for a in got], header(got)
        self._mark_counters()  # what is fetched from now on belongs to the next epoch (prefetch included)
        self.renders += 1
        self.view.final(snap)
        if self.explore_at_end:
            self.open_explorer()

    def open_explorer(self) -> Any:
        """Open the fetch-latency explorer of the loader's stats in the panel; returns it."""
        stats = getattr(self.loader, "stats", None)
        show = getattr(self.view, "show_explorer", None)
        if stats is None or not callable(show):
            return None
        self.explorer = stats.explore()
        show(self.explorer.widget)
        return self.explorer

    def loop_failed(self, error: BaseException | str) -> None:
        """The loop's own body raised ``error`` (not the loader): show the epoch in red.

        The loader only sees its iterator closed, as for a ``break``, so IPython tells the monitor
        (see :func:`watch_cells`). An epoch that ran to its last batch stays green."""
        if self._state == "running":
            self.finish(error)
            return
        fin = self._final
        if self._state == "done" and fin is not None and fin.total_batches is not None \
                and fin.batches < fin.total_batches:  # closed early: that was this error, not a break
            self._state, self._error = "error", _describe(error)
            self._final = dataclasses.replace(fin, state="error", error=self._error)
            self.renders += 1
            self.view.final(dataclasses.replace(self._final))

    def _cell_start(self, info: Any = None) -> None:
        self._seen_at_cell = self._seen

    def _cell_end(self, result: Any = None) -> None:
        error = getattr(result, "error_in_exec", None)
        if error is not None and self._seen > self._seen_at_cell:  # this cell iterated the loader, then failed
            self.loop_failed(error)

    def _mark_counters(self) -> None:
        cache = self._loader_snapshot()
        self._hits0, self._misses0 = cache.get("hits", 0), cache.get("misses", 0)

    # loader callbacks: fn(loader, stats) after each batch, fn(loader, stats, error) at the end
    def _loader_batch(self, loader: Any, stats: Any) -> None:
        self.on_batch(stats.last_fetch_s)

    def _loader_end(self, loader: Any, stats: Any, error: BaseException | None) -> None:
        if self._state != "running":
            if error is None:
                return
            self._begin(self.clock())  # failed before its first batch: still show it, in red
        self.finish(error)

    def detach(self) -> None:
        """Stop receiving the loader's callbacks (the display keeps its last state)."""
        hooks, self._cell_hooks = self._cell_hooks, ()
        for event, fn in zip(("pre_run_cell", "post_run_cell"), hooks[1:]):
            with contextlib.suppress(ValueError):
                hooks[0].unregister(event, fn)
        for name, fn in (("remove_batch_callback", self._loader_batch),
                         ("remove_epoch_end_callback", self._loader_end)):
            remove = getattr(self.loader, name, None)
            if callable(remove):
                with contextlib.suppress(ValueError):
                    remove(fn)

    # -- helpers
    def show(self, *, render: bool = True) -> "Monitor":
        """Display the view now (the panel appears before the loop starts)."""
        if not self._shown:
            self._shown = True
            self.view.show()
            if render:
                self.view.render(self.snapshot(), self.clock())
        return self

    def _begin(self, now: float) -> None:
        self._state, self._error, self._final = "running", None, None
        self._start, self._batches, self._items = now, 0, 0
        self._waits.clear()
        self._run.clear()
        self._last_render = -math.inf
        self.show(render=False)

    def _render(self, now: float) -> None:
        self._last_render = now
        self.renders += 1
        self.view.render(self.snapshot(now), now)

    def _loader_snapshot(self) -> dict[str, Any]:
        fn = getattr(getattr(self.loader, "stats", None), "snapshot", None)
        if not callable(fn):
            return {}
        try:
            return fn(recent=1)
        except Exception:  # noqa: BLE001 - the display is best effort
            return {}

    def snapshot(self, now: float | None = None) -> Snapshot:
        """The current state as plain data (after :meth:`finish`: the final state of that epoch)."""
        if self._state in ("done", "error") and self._final is not None:
            return dataclasses.replace(self._final)
        now = self.clock() if now is None else now
        p50_ms, p99_ms = p50_p99(self._waits)
        s = Snapshot(title=self.title, state=self._state, batches=self._batches, items=self._items,
                     total_batches=_total_batches(self.loader), error=self._error,
                     elapsed_s=(now - self._start) if self._start is not None else 0.0,
                     waits_ms=list(self._waits), p50_ms=p50_ms, p99_ms=p99_ms,
                     run_ms=list(self._run.values))
        totals = getattr(getattr(self.loader, "stats", None), "epoch_stages", None)
        if totals is not None:
            s.stages = totals.as_dict()
        c = self._loader_snapshot()
        if isinstance(c.get("epoch"), int):
            s.epoch = c["epoch"]
        if "files" in c:
            s.files, s.files_cached = int(c["files"]), int(c["files_cached"])
            s.bytes_total, s.bytes_cached = int(c["bytes"]), int(c["bytes_cached"])
            hits, misses = c["hits"] - self._hits0, c["misses"] - self._misses0
            s.hit_rate = hits / (hits + misses) if hits + misses > 0 else None
        return s


def _title(loader: Any) -> str:
    ds = getattr(loader, "dataset", None)
    vol = getattr(ds, "volume", None)
    if vol is not None and hasattr(vol, "display"):
        return f"ucmagic \u2014 {vol.display()}"
    path = getattr(ds, "path", None)
    return f"ucmagic \u2014 {path}" if path else "ucmagic"


def _describe(error: BaseException | str) -> str:
    if isinstance(error, BaseException):
        msg = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"{type(error).__name__}: {msg}" if msg else type(error).__name__
    return str(error)


def _batch_size(loader: Any) -> int | None:
    bs = getattr(loader, "batch_size", None)
    return bs if isinstance(bs, int) else None


def _total_batches(loader: Any) -> int | None:
    if loader is None:
        return None
    try:
        return len(loader)
    except Exception:  # noqa: BLE001 - any loader without a length shows no total
        return None


def attach_monitor(loader: Any, *, mode: str | None = None, rate_hz: float = DEFAULT_RATE_HZ,
                   title: str | None = None, show: bool = True, view: Any = None, explore: bool = False,
                   advise: bool = False) -> Monitor:
    """Create a :class:`Monitor` for ``loader`` and register it as the loader's batch callback.

    ``loader.monitor()`` calls this. ``mode`` is ``widget``, ``text``, ``off`` or ``auto`` (default:
    ``UCMAGIC_PROGRESS``, else the widget in a notebook). With ``show`` the panel is displayed now.
    ``view``: an already shown view (``%ucload`` shows its panel before listing); ``explore``: open
    the explorer in the panel when the epoch ends; ``advise``: show ``loader.stats.advise()`` then.
    Returns the monitor; ``monitor.detach()`` stops it.
    """
    add = getattr(loader, "add_batch_callback", None)
    if add is None:
        raise TypeError(f"{type(loader).__name__} has no add_batch_callback(): wrap your dataset in "
                        "ucmagic.DataLoader, or call Monitor.on_batch() from your loop")
    mon = Monitor(loader, mode=mode, rate_hz=rate_hz, title=title, view=view, explore=explore, advise=advise)
    if mon.mode == "off":
        return mon
    for old in list(getattr(loader, "_ucmagic_monitors", ())):  # one live display per loader
        old.detach()
    add(mon._loader_batch)  # noqa: SLF001 - Monitor's own callback, same module
    add_end = getattr(loader, "add_epoch_end_callback", None)
    if callable(add_end):
        add_end(mon._loader_end)  # noqa: SLF001 - same module
    with contextlib.suppress(AttributeError):
        loader._ucmagic_monitors = [mon]  # noqa: SLF001 - our marker attribute on the loader
    watch_cells(mon)
    if show:
        mon.show()
    return mon


def watch_cells(mon: Monitor) -> None:
    """In IPython, let a cell that iterated ``mon``'s loader and then raised turn the display red.

    Hooks ``pre_run_cell``/``post_run_cell``; they hold the monitor weakly and unhook themselves
    once it is gone (``Monitor.detach()`` unhooks them too). Outside IPython this does nothing.
    """
    ip_mod = sys.modules.get("IPython")
    ip = ip_mod.get_ipython() if ip_mod is not None else None
    events = getattr(ip, "events", None)
    if events is None:
        return
    ref = weakref.ref(mon)

    def hook(on: Callable[[Monitor, Any], None]) -> Callable[[Any], None]:
        def run(arg: Any = None) -> None:  # the cell's info (pre) or result (post)
            m = ref()
            if m is None:
                _unhook(events, pre_run_cell, post_run_cell)
            else:
                on(m, arg)
        return run

    pre_run_cell = hook(Monitor._cell_start)  # noqa: SLF001 - same module
    post_run_cell = hook(Monitor._cell_end)  # noqa: SLF001 - same module
    events.register("pre_run_cell", pre_run_cell)
    events.register("post_run_cell", post_run_cell)
    mon._cell_hooks = (events, pre_run_cell, post_run_cell)  # noqa: SLF001 - same module


def _unhook(events: Any, pre: Any, post: Any) -> None:
    for event, fn in (("pre_run_cell", pre), ("post_run_cell", post)):
        with contextlib.suppress(ValueError):
            events.unregister(event, fn)
