"""The node-wide memory-mapped listing vs today's per-process list of FileEntry (issue 16).

    python bench/listing.py [--files 1000000] [--per-dir 100] [--data DIR] [--procs 8] [--fuse] [--list-ms 50]

Generates ``--files`` small files in a nested tree (``part<k>/part<k>/g<group>/f<i>.bin``,
``--per-dir`` files per directory; kept in ``--data`` between runs), then measures on local disk
and, with ``--fuse``, through the P20 FUSE volume (``ucmagic.testing.mount_slow_volume``: 20 ms per
open, ``--list-ms`` per directory listing):

- listing time: ``open_listing`` (parallel scan + sort + Arrow write) and ``Volume.list`` (today)
  vs a single-threaded ``os.walk``, names only and with a ``stat`` per file (what a listing needs);
- restart: ``open_listing`` in a fresh process on an unchanged tree, per ``validate=`` mode, vs a
  fresh listing (``relist=True``) in a fresh process;
- memory: ``--procs`` spawned processes (2 ranks x 4 workers by default) each receive the pickled
  listing and walk their share of a shuffled epoch, then report their RSS, USS and PSS growth,
  measured while all of them are alive: today's list of FileEntry plus an int64 permutation vs the
  mapped listing with the array-free order, decoded 4,096 entries at a time;
- pickled sizes: the list of FileEntry, today's pickled UCVolumeDataset, the Listing.
- ``--dataset``: the real thing. ``--ranks`` ranks (gloo, one process each) x ``--workers``
  spawned DataLoader workers run one full shuffled epoch of ``UCVolumeDataset`` through
  ``ucmagic.DataLoader``, then ``stats()`` and ``state_dict()``; each rank and worker reports its
  own (unshared, USS) memory growth in bytes per file, and the dataset's size as pickled into a
  spawned worker. ``--only-dataset`` skips everything else.

Every timed step runs in its own process. Figures go to stdout and, as JSON, to ``--json``.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


# ---------------------------------------------------------------- tree

def generate(root: str, n: int, per_dir: int) -> None:
    """``n`` files of 16-48 bytes; skipped when ``root`` already holds them (marker file)."""
    marker = os.path.join(os.path.dirname(root), f".{os.path.basename(root)}-{n}-{per_dir}.done")
    if os.path.exists(marker):
        return
    shutil.rmtree(root, ignore_errors=True)
    parent, stem = os.path.split(root)
    for name in os.listdir(parent):  # the markers of the tree just removed
        if name.startswith(f".{stem}-") and name.endswith(".done"):
            os.unlink(os.path.join(parent, name))
    t0 = time.perf_counter()
    made: set[str] = set()
    for i in range(n):
        g = i // per_dir
        d = os.path.join(root, f"part{g % 8}", f"part{g % 8}", f"g{g:06d}")
        if d not in made:
            os.makedirs(d, exist_ok=True)
            made.add(d)
        with open(os.path.join(d, f"f{i:08d}.bin"), "wb") as f:
            f.write(b"x" * (16 + i % 33))
    old = time.time() - 3600  # a data set written a while ago (no "racy" entries)
    for dirpath, _, files in os.walk(root):
        for name in files:
            os.utime(os.path.join(dirpath, name), (old, old))
        os.utime(dirpath, (old, old))
    open(marker, "w").close()
    print(f"generated {n:,} files in {len(made):,} directories in {time.perf_counter() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------- steps, each in a fresh process

def run_in_child(name: str, **kw) -> dict:
    """Run ``python bench/listing.py --step name`` and return its JSON line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--step", name, "--kw", json.dumps(kw)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(f"step {name} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_step(name: str, kw: dict) -> dict:
    # library imports are not listing time (a training process has them loaded already)
    import pyarrow.compute
    import pyarrow.ipc  # noqa: F401

    from ucmagic.files.listing import open_listing
    from ucmagic.files.volume import LocalVolume

    if name == "walk":  # single-threaded os.walk, names only or with a stat per file (sizes and mtimes)
        t0 = time.perf_counter()
        n = 0
        for dirpath, _, files in os.walk(kw["root"]):
            for f in files:
                if kw["stat"]:
                    os.stat(os.path.join(dirpath, f))
                n += 1
        return {"s": time.perf_counter() - t0, "files": n}
    if name == "pwalk":  # the volume's limit: a bare walk with a stat per entry on `threads` threads
        from concurrent.futures import ThreadPoolExecutor

        def one(d: str) -> tuple[list[str], int]:
            dirs, k = [], 0
            with os.scandir(d) as it:
                for de in it:
                    if de.is_dir(follow_symlinks=False):
                        dirs.append(de.path)
                    else:
                        de.stat()
                        k += 1
            return dirs, k

        t0 = time.perf_counter()
        n = 0
        with ThreadPoolExecutor(kw["threads"]) as pool:
            todo = [pool.submit(one, kw["root"])]
            while todo:
                dirs, k = todo.pop().result()
                n += k
                todo.extend(pool.submit(one, d) for d in dirs)
        return {"s": time.perf_counter() - t0, "files": n}
    vol = LocalVolume(kw["root"], list_threads=kw.get("threads", 16))
    if name == "volume_list":
        t0 = time.perf_counter()
        n = len(vol.list())
        return {"s": time.perf_counter() - t0, "files": n}
    if name == "open":
        import threading

        import psutil

        proc = psutil.Process()
        rss0 = proc.memory_info().rss
        peak = [rss0]
        done = threading.Event()

        def sample() -> None:  # the builder's peak memory, sampled every 10 ms
            while not done.wait(0.01):
                peak[0] = max(peak[0], proc.memory_info().rss)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        t0 = time.perf_counter()
        listing = open_listing(vol, None, kw["cache"], relist=kw["relist"], validate=kw["validate"])
        s = time.perf_counter() - t0
        done.set()
        sampler.join()
        return {"s": s, "files": len(listing), "path": listing.path, "file_bytes": os.path.getsize(listing.path),
                "peak_rss_growth": max(peak[0], proc.memory_info().rss) - rss0}
    if name == "warm_epochs":  # validate="lazy" vs "dirs": one process, cache already warm
        from ucmagic import UCVolumeDataset

        out = {}
        for mode in ("dirs", "lazy"):
            t0 = time.perf_counter()
            ds = UCVolumeDataset(kw["root"], cache_dir=kw["cache"], validate=mode)
            out[f"{mode}_open_s"] = time.perf_counter() - t0
            for e in range(2):
                ds.set_epoch(e)
                t0 = time.perf_counter()
                k = sum(1 for _ in ds)
                out[f"{mode}_epoch{e}_s"] = time.perf_counter() - t0
            out["files"] = k
        return out
    if name == "pickles":
        from ucmagic import UCVolumeDataset

        entries = vol.list()
        listing = open_listing(vol, None, kw["cache"])
        ds = UCVolumeDataset(kw["root"], cache_dir=kw["cache"])
        return {"list": len(pickle.dumps(entries)), "dataset": len(pickle.dumps(ds)),
                "listing": len(pickle.dumps(listing)), "files": len(entries)}
    raise SystemExit(f"unknown step {name}")


# ---------------------------------------------------------------- memory: N processes at once

def _member(kind: str, blob: bytes, streams: int, s: int, barrier, q) -> None:
    import gc

    import numpy as np
    import psutil
    import pyarrow.compute
    import pyarrow.ipc  # noqa: F401

    from ucmagic.files import plan
    from ucmagic.files.listing import Listing  # noqa: F401  (imported before the baseline)
    from ucmagic.files.volume import listing_fingerprint

    proc = psutil.Process()
    gc.collect()
    m0 = proc.memory_full_info()
    obj = pickle.loads(blob)
    n = len(obj)
    a, b = n * s // streams, n * (s + 1) // streams
    touched = 0
    if kind == "list":  # today: the dataset's list, an int64 permutation, the stream's entries
        order = plan.epoch_order(n, seed=1, epoch=0, shuffle=True)
        mine = [obj[i] for i in order[a:b].tolist()]
        touched = sum(e.size for e in mine) + sum(e.size for e in obj)  # stats(): total bytes
        listing_fingerprint(obj)
        keep = (order, mine)
    else:  # the mapped listing, the array-free order, the stream's entries chunk by chunk
        for idx in plan.order_chunks(n, [(a, b)], seed=1, epoch=0, shuffle="global", chunk=4096):
            touched += sum(e.size for e in obj.entries(idx))
        touched += obj.total_bytes + len(obj.fingerprint)
        keep = None
    gc.collect()
    barrier.wait()  # everyone holds what it holds: PSS splits the shared pages among them
    m1 = proc.memory_full_info()
    q.put({"rss": m1.rss - m0.rss, "uss": m1.uss - m0.uss, "pss": m1.pss - m0.pss, "touched": touched})
    barrier.wait()
    del keep, obj, np


def memory(kind: str, blob: bytes, procs: int) -> dict:
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_member, args=(kind, blob, procs, s, barrier, q)) for s in range(procs)]
    for p in ps:
        p.start()
    got = [q.get(timeout=1800) for _ in ps]
    for p in ps:
        p.join(120)
    return {k: [g[k] for g in got] for k in ("rss", "uss", "pss")}


# ---------------------------------------------------------------- the dataset: ranks x spawned workers

def _uss(pid: int | None = None) -> int:
    import psutil

    return psutil.Process(pid).memory_full_info().uss


def _worker_baseline(_: int) -> None:
    with open(os.path.join(os.environ["BENCH_OUT"], f"w{os.getpid()}.base"), "w") as f:
        f.write(str(_uss()))


def _rank(root: str, cache: str, out_dir: str, workers: int) -> None:
    import gc

    import torch.distributed as dist

    from ucmagic import DataLoader, UCVolumeDataset
    from ucmagic.files.listing import Listing  # noqa: F401  (imported before the baseline)

    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out_dir, 'store')}",
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    import pyarrow.compute
    import pyarrow.ipc  # noqa: F401

    gc.collect()
    base = _uss()
    ds = UCVolumeDataset(root, cache_dir=cache, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=256, num_workers=workers, multiprocessing_context="spawn",
                        persistent_workers=True, collate_fn=len, worker_init_fn=_worker_baseline,
                        log_to_mlflow=False)
    t0 = time.perf_counter()
    got = sum(loader)
    epoch_s = time.perf_counter() - t0
    stats = ds.stats()
    state = loader.state_dict()
    gc.collect()
    workers_uss = {}
    import psutil

    for child in psutil.Process().children():  # the workers are alive (persistent): measure them now
        base_file = os.path.join(out_dir, f"w{child.pid}.base")
        if os.path.exists(base_file):
            with open(base_file) as f:
                workers_uss[child.pid] = _uss(child.pid) - int(f.read())
    res = {"rank": dist.get_rank(), "items": got, "epoch_s": epoch_s, "rank_uss": _uss() - base,
           "workers_uss": workers_uss, "files": stats["files"], "state_bytes": len(json.dumps(state))}
    with open(os.path.join(out_dir, f"rank{dist.get_rank()}.json"), "w") as f:
        json.dump(res, f)
    dist.barrier()
    del loader
    dist.destroy_process_group()


def dataset_memory(root: str, cache: str, ranks: int, workers: int) -> dict:
    """Run ``ranks`` ranks x ``workers`` spawned workers over one shuffled epoch (see the module doc)."""
    from ucmagic.files.listing import open_listing
    from ucmagic.files.volume import LocalVolume

    open_listing(LocalVolume(root), None, cache)  # listed once beforehand: the ranks measure steady state
    out_dir = tempfile.mkdtemp(prefix="ucmagic-bench-ds-")
    try:
        env = dict(os.environ, BENCH_OUT=out_dir, WORLD_SIZE=str(ranks), PYTHONPATH=ROOT)
        code = (f"import sys; sys.path.insert(0, {HERE!r}); import listing as b; "
                f"b._rank({root!r}, {cache!r}, {out_dir!r}, {workers})")
        ps = [subprocess.Popen([sys.executable, "-c", code], env=dict(env, RANK=str(r))) for r in range(ranks)]
        for p in ps:
            if p.wait() != 0:
                raise SystemExit(f"a rank failed (exit {p.returncode})")
        got = []
        for r in range(ranks):
            with open(os.path.join(out_dir, f"rank{r}.json")) as f:
                got.append(json.load(f))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    workers_uss = {pid: v for g in got for pid, v in g["workers_uss"].items()}
    return {"ranks": got, "worker_uss": sorted(workers_uss.values()), "files": got[0]["files"]}


def pickled_for_a_worker(obj) -> bytes:
    """``obj`` pickled as multiprocessing pickles it into a spawned worker (shared memory as handles)."""
    from multiprocessing import context, reduction
    from multiprocessing.resource_sharer import DupFd

    class SpawnPopen:
        def duplicate_for_child(self, fd):
            return fd

        def DupFd(self, fd):  # noqa: N802 - multiprocessing's name
            return DupFd(fd)

    context.set_spawning_popen(SpawnPopen())
    try:
        return bytes(reduction.ForkingPickler.dumps(obj))
    finally:
        context.set_spawning_popen(None)


def run_dataset(root: str, cache: str, args, out: dict) -> None:
    from ucmagic import UCVolumeDataset

    r = dataset_memory(root, cache, args.ranks, args.workers)
    n = r["files"]
    blob = pickled_for_a_worker(UCVolumeDataset(root, cache_dir=cache, shuffle=True))
    r["pickled_for_worker"] = len(blob)
    out["dataset"] = r
    for g in r["ranks"]:
        print(f"rank {g['rank']}: {g['items']:,} items in {g['epoch_s']:.1f} s; own memory (USS growth) after the "
              f"epoch + stats() + state_dict(): {g['rank_uss'] / n:.1f} B/file", flush=True)
    w = r["worker_uss"]
    if w:
        print(f"{len(w)} spawned workers: own memory growth {min(w) / n:.1f}..{max(w) / n:.1f} B/file", flush=True)
    print(f"UCVolumeDataset pickled into a spawned worker: {len(blob):,} bytes ({n:,} files)", flush=True)


# ---------------------------------------------------------------- main

def measure(label: str, root: str, cache: str, args, out: dict, daemon=None) -> None:
    """Time the listing steps; with ``daemon`` (the FUSE server, a psutil.Process) also its CPU use."""
    r: dict = {}
    print(f"\n== {label}: {root}", flush=True)

    def step(name: str, **kw) -> dict:
        cpu0 = sum(daemon.cpu_times()[:2]) if daemon is not None else 0.0
        got = run_in_child(name, **kw)
        if daemon is not None:
            got["daemon_cpu"] = (sum(daemon.cpu_times()[:2]) - cpu0) / got["s"]
            print(f"   (FUSE server CPU during this step: {got['daemon_cpu']:.2f} cores)", flush=True)
        return got

    r["fresh_open"] = step("open", root=root, cache=cache, relist=True, validate="files", threads=args.list_threads)
    files = r["fresh_open"]["files"]
    print(f"open_listing, fresh (relist=True):   {r['fresh_open']['s']:8.2f} s  ({files:,} files, "
          f"file {r['fresh_open']['file_bytes'] / files:.1f} B/file, builder peak RSS growth "
          f"{r['fresh_open']['peak_rss_growth'] / files:.0f} B/file)", flush=True)
    for mode in args.restart.split(","):
        r[f"restart_{mode}"] = step("open", root=root, cache=cache, relist=False, validate=mode)
        assert r[f"restart_{mode}"]["path"] == r["fresh_open"]["path"], "the listing was not reused"
        print(f"open_listing, restart validate={mode!r:8} {r[f'restart_{mode}']['s']:8.2f} s  "
              f"({r['fresh_open']['s'] / r[f'restart_{mode}']['s']:.0f}x faster than fresh)", flush=True)
    if args.warm_epochs:
        from ucmagic import UCVolumeDataset

        UCVolumeDataset(root, cache_dir=cache + "-warm").warm(background=False, threads=32)
        w = step("warm_epochs", root=root, cache=cache + "-warm")
        r["warm_epochs"] = w
        for mode in ("dirs", "lazy"):
            print(f"warm epochs, one process, validate={mode!r:7}: open {w[f'{mode}_open_s']:6.2f} s, epoch 1 "
                  f"{w[f'{mode}_epoch0_s']:6.2f} s, epoch 2 {w[f'{mode}_epoch1_s']:6.2f} s", flush=True)
    if not args.skip_volume_list:
        r["volume_list"] = step("volume_list", root=root)
        print(f"Volume.list (today):                 {r['volume_list']['s']:8.2f} s", flush=True)
    if not args.skip_walk:
        for st in {"both": (False, True), "names": (False,), "stat": (True,)}[args.walk]:
            w = step("walk", root=root, stat=st)
            r[f"walk_stat{int(st)}"] = w
            print(f"os.walk single-threaded{' + stat' if st else '         '}:     {w['s']:8.2f} s  "
                  f"(open_listing {w['s'] / r['fresh_open']['s']:.1f}x faster)", flush=True)
    for t in [int(x) for x in args.pwalk.split(",") if x]:
        w = step("pwalk", root=root, threads=t)
        r[f"pwalk{t}"] = w
        print(f"bare scandir + stat walk, {t:3d} threads: {w['s']:8.2f} s", flush=True)
    out[label] = r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=1_000_000)
    ap.add_argument("--per-dir", type=int, default=100)
    ap.add_argument("--data", default=os.path.join(tempfile.gettempdir(), "ucmagic-bench-listing"))
    ap.add_argument("--procs", type=int, default=8, help="processes for the memory test (2 ranks x 4 workers)")
    ap.add_argument("--fuse", action="store_true", help="also measure through the P20 FUSE volume")
    ap.add_argument("--list-ms", type=float, default=50.0)
    ap.add_argument("--skip-walk", action="store_true")
    ap.add_argument("--walk", choices=("both", "names", "stat"), default="both",
                    help="os.walk variants to time (on FUSE each is long at 1 M files)")
    ap.add_argument("--restart", default="files,dirs,none", help="validate= modes to time a restart with")
    ap.add_argument("--skip-volume-list", action="store_true")
    ap.add_argument("--warm-epochs", action="store_true",
                    help='time warm epochs after a restart with validate="lazy" (first-use checks) vs "dirs"')
    ap.add_argument("--list-threads", type=int, default=16, help="LocalVolume(list_threads=) of the fresh listing")
    ap.add_argument("--pwalk", default="", help="thread counts of a bare parallel walk to time, e.g. 16,64")
    ap.add_argument("--skip-local", action="store_true", help="only the FUSE part (with --fuse)")
    ap.add_argument("--skip-memory", action="store_true", help="skip the pickles and N-process memory parts")
    ap.add_argument("--dataset", action="store_true", help="also run UCVolumeDataset: ranks x spawned workers")
    ap.add_argument("--only-dataset", action="store_true", help="run only the --dataset part")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--json", default="")
    ap.add_argument("--step", help=argparse.SUPPRESS)
    ap.add_argument("--kw", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.step:
        print(json.dumps(run_step(args.step, json.loads(args.kw))))
        return

    os.makedirs(args.data, exist_ok=True)
    root = os.path.join(args.data, "tree")
    generate(root, args.files, args.per_dir)
    work = tempfile.mkdtemp(prefix="ucmagic-bench-listing-")
    out: dict = {"files": args.files, "per_dir": args.per_dir, "procs": args.procs}
    try:
        cache = os.path.join(work, "cache")
        if args.dataset or args.only_dataset:
            sys.path.insert(0, ROOT)
            run_dataset(root, os.path.join(work, "cache-ds"), args, out)
        if not args.only_dataset:
            measure_all(root, cache, work, args, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def measure_all(root: str, cache: str, work: str, args, out: dict) -> None:
    if not args.skip_local:
        measure("local", root, cache, args, out)
    if not args.skip_memory:
        memory_all(root, cache, args, out)
    if args.fuse:
        from ucmagic.testing import fuse_available, mount_slow_volume

        if not fuse_available():
            print("FUSE not available here: skipped", flush=True)
        else:
            mnt = os.path.join(work, "mnt")
            with mount_slow_volume(root, mnt, open_ms=20, mbps=200, list_ms=args.list_ms):
                import psutil

                daemon = next((c for c in psutil.Process().children() if "ucmagic._slowfuse" in " ".join(c.cmdline())),
                              None)
                measure(f"fuse_P20_list{args.list_ms:g}ms", mnt, os.path.join(work, "cache-fuse"), args, out, daemon)


def memory_all(root: str, cache: str, args, out: dict) -> None:
    sys.path.insert(0, ROOT)
    from ucmagic.files.listing import open_listing
    from ucmagic.files.volume import LocalVolume

    p = run_in_child("pickles", root=root, cache=cache)
    out["pickles"] = p
    print(f"\npickled: list of FileEntry {p['list'] / 1e6:.1f} MB, UCVolumeDataset plain pickle "
          f"{p['dataset'] / 1e6:.1f} MB, Listing {p['listing']} bytes", flush=True)
    vol = LocalVolume(root)
    blobs = {"list": pickle.dumps(vol.list()), "mapped": pickle.dumps(open_listing(vol, None, cache))}
    for kind, blob in blobs.items():
        m = memory(kind, blob, args.procs)
        out[f"memory_{kind}"] = m
        n = p["files"]
        print(f"memory per process, {kind:6}: RSS {max(m['rss']) / n:6.1f}  USS {max(m['uss']) / n:6.1f}  "
              f"PSS {max(m['pss']) / n:6.1f} B/file (max of {args.procs}); node total PSS "
              f"{sum(m['pss']) / n:6.1f} B/file", flush=True)


if __name__ == "__main__":
    main()
