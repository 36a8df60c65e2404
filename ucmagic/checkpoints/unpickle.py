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
from .._util import is_integer
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
    problem = metadata_problem(md)
    if problem is not None:
        raise CheckpointCorruptError(f"checkpoint .metadata {problem}; the checkpoint is damaged or was not "
                                     "written by a DCP writer: save it again or load another step")
    return md


def _dims(value: Any) -> tuple[int, ...] | None:
    """``value`` as a shape (a ``torch.Size`` or tuple of non-negative ints), else None."""
    if not isinstance(value, tuple) or not all(is_integer(d) and d >= 0 for d in value):
        return None
    return tuple(int(d) for d in value)


def metadata_problem(md: Metadata) -> str | None:
    """What is wrong with the structure of unpickled DCP metadata (None: nothing): the state dict's metadata
    maps names to tensor or bytes entries, each tensor's shape and chunks are non-negative and every chunk
    lies inside its tensor; the storage entries are a mapping (their paths and byte ranges are the reader's to
    check against the files: :func:`ucmagic.checkpoints.format.storage_problem`)."""
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                       TensorStorageMetadata)

    sdm = getattr(md, "state_dict_metadata", None)
    if not isinstance(sdm, dict):
        return "has no state dict metadata"
    for fqn, m in sdm.items():
        if not isinstance(fqn, str):
            return f"has a state dict key {fqn!r} that is not a string"
        if isinstance(m, BytesStorageMetadata):
            continue
        if not isinstance(m, TensorStorageMetadata):
            return f"describes {fqn!r} as a {type(m).__name__}"
        size = _dims(m.size)
        props = getattr(m, "properties", None)
        if size is None or not isinstance(getattr(props, "dtype", None), torch.dtype):
            return f"gives {fqn!r} the shape {m.size!r} or dtype {getattr(props, 'dtype', None)!r}"
        if not isinstance(m.chunks, list):
            return f"gives {fqn!r} no list of chunks"
        for c in m.chunks:
            offsets, sizes = (_dims(getattr(c, "offsets", None)), _dims(getattr(c, "sizes", None))) \
                if isinstance(c, ChunkStorageMetadata) else (None, None)
            if offsets is None or sizes is None or not len(offsets) == len(sizes) == len(size) \
                    or any(o + n > d for o, n, d in zip(offsets, sizes, size)):
                return f"gives {fqn!r} (shape {tuple(size)}) a chunk outside it ({c!r})"
    if not isinstance(getattr(md, "storage_data", None), dict):
        return "has no storage entries"
    return None


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

