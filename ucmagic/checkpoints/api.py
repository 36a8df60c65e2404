"""Checkpoints on volumes: ``save_checkpoint`` / ``load_checkpoint`` / ``list_checkpoints``.

``save_checkpoint(root, model=..., optimizer=..., step=N)`` writes ``root/step_<N>/`` with torch
DCP through :class:`UCVolumeWriter` (every rank writes its shard locally, uploads in parallel, the
coordinator commits), or with one ``torch.save`` file from rank 0 (``single_file=True``, for small
models). ``load_checkpoint`` restores in place and returns ``(step, extra)``; ``"latest"`` is the
highest *committed* step. ``keep=N`` deletes older committed steps once the new one is committed.
"""
from __future__ import annotations

import contextlib
import functools
import os
import pickle
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from .format import (
    COMMIT_NAME,
    FORMAT_SINGLE,
    KIND_DCP,
    KIND_TORCH_SAVE,
    METADATA_NAME,
    SAVING_NAME,
    SINGLE_FILE_NAME,
    CheckpointInfo,
    describe_keys,
    foreign_step,
    is_torch_save_name,
    key_mismatch,
    looks_like_torch_save,
    make_commit,
    parse_step_dirname,
    pick_latest,
    pick_step,
    shape_mismatch,
    sort_infos,
    step_dirname,
    to_delete,
)
from .commit import begin_save, clean_checkpoints, commit_save, read_commit, volume_dir
from .exit import track_pending_save
from .reader import UCVolumeReader
from .unpickle import unsafe_reason
from .writer import UCVolumeWriter
from ..dist import all_gather_ints, barrier, dist_info
from ..errors import (
    CheckpointCorruptError,
    CheckpointCredentialsError,
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
_P = ParamSpec("_P")
_R = TypeVar("_R")
_SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent"


@contextlib.contextmanager
def _quiet() -> Any:
    """Silence exactly torch's "torch.distributed is disabled" UserWarning, in this call only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield



#: A store's "no credentials" error (by class name: the store's package may not be installed) -> how to set them.
_CREDENTIAL_HINTS = {
    "NoCredentialsError": "no AWS credentials were found for S3: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                          "(or AWS_PROFILE, or ~/.aws/credentials), or pass "
                          "storage_options={'key': ..., 'secret': ...}",
    "PartialCredentialsError": "the AWS credentials for S3 are incomplete: set both AWS_ACCESS_KEY_ID and "
                               "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or pass storage_options={'key': ..., "
                               "'secret': ...}",
    "DefaultCredentialsError": "no Google Cloud credentials were found: set GOOGLE_APPLICATION_CREDENTIALS to a "
                               "service-account key file, or pass storage_options={'token': ...}",
}


def _credentials_error(e: BaseException, where: str) -> CheckpointCredentialsError | None:
    """The named one-line error when ``e`` (or its cause, or a rank's failure inside it) is a missing credential."""
    todo: list[Any] = [e]
    seen: set[int] = set()
    while todo:
        x = todo.pop()
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        hint = next((_CREDENTIAL_HINTS[c.__name__] for c in type(x).__mro__ if c.__name__ in _CREDENTIAL_HINTS), None)
        if hint is not None:
            return CheckpointCredentialsError(f"{where}: {hint}")
        todo += [x.__cause__, x.__context__, *(p[0] if isinstance(p, tuple) else p
                                                for p in getattr(x, "failures", {}).values())]
    return None


def _naming_credentials(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` (whose first argument is the root), raising a missing credential as one named line."""
    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            named = _credentials_error(e, str(os.fspath(args[0])) if args else str(kwargs.get("root")))  # type: ignore[call-overload]
            if named is None:
                raise
            raise named from None
    return call


# ---------------------------------------------------------------- listing and retention

def _root(root: str | os.PathLike[str], *, create: bool = False,
          storage_options: dict[str, Any] | None = None) -> str:
    from ..files.volume import missing_path_hint

    from . import transfer as xfer

    path = volume_dir(root)
    if xfer.is_url(path):
        xfer.use_storage_options(path, storage_options)
        if create or xfer.isdir(path):  # an object store has no empty directories: one is made by its files
            return path
        raise SourceNotFoundError(f"checkpoint root {path}: nothing is stored there; check the URL and the "
                                  "credentials (storage_options=), or save a checkpoint there first")
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise CheckpointError(f"checkpoint root {os.fspath(root)} is a file; pass the directory that holds step_<N>/")
    if create:
        xfer.check_destination(path)
    if create and os.path.isdir(os.path.dirname(path)):
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as e:
            raise xfer.destination_error(e, path) from None
        return path
    what = "its parent directory does not exist" if create else "it does not exist"
    raise SourceNotFoundError(f"checkpoint root {os.fspath(root)}: {what}; {missing_path_hint(os.fspath(root))}")


def _foreign_dcp(path: str, name: str) -> CheckpointInfo | None:
    """A DCP directory no ucmagic save touched: complete once ``.metadata`` is there (torch writes it last)."""
    from . import transfer as xfer

    try:
        names = xfer.list_names(path)
        if COMMIT_NAME in names or SAVING_NAME in names or METADATA_NAME not in names:
            return None
        sizes = [xfer.stat_file(os.path.join(path, n))[0] for n in names
                 if not n.startswith(".") or n == METADATA_NAME]
        when = xfer.stat_file(os.path.join(path, METADATA_NAME))[1]
    except OSError:
        return None
    return CheckpointInfo(foreign_step(name), path, when, sum(sizes), KIND_DCP)


def _torch_save_file(path: str, name: str) -> CheckpointInfo | None:
    from . import transfer as xfer

    try:
        head = xfer.read_head(path, 4)
        size, mtime = xfer.stat_file(path)
    except OSError:
        return None
    if not looks_like_torch_save(head):
        return None
    return CheckpointInfo(foreign_step(name), path, mtime, size, KIND_TORCH_SAVE)


def _probe(root: str, name: str) -> CheckpointInfo | None:
    """The complete checkpoint ``root/name`` is, or None (unfinished, killed, not a checkpoint)."""
    from . import transfer as xfer

    path = os.path.join(root, name)
    if xfer.outside_link(root, name) is not None:
        return None  # a link out of the root: another place's data, never loaded through it
    if not xfer.isdir(path):
        return _torch_save_file(path, name) if is_torch_save_name(name) else None
    try:
        c = read_commit(path)
    except CheckpointInProgressError:
        return None
    except (CheckpointError, OSError):
        return _foreign_dcp(path, name)
    step = parse_step_dirname(name)
    if step is None:  # UCVolumeWriter used directly, into a directory named otherwise
        step = c.get("step") if isinstance(c.get("step"), int) else foreign_step(name)
    return CheckpointInfo(step, path, float(c["time"]), int(c["bytes"]), str(c["format"]))


@_naming_credentials
def list_checkpoints(root: str | os.PathLike[str], *,
                     storage_options: dict[str, Any] | None = None) -> list[CheckpointInfo]:
    """Complete checkpoints under ``root`` as ``CheckpointInfo(step, path, time, size, kind)``, oldest first.

    Lists ucmagic's committed ``step_<N>/`` directories, DCP directories other writers made (torch's
    ``FileSystemWriter``, ``databricks.air.data``; ``kind="dcp"``, complete once ``.metadata`` is there)
    and ``torch.save`` files (``.pt``/``.pth``/``.ckpt``; ``kind="torch.save"``). A foreign entry's step is
    the number after a step word in its name (``step_100``, ``epoch=3-step=1000.ckpt``, ``checkpoint-500``,
    ``ckpt_20.pt``, ``global_step200``: :func:`.format.foreign_step`); any other name, a date or a bare
    number included, has step None (listed last, never "latest"). Unfinished,
    killed or failed saves are skipped. ``root`` may be an fsspec URL (``s3://bucket/run/ckpts``;
    ``storage_options`` as for fsspec, else the store's own configuration).
    """
    from . import transfer as xfer

    path = _root(root, storage_options=storage_options)
    names = [n for n in xfer.list_names(path) if not n.startswith(".")]
    if not names:
        return []
    with ThreadPoolExecutor(max_workers=min(16, len(names))) as pool:
        found = [i for i in pool.map(lambda n: _probe(path, n), names) if i is not None]
    return sort_infos(found)


def _delete_checkpoint(path: str) -> None:
    """Un-commit first (so a half-deleted directory is never taken for a checkpoint), then remove."""
    from . import transfer as xfer

    xfer.remove_quietly(os.path.join(path, COMMIT_NAME))
    xfer.remove_tree(path)


def _retain(root: str, keep: int | None, newest: int) -> None:
    if keep is None:
        return
    infos = {i.step: i for i in list_checkpoints(root) if i.kind.startswith("ucmagic") and i.step is not None
             and parse_step_dirname(os.path.basename(i.path)) is not None}  # never a foreign checkpoint
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
def _unwrapping() -> Iterator[None]:
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
                 async_: bool, cancel: Any = None) -> Future[None] | None:
    """Rank 0: torch.save to local staging, upload, commit. Returns a Future when ``async_``."""
    import uuid

    import torch

    from . import transfer as xfer

    save_id = str(uuid.uuid4())
    staging = xfer.make_staging_dir(writer_kw.get("staging_dir"), f"single-{save_id}")
    local = os.path.join(staging, SINGLE_FILE_NAME)
    try:
        torch.save(state, local)
        begin_save(path, save_id)  # readers refuse from here on; an older save of this step is un-committed
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
            commit_save(path, save_id, marker)  # only if no newer save of this step began meanwhile
        finally:
            xfer.release_staging_dir(staging)

    if not async_:
        upload()
        return None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ucmagic-ckpt")
    fut = pool.submit(upload)
    pool.shutdown(wait=False)
    return fut


@_naming_credentials
def save_checkpoint(root: str | os.PathLike[str], *, model: Any, optimizer: Any = None, step: int,
                    extra: dict[str, Any] | None = None, async_: bool = False, keep: int | None = None,
                    single_file: bool = False, **writer_kw: Any) -> str | Future[str]:
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
    root_path = _root(root, create=True, storage_options=writer_kw.get("storage_options"))
    path = os.path.join(root_path, name)
    from . import transfer as xfer

    def finish() -> str:
        if dist_info(from_env=False).rank == 0:
            _retain(root_path, keep, step)
            with contextlib.suppress(OSError, CheckpointError):  # the new checkpoint is committed regardless
                clean_checkpoints(root_path)  # killed saves' directories (their owner here is gone)
        return path

    if single_file:
        state = {"model": model.state_dict()}
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        fut = None
        out: Future[str] = Future()
        pending = track_pending_save(path, out) if async_ else None
        try:
            if dist_info(from_env=False).rank == 0:
                try:
                    xfer.makedirs(path, root=root_path)  # step_<N> is never a link (one planted would be followed)
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
    try:
        xfer.makedirs(path, root=root_path)  # step_<N> is never a link (the writer is given it as its own folder)
    except OSError as e:
        raise xfer.destination_error(e, path) from None
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
            out.set_exception(_credentials_error(e, path) or _unwrap(e))
            return
        _settle(out, finish)

    f.add_done_callback(done)
    return out


def _settle(out: Future[str], fn: Any) -> None:
    try:
        out.set_result(fn())
    except BaseException as e:  # noqa: BLE001
        out.set_exception(e)


# ---------------------------------------------------------------- load

@_naming_credentials
def resolve_step(root: str | os.PathLike[str], step: int | str, *,
                 storage_options: dict[str, Any] | None = None) -> tuple[int, str]:
    """``(step, path)`` of checkpoint ``step`` (an int or ``"latest"``) under ``root``: ucmagic's
    ``step_<N>/``, else a foreign checkpoint whose name carries that step (see :func:`list_checkpoints`)."""
    from . import transfer as xfer

    root_path = _root(root, storage_options=storage_options)
    if step == "latest":
        chosen = pick_latest(list_checkpoints(root_path))
        if chosen is None:
            raise NoCheckpointError(f"no committed checkpoint under {os.fspath(root)} (looked for step_<N>/ "
                                    "with its commit marker, DCP directories with .metadata and torch.save files "
                                    "whose names carry a step); save one first or check the root")
        return chosen.step, chosen.path  # type: ignore[return-value]
    number = pick_step([], step)
    path = os.path.join(root_path, step_dirname(number))  # type: ignore[arg-type]
    outside = xfer.outside_link(root_path, step_dirname(number))  # type: ignore[arg-type]
    if outside is not None:
        raise outside
    if xfer.isdir(path):
        return number, path  # type: ignore[return-value]
    infos = list_checkpoints(root_path)
    same = [i for i in infos if i.step == number]
    if same:
        return number, same[0].path  # type: ignore[return-value]
    have = [i.step for i in infos if i.step is not None]
    raise NoCheckpointError(f"no checkpoint for step {step} under {os.fspath(root)}; committed steps: "
                            f"{have or 'none'}")


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
            raise UnsafeCheckpointError(
                f"{os.path.join(path, SINGLE_FILE_NAME)} holds objects that are not plain tensors and "
                f"containers ({unsafe_reason(exc)}); it was not loaded. Only load checkpoints you wrote yourself"
            ) from None
    finally:
        xfer.release_staging_dir(staging)
    _restore_from_dict(path, state, model, optimizer)


_OPTIM_KEYS = ("optimizer", "optim", "opt")


def _restore_from_dict(path: str, state: Any, model: Any, optimizer: Any) -> None:
    """Load a ``torch.save``-style dict: ``{"model": ..., "optimizer"|"optim"|"opt": ...}``, ``{"state_dict": ...}``
    (PyTorch Lightning) or a bare model state dict."""
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        msd = state["model"]
    elif isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        msd = state["state_dict"]
    elif isinstance(state, dict):
        msd = state
    else:
        raise CheckpointMismatchError(f"{path} holds a {type(state).__name__}, not a state dict; load it with "
                                      "torch.load and restore it yourself")
    own = model.state_dict()
    _check_keys(path, own.keys(), msd.keys())
    _check_shapes(path, {k: tuple(v.shape) for k, v in own.items() if hasattr(v, "shape")},
                  {k: tuple(v.shape) for k, v in msd.items() if hasattr(v, "shape")})
    if optimizer is not None:  # first: torch checks an optimizer state before it changes anything
        okey = next((k for k in _OPTIM_KEYS if msd is not state and isinstance(state.get(k), dict)), None)
        if okey is None:
            raise CheckpointMismatchError(f"{path} holds no optimizer state; load it without optimizer=")
        try:
            optimizer.load_state_dict(state[okey])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointMismatchError(f"{path}: its optimizer state does not fit this optimizer ({e}); load it "
                                          "into the same optimizer and parameter groups it was saved from") from None
    model.load_state_dict(msd)  # keys and shapes checked above


def _check_shapes(path: str, expected: dict[str, tuple[int, ...]], present: dict[str, tuple[int, ...]]) -> None:
    bad = shape_mismatch(expected, present)
    if bad:
        raise CheckpointMismatchError(f"checkpoint {path} does not match the model's shapes ({describe_keys(bad, 3)}); "
                                      "load it into the same architecture (and sizes) it was saved from")


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


@_naming_credentials
def load_checkpoint(root: str | os.PathLike[str], step: int | str = "latest", *, model: Any, optimizer: Any = None,
                    map_location: Any = None, **reader_kw: Any) -> tuple[int, Any]:
    """Restore ``model`` (and ``optimizer``) in place from ``root/step_<step>/``; return ``(step, extra)``.

    ``step="latest"`` picks the highest committed step, skipping unfinished saves. Every rank calls
    this. Raises :class:`SourceNotFoundError` for a missing root, ``NoCheckpointError`` when nothing
    is committed, ``CheckpointNotCommittedError`` for an unfinished step, ``CheckpointCorruptError``
    for a damaged file and ``CheckpointMismatchError`` when the keys differ from the model's.
    """
    from . import transfer as xfer

    chosen, path = resolve_step(root, step, storage_options=reader_kw.get("storage_options"))
    if xfer.isfile(path):  # a torch.save file in the root
        _load_torch_file(path, model, optimizer, map_location, reader_kw)
        return chosen, None
    try:
        commit = read_commit(path)  # raises CheckpointNotCommittedError for an unfinished save
    except CheckpointInProgressError:
        raise
    except CheckpointNotCommittedError:
        if _foreign_dcp(path, os.path.basename(path)) is None:
            raise
        _load_dcp(path, model, optimizer, reader_kw)  # written by torch's FileSystemWriter or another tool
        return chosen, None
    if commit["format"] == FORMAT_SINGLE:
        _load_single(path, commit, model, optimizer, map_location, reader_kw)
    else:
        _load_dcp(path, model, optimizer, reader_kw)
    return int(commit.get("step", chosen)), commit.get("extra")


def _load_torch_file(path: str, model: Any, optimizer: Any, map_location: Any,
                     reader_kw: dict[str, Any] | None = None) -> None:
    from . import transfer as xfer

    if xfer.is_url(path):  # torch.load reads a local file: download it first (and delete it after)
        staging = xfer.make_staging_dir((reader_kw or {}).get("staging_dir"), "torch-file-load")
        try:
            local = os.path.join(staging, os.path.basename(path))
            xfer.download_file(path, local, None, name=os.path.basename(path), where=os.path.dirname(path))
            _load_torch_file(local, model, optimizer, map_location)
        finally:
            xfer.release_staging_dir(staging)
        return
    import torch

    loc = map_location if map_location is not None else _model_device(model)
    try:
        state = torch.load(path, map_location=loc, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path} holds objects that are not plain tensors and containers "
                                    f"({unsafe_reason(exc)}); it was not loaded. Only load checkpoints you trust"
                                    ) from None
    _restore_from_dict(path, state, model, optimizer)


def _load_dcp(path: str, model: Any, optimizer: Any, reader_kw: dict[str, Any]) -> None:
    """Load into a staging copy of the state; apply it to ``model`` (and ``optimizer``) only once every rank
    has read its part whole and verified (a damaged, missing or mismatched file changes nothing)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    reader = UCVolumeReader(path, **reader_kw)
    fresh_optimizer = optimizer is not None and not optimizer.state  # get_state_dict fills in its state
    try:
        ours = _dcp_state(model, optimizer)
        stored = reader.read_metadata().state_dict_metadata
        keys = list(stored)
        nested = any(k.startswith("model.") for k in keys)  # {"model": ..., "optim": ...} as ucmagic and the seed
        prefix = "model." if nested else ""
        _check_keys(path, ours["model"], (k[len(prefix):] for k in keys if k.startswith(prefix)))
        _check_shapes(path, {k: tuple(v.shape) for k, v in ours["model"].items() if hasattr(v, "shape")},
                      {k[len(prefix):]: tuple(getattr(m, "size")) for k, m in stored.items()
                       if k.startswith(prefix) and getattr(m, "size", None) is not None})
        okey = next((k for k in ("optim", "optimizer", "opt") if any(n.startswith(k + ".") for n in keys)), None)
        if optimizer is not None and (okey is None or not nested):
            raise CheckpointMismatchError(f"{path} holds no optimizer state; load it without optimizer=")
        target: dict[str, Any] = ours["model"] if not nested else {"model": ours["model"]}
        if optimizer is not None:
            target[str(okey)] = _stored_params_only(ours["optim"], str(okey), keys)
        staged = _staging_copy(target)
        failure: BaseException | None = None
        try:
            with _unwrapping(), _quiet():
                dcp.load(staged, storage_reader=reader)
        except BaseException as e:  # noqa: BLE001 - raised below, once every rank has given its verdict
            failure = e
        _agree(path, failure)
    except BaseException:
        if fresh_optimizer:
            optimizer.state.clear()  # as it was: the state get_state_dict made for the load is not kept
        raise
    optim_state: dict[str, Any] = {}
    stateless: list[str] = []
    if optimizer is not None:
        optim_state = staged[str(okey)]
        fresh = ours["optim"].get("state", {})
        if isinstance(optim_state.get("state"), dict) and isinstance(fresh, dict):
            # parameters without state in the checkpoint go through torch's set_state_dict with the state
            # get_state_dict made for them (every torch version loads that), and lose it right after
            stateless = [k for k in fresh if k not in optim_state["state"]]
            optim_state["state"] = {**{k: fresh[k] for k in stateless}, **optim_state["state"]}
    set_state_dict(model, [] if optimizer is None else optimizer,
                   model_state_dict=staged["model"] if nested else staged, optim_state_dict=optim_state)
    if stateless:  # as they were saved (and as torch.save keeps them): no state
        params = dict(model.named_parameters())
        for fqn in stateless:
            if fqn in params:
                optimizer.state.pop(params[fqn], None)


def _staging_copy(state: Any) -> Any:
    """``state``'s structure with a fresh tensor in place of each tensor (a plain one in host memory; a DTensor
    keeps its layout): what a load fills in before anything of the model's is touched."""
    import torch

    if isinstance(state, dict):
        return {k: _staging_copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_staging_copy(v) for v in state)
    if type(state) is torch.Tensor:
        return torch.empty_like(state, device="cpu")
    if isinstance(state, torch.Tensor):
        return torch.empty_like(state)
    return state


def _stored_params_only(optim_state: dict[str, Any], key: str, stored: list[str]) -> dict[str, Any]:
    """The optimizer state to read from the checkpoint: a parameter that has none there (it never got a gradient
    before the save) is left out, else torch's load fails with "Missing key in checkpoint state_dict"."""
    state = optim_state.get("state")
    if not isinstance(state, dict):
        return optim_state
    head = f"{key}.state."
    prefixes: set[str] = set()
    for name in stored:
        if name.startswith(head):
            parts = name[len(head):].split(".")
            prefixes.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return {**optim_state, "state": {fqn: v for fqn, v in state.items() if str(fqn) in prefixes}}


def _agree(path: str, failure: BaseException | None) -> None:
    """Every rank's verdict on its staged load: raise on every rank when any rank failed, before any applies."""
    world = dist_info(from_env=False).world
    if world > 1:
        verdicts = all_gather_ints([0 if failure is None else 1], world)
        if failure is None and any(verdicts):
            failed = [r for r, v in enumerate(verdicts) if v]
            raise CheckpointError(f"{path}: rank(s) {failed} could not load this checkpoint (their error says why); "
                                  "nothing was applied on any rank")
    if failure is not None:
        raise failure


