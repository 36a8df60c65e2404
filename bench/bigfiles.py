"""Big files on a FUSE slow volume: ucmagic's cold epoch vs the ranged-parallel limit and its peers.

    python bench/bigfiles.py [--rounds 3] [--sets one,four] [--contenders ...] [--keep-src]

Sets: ``one`` is one 1 GiB file, ``four`` is 4 x 512 MiB. They sit on one FUSE mount made by
``ucmagic.testing.mount_slow_volume`` (profile P20: 20 ms per open, 200 MB/s per read stream) under
``/Volumes/bench/big/p20`` (databricks-sdk-air accepts only such paths). Each contender runs in its
own fresh process on an empty cache, interleaved over rounds (the order rotates each round); the
report gives medians. Contenders:

- ``ranged``: the limit, a raw copy of every file by 32 threads reading 16 MiB ranges (own handle
  per thread and file, ``os.pread``/``os.pwrite``);
- ``onestream``: a raw copy with one stream per file (all files at once, ``shutil.copyfile``);
- ``ucmagic``: ``UCVolumeDataset`` + ``ucmagic.DataLoader(ds, batch_size=1)``, defaults otherwise;
- ``dbair``: ``databricks-sdk-air[data]==0.1.1`` ``UCVolumeDataset`` + its ``DataLoader(ds, batch_size=1)``
  (interpreter at ``$DBAIR_PYTHON``, default /tmp/venv-dbair/bin/python).

Printed per set: seconds for the cold epoch (every file on local disk and handed out), MB/s, time to
the first item (first file complete for the raw copies), and peak bytes of the contender's cache
directory (allocated blocks, sampled every 50 ms; ``TMPDIR`` points there, where databricks-sdk-air
keeps its cache). The loaders hand out paths; the loop checks each file's size but does not read it.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time

from _child import run_sampled  # bench/ is on sys.path when a benchmark runs as a script

HERE = os.path.dirname(os.path.abspath(__file__))
MiB = 1 << 20
SETS = {"one": (1, 1024 * MiB), "four": (4, 512 * MiB)}
PROFILE = {"open_ms": 20, "mbps": 200}
RANGE = 16 * MiB
THREADS = 32


# ---------------------------------------------------------------- contenders (run in a child process)

def _files(vol: str) -> list[str]:
    return sorted(os.path.join(vol, f) for f in os.listdir(vol))


def _ranged(files: list[str], dest: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    local = threading.local()
    sizes = {f: os.path.getsize(f) for f in files}
    outs = {f: os.open(os.path.join(dest, os.path.basename(f)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            for f in files}
    left = {f: -(-sizes[f] // RANGE) for f in files}
    mu = threading.Lock()
    opened: list[int] = []  # every thread's source descriptors, closed at the end (the mount unmounts cleanly)
    t0 = time.perf_counter()
    first = [None]

    def one(job: tuple[str, int]) -> int:
        src, off = job
        fds = local.__dict__.setdefault("fds", {})
        if src not in fds:
            fds[src] = os.open(src, os.O_RDONLY)
            with mu:
                opened.append(fds[src])
        end, n = min(off + RANGE, sizes[src]), 0
        while off < end:
            data = os.pread(fds[src], min(MiB, end - off), off)
            if not data:
                raise OSError(f"{src} ended early")
            os.pwrite(outs[src], data, off)
            off += len(data)
            n += len(data)
        with mu:
            left[src] -= 1
            if left[src] == 0 and first[0] is None:
                first[0] = time.perf_counter() - t0
        return n

    jobs = [(f, off) for f in files for off in range(0, sizes[f], RANGE)]
    with ThreadPoolExecutor(THREADS) as ex:
        total = sum(ex.map(one, jobs))
    for fd in [*outs.values(), *opened]:
        os.close(fd)
    return {"secs": time.perf_counter() - t0, "first": first[0], "files": len(files), "bytes": total}


def _onestream(files: list[str], dest: str) -> dict:
    from concurrent.futures import ThreadPoolExecutor, as_completed

    t0 = time.perf_counter()
    first = None

    def one(src: str) -> int:
        out = os.path.join(dest, os.path.basename(src))
        shutil.copyfile(src, out)
        return os.path.getsize(out)

    total = 0
    with ThreadPoolExecutor(len(files)) as ex:
        for fut in as_completed([ex.submit(one, f) for f in files]):
            total += fut.result()
            first = first if first is not None else time.perf_counter() - t0
    return {"secs": time.perf_counter() - t0, "first": first, "files": len(files), "bytes": total}


def _loop(loader) -> dict:
    t0 = time.perf_counter()
    first, n, nbytes = None, 0, 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        for path in batch:
            nbytes += os.path.getsize(path)
            n += 1
    return {"secs": time.perf_counter() - t0, "first": first, "files": n, "bytes": nbytes}


def child(mode: str, vol: str, cache: str) -> dict:
    t_setup = time.perf_counter()
    if mode in ("ranged", "onestream"):
        return {"epoch": (_ranged if mode == "ranged" else _onestream)(_files(vol), cache)}
    if mode == "ucmagic":
        from ucmagic import DataLoader, UCVolumeDataset

        ds = UCVolumeDataset(vol, cache_dir=cache)
        loader = DataLoader(ds, batch_size=1)
        setup = time.perf_counter() - t_setup
        return {"setup": setup, "workers": loader.num_workers, "epoch": _loop(loader),
                "stats": {k: ds.stats()[k] for k in ("misses", "retries")}}
    if mode == "dbair":
        from databricks.air.data import DataLoader, UCVolumeDataset

        ds = UCVolumeDataset(vol)
        loader = DataLoader(ds, batch_size=1)
        setup = time.perf_counter() - t_setup
        return {"setup": setup, "workers": loader.num_workers, "epoch": _loop(loader)}
    raise SystemExit(f"unknown mode {mode}")


# ---------------------------------------------------------------- parent: orchestration and sampling

def _allocated(root: str) -> int:
    """Disk blocks under ``root``, each file counted once (cache leases are hard links)."""
    total = 0
    seen: set[int] = set()
    stack = [root]
    while stack:
        d = stack.pop()
        try:
            with os.scandir(d) as it:
                for de in it:
                    try:
                        if de.is_dir(follow_symlinks=False):
                            stack.append(de.path)
                        elif de.is_file(follow_symlinks=False):
                            st = de.stat(follow_symlinks=False)
                            if st.st_ino not in seen:
                                seen.add(st.st_ino)
                                total += st.st_blocks * 512
                    except OSError:
                        pass
        except OSError:
            pass
    return total


def run_child(python: str, mode: str, vol: str, cache: str, timeout: float = 600) -> dict:
    cmd = [python, os.path.abspath(__file__), "--child", mode, "--vol", vol, "--cache", cache]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), UCMAGIC_PROGRESS="off", TMPDIR=cache)
    res, peak = run_sampled(cmd, env, mode, lambda _pid: _allocated(cache), 0.05, timeout)
    if "error" not in res:
        res["peak_cache"] = peak
    return res


def make_sets(src: str, names: list[str]) -> None:
    """Files of random-looking bytes (a 64 MiB random block, each MiB stamped with file and offset)."""
    block = None
    for name in names:
        count, size = SETS[name]
        d = os.path.join(src, name)
        want = {f"{name}{i}.bin": size for i in range(count)}
        if os.path.isdir(d) and {f: os.path.getsize(os.path.join(d, f)) for f in os.listdir(d)} == want:
            continue
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        block = block or bytearray(os.urandom(64 * MiB))
        for f in want:
            with open(os.path.join(d, f), "wb") as out:
                for off in range(0, size, len(block)):
                    for m in range(0, len(block), MiB):
                        block[m:m + 32] = f"{f}@{off + m}".encode().ljust(32)
                    out.write(block[:size - off])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sets", default="one,four")
    ap.add_argument("--contenders", default="ranged,onestream,ucmagic,dbair")
    ap.add_argument("--workdir", default="/tmp/ucmagic-bigbench")
    ap.add_argument("--keep-src", action="store_true", help="keep the source files for the next run (3 GiB)")
    ap.add_argument("--json", default=None, help="also write all results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vol", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.vol, a.cache)), flush=True)
        return

    sys.path.insert(0, os.path.dirname(HERE))
    from ucmagic.testing import fuse_available, mount_slow_volume

    if not fuse_available():
        raise SystemExit("needs FUSE: apt-get install fuse3 && pip install mfusepy (and /dev/fuse)")
    python_for = {"dbair": os.environ.get("DBAIR_PYTHON", "/tmp/venv-dbair/bin/python")}
    contenders = [c for c in a.contenders.split(",") if c]
    if "dbair" in contenders and not os.path.exists(python_for["dbair"]):
        print(f"skipping dbair: no interpreter at {python_for['dbair']}", file=sys.stderr)
        contenders.remove("dbair")
    sets = [s for s in a.sets.split(",") if s]
    need = sum(SETS[s][0] * SETS[s][1] for s in sets)
    src = os.path.join(a.workdir, "src")
    os.makedirs(a.workdir, exist_ok=True)
    if shutil.disk_usage(a.workdir).free < 2.5 * need:
        raise SystemExit(f"needs {2.5 * need / 1e9:.1f} GB free under {a.workdir} (sources + one cache)")
    make_sets(src, sets)
    results: dict[str, dict[str, list[dict]]] = {s: {c: [] for c in contenders} for s in sets}
    try:
        with mount_slow_volume(src, "/Volumes/bench/big/p20", list_ms=50, **PROFILE) as mnt:
            for rnd in range(a.rounds):
                for s in sets:
                    k = rnd % len(contenders)
                    for c in contenders[k:] + contenders[:k]:
                        cache = tempfile.mkdtemp(prefix=f"{c}-", dir=a.workdir)
                        r = run_child(python_for.get(c, sys.executable), c, os.path.join(mnt, s), cache)
                        shutil.rmtree(cache, ignore_errors=True)
                        results[s][c].append(r)
                        e = r.get("epoch")
                        status = r.get("error") or (f"{e['secs']:.2f}s  {e['bytes'] / e['secs'] / 1e6:.0f} MB/s  "
                                                    f"first {e['first']:.2f}s")
                        print(f"[round {rnd + 1}] {s:4s} {c:9s} {status}  peak cache "
                              f"{r.get('peak_cache', 0) / 1e6:.0f} MB", flush=True)
    finally:
        if not a.keep_src:
            shutil.rmtree(src, ignore_errors=True)
    report(results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def _med(runs: list[dict], key: str) -> float:
    vals = [r["epoch"][key] if key in r.get("epoch", {}) else r[key] for r in runs if "epoch" in r]
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else float("nan")


def report(results: dict) -> None:
    for s, res in results.items():
        count, size = SETS[s]
        print(f"\n== {s}: {count} x {size // MiB} MiB on P20 ({PROFILE['open_ms']} ms per open, "
              f"{PROFILE['mbps']} MB/s per stream), medians of {max(len(v) for v in res.values())} rounds ==")
        print(f"{'contender':10s} {'epoch s':>8s} {'MB/s':>6s} {'first s':>8s} {'peak cache MB':>14s}  (all runs, s)")
        for c, runs in res.items():
            ok = [r for r in runs if "epoch" in r]
            if not ok:
                print(f"{c:10s} failed: {runs[0].get('error') if runs else 'not run'}")
                continue
            secs = _med(ok, "secs")
            print(f"{c:10s} {secs:8.2f} {count * size / secs / 1e6:6.0f} {_med(ok, 'first'):8.2f} "
                  f"{_med(ok, 'peak_cache') / 1e6:14.0f}  ({', '.join(format(r['epoch']['secs'], '.2f') for r in ok)})")
        def get(c: str, res: dict = res) -> float:
            return _med([r for r in res.get(c, []) if "epoch" in r], "secs")

        print("ratios (targets in brackets):")
        if "ucmagic" in res and "ranged" in res:
            print(f"  ucmagic / ranged-parallel limit     {get('ucmagic') / get('ranged'):5.2f}  [<= 1.25]")
        if "ucmagic" in res and "onestream" in res:
            print(f"  one stream per file / ucmagic       {get('onestream') / get('ucmagic'):5.2f}")
        if "ucmagic" in res and "dbair" in res:
            print(f"  databricks-sdk-air / ucmagic        {get('dbair') / get('ucmagic'):5.2f}"
                  + ("  [>= 2]" if s == "one" else ""))


if __name__ == "__main__":
    main()
