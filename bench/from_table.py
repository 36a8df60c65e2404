"""Labels from a table, files from a volume: files_from_table's cold epoch vs UCVolumeDataset's (issue 44 item 6).

    python bench/from_table.py [--files 2000] [--size 150KiB] [--rounds 3] [--profile P100] [--volume fuse|slow]

The same files on a slow volume (``--volume fuse``: ``ucmagic.testing.mount_slow_volume`` under
``/Volumes/bench/...``, as bench/coldwarm.py; ``slow``: the in-process ``slow://`` fsspec simulator;
default fuse where FUSE is available), read by three contenders, each in a fresh process with a cold
cache of its own, interleaved over rounds (the order rotates):

- ``files``: ``UCVolumeDataset(vol)`` + ``ucmagic.DataLoader`` (the reference);
- ``table``: ``files_from_table(labels, root=vol, columns=["label"])`` + ``ucmagic.DataLoader``, the files
  stat-ed at construction (no size/mtime columns);
- ``sized``: the same with ``size_column=`` / ``mtime_column=`` from the table (no stat per file).

The labels table is one Parquet file (path, label, size, mtime). Every loop reads the bytes of every
file it is handed. Printed: per round and median, the construction (``setup``: listing or table read +
stats) and the cold epoch, and the ratios to ``files`` (target: epoch within 1.1x). Smoke run:
``--files 60 --rounds 1 --volume slow --profile P20``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

from _child import RemovedAtExit, run_sampled  # bench/ is on sys.path when a benchmark runs as a script

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILES = {"P20": {"open_ms": 20, "mbps": 200}, "P100": {"open_ms": 100, "mbps": 100}}
CONTENDERS = ("files", "table", "sized")
BATCH = 32


def _read(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def child(mode: str, vol: str, labels: str, cache: str, storage: str) -> dict:
    """One contender's construction and cold epoch (in its own process)."""
    from ucmagic import DataLoader, UCVolumeDataset, files_from_table

    so = json.loads(storage) or None
    t0 = time.perf_counter()
    if mode == "files":
        ds = UCVolumeDataset(vol, cache_dir=cache, storage_options=so)
    else:
        extra = {"size_column": "size", "mtime_column": "mtime"} if mode == "sized" else {}
        ds = files_from_table(labels, root=vol, columns=["label"], cache_dir=cache, storage_options=so, **extra)
    setup = time.perf_counter() - t0
    loader = DataLoader(ds, batch_size=BATCH)
    t1 = time.perf_counter()
    n = nbytes = 0
    first = None
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t1
        paths = batch["path"] if isinstance(batch, dict) else batch
        for p in paths:
            nbytes += _read(p)
            n += 1
    return {"setup": setup, "epoch": time.perf_counter() - t1, "first": first, "files": n, "bytes": nbytes,
            "misses": ds.stats()["misses"]}


def _rss(pid: int) -> int:
    """Summed RSS of ``pid`` and its children (the sampled peak)."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            total += q.memory_info().rss
    return total


def write_labels(src: str, out: str, stat_root: str) -> int:
    """The labels table of every file under ``src``: relative path, a label, size and mtime as the
    volume reports them (``stat_root``: where the volume's files are seen as local paths)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rels = sorted(os.path.relpath(os.path.join(d, f), src).replace(os.sep, "/")
                  for d, _, fs in os.walk(src) for f in fs)
    sts = [os.stat(os.path.join(stat_root, r)) for r in rels]
    pq.write_table(pa.table({"path": rels, "label": [i % 10 for i in range(len(rels))],
                             "size": [s.st_size for s in sts], "mtime": [s.st_mtime for s in sts]}), out)
    return len(rels)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", default="150KiB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", default="P100", choices=sorted(PROFILES))
    ap.add_argument("--volume", default=None, choices=("fuse", "slow"), help="default: fuse where available")
    ap.add_argument("--workdir", default="/tmp/ucmagic-bench-table")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vol", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--labels", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--storage", default="null", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.vol, a.labels, a.cache, a.storage)), flush=True)
        return

    sys.path.insert(0, os.path.dirname(HERE))
    from ucmagic.testing import fuse_available, make_files, mount_slow_volume
    from ucmagic.units import parse_size

    kind = a.volume or ("fuse" if fuse_available() else "slow")
    os.makedirs(a.workdir, exist_ok=True)
    results: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    with contextlib.ExitStack() as stack:
        kept = stack.enter_context(RemovedAtExit())
        src = kept.add(tempfile.mkdtemp(prefix="src-", dir=a.workdir))
        make_files(src, a.files, parse_size(a.size))
        storage: dict | None = None
        if kind == "fuse":
            vol = stack.enter_context(mount_slow_volume(src, "/Volumes/bench/slow/table", list_ms=50,
                                                        **PROFILES[a.profile]))
            stat_root = vol
        else:
            vol, stat_root, storage = "slow://" + src, src, {**PROFILES[a.profile], "list_ms": 50}
        labels = os.path.join(kept.add(tempfile.mkdtemp(prefix="labels-", dir=a.workdir)), "labels.parquet")
        n = write_labels(src, labels, stat_root)
        print(f"{n} files of {a.size} on {kind} {a.profile} ({vol})", flush=True)
        env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), UCMAGIC_PROGRESS="off")
        for rnd in range(a.rounds):
            order = list(CONTENDERS[rnd % len(CONTENDERS):] + CONTENDERS[:rnd % len(CONTENDERS)])
            for c in order:
                cache = kept.add(tempfile.mkdtemp(prefix=f"cache-{c}-", dir=a.workdir))
                cmd = [sys.executable, os.path.abspath(__file__), "--child", c, "--vol", vol, "--labels", labels,
                       "--cache", cache, "--storage", json.dumps(storage)]
                res, peak = run_sampled(cmd, env, c, _rss, 0.1, a.timeout)
                res["peak_mb"] = peak / 1e6
                results[c].append(res)
                if "error" in res:
                    print(f"[round {rnd + 1}] {c:6s} error: {res['error']}", flush=True)
                    continue
                if res["files"] != n or res["misses"] != n:
                    raise SystemExit(f"{c} delivered {res['files']} files with {res['misses']} misses; expected {n}")
                print(f"[round {rnd + 1}] {c:6s} setup {res['setup']:.2f}s  epoch {res['epoch']:.2f}s  "
                      f"first {res['first']:.2f}s  peak {res['peak_mb']:.0f} MB", flush=True)
    report(results)


def report(results: dict[str, list[dict]]) -> None:
    ok = {c: [r for r in rs if "error" not in r] for c, rs in results.items()}
    if not all(ok.values()):
        print("some contender failed every round: no ratios")
        return
    med = {c: {k: statistics.median(r[k] for r in rs) for k in ("setup", "epoch")} for c, rs in ok.items()}
    print(f"\n{'contender':10s} {'setup s':>8s} {'epoch s':>8s} {'setup+epoch':>12s} {'epoch ratio':>12s} "
          f"{'total ratio':>12s}")
    base = med["files"]
    for c, m in med.items():
        print(f"{c:10s} {m['setup']:8.2f} {m['epoch']:8.2f} {m['setup'] + m['epoch']:12.2f} "
              f"{m['epoch'] / base['epoch']:12.2f} {(m['setup'] + m['epoch']) / (base['setup'] + base['epoch']):12.2f}")
    print("target (issue 44): the table contenders' cold epoch within 1.1x of files")


if __name__ == "__main__":
    main()
