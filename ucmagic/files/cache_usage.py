"""Accounting of a cache directory: every byte under it, by kind, and the evictable entries."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .cache_layout import OLD_DATA, SUBDIRS, CacheLayout, file_size, parse_entry_name, parse_tmp_name, scandir


@dataclass
class CacheUsage:
    """What is under a cache directory, in files and bytes (apparent sizes).

    ``files``/``bytes``: complete entries in ``data/``; ``protected_*``: those named by a live
    protection record; ``tmp_*``: fills in progress or abandoned; ``records_*``: protection records;
    ``other_bytes``: anything else (ledger, the node's listings, stray files).
    """

    files: int = 0
    bytes: int = 0
    protected_files: int = 0
    protected_bytes: int = 0
    tmp_files: int = 0
    tmp_bytes: int = 0
    records_files: int = 0
    records_bytes: int = 0
    other_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.bytes + self.tmp_bytes + self.records_bytes + self.other_bytes


def scan(layout: CacheLayout, protected: set[str]) -> tuple[list[tuple[str, int, float]], CacheUsage]:
    """Unprotected entries ``(path, size, mtime)`` and the usage. Temp files count at their final
    size (the name carries it), so a fill in progress already holds its room."""
    free: list[tuple[str, int, float]] = []
    u = CacheUsage()
    # an entry is a directory files/<key>-<size>, counted from the moment it is made (before its file
    # is linked in); its size is in its name and its mtime is its last use, so one directory read and
    # a stat per entry count it
    for de in scandir(layout.entries, dirs=True):
        parsed = parse_entry_name(de.name)
        if parsed is None or not de.is_dir(follow_symlinks=False):
            u.other_bytes += file_size(de)
            continue
        try:
            mtime = de.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            continue
        size = parsed[1]
        u.files += 1
        u.bytes += size
        if de.name in protected:
            u.protected_files += 1
            u.protected_bytes += size
        else:
            free.append((de.path, size, mtime))
    for bucket in scandir(os.path.join(layout.root, OLD_DATA), dirs=True):  # the old layout, until reaped
        for de in scandir(bucket.path) if bucket.is_dir(follow_symlinks=False) else [bucket]:
            u.other_bytes += file_size(de)
    for de in scandir(layout.tmp, dirs=True):
        parsed_tmp = parse_tmp_name(de.name)
        u.tmp_files += 1
        u.tmp_bytes += max(file_size(de), parsed_tmp[1] if parsed_tmp else 0)
    for de in scandir(layout.prot):
        u.records_files += 1
        u.records_bytes += file_size(de)
    for de in scandir(layout.root):
        if de.name not in SUBDIRS:
            u.other_bytes += file_size(de)
    for sub in (layout.locks, os.path.join(layout.root, "listings")):  # lock files, the node's listings
        for de in scandir(sub):
            u.other_bytes += file_size(de)
    return free, u
