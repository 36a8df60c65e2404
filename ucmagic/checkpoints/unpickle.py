"""Restricted unpickling of what a checkpoint holds: ``.metadata`` with an allow-list of DCP metadata
types, and every non-tensor entry checked with ``torch.load(weights_only=True)`` before torch sees it.
"""
from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner

from .. import _torch_compat as compat
from ..errors import UnsafeCheckpointError

_ALLOWED_GLOBALS = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP ``.metadata`` but refuses any global that is not a DCP metadata type."""

    def find_class(self, module: str, name: str) -> Any:
        if "." not in name:
            if (module, name) in _ALLOWED_GLOBALS or (module, name) in compat.DCP_METADATA_GLOBALS \
                    or module == "torch.distributed.checkpoint.metadata":
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
                return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"checkpoint .metadata refers to {module}.{name}, which is not checkpoint metadata; refusing to "
            "unpickle it (pass allow_unsafe_pickle=True to UCVolumeReader only if you trust this checkpoint)")


def load_metadata(data: bytes, *, allow_unsafe: bool = False) -> Metadata:
    """Unpickle DCP metadata, admitting only metadata classes unless ``allow_unsafe``."""
    if allow_unsafe:
        md: Metadata = pickle.loads(data)  # noqa: S301 - the caller trusts this checkpoint (allow_unsafe_pickle=True)
        return md
    md = _MetadataUnpickler(io.BytesIO(data)).load()
    return md


class WeightsOnlyPlanner:
    """Delegates to a LoadPlanner, but first checks every non-tensor blob with a weights-only load."""

    def __init__(self, inner: LoadPlanner, where: str) -> None:
        self._inner = inner
        self._where = where

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(io.BytesIO(value.getbuffer()), weights_only=True)
        except Exception as e:  # noqa: BLE001 - the weights-only unpickler raises several types
            raise UnsafeCheckpointError(
                f"{self._where}: entry {read_item.dest_index.fqn!r} is a pickled object that "
                f"torch.load(weights_only=True) refuses ({str(e).splitlines()[0]}); pass "
                "allow_unsafe_pickle=True to UCVolumeReader only if you trust this checkpoint") from None
        value.seek(0)
        self._inner.load_bytes(read_item, value)

