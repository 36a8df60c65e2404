"""Shared by the benchmarks: run one contender in a child process while a thread samples it."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from typing import Any, Callable


def tree_memory(pid: int) -> tuple[int, int]:
    """(summed PSS, summed USS) in bytes of ``pid`` and every process under it.

    PSS splits each shared page between the processes mapping it; USS counts only the pages no other
    process maps (what the tree would give back if it ended). Both from one ``memory_full_info()`` call."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    pss = uss = 0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            info = p.memory_full_info()
            pss += info.pss
            uss += info.uss
    return pss, uss


def _peak(a: Any, b: Any) -> Any:
    """The larger sample: element-wise for tuples (each measure's own peak), else ``max``."""
    if isinstance(a, tuple):
        return tuple(max(x, y) for x, y in zip(a, b))
    return max(a, b)


def run_sampled(cmd: list[str], env: dict[str, str], mode: str, sample: Callable[[int], Any],
                interval: float, timeout: float) -> tuple[dict, Any]:
    """Run ``cmd``; every ``interval`` s record ``sample(pid)`` (a number, or a tuple of numbers whose
    peaks are kept one by one). Returns (the last JSON line it printed, or ``{"error": ..., "mode": mode}``,
    the peak sample).

    ``os.sync()`` first: the gigabytes an earlier contender wrote reach the disk before this one starts,
    not while it writes its cache (measured in bench/shards.py: a cold epoch run right after another
    contender's 2.3 GB of writes took 6.0-6.7 s instead of 4.4-4.9 s)."""
    os.sync()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,  # our own script
                            start_new_session=True)  # its own group: a timeout kills its worker processes too
    peak: list[Any] = [None]
    done = threading.Event()

    def loop() -> None:
        while not done.wait(interval):
            now = sample(proc.pid)
            peak[0] = now if peak[0] is None else _peak(peak[0], now)

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
    if peak[0] is None:  # ended before the first sample
        peak[0] = sample(proc.pid)
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
