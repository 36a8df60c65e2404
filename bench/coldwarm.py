"""Cold/warm epochs on FUSE slow volumes: ucmagic vs the I/O limit and its peers (SPEC section 4).

    python bench/coldwarm.py [--files 2000] [--size 150KiB] [--rounds 3] [--profiles P20,P100]
    python bench/coldwarm.py --scale-files 200000 [--rounds 1] [--profiles ""]   # + the scale case
    python bench/coldwarm.py --baseline main~20 [--rounds 5]   # before/after: + the same bench over REF

Mounts two slow volumes (P20: 20 ms per open, 200 MB/s per stream; P100: 100 ms, 100 MB/s) with
``ucmagic.testing.mount_slow_volume`` under ``/Volumes/bench/...`` (databricks-sdk-air accepts
only such paths), then runs each contender in its own fresh process, interleaved over rounds,
and prints medians and the SPEC's ratios. Contenders:

- ``raw``: the I/O limit, a bare copy of every file by 4 processes x 64 threads;
- ``torch0`` / ``torch6``: torch.utils.data.DataLoader over a map-style dataset reading each file
  from the volume, 0 and 6 workers (``torch0`` is timed on a subset and scaled: it takes minutes);
- ``dbair``: ``databricks-sdk-air[data]==0.1.1`` UCVolumeDataset + its DataLoader, defaults
  (venv at ``$DBAIR_PYTHON``, default /tmp/venv-dbair/bin/python, with the same torch and numpy as
  this one: docs/benchmarks.md);
- ``litdata``: litdata ``StreamingRawDataset(dir, cache_files=True, item_type="path", recompute_index=True)``
  (it writes an index file into the data directory; without recompute_index a second mount of the
  same files reads the first mount's paths) under a
  torch DataLoader with 6 workers (venv at ``$LITDATA_PYTHON``);
- ``ucmagic``: ``UCVolumeDataset`` + ``ucmagic.DataLoader`` with defaults: a cold and a warm epoch;
- ``restart``: ucmagic in a fresh process on the same cache (a kernel restart);
- ``ucbudget``: ucmagic's cold epoch with ``cache_limit`` set to half the data (issue 23: <= 1.5x unbudgeted);
- ``direct``: a plain loop reading the cached files from local disk (the warm reference);
- ``baseline`` (with ``--baseline REF``): the ``ucmagic`` contender's cold and warm epoch, run by this same
  script in its own child process whose ``ucmagic`` is imported from a ``git worktree`` of REF (checked
  out in a temp dir, removed at the end), interleaved with the other contenders; with ``--scale-files``,
  ``scale-base`` does the same for the scale case. Rounds default to 5 then; the report adds a
  before/after table (medians) and the per-round ratios.

Every loop reads the bytes of every file it is handed. Memory is the peak of the summed PSS, and
beside it the summed USS (memory no other process shares), of the contender's whole process tree,
sampled every 100 ms. Client CPU is the user + system seconds of the
contender's process and all its children (loader workers, copy processes) over each epoch: live
ones through psutil, exited ones through the rusage of reaped children. The FUSE server's CPU is not
client CPU and is not counted.

Scale case (``--scale-files N``, 0 = off): N files of 1 KiB on local disk (no FUSE), one process,
``num_workers=0``: the listing (``UCVolumeDataset(...)``), a cold epoch vs a raw copy by 8 threads,
and a warm epoch vs a plain walk-and-read loop over the source tree, each in a fresh process,
interleaved over rounds. Use 3 rounds or more: a run's first contender, whichever it is, was up to
40 s slower than the others in session 17's runs. Start the run several minutes after any large
deletion (an earlier run's caches, removed when it ends): ext4 without a journal re-checks, at each
new file, every inode freed in the last minutes (docs/benchmarks.md, session 17). Per-round ratios
are printed beside the medians.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

from _child import RemovedAtExit, run_sampled, tree_memory  # bench/ is on sys.path when a benchmark runs as a script

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILES = {"P20": {"open_ms": 20, "mbps": 200}, "P100": {"open_ms": 100, "mbps": 100}}
BATCH = 32


# ---------------------------------------------------------------- contenders (run in a child process)

def _read(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def client_cpu() -> float:
    """CPU seconds (user + system) of this process and every child it has or had (reaped ones included)."""
    import psutil

    me = psutil.Process()
    t = me.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for c in me.children(recursive=True):
        try:
            ct = c.cpu_times()
            total += ct.user + ct.system
        except psutil.NoSuchProcess:  # exited since the listing: counted once reaped
            pass
    return total


def _timed(fn) -> dict:
    """Run ``fn() -> dict`` (an epoch), adding its wall seconds and client CPU seconds."""
    c0, t0 = client_cpu(), time.perf_counter()
    out = fn()
    out.setdefault("secs", time.perf_counter() - t0)
    out["cpu"] = client_cpu() - c0
    return out


def _epoch(loader, read_paths: bool) -> dict:
    c0 = client_cpu()
    t0 = time.perf_counter()
    first, n, nbytes = None, 0, 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        for x in batch:
            nbytes += _read(x) if read_paths else int(x)
            n += 1
    return {"secs": time.perf_counter() - t0, "first": first, "files": n, "bytes": nbytes, "cpu": client_cpu() - c0}


class _VolumeFiles:
    """Map-style dataset: what users write without a cache (read each file from the volume)."""

    def __init__(self, paths):
        self.paths = paths

    def __len__(self):
        return len(self.paths)

    def __getitem__(self, i):
        return _read(self.paths[i])


def _listing(vol: str) -> list[str]:
    return sorted(os.path.join(vol, f) for f in os.listdir(vol))


def child(mode: str, vol: str, cache: str, limit: int) -> dict:
    t_setup = time.perf_counter()
    if mode == "raw":
        from concurrent.futures import ProcessPoolExecutor

        files = _listing(vol)
        chunks = [files[i::4] for i in range(4)]
        c0 = client_cpu()
        with ProcessPoolExecutor(4) as ex:
            t0 = time.perf_counter()
            total = sum(ex.map(_raw_copy, chunks, [cache] * 4))
            secs = time.perf_counter() - t0
        return {"epochs": [{"secs": secs, "first": None, "files": len(files), "bytes": total,
                            "cpu": client_cpu() - c0}]}
    if mode.startswith("scale-"):
        return scale_child(mode, vol, cache)
    if mode in ("torch0", "torch6"):
        import torch.utils.data as tud

        files = _listing(vol)[: limit or None]
        loader = tud.DataLoader(_VolumeFiles(files), batch_size=BATCH, num_workers=0 if mode == "torch0" else 6)
        setup = time.perf_counter() - t_setup
        return {"setup": setup, "epochs": [_epoch(loader, False)]}
    if mode == "dbair":
        from databricks.air.data import DataLoader, UCVolumeDataset

        ds = UCVolumeDataset(vol)
        loader = DataLoader(ds, batch_size=BATCH)
        setup = time.perf_counter() - t_setup
        return {"setup": setup, "workers": loader.num_workers, "epochs": [_epoch(loader, True)]}
    if mode == "litdata":
        import torch.utils.data as tud
        from litdata import StreamingRawDataset

        ds = StreamingRawDataset(vol, cache_dir=cache, cache_files=True, item_type="path", recompute_index=True)
        loader = tud.DataLoader(ds, batch_size=BATCH, num_workers=6)
        setup = time.perf_counter() - t_setup
        return {"setup": setup, "epochs": [_epoch(loader, True)]}
    if mode in ("ucmagic", "restart", "baseline"):  # baseline: the same, with ucmagic from the REF worktree
        import ucmagic
        from ucmagic import DataLoader, UCVolumeDataset

        ds = UCVolumeDataset(vol, cache_dir=cache)
        loader = DataLoader(ds, batch_size=BATCH)
        setup = time.perf_counter() - t_setup
        epochs = [_epoch(loader, True) for _ in range(1 if mode == "restart" else 2)]
        return {"setup": setup, "epochs": epochs, "stats": {k: ds.stats()[k] for k in ("hits", "misses", "retries")},
                "code": os.path.dirname(os.path.dirname(os.path.abspath(ucmagic.__file__)))}
    if mode == "ucbudget":  # a cache_limit of half the data (``--limit`` bytes): one cold epoch
        from ucmagic import DataLoader, UCVolumeDataset

        ds = UCVolumeDataset(vol, cache_dir=cache, cache_limit=limit)
        loader = DataLoader(ds, batch_size=BATCH)
        setup = time.perf_counter() - t_setup
        return {"setup": setup, "epochs": [_epoch(loader, True)], "limit": limit}
    if mode == "direct":
        # every file the round's ucmagic run cached (the cache's files/ tree), read by a plain loop
        paths = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(cache, "files")) for f in fs]
        return {"epochs": [_timed(lambda: {"first": None, "files": len(paths), "bytes": sum(_read(p) for p in paths)})]}
    raise SystemExit(f"unknown mode {mode}")


def scale_child(mode: str, src: str, cache: str) -> dict:
    """The scale case: ``scale-uc`` (listing, cold and warm epoch), ``scale-raw`` (8-thread copy),
    ``scale-walk`` (a plain loop walking the source tree and reading every file). Each timed pass
    starts after ``os.sync()``: none pays for the kernel writing back an earlier step's files."""
    if mode in ("scale-uc", "scale-base"):  # scale-base: ucmagic from the REF worktree
        import ucmagic
        from ucmagic import DataLoader, UCVolumeDataset

        t0 = time.perf_counter()
        ds = UCVolumeDataset(src, cache_dir=cache)
        listing = time.perf_counter() - t0
        loader = DataLoader(ds, batch_size=BATCH, num_workers=0)
        epochs = []
        for _ in range(2):
            os.sync()  # the cold epoch's 200,000 new files are written back before the warm one is timed
            epochs.append(_epoch(loader, True))
        return {"setup": listing, "epochs": epochs,
                "code": os.path.dirname(os.path.dirname(os.path.abspath(ucmagic.__file__)))}
    if mode == "scale-raw":
        from concurrent.futures import ThreadPoolExecutor

        def walk() -> list[str]:
            return [os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs]

        def copy(rels: list[str]) -> dict:
            for d in {os.path.dirname(r) for r in rels}:
                os.makedirs(os.path.join(cache, d), exist_ok=True)

            def one(rel: str) -> int:
                shutil.copyfile(os.path.join(src, rel), os.path.join(cache, rel))
                return os.path.getsize(os.path.join(src, rel))

            with ThreadPoolExecutor(8) as ex:
                return {"first": None, "files": len(rels), "bytes": sum(ex.map(one, rels, chunksize=256))}

        os.sync()
        return {"epochs": [_timed(lambda: copy(walk()))]}
    if mode == "scale-walk":
        def walk_read() -> dict:
            n = nbytes = 0
            for d, _, fs in os.walk(src):
                for f in fs:
                    nbytes += _read(os.path.join(d, f))
                    n += 1
            return {"first": None, "files": n, "bytes": nbytes}

        os.sync()
        return {"epochs": [_timed(walk_read)]}
    raise SystemExit(f"unknown mode {mode}")


def _raw_copy(files: list[str], dest: str) -> int:
    from concurrent.futures import ThreadPoolExecutor

    os.makedirs(dest, exist_ok=True)

    def one(src: str) -> int:
        out = os.path.join(dest, os.path.basename(src))
        shutil.copyfile(src, out)
        return os.path.getsize(out)

    with ThreadPoolExecutor(64) as ex:
        return sum(ex.map(one, files))


# ---------------------------------------------------------------- parent: orchestration and memory

def run_child(python: str, mode: str, vol: str, cache: str, limit: int = 0, timeout: float = 900,
              code: str | None = None) -> dict:
    """One contender in a fresh process, its tree's memory sampled; ``code``: the directory ucmagic is
    imported from (default: this checkout; the baseline's worktree for ``baseline``/``scale-base``)."""
    cmd = [python, os.path.abspath(__file__), "--child", mode, "--vol", vol, "--cache", cache, "--limit", str(limit)]
    env = dict(os.environ, PYTHONPATH=code or os.path.dirname(HERE), UCMAGIC_PROGRESS="off")
    t0 = time.perf_counter()
    res, (pss, uss) = run_sampled(cmd, env, mode, tree_memory, 0.1, timeout)
    if "error" not in res:
        res["wall"] = time.perf_counter() - t0
        res["peak_mb"] = pss / 1e6
        res["uss_mb"] = uss / 1e6
    return res


@contextlib.contextmanager
def baseline_worktree(ref: str | None, workdir: str):
    """A detached ``git worktree`` of ``ref`` in a temp dir under ``workdir`` (None without a ref); removed after."""
    if not ref:
        yield None
        return
    import subprocess

    repo = os.path.dirname(HERE)
    os.makedirs(workdir, exist_ok=True)
    path = tempfile.mkdtemp(prefix="baseline-", dir=workdir)
    try:
        subprocess.run(["git", "-C", repo, "worktree", "add", "--detach", "--force", path, ref], check=True,
                       capture_output=True, text=True, timeout=120)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(path, ignore_errors=True)
        raise SystemExit(f"--baseline {ref}: git worktree add failed: {e.stderr.strip()}") from None
    rev = subprocess.run(["git", "-C", path, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         timeout=60).stdout.strip()
    print(f"baseline: {ref} ({rev}) checked out in {path}", flush=True)
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", repo, "worktree", "remove", "--force", path], capture_output=True, timeout=120)
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["git", "-C", repo, "worktree", "prune"], capture_output=True, timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", default="150KiB")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3; 5 with --baseline)")
    ap.add_argument("--profiles", default="P20,P100")
    ap.add_argument("--contenders", default="raw,torch0,torch6,dbair,litdata,ucmagic,restart,direct,ucbudget")
    ap.add_argument("--torch0-files", type=int, default=200, help="torch0 is timed on this many files and scaled")
    ap.add_argument("--workdir", default="/tmp/ucmagic-bench")
    ap.add_argument("--json", default=None, help="also write all results here")
    ap.add_argument("--baseline", default=None, metavar="REF",
                    help="also run the ucmagic contender over a git worktree of REF (a commit, branch or tag): "
                         "before/after medians")
    ap.add_argument("--scale-files", type=int, default=0,
                    help="also run the scale case on this many 1 KiB files on local disk (the issue's: 200000)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vol", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.vol, a.cache, a.limit)), flush=True)
        return
    if a.rounds is None:
        a.rounds = 5 if a.baseline else 3
    with baseline_worktree(a.baseline, a.workdir) as base:
        run_all(a, base)


def run_all(a: argparse.Namespace, base: str | None) -> None:
    """The runs of :func:`main`; ``base`` is the baseline's worktree (None without ``--baseline``)."""

    sys.path.insert(0, os.path.dirname(HERE))
    from ucmagic.testing import fuse_available, make_files, mount_slow_volume
    from ucmagic.units import parse_size

    profiles = [p for p in a.profiles.split(",") if p]
    if profiles and not fuse_available():
        raise SystemExit("needs FUSE: apt-get install fuse3 && pip install mfusepy (and /dev/fuse)")
    pythons = {"dbair": os.environ.get("DBAIR_PYTHON", "/tmp/venv-dbair/bin/python"),
               "litdata": os.environ.get("LITDATA_PYTHON", "/tmp/venv-litdata/bin/python")}
    contenders = [c for c in a.contenders.split(",") if c]
    if base and "baseline" not in contenders:
        contenders.append("baseline")
    if not base and "baseline" in contenders:
        raise SystemExit("the baseline contender needs --baseline REF")
    for c in ("dbair", "litdata"):
        if c in contenders and not os.path.exists(pythons[c]):
            print(f"skipping {c}: no interpreter at {pythons[c]}", file=sys.stderr)
            contenders.remove(c)
    src = os.path.join(a.workdir, "src")
    if not os.path.isdir(src) or len([f for f in os.listdir(src) if f.endswith(".bin")]) != a.files:
        shutil.rmtree(src, ignore_errors=True)
        make_files(src, a.files, parse_size(a.size), depth=0)  # flat: databricks-sdk-air lists one level only
    for stray in [f for f in os.listdir(src) if not f.endswith(".bin")]:
        os.remove(os.path.join(src, stray))
    expected = set(os.listdir(src))
    results: dict[str, dict[str, list[dict]]] = {p: {c: [] for c in contenders} for p in profiles}
    with ContextlibExit() as stack:
        kept = stack.enter_context(RemovedAtExit())  # outputs go when the run ends (see RemovedAtExit)
        mounts = {p: stack.enter_context(mount_slow_volume(src, f"/Volumes/bench/slow/{p.lower()}", list_ms=50,
                                                             **PROFILES[p])) for p in profiles}
        for rnd in range(a.rounds):
            for p in profiles:
                vol = mounts[p]
                ucache = kept.add(tempfile.mkdtemp(prefix="ucache-", dir=a.workdir))
                for c in _rotated(contenders, rnd):
                    python = pythons.get(c, sys.executable)
                    shared = c in ("ucmagic", "restart", "direct")
                    cache = ucache if shared else kept.add(tempfile.mkdtemp(dir=a.workdir))
                    limit = a.torch0_files if c == "torch0" else 0
                    if c == "ucbudget":
                        limit = a.files * parse_size(a.size) // 2  # half the data
                    if c == "torch0" and rnd > 0:
                        continue  # minutes per run: once is enough
                    r = run_child(python, c, vol, cache, limit, code=base if c == "baseline" else None)
                    for stray in set(os.listdir(src)) - expected:  # litdata writes an index into the data dir
                        os.remove(os.path.join(src, stray))
                    if c == "torch0" and "epochs" in r:
                        scale = a.files / max(1, r["epochs"][0]["files"])
                        r["epochs"][0]["secs"] *= scale
                        r["epochs"][0]["cpu"] *= scale
                        r["scaled_from"] = r["epochs"][0]["files"]
                    results[p][c].append(r)
                    status = r.get("error") or " ".join(f"{e['secs']:.2f}s ({e['cpu']:.1f} cpu-s)" for e in r["epochs"])
                    print(f"[round {rnd + 1}] {p} {c:8s} {status}  peak {r.get('peak_mb', 0):.0f} MB", flush=True)
    if profiles:
        report(results, a.files)
        if base:
            report_baseline(results, a.baseline)
    if a.scale_files:
        results["scale"] = run_scale(a.workdir, a.scale_files, a.rounds, base)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


SCALE_CONTENDERS = ("scale-uc", "scale-raw", "scale-walk")


def run_scale(workdir: str, n: int, rounds: int, base: str | None = None) -> dict[str, list[dict]]:
    """The scale case: ``n`` files of 1 KiB on local disk, each contender in a fresh process, interleaved;
    with ``base`` (the baseline's worktree) ``scale-base`` too."""
    contenders = SCALE_CONTENDERS + (("scale-base",) if base else ())
    from ucmagic.testing import make_files

    src = os.path.join(workdir, f"scale-{n}")
    if not os.path.isdir(src):
        t0 = time.perf_counter()
        make_files(src + ".part", n, 1024, depth=1, per_dir=1000)
        os.replace(src + ".part", src)
        print(f"scale: wrote {n} files of 1 KiB in {time.perf_counter() - t0:.0f} s", flush=True)
    res: dict[str, list[dict]] = {c: [] for c in contenders}
    with RemovedAtExit() as kept:  # outputs go when the run ends (see RemovedAtExit)
        for rnd in range(rounds):
            k = rnd % len(contenders)
            for c in contenders[k:] + contenders[:k]:
                cache = kept.add(tempfile.mkdtemp(prefix="scale-", dir=workdir))
                r = run_child(sys.executable, c, src, cache, timeout=1800, code=base if c == "scale-base" else None)
                res[c].append(r)
                status = r.get("error") or " ".join(f"{e['secs']:.2f}s ({e['cpu']:.1f} cpu-s)" for e in r["epochs"])
                listing = f"  listing {r['setup']:.2f}s" if "setup" in r else ""
                print(f"[round {rnd + 1}] scale {c:10s} {status}" + listing, flush=True)
    ok = {c: [r for r in runs if "epochs" in r] for c, runs in res.items()}
    uc, raw, walk = ok["scale-uc"], ok["scale-raw"], ok["scale-walk"]
    print(f"\n== scale: {n} files of 1 KiB on local disk, one process, num_workers=0, medians ==")
    print(f"  listing                 {_medv(uc, 'setup'):7.2f} s")
    cold, rawc = _med(uc), _med(raw)
    warm, direct = _med(uc, epoch=1), _med(walk)
    print(f"  cold epoch              {cold:7.2f} s  ({n / cold:,.0f} files/s, {_med(uc, 'cpu'):.1f} cpu-s)   "
          f"raw 8-thread copy {rawc:.2f} s ({_med(raw, 'cpu'):.1f} cpu-s)   ratio {cold / rawc:.2f}")
    print(f"  warm epoch              {warm:7.2f} s  ({n / warm:,.0f} files/s, {_med(uc, 'cpu', 1):.1f} cpu-s)   "
          f"walk-and-read {direct:.2f} s ({_med(walk, 'cpu'):.1f} cpu-s)   ratio {warm / direct:.2f}  [<= 1.5]")
    print(f"  bookkeeping per file, cold: {(cold - rawc) / n * 1e6:.0f} us over the raw copy")
    per_round = [(u["epochs"][0]["secs"] / r["epochs"][0]["secs"]) for u, r in zip(res["scale-uc"], res["scale-raw"])
                 if "epochs" in u and "epochs" in r]
    print("  cold / raw copy per round: " + ", ".join(f"{x:.2f}" for x in per_round))
    if base:
        before = ok["scale-base"]
        print(f"  before/after: listing {_medv(before, 'setup'):.2f} -> {_medv(uc, 'setup'):.2f} s, "
              f"cold {_med(before):.2f} -> {cold:.2f} s, warm {_med(before, epoch=1):.2f} -> {warm:.2f} s  "
              "[after not slower]")
        print(f"  baseline ucmagic imported from: {', '.join(sorted({r.get('code', '?') for r in before}))}")
    return res


def _rotated(contenders: list[str], rnd: int) -> list[str]:
    """Contenders in a different order each round (a mount's first reader is often the fastest);
    ucmagic, restart and direct stay together and in that order (they share the round's cache)."""
    units: list[list[str]] = []
    for c in contenders:
        if c in ("restart", "direct") and units and units[-1][0] == "ucmagic":
            units[-1].append(c)
        else:
            units.append([c])
    k = rnd % len(units) if units else 0
    return [c for unit in units[k:] + units[:k] for c in unit]


class ContextlibExit:
    """A tiny ExitStack alias so mounts are undone even when a contender crashes."""

    def __enter__(self):
        import contextlib

        self._s = contextlib.ExitStack()
        return self._s.__enter__()

    def __exit__(self, *exc):
        return self._s.__exit__(*exc)


def _med(runs: list[dict], key: str = "secs", epoch: int = 0) -> float:
    vals = [r["epochs"][epoch][key] for r in runs if "epochs" in r and len(r["epochs"]) > epoch
            and r["epochs"][epoch].get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def _medv(runs: list[dict], key: str) -> float:
    vals = [r[key] for r in runs if key in r]
    return statistics.median(vals) if vals else float("nan")


def report(results: dict, files: int) -> None:
    for p, res in results.items():
        print(f"\n== {p}: {PROFILES[p]['open_ms']} ms per open, {PROFILES[p]['mbps']} MB/s per stream, "
              f"{files} files ==")
        print(f"{'contender':10s} {'epoch s':>8s} {'warm s':>7s} {'1st batch s':>11s} {'setup s':>8s} {'peak MB':>8s} "
              f"{'USS MB':>7s} {'cpu s':>6s} {'warm cpu s':>10s}")
        for c, runs in res.items():
            ok = [r for r in runs if "epochs" in r]
            if not ok:
                print(f"{c:10s} failed: {runs[0].get('error') if runs else 'not run'}")
                continue
            two = c in ("ucmagic", "baseline")  # a cold and a warm epoch
            warm = _med(ok, epoch=1) if two else float("nan")
            wcpu = _med(ok, "cpu", 1) if two else float("nan")
            print(f"{c:10s} {_med(ok):8.2f} {warm:7.2f} {_med(ok, 'first'):11.2f} {_medv(ok, 'setup'):8.2f} "
                  f"{_medv(ok, 'peak_mb'):8.0f} {_medv(ok, 'uss_mb'):7.0f} {_med(ok, 'cpu'):6.2f} {wcpu:10.2f}"
                  + (f"  (scaled from {ok[0]['scaled_from']} files)" if "scaled_from" in ok[0] else ""))
        def get(c: str, res: dict = res, **kw) -> float:
            return _med([r for r in res.get(c, []) if "epochs" in r], **kw)

        cold, raw = get("ucmagic"), get("raw")
        print("ratios (targets in brackets):")
        print(f"  ucmagic cold / raw-copy limit      {cold / raw:5.2f}  [<= 1.1]")
        cpu_ratio = get('ucmagic', key='cpu') / get('raw', key='cpu')
        print(f"  ucmagic cold CPU / raw-copy CPU    {cpu_ratio:5.2f}  [<= 1.25]")
        if res.get("dbair"):
            print(f"  databricks-sdk-air / ucmagic cold  {get('dbair') / cold:5.2f}  [>= {1.2 if p == 'P20' else 2.0}]")
            for key, what in (("peak_mb", "PSS"), ("uss_mb", "USS")):
                pm = _medv([r for r in res["ucmagic"] if "epochs" in r], key) / _medv(
                    [r for r in res["dbair"] if "epochs" in r], key)
                print(f"  peak memory ucmagic / databricks   {pm:5.2f}  [<= 0.5]  (summed {what} of each process tree)")
        print(f"  ucmagic first batch (s)            {get('ucmagic', key='first'):5.2f}  [<= 0.5]")
        if res.get("direct"):
            print(f"  ucmagic warm / direct local read   {get('ucmagic', epoch=1) / get('direct'):5.2f}  [<= 1.5]"
                  f"  (absolute: {get('ucmagic', epoch=1):.2f} s vs {get('direct'):.2f} s)")
        if res.get("ucbudget"):
            print(f"  half-data budget / unbudgeted cold {get('ucbudget') / cold:5.2f}  [<= 1.5]"
                  f"  (absolute: {get('ucbudget'):.2f} s)")
        if res.get("restart"):
            print(f"  restart epoch / warm epoch         {get('restart') / get('ucmagic', epoch=1):5.2f}  [<= 1.5]"
                  f"  (absolute: {get('restart'):.2f} s)")
        for c in ("torch0", "torch6", "litdata"):
            if res.get(c):
                print(f"  {c} / ucmagic cold{' ' * (17 - len(c))}{get(c) / cold:5.2f}")



def report_baseline(results: dict, ref: str) -> None:
    """Before (``--baseline REF``) and after (this checkout), medians over the rounds, per profile."""
    def ok(res: dict, c: str) -> list[dict]:
        return [r for r in res.get(c, []) if "epochs" in r]

    for p, res in results.items():
        before, after, raw = ok(res, "baseline"), ok(res, "ucmagic"), ok(res, "raw")
        if not before or not after:
            print(f"\n== {p}: before/after: no successful {'baseline' if not before else 'ucmagic'} run")
            continue
        print(f"\n== {p}: before ({ref}, {len(before)} runs) / after (this checkout, {len(after)} runs), medians ==")
        rows = [("cold epoch s", _med(before), _med(after), "not slower"),
                ("warm epoch s", _med(before, epoch=1), _med(after, epoch=1), "not slower"),
                ("client CPU per cold epoch s", _med(before, "cpu"), _med(after, "cpu"), "not worse")]
        if raw:
            rc = _med(raw, "cpu")
            rows.append(("cold CPU / raw-copy CPU", _med(before, "cpu") / rc, _med(after, "cpu") / rc, "<= 1.25"))
        rows += [("peak memory MB (summed PSS)", _medv(before, "peak_mb"), _medv(after, "peak_mb"), ""),
                 ("peak memory MB (summed USS)", _medv(before, "uss_mb"), _medv(after, "uss_mb"), "")]
        print(f"  {'':30s} {'before':>9s} {'after':>9s} {'after/before':>12s}")
        for name, b, a, target in rows:
            ratio = a / b if b else float("nan")
            print(f"  {name:30s} {b:9.2f} {a:9.2f} {ratio:12.2f}" + (f"  [{target}]" if target else ""))
        cold = [f"{x['epochs'][0]['secs'] / y['epochs'][0]['secs']:.2f}" for x, y in zip(after, before)]
        print("  after/before cold per round: " + ", ".join(cold))
        code = sorted({r.get("code", "?") for r in before})
        print(f"  baseline ucmagic imported from: {', '.join(code)}")


if __name__ == "__main__":
    main()
