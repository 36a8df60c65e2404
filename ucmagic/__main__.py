"""Command line: ``python -m ucmagic demo|stage|export|ckpt|bench ...``."""
from __future__ import annotations

import argparse
import sys


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="generate files on a simulated slow volume and compare ucmagic with a plain torch DataLoader",
                       description="Generate small files, serve them through the slow-volume simulator, "
                                   "run two epochs with ucmagic and with torch.utils.data.DataLoader, print times.")
    p.add_argument("--files", type=int, default=2000, help="number of files (default 2000)")
    p.add_argument("--size", default="150KiB", help="size of each file (default 150KiB)")
    p.add_argument("--open-ms", type=float, default=20.0, help="simulated latency per open (default 20)")
    p.add_argument("--mbps", type=float, default=200.0, help="simulated bandwidth per stream in MB/s (default 200)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workdir", default=None, help="where to put the data and cache (default: a temp dir, removed after)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run the plain torch DataLoader")

    def run(a: argparse.Namespace) -> int:
        from .demo import run_demo
        from .units import parse_size

        run_demo(files=a.files, size=parse_size(a.size), open_ms=a.open_ms, mbps=a.mbps,
                 batch_size=a.batch_size, workdir=a.workdir, baseline=not a.skip_baseline)
        return 0

    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ucmagic", description="ucmagic: training data from slow volumes into PyTorch, fast.")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a = ap.parse_args(argv)
    if not getattr(a, "func", None):
        ap.print_help()
        return 2
    try:
        return int(a.func(a) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # one clear line for the terminal; tracebacks with UCMAGIC_DEBUG=1
        import os

        if os.environ.get("UCMAGIC_DEBUG"):
            raise
        print(f"ucmagic: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
