"""The old import paths of modules that moved into subpackages: they keep working for one release.

``import ucmagic.magics``, ``from ucmagic.checkpoint import save_checkpoint``,
``mock.patch("ucmagic.widget.x")`` and unpickling a class saved under an old path all get the
module at its new path -- the same module object, so patches, ``isinstance`` and module state
agree -- and a ``DeprecationWarning`` that names the new path. ``ucmagic/__init__`` installs the
finder; it imports nothing until an old path is used, and answers for the names in :data:`MOVED`
only. The old paths go in ucmagic 0.3 (this table, the finder and the test of both with them).
"""
from __future__ import annotations

import importlib
import os
import sys
import warnings
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any, Sequence

REMOVED_IN = "0.3"

#: old module path -> new module path (the same module object is returned for both)
MOVED: dict[str, str] = {
    "ucmagic.checkpoint": "ucmagic.checkpoints.api",
    "ucmagic.checkpoint_storage": "ucmagic.checkpoints.storage",
    "ucmagic.checkpoint_format": "ucmagic.checkpoints.format",
    "ucmagic.checkpoint_transfer": "ucmagic.checkpoints.transfer",
    "ucmagic.sources": "ucmagic.tables.sources",
    "ucmagic.parquet": "ucmagic.tables",
    "ucmagic.parquet_export": "ucmagic.tables.export",
    "ucmagic.parquet_dataset": "ucmagic.tables.parquet_dataset",
    "ucmagic.parquet_rows": "ucmagic.tables.rows",
    "ucmagic.magics": "ucmagic.notebook.magics",
    "ucmagic.widget": "ucmagic.notebook.panel",
    "ucmagic.plots": "ucmagic.notebook.plots",
    "ucmagic.explorer": "ucmagic.notebook.explorer",
    "ucmagic.demo": "ucmagic.testing.demo",
}


_IMPORTLIB_DIR = os.path.dirname(importlib.__file__) + os.sep


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside the import system and this module: the user's import.

    ``warnings`` itself skips importlib's bootstrap frames when it counts, so they are not counted here."""
    frame = sys._getframe(1)  # noqa: SLF001 - the standard way to walk the caller's stack
    level = 1
    while frame.f_back is not None:
        name = frame.f_code.co_filename
        if name != __file__ and not name.startswith(("<frozen importlib", _IMPORTLIB_DIR)):
            break
        frame = frame.f_back
        if not ("importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename):
            level += 1
    return level


class _AliasLoader:
    """Loads an old path as the module at its new path (imported first if needed)."""

    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new
        self._spec: ModuleSpec | None = None

    def create_module(self, spec: ModuleSpec) -> ModuleType:
        warnings.warn(f"{self.old} moved to {self.new}: import {self.new} instead "
                      f"(the old path is removed in ucmagic {REMOVED_IN})", DeprecationWarning,
                      stacklevel=_caller_stacklevel())
        module = importlib.import_module(self.new)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # the import system gave the module the old path's spec; it keeps its own (reload, pickle, -m)
        module.__spec__ = self._spec


class MovedModuleFinder:
    """A ``sys.meta_path`` finder that answers for the old paths in :data:`MOVED` and nothing else."""

    ucmagic_moved_finder = True  # marks an installed instance (install() stays idempotent across reloads)

    @staticmethod
    def find_spec(fullname: str, path: Sequence[str] | None = None, target: Any = None) -> ModuleSpec | None:
        new = MOVED.get(fullname)
        if new is None:
            return None
        return ModuleSpec(fullname, _AliasLoader(fullname, new))  # type: ignore[arg-type]


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (a stale old file left in the package must not win)."""
    if not any(getattr(f, "ucmagic_moved_finder", False) for f in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())
