"""Benchmark: ucmagic.stage against the documented xargs recipe, a raw threaded copy and serial cp -r.

    python bench/stage.py                      # 2,000 files x 150 KiB, profiles P100 and P20
    python -m ucmagic bench stage -- --files 500 --repeat 1

Profiles (per-open latency, per-stream bandwidth): P100 = 100 ms, 100 MB/s; P20 = 20 ms, 200 MB/s.
The source is served through a real FUSE mount (ucmagic.testing.mount_slow_volume) so every copier,
including cp and xargs, pays the same latency. Without FUSE (no /dev/fuse, fuse3 or mfusepy) it
falls back to the in-process slow:// simulator, where only the Python copiers can run; it says so.

Methods, each into a fresh local destination, time includes listing:
  recipe  find . -type f -print0 | xargs -0 -P 256 -I {} cp --parents "{}" DEST/
  raw     4 processes x 64 threads, plain open/read/write (no skip, no atomic rename, no checks)
  stage   ucmagic.stage(src, dest, progress=False) with its defaults
  stage-pN  ucmagic.stage(..., processes=N) variants (--variants)
  cp-r    serial cp -r (P20 only; --no-serial to skip)
Targets (issue 7): stage <= 1.25x raw; stage >= 1.5x faster than recipe on P100, no slower on P20;
stage >= 10x faster than cp -r on P20.
"""
from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Iterator

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ucmagic import testing
from ucmagic.staging import stage

PROFILES = {"P100": (100.0, 100.0), "P20": (20.0, 200.0)}


@contextlib.contextmanager
def _threads_patched() -> Iterator[None]:
    """Start the FUSE server with many threads: libfuse3 serves at most 10 requests at once by default,
    which would cap every copier at ~10 opens in flight (no-op once ucmagic.testing.slowfuse sets max_threads)."""
    boot = ("import mfusepy, runpy, sys; _F = mfusepy.FUSE\n"
            "def F(*a, **k):\n    k.setdefault('max_threads', 1024)\n    return _F(*a, **k)\n"
            "mfusepy.FUSE = F; sys.argv = ['slowfuse'] + sys.argv[1:]\n"
            "runpy.run_module('ucmagic.testing.slowfuse', run_name='__main__')")
    real_popen = testing.subprocess.Popen

    def popen(cmd, *a, **k):
        if cmd[1:3] == ["-m", "ucmagic.testing.slowfuse"]:
            cmd = [cmd[0], "-c", boot, *cmd[3:]]
        return real_popen(cmd, *a, **k)

    testing.subprocess.Popen = popen
    try:
        yield
    finally:
        testing.subprocess.Popen = real_popen


def _copy_file(args: tuple[str, str]) -> int:
    s, d = args
    with open(s, "rb") as fs, open(d, "wb") as fd:
        data = fs.read()
        fd.write(data)
    return len(data)


def _copy_part(pairs: list[tuple[str, str]], threads: int) -> int:
    with ThreadPoolExecutor(threads) as pool:
        return sum(pool.map(_copy_file, pairs))


def raw_copy(src: str, dest: str, procs: int = 4, threads: int = 64) -> None:
    pairs = []
    for root, _dirs, files in os.walk(src):
        rel = os.path.relpath(root, src)
        os.makedirs(os.path.join(dest, rel), exist_ok=True)
        pairs += [(os.path.join(root, f), os.path.join(dest, rel, f)) for f in files]
    parts = [pairs[i::procs] for i in range(procs)]
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("fork")) as pool:
        sum(pool.map(_copy_part, parts, [threads] * procs))


RECIPE_MISSING: list[int] = []


def recipe(src: str, dest: str) -> None:
    """The documented recipe, verbatim. Its parallel ``cp --parents`` race on creating the same folders
    ("cannot make directory ...: File exists"), so some files are not copied: count them."""
    os.makedirs(dest, exist_ok=True)
    subprocess.run(f'cd "{src}" && find . -type f -print0 | xargs -0 -P 256 -I {{}} cp --parents "{{}}" "{dest}/"',
                   shell=True, check=False, stderr=subprocess.DEVNULL)
    RECIPE_MISSING.append(EXPECTED[0] - sum(len(f) for _, _, f in os.walk(dest)))


EXPECTED = [0]


def serial_cp(src: str, dest: str) -> None:
    subprocess.run(["cp", "-r", src, dest], check=True)


def timed(fn, src: str, dest: str) -> float:
    shutil.rmtree(dest, ignore_errors=True)
    os.sync()  # no write-back of the previous run's files during this one
    time.sleep(0.5)
    t = time.perf_counter()
    fn(src, dest)
    dt = time.perf_counter() - t
    shutil.rmtree(dest, ignore_errors=True)
    return dt


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", type=int, default=150 * 1024)
    ap.add_argument("--repeat", type=int, default=3, help="runs per method (median reported)")
    ap.add_argument("--profiles", default="P100,P20")
    ap.add_argument("--variants", default="1,2,4", help="stage processes= variants to also time ('' for none)")
    ap.add_argument("--no-serial", action="store_true", help="skip the slow serial cp -r")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--dest-dir", default=None, help="where the copies go (default: the work dir, on local disk; "
                    "/dev/shm takes the local disk out of the comparison)")
    a = ap.parse_args()

    work = a.workdir or tempfile.mkdtemp(prefix="ucmagic-bench-stage-")
    src = os.path.join(work, "src")
    if not os.path.isdir(src):
        testing.make_files(src, a.files, a.size, depth=2, per_dir=100)
    EXPECTED[0] = a.files
    fuse = testing.fuse_available()
    print(f"stage benchmark: {a.files} files x {a.size // 1024} KiB, cpus={os.cpu_count()}, "
          f"{'FUSE mount' if fuse else 'NO FUSE: slow:// simulator fallback (recipe and cp -r cannot run)'}")
    variants = [int(v) for v in a.variants.split(",") if v.strip()]
    ok = True
    for name in a.profiles.split(","):
        open_ms, mbps = PROFILES[name]
        mnt = os.path.join(work, f"mnt-{name}")
        dest = os.path.join(a.dest_dir or work, "ucmagic-bench-dest")
        ctx = (testing.mount_slow_volume(src, mnt, open_ms=open_ms, mbps=mbps) if fuse
               else contextlib.nullcontext(None))
        with _threads_patched(), ctx:
            source = mnt if fuse else f"slow://{src}"
            opts = None if fuse else {"open_ms": open_ms, "mbps": mbps}
            methods = {"stage": lambda s, d: stage(s, d, progress=False, storage_options=opts)}
            for p in variants:
                methods[f"stage-p{p}"] = (lambda p: lambda s, d: stage(s, d, progress=False, processes=p,
                                                                       storage_options=opts))(p)
            if fuse:
                methods["raw"] = raw_copy
                methods["recipe"] = recipe
            times: dict[str, list[float]] = {m: [] for m in methods}
            for _ in range(a.repeat):  # interleaved, so load from other processes hits all methods alike
                for m, fn in methods.items():
                    times[m].append(timed(fn, source, dest))
            if fuse and name == "P20" and not a.no_serial:
                times["cp-r"] = [timed(serial_cp, source, dest)]
        med = {m: statistics.median(v) for m, v in times.items()}
        print(f"\n{name} ({open_ms:g} ms/open, {mbps:g} MB/s per stream), median of {a.repeat}:")
        for m, v in med.items():
            print(f"  {m:10s} {v:7.2f} s   (runs: {', '.join(f'{x:.2f}' for x in times[m])})")
        if "recipe" in med:
            print(f"  recipe missed files (cp --parents races on mkdir): {RECIPE_MISSING}")
            RECIPE_MISSING.clear()
        s = med["stage"]
        if "raw" in med:
            r = s / med["raw"]
            print(f"  stage/raw        = {r:.2f}x  (target <= 1.25)")
            ok &= r <= 1.25
        if "recipe" in med:
            r = med["recipe"] / s
            target = 1.5 if name == "P100" else 1.0
            print(f"  recipe/stage     = {r:.2f}x  (target >= {target})")
            ok &= r >= target
        if "cp-r" in med:
            r = med["cp-r"] / s
            print(f"  cp-r/stage       = {r:.1f}x  (target >= 10)")
            ok &= r >= 10
    if not a.workdir:
        shutil.rmtree(work, ignore_errors=True)
    print("\nall targets met" if ok else "\nsome targets missed")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
