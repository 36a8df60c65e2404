"""Samples out of big files: tar shards (WebDataset, ``ucmagic.pack``), token arrays, mixing.

Modules: :mod:`.index` (the shard index format, tar header scans), :mod:`.chunks` (the ranged
chunk cache), :mod:`.samples` (map-style :class:`ShardDataset` and the planned
:class:`SampleStream`), :mod:`.shuffle` (the bounded-cache shuffle and its quality figures),
:mod:`.webdataset` (:class:`TarShards`), :mod:`.tokens` (:class:`TokenWindows`), :mod:`.mix`
(:func:`mix`). See docs/shards.md. Names load on first use.
"""
from __future__ import annotations

from .._util import lazy_exports

_EXPORTS = {
    "Member": "index",
    "MemberColumns": "index",
    "ShardInfo": "index",
    "scan_tar": "index",
    "read_index": "index",
    "write_index": "index",
    "ChunkReader": "chunks",
    "ChunkedFile": "chunks",
    "ShardDataset": "samples",
    "SampleStream": "samples",
    "TarShards": "webdataset",
    "TokenWindows": "tokens",
    "Mix": "mix",
    "mix": "mix",
    "distinct_files": "shuffle",
    "file_spread": "shuffle",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
