"""Every use of a private torch API in ucmagic, feature-detected, in one place.

torch's DataLoader and DCP file-system classes expose a few hooks only through underscore names.
Each is looked up here; when a torch release lacks one, the caller gets :class:`TorchVersionError`
naming the feature and the torch version that has it, instead of an ``AttributeError`` deep inside
``dcp.save`` or a worker. Nothing else in ucmagic touches a private torch name. The one private
Python hook ucmagic needs (``threading._register_atexit``, for the checkpoint exit wait) is here too,
for the same reason: one place to look when a release changes it.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.utils.data as tud

from .errors import TorchVersionError

#: The oldest torch release ucmagic is tested with (CI runs the core tests on it).
MIN_TORCH = "2.4.1"


def _missing(feature: str, needs: str) -> TorchVersionError:
    return TorchVersionError(
        f"{feature} needs torch >= {needs}, but torch {torch.__version__} is installed and lacks it; "
        f"upgrade torch (pip install 'torch>={needs}')")


# ---------------------------------------------------------------- DataLoader internals

def _check_loader_hooks() -> None:
    if not isinstance(getattr(tud.DataLoader, "_index_sampler", None), property):
        raise _missing("ucmagic.DataLoader (mid-epoch resume of map-style datasets hooks the index sampler)",
                       MIN_TORCH)


def base_index_sampler(loader: tud.DataLoader[Any]) -> Any:
    """torch's own index sampler of ``loader`` (the one a subclass's override wraps)."""
    _check_loader_hooks()
    return tud.DataLoader._index_sampler.fget(loader)  # type: ignore[attr-defined]  # noqa: SLF001 - this module's job


def is_map_style(loader: tud.DataLoader[Any]) -> bool:
    """True when ``loader`` iterates a map-style dataset (torch's ``_DatasetKind.Map``)."""
    kind = loader.__dict__.get("_dataset_kind")
    if kind is None:
        return not isinstance(loader.dataset, tud.IterableDataset)
    return bool(kind == 0)


def live_iterator(loader: tud.DataLoader[Any]) -> Any:
    """The iterator a ``persistent_workers`` loader keeps between epochs, or None."""
    return loader.__dict__.get("_iterator")


def forget_iterator(loader: tud.DataLoader[Any]) -> None:
    """Make the loader start a fresh iterator (and fresh workers) next epoch."""
    loader.__dict__["_iterator"] = None


_PULLED = ("_sampler_iter", "_reset", "_next_data", "_num_yielded", "_IterableDataset_len_called")


def batch_puller(iterator: Any) -> Callable[[], Any]:
    """``next(iterator)`` of torch's DataLoader iterator, as a function. torch's ``__next__`` opens a
    profiler range around every batch (``record_function``: ~14 us of Python op dispatch even when no
    profiler runs, a sixth of what a warm epoch of small cached files costs ucmagic besides the reads);
    while no profiler runs and no length warning can be due (the batches so far are fewer than the
    ``len()`` an iterable dataset's loader said, where it was asked), this does what that ``__next__``
    does inside the range. Elsewhere (a profiler on,
    an iterator that overrides ``__next__``, a torch without these names) it is ``next(iterator)``."""
    base = getattr(getattr(tud, "dataloader", None), "_BaseDataLoaderIter", None)
    profiling = getattr(getattr(torch._C, "_autograd", None), "_profiler_enabled", None)  # noqa: SLF001 - this module's job
    if (base is None or profiling is None or not isinstance(iterator, base)
            or type(iterator).__next__ is not base.__next__ or not all(hasattr(iterator, a) for a in _PULLED)):
        return iterator.__next__
    it = iterator

    def pull() -> Any:
        said = it._IterableDataset_len_called  # noqa: SLF001 - this module's job
        if (said is not None and it._num_yielded >= said) or profiling():  # noqa: SLF001
            return next(it)  # torch's own: its range, and its warning of a batch past the length it said
        if it._sampler_iter is None:  # noqa: SLF001
            it._reset()  # noqa: SLF001
        data = it._next_data()  # noqa: SLF001
        it._num_yielded += 1  # noqa: SLF001
        return data

    return pull


def pin_memory(data: Any, device: Any = None) -> Any:
    """``data`` with its tensors pinned, as torch's pin-memory thread pins a batch (any nesting)."""
    from torch.utils.data._utils.pin_memory import pin_memory as pin

    return pin(data, device)


def shutdown_workers(iterator: Any) -> None:
    """Stop the worker processes of a multi-process DataLoader iterator (no-op for others)."""
    stop = getattr(iterator, "_shutdown_workers", None)
    if stop is not None:
        stop()


# ---------------------------------------------------------------- torch.distributed.checkpoint internals

#: Globals a DCP ``.metadata`` pickle refers to that are not in ``torch.distributed.checkpoint.metadata``.
DCP_METADATA_GLOBALS = frozenset({("torch.distributed.checkpoint.filesystem", "_StorageInfo")})


def storage_location(storage_data: Any, index: Any) -> tuple[str, int, int]:
    """(relative file name, offset, length) of one item in a DCP file-system checkpoint's storage data."""
    info = storage_data[index]
    try:
        return info.relative_path, int(info.offset), int(info.length)
    except AttributeError:
        raise _missing("reading this checkpoint's storage layout", MIN_TORCH) from None


def storage_entry(info: Any) -> tuple[Any, Any, Any, Any] | None:
    """``(relative_path, offset, length, transform_descriptors)`` of one DCP file-system storage entry exactly as
    ``.metadata`` holds them (nothing coerced: they are checked by the reader), or None when ``info`` is not
    torch's ``_StorageInfo`` (a damaged or hostile ``.metadata``)."""
    from torch.distributed.checkpoint import filesystem as fsmod

    cls = getattr(fsmod, "_StorageInfo", None)
    if cls is None:
        raise _missing("reading this checkpoint's storage layout", MIN_TORCH)
    if not isinstance(info, cls):
        return None
    # a field pickled as None is left out of the pickle (_StorageInfo.__getstate__): missing reads as None
    return tuple(getattr(info, f, None) for f in ("relative_path", "offset", "length", "transform_descriptors"))  # type: ignore[return-value]


def install_filesystem(writer_or_reader: Any, fs: Any) -> None:
    """Route a FileSystemWriter/Reader's file I/O through ``fs`` (a ``FileSystem`` subclass instance)."""
    if not hasattr(writer_or_reader, "fs"):
        raise _missing("UCVolumeWriter/UCVolumeReader (they plug into FileSystemWriter.fs)", MIN_TORCH)
    writer_or_reader.fs = fs


def write_files(writer: Any, planner: Any, file_queue: Any) -> Any:
    """Write the ``(path, file_name, items)`` entries of ``file_queue`` with the writer's threads.

    torch's ``_FileSystemWriter._write_data`` where it exists; on older torch (2.4) the same work is done
    with ``_write_files_from_queue``, the function it wraps. Returns a torch Future of the WriteResults.
    """
    fn = getattr(writer, "_write_data", None)
    if fn is not None:
        return fn(planner, file_queue)
    return _write_files_legacy(writer, planner, file_queue)


def _write_files_legacy(writer: Any, planner: Any, file_queue: Any) -> Any:
    import inspect
    import queue
    import threading

    from torch.distributed.checkpoint import filesystem as fsmod
    from torch.futures import Future

    worker = getattr(fsmod, "_write_files_from_queue", None)
    if worker is None:
        raise _missing("UCVolumeWriter (it writes shards with FileSystemWriter's writer threads)", MIN_TORCH)
    params = inspect.signature(worker).parameters
    result_queue: queue.Queue = queue.Queue()
    kw: dict[str, Any] = {"file_queue": file_queue, "result_queue": result_queue, "planner": planner,
                          "inflight_threshhold": writer.per_thread_copy_ahead, "use_fsync": writer.sync_files,
                          "create_stream": writer.fs.create_stream, "thread_count": writer.thread_count}
    if "transforms" in params:  # releases after 2.4 take the writer's transforms too
        kw["transforms"] = writer.transforms
    unknown = [p for p, v in params.items() if p not in kw and v.default is inspect.Parameter.empty]
    if unknown:
        raise _missing("UCVolumeWriter (FileSystemWriter's writer threads changed)", MIN_TORCH)
    threads = [threading.Thread(target=worker, kwargs=kw) for _ in range(1, writer.thread_count)]
    for t in threads:
        t.start()
    worker(**kw)
    for t in threads:
        t.join()
    res: list[Any] = []
    while True:
        try:
            res += result_queue.get_nowait()
        except queue.Empty:
            break
    fut: Any = Future()
    fut.set_result(res)
    return fut


def set_up_writer_kwargs(method: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of ``set_up_storage_writer``/``reader`` that this torch's method accepts."""
    import inspect

    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}


# ---------------------------------------------------------------- torch.distributed quirks

def destroy_waits_holding_gil() -> bool:
    """Whether ``destroy_process_group`` holds the GIL while it waits for gloo's threads (torch < 2.8; 2.8 releases
    it), so that a thread of gloo's waiting for the GIL to free a collective's tensors hangs it."""
    from torch.torch_version import TorchVersion

    return TorchVersion(torch.__version__) < "2.8"


# ---------------------------------------------------------------- Python internals

def register_early_exit_hook(fn: Callable[[], None]) -> None:
    """Run ``fn`` at exit before non-daemon threads are joined and before concurrent.futures shuts down.

    ``threading._register_atexit`` is the only hook that runs that early (the checkpoint exit wait
    needs the thread pools still working); where it is missing or the interpreter is already
    shutting down, ``atexit`` still runs ``fn`` (the thread pools may then refuse the uploads).
    """
    import atexit
    import threading

    early = getattr(threading, "_register_atexit", None)
    if early is not None:
        try:
            early(fn)
            return
        except RuntimeError:  # the interpreter is already shutting down
            pass
    atexit.register(fn)
