"""A small progress display: a text line in a terminal or log, or an ipywidgets bar in a notebook.

Used by :func:`ucmagic.stage`, the command line and the notebook magics::

    with Progress(total=2000, total_bytes=300e6, desc="stage", mode=True) as p:
        for f in files:
            ...
            p.update(1, nbytes)

``mode``: ``True`` (widget in a notebook frontend when ipywidgets is installed, else text),
``"text"``, ``"widget"`` (falls back to text when no widget can be shown) or ``False``/``None`` (silent).
Text output rewrites one line with ``\\r`` on a TTY and prints a line every ``interval`` seconds
otherwise (CI logs, ``%sh``, files). Updates are cheap and throttled, so calling :meth:`update`
once per file is fine.

The widget itself is the notebook layer's (``ucmagic.notebook.panel.ProgressBar``, reached through
the ``"progress_bar"`` presenter of :mod:`ucmagic.presenters`): this module imports neither
IPython nor ipywidgets.
"""
from __future__ import annotations

import importlib.util
import os
import sys
import threading
import time
from typing import Any, TextIO

from .presenters import presenter
from .units import format_size

DISPLAY_MODES = ("auto", "widget", "text", "off")  # the string values of progress= / $UCMAGIC_PROGRESS
MODES = (True, False, None, *DISPLAY_MODES)
MIN_RATE_S = 0.5  # seconds before a rate or an ETA is shown


# ---------------------------------------------------------------- pure helpers

def format_duration(seconds: float) -> str:
    """``42.0 -> '42.0 s'``, ``125 -> '2m05s'``, ``3725 -> '1h02m'``."""
    s = max(0.0, float(seconds))
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m{int(s % 60):02d}s"
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m"


def format_progress(done: int, total: int | None, nbytes: int, elapsed: float, *, desc: str = "",
                    unit: str = "files", total_bytes: int | None = None, failed: int = 0) -> str:
    """One line: ``desc: 1,200/2,000 files (60%)  180.0 MB  90.0 MB/s  2.0 s  eta 1.3 s``.

    Rate and ETA appear once they mean something (2 items and half a second in): the first line
    shows no "0 B/s" and no ETA extrapolated from start-up time."""
    settled = done >= 2 and elapsed >= MIN_RATE_S
    parts = [f"{desc}: " if desc else ""]
    if total:
        pct = 100.0 * done / total
        parts.append(f"{done:,}/{total:,} {unit} ({pct:.0f}%)")
    else:
        parts.append(f"{done:,} {unit}")
    line = "".join(parts)
    if nbytes or total_bytes:
        line += f"  {format_size(nbytes)}"
        if settled:
            line += f"  {format_size(nbytes / elapsed)}/s"
    line += f"  {format_duration(elapsed)}"
    if failed:
        line += f"  {failed:,} failed"
    if total and 0 < done < total and settled:
        line += f"  eta {format_duration(elapsed * (total - done) / done)}"
    return line


def in_notebook() -> bool:
    """True inside a notebook frontend or Jupyter-protocol kernel (JupyterLab, VS Code, Databricks)."""
    ip_mod = sys.modules.get("IPython")
    if ip_mod is None:
        return False
    try:
        ip = ip_mod.get_ipython()
    except Exception:  # noqa: BLE001
        return False
    if ip is None:
        return False
    return (type(ip).__name__ in ("ZMQInteractiveShell", "DatabricksShell") or "zmq" in type(ip).__module__
            or getattr(ip, "kernel", None) is not None)


def widgets_available() -> bool:
    """True when ipywidgets and IPython are installed (looked up, not imported)."""
    try:
        return all(importlib.util.find_spec(m) is not None for m in ("ipywidgets", "IPython"))
    except (ImportError, ValueError):
        return False


def display_mode(mode: str | None = "auto") -> str:
    """``"widget"``, ``"text"`` or ``"off"``: an explicit mode wins, then ``$UCMAGIC_PROGRESS``, then
    auto (the widget in a notebook with ipywidgets, else text). ``"auto"`` defers to the next; a
    widget without ipywidgets falls back to text. The one home of display-mode resolution."""
    for m in (mode, os.environ.get("UCMAGIC_PROGRESS")):
        m = (m or "").strip().lower()
        if m in ("", "auto"):
            continue
        if m not in DISPLAY_MODES:
            raise ValueError(f"progress must be True, False, 'text', 'widget', 'off' or 'auto', got {m!r} "
                             "(also in $UCMAGIC_PROGRESS and %config UcMagics.progress)")
        if m == "widget" and not widgets_available():
            return "text"
        return m
    return "widget" if in_notebook() and widgets_available() else "text"


def resolve_mode(mode: object) -> str | None:
    """Map the user's ``progress=`` value to ``"text"``, ``"widget"`` or ``None`` (silent).

    ``False``/``None``/``"off"`` -> silent; ``True``/``"auto"`` and strings as :func:`display_mode`.
    """
    if mode is None or mode is False:
        return None
    if mode is True:
        mode = "auto"
    if not isinstance(mode, str):
        raise ValueError(f"progress must be True, False, 'text', 'widget', 'off' or 'auto', got {mode!r}")
    m = display_mode(mode)
    return None if m == "off" else m


# ---------------------------------------------------------------- the display

class Progress:
    """A throttled progress display (see the module docstring). Thread-safe."""

    def __init__(self, total: int | None = None, *, total_bytes: int | None = None, desc: str = "",
                 unit: str = "files", mode: bool | str | None = True, stream: TextIO | None = None,
                 interval: float | None = None) -> None:
        self.total = total
        self.total_bytes = total_bytes
        self.desc = desc
        self.unit = unit
        self.mode = resolve_mode(mode)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        # a TTY line is cheap to redraw; a log line every 10 s is enough; a widget a few times a second
        self.interval = (interval if interval is not None
                         else (0.1 if self.tty else 0.25 if self.mode == "widget" else 10.0))
        self.done = 0
        self.nbytes = 0
        self.failed = 0
        self.start = time.monotonic()
        self._last = float("-inf")  # the first update draws at once
        self._width = 0
        self._logged: tuple[object, ...] = ()  # the counts (and text) of the last line written to a log
        self._closed = False
        self._mu = threading.Lock()
        self._bar: Any = None  # the notebook layer's ProgressBar
        if self.mode == "widget":
            self._make_widget()

    def _make_widget(self) -> None:
        try:
            self._bar = presenter("progress_bar")(self.desc, self.total)
        except Exception:  # noqa: BLE001 - no frontend after all: degrade to text
            self.mode, self._bar = "text", None

    # ------------------------------------------------------------ updates

    def line(self) -> str:
        return format_progress(self.done, self.total, self.nbytes, time.monotonic() - self.start, desc=self.desc,
                               unit=self.unit, total_bytes=self.total_bytes, failed=self.failed)

    def update(self, n: int = 1, nbytes: int = 0, failed: int = 0) -> None:
        """Add ``n`` finished items (``nbytes`` bytes, ``failed`` of them failed) and redraw if due."""
        with self._mu:
            self.done += n
            self.nbytes += nbytes
            self.failed += failed
            self._maybe_draw()

    def set(self, done: int, nbytes: int = 0, failed: int = 0) -> None:
        """Set absolute counts (when another process does the counting) and redraw if due."""
        with self._mu:
            self.done, self.nbytes, self.failed = done, nbytes, failed
            self._maybe_draw()

    def _maybe_draw(self) -> None:
        if self.mode is None or self._closed:
            return
        now = time.monotonic()
        if now - self._last < self.interval:
            return
        self._last = now
        self._draw(final=False)

    def _draw(self, final: bool, text: str | None = None) -> None:
        line = text if text is not None else self.line()
        if self.mode == "widget" and self._bar is not None:
            self._bar.draw(self.done, self.total, line.split(": ", 1)[-1] if self.desc else line, final=final,
                           failed=self.failed)
            return
        try:
            if self.tty:
                pad = max(0, self._width - len(line))
                self.stream.write("\r" + line + " " * pad + ("\n" if final else ""))
                self._width = len(line)
            else:
                state = (self.done, self.nbytes, self.failed, text)
                if final and state == self._logged:
                    return  # a log gets a line per update: the final counts were just written
                self.stream.write(line + "\n")
                self._logged = state
            self.stream.flush()
        except (OSError, ValueError):  # closed stream: progress is best effort
            pass

    def close(self, text: str | None = None) -> None:
        """Draw the final state (or ``text``) once; further updates are ignored."""
        with self._mu:
            if self._closed:
                return
            self._closed = True
            if self.mode is not None:
                self._draw(final=True, text=text)

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
