"""Loading one committed checkpoint into a model (and optimizer): a ``torch.save`` file or a DCP directory, with
the shape and key checks that name what does not match."""
from __future__ import annotations

import os
import pickle
from typing import Any

from .._util import error_line, is_remote_url
from .format import SINGLE_FILE_NAME, describe_keys, key_mismatch, shape_mismatch
from .reader import UCVolumeReader
from .unpickle import unsafe_reason
from ..dist import all_gather_ints, dist_info, settle
from ..errors import (CheckpointCorruptError, CheckpointError, CheckpointMismatchError, UCMagicError,
                      UnsafeCheckpointError)
from .torch_state import dcp_state, model_device, quiet_dcp, unwrapping


def load_single(path: str, commit: dict[str, Any], model: Any, optimizer: Any, map_location: Any,
                 kw: dict[str, Any]) -> None:
    import torch

    from . import transfer as xfer

    staging = xfer.make_staging_dir(kw.get("staging_dir"), f"single-load-{commit['save_id']}")
    local = os.path.join(staging, SINGLE_FILE_NAME)
    try:
        xfer.download_file(os.path.join(path, SINGLE_FILE_NAME), local, commit["files"].get(SINGLE_FILE_NAME),
                           name=SINGLE_FILE_NAME, where=path)
        loc = map_location if map_location is not None else model_device(model)
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


def load_torch_file(path: str, model: Any, optimizer: Any, map_location: Any,
                     reader_kw: dict[str, Any] | None = None) -> None:
    from . import transfer as xfer

    if is_remote_url(path):  # torch.load reads a local file: download it first (and delete it after)
        staging = xfer.make_staging_dir((reader_kw or {}).get("staging_dir"), "torch-file-load")
        try:
            local = os.path.join(staging, os.path.basename(path))
            xfer.download_file(path, local, None, name=os.path.basename(path), where=os.path.dirname(path))
            load_torch_file(local, model, optimizer, map_location)
        finally:
            xfer.release_staging_dir(staging)
        return
    import torch

    loc = map_location if map_location is not None else model_device(model)
    try:
        state = torch.load(path, map_location=loc, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpointError(f"{path} holds objects that are not plain tensors and containers "
                                    f"({unsafe_reason(exc)}); it was not loaded. Only load checkpoints you trust"
                                    ) from None
    except (RuntimeError, EOFError) as exc:  # torch's zip reader on a file cut short ("PytorchStreamReader ...")
        if isinstance(exc, RuntimeError) and "PytorchStreamReader" not in str(exc) and "zip" not in str(exc):
            raise
        raise CheckpointCorruptError(f"{path} is not a complete torch.save file ({error_line(exc)}): a save that "
                                     "was killed or ran out of space; nothing was loaded. Load another checkpoint or "
                                     "save it again") from None
    _restore_from_dict(path, state, model, optimizer)


def load_dcp(path: str, model: Any, optimizer: Any, reader_kw: dict[str, Any]) -> None:
    """Load into a staging copy of the state; apply it to ``model`` (and ``optimizer``) only once every rank
    has read its part whole and verified (a damaged, missing or mismatched file changes nothing)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    reader = UCVolumeReader(path, **reader_kw)
    fresh_optimizer = optimizer is not None and not optimizer.state  # get_state_dict fills in its state
    try:
        ours = dcp_state(model, optimizer)
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
            with unwrapping(), quiet_dcp():
                dcp.load(staged, storage_reader=reader)
        except BaseException as e:  # noqa: BLE001 - raised below, once every rank has given its verdict
            failure = _named(path, e)
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
    try:  # the optimizer first: torch refuses a state that does not fit it before changing anything
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, optim_state_dict=optim_state)
        set_model_state_dict(model, staged["model"] if nested else staged)  # keys and shapes checked above
    except Exception as e:
        if fresh_optimizer:
            optimizer.state.clear()
        raise _named(path, e) from e
    if stateless:  # as they were saved (and as torch.save keeps them): no state
        params = dict(model.named_parameters())
        for fqn in stateless:
            if fqn in params:
                optimizer.state.pop(params[fqn], None)


def _named(path: str, exc: BaseException) -> BaseException:
    """A load's failure as a ucmagic error: torch's own (its planner or reader refusing what ``.metadata`` says,
    a tensor that does not fit) becomes :class:`CheckpointCorruptError` naming it, its traceback kept as the
    cause; ucmagic's errors and Ctrl-C pass through."""
    if isinstance(exc, (UCMagicError, KeyboardInterrupt, SystemExit, GeneratorExit)):
        return exc  # (torch's CheckpointException is a BaseException: it is named below)
    named = CheckpointCorruptError(f"{path} cannot be loaded: {error_line(exc)}; the checkpoint is damaged, or was "
                                   "not saved from this model and optimizer: save it again or load another step")
    named.__cause__ = exc
    return named


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
        settle()  # DCP's collectives of this load are freed before it returns (torch < 2.8)
        if failure is None and any(verdicts):
            failed = [r for r, v in enumerate(verdicts) if v]
            raise CheckpointError(f"{path}: rank(s) {failed} could not load this checkpoint (their error says why); "
                                  "nothing was applied on any rank")
    if failure is not None:
        raise failure
