"""JupyterLab + headless Chromium, driven by Playwright: shared by tests/test_browser.py and docs/screenshots.py.

It uses the system's Chromium (Debian's ``chromium`` package, or ``$UCMAGIC_CHROMIUM``); it never
downloads a browser. The JupyterLab server listens on 127.0.0.1 with a random token, a temporary
root directory and temporary config, runtime, workspace and IPython directories, so nothing of the
user's own Jupyter setup is read or written. Its kernel imports ucmagic from this checkout.

Typical use::

    with lab_session(root, "demo.ipynb", artifacts) as lab:
        lab.run_cell(0)
        state = lab.widget_state(0)     # WidgetState parsed from the page's DOM
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

REPO = Path(__file__).resolve().parent.parent

CHROMIUM_CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser", "/usr/lib/chromium/chromium")
# Flags for a system Chromium in a container (root, small /dev/shm, no network, no GPU).
CHROMIUM_ARGS = ["--no-sandbox", "--headless", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-dev-shm-usage"]
# Environment the test runner sets that must not reach the notebook's kernel.
_SCRUB_ENV = ("UCMAGIC_PROGRESS", "UCMAGIC_RAISE", "UCMAGIC_CACHE_DIR", "JUPYTER_CONFIG_DIR",
              "JUPYTER_RUNTIME_DIR", "JUPYTERLAB_WORKSPACES_DIR", "JUPYTERLAB_SETTINGS_DIR", "IPYTHONDIR",
              "MPLBACKEND", "JPY_SESSION_NAME")


# ------------------------------------------------------------------ requirements

def find_chromium() -> str | None:
    """The Chromium executable: ``$UCMAGIC_CHROMIUM``, else Debian's ``/usr/bin/chromium`` or one on PATH."""
    env = os.environ.get("UCMAGIC_CHROMIUM")
    if env:
        return env if os.access(env, os.X_OK) else None
    for path in CHROMIUM_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("chromium") or shutil.which("chromium-browser")


def missing_requirement() -> str | None:
    """Why the browser test cannot run here (None when it can)."""
    for mod, pip in (("playwright", "playwright"), ("jupyterlab", "jupyterlab"), ("ipywidgets", "ipywidgets"),
                     ("ipykernel", "ipykernel")):
        if importlib.util.find_spec(mod) is None:
            return f"{mod} is not installed: pip install {pip} (or pip install -e '.[test]')"
    if find_chromium() is None:
        return ("no Chromium found (/usr/bin/chromium): apt-get install -y chromium, "
                "or set UCMAGIC_CHROMIUM to a Chromium executable")
    return None


# ------------------------------------------------------------------ notebooks

def write_notebook(path: str | os.PathLike, cells: Sequence[str]) -> Path:
    """Write a notebook (nbformat 4) of code cells without outputs, on the ``python3`` kernel."""
    nb = {
        "nbformat": 4, "nbformat_minor": 5,
        "metadata": {"kernelspec": {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"},
                     "language_info": {"name": "python"}},
        "cells": [{"cell_type": "code", "id": f"cell-{i}", "metadata": {}, "execution_count": None, "outputs": [],
                   "source": src.strip("\n")} for i, src in enumerate(cells)],
    }
    out = Path(path)
    out.write_text(json.dumps(nb, indent=1))
    return out


# ------------------------------------------------------------------ the JupyterLab server

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_lab_settings(config_dir: Path) -> None:
    """No news/update toasts; render every cell (no virtual scrolling that detaches off-screen outputs)."""
    labconfig = config_dir / "labconfig"
    labconfig.mkdir(parents=True, exist_ok=True)
    (labconfig / "page_config.json").write_text(json.dumps(
        {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
    tracker = config_dir / "lab" / "user-settings" / "@jupyterlab" / "notebook-extension"
    tracker.mkdir(parents=True, exist_ok=True)
    (tracker / "tracker.jupyterlab-settings").write_text(json.dumps({"windowingMode": "none"}))


class LabServer:
    """A JupyterLab server on 127.0.0.1 serving ``root`` (a context manager; logs to ``log_path``)."""

    def __init__(self, root: str | os.PathLike, *, log_path: str | os.PathLike | None = None,
                 startup_timeout: float = 180.0) -> None:
        self.root = Path(root)
        self.token = secrets.token_hex(16)
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.proc: subprocess.Popen[bytes] | None = None

    def env(self, state: Path) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _SCRUB_ENV}
        env.update(JUPYTER_CONFIG_DIR=str(state / "config"), JUPYTER_RUNTIME_DIR=str(state / "runtime"),
                   JUPYTERLAB_WORKSPACES_DIR=str(state / "workspaces"), IPYTHONDIR=str(state / "ipython"),
                   UCMAGIC_CACHE_DIR=str(state / "ucmagic-cache"),
                   PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p))
        return env

    def start(self) -> "LabServer":
        self._tmp = tempfile.TemporaryDirectory(prefix="ucmagic-lab-")
        state = Path(self._tmp.name)
        _write_lab_settings(state / "config")
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.ip=127.0.0.1",
               f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
               "--ServerApp.shutdown_no_activity_timeout=600", "--MappingKernelManager.cull_idle_timeout=0"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd.append("--allow-root")
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # closed once the server has it
        try:
            # own session: teardown can end the server and its kernels together
            self.proc = subprocess.Popen(cmd, cwd=self.root, env=self.env(state), stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        finally:
            if log is not subprocess.DEVNULL:
                log.close()
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        url = f"{self.base}/api/status?token={self.token}"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {self.proc.returncode} at startup; "
                                   f"see {self.log_path}")
            try:
                with urllib.request.urlopen(url, timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError(f"JupyterLab did not answer {self.base}/api/status within {self.startup_timeout:.0f} s; "
                           f"see {self.log_path}")

    def url(self, notebook: str) -> str:
        return f"{self.base}/lab/tree/{notebook}?token={self.token}&reset"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()  # Jupyter shuts its kernels down on SIGTERM
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=20)
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)  # kernels left behind (our own session only)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LabServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


# ------------------------------------------------------------------ reading the panel from the DOM

_WIDGET_JS = """
(i) => {
  const cells = document.querySelectorAll('.jp-Notebook .jp-Cell');
  const cell = cells[i];
  if (!cell) return null;
  const box = [...cell.querySelectorAll('.jp-OutputArea-output .widget-vbox')]
      .find(b => (b.innerText || '').includes('ucmagic'));
  if (!box) return null;
  const svg = box.querySelector('svg');
  const line = svg ? svg.querySelector('polyline') : null;
  return {
    texts: [...box.querySelectorAll('.widget-html-content')].map(e => e.innerText.trim()),
    bars: [...box.querySelectorAll('.widget-hprogress')].map(p => {
      const b = p.querySelector('.progress-bar');
      const d = p.querySelector('.widget-label');
      return {name: d ? d.innerText.trim() : '', width: b ? b.style.width : '', cls: b ? b.className : ''};
    }),
    svg_text: svg ? [...svg.querySelectorAll('text')].map(t => t.textContent) : [],
    plot_points: line ? line.getAttribute('points').trim().split(/\\s+/).length : 0,
    visible: box.getBoundingClientRect().height > 0,
  };
}
"""


_CLIP_JS = """
([i, pad]) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
  const box = cell && cell.querySelector('.jp-OutputArea-output .widget-vbox');
  if (!box) return null;
  const r = box.getBoundingClientRect();
  let right = r.left;
  for (const e of box.querySelectorAll('.widget-html-content > *, .widget-html-content, .widget-hprogress, svg')) {
    const range = document.createRange();
    range.selectNodeContents(e);
    right = Math.max(right, Math.min(e.getBoundingClientRect().right, range.getBoundingClientRect().right || 0));
  }
  const v = Math.min(pad, 3);  // the cell's own borders sit just above and below the panel
  return {x: Math.max(0, r.left - pad), y: Math.max(0, r.top - v),
          width: right - r.left + 2 * pad, height: r.height + 2 * v};
}
"""


def _num(s: str) -> int:
    return int(s.replace(",", ""))


@dataclass
class Bar:
    name: str
    fraction: float  # 0..1 from the bar's style.width
    style: str  # info | success | danger | "" (from the bar's class)


@dataclass
class WidgetState:
    """The ucmagic panel as the browser shows it."""

    texts: list[str]
    bars: list[Bar]
    svg_text: list[str]
    plot_points: int
    files_cached: int | None = None
    files_total: int | None = None
    batches: int | None = None
    total_batches: int | None = None
    p50: str | None = None
    p99: str | None = None
    status: str = ""
    raw: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dom(cls, d: dict[str, Any]) -> "WidgetState":
        bars = []
        for b in d["bars"]:
            m = re.match(r"([\d.]+)%", b["width"] or "")
            style = next((s for s in ("success", "danger", "info", "warning") if f"progress-bar-{s}" in b["cls"]), "")
            bars.append(Bar(b["name"], float(m.group(1)) / 100 if m else 0.0, style))
        s = cls(texts=d["texts"], bars=bars, svg_text=d["svg_text"], plot_points=d["plot_points"], raw=d)
        for t in d["texts"]:
            if m := re.search(r"([\d,]+) / ([\d,]+) cached", t):
                s.files_cached, s.files_total = _num(m.group(1)), _num(m.group(2))
            if m := re.search(r"([\d,]+)(?:/([\d,]+))? batches$", t):
                s.batches = _num(m.group(1))
                s.total_batches = _num(m.group(2)) if m.group(2) else None
        for t in d["svg_text"]:
            if m := re.match(r"(p50|p99) (.+)", t):
                setattr(s, m.group(1), m.group(2))
        s.status = d["texts"][-1] if d["texts"] else ""
        return s

    def bar(self, name: str) -> Bar:
        return next(b for b in self.bars if b.name == name)


# ------------------------------------------------------------------ the page

class LabPage:
    """A notebook open in JupyterLab in headless Chromium."""

    def __init__(self, page: Any, server: LabServer) -> None:
        self.page = page
        self.server = server

    def open(self, notebook: str, *, timeout: float = 180.0) -> None:
        self.page.goto(self.server.url(notebook), timeout=timeout * 1000)
        self.page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout * 1000)
        self.wait_kernel_idle(timeout)

    def wait_kernel_idle(self, timeout: float = 180.0) -> None:
        """Wait until the status bar's kernel item reads ``| Idle`` (the kernel exists and is idle)."""
        self.page.wait_for_function(
            "() => { const s = document.querySelector('#jp-main-statusbar');"
            " return !!s && s.innerText.includes('| Idle'); }", timeout=timeout * 1000)

    def cell(self, i: int) -> Any:
        return self.page.locator(".jp-Notebook .jp-Cell").nth(i)

    def prompt(self, i: int) -> str:
        return self.cell(i).locator(".jp-InputPrompt").first.inner_text().strip()

    def run_cell(self, i: int, *, start_timeout: float = 60.0) -> None:
        """Run cell ``i`` in place (Control+Enter) and wait until the kernel has started it (``[*]``)."""
        self.cell(i).locator(".jp-InputArea-editor").click()
        self.page.keyboard.press("Control+Enter")
        deadline = time.monotonic() + start_timeout
        while "*" not in self.prompt(i):
            if re.search(r"\[\d+\]", self.prompt(i)):  # already finished
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell {i} did not start within {start_timeout:.0f} s (prompt {self.prompt(i)!r})")
            time.sleep(0.05)

    def cell_done(self, i: int) -> bool:
        return bool(re.search(r"\[\d+\]", self.prompt(i)))

    def wait_cell_done(self, i: int, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.cell_done(i):
            if time.monotonic() > deadline:
                raise TimeoutError(f"cell {i} still running after {timeout:.0f} s")
            time.sleep(0.1)

    def output_text(self, i: int) -> str:
        return self.cell(i).locator(".jp-OutputArea").first.inner_text()

    def widget_state(self, i: int) -> WidgetState | None:
        """The ucmagic panel in cell ``i``'s output, or None while there is none."""
        d = self.page.evaluate(_WIDGET_JS, i)
        return WidgetState.from_dom(d) if d and d["visible"] else None

    def widget(self, i: int) -> Any:
        """Locator of the panel in cell ``i`` (for element screenshots)."""
        return self.cell(i).locator(".jp-OutputArea-output .widget-vbox").first

    def widget_clip(self, i: int, pad: int = 8) -> dict[str, float] | None:
        """The page region of cell ``i``'s panel, cut to what it draws (the box itself spans the cell)."""
        return self.page.evaluate(_CLIP_JS, [i, pad])

    def screenshot(self, path: str | os.PathLike, *, cell: int | None = None) -> Path:
        """The whole viewport, or only cell ``cell``'s panel."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        clip = self.widget_clip(cell) if cell is not None else None
        if cell is not None and clip is None:
            raise RuntimeError(f"no ucmagic panel in cell {cell} to screenshot")
        self.page.screenshot(path=str(out), clip=clip) if clip else self.page.screenshot(path=str(out))
        return out


@contextlib.contextmanager
def lab_session(root: str | os.PathLike, notebook: str, artifacts: str | os.PathLike, *,
                viewport: tuple[int, int] = (1280, 1000), scale: float = 1.0,
                timeout: float = 180.0) -> Iterator[LabPage]:
    """JupyterLab serving ``root`` with ``notebook`` open in headless Chromium and its kernel idle.

    The server log goes to ``artifacts/jupyterlab.log``; on an error a screenshot of the page goes
    to ``artifacts/failure.png``.
    """
    from playwright.sync_api import sync_playwright

    chromium = find_chromium()
    if chromium is None:
        raise RuntimeError(missing_requirement() or "no Chromium")
    artifacts = Path(artifacts)
    artifacts.mkdir(parents=True, exist_ok=True)
    with LabServer(root, log_path=artifacts / "jupyterlab.log", startup_timeout=timeout) as server, \
            sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
                                     timeout=timeout * 1000)
        try:
            ctx = browser.new_context(viewport={"width": viewport[0], "height": viewport[1]},
                                      device_scale_factor=scale)
            page = ctx.new_page()
            page.set_default_timeout(timeout * 1000)
            lab = LabPage(page, server)
            try:
                lab.open(notebook, timeout=timeout)
                yield lab
            except BaseException:
                with contextlib.suppress(Exception):
                    lab.screenshot(artifacts / "failure.png")
                raise
        finally:
            browser.close()


# ------------------------------------------------------------------ the demo cell

def training_cell(src: str, *, files: int, file_size: int = 4096, batch: int = 16, step_s: float = 0.15,
                  open_ms: float = 30, mbps: float = 100, workers: int = 0) -> str:
    """A notebook cell: make ``files`` files in ``src``, serve them through the ``slow://`` volume
    simulator, ``%ucload`` them and run one epoch whose loop body takes ``step_s`` per batch."""
    return f'''
import os, time, fsspec
from ucmagic.testing import make_files
src = {src!r}
make_files(src, {files}, {file_size})
fsspec.config.conf["slow"] = {{"open_ms": {open_ms}, "mbps": {mbps}}}   # a network volume, simulated
%load_ext ucmagic
loader = %ucload slow://{{src}} -b {batch} -w {workers}
for batch in loader:
    time.sleep({step_s})          # the training step
print("epoch done")
'''


# ------------------------------------------------------------------ the explorer

_EXPLORER_JS = """
(i) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
  const box = cell && cell.querySelector('.ucmagic-explorer');
  if (!box) return null;
  const img = box.querySelector('img');
  const text = (sel) => { const e = box.querySelector(sel); return e ? e.innerText.trim() : ''; };
  const html = [...box.querySelectorAll('.widget-html-content')].map(e => e.innerText.trim());
  return {
    img: img ? img.getAttribute('src') || '' : '',
    img_height: img ? img.getBoundingClientRect().height : 0,
    table: text('.ucmagic-slowest'),
    files: text('.ucmagic-files'),
    summary: html.find(t => t.includes('in view')) || '',
    range: [...box.querySelectorAll('.widget-readout')].map(e => e.innerText.trim()),
    visible: box.getBoundingClientRect().height > 0,
  };
}
"""


@dataclass
class ExplorerState:
    """The explorer as the browser shows it."""

    img: str  # the plot's data URL (changes when the plot is redrawn)
    img_height: float
    table: str  # the slowest-batches table's text
    files: str  # the selected batch's files
    summary: str
    range: list[str]


def explorer_state(lab: LabPage, i: int) -> ExplorerState | None:
    """The explorer in cell ``i``'s output, or None while there is none."""
    d = lab.page.evaluate(_EXPLORER_JS, i)
    if not d or not d["visible"]:
        return None
    return ExplorerState(d["img"], d["img_height"], d["table"], d["files"], d["summary"], d["range"])


def explorer_screenshot(lab: LabPage, i: int, path: str | os.PathLike, max_height: float = 900) -> Path:
    """The explorer of cell ``i`` (its top ``max_height`` CSS pixels: plot, hints and the first table rows)."""
    box = lab.cell(i).locator(".ucmagic-explorer").first
    box.evaluate("e => e.scrollIntoView({block: 'start'})")
    time.sleep(0.3)
    r = box.bounding_box()
    out = Path(path)
    lab.page.screenshot(path=str(out), clip={"x": r["x"], "y": r["y"], "width": r["width"],
                                             "height": min(r["height"], max_height)})
    return out


def move_range_start(lab: LabPage, i: int, steps: int) -> None:
    """Move the explorer's range slider's lower handle ``steps`` batches right, with the keyboard."""
    handle = lab.cell(i).locator(".ucmagic-explorer .noUi-handle-lower").first
    handle.focus()
    for _ in range(steps):
        handle.press("ArrowRight")


def explorer_cell(src: str, *, files: int, slow: int, slow_ms: float = 900, batch: int = 8, epochs: int = 1) -> str:
    """A notebook cell: ``files`` files behind ``slow://`` with one straggler (listing index ``slow``),
    ``epochs`` epochs through ``ucmagic.DataLoader`` with its default workers under ``spawn``, then the explorer."""
    return f'''
import time
from ucmagic import DataLoader, UCVolumeDataset
from ucmagic.testing import make_files
rels = make_files({src!r}, {files}, 2048)
SLOW = rels[{slow}]
ds = UCVolumeDataset("slow://" + {src!r}, prefetch=2, storage_options={{
    "open_ms": 2, "mbps": 0, "list_ms": 0, "slow_files": {{SLOW: {slow_ms}}}}})
loader = DataLoader(ds, batch_size={batch}, multiprocessing_context="spawn", log_to_mlflow=False)
for epoch in range({epochs}):
    for batch in loader:
        time.sleep(0.01)
print("workers:", loader.num_workers, "straggler:", SLOW)
loader.stats.explore()
'''


# ------------------------------------------------------------------ the explorer's interactive chart (issue 45)

_CHART_JS = """
(i) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
  const chart = cell && cell.querySelector('.ucmagic-explorer .ucmagic-chart');
  if (!chart) return null;
  const bars = [...chart.querySelectorAll('rect.ucmagic-bar')];
  let tallest = null, top = -1;
  const per = {};
  for (const b of bars) {  // a batch's bar is its stacked rects: the tallest batch by their summed height
    const s = b.getAttribute('data-step');
    per[s] = (per[s] || 0) + parseFloat(b.getAttribute('height'));
    if (per[s] > top) { top = per[s]; tallest = s; }
  }
  const tip = chart.querySelector('.ucmagic-chart-tip');
  const img = cell.querySelector('.ucmagic-explorer img');
  return {
    steps: Object.keys(per).length,
    tallest: tallest === null ? -1 : parseInt(tallest),
    by_height: Object.keys(per).sort((a, b) => per[b] - per[a]).map(s => parseInt(s)),
    tip: tip && tip.style.display !== 'none' ? tip.innerText : '',
    png_shown: !!img && img.getBoundingClientRect().height > 0,
    width: chart.querySelector('svg').getBoundingClientRect().width,
  };
}
"""


def chart_state(lab: LabPage, i: int) -> dict[str, Any] | None:
    """The explorer chart of cell ``i``: ``steps`` (batches drawn), ``tallest`` (the step of the
    longest wait), ``by_height`` (the steps, longest wait first), ``tip`` (the hover text shown),
    ``png_shown`` (the PNG fallback still visible)."""
    d = lab.page.evaluate(_CHART_JS, i)
    return d or None


def hover_chart_step(lab: LabPage, i: int, step: int) -> None:
    """Move the mouse over the bar of batch step ``step`` in cell ``i``'s chart."""
    bar = lab.cell(i).locator(f".ucmagic-chart rect.ucmagic-bar[data-step='{step}']").last
    bar.scroll_into_view_if_needed()
    bar.hover(force=True)


def drag_chart(lab: LabPage, i: int, start: float, end: float) -> None:
    """Drag across cell ``i``'s chart from ``start`` to ``end`` (fractions of its plot width): a zoom."""
    svg = lab.cell(i).locator(".ucmagic-chart svg").first
    svg.scroll_into_view_if_needed()
    r = svg.bounding_box()
    s = r["width"] / 720  # the chart draws in a 720-wide box (batch_chart.js's W), scaled to its width
    left, width, y = r["x"] + 52 * s, r["width"] - 62 * s, r["y"] + r["height"] / 2  # its plot area (L, R)
    mouse = lab.page.mouse
    mouse.move(left + start * width, y)
    mouse.down()
    mouse.move(left + (start + end) / 2 * width, y, steps=4)
    mouse.move(left + end * width, y, steps=4)
    mouse.up()


# ------------------------------------------------------------------ does it read cleanly? (issue 52)

_PANEL_LAYOUT_JS = """
(i) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
  const box = cell && cell.querySelector('.ucmagic-panel');
  if (!box) return null;
  const texts = [];
  for (const svg of box.querySelectorAll('svg')) {
    const w = svg.getBoundingClientRect();
    for (const t of svg.querySelectorAll('text')) {  // each label drawn whole, inside its picture
      const r = t.getBoundingClientRect();
      texts.push({text: t.textContent, inside: r.left >= w.left - 1 && r.right <= w.right + 1,
                  stages: svg.classList.contains('ucmagic-stages')});
    }
  }
  const line = box.querySelector('polyline');
  const first = line ? parseFloat(line.getAttribute('points').trim().split(/\\s+/)[0].split(',')[0]) : null;
  const button = [...box.querySelectorAll('button')].find(b => (b.title || '').includes('explorer'));
  const br = button ? button.getBoundingClientRect() : null;
  return {
    texts,
    text: box.innerText,
    first_x: first,
    button: button ? {text: button.innerText.trim(), width: br.width, shown: br.width > 0,
                      clipped: button.scrollWidth > button.clientWidth + 1,
                      inside: br.right <= box.getBoundingClientRect().right + 1} : null,
  };
}
"""


def panel_layout(lab: LabPage, i: int) -> dict[str, Any] | None:
    """How the panel of cell ``i`` is laid out: every SVG label (``text``, drawn ``inside`` its picture), the
    panel's text, the sparkline's first point (``first_x``, SVG units) and the explore button (its text,
    whether its label is clipped, whether it sits inside the panel)."""
    return lab.page.evaluate(_PANEL_LAYOUT_JS, i) or None


_EXPLORER_LAYOUT_JS = """
(i) => {
  const cell = document.querySelectorAll('.jp-Notebook .jp-Cell')[i];
  const box = cell && cell.querySelector('.ucmagic-explorer');
  if (!box) return null;
  const right = box.getBoundingClientRect().right + 1;
  const over = [...box.querySelectorAll('svg, table, .widget-hbox, .widget-dropdown, .widget-html-content')]
      .filter(e => e.getBoundingClientRect().width > 0 && e.getBoundingClientRect().right > right)
      .map(e => e.className.baseVal !== undefined ? 'svg' : (e.className || e.tagName));
  const files = [...box.querySelectorAll('.ucmagic-slowest tr td:last-child')];
  return {
    overflowing: over,
    files_wrap: files.length > 0 && files.every(td => getComputedStyle(td).whiteSpace === 'normal'),
    files_inside: files.every(td => td.getBoundingClientRect().right <= right),
    width: box.getBoundingClientRect().width,
  };
}
"""


def explorer_layout(lab: LabPage, i: int) -> dict[str, Any] | None:
    """How the explorer of cell ``i`` is laid out: the parts reaching past its right edge (``overflowing``),
    whether the slowest-files cells wrap and stay inside it, its width."""
    return lab.page.evaluate(_EXPLORER_LAYOUT_JS, i) or None
