"""Accounting of a cache directory: every byte under it, by kind, and the evictable entries."""
from __future__ import annotations

import os
from dataclasses import dataclass

from .cache_layout import (OLD_DATA, SUBDIRS, CacheLayout, file_size, is_entry_top, parse_old_entry, parse_tmp_name,
                           scandir)


@dataclass
class CacheUsage:
    """What is under a cache directory, in files and bytes (apparent sizes).

    ``files``/``bytes``: complete entries in ``files/``; ``protected_*``: those named by a live
    protection record; ``tmp_*``: fills in progress or abandoned (``tmp_bytes`` at their final size,
    ``tmp_written`` what they have written so far, allocated: it changes while any fill copies);
    ``records_*``: protection records; ``other_bytes``: anything else (ledger, the node's listings, stray files).
    """

    files: int = 0
    bytes: int = 0
    protected_files: int = 0
    protected_bytes: int = 0
    tmp_files: int = 0
    tmp_bytes: int = 0
    tmp_written: int = 0
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
    # an entry is a file under files/<space>/ (or files/k/), counted once it is linked there (a
    # budgeted fill's temp file holds its room until then); its atime is its last use
    for top in scandir(layout.entries, dirs=True):
        if not top.is_dir(follow_symlinks=False):
            u.other_bytes += file_size(top)
            continue
        old = parse_old_entry(top.name)
        if old is not None:  # the previous layout, until reaped
            u.other_bytes += old[1]
            continue
        if not is_entry_top(top.name):
            continue
        head = top.name.partition("~")[0]
        stack = [(top.path, head)]
        while stack:
            folder, name = stack.pop()
            for de in scandir(folder, dirs=True):
                sub = name + "/" + de.name
                if de.is_dir(follow_symlinks=False):
                    stack.append((de.path, sub))
                    continue
                try:
                    st = de.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                u.files += 1
                u.bytes += st.st_size
                if sub in protected:
                    u.protected_files += 1
                    u.protected_bytes += st.st_size
                else:
                    free.append((de.path, st.st_size, st.st_atime))
    for bucket in scandir(os.path.join(layout.root, OLD_DATA), dirs=True):  # the old layout, until reaped
        for de in scandir(bucket.path) if bucket.is_dir(follow_symlinks=False) else [bucket]:
            u.other_bytes += file_size(de)
    for de in scandir(layout.tmp, dirs=True):
        parsed_tmp = parse_tmp_name(de.name)
        u.tmp_files += 1
        try:
            tst = de.stat(follow_symlinks=False) if de.is_file(follow_symlinks=False) else None
        except FileNotFoundError:
            tst = None
        u.tmp_bytes += max(tst.st_size if tst else 0, parsed_tmp[1] if parsed_tmp else 0)
        u.tmp_written += tst.st_blocks * 512 if tst else 0
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
