"""The torch side shared by save and load: the state dict DCP saves, the device a model lives on, and the
unwrapping of the errors DCP wraps (so the caller sees ucmagic's own)."""
from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

from ..errors import UCMagicError


# torch's DCP warns on every single-process save/load; ucmagic's own calls are single-process on purpose
_SINGLE_PROCESS_WARNING = r"torch\.distributed is (disabled, )?unavailable or uninitialized, assuming the intent"


@contextlib.contextmanager
def quiet_dcp() -> Any:
    """Silence exactly torch's "torch.distributed is disabled" UserWarning, in this call only."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS_WARNING, category=UserWarning)
        yield


# ---------------------------------------------------------------- state dicts

def dcp_state(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
    )

    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def unwrap_error(e: BaseException) -> BaseException:
    """The ucmagic error (or Ctrl-C) inside torch's CheckpointException, if there is one."""
    for pair in getattr(e, "failures", {}).values():
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, (UCMagicError, KeyboardInterrupt)):
            return inner
    return e


@contextlib.contextmanager
def unwrapping() -> Iterator[None]:
    """Re-raise torch's CheckpointException as the ucmagic error it carries, if any."""
    try:
        yield
    except BaseException as e:
        inner = unwrap_error(e)
        if inner is e:
            raise
        raise inner from None


def model_device(model: Any) -> Any:
    import torch

    for t in list(model.parameters()) + list(model.buffers()):
        return t.device
    return torch.device("cpu")
