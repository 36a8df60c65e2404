"""Samples out of big files: tar shards (WebDataset), token arrays, packed shards, mixing.

See docs/shards.md. Names load on first use.
"""
from __future__ import annotations

from .._util import lazy_exports

_EXPORTS = {
    "Member": "index",
    "ShardInfo": "index",
    "scan_tar": "index",
    "read_index": "index",
    "write_index": "index",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
