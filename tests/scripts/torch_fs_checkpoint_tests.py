"""Run torch's own file-system checkpoint tests twice: with torch's FileSystemWriter/Reader, then with
ucmagic's UCVolumeWriter/UCVolumeReader in their place; print the counts side by side and the tests
whose outcome differs.

    python tests/scripts/torch_fs_checkpoint_tests.py PATH/TO/test_file_system_checkpoint_cpu.py [MORE.py ...]

The test files come from a pytorch checkout (test/distributed/checkpoint/); they need
``expecttest`` (and ``zstandard`` for the ZStandard tests), and run as torch's CI does, with gloo.
Exit status 1 when ucmagic's classes pass fewer tests than torch's.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

SWAP = """

# ---- appended by ucmagic's tests/scripts/torch_fs_checkpoint_tests.py: ucmagic's classes in torch's place
from ucmagic import UCVolumeReader as FileSystemReader  # noqa: E402,F811
from ucmagic import UCVolumeWriter as FileSystemWriter  # noqa: E402,F811
"""
_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\s+(?:\[\d+\]\s+)?(\S+)", re.M)
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)")


def run(test_file: str, swapped: bool, timeout: float) -> tuple[dict[str, int], dict[str, str], str]:
    """Counts, per-test outcomes and the pytest output of one run."""
    with tempfile.TemporaryDirectory(prefix="ucmagic-torchtests-") as d:
        copy = os.path.join(d, os.path.basename(test_file))
        shutil.copyfile(test_file, copy)
        if swapped:
            with open(copy, "a") as f:
                f.write(SWAP)
        env = dict(os.environ, UCMAGIC_STAGING_DIR=os.path.join(d, "staging"), TMPDIR=d, OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "-o", "addopts=",
               "-W", "ignore::UserWarning", copy]
        try:
            p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True, timeout=timeout, check=False)
            out = p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            out += f"\n[timed out after {timeout} s]"
    summary = out.strip().splitlines()[-1] if out.strip() else ""
    counts = {k.rstrip("s") if k.startswith("error") else k: int(n) for n, k in _COUNT.findall(summary)}
    outcomes = {name.split("::", 1)[-1]: kind for kind, name in _OUTCOME.findall(out)}
    return counts, outcomes, out


def describe(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    rest = ", ".join(f"{n} {k}" for k, n in counts.items() if k != "passed" and n)
    return f"{counts.get('passed', 0)} of {total} passed" + (f" ({rest})" if rest else "")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="torch test files (test/distributed/checkpoint/test_file_system_*.py)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run (default 1800)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print the pytest output of runs that differ")
    a = ap.parse_args(argv)
    worse = False
    for test_file in a.files:
        theirs, their_outcomes, their_out = run(test_file, False, a.timeout)
        ours, our_outcomes, our_out = run(test_file, True, a.timeout)
        print(f"{os.path.basename(test_file)}")
        print(f"  torch's FileSystemWriter/Reader:  {describe(theirs)}")
        print(f"  ucmagic's UCVolumeWriter/Reader:  {describe(ours)}")
        for name in sorted(set(their_outcomes) | set(our_outcomes)):
            if their_outcomes.get(name) != our_outcomes.get(name):
                print(f"  differs: {name}: torch {their_outcomes.get(name)}, ucmagic {our_outcomes.get(name)}")
            elif their_outcomes.get(name) in ("FAILED", "ERROR"):
                print(f"  fails with both: {name}")
        if ours.get("passed", 0) < theirs.get("passed", 0):
            worse = True
            if a.verbose:
                print(our_out[-6000:])
    return 1 if worse else 0


if __name__ == "__main__":
    sys.exit(main())
