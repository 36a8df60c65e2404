"""Where the calling process sits in a run, and the two collectives ucmagic needs.

The one home of rank/world lookups: :func:`dist_info` (rank, world size, local rank and world
size, DataLoader worker id and count), :func:`worker_info`, :func:`local_world_size`, :func:`barrier`,
:func:`all_gather_ints` and :func:`settle`. torch is imported when a function runs, so importing this module is
light.
"""
from __future__ import annotations

import os
import time
import types
from collections import deque
from functools import lru_cache
from typing import Any, Callable, NamedTuple, Protocol

__all__ = ["DistInfo", "dist_info", "worker_info", "local_world_size", "barrier", "settle", "all_gather_ints"]


class DistInfo(NamedTuple):
    """The calling process's place in the run (all 0/1 in a plain single process)."""

    rank: int
    world: int
    local_rank: int
    local_world: int
    worker: int       # DataLoader worker id (0 in the main process)
    num_workers: int  # DataLoader workers of this iteration (1 in the main process)


class WorkerView(Protocol):
    """What ucmagic reads of ``torch.utils.data.get_worker_info()``."""

    @property
    def id(self) -> int: ...

    @property
    def num_workers(self) -> int: ...


def _group() -> types.ModuleType | None:
    """``torch.distributed`` when a process group is initialised, else None."""
    import torch

    d = torch.distributed
    return d if d.is_available() and d.is_initialized() else None


def local_world_size(world: int) -> int:
    """Processes per node: ``LOCAL_WORLD_SIZE`` (torchrun sets it), else ``world`` (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world)) or world


def worker_info() -> WorkerView | None:
    """``torch.utils.data.get_worker_info()`` (None in the main process or without torch); the
    import is resolved once, not per call (it is asked for every fetched file)."""
    return _worker_info_fn()()


@lru_cache(maxsize=None)
def _worker_info_fn() -> Callable[[], WorkerView | None]:
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover
        return lambda: None
    return get_worker_info


def dist_info(*, from_env: bool = True) -> DistInfo:
    """Rank, world size, local rank/world size and DataLoader worker of the calling process.

    Rank and world size come from an initialised ``torch.distributed`` group, else (with
    ``from_env``) from the ``RANK``/``WORLD_SIZE`` variables torchrun sets, which DataLoader
    workers inherit. ``from_env=False`` reports what collectives see: rank 0 of 1 without a group.
    """
    rank, world = 0, 1
    group = _group()
    if group is not None:
        rank, world = group.get_rank(), group.get_world_size()
    elif from_env and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ["WORLD_SIZE"])
    lws = local_world_size(world)
    local_rank = int(os.environ.get("LOCAL_RANK", rank % max(1, lws)))
    info = worker_info()
    return DistInfo(rank, world, local_rank, lws, info.id if info else 0, info.num_workers if info else 1)


def barrier() -> None:
    """Wait for every rank (a no-op without an initialised process group).

    A gather of one held tensor, then :func:`settle`, not torch's barrier: torch's gloo barrier keeps a record of
    the collectives still running when it starts, freed later on gloo's own thread, which can hang a
    ``destroy_process_group`` right after on torch < 2.8 (see ``_HELD``).
    """
    group = _group()
    if group is not None:
        device = _collective_device(str(group.get_backend()))
        if device is None:
            group.barrier()
            return
        import torch

        _gather(group, torch.zeros(1, dtype=torch.int64, device=device), group.get_world_size())
    settle()


def settle() -> None:
    """Let torch's gloo threads free what finished collectives left, before the caller goes on (torch < 2.8).

    Those threads free a collective's tensors after its waiter has gone on, and each free needs the GIL; on torch
    before 2.8 ``destroy_process_group`` holds the GIL while it waits for those threads, so a destroy right after
    torch's own collectives (DCP's) hangs now and then (on 2.4.1, 2 loops of 3 of 40 ``dcp.save``, barrier,
    destroy hung; torch 2.8 fixed it). Called after DCP's collectives, this releases the GIL for 20 ms so that
    the frees run first; it narrows the window, it cannot close it. A no-op without gloo, without a group, or on
    torch >= 2.8.
    """
    group = _group()
    if group is None or group.get_world_size() <= 1 or "gloo" not in str(group.get_backend()):
        return
    from ._torch_compat import destroy_waits_holding_gil

    if destroy_waits_holding_gil():
        time.sleep(_SETTLE_S)


_SETTLE_S = 0.02


def all_gather_ints(mine: list[int], world: int) -> list[int]:
    """Every rank's ``mine``, concatenated in rank order (``mine`` itself when ``world`` is 1).

    Every rank must call it; the lists may differ in length. Raises RuntimeError when ``world > 1`` but no
    process group is initialised.
    """
    if world <= 1:
        return [int(x) for x in mine]
    group = _group()
    if group is None:
        raise RuntimeError(f"gathering every rank's progress on world_size={world} needs torch.distributed "
                           "initialised: call it on every rank after init_process_group")
    device = _collective_device(str(group.get_backend()))
    if device is None:  # a backend whose tensors' device is not known here: torch's object gather
        out: list[Any] = [None] * world
        group.all_gather_object(out, [int(x) for x in mine])
        return [int(x) for per_rank in out for x in per_rank]
    import torch

    lengths = [row[0] for row in _gather(group, torch.tensor([len(mine)], dtype=torch.int64, device=device), world)]
    width = max(lengths)
    padded = torch.tensor([int(x) for x in mine] + [0] * (width - len(mine)), dtype=torch.int64, device=device)
    rows = _gather(group, padded, world)
    return [int(x) for n, row in zip(lengths, rows) for x in row[:n]]


def _collective_device(backend: str) -> str | None:
    """Where a collective's tensors live for ``backend`` (None: unknown, use torch's object collectives)."""
    if backend == "gloo" or "cpu:" in backend:
        return "cpu"
    if backend == "nccl":
        import torch

        return f"cuda:{torch.cuda.current_device()}"
    return None


# The recent gathers' work objects with their tensors, held by Python so that Python, on the thread that gathered,
# drops a gather's last reference. Otherwise torch's gloo frees a finished gather on its own worker thread, and
# with it the tensors' Python objects: that thread then takes the GIL, making itself a Python thread state on the
# way. Two hangs followed from that: `destroy_process_group` holding the GIL while it joins that thread (torch
# before 2.8: CI's load, barrier, destroy test on 2.4.1, 1 run in 40-120), and a DataLoader worker forked while
# that thread held the interpreter's lock on its thread states (Python 3.11 before the fix of CPython's
# gh-112275; the seed gather runs just before the workers fork): the worker deadlocked before running any Python
# (the exactly-once matrix: 1 cell in ~100 under load; a gather-then-fork loop: 4 children of 2,000).
# gloo lets go of a work object once it has run, but its thread may be descheduled before it does (a loop of
# gathers beside two busy processes outran it by 8 gathers): a work object goes once it is _HELD_S old and
# _HELD_MIN newer ones are held; at most _HELD_MAX are kept.
_HELD: deque[tuple[float, Any, list[Any]]] = deque()
_HELD_S, _HELD_MIN, _HELD_MAX = 5.0, 8, 256


def _gather(group: Any, tensor: Any, world: int) -> list[list[int]]:
    """``tensor`` of every rank, in rank order, as lists of ints; the work and its tensors are held (``_HELD``)."""
    import torch

    outs = [torch.empty_like(tensor) for _ in range(world)]
    work = group.all_gather(outs, tensor, async_op=True)
    work.wait()
    now = time.monotonic()
    _HELD.append((now, work, [tensor, *outs]))
    while len(_HELD) > _HELD_MAX or (len(_HELD) > _HELD_MIN and now - _HELD[0][0] > _HELD_S):
        _HELD.popleft()
    return [[int(x) for x in t.tolist()] for t in outs]
