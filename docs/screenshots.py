"""Regenerate the README's screenshots: the live ``%ucload`` panel (docs/img/widget.png) and the
fetch-latency explorer (docs/img/explorer.png).

Same machinery as tests/test_browser.py (tests/browser_harness.py): a throwaway JupyterLab server,
the system Chromium driven by Playwright, a generated notebook whose cell loads 3,000 files from
the ``slow://`` volume simulator with ``%ucload`` and trains for about 10 seconds. The panel is
captured mid-epoch, while it is live. The explorer comes from a second notebook: one epoch of
192 files with one injected slow file, default workers under ``spawn``, then ``loader.stats.explore()``.

    python docs/screenshots.py                      # writes docs/img/widget.png and docs/img/explorer.png
    python docs/screenshots.py --only explorer      # just one of them
    python docs/screenshots.py --out /tmp/shots     # elsewhere; also keeps the full page and the log

Needs: pip install jupyterlab playwright ipywidgets ipykernel; apt-get install -y chromium.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import browser_harness as bh  # noqa: E402

# A cold epoch on an object-store-like volume (400 ms per open) with a fast training step: the loop
# sometimes waits for data, so the plot shows real waits; 125 batches of 24 files, about 10 s.
FILES, FILE_SIZE, BATCH, STEP_S, OPEN_MS, MBPS = 3000, 8 * 1024, 24, 0.05, 400, 50


def capture(out_dir: Path, *, at: float = 0.6, scale: float = 2.0) -> Path:
    """Run the demo cell and save the panel once ``at`` of the epoch is done; returns the PNG path."""
    with tempfile.TemporaryDirectory(prefix="ucmagic-") as tmp:
        root = Path(tmp)
        cell = bh.training_cell(str(root / "images"), files=FILES, file_size=FILE_SIZE, batch=BATCH,
                                step_s=STEP_S, open_ms=OPEN_MS, mbps=MBPS)
        bh.write_notebook(root / "demo.ipynb", [cell])
        with bh.lab_session(root, "demo.ipynb", out_dir, viewport=(1100, 900), scale=scale) as lab:
            lab.run_cell(0)
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not lab.cell_done(0):
                s = lab.widget_state(0)
                if s and s.batches and s.total_batches and s.batches >= at * s.total_batches and s.plot_points > 2:
                    png = lab.screenshot(out_dir / "widget.png", cell=0)
                    lab.screenshot(out_dir / "notebook.png")
                    lab.wait_cell_done(0)
                    return png
                time.sleep(0.1)
            raise RuntimeError(f"the panel never reached {at:.0%} of the epoch while the cell ran; "
                               f"see {out_dir / 'jupyterlab.log'}")


def capture_explorer(out_dir: Path, *, scale: float = 2.0) -> Path:
    """Run the straggler cell and save the explorer it shows; returns the PNG path."""
    with tempfile.TemporaryDirectory(prefix="ucmagic-") as tmp:
        root = Path(tmp)
        cell = bh.explorer_cell(str(root / "images"), files=192, slow=150, epochs=2)
        bh.write_notebook(root / "explore.ipynb", [cell])
        with bh.lab_session(root, "explore.ipynb", out_dir, viewport=(1100, 1400), scale=scale) as lab:
            lab.run_cell(0)
            lab.wait_cell_done(0, timeout=300)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                s = bh.explorer_state(lab, 0)
                if s and s.img and s.table:
                    break
                time.sleep(0.2)
            bh.move_range_start(lab, 0, 2)  # past the workers' start-up: the straggler stands out
            time.sleep(6)  # the plot is redrawn after the summary
            out = out_dir / "explorer.png"
            lab.page.set_viewport_size({"width": 1100, "height": 1100})
            return bh.explorer_screenshot(lab, 0, out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="output directory (default: docs/img, keeping only widget.png)")
    ap.add_argument("--at", type=float, default=0.6, help="fraction of the epoch at which to capture (0.6)")
    ap.add_argument("--scale", type=float, default=2.0, help="device pixel ratio of the capture (2)")
    ap.add_argument("--only", choices=["widget", "explorer"], default=None, help="take one screenshot only")
    a = ap.parse_args(argv)
    reason = bh.missing_requirement()
    if reason:
        print(f"cannot take screenshots: {reason}", file=sys.stderr)
        return 2
    jobs = {"widget": lambda d: capture(d, at=a.at, scale=a.scale),
            "explorer": lambda d: capture_explorer(d, scale=a.scale)}
    for name, job in jobs.items():
        if a.only not in (None, name):
            continue
        if a.out is not None:
            a.out.mkdir(parents=True, exist_ok=True)
            png = job(a.out)
        else:
            dest = HERE / "img" / f"{name}.png"
            dest.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(prefix="ucmagic-shots-") as work:
                shot = job(Path(work))
                dest.write_bytes(shot.read_bytes())
            png = dest
        print(f"wrote {png} ({png.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
