"""System calls per cache fill: a cold UCVolumeDataset epoch over N small local files, counted with ``strace -c -f``.

    python bench/fill_syscalls.py                 # 200 and 400 files of 4 KiB, without and with a budget
    python bench/fill_syscalls.py --baseline DIR  # the same for the tree at DIR (e.g. a worktree of main)

Each count runs the epoch in a fresh process under ``strace -f -c`` for N and 2N files; the difference divided
by N is the cost of one fill (listing and start-up cancel out). ``futex`` is left out of the total (thread
wake-ups: it varies from run to run). Needs ``strace``. Counts, not times: safe to run on a busy machine.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

CHILD = """
import os, sys
src, cache, budget = sys.argv[1], sys.argv[2], sys.argv[3] == "budget"
import ucmagic
ds = ucmagic.UCVolumeDataset(src, cache_dir=cache, cache_limit="1GB" if budget else None)
assert sum(1 for _ in ds) == len(os.listdir(src))
"""


def count(tree: str, n: int, budget: bool, work: str) -> dict[str, int]:
    """Per-syscall counts of one cold epoch over ``n`` files with ucmagic imported from ``tree``."""
    src = tempfile.mkdtemp(dir=work)
    for i in range(n):
        with open(os.path.join(src, f"f{i:05d}.bin"), "wb") as f:
            f.write(os.urandom(4096))
    out = os.path.join(work, "strace.txt")
    env = {**os.environ, "PYTHONPATH": tree}
    subprocess.run(["strace", "-f", "-c", "-o", out, sys.executable, "-c", CHILD, src,
                    tempfile.mkdtemp(dir=work), "budget" if budget else "none"], env=env, check=True,
                   stdout=subprocess.DEVNULL, cwd=work)  # cwd: not a source tree (it would come first)
    calls: dict[str, int] = {}
    with open(out) as f:
        for line in f:
            m = re.match(r"\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?(\w+)\s*$", line)
            if m and m.group(2) != "total":
                calls[m.group(2)] = int(m.group(1))
    return calls


def per_fill(tree: str, budget: bool, n: int, work: str) -> dict[str, float]:
    a, b = count(tree, n, budget, work), count(tree, 2 * n, budget, work)
    return {k: (b.get(k, 0) - a.get(k, 0)) / n for k in set(a) | set(b)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--files", type=int, default=200)
    ap.add_argument("--baseline", default=None, help="another source tree to count too")
    a = ap.parse_args()
    if shutil.which("strace") is None:
        raise SystemExit("needs strace")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("this tree", here)] + ([("baseline", os.path.abspath(a.baseline))] if a.baseline else [])
    work = tempfile.mkdtemp(prefix="fill-syscalls-")
    try:
        for budget in (False, True):
            for name, tree in trees:
                d = per_fill(tree, budget, a.files, work)
                core = {k: v for k, v in d.items() if k != "futex" and abs(v) >= 0.05}
                top = ", ".join(f"{k} {v:.2f}" for k, v in sorted(core.items(), key=lambda kv: -kv[1]))
                print(f"{'budget 1GB' if budget else 'no budget'} | {name}: {sum(core.values()):.1f} calls per "
                      f"fill without futex ({top})", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
