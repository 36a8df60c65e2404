"""Volumes: resolve a path or URL, list its files with size and mtime, copy one file out; the backend registry.

A volume is a storage backend: a local or mounted directory (``/Volumes/...`` on Databricks, NFS, a
FUSE mount) or an fsspec URL (``s3://``, ``memory://``...). Datasets and staging only read from it;
checkpoints and exports write through its atomic write side (:meth:`Volume.write_bytes`...).

This module is the registry (:func:`open_volume`, :func:`register_volume`, :func:`unregister_volume`) and the
one import point for the volume names, which live by concern in :mod:`.entries` (listing entries, patterns,
fingerprints), :mod:`.local_paths` (``/Volumes`` resolution), :mod:`.volume_base` (the :class:`Volume` contract),
:mod:`.volume_local` and :mod:`.volume_fsspec` (the two built-in backends).
"""
from __future__ import annotations

import builtins
import os
import re
from typing import Any, Callable, Union

from .._util import is_remote_url
from ..errors import InvalidArgumentError, SourceNotFoundError
from .entries import (DirScan, FileEntry, compile_pattern, filter_entries, fingerprint_rows, is_safe_rel,
                      listing_fingerprint)
from .local_paths import existing_local, local_path, missing_path_hint, resolve_local_path
from .volume_base import Volume, check_unchanged, copy_error
from .volume_fsspec import FsspecVolume, info_mtime
from .volume_local import FAST_DIR_S, FAST_ENTRY_S, LocalVolume

__all__ = [
    "FAST_DIR_S", "FAST_ENTRY_S", "DirScan", "FileEntry", "FsspecVolume", "LocalVolume", "Volume", "VolumeMatch",
    "check_unchanged", "compile_pattern", "copy_error", "existing_local", "filter_entries", "fingerprint_rows",
    "info_mtime", "is_safe_rel", "listing_fingerprint", "local_path", "missing_path_hint", "open_volume",
    "register_volume", "resolve_local_path", "unregister_volume", "volume_class",
]


def open_volume(path: Any, storage_options: dict[str, Any] | None = None) -> Volume:
    """Resolve ``path`` (directory, ``/Volumes/...`` path, ``file://`` or any fsspec URL) to a Volume.

    Raises :class:`SourceNotFoundError` for a missing path and :class:`SourceNotADirectoryError` when
    ``path`` is a file.
    """
    if isinstance(path, Volume):
        return path
    path = os.fspath(path)
    if isinstance(path, str) and not path.strip():  # "" would be the current directory, all of it
        raise InvalidArgumentError(f"path is empty ({path!r}): give a directory, a /Volumes/... path or a URL "
                                   "(for the current directory, say '.')")
    return volume_class(path).from_path(path, storage_options)


# ---------------------------------------------------------------- the backend registry

VolumeMatch = Union[str, Callable[[str], bool]]
_backends: builtins.list[tuple[VolumeMatch, Callable[[str], bool], type[Volume]]] = []  # latest first


def register_volume(scheme_or_predicate: VolumeMatch, cls: type[Volume]) -> None:
    """Make :func:`open_volume` (and so datasets, staging, tables and checkpoints) build ``cls`` for some paths.

    ``scheme_or_predicate`` is a URL scheme (``"az"`` matches ``az://...``) or a predicate on the path
    string. The latest registration that matches wins, so a scheme registered later overrides the
    built-ins (local paths and ``file://``: :class:`LocalVolume`; any other URL: :class:`FsspecVolume`);
    registering the same scheme again replaces its class. ``cls.from_path(path, storage_options)``
    builds the volume. Register where ``cls`` is defined: a worker process that unpickles a volume
    imports that module, and so has the registration too. See docs/backends.md.
    """
    if not (isinstance(cls, type) and issubclass(cls, Volume)):
        raise TypeError(f"register_volume needs a Volume subclass, got {cls!r}")
    if isinstance(scheme_or_predicate, str):
        scheme = scheme_or_predicate.lower().rstrip(":/")
        if not re.fullmatch(r"[a-z][a-z0-9+.\-]*", scheme):
            raise ValueError(f"{scheme_or_predicate!r} is not a URL scheme (letters, digits, '+', '.', '-')")
        prefix = scheme + "://"
        matches: Callable[[str], bool] = lambda path: path[:len(prefix)].lower() == prefix  # noqa: E731
        key: VolumeMatch = scheme
    elif callable(scheme_or_predicate):
        matches, key = scheme_or_predicate, scheme_or_predicate
    else:
        raise TypeError(f"register_volume needs a URL scheme or a predicate, got {scheme_or_predicate!r}")
    _backends[:] = [b for b in _backends if b[0] != key]
    _backends.insert(0, (key, matches, cls))


def unregister_volume(scheme_or_predicate: VolumeMatch) -> bool:
    """Undo :func:`register_volume` for this scheme (or this very predicate object); paths it matched go to
    the next registration that matches them again (the built-ins in the end). False when it was not registered."""
    key: VolumeMatch = (scheme_or_predicate.lower().rstrip(":/") if isinstance(scheme_or_predicate, str)
                        else scheme_or_predicate)
    kept = [b for b in _backends if b[0] != key]
    removed = len(kept) != len(_backends)
    _backends[:] = kept
    return removed


def volume_class(path: str) -> type[Volume]:
    """The registered backend class for ``path`` (the latest registration that matches)."""
    for _, matches, cls in _backends:
        if matches(path):
            return cls
    raise SourceNotFoundError(f"no volume backend handles {path!r}: register one with ucmagic.register_volume")


def _is_local_path(path: str) -> bool:
    return not is_remote_url(path)


# The two built-ins; later registrations (a scheme such as ``slow``, ``az``) take precedence.
register_volume(_is_local_path, LocalVolume)
register_volume(is_remote_url, FsspecVolume)
