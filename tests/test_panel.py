"""ucmagic.notebook.panel, the live monitor (W1): pure renderers, throttling, final states, widget and text
views, the monitor on real loaders."""
from __future__ import annotations

import io
import math
import sys
import xml.etree.ElementTree as ET

import pytest

from ucmagic.notebook import panel as widget
from ucmagic.notebook.panel import Monitor, Snapshot, TextView, sparkline_svg, text_line


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class RecordingView:
    def __init__(self) -> None:
        self.shown = 0
        self.renders: list[Snapshot] = []
        self.finals: list[Snapshot] = []

    def show(self) -> None:
        self.shown += 1

    def render(self, s: Snapshot, now: float = 0.0) -> None:
        self.renders.append(s)

    def final(self, s: Snapshot) -> None:
        self.finals.append(s)


class FakeLoader:
    """What the monitor reads from a loader: dataset, batch_size, len(), add_batch_callback."""

    def __init__(self, dataset=None, batch_size: int = 4, n: int | None = 10) -> None:
        self.dataset, self.batch_size, self._n = dataset, batch_size, n
        self.callbacks = []

    def __len__(self) -> int:
        if self._n is None:
            raise TypeError("no len")
        return self._n

    def add_batch_callback(self, fn) -> None:
        self.callbacks.append(fn)


# ------------------------------------------------------------------ pure pieces

def test_sparkline_is_valid_svg_with_percentile_lines():
    svg = sparkline_svg([1.0, 5.0, 2.0, 80.0], 3.5, 78.0)
    root = ET.fromstring(svg)
    tags = [el.tag.split("}")[-1] for el in root.iter()]
    assert "polyline" in tags and tags.count("line") == 2
    assert "p50 3.5 ms" in svg and "p99 78 ms" in svg
    # only the most recent points are drawn
    many = sparkline_svg([float(i) for i in range(1000)], 500.0, 990.0, points=50)
    pts = ET.fromstring(many).find("{http://www.w3.org/2000/svg}polyline").get("points").split()
    assert len(pts) == 50


def test_sparkline_without_data_has_no_line():
    svg = sparkline_svg([], math.nan, math.nan)
    assert "polyline" not in svg and "p50" not in svg
    ET.fromstring(svg)


def test_text_line_names_cache_latency_and_state():
    s = Snapshot(title="ucload", state="running", batches=5, total_batches=20, items=160, elapsed_s=2.0,
                 files=100, files_cached=40, bytes_total=1_000_000, bytes_cached=400_000, hit_rate=0.25,
                 p50_ms=12.0, p99_ms=80.0)
    line = text_line(s)
    assert "5/20 batches" in line and "cached 40/100 files" in line and "hit 25%" in line
    assert "p50 12 ms" in line and "p99 80 ms" in line and "80 items/s" in line and "eta" in line
    s.state, s.error = "error", "FetchError: cannot copy x"
    assert "FAILED: FetchError: cannot copy x" in text_line(s)
    assert "\n" not in text_line(s)


def test_eta_from_rate():
    s = Snapshot(state="running", batches=10, total_batches=30, elapsed_s=5.0)
    assert s.eta_s == pytest.approx(10.0)
    s.state = "done"
    assert s.eta_s is None


# ------------------------------------------------------------------ choosing the display

def test_resolve_mode(monkeypatch):
    monkeypatch.delenv("UCMAGIC_PROGRESS", raising=False)
    assert widget.resolve_mode() == "text"  # no notebook frontend here
    assert widget.resolve_mode("off") == "off"
    assert widget.resolve_mode("widget") == "widget"
    monkeypatch.setenv("UCMAGIC_PROGRESS", "off")
    assert widget.resolve_mode() == "off"
    assert widget.resolve_mode("auto") == "off"  # auto defers to the variable
    assert widget.resolve_mode("text") == "text"  # an explicit mode wins
    with pytest.raises(ValueError, match="UCMAGIC_PROGRESS"):
        widget.resolve_mode("loud")


# ------------------------------------------------------------------ the monitor

def test_updates_are_throttled_and_values_change():
    clock, view = FakeClock(), RecordingView()
    mon = Monitor(FakeLoader(n=1000), view=view, clock=clock, rate_hz=4)
    for i in range(400):  # 400 batches, 10 ms apart: 4 s of loop
        mon.on_batch(0.002 + (i % 10) * 0.001)
        clock.t += 0.01
    assert view.shown == 1
    assert 14 <= len(view.renders) <= 17  # ~4 per second, never one per batch
    first, last = view.renders[0], view.renders[-1]
    assert first.batches == 1 and last.batches > 370
    assert last.items == last.batches * 4
    assert last.state == "running" and last.total_batches == 1000 and last.eta_s is not None
    assert 2.0 <= last.p50_ms <= 12.0 and last.p99_ms >= last.p50_ms
    assert len(last.waits_ms) == widget.WINDOW


def test_final_state_done_then_new_epoch_restarts():
    clock, view = FakeClock(), RecordingView()
    mon = Monitor(FakeLoader(), view=view, clock=clock)
    for _ in range(10):
        mon.on_batch(0.001)
        clock.t += 0.05
    mon.finish()
    mon.finish()  # idempotent
    assert len(view.finals) == 1 and view.finals[0].state == "done" and view.finals[0].batches == 10
    mon.on_batch(0.001)  # next epoch
    assert view.renders[-1].state == "running" and view.renders[-1].batches == 1


def test_final_state_on_error_carries_the_message():
    clock, view = FakeClock(), RecordingView()
    mon = Monitor(FakeLoader(), view=view, clock=clock)
    mon.on_batch(0.01)
    mon.finish(OSError("cannot copy /v/a.bin: boom\nsecond line"))
    fin = view.finals[-1]
    assert fin.state == "error" and fin.error == "OSError: cannot copy /v/a.bin: boom"


def _uc_loader(root, **kw):
    from ucmagic.files.dataset import UCVolumeDataset
    from ucmagic.loading.loader import DataLoader

    return DataLoader(UCVolumeDataset(root), batch_size=10, num_workers=0, log_to_mlflow=False, **kw)


def test_cache_fill_follows_a_real_loader(tree):
    root, rels = tree
    loader = _uc_loader(root)
    clock, view = FakeClock(), RecordingView()
    mon = Monitor(loader, view=view, clock=clock, rate_hz=1000)
    loader.add_batch_callback(mon._loader_batch)
    loader.add_epoch_end_callback(mon._loader_end)
    first = mon.snapshot()
    assert first.files == len(rels) and first.files_cached == 0 and first.total_batches == 12
    for _ in loader:
        clock.t += 0.01
    cached = [s.files_cached for s in view.renders]
    # fills while the loop runs; the 12th (last) batch draws the final state at once
    assert len(view.renders) == 11 and cached == sorted(cached) and cached[-1] > 0
    fin = view.finals[-1]
    assert fin.state == "done" and fin.batches == 12 and fin.items == 120
    assert fin.files_cached == len(rels) and fin.bytes_cached == fin.bytes_total == 3000 * len(rels)
    assert fin.hit_rate == 0.0 and fin.epoch == 0
    for _ in loader:  # second epoch: a new display state, everything a hit
        pass
    assert view.finals[-1].hit_rate == 1.0 and view.finals[-1].epoch == 1 and len(view.finals) == 2


def test_loader_monitor_turns_red_when_the_loader_fails(tree):
    root, _ = tree
    loader = _uc_loader(root, collate_fn=lambda b: 1 / 0)
    mon = loader.monitor(mode="text", show=False)
    assert isinstance(mon.view, TextView)
    mon.view = RecordingView()
    with pytest.raises(ZeroDivisionError):
        next(iter(loader))
    fin = mon.view.finals[-1]
    assert fin.state == "error" and fin.error.startswith("ZeroDivisionError")


def test_attach_monitor_registers_the_callbacks_once():
    loader = FakeLoader()
    mon = widget.attach_monitor(loader, mode="text", show=False)
    assert loader.callbacks == [mon._loader_batch]
    assert widget.attach_monitor(loader, mode="off").mode == "off"
    with pytest.raises(TypeError, match="add_batch_callback"):
        widget.attach_monitor(object(), mode="text")


def test_one_display_per_loader(tree):
    root, _ = tree
    loader = _uc_loader(root)
    m1 = loader.monitor(mode="text", show=False)
    m2 = loader.monitor(mode="text", show=False)
    assert loader._batch_callbacks == [m2._loader_batch] and loader._end_callbacks == [m2._loader_end]
    assert m1 is not m2


# ------------------------------------------------------------------ the widget view

def test_widget_view_shows_state_and_turns_red_on_error():
    pytest.importorskip("ipywidgets")
    view = widget.WidgetView("ucmagic test")
    s = Snapshot(title="t", state="running", batches=3, total_batches=12, items=30, elapsed_s=1.0, files=10,
                 files_cached=4, bytes_total=1000, bytes_cached=400, hit_rate=0.5, waits_ms=[1.0, 2.0, 9.0],
                 p50_ms=2.0, p99_ms=9.0)
    view.render(s)
    assert view.files_bar.value == pytest.approx(0.4) and view.bytes_bar.value == pytest.approx(0.4)
    assert "4 / 10 cached" in view.files_lbl.value
    assert view.batch_bar.value == pytest.approx(0.25)
    assert "<svg" in view.plot.value and "p99" in view.plot.value
    assert "ETA" in view.status.value
    s.state, s.error = "error", "FetchError: nope"
    view.final(s)
    assert view.files_bar.bar_style == "danger" and view.batch_bar.bar_style == "danger"
    assert "#d62728" in view.status.value and "FetchError: nope" in view.status.value
    s.state, s.error = "done", None
    view.final(s)
    assert view.files_bar.bar_style == "success"


def test_widget_view_hides_cache_rows_without_a_file_cache():
    pytest.importorskip("ipywidgets")
    view = widget.WidgetView("parquet")
    view.render(Snapshot(state="running", batches=1))
    assert view.cache_rows.layout.display == "none"


def test_monitor_in_widget_mode_updates_the_panel(tree):
    pytest.importorskip("ipywidgets")
    clock = FakeClock()
    mon = Monitor(FakeLoader(n=5), mode="widget", clock=clock)
    assert isinstance(mon.view, widget.WidgetView)
    mon.on_batch(0.004)
    assert "1/5 batches" in mon.view.batch_lbl.value
    mon.finish(RuntimeError("boom"))
    assert mon.view.batch_bar.bar_style == "danger"


# ------------------------------------------------------------------ text fallback

def test_text_view_rewrites_one_line_on_a_terminal():
    out = io.StringIO()
    clock = FakeClock()
    mon = Monitor(FakeLoader(n=100), view=TextView(out, live=True), clock=clock, rate_hz=4)
    for _ in range(20):
        mon.on_batch(0.003)
        clock.t += 0.1
    mon.finish()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.count("\r") == mon.renders
    assert "20 batches" in text.split("\r")[-1] and "done" in text.split("\r")[-1]


def test_text_view_prints_periodic_lines_in_a_log():
    out = io.StringIO()
    clock = FakeClock()
    mon = Monitor(FakeLoader(n=1000), view=TextView(out, live=False, interval_s=10.0), clock=clock, rate_hz=4)
    for _ in range(300):  # 30 s of loop
        mon.on_batch(0.003)
        clock.t += 0.1
    mon.finish(ValueError("bad batch"))
    lines = out.getvalue().splitlines()
    assert 3 <= len(lines) <= 5 and "\r" not in out.getvalue()
    assert "FAILED: ValueError: bad batch" in lines[-1]


def test_text_mode_writes_to_stderr(capsys):
    mon = Monitor(FakeLoader(n=2), mode="text", clock=FakeClock())
    mon.on_batch(0.001)
    mon.finish()
    err = capsys.readouterr().err
    assert "batches" in err and "done" in err


# ------------------------------------------------------------------ rough edges of a first run

def test_first_line_has_no_rate_or_eta_before_they_mean_something():
    first = Snapshot(title="t", state="running", batches=1, total_batches=1000, items=32, elapsed_s=0.02)
    line = text_line(first)
    assert "items/s" not in line and "eta" not in line and first.eta_s is None
    later = Snapshot(title="t", state="running", batches=50, total_batches=1000, items=1600, elapsed_s=5.0)
    assert "320 items/s" in text_line(later) and "eta 1m35s" in text_line(later)


def test_stage_progress_first_line_has_no_rate_or_eta():
    from ucmagic.progress import format_progress

    line = format_progress(1, 2000, 150_000, 0.01, desc="stage")
    assert "/s" not in line and "eta" not in line
    assert "eta" in format_progress(100, 2000, 15_000_000, 2.0, desc="stage")


def test_stage_progress_in_widget_mode_draws_the_notebook_bar_and_ends_green_or_red(monkeypatch):
    pytest.importorskip("ipywidgets")
    from ucmagic import presenters
    from ucmagic.notebook.panel import ProgressBar
    from ucmagic.progress import Progress

    bars: list[ProgressBar] = []
    monkeypatch.setitem(presenters._registry, "progress_bar", lambda desc, total: bars.append(ProgressBar(desc, total))
                        or bars[-1])
    with Progress(total=4, desc="stage", mode="widget", interval=0) as p:
        p.update(3, nbytes=300)
    assert p.mode == "widget" and len(bars) == 1
    bar = bars[0]
    assert (bar.bar.value, bar.bar.max, bar.bar.bar_style) == (3, 4, "success")
    assert bar.label.value.startswith("3/4") and "stage" not in bar.label.value  # the description is on the bar
    bar.draw(4, 4, "4/4", final=True, failed=1)
    assert bar.bar.bar_style == "danger" and bar.label.value == "4/4"


def test_stage_progress_falls_back_to_text_when_no_bar_can_be_shown(monkeypatch, capsys):
    from ucmagic import presenters
    from ucmagic.progress import Progress

    def broken(desc: str, total: int | None) -> None:
        raise RuntimeError("no frontend")

    monkeypatch.setitem(presenters._registry, "progress_bar", broken)
    with Progress(total=2, desc="stage", mode="widget", stream=sys.stderr, interval=0) as p:
        p.update(2)
    assert p.mode == "text" and "stage: 2/2" in capsys.readouterr().err


def test_a_cell_that_iterates_the_loader_then_raises_turns_the_display_red_and_hooks_go_with_the_monitor():
    import gc

    import torch
    from IPython.core.interactiveshell import InteractiveShell

    from ucmagic import DataLoader

    ip = InteractiveShell.instance()
    try:
        loader = DataLoader(torch.arange(40), batch_size=4, num_workers=0, log_to_mlflow=False)
        mon = widget.attach_monitor(loader, view=RecordingView(), show=False)
        ip.user_ns["loader"] = loader
        ip.run_cell("for i, b in enumerate(loader):\n    if i == 3:\n        raise RuntimeError('bad batch')")
        snap = mon.snapshot()
        assert snap.state == "error" and "bad batch" in (snap.error or "")
        ip.run_cell("for b in loader:\n    pass")  # a later epoch that ends normally is green again
        assert mon.snapshot().state == "done"
        gc.collect()
        ip.run_cell("1")  # hooks of monitors that earlier tests dropped go first: count only this one's
        hooks = len(ip.events.callbacks["post_run_cell"])
        mon.detach()
        del mon
        gc.collect()
        ip.run_cell("1")
        assert len(ip.events.callbacks["post_run_cell"]) == hooks - 1
    finally:
        InteractiveShell.clear_instance()


def test_users_print_after_the_last_batch_starts_on_a_fresh_line():
    """The final line (with its newline) is drawn when the last batch is delivered, before the
    loop body runs, so what the loop prints at the end of the epoch does not land on the \\r line."""
    out = io.StringIO()
    loader = FakeLoader(n=5)
    mon = Monitor(loader, view=TextView(out, live=True), clock=FakeClock(), rate_hz=1000)
    for _ in range(5):
        mon.on_batch(0.002)
    assert out.getvalue().endswith("\n") and "done" in out.getvalue().split("\r")[-1]
    mon.finish()  # the loader's epoch-end callback comes later: nothing more is written
    assert out.getvalue().count("\n") == 1


def test_run_series_keeps_the_cold_first_spike():
    rs = widget.RunSeries(points=8)
    rs.add(5000.0)  # the cold first batch
    for _ in range(999):
        rs.add(2.0)
    assert len(rs.values) <= 8 and rs.values[0] == 5000.0 and rs.values[-1] == 2.0
    assert rs.width * len(rs.values) >= 1000


def test_sparkline_uses_a_log_scale_under_a_cold_spike():
    waits = [4000.0] + [2.0 + (i % 5) for i in range(100)]
    svg = sparkline_svg(waits, 3.0, 6.0)
    ET.fromstring(svg)
    assert "log scale" in svg and "whole epoch" in svg
    ys = [float(p.split(",")[1]) for p in svg.split('points="')[1].split('"')[0].split()]
    # the steady state uses a good part of the height instead of a flat line at the bottom
    assert max(ys[1:]) - min(ys[1:]) > 5 and min(ys) == ys[0]
    assert "log scale" not in sparkline_svg([2.0, 3.0, 4.0], 3.0, 4.0)


def test_whole_epoch_reaches_the_plot():
    view = RecordingView()
    mon = Monitor(FakeLoader(n=1000), view=view, clock=FakeClock(), rate_hz=1000)
    mon.on_batch(5.0)
    for _ in range(400):
        mon.on_batch(0.002)
    assert view.renders[-1].run_ms[0] == 5000.0 and len(view.renders[-1].run_ms) <= widget.PLOT_POINTS


def test_final_state_carries_the_hints(tree):
    root, _ = tree
    loader = _uc_loader(root)
    view = RecordingView()
    mon = Monitor(loader, view=view, clock=FakeClock(), rate_hz=1000)
    loader.add_batch_callback(mon._loader_batch)
    for _ in loader:
        pass
    assert view.finals[-1].hints == loader.stats.hints()
    out = io.StringIO()
    TextView(out, live=False).final(Snapshot(state="done", hints=["a hint"]))
    assert out.getvalue().endswith("  hint: a hint\n")


def test_panel_starts_in_a_listing_state():
    pytest.importorskip("ipywidgets")
    view = widget.WidgetView("ucmagic")
    view.starting("starting: listing /v ...")
    assert "starting: listing /v" in view.status.value and view.explore_button.layout.display == "none"
    view.show()  # already shown by starting(): not displayed twice
    assert view._displayed


def test_explore_button_opens_the_explorer_in_the_panel(tree):
    pytest.importorskip("ipywidgets")
    root, _ = tree
    loader = _uc_loader(root)
    mon = widget.attach_monitor(loader, mode="widget", show=False)
    for _ in loader:
        pass
    assert mon.view.explore_button.layout.display is None and mon.view.explorer_box.children == ()
    mon.view.explore_button.click()
    (box,) = mon.view.explorer_box.children
    assert box is mon.explorer.widget and "batches in view" in mon.explorer.summary.value


def test_explore_at_the_end_opens_it_when_the_loop_ends(tree):
    pytest.importorskip("ipywidgets")
    root, _ = tree
    loader = _uc_loader(root)
    mon = widget.attach_monitor(loader, mode="widget", show=False, explore=True)
    it = iter(loader)
    next(it)
    assert mon.view.explorer_box.children == ()
    for _ in it:
        pass
    assert mon.view.explorer_box.children == (mon.explorer.widget,)


# ------------------------------------------------------------------ issue 45: the epoch's stage bar, --advise

def test_stage_bar_draws_the_loops_time_and_the_workers_seconds_per_stage():
    from ucmagic.notebook.panel_render import stage_bar_svg

    svg = stage_bar_svg({"compute": 1.0, "wait": 3.0, "wait_fetch": 2.0, "wait_user": 1.0, "wait_collate": 0.0,
                         "fetch": 4.0, "user": 2.0, "collate": 0.5, "batches": 10})
    root = ET.fromstring(svg[:svg.index("</svg>") + 6])
    titles = [r.find("{http://www.w3.org/2000/svg}title").text for r in root.iter("{http://www.w3.org/2000/svg}rect")]
    assert titles == ["loop compute: 1 s", "fetch: 2 s", "your code: 1 s", "fetch: 4 s", "your code: 2 s",
                      "collate: 0.5 s"]
    assert "waiting 75%" in svg


def test_the_panel_shows_the_epochs_stages_and_the_advice_at_the_end():
    import torch

    from ucmagic.loading.loader import DataLoader

    class Slow(torch.utils.data.Dataset):
        def __len__(self):
            return 12

        def __getitem__(self, i):
            import time
            time.sleep(0.005)
            return i

    loader = DataLoader(Slow(), batch_size=4, num_workers=0, log_to_mlflow=False)
    out = io.StringIO()
    mon = widget.attach_monitor(loader, mode="text", show=False, advise=True)
    mon.view = TextView(out, live=False)
    for _ in loader:
        pass
    fin = mon.snapshot()
    assert fin.stages["batches"] == 3 and fin.stages["user"] >= 12 * 0.005
    assert fin.advice and "advice 1: " in out.getvalue()
    assert "  stages: loop " in out.getvalue() and "your code" in out.getvalue()
