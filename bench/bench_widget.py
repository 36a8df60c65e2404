"""Cost of the live monitor (W1) per batch and per redraw, and its share of a training loop.

    python bench/bench_widget.py

Prints microseconds per ``on_batch`` call without a redraw (the common case: the monitor redraws
at most 4 times a second), per full redraw of the ipywidgets panel (SVG sparkline of 120 points,
bars, labels; widget messages go to ipywidgets' dummy comm here, so the kernel's JSON+ZMQ send,
~10-50 us per changed widget, is not included), per SVG build alone, and per text-line redraw,
plus the monitor's share of a 4 Hz display at 1,000 batches/s.
"""
from __future__ import annotations

import io
import time

from ucmagic.notebook.panel import Monitor, Snapshot, TextView, WidgetView, sparkline_svg


class _Loader:
    batch_size = 32

    def __len__(self) -> int:
        return 100_000


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for i in range(n):
        fn(i)
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    waits = [0.001 * (1 + (i * 7919) % 13) for i in range(256)]
    mon = Monitor(_Loader(), mode="off", rate_hz=4)
    mon.on_batch(0.001)
    no_redraw = per_call(lambda i: mon.on_batch(waits[i % 256]), 200_000)

    view = WidgetView("bench")
    snap = Snapshot(title="bench", state="running", batches=10, total_batches=1000, items=320, elapsed_s=1.0,
                    files=20000, files_cached=5000, bytes_total=3_000_000_000, bytes_cached=750_000_000,
                    hit_rate=0.4, waits_ms=[w * 1000 for w in waits], p50_ms=5.0, p99_ms=12.0)

    def redraw(i: int) -> None:
        snap.batches = 10 + i
        snap.files_cached = 5000 + i
        snap.waits_ms = snap.waits_ms[1:] + [snap.waits_ms[0]]
        view.render(snap)

    widget_redraw = per_call(redraw, 2000)
    svg = per_call(lambda i: sparkline_svg(snap.waits_ms, 5.0, 12.0), 5000)
    mon_w = Monitor(_Loader(), view=view, rate_hz=1e9)  # redraw on every batch: full monitor path
    mon_w._shown = True  # no frontend here: do not print the panel
    full = per_call(lambda i: mon_w.on_batch(waits[i % 256]), 2000)
    text = TextView(io.StringIO(), live=True)
    text_redraw = per_call(lambda i: text.render(snap, float(i)), 20000)
    loop_share = (4 * full + 1000 * no_redraw) / 1e6  # seconds of monitor work per second of a 1 kHz loop
    print(f"on_batch without redraw: {no_redraw:8.2f} us")
    print(f"widget panel redraw:     {widget_redraw:8.1f} us  (SVG alone {svg:.1f} us)")
    print(f"on_batch with redraw:    {full:8.1f} us  (snapshot + panel)")
    print(f"text line redraw:        {text_redraw:8.1f} us")
    print(f"share of a 1,000 batches/s loop at 4 Hz: {loop_share:.3%}")


if __name__ == "__main__":
    main()
