"""The ``%ucload`` live panel in a real browser: JupyterLab + headless Chromium (SPEC M1, M2, W1).

A JupyterLab server on 127.0.0.1 (temporary root, token and Jupyter dirs) serves a generated
notebook; Playwright drives the system Chromium (never a downloaded one). Everything asserted is
read from the page's DOM while the kernel runs the cell. Screenshots (mid-run, end, error) and the
server log go to ``$UCMAGIC_BROWSER_ARTIFACTS`` when set, else to a pytest temp dir.

Skipped with the reason when Playwright, JupyterLab or Chromium is missing, unless
``UCMAGIC_REQUIRE_BROWSER=1`` (CI sets it once Chromium is installed): then a missing piece fails.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # browser_harness, whatever pytest's import mode
import browser_harness as bh

FILES, BATCH = 640, 16  # 40 batches of 16 files of 4 KiB
STEP_S = 0.15  # the training step: the cell runs about 6 s
TOTAL = FILES // BATCH
FAILING_LOOP = '''
for i, batch in enumerate(loader):    # a second epoch whose training step fails
    time.sleep(0.05)
    if i == 10:
        raise RuntimeError("simulated training failure")
'''

EXPLORE_FILES, EXPLORE_SLOW = 192, 150  # 24 batches of 8; the straggler is late in its worker's stream

_missing = bh.missing_requirement()
if _missing and os.environ.get("UCMAGIC_REQUIRE_BROWSER", "").strip() not in ("", "0"):
    raise RuntimeError(f"UCMAGIC_REQUIRE_BROWSER is set but {_missing}")

pytestmark = [pytest.mark.browser, pytest.mark.timeout(600),
              pytest.mark.skipif(_missing is not None, reason=f"browser test: {_missing}")]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory) -> Path:
    env = os.environ.get("UCMAGIC_BROWSER_ARTIFACTS")
    out = Path(env) if env else tmp_path_factory.mktemp("browser-artifacts")
    out.mkdir(parents=True, exist_ok=True)
    return out


@pytest.fixture(scope="module")
def lab(tmp_path_factory, artifacts):
    root = tmp_path_factory.mktemp("lab-root")
    cell = bh.training_cell(str(root / "volume"), files=FILES, batch=BATCH, step_s=STEP_S)
    explore = bh.explorer_cell(str(root / "straggler"), files=EXPLORE_FILES, slow=EXPLORE_SLOW)
    bh.write_notebook(root / "panel.ipynb", [cell, FAILING_LOOP, explore])
    with bh.lab_session(root, "panel.ipynb", artifacts) as page:
        yield page


def _run_first_cell(lab, artifacts: Path) -> tuple[list[bh.WidgetState], bh.WidgetState]:
    """Run the training cell; return the panel states seen while it ran, and its final state."""
    lab.run_cell(0)
    running: list[bh.WidgetState] = []
    mid_shot = False
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        state = lab.widget_state(0)
        if lab.cell_done(0):  # read after the state: a state read before this is a running state
            break
        if state is not None:
            running.append(state)
            if not mid_shot and state.batches and state.batches >= TOTAL // 2:
                lab.screenshot(artifacts / "mid-run.png")
                lab.screenshot(artifacts / "mid-run-panel.png", cell=0)
                mid_shot = True
        time.sleep(0.2)
    else:
        raise TimeoutError("the training cell did not finish within 300 s")
    final = _wait_for(lab, 0, lambda s: "done in" in s.status, "the panel to show 'done'")
    lab.screenshot(artifacts / "end.png")
    lab.screenshot(artifacts / "end-panel.png", cell=0)
    return running, final


def _wait_for(lab, cell: int, ok, what: str, timeout: float = 60) -> bh.WidgetState:
    deadline = time.monotonic() + timeout
    state = None
    while time.monotonic() < deadline:
        state = lab.widget_state(cell)
        if state is not None and ok(state):
            return state
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last panel state: {state}")


@pytest.fixture(scope="module")
def first_run(lab, artifacts):
    return _run_first_cell(lab, artifacts)


def test_panel_is_live_while_the_loop_runs(first_run):
    seen, _ = first_run
    assert seen, "no ucmagic panel appeared in the cell's output while it ran"
    running = [s for s in seen if "ETA" in s.status]  # the epoch's own state (its end may precede the cell's)
    cached = [s.files_cached for s in running if s.files_cached is not None]
    batches = [s.batches for s in running if s.batches is not None]
    assert len(set(cached)) >= 3, f"cache fill did not move while the cell ran: {cached}"
    assert len(set(batches)) >= 3, f"batch counter did not move while the cell ran: {batches}"
    assert cached == sorted(cached) and batches == sorted(batches)
    assert all(s.files_total == FILES and s.total_batches == TOTAL for s in running)
    assert min(batches) < TOTAL // 2  # seen early, not only at the end
    drawn = [s for s in running if s.plot_points >= 2]
    assert drawn, "the latency plot was never drawn while the cell ran"
    assert drawn[-1].p50 and drawn[-1].p99
    green = [s for s in running if any(b.style == "success" for b in s.bars)]
    assert not green, f"green before the end: {green[:2]}"  # green only at the end


def test_panel_shows_the_final_state(lab, first_run):
    _, final = first_run
    assert (final.files_cached, final.files_total) == (FILES, FILES)
    assert (final.batches, final.total_batches) == (TOTAL, TOTAL)
    assert [(b.name, b.fraction, b.style) for b in final.bars] == [
        ("files", 1.0, "success"), ("bytes", 1.0, "success"), ("epoch", 1.0, "success")]
    assert final.plot_points == TOTAL  # one point per batch (fewer than the plot's 120)
    for label in (final.p50, final.p99):
        assert label and re.fullmatch(r"\d+(\.\d)? ms", label), final.svg_text
    assert re.search(rf"{TOTAL}/{TOTAL} batches .*hit rate 0% .*done in", final.status), final.status
    assert "epoch done" in lab.output_text(0)


def test_the_panel_reads_cleanly(lab, first_run):
    """Issue 52: labels cut off ("loop 6.43 s, waiti", "workers' s"), the loop's line printed twice, the
    whole-epoch sparkline drawn right-aligned with its left half empty, the explore button collapsing to an
    icon and an ellipsis at the end of the epoch."""
    lay = _until(lambda: bh.panel_layout(lab, 0), lambda d: d["button"] and d["button"]["shown"],
                 "the panel's explore button to show")
    clipped = [t["text"] for t in lay["texts"] if not t["inside"]]
    assert not clipped, f"labels drawn past their picture's edge: {clipped}"
    labels = [t["text"] for t in lay["texts"] if t["stages"]]
    assert labels[:2] == ["the loop", "making batches"], labels
    loop_lines = [line for line in lay["text"].splitlines() if line.startswith("the loop ")]  # not the hints'
    assert len(loop_lines) == 1 and "waiting" in loop_lines[0], lay["text"]
    assert lay["first_x"] is not None and lay["first_x"] <= 5, lay  # the epoch so far, from the left edge
    button = lay["button"]
    assert button["text"] == "explore" and not button["clipped"] and button["inside"], button


def test_a_failing_loop_turns_the_panel_red(lab, first_run, artifacts):
    lab.run_cell(1)
    lab.wait_cell_done(1, timeout=120)
    assert "simulated training failure" in lab.output_text(1)
    state = _wait_for(lab, 0, lambda s: "failed" in s.status, "the panel to turn red")
    lab.screenshot(artifacts / "error.png")
    assert "failed: RuntimeError: simulated training failure" in state.status
    assert {b.style for b in state.bars} == {"danger"}
    assert state.batches == 11 and state.total_batches == TOTAL and state.bar("epoch").fraction < 1
    assert "epoch 1" in " ".join(state.texts) and "hit rate 100%" in state.status  # second epoch: all cached


def test_explorer_zooms_and_names_the_slow_file(lab, artifacts):
    """Default workers under spawn, one injected slow file: the explorer shows it; moving the range
    control redraws the plot and the slowest-batches table."""
    lab.run_cell(2)
    lab.wait_cell_done(2, timeout=300)
    out = lab.output_text(2)
    assert "straggler:" in out, out
    straggler = out.split("straggler:", 1)[1].split()[0]
    deadline = time.monotonic() + 60
    before = None
    while time.monotonic() < deadline and not (before and before.img and before.table):
        before = bh.explorer_state(lab, 2)
        time.sleep(0.2)
    assert before and before.img, before  # a PNG (blob: URL) drawn: shown until the chart renders
    assert straggler in before.table, before.table
    assert before.summary.startswith("24 batches in view"), before.summary
    _hover_and_zoom_the_chart(lab, straggler, artifacts)
    before = bh.explorer_state(lab, 2) or before
    lab.screenshot(artifacts / "explorer.png")
    bh.move_range_start(lab, 2, 3)
    deadline = time.monotonic() + 60
    after = before
    # the summary, the table and the files are three widgets, updated one after the other: wait for all three
    while time.monotonic() < deadline and not (after.summary.startswith("21 batches in view")
                                               and straggler in after.table and straggler in after.files):
        time.sleep(0.2)
        after = bh.explorer_state(lab, 2) or before
    assert after.summary.startswith("21 batches in view"), after.summary
    assert after.img != before.img and after.table != before.table
    assert straggler in after.table and straggler in after.files  # the slowest batch in view holds it


def _hover_and_zoom_the_chart(lab, straggler: str, artifacts: Path) -> None:
    """The interactive chart (anywidget): it replaces the PNG once its JavaScript runs; hovering the
    tallest bar names that batch and, asked from the kernel, the straggler; a drag zooms the range."""
    chart = _until(lambda: bh.chart_state(lab, 2), lambda c: c["steps"] == 24 and not c["png_shown"],
                   "the chart to draw 24 batches and hide the PNG")
    tip = None
    for step in chart["by_height"][:3]:  # the straggler's batch is among the longest waits (the first: startup)
        bh.hover_chart_step(lab, 2, step)
        tip = _until(lambda: bh.chart_state(lab, 2), lambda c, s=step: f"step {s})" in c["tip"]
                     and "slowest files" in c["tip"], f"the hover over step {step} to show its files")
        if straggler in tip["tip"]:
            break
    assert tip and straggler in tip["tip"] and "made in: fetch" in tip["tip"], tip
    lab.screenshot(artifacts / "explorer-chart-hover.png", cell=2)
    lay = bh.explorer_layout(lab, 2)
    assert lay and not lay["overflowing"], lay  # issue 52: the controls, chart and table fit the output's width
    assert lay["files_wrap"] and lay["files_inside"], lay  # the slowest-files column wraps, never clips
    bh.drag_chart(lab, 2, 0.0, 0.5)
    zoomed = _until(lambda: bh.explorer_state(lab, 2), lambda e: not e.summary.startswith("24 batches"),
                    "the drag to zoom the range")
    assert bh.chart_state(lab, 2)["tip"] == "", "the tooltip stayed up after the drag (issue 52)"
    n = int(zoomed.summary.split()[0])
    assert 8 <= n <= 16, zoomed.summary  # about the first half of 24 batches
    assert _until(lambda: bh.chart_state(lab, 2), lambda c: c["steps"] == n, "the chart to redraw")["steps"] == n
    lab.page.locator(".ucmagic-chart svg").first.dblclick()
    _until(lambda: bh.explorer_state(lab, 2), lambda e: e.summary.startswith("24 batches in view"),
           "a double click to show the whole run again")


def _until(read, ok, what: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    got = None
    while time.monotonic() < deadline:
        got = read()
        if got is not None and ok(got):
            return got
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last seen: {got}")
