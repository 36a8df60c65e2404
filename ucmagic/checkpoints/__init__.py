"""Checkpoints on a slow volume: ``save_checkpoint`` / ``load_checkpoint`` / ``list_checkpoints`` and the
DCP storage classes ``UCVolumeWriter`` / ``UCVolumeReader``.

Modules: :mod:`.api` (save, load, list, retention), :mod:`.storage` (the DCP writer and reader),
:mod:`.format` (layout names and the commit marker; pure), :mod:`.transfer` (CRC-checked copies).
The names below load on first use, so importing :mod:`ucmagic.checkpoints.format` needs no torch.
"""
from __future__ import annotations

import importlib
from typing import Any

# public name -> submodule that defines (or re-exports) it
_EXPORTS = {
    "save_checkpoint": "api",
    "load_checkpoint": "api",
    "list_checkpoints": "api",
    "resolve_step": "api",
    "UCVolumeWriter": "storage",
    "UCVolumeReader": "storage",
    "CheckpointInfo": "format",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
