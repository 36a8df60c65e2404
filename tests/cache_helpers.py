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


def record_name(p: str) -> str:
    """What protection records hold for the cached file ``p`` of an opaque key (``files/k/<key>-<size><ext>``)."""
    return "k/" + os.path.basename(p)


def used_at(p: str, t: float) -> None:
    """Make ``t`` the last use of the cached file ``p`` (its atime; its mtime is its version stamp)."""
    os.utime(p, ns=(int(t * 1e9), os.stat(p).st_mtime_ns))
