"""Shared by the benchmarks: run one contender in a child process while a thread samples it."""
from __future__ import annotations

import json
import subprocess
import threading
from typing import Callable


def run_sampled(cmd: list[str], env: dict[str, str], mode: str, sample: Callable[[int], int],
                interval: float, timeout: float) -> tuple[dict, int]:
    """Run ``cmd``; every ``interval`` s record ``sample(pid)``. Returns (the last JSON line it printed,
    or ``{"error": ..., "mode": mode}``, the peak sample)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # noqa: S603 - our own script
    peak = [0]
    done = threading.Event()

    def loop() -> None:
        while not done.wait(interval):
            peak[0] = max(peak[0], sample(proc.pid))

    th = threading.Thread(target=loop, daemon=True)
    th.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    done.set()
    th.join()
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        return {"error": (err or out).strip().splitlines()[-1:] or ["no output"], "mode": mode}, peak[0]
    return json.loads(lines[-1]), peak[0]
