"""Which shard dataset a directory holds, for ``ucmagic.load`` / ``%ucload`` (``kind=`` / ``--kind`` overrides)."""
from __future__ import annotations

import os
from typing import Any

from ..errors import LoadUsageError
from ..files.volume import resolve_local_path
from .index import FORMAT, INDEX_NAME

KINDS = ("files", "shards", "tokens")


def shard_kind(source: str) -> str | None:
    """``"shards"`` for a local directory with a ucmagic ``index.json`` or whose files are all ``.tar``;
    None otherwise (URLs are not probed: pass ``kind="shards"``)."""
    real = resolve_local_path(source)
    if not os.path.isdir(real):
        return None
    index = os.path.join(real, INDEX_NAME)
    if os.path.isfile(index):
        try:
            with open(index, "rb") as f:  # the head names the format; a big index is not read whole
                if f'"{FORMAT}"'.encode() in f.read(4096):
                    return "shards"
        except OSError:
            pass
    names = [n for n in os.listdir(real) if not n.startswith((".", "_"))]
    files = [n for n in names if os.path.isfile(os.path.join(real, n))]
    if files and len(files) == len(names) and all(n.endswith(".tar") for n in files):
        return "shards"
    return None


def check_kind(kind: str | None) -> str | None:
    if kind is not None and kind not in KINDS:
        raise LoadUsageError(f"kind=/--kind must be one of {', '.join(KINDS)}, got {kind!r}")
    return kind


def open_shards(source: str, kind: str, *, pattern: str | None = None, shuffle: bool = False, seed: int = 0,
                cache_dir: str | None = None, cache_limit: Any = None, block_size: int | None = None,
                dtype: Any = "uint16") -> Any:
    """The :class:`~ucmagic.shards.samples.SampleStream` ``ucmagic.load`` wraps for a shard directory."""
    if kind == "tokens":
        from .tokens import TokenWindows

        if not block_size:
            raise LoadUsageError("kind='tokens' needs block_size= (tokens per window), e.g. block_size=1024")
        ds: Any = TokenWindows(source, block_size=int(block_size), dtype=dtype, pattern=pattern,
                               cache_dir=cache_dir, cache_limit=cache_limit)
    else:
        from .webdataset import TarShards

        ds = TarShards(source, pattern=pattern, cache_dir=cache_dir, cache_limit=cache_limit)
    return ds.stream(shuffle=shuffle, seed=seed)
