"""The report of ``python -m ucmagic cache info|prune|clear``: what a cache directory holds, and
its maintenance."""
from __future__ import annotations

import os

from ..units import format_size, parse_size
from .cache import FileCache
from .cache_layout import cache_root


def cache_command(action: str, root: str | None = None, *, limit: int | str | None = None) -> str:
    """``info``, ``prune`` or ``clear`` on a whole cache directory (``python -m ucmagic cache``); returns a report.
    A directory that does not exist is reported as such, never created (a mistyped ``--cache-dir``)."""
    if action not in ("info", "prune", "clear"):
        raise ValueError(f"unknown cache action {action!r}: use info, prune or clear")
    where = cache_root(root)
    if not os.path.isdir(where):
        return f"{where}: no cache directory here (nothing to {'report' if action == 'info' else action})"
    cache = FileCache(root)
    if action == "info":
        u = cache.usage()
        return (f"{cache.root}: {format_size(u.total_bytes)} in all\n"
                f"  entries            {u.files} files, {format_size(u.bytes)}\n"
                f"  protected now      {u.protected_files} files, {format_size(u.protected_bytes)}\n"
                f"  protection records {u.records_files} files, {format_size(u.records_bytes)}\n"
                f"  temp files         {u.tmp_files} files, {format_size(u.tmp_bytes)}\n"
                f"  other              {format_size(u.other_bytes)}")
    if action == "prune":
        with cache.eviction_lock():
            r = cache.reap()
        freed = 0
        if limit is not None:
            freed = cache.evict(keep_below=parse_size(limit))
        return (f"{cache.root}: dropped {r['records']} protection record(s) of exited processes, "
                f"{r['tmp']} abandoned temp file(s), {r['old']} old-layout entries, evicted {format_size(freed)}")
    if action == "clear":
        r = cache.clear()
        return (f"{cache.root}: removed {r['entries']} entries, {r['records']} protection record(s), "
                f"{r['tmp']} temp file(s) and {r['indexes']} row index(es); entries protected by running loops stay")
    raise ValueError(f"unknown cache action {action!r}: use info, prune or clear")


