"""The steps under a checkpoint root: list them (committed or not, ucmagic's or torch's own), pick one, keep the
newest N; and the one translation of a store's missing-credentials error into what to set."""
from __future__ import annotations

import functools
import os
import stat
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar

from .._util import is_remote_url
from .format import (COMMIT_NAME, KIND_DCP, KIND_TORCH_SAVE, METADATA_NAME, SAVING_NAME, ZIP_TAIL, CheckpointInfo,
                     foreign_step, is_torch_save_name, looks_like_torch_save, parse_step_dirname, pick_latest,
                     pick_step, sort_infos, step_dirname, to_delete, torn_torch_save)
from .commit import read_commit, volume_dir
from ..errors import (CheckpointCredentialsError, CheckpointError, CheckpointInProgressError, NoCheckpointError,
                      SourceNotFoundError)


_P = ParamSpec("_P")
_R = TypeVar("_R")


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


def credentials_error(e: BaseException, where: str) -> CheckpointCredentialsError | None:
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


def naming_credentials(fn: Callable[_P, _R]) -> Callable[_P, _R]:
    """``fn`` (whose first argument is the root), raising a missing credential as one named line."""
    @functools.wraps(fn)
    def call(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return fn(*args, **kwargs)
        except BaseException as e:
            named = credentials_error(e, str(os.fspath(args[0])) if args else str(kwargs.get("root")))  # type: ignore[call-overload]
            if named is None:
                raise
            raise named from None
    return call


# ---------------------------------------------------------------- listing and retention

def checkpoint_root(root: str | os.PathLike[str], *, create: bool = False,
                    storage_options: dict[str, Any] | None = None, allow_shared: bool = False) -> str:
    """The checkpoint root ``root`` names (local, ``/Volumes/...`` resolved, or a URL). ``create`` (a save):
    made where missing, and a local root another user owns or may write to, or below a folder another user
    may write to, is refused by name (:class:`~ucmagic.errors.UnsafeDirectoryError`: they could swap a step
    folder for a link to theirs while the save writes) unless ``allow_shared``; on a network mount the
    service decides who writes."""
    from ..files.locks import check_write_dest
    from ..files.volume import missing_path_hint

    from . import transfer as xfer

    path = volume_dir(root)
    if is_remote_url(path):
        xfer.use_storage_options(path, storage_options)
        if create or xfer.isdir(path):  # an object store has no empty directories: one is made by its files
            return path
        raise SourceNotFoundError(f"checkpoint root {path}: nothing is stored there; check the URL and the "
                                  "credentials (storage_options=), or save a checkpoint there first")
    try:
        is_dir: bool | None = stat.S_ISDIR(os.stat(path).st_mode)  # one look: ranks make the root at once
    except OSError:
        is_dir = None
    if is_dir:
        if create:
            xfer.check_destination(path)  # a read-only or unwritable root says so first
            check_write_dest(path, allow_shared=allow_shared, what="checkpoint root")
        return path
    if is_dir is False:
        raise CheckpointError(f"checkpoint root {os.fspath(root)} is a file; pass the directory that holds step_<N>/")
    if create:
        xfer.check_destination(path)
    if create and os.path.isdir(os.path.dirname(path)):
        try:
            os.makedirs(path, mode=0o755, exist_ok=True)
        except OSError as e:
            raise xfer.destination_error(e, path) from None
        check_write_dest(path, allow_shared=allow_shared, what="checkpoint root")
        return path
    what = "its parent directory does not exist" if create else "it does not exist"
    raise SourceNotFoundError(f"checkpoint root {os.fspath(root)}: {what}; {missing_path_hint(os.fspath(root))}")


def foreign_dcp(path: str, name: str) -> CheckpointInfo | None:
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
    """A ``torch.save`` file (Lightning's ``epoch=4-step=200.ckpt``...) as a checkpoint, checked before it can
    be chosen: one cut short (its zip directory missing) is left out with a warning naming it, never "latest"."""
    from . import transfer as xfer

    try:
        head = xfer.read_head(path, 4)
        size, mtime = xfer.stat_file(path)
        torn = looks_like_torch_save(head) and torn_torch_save(head, xfer.read_tail(path, ZIP_TAIL))
    except OSError:
        return None
    if not looks_like_torch_save(head):
        return None
    if torn:
        warnings.warn(f"ucmagic: {path} is not a complete torch.save file (the end of its zip archive is missing: "
                      "a save that was killed or ran out of space); it is left out of the checkpoints and never "
                      "'latest'. Save it again, or remove it", stacklevel=2)
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
        return foreign_dcp(path, name)
    step = parse_step_dirname(name)
    if step is None:  # UCVolumeWriter used directly, into a directory named otherwise
        step = c.get("step") if isinstance(c.get("step"), int) else foreign_step(name)
    return CheckpointInfo(step, path, float(c["time"]), int(c["bytes"]), str(c["format"]))


@naming_credentials
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

    path = checkpoint_root(root, storage_options=storage_options)
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


def retain(root: str, keep: int | None, newest: int) -> None:
    if keep is None:
        return
    infos = {i.step: i for i in list_checkpoints(root) if i.kind.startswith("ucmagic") and i.step is not None
             and parse_step_dirname(os.path.basename(i.path)) is not None}  # never a foreign checkpoint
    for step in to_delete(infos, keep, newest):
        try:
            _delete_checkpoint(infos[step].path)
        except OSError as e:  # the new checkpoint is committed; a failed clean-up must not fail the save
            warnings.warn(f"could not delete old checkpoint {infos[step].path}: {e}", stacklevel=2)


@naming_credentials
def resolve_step(root: str | os.PathLike[str], step: int | str, *,
                 storage_options: dict[str, Any] | None = None) -> tuple[int, str]:
    """``(step, path)`` of checkpoint ``step`` (an int or ``"latest"``) under ``root``: ucmagic's
    ``step_<N>/``, else a foreign checkpoint whose name carries that step (see :func:`list_checkpoints`)."""
    from . import transfer as xfer

    root_path = checkpoint_root(root, storage_options=storage_options)
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
    same = pick_latest(infos, number)
    if same is not None:
        return number, same.path  # type: ignore[return-value]
    have = [i.step for i in infos if i.step is not None]
    raise NoCheckpointError(f"no checkpoint for step {step} under {os.fspath(root)}; committed steps: "
                            f"{have or 'none'}")
