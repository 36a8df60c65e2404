"""Helpers of the file cache's tests (test_cache, test_budget_keeper, test_protection_records)."""
import os
import time


def writer(data: bytes, delay: float = 0.0, calls: list | None = None):
    def write(tmp: str) -> int:
        if calls is not None:
            calls.append(1)
        time.sleep(delay)
        with open(tmp, "wb") as f:
            f.write(data)
        return len(data)
    return write


def entry_of(p: str) -> str:
    """The entry directory of a cached file of an opaque key (``files/<key>-<size>/<key><ext>``): its
    name is what protection records hold, its mtime the entry's last use."""
    return os.path.dirname(p)
