"""Local path resolution: ``/Volumes/<catalog>/<schema>/<volume>/...`` to a real directory (mounted on Databricks,
mapped under ``$UCMAGIC_CATALOG_ROOT`` elsewhere), and the hint for a missing one."""
from __future__ import annotations

import os
import stat

from ..errors import SourceNotFoundError


def _volume_parts(p: str) -> tuple[str, str, str, list[str]] | None:
    """(catalog, schema, volume, rest) of an absolute ``/Volumes/<catalog>/<schema>/<volume>/...`` path."""
    parts = p.split(os.sep)
    if len(parts) >= 5 and parts[0] == "" and parts[1] == "Volumes" and all(parts[2:5]):
        return parts[2], parts[3], parts[4], parts[5:]
    return None


def _catalog_volume_dir(catalog: str, schema: str, volume: str) -> str | None:
    root = os.environ.get("UCMAGIC_CATALOG_ROOT")
    return os.path.join(os.path.abspath(os.path.expanduser(root)), catalog, schema, "volumes", volume) if root else None


def resolve_local_path(path: str) -> str:
    """Map ``/Volumes/<catalog>/<schema>/<volume>/...`` to a real path, leniently (never raises).

    The path itself wins when it or its volume exists (on Databricks ``/Volumes`` is a FUSE mount);
    otherwise it resolves under ``$UCMAGIC_CATALOG_ROOT/<catalog>/<schema>/volumes/<volume>/...``
    when that variable is set. Other paths are returned absolute and user-expanded.
    """
    p = os.path.abspath(os.path.expanduser(path))
    vol = _volume_parts(p)
    if vol is None or os.path.exists(p) or os.path.isdir(os.sep.join(p.split(os.sep)[:5])):
        return p
    mapped = _catalog_volume_dir(*vol[:3])
    return os.path.join(mapped, *vol[3]) if mapped else p


def local_path(path: str | os.PathLike[str]) -> str:
    """The real local path of ``path``, for code that opens files itself (``torch.save``, Hugging Face).

    ``/Volumes/<catalog>/<schema>/<volume>/...`` is returned unchanged where the volume is mounted
    (Databricks); elsewhere it maps under ``$UCMAGIC_CATALOG_ROOT/<catalog>/<schema>/volumes/<volume>/``.
    The file itself need not exist (glob patterns work too), but its volume must:
    :class:`SourceNotFoundError` says which directory is missing and what to set. Other paths come
    back absolute and user-expanded::

        torch.save(state, ucmagic.local_path("/Volumes/main/default/ckpt/model.pt"))
    """
    given = os.fspath(path)
    vol = _volume_parts(os.path.abspath(os.path.expanduser(given)))
    if vol is not None:
        catalog, schema, volume, _ = vol
        mapped = _catalog_volume_dir(catalog, schema, volume)
        if not os.path.isdir(f"/Volumes/{catalog}/{schema}/{volume}") and not (mapped and os.path.isdir(mapped)):
            raise SourceNotFoundError(f"{given}: volume not found; {missing_path_hint(given)}")
    return resolve_local_path(given)


def missing_path_hint(path: str) -> str:
    """What to do about a missing ``path``: for ``/Volumes/...``, which directory was looked for and why."""
    vol = _volume_parts(os.path.abspath(os.path.expanduser(path)))
    if vol is None:
        return "check the path"
    catalog, schema, volume, _ = vol
    mapped = _catalog_volume_dir(catalog, schema, volume)
    if mapped is None:
        return (f"/Volumes/{catalog}/{schema}/{volume} is not mounted here (outside Databricks); set "
                "UCMAGIC_CATALOG_ROOT to a local directory that holds <catalog>/<schema>/volumes/<volume>/")
    if not os.path.isdir(mapped):
        return (f"UCMAGIC_CATALOG_ROOT is set, but the volume directory {mapped} does not exist: create it "
                f"(mkdir -p {mapped}) or check the catalog, schema and volume names")
    return f"the volume maps to {mapped}, which exists; check the rest of the path"


def existing_local(path: str) -> tuple[str, bool]:
    """:func:`resolve_local_path` and whether it is a directory, from one look: a directory swapped for another
    meanwhile (an overwrite renames the old one away, then the new one in) reads as there or missing, never as a
    file. :class:`SourceNotFoundError` naming ``path`` and the fix where nothing is there."""
    real = resolve_local_path(path)
    try:
        mode = os.stat(real).st_mode
    except (OSError, ValueError):
        raise SourceNotFoundError(f"{path} does not exist: {missing_path_hint(path)}") from None
    return real, stat.S_ISDIR(mode)
