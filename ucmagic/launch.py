"""``@distributed``: run a function on N local processes with ``torch.distributed`` initialised.

Drop-in for the local mode of ``databricks.air.distributed``::

    from ucmagic import distributed

    @distributed(num_processes=2)          # default: one process per GPU, else 2 on CPU
    def train(lr):
        import torch.distributed as dist
        ds = ucmagic.UCVolumeDataset("/Volumes/main/default/imgs")   # partitioned over the ranks
        ...
        return dist.get_rank(), lr

    train.distributed(0.1)                 # -> (0, 0.1): rank 0's result
    train(0.1)                             # plain local call, no processes

Why multiprocessing (spawn) rather than ``torch.distributed.launcher.api.elastic_launch``: the
elastic agent has no wall-clock timeout, installs SIGTERM/SIGINT handlers in the calling process
(a notebook kernel) that it never restores, returns a failed rank's exception only as text, and
runs a rendezvous on every call. Here each rank is a ``spawn`` child that receives the function and
its arguments pickled with cloudpickle (so functions defined in a notebook cell work), joins a
``TCPStore`` the caller already bound to a free port (no race for the port), and sends back its
result, or its exception with the traceback. On the first failure, or when ``timeout`` expires, the
other ranks are terminated at once instead of hanging in a collective. The ranks see the same
environment ``torchrun`` gives them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``), and ``print`` output of every rank is relayed to the caller
(prefixed ``[rank N]``), so it shows up in a notebook cell. Multi-node runs use ``torchrun``.
"""
from __future__ import annotations

import contextlib
import functools
import os
import queue as queue_mod
import sys
import time
import traceback
import types
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, overload

from .errors import DistributedRunError, DistributedTimeoutError, InvalidArgumentError

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

TERMINATE_GRACE_S = 5.0
DEATH_GRACE_S = 1.0
"""How long a rank's death, or another rank's error, may take to show after it happened: a message a rank sent
just before exiting, or the exit of a rank whose death broke a collective another rank then reports."""
_UNSET: Any = object()




class RemoteTraceback(Exception):  # noqa: N818 - named after multiprocessing.pool.RemoteTraceback
    """Carries a rank's formatted traceback; set as ``__cause__`` of the re-raised exception."""

    def __init__(self, tb: str) -> None:
        super().__init__(tb)
        self.tb = tb

    def __str__(self) -> str:
        return self.tb


# ---------------------------------------------------------------- pure helpers

def _visible_gpus() -> int:
    """GPUs this process can use (0 without torch or usable CUDA)."""
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - no usable torch: no GPU
        return 0


def default_num_processes() -> int:
    """One process per visible GPU, else 2."""
    return _visible_gpus() or 2


def choose_backend(backend: str | None, num_processes: int) -> str:
    """``nccl`` when there is a GPU for every rank, else ``gloo`` (an explicit choice wins)."""
    if backend:
        return backend
    return "nccl" if _visible_gpus() >= num_processes else "gloo"  # torch missing or CUDA unusable: gloo


def rank_env(rank: int, world: int, master_addr: str, master_port: int) -> dict[str, str]:
    """The variables ``torchrun`` sets for one rank on a single node."""
    env = {
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "GROUP_RANK": "0", "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world), "NODE_RANK": "0",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        # the caller owns the store on MASTER_PORT: ranks join it as clients
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "0",
    }
    if world > 1 and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = "1"  # as torchrun: N ranks x all cores oversubscribes the CPU
    return env


def _validate(num_processes: object, timeout: object) -> None:
    if num_processes is not None and (isinstance(num_processes, bool) or not isinstance(num_processes, int)
                                      or num_processes < 1):
        raise ValueError(f"num_processes must be a positive int or None, got {num_processes!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ValueError(f"timeout must be None or a positive number of seconds, got {timeout!r}")


def _serverless_form(num_processes: int | None, gpus: object, gpu_type: object) -> int | None:
    """``num_processes`` given Databricks' ``gpus=``/``gpu_type=`` (the seeds' form): ``gpus`` ranks
    here; a ``gpu_type`` is warned about (no serverless GPU kind can be chosen on this machine)."""
    if gpus is not None:
        if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
            raise InvalidArgumentError(f"gpus must be a positive int (the number of ranks), got {gpus!r}")
        if num_processes is not None and num_processes != gpus:
            raise InvalidArgumentError(f"num_processes={num_processes!r} and gpus={gpus!r} disagree: pass one of them")
        num_processes = gpus
    if gpu_type is not None:
        if not isinstance(gpu_type, str):
            raise InvalidArgumentError(f"gpu_type must be a string such as 'H100', got {gpu_type!r}")
        here = _visible_gpus()
        ranks = num_processes or default_num_processes()
        fewer = "" if here >= ranks else ", fewer than the ranks: they use gloo on CPU"
        warnings.warn(f"ucmagic: gpu_type={gpu_type!r} selects Databricks serverless GPUs; here the {ranks} rank(s) "
                      f"run on this machine, which has {here} GPU(s){fewer}", UserWarning, stacklevel=3)
    return num_processes


# ---------------------------------------------------------------- tracebacks with source lines
# cloudpickle renames the file of every function it pickles by value to "<dynamic-code>", so a rank's
# traceback would show no file and no source line. The caller sends where each code object came from
# and the source lines it has (notebook cells included); the rank puts them back before running.

def _functions(fn: object, seen: set[int]) -> Iterator[types.FunctionType]:
    """``fn`` and the plain functions it reaches through its globals and closure (those pickled by value)."""
    if id(fn) in seen or not isinstance(fn, types.FunctionType):
        return
    seen.add(id(fn))
    yield fn
    names: set[str] = set()
    stack = [fn.__code__]
    while stack:
        code = stack.pop()
        names.update(code.co_names)
        stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    refs = [fn.__globals__.get(n) for n in names]
    refs += [c.cell_contents for c in (fn.__closure__ or ()) if _cell_filled(c)]
    for r in refs:
        yield from _functions(r, seen)


def _cell_filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def code_origins(fn: object, max_lines: int = 20000) -> tuple[dict[tuple[str, int], str], dict[str, list[str]]]:
    """``({(name, first line): file}, {file: source lines})`` for the code ``fn`` runs."""
    import linecache

    where: dict[tuple[str, int], str] = {}
    files: dict[str, list[str]] = {}
    for f in _functions(fn, set()):
        stack = [f.__code__]
        while stack:
            code = stack.pop()
            where[(code.co_name, code.co_firstlineno)] = code.co_filename
            stack.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
            if code.co_filename not in files:
                lines = linecache.getlines(code.co_filename)
                if lines and len(lines) <= max_lines:
                    files[code.co_filename] = lines
    return where, files


def _restore_origins(fn: object, where: dict[tuple[str, int], str], files: dict[str, list[str]]) -> None:
    import linecache

    def fix(code: types.CodeType) -> types.CodeType:
        consts = tuple(fix(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
        name = where.get((code.co_name, code.co_firstlineno), code.co_filename)
        return code.replace(co_filename=name, co_consts=consts)

    for f in _functions(fn, set()):
        if f.__code__.co_filename == "<dynamic-code>":
            f.__code__ = fix(f.__code__)
    for name, lines in files.items():
        linecache.cache.setdefault(name, (sum(map(len, lines)), None, lines, name))


# ---------------------------------------------------------------- the child side

class _RelayWriter:
    """A text stream that forwards whole lines to the caller through the result queue."""

    def __init__(self, q: Any, rank: int, stream: str, prefix: str) -> None:
        self.q, self.rank, self.stream, self.prefix = q, rank, stream, prefix
        self.buf = ""
        self.encoding = "utf-8"

    def write(self, s: str) -> int:
        self.buf += s
        if "\n" in self.buf:
            head, self.buf = self.buf.rsplit("\n", 1)
            self._send(head + "\n")
        return len(s)

    def _send(self, text: str) -> None:
        if self.prefix:
            text = "".join(self.prefix + line for line in text.splitlines(keepends=True))
        with contextlib.suppress(Exception):  # output is best effort
            self.q.put(("out", self.rank, self.stream, text))

    def flush(self) -> None:
        if self.buf:
            buf, self.buf = self.buf, ""
            self._send(buf)

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        raise OSError("relayed stream has no file descriptor")


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):  # best effort
            import ctypes
            import signal

            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: no orphan ranks if the caller dies


def _worker(rank: int, world: int, env: dict[str, str], backend: str, pg_timeout_s: float, payload: bytes,
            q: Any, relay: bool) -> None:
    """Entry point of one rank (module level, so spawn can import it)."""
    os.environ.update(env)
    _die_with_parent()
    prefix = f"[rank {rank}] " if world > 1 else ""
    if relay:
        sys.stdout = _RelayWriter(q, rank, "stdout", prefix)
        sys.stderr = _RelayWriter(q, rank, "stderr", prefix)
    try:
        import cloudpickle

        fn, args, kwargs, where, files = cloudpickle.loads(payload)
        with contextlib.suppress(Exception):  # only cosmetic
            _restore_origins(fn, where, files)
        import torch
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=pg_timeout_s))
        original_init = dist.init_process_group

        @functools.wraps(original_init)
        def init_once(*a: Any, **k: Any) -> None:  # user code that initialises the group itself keeps working
            if not dist.is_initialized():
                original_init(*a, **k)

        dist.init_process_group = init_once
        try:
            result = fn(*args, **kwargs)
        finally:
            dist.init_process_group = original_init
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # best effort
                dist.destroy_process_group()
        body = None
        if rank == 0:
            try:
                body = cloudpickle.dumps(result)
            except Exception as e:
                raise TypeError(f"rank 0's return value ({type(result).__name__}) cannot be pickled back to the "
                                f"caller: {e}. Return plain data (numbers, lists, dicts, tensors on CPU)") from e
        _flush(relay)
        q.put(("ok", rank, body))
    except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        try:
            import cloudpickle

            exc_bytes: bytes | None = cloudpickle.dumps(e)
            cloudpickle.loads(exc_bytes)
        except Exception:  # noqa: BLE001
            exc_bytes = None
        _flush(relay)
        q.put(("error", rank, (exc_bytes, f"{type(e).__name__}: {e}", tb)))
        q.close()
        q.join_thread()
        os._exit(1)
    q.close()
    q.join_thread()


def _flush(relay: bool) -> None:
    if relay:
        for s in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # best effort
                s.flush()


# ---------------------------------------------------------------- the caller side

def _terminate(procs: Sequence[BaseProcess]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + TERMINATE_GRACE_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(1.0)


def _raise_rank_error(name: str, rank: int, info: tuple[bytes | None, str, str]) -> None:
    exc_bytes, summary, tb = info
    remote = RemoteTraceback(f'\n"""\nTraceback from rank {rank} of {name}:\n{tb}"""')
    exc: BaseException | None = None
    if exc_bytes is not None:
        import cloudpickle

        try:
            exc = cloudpickle.loads(exc_bytes)
        except Exception:  # noqa: BLE001
            exc = None
    if exc is None:
        raise DistributedRunError(f"rank {rank} of {name} failed: {summary}") from remote
    if hasattr(exc, "add_note"):
        exc.add_note(f"(raised in rank {rank} of @distributed {name}; its traceback is shown above)")
    raise exc from remote


def _died_silently(procs: Sequence[BaseProcess], reported: set[int]) -> int | None:
    for r, p in enumerate(procs):
        if r not in reported and not p.is_alive() and p.exitcode not in (None, 0):
            return r
    return None


def _silent_death(procs: Sequence[BaseProcess], reported: set[int], q: Any) -> int | None:
    """The rank that died without reporting an error, waited for up to :data:`DEATH_GRACE_S` while another rank
    is still running: a rank that calls ``os._exit`` breaks the collective its peer is in, and the peer's error
    (``Connection reset by peer``) can arrive before the dead rank's exit shows; the death is the cause. Meanwhile
    the messages of the ranks are read (``q``): a rank whose error or result arrives did not die silently, and
    output is shown. ``reported`` grows with them."""
    until = time.monotonic() + DEATH_GRACE_S
    while True:
        _drain(q, reported)
        dead = _died_silently(procs, reported)
        if dead is not None:  # what the rank sent just before it exited is in the queue by now
            _drain(q, reported)
            dead = _died_silently(procs, reported)
        others = [p for r, p in enumerate(procs) if r not in reported and p.is_alive()]
        if dead is not None or not others or time.monotonic() > until:
            return dead
        time.sleep(0.05)


def _drain(q: Any, reported: set[int]) -> None:
    """Read the messages waiting in ``q``: show output; a rank that reported (its error or its result) joins
    ``reported``."""
    while True:
        try:
            msg = q.get_nowait()
        except queue_mod.Empty:
            return
        except (OSError, EOFError, ValueError):  # the queue is gone (a rank killed mid-message)
            return
        if msg[0] == "out":
            _show_output(msg)
        else:
            reported.add(msg[1])


def _show_output(msg: tuple[Any, ...]) -> None:
    """A rank's output message ``("out", rank, "stdout" or "stderr", text)``, written where it belongs."""
    stream = sys.stdout if msg[2] == "stdout" else sys.stderr
    stream.write(msg[3])
    stream.flush()


def _death_message(name: str, rank: int, code: int | None) -> str:
    how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
    main = sys.modules.get("__main__")
    script = ("; in a script, start the run under `if __name__ == \"__main__\":` (each rank imports the "
              "script, and a call at its top level starts the ranks again)") if getattr(main, "__file__", None) else ""
    return (f"rank {rank} of {name} {how} without reporting an error (out of memory? os._exit? a crash in "
            f"native code?{script}); the other ranks were stopped. Check the rank's output above")


def run_distributed(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                    num_processes: int | None = None, backend: str | None = None, timeout: float | None = None,
                    relay_output: bool = True, pg_timeout: float = 1800.0) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``num_processes`` local ranks; return rank 0's result.

    The first rank to fail has its exception re-raised here (same type, with the rank's traceback
    as its cause) after the other ranks are terminated. ``timeout`` (seconds) bounds the whole run.
    """
    import multiprocessing as mp

    import cloudpickle
    from torch.distributed import TCPStore

    _validate(num_processes, timeout)
    world = num_processes or default_num_processes()
    backend = choose_backend(backend, world)
    name = getattr(fn, "__qualname__", repr(fn))
    try:
        payload = cloudpickle.dumps((fn, tuple(args), dict(kwargs), *code_origins(fn)))
    except Exception as e:
        raise TypeError(f"cannot send {name} and its arguments to the ranks: {e}. Build large or unpicklable "
                        "objects (datasets, open files, clients) inside the function instead") from e

    addr = "127.0.0.1"
    store = TCPStore(addr, 0, world, True, timeout=timedelta(seconds=pg_timeout), wait_for_workers=False)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, name=f"ucmagic-rank{r}", daemon=False,
                         args=(r, world, rank_env(r, world, addr, store.port), backend, pg_timeout, payload, q,
                               relay_output)) for r in range(world)]
    deadline = None if timeout is None else time.monotonic() + timeout
    done: set[int] = set()
    result: Any = None
    dead_since: dict[int, float] = {}
    try:
        for p in procs:
            p.start()
        while len(done) < world:
            try:
                msg = q.get(timeout=0.1)
            except queue_mod.Empty:
                msg = None
            if msg is not None:
                kind, rank = msg[0], msg[1]
                if kind == "out":
                    _show_output(msg)
                elif kind == "ok":
                    done.add(rank)
                    if rank == 0:
                        result = cloudpickle.loads(msg[2])
                elif kind == "error":
                    dead = _silent_death(procs, done | {rank}, q)
                    _terminate(procs)
                    if dead is not None:  # that death is the cause; this rank's error is its echo
                        raise DistributedRunError(_death_message(name, dead, procs[dead].exitcode)
                                                  + f"; rank {rank} then failed with: {msg[2][1]}")
                    _raise_rank_error(name, rank, msg[2])
                continue
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r in done or p.is_alive():
                    continue
                # give a message the rank sent just before exiting time to arrive
                if now - dead_since.setdefault(r, now) > DEATH_GRACE_S:
                    code = p.exitcode
                    _terminate(procs)
                    raise DistributedRunError(_death_message(name, r, code))
            if deadline is not None and now > deadline:
                running = [r for r, p in enumerate(procs) if p.is_alive()]
                _terminate(procs)
                raise DistributedTimeoutError(
                    f"{name} ran for more than timeout={timeout:g} s on {world} processes (ranks still running: "
                    f"{running}); they were stopped. A rank may be stuck in a collective that another rank never "
                    "reached; pass a larger timeout= or timeout=None")
    except BaseException:
        _terminate(procs)
        raise
    finally:
        for p in procs:
            p.join(TERMINATE_GRACE_S)
        _terminate(procs)
        q.close()
        del store
    return result


class DistributedFunction:
    """A function decorated with :func:`distributed`: ``fn(...)`` runs it here, ``fn.distributed(...)`` on N ranks."""

    def __init__(self, func: Callable[..., Any], num_processes: int | None, backend: str | None,
                 timeout: float | None, relay_output: bool = True) -> None:
        _validate(num_processes, timeout)
        self.func = func
        self.num_processes = num_processes
        self.backend = backend
        self.timeout = timeout
        self.relay_output = relay_output
        functools.update_wrapper(self, func)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the original function in this process (no ranks, no process group)."""
        return self.func(*args, **kwargs)

    def distributed(self, *args: Any, **kwargs: Any) -> Any:
        """Run on ``num_processes`` ranks with ``torch.distributed`` initialised; return rank 0's result."""
        import inspect

        try:
            inspect.signature(self.func).bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self.func.__name__}.distributed(): {e}") from None
        return run_distributed(self.func, args, kwargs, num_processes=self.num_processes, backend=self.backend,
                               timeout=self.timeout, relay_output=self.relay_output)

    def with_overrides(self, *, num_processes: Any = _UNSET, backend: Any = _UNSET,
                       timeout: Any = _UNSET) -> "DistributedFunction":
        """A copy with other settings: ``train.with_overrides(num_processes=4).distributed(...)``."""
        return DistributedFunction(self.func, self.num_processes if num_processes is _UNSET else num_processes,
                                   self.backend if backend is _UNSET else backend,
                                   self.timeout if timeout is _UNSET else timeout, self.relay_output)

    def __repr__(self) -> str:
        return (f"DistributedFunction({self.func.__qualname__}, num_processes={self.num_processes}, "
                f"backend={self.backend}, timeout={self.timeout})")


@overload
def distributed(num_processes: Callable[..., Any], *, backend: str | None = None, timeout: float | None = None,
                relay_output: bool = True, gpus: int | None = None,
                gpu_type: str | None = None) -> DistributedFunction: ...
@overload
def distributed(num_processes: int | None = None, *, backend: str | None = None, timeout: float | None = None,
                relay_output: bool = True, gpus: int | None = None,
                gpu_type: str | None = None) -> Callable[[Callable[..., Any]], DistributedFunction]: ...
def distributed(num_processes: int | Callable[..., Any] | None = None, *, backend: str | None = None,
                timeout: float | None = None, relay_output: bool = True, gpus: int | None = None,
                gpu_type: str | None = None,
                ) -> DistributedFunction | Callable[[Callable[..., Any]], DistributedFunction]:
    """Decorator: ``fn.distributed(*args, **kw)`` runs ``fn`` on N local processes, returns rank 0's result.

    Args:
        num_processes: ranks to start (default: one per GPU, else 2).
        backend: ``"nccl"`` or ``"gloo"`` (default: nccl when every rank has a GPU, else gloo).
        timeout: seconds the whole run (process start included) may take before every rank is stopped and
            :class:`DistributedTimeoutError` is raised (default None: no limit).
        relay_output: forward each rank's ``print``/stderr output to the caller, prefixed ``[rank N]``.
        gpus, gpu_type: the Databricks serverless form (``@distributed(gpus=8, gpu_type='H100')``):
            ``gpus`` is the number of ranks, started here; ``gpu_type`` names a serverless GPU kind,
            which cannot be chosen on this machine: a warning says what runs instead.

    Calling ``fn(...)`` directly runs the original function in this process. Rank ``r`` uses GPU
    ``r`` with nccl. A :class:`ucmagic.UCVolumeDataset` built inside the function splits its files
    over the ranks by itself (no DistributedSampler). Use it bare (``@distributed``) or with arguments.
    """
    if callable(num_processes):  # bare @distributed
        return DistributedFunction(num_processes, None, backend, timeout, relay_output)
    num_processes = _serverless_form(num_processes, gpus, gpu_type)
    _validate(num_processes, timeout)

    def decorate(func: Callable[..., Any]) -> DistributedFunction:
        return DistributedFunction(func, num_processes, backend, timeout, relay_output)

    return decorate


__all__ = ["distributed", "DistributedFunction", "DistributedRunError", "DistributedTimeoutError", "run_distributed"]
