"""IPython magics: ``%ucload``, ``%ucstage``, ``%ucckpt`` (``%load_ext ucmagic``).

Each magic parses its line, looks names up in the user namespace, validates everything, then
makes one call to the public API. User mistakes become one ``UsageError`` line saying what to
do; with ``UCMAGIC_RAISE=1`` they are raised as real exceptions instead (so an executed notebook
fails where a magic fails). Settings: ``%config UcMagics.cache_dir=...`` (also ``workers``,
``progress``, ``mlflow``).
"""
from __future__ import annotations

import functools
import keyword
import os
import shlex
from typing import Any, Callable, NoReturn

from ..errors import import_extra

import_extra("IPython", feature="the notebook magics")  # a clear pip line instead of a bare ModuleNotFoundError
from IPython.core.error import UsageError  # noqa: E402
from IPython.core.magic import Magics, line_magic, magics_class, needs_local_scope, no_var_expand  # noqa: E402
from IPython.core.magic_arguments import argument, kwds, magic_arguments  # noqa: E402
from IPython.utils.text import DollarFormatter  # noqa: E402
from traitlets import Bool, Enum, Int, Unicode  # noqa: E402

from .._util import error_line, is_url  # noqa: E402 - after the import_extra check above
from ..errors import LoadUsageError, MagicUsageError, UCMagicError  # noqa: E402 - same




class _HelpShown(Exception):  # noqa: N818 - a signal, not an error: the magic printed its help
    """Raised by :meth:`UcMagics._parse` after printing the help; the magic returns None."""


def wants_help(args: list[str]) -> bool:
    """True when ``-h`` or ``--help`` is among the arguments (before any ``--``)."""
    for arg in args:
        if arg == "--":
            return False
        if arg in ("-h", "--help"):
            return True
    return False


def _raise_mode() -> bool:
    return os.environ.get("UCMAGIC_RAISE", "").strip().lower() not in ("", "0", "false", "no")


def _fail(magic: str, message: str) -> NoReturn:
    """Report a user mistake: ``UsageError`` for the notebook, MagicUsageError with UCMAGIC_RAISE=1."""
    text = f"%{magic}: {message}"
    if _raise_mode():
        raise MagicUsageError(text)
    raise UsageError(text)


def _friendly(magic: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Turn engine errors (UCMagicError, OSError, ValueError, KeyError, torch's CheckpointException)
    into one UsageError line; ``-h``/``--help`` (see :meth:`UcMagics._parse`) prints the help and returns None."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: Any, line: str = "", local_ns: dict[str, Any] | None = None) -> Any:
            try:
                return fn(self, line, local_ns)
            except _HelpShown:
                return None
            except (UsageError, MagicUsageError):
                raise
            except BaseException as exc:
                # torch's CheckpointException is a BaseException whose text is a traceback per rank
                known = isinstance(exc, (UCMagicError, OSError, ValueError, KeyError)) or (
                    type(exc).__name__ == "CheckpointException")
                if not known or _raise_mode():
                    raise
                raise UsageError(f"%{magic}: {error_line(exc)}") from None

        return wrapper

    return deco


# ------------------------------------------------------------------ pure helpers

def expand(line: str, ns: dict[str, Any]) -> str:
    """Expand ``{expr}`` and ``$name`` in ``line`` like IPython does, but fail loudly.

    ``$$`` and ``{{ }}`` give a literal ``$``/braces; ``$`` inside single quotes stays literal.
    A value with spaces expanded outside quotes is quoted so it stays one argument. Raises
    ``LookupError`` naming the first expression that cannot be resolved.
    """
    if "$" not in line and "{" not in line and "}" not in line:
        return line
    fmt = DollarFormatter()
    out: list[str] = []
    quote = ""
    try:
        for literal, field, spec, conversion in fmt.parse(line):
            out.append(literal)
            for ch in literal:
                if quote and ch == quote:
                    quote = ""
                elif not quote and ch in "'\"":
                    quote = ch
            if field is None:
                continue
            expr = f"{field}:{spec}" if spec else field
            value = str(fmt.convert_field(eval(expr, ns), conversion))  # noqa: S307 (IPython's own semantics)
            if not quote and (value == "" or any(c.isspace() or c in "'\"\\" for c in value)):
                value = shlex.quote(value)
            out.append(value)
    except NameError as exc:
        name = getattr(exc, "name", None) or str(exc)
        raise LookupError(f"{name!s} is not defined: define the variable first, or write $$ for a literal $ "
                          "and {{ }} for literal braces") from None
    except ValueError as exc:  # unbalanced braces
        raise LookupError(f"cannot expand {line!r}: {exc} (write {{{{ }}}} for literal braces)") from None
    except Exception as exc:  # noqa: BLE001 - any expansion error becomes a LookupError naming it
        raise LookupError(f"cannot expand {line!r}: {type(exc).__name__}: {exc}") from None
    return "".join(out)


def split_args(line: str) -> list[str]:
    """Split a magic line like a shell: quotes group words (``"my dir"``) and are removed."""
    if os.name != "nt":
        return shlex.split(line, comments=True, posix=True)
    parts = shlex.split(line, comments=True, posix=False)  # keep Windows backslashes
    return [p[1:-1] if len(p) >= 2 and p[0] == p[-1] and p[0] in "\"'" else p for p in parts]


def check_identifier(name: str) -> bool:
    return name.isidentifier() and not keyword.iskeyword(name)


# ------------------------------------------------------------------ the magics

_LOAD_EXAMPLES = """\
Examples::

  %ucload /Volumes/main/default/images -p "**/*.jpg" -b 64 -o loader
  loader = %ucload s3://bucket/train --shuffle --limit 50GB
  %ucload {data_dir} -b $batch -w 2 --no-widget -o loader
  df = %ucload main.default.ratings --rows 10000
  loader = %ucload /data/ratings.parquet --stream -b 4096
"""

_STAGE_EXAMPLES = """\
Examples::

  %ucstage /Volumes/main/default/images /local_disk0/images -j 256
  %ucstage s3://bucket/audio /tmp/audio -p "*.wav"
  %ucstage --export main.default.events /Volumes/main/default/export --file-size 512MB
  %ucstage --export df /tmp/df_parquet          # df: a pandas/pyarrow/Spark frame in your namespace
  %ucstage /Volumes/main/default/images /Volumes/main/default/shards --pack --shard-size 1GB --label-from-folder
  %ucstage --pack df /tmp/shards --columns image=jpg,label=cls   # a table: a member per column
"""

_CKPT_EXAMPLES = """\
Examples::

  %ucckpt save /Volumes/main/default/ckpt -m model --opt opt --step 100 --keep 3
  fut = %ucckpt save /tmp/ckpt -m model --step 200 --async --loader loader
  %ucckpt list /tmp/ckpt
  %ucckpt load /tmp/ckpt latest -m model --opt opt --loader loader
  %ucckpt load /tmp/ckpt 100 -m model
"""


@magics_class
class UcMagics(Magics):
    """ucmagic's notebook commands. Settings: ``%config UcMagics.<name>=<value>``."""

    shell: Any  # the InteractiveShell; IPython's Magics declares it as None

    cache_dir = Unicode(None, allow_none=True,
                        help="Cache directory for %ucload (default: $UCMAGIC_CACHE_DIR, else ~/.cache/ucmagic)."
                        ).tag(config=True)
    workers = Int(None, allow_none=True,
                  help="DataLoader worker processes for %ucload (default: ucmagic.DataLoader's).").tag(config=True)
    progress = Enum(["auto", "widget", "text", "off"], "auto",
                    help="Live display of %ucload loaders: widget, text, off, or auto ($UCMAGIC_PROGRESS "
                         "when set, else the widget in a notebook and text elsewhere).").tag(config=True)
    mlflow = Bool(True, help="Log per-batch timings of %ucload loaders to the active MLflow run.").tag(config=True)

    # -------------------------------------------------------------- shared plumbing

    def _parse(self, magic: str, fn: Any, line: str, local_ns: dict[str, Any] | None) -> Any:
        ns = dict(self.shell.user_ns) if self.shell is not None else {}
        if local_ns:
            ns.update(local_ns)
        try:
            raw = split_args(line)
        except ValueError:
            raw = []
        if wants_help(raw):  # every magic and subcommand: -h/--help prints the help, whatever else is there
            text = fn.parser.format_help().strip()
            text = text[2:].lstrip("\n") if text.startswith("::") else text  # the docstring's literal-block mark
            print(f"usage:\n{text}\n\nucmagic {_version()}")
            raise _HelpShown
        try:
            expanded = expand(line, ns)
        except LookupError as exc:
            _fail(magic, str(exc))
        try:
            return fn.parser.parse_args(split_args(expanded))
        except UsageError as exc:
            _fail(magic, f"{exc}; see %{magic} --help for usage")
        except ValueError as exc:  # unbalanced quotes
            _fail(magic, f"cannot parse {expanded!r}: {exc}; quote paths with spaces as \"my dir\"")

    def _lookup(self, magic: str, flag: str, name: str | None, local_ns: dict[str, Any] | None,
                kind: Any = None, what: str = "") -> Any:
        """The object bound to ``name`` in the user namespace (never evaluated)."""
        if name is None:
            return None
        if not check_identifier(name):
            _fail(magic, f"{flag} takes the name of a variable, got {name!r}")
        ns = local_ns if local_ns and name in local_ns else (self.shell.user_ns if self.shell is not None else {})
        if name not in ns:
            _fail(magic, f"{flag} {name}: no variable named {name!r} in the notebook; define it first")
        obj = ns[name]
        if kind is not None and not isinstance(obj, kind):
            _fail(magic, f"{flag} {name}: expected {what}, got {type(obj).__name__}")
        return obj

    def _bind(self, name: str, value: Any) -> None:
        self.shell.user_ns[name] = value

    def _check_out(self, magic: str, out: str | None) -> None:
        if out is not None and not check_identifier(out):
            _fail(magic, f"-o takes a variable name, got {out!r}")

    # -------------------------------------------------------------- %ucload

    @no_var_expand
    @needs_local_scope
    @line_magic
    @magic_arguments()
    @kwds(epilog=_LOAD_EXAMPLES)
    @argument("source", help="directory, /Volumes/... path or URL of files; or a table name "
                             "(catalog.schema.table), Delta directory or Parquet path")
    @argument("-o", "--out", metavar="VAR", help="bind the result to VAR instead of returning it")
    @argument("-p", "--pattern", metavar="GLOB",
              help="only files matching GLOB (\"**/*.jpg\"; no / matches names at any depth)")
    @argument("-b", "--batch-size", type=int, default=None, metavar="BATCH",
              help="batch size (default 32 for files; rows per batch with --stream, default 1024)")
    @argument("-w", "--workers", type=int, default=None, metavar="WORKERS",
              help="DataLoader worker processes (default: %%config UcMagics.workers, else the DataLoader's)")
    @argument("--shuffle", action="store_true", help="seeded per-epoch shuffle")
    @argument("--seed", type=int, default=0, help="shuffle seed (default 0)")
    @argument("--cache-dir", metavar="DIR", help="cache directory (default: %%config UcMagics.cache_dir, "
                                                  "$UCMAGIC_CACHE_DIR, ~/.cache/ucmagic)")
    @argument("--limit", metavar="BYTES", help="cache budget, e.g. 50GB (default: keep 10%% of the disk free)")
    @argument("--no-widget", action="store_true", help="do not show the live progress widget")
    @argument("--explore", action="store_true", help="open the fetch-latency explorer in the panel when the loop ends")
    @argument("--advise", action="store_true", help="show loader.stats.advise() in the panel when the loop ends")
    @argument("--rows", type=int, default=None, metavar="N", help="tables: load at most N rows")
    @argument("--columns", metavar="COLS", help="tables: comma-separated columns to load")
    @argument("--where", default=None, metavar="PREDICATE",
              help="tables: only the rows a SQL predicate keeps (DuckDB's dialect), e.g. \"label = 3\"")
    @argument("--stream", action="store_true", help="tables: a ParquetDataset loader instead of a DataFrame")
    @argument("--files", action="store_true", help="treat SOURCE as a directory of files even if it holds Parquet")
    @argument("--kind", default=None, metavar="KIND",
              help="files, shards or tokens: what SOURCE holds (default: guessed; .tar shards stream samples)")
    @argument("--block-size", type=int, default=None, metavar="TOKENS", help="--kind tokens: tokens per window")
    @_friendly("ucload")
    def ucload(self, line: str = "", local_ns: dict[str, Any] | None = None) -> Any:
        """Load training data: a directory of files becomes a cached, prefetching DataLoader;
        a table becomes a pandas DataFrame (or a streaming loader with --stream).

        The loader shows a live widget (cache fill, batch latency p50/p99, throughput) while
        your loop iterates it."""
        a = self._parse("ucload", UcMagics.ucload, line, local_ns)
        self._check_out("ucload", a.out)
        for flag, v in (("-b", a.batch_size), ("-w", a.workers), ("--rows", a.rows)):
            if v is not None and v < (0 if flag == "-w" else 1):
                _fail("ucload", f"{flag} must be {'>= 0' if flag == '-w' else '>= 1'}, got {v}")
        limit = None
        if a.limit is not None:
            from ..units import parse_size

            try:
                limit = parse_size(a.limit)
            except ValueError as exc:
                _fail("ucload", f"--limit: {exc}")
        columns = [c.strip() for c in a.columns.split(",") if c.strip()] if a.columns else None
        from ..api import load

        a.panel, a.loader_kind = None, None
        try:
            result = load(a.source, files=a.files, pattern=a.pattern, batch_size=a.batch_size,
                          num_workers=a.workers if a.workers is not None else self.workers, shuffle=a.shuffle,
                          seed=a.seed, cache_dir=a.cache_dir or self.cache_dir, cache_limit=limit,
                          rows=a.rows, columns=columns, stream=a.stream, kind=a.kind, block_size=a.block_size,
                          where=a.where,
                          on_start=lambda kind: self._early_panel(a, kind),
                          listing_progress=((lambda count: self._listing_progress(a, count))
                                            if self._panel_wanted(a) else None),
                          **self._loader_kwargs(a))
        except LoadUsageError as exc:
            _fail("ucload", str(exc))
        except BaseException as exc:
            self._panel_failed(a, exc)
            raise
        if a.loader_kind is not None:  # a DataLoader (files, or a table with --stream): attach the display
            result = self._finish_loader(result, a)
        if a.out:
            self._bind(a.out, result)
            return None
        return result

    def _loader_kwargs(self, a: Any) -> dict[str, Any]:
        return {} if self.mlflow else {"log_to_mlflow": False}

    def _panel_wanted(self, a: Any) -> bool:
        """Whether %ucload shows the live panel (else the engine's own text progress is shown)."""
        from .panel import resolve_mode

        return not a.no_widget and resolve_mode(self.progress) == "widget"

    def _early_panel(self, a: Any, kind: str) -> None:
        """Show the live panel at once in a "starting / listing" state (imports and listing take seconds)."""
        a.panel, a.loader_kind = None, kind
        if a.no_widget:
            return
        from .panel import WidgetView, resolve_mode

        if resolve_mode(self.progress) == "widget":
            a.panel = WidgetView(f"ucmagic \u2014 {a.source}")
            a.panel.starting(f"starting: listing {a.source} ...")

    @staticmethod
    def _listing_progress(a: Any, count: int) -> None:
        """The panel's "starting" line counts the files listed so far (a long listing takes seconds)."""
        if getattr(a, "panel", None) is not None:
            a.panel.starting(f"starting: listing {a.source}: {count:,} files so far ...")

    @staticmethod
    def _panel_failed(a: Any, exc: BaseException) -> None:
        if getattr(a, "panel", None) is not None:
            a.panel.starting(f"failed: {type(exc).__name__}: {exc}")

    def _finish_loader(self, loader: Any, a: Any) -> Any:
        if not a.no_widget:
            from .panel import attach_monitor, resolve_mode

            mode = resolve_mode(self.progress)
            if mode != "off":  # shown in this cell, updated by the loop in later cells
                attach_monitor(loader, mode=mode, view=getattr(a, "panel", None), explore=a.explore,
                               advise=a.advise)
        return loader

    # -------------------------------------------------------------- %ucstage

    @no_var_expand
    @needs_local_scope
    @line_magic
    @magic_arguments()
    @kwds(epilog=_STAGE_EXAMPLES)
    @argument("source", help="directory (or URL) to copy; with --export: a table name, path, SQL query, "
                             "or the name of a DataFrame variable")
    @argument("dest", help="local directory to copy into; with --export: the output directory")
    @argument("-j", "--concurrency", "--jobs", dest="concurrency", type=int, default=None, metavar="N",
              help="parallel copies (default 256; --jobs is an alias)")
    @argument("-p", "--pattern", metavar="GLOB", help="only files matching GLOB")
    @argument("--export", action="store_true", help="export a table as Parquet files instead of copying files")
    @argument("--file-size", metavar="SIZE", default=None, help="--export: target size of each file (default 1GB)")
    @argument("--pack", action="store_true",
              help="pack files (or a table) into tar shards with an index instead of copying them (ucmagic.pack)")
    @argument("--shard-size", metavar="SIZE", default=None, help="--pack: target size of each shard (default 1GB)")
    @argument("--label-from-folder", action="store_true",
              help="--pack: a cls member per sample, the index of its top folder")
    @argument("--columns", metavar="COLS", help="--pack of a table: columns, each optionally COLUMN=EXT")
    @argument("--key-column", metavar="COL", help="--pack of a table: a column of unique sample keys")
    @argument("-o", "--out", metavar="VAR", help="bind the result to VAR instead of returning it")
    @_friendly("ucstage")
    def ucstage(self, line: str = "", local_ns: dict[str, Any] | None = None) -> Any:
        """Copy a tree of small files to local disk in parallel (skipping unchanged files), or
        with --export write a table as Parquet files of a target size, or with --pack pack files
        (or a table) into WebDataset tar shards of a target size (ucmagic.pack; a rerun resumes)."""
        a = self._parse("ucstage", UcMagics.ucstage, line, local_ns)
        self._check_out("ucstage", a.out)
        result: Any  # ExportResult, StageResult or PackSummary
        pack_only = [f for f, v in (("--shard-size", a.shard_size), ("--columns", a.columns),
                                    ("--label-from-folder", a.label_from_folder or None),
                                    ("--key-column", a.key_column)) if v is not None]
        if a.pack:
            result = self._pack(a, local_ns)
        elif pack_only:
            _fail("ucstage", f"{pack_only[0]} applies to --pack only")
        elif a.export:
            if a.concurrency is not None or a.pattern is not None:
                _fail("ucstage", "-j and -p apply to file staging, not to --export")
            size = "1GB"
            if a.file_size is not None:
                from ..units import parse_size

                try:
                    parse_size(a.file_size)
                except ValueError as exc:
                    _fail("ucstage", f"--file-size: {exc}")
                size = a.file_size
            source: Any = a.source
            if check_identifier(a.source):  # a variable holding a DataFrame/Table: looked up, never evaluated
                ns = local_ns if local_ns and a.source in local_ns else self.shell.user_ns
                if a.source not in ns:
                    _fail("ucstage", f"--export {a.source}: no variable named {a.source!r}; pass a table name "
                                     "(catalog.schema.table), a path, or the name of a DataFrame variable")
                source = ns[a.source]
            from ..tables import export_parquet

            result = export_parquet(source, a.dest, target_file_size=size)
        else:
            if a.file_size is not None:
                _fail("ucstage", "--file-size applies to --export only")
            if a.concurrency is not None and a.concurrency < 1:
                _fail("ucstage", f"-j must be >= 1, got {a.concurrency}")
            _check_exists("ucstage", a.source, directory=True)
            from ..staging import stage

            kw: dict[str, Any] = {"pattern": a.pattern}
            if a.concurrency is not None:
                kw["concurrency"] = a.concurrency
            result = stage(a.source, a.dest, **kw)
        if a.out:
            self._bind(a.out, result)
            return None
        return result

    def _pack(self, a: Any, local_ns: dict[str, Any] | None) -> Any:
        """``%ucstage SRC DEST --pack``: one :func:`ucmagic.pack` call (SRC may name a DataFrame variable)."""
        if a.export or a.file_size is not None:
            _fail("ucstage", "--pack and --export/--file-size do not go together: --pack writes tar shards "
                             "(--shard-size), --export Parquet files")
        from ..shards.pack import pack, parse_columns
        from ..units import parse_size

        try:
            parse_size(a.shard_size)
        except ValueError as exc:
            _fail("ucstage", f"--shard-size: {exc}")
        source: Any = a.source
        if check_identifier(a.source) and not os.path.exists(a.source):  # a DataFrame variable: looked up
            source = self._lookup("ucstage", "--pack", a.source, local_ns)
        elif not is_url(a.source):
            _check_exists("ucstage", a.source, directory=False)
        return pack(source, a.dest, a.shard_size or "1GB", label_from_folder=a.label_from_folder,
                    pattern=a.pattern, workers=a.concurrency, columns=parse_columns(a.columns),
                    key_column=a.key_column, progress=self.progress)

    # -------------------------------------------------------------- %ucckpt

    @no_var_expand
    @needs_local_scope
    @line_magic
    @magic_arguments()
    @kwds(epilog=_CKPT_EXAMPLES)
    @argument("action", choices=["save", "load", "list"], help="save, load or list")
    @argument("root", help="checkpoint root: a local directory, a mounted volume (/Volumes/...) or an fsspec "
                           "URL (s3://bucket/run/ckpts)")
    @argument("step_arg", nargs="?", default=None, metavar="STEP",
              help="load: the step to restore, or latest (default)")
    @argument("-m", "--model", metavar="MODEL", help="name of the torch.nn.Module variable")
    @argument("--opt", metavar="OPT", help="name of the torch.optim.Optimizer variable")
    @argument("--step", type=int, default=None, metavar="N", help="save: the training step")
    @argument("--async", dest="async_", action="store_true",
              help="save: return once the local copy is written; the upload continues in the background")
    @argument("--keep", type=int, default=None, metavar="K", help="save: keep only the K newest checkpoints")
    @argument("--loader", metavar="LOADER",
              help="name of a loader whose state_dict() is saved / restored with the checkpoint")
    @argument("--extra", metavar="VAR", help="save: name of a dict variable stored with the checkpoint")
    @argument("-o", "--out", metavar="VAR", help="bind the result to VAR instead of returning it")
    @_friendly("ucckpt")
    def ucckpt(self, line: str = "", local_ns: dict[str, Any] | None = None) -> Any:
        """Save, restore or list checkpoints of a model (and optimizer, and loader position).

        -m, --opt, --loader and --extra name variables of the notebook; they are looked up,
        never evaluated. A checkpoint becomes visible only once fully written."""
        a = self._parse("ucckpt", UcMagics.ucckpt, line, local_ns)
        self._check_out("ucckpt", a.out)
        if a.action == "list":
            for flag, v in (("STEP", a.step_arg), ("-m", a.model), ("--opt", a.opt), ("--step", a.step),
                            ("--keep", a.keep), ("--loader", a.loader), ("--extra", a.extra),
                            ("--async", a.async_ or None)):
                if v is not None:
                    _fail("ucckpt", f"{flag} does not apply to list; use: %ucckpt list ROOT")
            _check_exists("ucckpt", a.root, directory=True)
            from ..checkpoints.api import list_checkpoints

            result = CheckpointList(list_checkpoints(a.root))
        else:
            result = self._save_or_load(a, local_ns)
        if a.out:
            self._bind(a.out, result)
            return None
        return result

    def _save_or_load(self, a: Any, local_ns: dict[str, Any] | None) -> Any:
        import torch

        if a.model is None:
            _fail("ucckpt", f"{a.action} needs -m MODEL (the name of your torch.nn.Module variable)")
        model = self._lookup("ucckpt", "-m", a.model, local_ns, torch.nn.Module, "a torch.nn.Module")
        opt = self._lookup("ucckpt", "--opt", a.opt, local_ns, torch.optim.Optimizer, "a torch.optim.Optimizer")
        loader = self._lookup("ucckpt", "--loader", a.loader, local_ns)
        if loader is not None and (isinstance(loader, (torch.nn.Module, torch.optim.Optimizer))
                                   or not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict"))):
            _fail("ucckpt", f"--loader {a.loader}: expected a loader with state_dict(), got {type(loader).__name__}")
        if a.action == "save":
            if a.step_arg is not None:
                _fail("ucckpt", f"save takes the step as --step N, not as {a.step_arg!r}")
            if a.step is None:
                _fail("ucckpt", "save needs --step N (the training step being saved)")
            if a.step < 0:
                _fail("ucckpt", f"--step {a.step}: the step must be 0 or more")
            if a.keep is not None and a.keep < 1:
                _fail("ucckpt", f"--keep {a.keep}: keep at least 1 checkpoint (or leave --keep out to keep all)")
            extra = self._lookup("ucckpt", "--extra", a.extra, local_ns, dict, "a dict")
            extra = dict(extra or {})
            if loader is not None:
                extra["loader"] = loader.state_dict()
            from ..checkpoints.api import save_checkpoint

            return save_checkpoint(a.root, model=model, optimizer=opt, step=a.step, extra=extra or None,
                                   async_=a.async_, keep=a.keep)
        # load
        for flag, v in (("--step", a.step), ("--keep", a.keep), ("--extra", a.extra), ("--async", a.async_ or None)):
            if v is not None:
                _fail("ucckpt", f"{flag} applies to save; load takes the step as: "
                                "%ucckpt load ROOT [STEP|latest] -m MODEL")
        step: Any = "latest"
        if a.step_arg is not None and a.step_arg != "latest":
            try:
                step = int(a.step_arg)
            except ValueError:
                _fail("ucckpt", f"STEP must be a number or latest, got {a.step_arg!r}")
        _check_exists("ucckpt", a.root, directory=True)
        from ..checkpoints.api import load_checkpoint

        if loader is not None and _peek_extra(a.root, step) is not None \
                and _loader_state(_peek_extra(a.root, step)) is None:
            _fail("ucckpt", f"the checkpoint in {a.root} holds no loader state: save it with --loader, "
                            "or load without --loader")
        result = load_checkpoint(a.root, step, model=model, optimizer=opt)
        if loader is not None:
            state = _loader_state(result)
            if state is None:
                _fail("ucckpt", f"model restored, but the checkpoint in {a.root} holds no loader state: "
                                "save it with --loader, or load without --loader")
            loader.load_state_dict(state)
        return result


# ------------------------------------------------------------------ small helpers

class CheckpointList(list):
    """What ``%ucckpt list`` returns: ``list_checkpoints``'s list (``CheckpointInfo`` items, ``time`` in epoch
    seconds), shown as a table with this machine's local dates."""

    def __repr__(self) -> str:
        if not self:
            return "no committed checkpoints"
        from ..checkpoints.format import format_checkpoints

        return format_checkpoints(self, utc=False)

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(repr(self))


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ucmagic")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "(not installed)"


def _check_exists(magic: str, path: str, *, directory: bool) -> None:
    if is_url(path):
        return
    from ..files.volume import resolve_local_path

    real = resolve_local_path(path)
    if not os.path.exists(real):
        _fail(magic, f"{path} does not exist: check the path")
    if directory and not os.path.isdir(real):
        _fail(magic, f"{path} is a file: pass a directory")


def _loader_state(result: Any) -> Any:
    """The loader state saved by ``%ucckpt save --loader`` in load_checkpoint's ``(step, extra)``."""
    extra = result[1] if isinstance(result, tuple) and len(result) == 2 else result
    return extra.get("loader") if isinstance(extra, dict) else None


def _peek_extra(root: str, step: Any) -> Any:
    """``(step, extra)`` of a checkpoint without loading it (so a load is all or nothing);
    None when it cannot be read this way (the load itself then reports the problem)."""
    try:
        from ..checkpoints.api import resolve_step
        from ..checkpoints.commit import read_commit

        chosen, path = resolve_step(root, step)
        return chosen, read_commit(path).get("extra")
    except Exception:  # noqa: BLE001 - a peek only; load_checkpoint reports the real error
        return None


# ------------------------------------------------------------------ extension entry points

def load_ipython_extension(ipython: Any) -> None:
    """Register the magics (a second load is harmless)."""
    if any(isinstance(c, UcMagics) for c in ipython.configurables):
        return
    ipython.register_magics(UcMagics(shell=ipython))  # joins ipython.configurables, reads its config


def unload_ipython_extension(ipython: Any) -> None:
    """Remove the magics and their ``%config`` entry."""
    mm = ipython.magics_manager
    for name in ("ucload", "ucstage", "ucckpt"):
        mm.magics["line"].pop(name, None)
    mm.registry.pop(UcMagics.__name__, None)
    ipython.configurables[:] = [c for c in ipython.configurables if not isinstance(c, UcMagics)]
