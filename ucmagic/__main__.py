"""Command line: ``python -m ucmagic demo|stage|pack|export|ckpt|cache|bench|advise ...``."""
from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable


def at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``, else a usage error (exit code 2) saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {value}")
        return value

    return parse


def _show_help(p: argparse.ArgumentParser) -> Callable[[argparse.Namespace], int]:
    """A command group's action when no subcommand is given: print its help, exit code 2."""

    def run(_: argparse.Namespace) -> int:
        p.print_help()
        return 2

    return run


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("demo",
                       help="generate files on a simulated slow volume and compare ucmagic with a plain torch "
                            "DataLoader",
                       description="Generate small files, serve them through the slow-volume simulator, "
                                   "run two epochs with ucmagic and with torch.utils.data.DataLoader, print times.")
    p.add_argument("--files", type=at_least(1), default=2000, help="number of files (default 2000)")
    p.add_argument("--size", default="150KiB", help="size of each file (default 150KiB)")
    p.add_argument("--open-ms", type=float, default=20.0, help="simulated latency per open (default 20)")
    p.add_argument("--mbps", type=float, default=200.0, help="simulated bandwidth per stream in MB/s (default 200)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--workdir", default=None,
                   help="where to put the data and cache (default: a temp dir, removed after)")
    p.add_argument("--skip-baseline", action="store_true", help="do not run the plain torch DataLoader")

    def run(a: argparse.Namespace) -> int:
        from .testing.demo import run_demo
        from .units import parse_size

        size = parse_size(a.size)
        if size is None:  # unreachable: --size always has a value (parse_size maps only None to None)
            raise SystemExit("ucmagic demo: --size needs a size such as 150KiB")
        run_demo(files=a.files, size=size, open_ms=a.open_ms, mbps=a.mbps,
                 batch_size=a.batch_size, workdir=a.workdir, baseline=not a.skip_baseline)
        return 0

    p.set_defaults(func=run)


def _add_stage(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stage", help="copy a tree of files from a slow volume to local disk, in parallel",
                       description="Copy the files under SRC to DEST in parallel, keeping relative paths. "
                                   "Files already staged and unchanged (same size and mtime) are skipped; each file "
                                   "lands atomically; failures are listed and make the exit code 1.")
    p.add_argument("src", help="directory, /Volumes/<catalog>/<schema>/<volume>/... path or fsspec URL")
    p.add_argument("dest", help="local destination directory (created if needed)")
    p.add_argument("-p", "--pattern", default=None, help="glob over relative paths, e.g. '**/*.jpg' (default: all)")
    p.add_argument("-j", "--concurrency", "--jobs", dest="concurrency", type=at_least(1), default=256,
                   help="copies in flight (default 256; --jobs is an alias)")
    p.add_argument("--processes", type=at_least(1), default=None, help="worker processes (default: up to 4)")
    p.add_argument("--retries", type=at_least(0), default=3, help="retries of a failing copy (default 3)")
    p.add_argument("--verify", choices=["size", "none"], default="size", help="check each copy's size (default size)")
    p.add_argument("--no-progress", action="store_true", help="do not show progress")

    def run(a: argparse.Namespace) -> int:
        from .staging import stage

        res = stage(a.src, a.dest, pattern=a.pattern, concurrency=a.concurrency, processes=a.processes,
                    retries=a.retries, verify=None if a.verify == "none" else a.verify,
                    progress=False if a.no_progress else "text")
        text = str(res)
        if not a.no_progress and sys.stderr.isatty():  # the progress line already ends with the summary
            text = text.split("\n", 1)[1] if "\n" in text else ""
        if text:
            print(text)
        return 0 if res.ok else 1

    p.set_defaults(func=run)


def _add_pack(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("pack", help="pack a tree of small files or a table into tar shards of a target size",
                       description="Pack the files under SRC (samples grouped by key: the same stem with different "
                                   "extensions) or a table (Parquet/CSV path, Delta directory) into uncompressed "
                                   "WebDataset tar shards with an index.json, in DEST. Each shard appears whole or "
                                   "not at all; running it again after a kill keeps the complete shards.")
    p.add_argument("src", help="directory, /Volumes/... path or fsspec URL of files; or a Parquet/CSV path or Delta "
                               "directory")
    p.add_argument("dest", help="local or mounted destination directory (created; not inside SRC)")
    p.add_argument("--shard-size", default="1GB", help="target size of each shard (default 1GB)")
    p.add_argument("--label-from-folder", action="store_true",
                   help="files: add a cls member with the index of each sample's top folder (class names in "
                        "index.json)")
    p.add_argument("-p", "--pattern", default=None, help="files: glob over relative paths, e.g. '**/*.jpg'")
    p.add_argument("-j", "--workers", type=at_least(1), default=None, help="files: reads in flight (default 256)")
    p.add_argument("--columns", default=None,
                   help="table: comma-separated columns, each optionally COLUMN=EXT (e.g. image=jpg,label=cls)")
    p.add_argument("--key-column", default=None, help="table: a column of unique sample keys (default: row number)")
    p.add_argument("--kind", choices=["files", "table"], default=None, help="treat SRC as files or as a table")
    from ._util import DEFAULT_RETRIES

    p.add_argument("--retries", type=at_least(0), default=DEFAULT_RETRIES,
                   help=f"retries of a failing read, with backoff (default {DEFAULT_RETRIES}, as the datasets)")
    p.add_argument("--no-progress", action="store_true", help="do not show progress")

    def run(a: argparse.Namespace) -> int:
        from .shards.pack import pack, parse_columns

        res = pack(a.src, a.dest, a.shard_size, label_from_folder=a.label_from_folder, pattern=a.pattern,
                   workers=a.workers, columns=parse_columns(a.columns), key_column=a.key_column, kind=a.kind,
                   retries=a.retries, progress=False if a.no_progress else "text")
        if a.no_progress or not sys.stderr.isatty():  # on a terminal the progress line ends with the summary
            print(res)
        return 0

    p.set_defaults(func=run)


def _add_export(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("export",
                       help="export a table, Delta directory, query or files to Parquet files of a target size",
                       description="Write SOURCE (a table name, a Delta directory, Parquet/CSV paths or globs, "
                                   "or a SQL query) as Parquet files of about --file-size into DEST.")
    p.add_argument("source", help="table name, Delta directory, Parquet/CSV path or glob, or SQL query")
    p.add_argument("dest", help="destination directory, /Volumes/... path or fsspec URL")
    p.add_argument("--file-size", default="1GB", help="target size of each file (default 1GB)")
    p.add_argument("--mode", default="overwrite", choices=["overwrite", "append", "error"],
                   help="overwrite (default: replace atomically), append (new files beside the old) or error")
    p.add_argument("--partition-by", default=None, help="comma-separated partition columns")
    p.add_argument("--where", default=None, metavar="PREDICATE",
                   help="only the rows a SQL predicate keeps (DuckDB's dialect), e.g. \"label = 3\"")

    def run(a: argparse.Namespace) -> int:
        from .tables import export_parquet

        cols = [c.strip() for c in a.partition_by.split(",") if c.strip()] if a.partition_by else None
        print(f"exporting {a.source} -> {a.dest} ...", file=sys.stderr, flush=True)
        res = export_parquet(a.source, a.dest, target_file_size=a.file_size, mode=a.mode, partition_by=cols,
                             filter=a.where)
        print(res)
        return 0

    p.set_defaults(func=run)


def _add_ckpt(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("ckpt", help="inspect checkpoints, remove killed saves",
                       description="Inspect checkpoints written by ucmagic; remove what killed saves left.")
    csub = p.add_subparsers(dest="ckpt_command", metavar="ACTION")
    lp = csub.add_parser("list", help="list complete checkpoints under ROOT with their time and size",
                         description="List the complete checkpoints under ROOT (step, commit time, size): "
                                     "ucmagic's committed step_<N>/, DCP directories other writers made and "
                                     "torch.save files (KIND column); unfinished saves are not listed.")
    lp.add_argument("root", help="checkpoint root: a local or mounted directory, a /Volumes/... path "
                                 "or an fsspec URL (s3://bucket/run/ckpts)")

    def run_list(a: argparse.Namespace) -> int:
        from .checkpoints.api import list_checkpoints
        from .checkpoints.format import format_checkpoints

        items = list(list_checkpoints(a.root))
        if not items:  # like list_checkpoints() returning []; a missing root raised above
            print(f"no committed checkpoints under {a.root}")
            return 0
        print(format_checkpoints(items))
        return 0

    lp.set_defaults(func=run_list)
    cl = csub.add_parser("clean", help="remove the directories of killed checkpoint saves under ROOT",
                         description="Remove the step directories under ROOT whose save was killed: the process "
                                     "named in its save-in-progress record (this host, pid and start time) is "
                                     "gone. Committed checkpoints and running saves are never touched. Records "
                                     "from other hosts or an older ucmagic count once a day old, or with --force.")
    cl.add_argument("root", help="checkpoint root: a local or mounted directory, a /Volumes/... path "
                                 "or an fsspec URL (s3://bucket/run/ckpts)")
    cl.add_argument("--force", action="store_true",
                    help="also remove saves recorded by other hosts or an older ucmagic (make sure none is running)")

    def run_clean(a: argparse.Namespace) -> int:
        from .checkpoints.commit import clean_checkpoints

        gone = clean_checkpoints(a.root, force=a.force)
        print("\n".join(f"removed {d}" for d in gone) if gone else f"no killed saves under {a.root}")
        return 0

    cl.set_defaults(func=run_clean)
    p.set_defaults(func=_show_help(p))


def _add_cache(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cache", help="inspect, prune or clear the local file cache",
                       description="Work on the whole cache directory ($UCMAGIC_CACHE_DIR, else ~/.cache/ucmagic).")
    csub = p.add_subparsers(dest="cache_command", metavar="ACTION")
    for name, text in (("info",
                        "show what is in the cache: entries, protected entries, protection records, temp files"),
                       ("prune", "drop protection records of exited processes and abandoned temp files "
                                 "(with --limit: also evict least-recently-used entries down to that size)"),
                       ("clear", "remove every entry not protected by a running loop, plus leftovers")):
        cp = csub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        cp.add_argument("--cache-dir", default=None,
                        help="cache directory (default: $UCMAGIC_CACHE_DIR or ~/.cache/ucmagic)")
        if name == "prune":
            cp.add_argument("--limit", default=None, help="evict down to this size, e.g. 20GB")

        def run(a: argparse.Namespace, name: str = name) -> int:
            from .files.cache_report import cache_command

            print(cache_command(name, a.cache_dir, limit=getattr(a, "limit", None)))
            return 0

        cp.set_defaults(func=run)
    p.set_defaults(func=_show_help(p))


def bench_dir() -> str | None:
    """The bench/ folder of a source checkout (benchmarks are not installed with the package)."""
    import os

    d = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    return d if os.path.isdir(d) else None


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="run a benchmark script from bench/ by name (e.g. 'bench stage')",
                       description="Run bench/NAME.py with the remaining arguments (put them after '--'), "
                                   "e.g. python -m ucmagic bench stage -- --files 500. Without NAME, list them.")
    p.add_argument("name", nargs="?", help="benchmark name (file name in bench/ without .py)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")

    def run(a: argparse.Namespace) -> int:
        import os
        import subprocess

        d = bench_dir()
        if d is None:
            print("ucmagic: error: no bench/ folder next to the package: benchmarks run from a source checkout",
                  file=sys.stderr)
            return 1
        names = sorted(f[:-3] for f in os.listdir(d) if f.endswith(".py") and not f.startswith("_"))
        if not a.name:
            print("benchmarks: " + ", ".join(names))
            return 0
        if a.name not in names:
            print(f"ucmagic: error: no benchmark {a.name!r}; available: {', '.join(names)}", file=sys.stderr)
            return 2
        args = a.args[1:] if a.args[:1] == ["--"] else a.args
        return subprocess.call([sys.executable, os.path.join(d, a.name + ".py"), *args])  # noqa: S603 - bench/ script

    p.set_defaults(func=run)


def _add_load(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("load", help="show what ucmagic.load / %%ucload would build from SOURCE, without loading it",
                       description="Classify SOURCE like ucmagic.load and %%ucload do (a directory of files, a table, "
                                   "or a table streamed with --stream) and print its kind, file count, rows and "
                                   "bytes. Lists files and reads Parquet footers only; no data is read.")
    p.add_argument("source", help="directory, /Volumes/... path or URL of files; or a table name, SQL query, "
                                  "Delta directory or Parquet/CSV path")
    p.add_argument("-p", "--pattern", default=None, help="files: only those matching GLOB, e.g. '**/*.jpg'")
    p.add_argument("--files", action="store_true", help="treat SOURCE as a directory of files even if it holds Parquet")
    p.add_argument("--stream", action="store_true", help="tables: as a streaming loader (ParquetDataset)")
    p.add_argument("--where", default=None, metavar="PREDICATE",
                   help="tables: count the rows a SQL predicate keeps (DuckDB's dialect; reads its columns)")

    def run(a: argparse.Namespace) -> int:
        from .api import describe_load

        print(describe_load(a.source, files=a.files, pattern=a.pattern, stream=a.stream, where=a.where).describe())
        return 0

    p.set_defaults(func=run)


def _add_advise(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("advise", help="what to change so the loop stops waiting, from saved loader stats",
                       description="Read stats saved by loader.stats.save() (or several ranks', merged) and print "
                                   "loader.stats.advise(): a ranked list of changes, each predicting the run's "
                                   "seconds with it against the measured run, and the measured numbers it used.")
    p.add_argument("stats", nargs="+", help="STATS.json file(s) written by loader.stats.save()")
    p.add_argument("--json", action="store_true", help="print the advice as a JSON list")
    p.add_argument("--epochs", type=at_least(1), default=None,
                   help="predict a run of this many epochs (default: the epochs recorded)")

    def run(a: argparse.Namespace) -> int:
        import dataclasses
        import json

        from .loading.advise import header
        from .loading.loader_stats import LoaderStats

        stats = LoaderStats.load(a.stats[0]) if len(a.stats) == 1 else LoaderStats.merge(a.stats)
        advice = stats.advise(epochs=a.epochs)
        if a.json:
            print(json.dumps([dataclasses.asdict(x) for x in advice], indent=1))
        elif not advice:
            print("no batches recorded")
        else:
            print(header(advice))
            print("\n".join(f"{i}. {x}" for i, x in enumerate(advice, 1)))
        return 0

    p.set_defaults(func=run)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m ucmagic",
                                 description="ucmagic: training data from slow volumes into PyTorch, fast.")
    from . import __version__

    ap.add_argument("-V", "--version", action="version", version=f"ucmagic {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")
    _add_demo(sub)
    _add_load(sub)
    _add_stage(sub)
    _add_pack(sub)
    _add_export(sub)
    _add_ckpt(sub)
    _add_cache(sub)
    _add_bench(sub)
    _add_advise(sub)
    _own_usage(ap)
    return ap


def _own_usage(parser: argparse.ArgumentParser) -> None:
    """Let each subcommand report bad arguments with its own usage (see :func:`main`)."""
    for action in parser._actions:  # noqa: SLF001 - argparse has no public way to list subparsers
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001 - same
            for sp in action.choices.values():
                sp.set_defaults(_parser=sp)
                _own_usage(sp)


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    a, extra = ap.parse_known_args(argv)
    if extra and getattr(a, "command", None) != "bench":
        getattr(a, "_parser", ap).error(f"unrecognized arguments: {' '.join(extra)}")
    if not getattr(a, "func", None):
        ap.print_help()
        return 2
    try:
        rc = int(a.func(a) or 0)
        sys.stdout.flush()  # here, not at exit: a closed pipe is handled below
        return rc
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`... | head`): stop quietly, as Unix tools do
        import os

        with contextlib.suppress(OSError):  # no second error when Python flushes stdout at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except Exception as e:  # one clear line for the terminal; tracebacks with UCMAGIC_DEBUG=1
        import os

        if os.environ.get("UCMAGIC_DEBUG"):
            raise
        from ._util import error_line

        print(f"ucmagic: error: {error_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
