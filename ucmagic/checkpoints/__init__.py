"""Checkpoints on a slow volume: ``save_checkpoint`` / ``load_checkpoint`` / ``list_checkpoints`` and the
DCP storage classes ``UCVolumeWriter`` / ``UCVolumeReader``.

Modules: :mod:`.api` (save, load, list, retention), :mod:`.writer` and :mod:`.reader` (the DCP storage
classes), :mod:`.commit` (reading a directory's commit marker and save-in-progress record), :mod:`.exit`
(asynchronous saves pending at interpreter exit), :mod:`.unpickle` (restricted unpickling),
:mod:`.format` (layout names and the commit marker; pure), :mod:`.transfer` (CRC-checked copies).
The names below load on first use, so importing :mod:`ucmagic.checkpoints.format` needs no torch.
"""
from __future__ import annotations

from .._util import lazy_exports

# public name -> submodule that defines (or re-exports) it
_EXPORTS = {
    "save_checkpoint": "api",
    "load_checkpoint": "api",
    "list_checkpoints": "api",
    "resolve_step": "api",
    "UCVolumeWriter": "writer",
    "UCVolumeReader": "reader",
    "CheckpointInfo": "format",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())  # PEP 562: loaded on first use
