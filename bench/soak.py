"""Soak and fault-cost benchmark (issue 8): many shuffled epochs under faults, and the price of a flaky volume.

    python bench/soak.py [--epochs 20] [--files 2000] [--size 32KiB] [--limit-frac 0.6] [--fail-every 7]
                         [--ratio-files 2000] [--ratio-rounds 3] [--no-dbair] [--json out.json]

Part 1, soak: ``--epochs`` epochs of ``UCVolumeDataset(shuffle=True)`` + ``ucmagic.DataLoader``
(2 workers) over a ``slow://`` volume (5 ms per open) where every ``--fail-every``-th open fails,
with a cache limit of ``--limit-frac`` of the data (so most of each epoch is evicted and fetched
again). Every delivered file is read and checked against the source's SHA-256. Prints, per epoch:
files delivered, duplicates and losses (both must be 0), retries, misses, peak cache bytes vs the
limit, and the peak RSS of the process tree (must stay flat).

Part 2, fault cost: cold epochs (fresh cache each) over two FUSE mounts of the same 2,000 files
(5 ms per open, 200 MB/s), one healthy and one failing every 7th open, ucmagic with defaults
(6 workers), interleaved, median of ``--ratio-rounds``: the ratio faulty/healthy (SPEC: <= 1.5x).
With ``/tmp/venv-dbair/bin/python`` (``$DBAIR_PYTHON``) the same for databricks-sdk-air's
DataLoader with defaults, one round (its faulty epoch takes over a minute). Without FUSE, part 2
uses ``slow://`` in-process volumes and skips databricks-sdk-air.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
BATCH = 32

DBAIR_CHILD = r"""
import json, sys, time
from databricks.air.data import DataLoader, UCVolumeDataset
ds = UCVolumeDataset(sys.argv[1])
loader = DataLoader(ds, batch_size=32)
t0 = time.perf_counter(); seen = []
for batch in loader:
    for p in batch:
        with open(p, "rb") as f:
            seen.append(f.readline().strip().decode())
print(json.dumps({"secs": time.perf_counter() - t0, "files": len(seen), "unique": len(set(seen)),
                  "workers": loader.num_workers}))
"""


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class TreeSampler:
    """Peak RSS of this process and its children, and peak cache bytes, sampled in a thread."""

    def __init__(self, cache=None, every: float = 0.1) -> None:
        import psutil

        self.proc = psutil.Process()
        self.cache = cache
        self.every = every
        self.peak_rss = 0
        self.peak_cache = 0
        self._stop = threading.Event()
        self._n = 0
        self._th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        while not self._stop.wait(self.every):
            rss = 0
            for p in [self.proc, *self.proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    rss += p.memory_info().rss
            self.peak_rss = max(self.peak_rss, rss)
            self._n += 1
            if self.cache is not None and self._n % 3 == 0:
                with contextlib.suppress(OSError):
                    self.peak_cache = max(self.peak_cache, self.cache.usage().bytes)

    def reset(self) -> None:
        self.peak_rss = 0
        self.peak_cache = 0

    def __enter__(self) -> "TreeSampler":
        self._th.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._th.join()


# ---------------------------------------------------------------- part 1: soak

def soak(a, work: str) -> dict:
    from ucmagic import DataLoader, UCVolumeDataset
    from ucmagic.testing import make_files
    from ucmagic.units import format_size, parse_size

    src = os.path.join(work, "soak-src")
    size = parse_size(a.size)
    make_files(src, a.files, size, per_dir=100)
    sums = {}
    for d, _, fs in os.walk(src):
        for f in fs:
            p = os.path.join(d, f)
            sums[os.path.relpath(p, src)] = _sha(p)
    limit = int(a.files * size * a.limit_frac)
    cache_dir = tempfile.mkdtemp(prefix="soak-cache-", dir=work)
    ds = UCVolumeDataset(f"slow://{src}", shuffle=True, cache_dir=cache_dir, cache_limit=limit,
                         storage_options={"open_ms": a.open_ms, "mbps": 0, "list_ms": 0, "fail_every": a.fail_every})
    loader = DataLoader(ds, batch_size=BATCH, num_workers=a.workers)
    print(f"soak: {a.epochs} epochs x {a.files} files of {format_size(size)}, shuffle, cache limit "
          f"{format_size(limit)} ({a.limit_frac:.0%} of the data), every {a.fail_every}th open fails, "
          f"{a.workers} workers", flush=True)
    print(f"{'epoch':>5} {'secs':>6} {'files':>6} {'dups':>5} {'lost':>5} {'bad':>4} {'retries':>8} {'misses':>7} "
          f"{'peak cache':>11} {'peak RSS':>9}", flush=True)
    rows = []
    prev = ds.stats()
    with TreeSampler(ds.cache) as smp:
        for epoch in range(a.epochs):
            ds.set_epoch(epoch)
            smp.reset()
            t0 = time.perf_counter()
            seen, bad = [], 0
            for batch in loader:
                for p in batch:
                    with open(p, "rb") as f:
                        data = f.read()
                    rel = data.split(b"\n", 1)[0].decode()
                    seen.append(rel)
                    bad += hashlib.sha256(data).hexdigest() != sums.get(rel)
            secs = time.perf_counter() - t0
            time.sleep(0.35)  # one more cache sample at the epoch's end
            st = ds.stats()
            row = {"epoch": epoch, "secs": secs, "files": len(seen), "duplicates": len(seen) - len(set(seen)),
                   "lost": len(set(sums) - set(seen)), "bad_bytes": bad,
                   "retries": st["retries"] - prev["retries"], "misses": st["misses"] - prev["misses"],
                   "peak_cache": smp.peak_cache, "peak_rss": smp.peak_rss}
            prev = st
            rows.append(row)
            print(f"{epoch:5d} {secs:6.2f} {row['files']:6d} {row['duplicates']:5d} {row['lost']:5d} {bad:4d} "
                  f"{row['retries']:8d} {row['misses']:7d} {format_size(smp.peak_cache):>11} "
                  f"{smp.peak_rss / 1e6:7.0f}MB", flush=True)
    final = ds.stats()
    cached_files = ds.cache.usage().files
    del loader
    rss = [r["peak_rss"] for r in rows]
    later = rss[2:] or rss
    out = {
        "epochs": len(rows), "files_delivered": sum(r["files"] for r in rows),
        "duplicates": sum(r["duplicates"] for r in rows), "losses": sum(r["lost"] for r in rows),
        "bad_bytes": sum(r["bad_bytes"] for r in rows), "retries": final["retries"], "misses": final["misses"],
        "evictions": final["misses"] - cached_files, "limit": limit,
        "peak_cache": max(r["peak_cache"] for r in rows),
        "rss_first_mb": rss[0] / 1e6, "rss_min_mb": min(later) / 1e6, "rss_max_mb": max(later) / 1e6,
        "rss_growth_last_vs_epoch2": rss[-1] / later[0], "rows": rows,
    }
    print(f"soak total: {out['epochs']} epochs, {out['files_delivered']} files delivered, duplicates "
          f"{out['duplicates']}, losses {out['losses']}, corrupt {out['bad_bytes']}, retries {out['retries']}, "
          f"fetches {out['misses']}, evictions {out['evictions']}, peak cache {format_size(out['peak_cache'])} "
          f"vs limit {format_size(limit)} ({out['peak_cache'] / limit:.2f}x), peak RSS per epoch "
          f"{out['rss_min_mb']:.0f}-{out['rss_max_mb']:.0f} MB from epoch 2 on "
          f"(last/epoch-2 {out['rss_growth_last_vs_epoch2']:.2f}x)", flush=True)
    shutil.rmtree(cache_dir, ignore_errors=True)
    return out


# ---------------------------------------------------------------- part 2: the cost of a flaky volume

def ucmagic_epoch(vol: str, work: str, storage_options=None) -> dict:
    from ucmagic import DataLoader, UCVolumeDataset

    cache = tempfile.mkdtemp(prefix="ratio-cache-", dir=work)
    try:
        ds = UCVolumeDataset(vol, cache_dir=cache, storage_options=storage_options)
        loader = DataLoader(ds, batch_size=BATCH)
        t0 = time.perf_counter()
        seen = []
        for batch in loader:
            for p in batch:
                with open(p, "rb") as f:
                    seen.append(f.readline().strip())
        secs = time.perf_counter() - t0
        st = ds.stats()
        del loader
        return {"secs": secs, "files": len(seen), "unique": len(set(seen)), "retries": st["retries"],
                "workers": 6}
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def dbair_epoch(python: str, vol: str) -> dict:
    r = subprocess.run([python, "-c", DBAIR_CHILD, vol], capture_output=True, text=True, timeout=900)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode != 0 or not lines:
        return {"error": (r.stderr or r.stdout).strip().splitlines()[-1:]}
    return json.loads(lines[-1])


def fault_cost(a, work: str) -> dict:
    from ucmagic.testing import fuse_available, make_files, mount_slow_volume
    from ucmagic.units import parse_size

    src = os.path.join(work, "ratio-src")
    make_files(src, a.ratio_files, parse_size(a.ratio_size), depth=0)  # flat: databricks-sdk-air lists one level
    python = os.environ.get("DBAIR_PYTHON", "/tmp/venv-dbair/bin/python")
    res: dict = {"ucmagic": {"healthy": [], "faulty": []}, "dbair": {"healthy": [], "faulty": []}}
    fuse = fuse_available()
    with contextlib.ExitStack() as stack:
        if fuse:
            vols = {kind: stack.enter_context(mount_slow_volume(
                src, f"/Volumes/soak/slow/{kind}", open_ms=a.open_ms, mbps=200, list_ms=50,
                fail_every=a.fail_every if kind == "faulty" else 0)) for kind in ("healthy", "faulty")}
            opts = {"healthy": None, "faulty": None}
        else:
            print("no FUSE here: fault cost measured on slow:// (in-process) and without databricks-sdk-air")
            vols = {"healthy": f"slow://{src}", "faulty": f"slow://{src}"}
            opts = {k: {"open_ms": a.open_ms, "mbps": 200, "list_ms": 50,
                        "fail_every": a.fail_every if k == "faulty" else 0} for k in vols}
        print(f"fault cost: {a.ratio_files} files of {a.ratio_size}, {a.open_ms} ms per open, healthy vs every "
              f"{a.fail_every}th open failing ({'FUSE' if fuse else 'slow://'}), cold cache each run", flush=True)
        for rnd in range(a.ratio_rounds):
            for kind in ("healthy", "faulty"):
                r = ucmagic_epoch(vols[kind], work, opts[kind])
                res["ucmagic"][kind].append(r)
                print(f"[round {rnd + 1}] ucmagic {kind:7s} {r['secs']:6.2f}s files {r['files']} unique "
                      f"{r['unique']} retries {r['retries']}", flush=True)
        if fuse and a.dbair and os.path.exists(python):
            for kind in ("healthy", "faulty"):
                r = dbair_epoch(python, vols[kind])
                res["dbair"][kind].append(r)
                print(f"[round 1] databricks-sdk-air {kind:7s} " + (f"{r['secs']:6.2f}s files {r['files']} unique "
                      f"{r['unique']}" if "secs" in r else f"error {r['error']}"), flush=True)
    out = {}
    for who in ("ucmagic", "dbair"):
        h = [r["secs"] for r in res[who]["healthy"] if "secs" in r]
        f = [r["secs"] for r in res[who]["faulty"] if "secs" in r]
        if h and f:
            out[who] = {"healthy_s": statistics.median(h), "faulty_s": statistics.median(f),
                        "ratio": statistics.median(f) / statistics.median(h),
                        "complete": all(r.get("unique") == a.ratio_files for r in res[who]["faulty"] if "secs" in r)}
    if "ucmagic" in out:
        u = out["ucmagic"]
        print(f"ucmagic: healthy {u['healthy_s']:.2f}s, every {a.fail_every}th open failing {u['faulty_s']:.2f}s: "
              f"ratio {u['ratio']:.2f}x  [<= 1.5]  every file delivered once: {u['complete']}")
    if "dbair" in out:
        d = out["dbair"]
        print(f"databricks-sdk-air: healthy {d['healthy_s']:.2f}s, faulty {d['faulty_s']:.2f}s: ratio {d['ratio']:.2f}x"
              f"; its faulty epoch / ours {d['faulty_s'] / out['ucmagic']['faulty_s']:.1f}x")
    out["runs"] = res
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", default="32KiB")
    ap.add_argument("--limit-frac", type=float, default=0.6)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--open-ms", type=float, default=5)
    ap.add_argument("--fail-every", type=int, default=7)
    ap.add_argument("--ratio-files", type=int, default=2000)
    ap.add_argument("--ratio-size", default="150KiB")
    ap.add_argument("--ratio-rounds", type=int, default=3)
    ap.add_argument("--no-dbair", dest="dbair", action="store_false")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: soak,ratio")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    os.environ.setdefault("UCMAGIC_PROGRESS", "off")
    work = a.workdir or tempfile.mkdtemp(prefix="ucmagic-soak-")
    os.makedirs(work, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    results = {}
    try:
        if "soak" not in skip:
            results["soak"] = soak(a, work)
        if "ratio" not in skip:
            results["fault_cost"] = fault_cost(a, work)
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
