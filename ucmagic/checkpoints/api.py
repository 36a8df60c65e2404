"""Checkpoints on volumes: ``save_checkpoint`` / ``load_checkpoint`` / ``list_checkpoints``.

``save_checkpoint(root, model=..., optimizer=..., step=N)`` writes ``root/step_<N>/`` with torch
DCP through :class:`UCVolumeWriter` (every rank writes its shard locally, uploads in parallel, the
coordinator commits), or with one ``torch.save`` file from rank 0 (``single_file=True``, for small
models). ``load_checkpoint`` restores in place and returns ``(step, extra)``; ``"latest"`` is the
highest *committed* step. ``keep=N`` deletes older committed steps once the new one is committed.
"""
from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .format import (
    COMMIT_NAME,
    FORMAT_SINGLE,
    SAVING_NAME,
    SINGLE_FILE_NAME,
    CheckpointInfo,
    describe_keys,
    key_mismatch,
    make_commit,
    make_saving_record,
    parse_step_dirname,
    pick_step,
    step_dirname,
    to_delete,
)
from .storage import (
    UCVolumeReader,
    UCVolumeWriter,
    read_commit,
    track_pending_save,
    volume_dir,
)
from ..dist import barrier, dist_info
from ..errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointExistsError,
    CheckpointInProgressError,
    CheckpointMismatchError,
    CheckpointNotCommittedError,
    CheckpointUploadError,
    NoCheckpointError,
    SourceNotFoundError,
    UCMagicError,
    UnsafeCheckpointError,
)

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointExistsError",
    "CheckpointInProgressError",
    "CheckpointInfo",
    "CheckpointMismatchError",
    "CheckpointNotCommittedError",
    "CheckpointUploadError",
    "NoCheckpointError",
    "UCVolumeReader",
    "UCVolumeWriter",
    "UnsafeCheckpointError",
    "list_checkpoints",
    "load_checkpoint",
    "save_checkpoint",
]

# torch's DCP warns on every single-process save/load; ucmagic's own calls are single-process on purpose
_SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent"


@contextlib.contextmanager
def _quiet() -> Any:
    """Silence exactly torch's "torch.distributed is disabled" UserWarning, in this call only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield



# ---------------------------------------------------------------- listing and retention

def _root(root: str | os.PathLike, *, create: bool = False) -> str:
    from ..volume import missing_path_hint

    path = volume_dir(root)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise CheckpointError(f"checkpoint root {os.fspath(root)} is a file; pass the directory that holds step_<N>/")
    if create:
        from . import transfer as xfer

        xfer.check_destination(path)
    if create and os.path.isdir(os.path.dirname(path)):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise xfer.destination_error(e, path) from None
        return path
    what = "its parent directory does not exist" if create else "it does not exist"
    raise SourceNotFoundError(f"checkpoint root {os.fspath(root)}: {what}; {missing_path_hint(os.fspath(root))}")


def _committed(root: str, names: list[str]) -> list[CheckpointInfo]:
    def probe(name: str) -> CheckpointInfo | None:
        path = os.path.join(root, name)
        try:
            c = read_commit(path)
        except (CheckpointError, OSError):
            return None
        return CheckpointInfo(parse_step_dirname(name), path, float(c["time"]), int(c["bytes"]))  # type: ignore[arg-type]

    if not names:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        found = [i for i in pool.map(probe, names) if i is not None]
    return sorted(found, key=lambda i: i.step)


def list_checkpoints(root: str | os.PathLike) -> list[CheckpointInfo]:
    """Committed checkpoints under ``root`` as ``CheckpointInfo(step, path, time, size)``, oldest step first.

    Directories whose save did not finish (no valid commit marker) are skipped.
    """
    path = _root(root)
    names = [n for n in os.listdir(path) if parse_step_dirname(n) is not None and os.path.isdir(os.path.join(path, n))]
    return _committed(path, names)


def _delete_checkpoint(path: str) -> None:
    """Un-commit first (so a half-deleted directory is never taken for a checkpoint), then remove."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, COMMIT_NAME))
    shutil.rmtree(path, ignore_errors=True)


def _retain(root: str, keep: int | None, newest: int) -> None:
    if keep is None:
        return
    infos = {i.step: i for i in list_checkpoints(root)}
    for step in to_delete(infos, keep, newest):
        try:
            _delete_checkpoint(infos[step].path)
        except OSError as e:  # the new checkpoint is committed; a failed clean-up must not fail the save
            warnings.warn(f"could not delete old checkpoint {infos[step].path}: {e}", stacklevel=2)


# ---------------------------------------------------------------- state dicts

def _dcp_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
    )

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def _unwrap(e: BaseException) -> BaseException:
    """The ucmagic error (or Ctrl-C) inside torch's CheckpointException, if there is one."""
    for pair in getattr(e, "failures", {}).values():
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, (UCMagicError, KeyboardInterrupt)):
            return inner
    return e


@contextlib.contextmanager
def _unwrapping():
    """Re-raise torch's CheckpointException as the ucmagic error it carries, if any."""
    try:
        yield
    except BaseException as e:
        inner = _unwrap(e)
        if inner is e:
            raise
        raise inner from None


def _model_device(model: Any) -> Any:
    import torch

    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")


# ---------------------------------------------------------------- save

def _save_single(path: str, state: dict[str, Any], info: dict[str, Any], writer_kw: dict[str, Any],
                 async_: bool, cancel: Any = None) -> Future | None:
    """Rank 0: torch.save to local staging, upload, commit. Returns a Future when ``async_``."""
    import socket
    import uuid

    import torch

    from . import transfer as xfer

    save_id = str(uuid.uuid4())
    staging = xfer.make_staging_dir(writer_kw.get("staging_dir"), f"single-{save_id}")
    local = os.path.join(staging, SINGLE_FILE_NAME)
    try:
        torch.save(state, local)
        record = make_saving_record(save_id=save_id, host=socket.gethostname(), pid=os.getpid())
        xfer.write_bytes(os.path.join(path, SAVING_NAME), record)  # readers refuse from here on
        xfer.remove_quietly(os.path.join(path, COMMIT_NAME))  # un-commit an older save of this step
    except BaseException as e:
        xfer.release_staging_dir(staging)
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            raise xfer.destination_error(e, path) from None
        raise

    def check() -> None:
        if cancel is not None and cancel.is_set():
            raise CheckpointError("the checkpoint save was cancelled (Ctrl-C)")

    def upload() -> None:
        try:
            rec = xfer.upload_file(local, os.path.join(path, SINGLE_FILE_NAME), verify=writer_kw.get("verify", "size"),
                                   check=check)
            check()
            marker = make_commit(kind=FORMAT_SINGLE, save_id=save_id, files={SINGLE_FILE_NAME: rec}, info=info)
            xfer.write_bytes(os.path.join(path, COMMIT_NAME), marker)
            xfer.remove_quietly(os.path.join(path, SAVING_NAME))
        finally:
            xfer.release_staging_dir(staging)

    if not async_:
        upload()
        return None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucmagic-ckpt")
    fut = pool.submit(upload)
    pool.shutdown(wait=False)
    return fut


def save_checkpoint(root: str | os.PathLike, *, model: Any, optimizer: Any = None, step: int,
                    extra: dict[str, Any] | None = None, async_: bool = False, keep: int | None = None,
                    single_file: bool = False, **writer_kw: Any) -> str | Future:
    """Save ``model`` (and ``optimizer``) to ``root/step_<step>/`` and commit it; every rank calls this.

    ``extra`` is a JSON-able dict (e.g. ``{"loader": loader.state_dict()}``) returned by
    :func:`load_checkpoint`. ``async_=True`` returns a ``concurrent.futures.Future`` as soon as the
    state is copied; it resolves to the checkpoint path once the checkpoint is durable, committed
    and retention has run, and raises upload errors. ``keep=N`` keeps the N highest committed steps.
    ``single_file=True``: rank 0 writes one ``torch.save`` file (small models). Other keyword
    arguments go to :class:`UCVolumeWriter`. Returns the checkpoint directory (or the Future).
    """
    name = step_dirname(step)
    to_delete([], keep, step)  # validates keep before anything is written
    info = {"step": step, "extra": extra}
    make_commit(kind=FORMAT_SINGLE, save_id="", files={}, info=info)  # validates extra is JSON-able
    root_path = _root(root, create=True)
    path = os.path.join(root_path, name)
    from . import transfer as xfer

    def finish() -> str:
        if dist_info(from_env=False).rank == 0:
            _retain(root_path, keep, step)
        return path

    if single_file:
        state = {"model": model.state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        fut = None
        out: Future = Future()
        pending = track_pending_save(path, out) if async_ else None
        try:
            if dist_info(from_env=False).rank == 0:
                try:
                    os.makedirs(path, exist_ok=True)
                except OSError as e:
                    raise xfer.destination_error(e, path) from None
                fut = _save_single(path, state, info, writer_kw, async_, pending.cancel if pending else None)
        except BaseException as e:
            out.set_exception(e)  # nothing is pending at exit
            raise
        if not async_:
            barrier()
            return finish()
        if fut is None:
            out.set_result(path)
            return out
        fut.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else _settle(out, finish))
        return out

    import torch.distributed.checkpoint as dcp

    state = _dcp_state(model, optimizer)
    writer = UCVolumeWriter(path, commit_info=info, **{"warn_overwrite": False, **writer_kw})
    if not async_:
        with _unwrapping(), _quiet():
            dcp.save(state, storage_writer=writer)
        return finish()
    with _unwrapping(), _quiet():
        # a concurrent Future (AsyncSaveResponse only with async_stager options, which are never passed)
        f: Any = dcp.async_save(state, storage_writer=writer)
        deadline = time.monotonic() + 60  # torch warns from its save thread: stay quiet until it is past that
        while not f.done() and not writer.wait_started(0.05) and time.monotonic() < deadline:
            pass
    out = Future()
    track_pending_save(path, out)

    def done(f: Any) -> None:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            out.set_exception(_unwrap(e))
            return
        _settle(out, finish)

    f.add_done_callback(done)
    return out


def _settle(out: Future, fn: Any) -> None:
    try:
        out.set_result(fn())
    except BaseException as e:  # noqa: BLE001
        out.set_exception(e)


# ---------------------------------------------------------------- load

def resolve_step(root: str | os.PathLike, step: int | str) -> tuple[int, str]:
    """``(step, directory)`` of the committed checkpoint ``step`` (an int or ``"latest"``) under ``root``."""
    root_path = _root(root)
    if step == "latest":
        infos = list_checkpoints(root_path)
        chosen = pick_step([i.step for i in infos], step)
        if chosen is None:
            raise NoCheckpointError(f"no committed checkpoint under {os.fspath(root)} (looked for step_<N>/ "
                                    f"with {COMMIT_NAME}); save one first or check the root")
        return chosen, os.path.join(root_path, step_dirname(chosen))
    chosen = pick_step([], step)
    path = os.path.join(root_path, step_dirname(chosen))  # type: ignore[arg-type]
    if not os.path.isdir(path):
        have = [i.step for i in list_checkpoints(root_path)]
        raise NoCheckpointError(f"no checkpoint for step {step} under {os.fspath(root)}; committed steps: "
                                f"{have or 'none'}")
    return chosen, path  # type: ignore[return-value]


def _load_single(path: str, commit: dict[str, Any], model: Any, optimizer: Any, map_location: Any,
                 kw: dict[str, Any]) -> None:
    import torch

    from . import transfer as xfer

    staging = xfer.make_staging_dir(kw.get("staging_dir"), f"single-load-{commit['save_id']}")
    local = os.path.join(staging, SINGLE_FILE_NAME)
    try:
        xfer.download_file(os.path.join(path, SINGLE_FILE_NAME), local, commit["files"].get(SINGLE_FILE_NAME),
                           name=SINGLE_FILE_NAME, where=path)
        loc = map_location if map_location is not None else _model_device(model)
        try:
            state = torch.load(local, map_location=loc, weights_only=True)
        except pickle.UnpicklingError as exc:  # weights_only refused a global: code, not weights
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UnsafeCheckpointError(
                f"{os.path.join(path, SINGLE_FILE_NAME)} holds objects that are not plain tensors and "
                f"containers ({first}); it was not loaded. Only load checkpoints you wrote yourself"
            ) from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    _check_keys(path, model.state_dict().keys(), state["model"].keys())
    model.load_state_dict(state["model"])
    if optimizer is not None:
        if "optimizer" not in state:
            raise CheckpointMismatchError(f"{path} holds no optimizer state; load it without optimizer=")
        optimizer.load_state_dict(state["optimizer"])


def _check_keys(path: str, expected: Any, present: Any) -> None:
    missing, unexpected = key_mismatch(expected, present)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing in the checkpoint: {describe_keys(missing)}")
        if unexpected:
            parts.append(f"not in the model: {describe_keys(unexpected)}")
        raise CheckpointMismatchError(f"checkpoint {path} does not match the model ({'; '.join(parts)}); "
                                      "load it into the same architecture it was saved from")


def load_checkpoint(root: str | os.PathLike, step: int | str = "latest", *, model: Any, optimizer: Any = None,
                    map_location: Any = None, **reader_kw: Any) -> tuple[int, Any]:
    """Restore ``model`` (and ``optimizer``) in place from ``root/step_<step>/``; return ``(step, extra)``.

    ``step="latest"`` picks the highest committed step, skipping unfinished saves. Every rank calls
    this. Raises :class:`SourceNotFoundError` for a missing root, ``NoCheckpointError`` when nothing
    is committed, ``CheckpointNotCommittedError`` for an unfinished step, ``CheckpointCorruptError``
    for a damaged file and ``CheckpointMismatchError`` when the keys differ from the model's.
    """
    chosen, path = resolve_step(root, step)
    commit = read_commit(path)  # raises CheckpointNotCommittedError for an unfinished save
    if commit["format"] == FORMAT_SINGLE:
        _load_single(path, commit, model, optimizer, map_location, reader_kw)
    else:
        _load_dcp(path, model, optimizer, reader_kw)
    return int(commit.get("step", chosen)), commit.get("extra")


def _load_dcp(path: str, model: Any, optimizer: Any, reader_kw: dict[str, Any]) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    reader = UCVolumeReader(path, **reader_kw)
    state = _dcp_state(model, optimizer)
    keys = list(reader.read_metadata().state_dict_metadata)
    _check_keys(path, state["model"], (k[len("model."):] for k in keys if k.startswith("model.")))
    if optimizer is not None and not any(k.startswith("optim.") for k in keys):
        raise CheckpointMismatchError(f"{path} holds no optimizer state; load it without optimizer=")
    with _unwrapping(), _quiet():
        dcp.load(state, storage_reader=reader)
    set_state_dict(model, [] if optimizer is None else optimizer, model_state_dict=state["model"],
                   optim_state_dict=state.get("optim", {}))


