"""Shared by the benchmarks: run one contender in a child process while a thread samples it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from typing import Callable


def run_sampled(cmd: list[str], env: dict[str, str], mode: str, sample: Callable[[int], int],
                interval: float, timeout: float) -> tuple[dict, int]:
    """Run ``cmd``; every ``interval`` s record ``sample(pid)``. Returns (the last JSON line it printed,
    or ``{"error": ..., "mode": mode}``, the peak sample).

    ``os.sync()`` first: the gigabytes an earlier contender wrote reach the disk before this one starts,
    not while it writes its cache (measured in bench/shards.py: a cold epoch run right after another
    contender's 2.3 GB of writes took 6.0-6.7 s instead of 4.4-4.9 s)."""
    os.sync()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,  # our own script
                            start_new_session=True)  # its own group: a timeout kills its worker processes too
    peak = [0]
    done = threading.Event()

    def loop() -> None:
        while not done.wait(interval):
            peak[0] = max(peak[0], sample(proc.pid))

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    timed_out = False
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)  # its workers (DataLoader, litdata.optimize) would hold the pipes open
        out, err = proc.communicate()
    except BaseException:  # Ctrl-C: the group no longer gets the terminal's signal
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    done.set()
    th.join()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if timed_out:
        return {"error": [f"timed out after {timeout:g} s"], "mode": mode}, peak[0]
    if proc.returncode != 0 or not lines:
        return {"error": (err or out).strip().splitlines()[-1:] or ["no output"], "mode": mode}, peak[0]
    return json.loads(lines[-1]), peak[0]


class RemovedAtExit:
    """Folders a benchmark wrote (caches, copies), removed when it ends rather than between contenders.

    Why: this VM's root file system is ext4 without a journal, where the allocation of every new inode
    skips past inodes freed in the last ~30 s, looking each one up (``recently_deleted``). Removing a
    contender's 2,000-6,000 files right before the next contender starts made the next one's file and
    directory creations cost several times their CPU (measured with ``perf record -a``: 28% of all
    samples under ``find_inode_bit`` / ``recently_deleted``, 25% for the raw copy); whichever contender
    ran after a removal paid it.
    """

    def __init__(self) -> None:
        self.paths: list[str] = []

    def add(self, path: str) -> str:
        self.paths.append(path)
        return path

    def __enter__(self) -> "RemovedAtExit":
        return self

    def __exit__(self, *exc: object) -> None:
        import shutil

        for p in self.paths:
            shutil.rmtree(p, ignore_errors=True)
