"""Restricted unpickling of what a checkpoint holds: ``.metadata`` with an allow-list of DCP metadata
types, and every non-tensor entry checked with ``torch.load(weights_only=True)`` before torch sees it.
"""
from __future__ import annotations

import enum
import importlib
import io
import pickle
import re
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadPlanner

from .. import _torch_compat as compat
from ..errors import CheckpointCorruptError, UnsafeCheckpointError

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
#: The DCP metadata classes a ``.metadata`` pickle builds (torch 2.4 to 2.13), and the older home of two of them.
_METADATA_CLASSES = frozenset({
    *((_DCP_METADATA, n) for n in ("Metadata", "MetadataIndex", "StorageMeta", "ChunkStorageMetadata",
                                    "TensorProperties", "TensorStorageMetadata", "BytesStorageMetadata",
                                    "_MEM_FORMAT_ENCODING")),
    ("torch.distributed._shard.sharded_tensor.metadata", "TensorProperties"),
    ("torch.distributed._shard.sharded_tensor.metadata", "MEM_FORMAT_ENCODING"),
    *compat.DCP_METADATA_GLOBALS,
})
#: What those classes hold besides plain data: sizes, layouts, the checkpoint id (a path), containers.
_HELPER_GLOBALS = frozenset({
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path"),
    ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
})


def _resolve(module: str, name: str) -> Any:
    """The allowed global ``module.name``, or None when it is not allowed (or this torch lacks it)."""
    if (module, name) in _METADATA_CLASSES or (module, name) in _HELPER_GLOBALS:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            return None
    found = vars(torch).get(name) if module == "torch" else None  # vars: no lazy import of a torch submodule
    return found if isinstance(found, (torch.dtype, torch.layout, torch.memory_format)) else None


def _buildable() -> frozenset[type]:
    """The classes whose fresh instances BUILD may fill in: the metadata classes, never an enum or a class."""
    out = set()
    for module, name in _METADATA_CLASSES:
        cls = _resolve(module, name)
        if isinstance(cls, type) and not issubclass(cls, enum.Enum):
            out.add(cls)
    return frozenset(out)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def unsafe_reason(exc: BaseException) -> str:
    """The one line of a refused weights-only load that says what was refused (``... GLOBAL posix.system ...``),
    without the terminal colour codes torch puts in its messages."""
    lines = [ln.strip() for ln in _ANSI.sub("", str(exc)).splitlines() if ln.strip()]
    named = [ln for ln in lines if "global" in ln.lower() or "unsupported" in ln.lower()]
    return (named or lines or [type(exc).__name__])[0]


def _refused(what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint .metadata {what}, which is not checkpoint metadata; refusing to unpickle it (pass "
        "allow_unsafe_pickle=True to UCVolumeReader only if you trust this checkpoint)")


class _MetadataUnpickler(pickle._Unpickler):  # noqa: SLF001 - the Python unpickler: its BUILD can be checked
    """Unpickles DCP ``.metadata``, admitting only the named metadata classes and what they hold.

    A global is one of those classes (by module and name, never a whole module's namespace), a torch
    dtype/layout/memory format, or a few builtins and ``torch.Size``; BUILD (``__setstate__`` or an
    attribute update) applies only to an instance of a metadata class, never to a class, an enum member
    or a module, so nothing outside the objects this pickle creates can change.
    """

    dispatch: ClassVar[dict[int, Any]] = dict(pickle._Unpickler.dispatch)  # noqa: SLF001 - its opcode table
    _BUILDABLE: frozenset[type] | None = None
    stack: list[Any]  # the Python unpickler's value stack

    def find_class(self, module: str, name: str) -> Any:
        found = _resolve(module, name) if isinstance(module, str) and isinstance(name, str) else None
        if found is None:
            raise _refused(f"refers to {module}.{name}")
        return found

    def load_build(self) -> None:
        if _MetadataUnpickler._BUILDABLE is None:
            _MetadataUnpickler._BUILDABLE = _buildable()
        target = self.stack[-2] if len(self.stack) >= 2 else None
        if type(target) not in _MetadataUnpickler._BUILDABLE:
            raise _refused(f"sets the state of a {type(target).__name__}")
        state = self.stack[-1]
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict) \
                and any(not isinstance(k, str) or k.startswith("__") for k in state[1]):
            raise _refused("sets special attributes")
        super().load_build()  # type: ignore[misc]

    dispatch[pickle.BUILD[0]] = load_build


def load_metadata(data: bytes, *, allow_unsafe: bool = False) -> Metadata:
    """Unpickle DCP metadata, admitting only metadata classes unless ``allow_unsafe``."""
    if allow_unsafe:
        md: Metadata = pickle.loads(data)  # noqa: S301 - the caller trusts this checkpoint (allow_unsafe_pickle=True)
        return md
    try:
        md = _MetadataUnpickler(io.BytesIO(data)).load()
    except (UnsafeCheckpointError, pickle.UnpicklingError, EOFError):
        raise
    except Exception as e:  # noqa: BLE001 - a malformed pickle fails in many ways: one type for the callers
        raise pickle.UnpicklingError(f"{type(e).__name__}: {e}") from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"checkpoint .metadata holds a {type(md).__name__}, not DCP metadata; the "
                                     "checkpoint is damaged: save it again")
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
                f"torch.load(weights_only=True) refuses ({unsafe_reason(e)}); pass "
                "allow_unsafe_pickle=True to UCVolumeReader only if you trust this checkpoint") from None
        value.seek(0)
        self._inner.load_bytes(read_item, value)

