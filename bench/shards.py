"""Packed shards on a FUSE slow volume: ucmagic.pack + TarShards vs MosaicML Streaming and litdata.

    python bench/shards.py [--images 15000] [--size 150KiB] [--shard-size 256MB] [--rounds 3]
                           [--contenders pack,mds,litopt,ucmagic,mosaic,litdata,files,ranged] [--big-gib 10]
                           [--lit-workers 16] [--timeout 600] [--max-minutes 0] [--workdir DIR] [--json FILE]
                           [--no-budget]
    python bench/shards.py --images 300 --shard-size 8MB --big-gib 0.05 --rounds 1   # a smoke run (no figures)

One run prints one table (a row per system: conversion s, cold and warm epoch samples/s, first batch
s, shuffle quality, peak cache under a two-shard budget), then the issue's targets as measured
ratios, with the first sample of a packed ``--big-gib`` shard and the index time of the same tar as
a foreign shard. ``--max-minutes M`` starts no round that would end past M minutes (the report says
how many rounds it took medians of); ``--timeout`` bounds each contender run (a run past it is
killed with its worker processes and reported as failed). The disk needed (about 6x the images
plus 2.1x ``--big-gib``) is checked first.

Images (``--images`` files of ``--size`` random bytes, ``<class>/<n>.jpg`` in 10 class folders) sit on
a FUSE mount made by ``ucmagic.testing.mount_slow_volume`` with the P100 profile (100 ms per open,
100 MB/s per read stream) under ``/Volumes/bench/shards/src``; the shards each converter writes go to
local disk and are read back through a second P100 mount (``/Volumes/bench/shards/out``). Every
contender runs in its own fresh process, interleaved over rounds (the order rotates each round), after
an ``os.sync()`` (``_child.run_sampled``: what the previous one wrote is on disk before this one
writes its cache); the report gives medians. ``--no-budget`` leaves out the runs under a cache
budget. Peers run in their own venvs under /tmp (``--system-site-packages`` with the same torch
pinned, made on first use; "peer not available" when that fails):
``mosaicml-streaming==0.13.0`` (/tmp/venv-mosaic) and ``litdata==0.2.76`` (/tmp/venv-litdata).

Conversion (source mount -> local shards of ``--shard-size``):
- ``pack``: ``ucmagic.pack(src, out, shard_size, label_from_folder=True)``, defaults otherwise;
- ``mds``: Mosaic's documented loop, ``MDSWriter(columns={"jpg": "bytes", "cls": "int", "idx": "int"},
  size_limit=shard_size)`` writing each file in order, the files read by 64 threads ahead of it (as many
  reads in flight as ``pack``: a plain loop would wait 100 ms per open);
- ``litopt``: ``litdata.optimize(fn=read one file, inputs=files, chunk_bytes=shard_size,
  num_workers=--lit-workers)`` (processes; 16 by default: each reads its files one at a time, 100 ms
  per open, so two would take 12 minutes for 15,000 files).

Reading (shards through the output mount; a cold epoch on an empty cache, then a warm one in the
same process, shuffled, batch 32, 4 loader workers; every loop touches the bytes of every image):
- ``ucmagic``: ``TarShards(out) .stream(shuffle=True)`` under ``ucmagic.DataLoader``;
- ``mosaic``: ``StreamingDataset(remote=out, local=cache, shuffle=True)`` under torch's DataLoader;
- ``litdata``: ``StreamingDataset("local:" + out, shuffle=True)`` under ``StreamingDataLoader``;
- ``files``: the same images as small files through ``UCVolumeDataset`` (the warm-epoch reference);
- ``ranged``: the limit, a raw copy of the packed shards by 32 threads reading 16 MiB ranges
  (``bench/bigfiles.py``'s copy).
Each shard reader also runs once under a cache budget of two shards (cold epoch, peak cache bytes:
the allocated blocks of its cache directory, sampled every 50 ms; Mosaic refuses a ``cache_limit``
under four times its largest shard, so it runs at that minimum). Time to the first sample counts from
the dataset's construction. Shuffle quality is ``ucmagic.shards.distinct_files(shards, k=32)``: the
mean number of distinct shards among each 32 consecutive samples of the shuffled epoch (the shard
of a peer's sample is found from the index it wrote).

``--big-gib N`` (0 = off): one packed shard of N GiB (images of ``--size``, made once and kept under
``--workdir``/bigroot), on its own P100 mount: in each round, the time from constructing ``TarShards``
to its first sample (``ds[0]``, one chunk fill) on a cold cache, and the time to index the same tar
without ``index.json`` (a foreign shard: header reads only).

Shuffle quality and peak cache: ucmagic's shuffled stream keeps each chunk until the last sample of
its window needs it, so under a two-shard budget smaller than the four workers' windows the peak is
the windows (docs/shards.md, "Sizing a budget"); the report prints that documented bound beside it.
The budget run is repeated with the largest window the budget holds (no read-ahead; one chunk for
256 MB shards and 4 workers): its peak (bound: budget plus two chunks per stream) and the shuffle
quality it costs are the row "ucmagic @budget, window N".
"""
from __future__ import annotations

import argparse
import bisect
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _child import run_sampled  # bench/ is on sys.path when a benchmark runs as a script
from bigfiles import _allocated, _ranged  # one home for the cache sampler and the ranged-copy limit

HERE = os.path.dirname(os.path.abspath(__file__))
PROFILE = {"open_ms": 100, "mbps": 100}
CLASSES = 10
BATCH = 32
WORKERS = 4
CHUNK = 32 << 20  # TarShards' default chunk size
PEERS = {"mosaic": ("/tmp/venv-mosaic", "mosaicml-streaming==0.13.0", "streaming"),
         "litdata": ("/tmp/venv-litdata", "litdata==0.2.76", "litdata")}
PEER_OF = {"mds": "mosaic", "mosaic": "mosaic", "litopt": "litdata", "litdata": "litdata"}
CONVERT = ("pack", "mds", "litopt")
READ = ("ucmagic", "mosaic", "litdata", "files", "ranged")
OUT_OF = {"ucmagic": "pack", "mosaic": "mds", "litdata": "litopt", "ranged": "pack"}


# ---------------------------------------------------------------- contenders (run in a child process)

def _images(src: str) -> list[tuple[str, int]]:
    out = []
    for c in sorted(os.listdir(src)):
        d = os.path.join(src, c)
        if os.path.isdir(d):
            out += [(os.path.join(d, f), int(c[1:])) for f in sorted(os.listdir(d))]
    return out


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def stub_torchvision() -> None:
    """Let ``import streaming`` work without torchvision: streaming's vision subpackage (unused here)
    imports it, and PyPI's torchvision wheel does not load against a CPU build of torch. Any
    ``torchvision.*`` becomes an empty module whose attributes are empty classes."""
    import importlib.abc
    import importlib.machinery
    import types

    class Stub(types.ModuleType):
        def __getattr__(self, name: str):
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if name == "torchvision" or name.startswith("torchvision."):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            return None

        def create_module(self, spec):
            return Stub(spec.name)

        def exec_module(self, module):
            module.__path__ = []

    sys.meta_path.insert(0, Finder())


def _lit_item(item: tuple[str, int, int]) -> dict:
    path, cls, idx = item
    return {"jpg": _read(path), "cls": cls, "idx": idx}


def convert(mode: str, src: str, out: str, shard_size: int, lit_workers: int = 16) -> dict:
    """Convert the images under ``src`` into shards in ``out``; timed from after the imports (listing included)."""
    shutil.rmtree(out, ignore_errors=True)
    if mode == "pack":
        import ucmagic

        t0 = time.perf_counter()
        res = ucmagic.pack(src, out, shard_size, label_from_folder=True, progress=False)
        samples = res.samples
    elif mode == "mds":
        stub_torchvision()
        from streaming import MDSWriter

        t0 = time.perf_counter()
        images = _images(src)
        from concurrent.futures import ThreadPoolExecutor

        with MDSWriter(out=out, columns={"jpg": "bytes", "cls": "int", "idx": "int"}, size_limit=shard_size) as w, \
                ThreadPoolExecutor(64) as pool:  # reads in flight as pack's: the writer itself is one stream
            for i, ((_, cls), data) in enumerate(zip(images, pool.map(_read, [p for p, _ in images]))):
                w.write({"jpg": data, "cls": cls, "idx": i})
        samples = len(images)
    elif mode == "litopt":
        from litdata import optimize

        t0 = time.perf_counter()
        images = _images(src)
        optimize(fn=_lit_item, inputs=[(p, c, i) for i, (p, c) in enumerate(images)], output_dir=out,
                 chunk_bytes=shard_size, num_workers=lit_workers)
        samples = len(images)
    else:
        raise SystemExit(f"unknown mode {mode}")
    secs = time.perf_counter() - t0
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(out) for f in fs)
    return {"convert": {"secs": secs, "samples": samples, "bytes": size}}


def _epoch(it, shard_of) -> dict:
    """One pass: wall seconds, first-batch seconds, samples, bytes and the shard of each sample."""
    t0 = time.perf_counter()
    first, n, nbytes, shards = None, 0, 0, []
    for batch in it:
        if first is None:
            first = time.perf_counter() - t0
        for key, size in batch:
            n += 1
            nbytes += size
            shards.append(shard_of(key))
    return {"secs": time.perf_counter() - t0, "first": first, "samples": n, "bytes": nbytes, "shards": shards}


def _quality(shards: list[int]) -> float:
    from ucmagic.shards import distinct_files

    return distinct_files(shards, 32)


def _cum_shard(counts: list[int]):
    cum = []
    total = 0
    for c in counts:
        total += c
        cum.append(total)
    return lambda idx: bisect.bisect_right(cum, idx)


def read(mode: str, vol: str, cache: str, limit: int, epochs: int, window: int = 8, read_ahead: int = -1) -> dict:
    t_setup = time.perf_counter()
    if mode == "ranged":
        files = sorted(os.path.join(vol, f) for f in os.listdir(vol) if f.endswith(".tar"))
        return {"epochs": [_ranged(files, cache)]}
    if mode in ("ucmagic", "files"):
        import ucmagic

        if mode == "ucmagic":
            from ucmagic.shards import TarShards

            ds = TarShards(vol, cache_dir=cache, cache_limit=limit or None)
            where = {k: int(f) for k, f in zip(ds.keys, ds.sample_file)}
            kw = {} if read_ahead < 0 else {"read_ahead": read_ahead}  # -1: the stream's default
            source = ds.stream(shuffle=True, seed=0, shuffle_window=window, **kw)

            def collate(b):
                return [(s["__key__"], len(s["jpg"])) for s in b]

            def shard_of(k):
                return where[k]
        else:
            source = ucmagic.UCVolumeDataset(vol, cache_dir=cache, cache_limit=limit or None, shuffle=True)

            def collate(b):
                return [(p, len(_read(p))) for p in b]

            def shard_of(k):
                return 0
        loader = ucmagic.DataLoader(source, batch_size=BATCH, num_workers=WORKERS, collate_fn=collate)
    elif mode == "mosaic":
        import torch

        stub_torchvision()
        from streaming import StreamingDataset
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        with open(os.path.join(vol, "index.json")) as f:
            shards = json.load(f)["shards"]
        shard_of = _cum_shard([s["samples"] for s in shards])
        if limit:  # Mosaic refuses a cache_limit under four times its largest shard: it gets that minimum
            limit = max(limit, 4 * max(s["raw_data"]["bytes"] for s in shards))
        ds = StreamingDataset(remote=vol, local=os.path.join(cache, "local"), shuffle=True, shuffle_seed=0,
                              shuffle_algo="py1e", batch_size=BATCH, cache_limit=limit or None)

        def collate(b):
            return [(int(s["idx"]), len(s["jpg"])) for s in b]

        loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=collate)
    elif mode == "litdata":
        from litdata import StreamingDataLoader, StreamingDataset

        kw = {"max_cache_size": limit} if limit else {}
        ds = StreamingDataset("local:" + vol, cache_dir=os.path.join(cache, "lit"), shuffle=True, seed=0, **kw)

        def collate(b):
            return [(int(s["idx"]), len(s["jpg"])) for s in b]

        shard_of = None
        loader = StreamingDataLoader(ds, batch_size=BATCH, num_workers=WORKERS, collate_fn=collate)
    else:
        raise SystemExit(f"unknown mode {mode}")
    setup = time.perf_counter() - t_setup
    runs = []
    for _ in range(epochs):
        runs.append(_epoch(loader, shard_of or (lambda k: 0)))
    runs[0]["first_from_setup"] = setup + runs[0]["first"]
    if mode == "litdata":  # a litdata sample's chunk: its position in the unshuffled order (untimed)
        from litdata import StreamingDataset

        with open(os.path.join(vol, "index.json")) as f:
            where_pos = _cum_shard([c["chunk_size"] for c in json.load(f)["chunks"]])
        plain = StreamingDataset("local:" + vol, cache_dir=os.path.join(cache, "lit-plain"), shuffle=False)
        chunk = {int(s["idx"]): where_pos(p) for p, s in enumerate(plain)}
        for r in runs:
            r["shards"] = [chunk[k] for k in r["shards"]]
    for r in runs:
        r["quality"] = _quality(r.pop("shards")) if mode != "files" else None
    return {"setup": setup, "epochs": runs, "limit": limit}


def big_shard(vol: str, foreign: str, cache: str) -> dict:
    from ucmagic.shards import TarShards

    t0 = time.perf_counter()
    ds = TarShards(vol, cache_dir=cache)
    first = ds[0]
    t_first = time.perf_counter() - t0
    t1 = time.perf_counter()
    TarShards(foreign, cache_dir=os.path.join(cache, "foreign"))
    return {"first": t_first, "first_bytes": len(first["bin"]), "index_foreign": time.perf_counter() - t1}


# ---------------------------------------------------------------- parent: orchestration and sampling

def peer_python(peer: str) -> str | None:
    """The venv interpreter of ``peer``, made on first use (same torch as here); None when it cannot be."""
    venv, req, module = PEERS[peer]
    py = os.path.join(venv, "bin", "python")
    probe = [py, os.path.abspath(__file__), "--child", "probe", "--peer", peer]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        if os.path.exists(py) and subprocess.run(probe, capture_output=True, timeout=120).returncode == 0:
            return py
    try:
        import torch

        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", venv], check=True, timeout=300)
        subprocess.run([py, "-m", "pip", "install", "-q", req, f"torch=={torch.__version__}"], check=True,
                       timeout=1200, capture_output=True)
        if subprocess.run(probe, capture_output=True, timeout=120).returncode == 0:
            return py
    except (OSError, subprocess.SubprocessError) as e:
        print(f"peer not available: {peer} ({req}): {e}", file=sys.stderr)
        return None
    print(f"peer not available: {peer} ({req}): cannot import {module} in {venv}", file=sys.stderr)
    return None


def run_child(python: str, args: list[str], mode: str, cache: str, timeout: float = 1800) -> dict:
    cmd = [python, os.path.abspath(__file__), "--child", mode, *args, "--cache", cache]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), HERE]), UCMAGIC_PROGRESS="off",
               TMPDIR=cache)
    res, peak = run_sampled(cmd, env, mode, lambda _pid: _allocated(cache), 0.05, timeout)
    if "error" not in res:
        res["peak_cache"] = peak
    return res


def make_images(src: str, n: int, size: int) -> None:
    """``n`` files of ``size`` random-looking bytes in CLASSES folders (kept between runs when unchanged)."""
    marker = os.path.join(os.path.dirname(src), f".images-{n}-{size}")
    if os.path.exists(marker) and os.path.isdir(src):
        return
    shutil.rmtree(src, ignore_errors=True)
    block = os.urandom(size + 4096)
    for i in range(n):
        d = os.path.join(src, f"c{i % CLASSES}")
        os.makedirs(d, exist_ok=True)
        off = (i * 61) % 4096
        with open(os.path.join(d, f"{i:06d}.jpg"), "wb") as f:
            f.write(f"{i:08d}".encode() + block[off + 8:off + size])
    open(marker, "w").close()


def make_big(root: str, gib: float, size: int) -> str:
    """``root`` holding one packed shard of ``gib`` GiB of images of ``size`` bytes in root/big, and the
    same tar alone (no index.json) in root/foreign (kept between runs when unchanged)."""
    import ucmagic

    marker = os.path.join(root, f".big-{gib:g}-{size}")
    src, big, foreign = (os.path.join(root, d) for d in ("bigsrc", "big", "foreign"))
    if os.path.exists(marker) and os.path.exists(os.path.join(big, "index.json")):
        return root
    shutil.rmtree(root, ignore_errors=True)
    block = os.urandom(size + 4096)
    for i in range(max(1, int(gib * (1 << 30) // size))):
        d = os.path.join(src, f"{i // 10000:03d}")
        if i % 10000 == 0:
            os.makedirs(d)
        with open(os.path.join(d, f"{i:07d}.bin"), "wb") as f:
            f.write(block[i % 4096:i % 4096 + size])
    ucmagic.pack(src, big, shard_size=int(gib * (1 << 30)) + (1 << 30), progress=False)
    shutil.rmtree(src)
    os.makedirs(foreign)
    os.link(os.path.join(big, "shard-000000.tar"), os.path.join(foreign, "shard-000000.tar"))
    open(marker, "w").close()
    return root


def peak_bound(budget: int, chunk: int, window: int, read_ahead: int, streams: int = WORKERS) -> int:
    """The most a TarShards cache holds under ``budget`` (docs/shards.md, "Sizing a budget")."""
    fits = budget >= streams * (window + read_ahead + 3) * chunk
    return budget + streams * (2 if fits else window + 2) * chunk


def fit_window(budget: int, chunk: int, streams: int = WORKERS) -> int:
    """The largest shuffle window (no read-ahead) whose streams the budget holds, at least 1."""
    return max(1, budget // (streams * chunk) - 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=15000)
    ap.add_argument("--size", default="150KiB")
    ap.add_argument("--shard-size", default="256MB")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contenders", default=",".join(CONVERT + READ))
    ap.add_argument("--big-gib", type=float, default=10.0, help="size of the one-shard case (0 = off)")
    ap.add_argument("--workdir", default="/tmp/ucmagic-shardbench")
    ap.add_argument("--no-budget", action="store_true", help="skip the runs under a cache budget (speed figures only)")
    ap.add_argument("--no-fuse", action="store_true", help="plain local directories (smoke runs only: no latency)")
    ap.add_argument("--json", default=None, help="also write all results here")
    ap.add_argument("--lit-workers", type=int, default=16, help="litdata.optimize num_workers (processes)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one contender run may take")
    ap.add_argument("--max-minutes", type=float, default=0,
                    help="start no round that would end past this many minutes (0: run every round)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--vol", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--limit", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, default=2, help=argparse.SUPPRESS)
    ap.add_argument("--window", type=int, default=8, help=argparse.SUPPRESS)
    ap.add_argument("--read-ahead", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--foreign", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--peer", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))
    from ucmagic.units import parse_size

    shard_size = int(parse_size(a.shard_size) or 0)
    if a.child:
        if a.child == "probe":  # can this interpreter import the peer (and torch)?
            if a.peer == "mosaic":
                stub_torchvision()
            __import__(PEERS[a.peer][2])
            import torch  # noqa: F401
            return
        if a.child in CONVERT:
            out = convert(a.child, a.src, a.out, shard_size, a.lit_workers)
        elif a.child == "big":
            out = big_shard(a.vol, a.foreign, a.cache)
        else:
            out = read(a.child, a.vol, a.cache, a.limit, a.epochs, a.window, a.read_ahead)
        print(json.dumps(out), flush=True)
        return

    from ucmagic.testing import fuse_available, mount_slow_volume

    if not a.no_fuse and not fuse_available():
        raise SystemExit("needs FUSE: apt-get install fuse3 && pip install mfusepy (and /dev/fuse); "
                         "--no-fuse runs on plain directories (smoke only)")
    contenders = [c for c in a.contenders.split(",") if c]
    python_for: dict[str, str] = {}
    for peer in sorted({PEER_OF[c] for c in contenders if c in PEER_OF}):
        py = peer_python(peer)
        if py is None:
            contenders = [c for c in contenders if PEER_OF.get(c) != peer]
        else:
            python_for[peer] = py
    size = int(parse_size(a.size) or 0)
    os.makedirs(a.workdir, exist_ok=True)
    # the images, three conversions, a reader's cache at a time; the big shard (twice while it is packed)
    need = 6 * a.images * size + 2.1 * a.big_gib * (1 << 30)
    free = shutil.disk_usage(a.workdir).free
    print(f"disk: {free / 1e9:.1f} GB free under {a.workdir}, {need / 1e9:.1f} GB needed", flush=True)
    if free < need:
        raise SystemExit(f"needs {need / 1e9:.1f} GB free under {a.workdir} ({free / 1e9:.1f} GB free): "
                         "lower --images or --big-gib, or pick another --workdir")
    t_start = time.perf_counter()
    done_rounds = [0]
    src, outroot = os.path.join(a.workdir, "src"), os.path.join(a.workdir, "out")
    make_images(src, a.images, size)
    os.makedirs(outroot, exist_ok=True)
    converts = [c for c in contenders if c in CONVERT]
    readers = [c for c in contenders if c in READ]
    results: dict[str, list[dict]] = {c: [] for c in converts}
    results.update({c: [] for c in readers})
    results.update({f"{c}@budget": [] for c in readers if c not in ("ranged", "files")})
    if "ucmagic" in readers:
        results["ucmagic@fit"] = []
    fit = fit_window(2 * shard_size, min(CHUNK, shard_size))
    big_results: list[dict] = []

    def py(c: str) -> str:
        return python_for.get(PEER_OF.get(c, ""), sys.executable)

    def cache_dir(c: str) -> str:
        return tempfile.mkdtemp(prefix=f"{c.replace('@', '-')}-", dir=a.workdir)

    def show(rnd: int, name: str, r: dict) -> None:
        if "error" in r:
            print(f"[round {rnd + 1}] {name:16s} failed: {r['error']}", flush=True)
            return
        if "convert" in r:
            cv = r["convert"]
            print(f"[round {rnd + 1}] {name:16s} convert {cv['secs']:.2f}s  {cv['samples'] / cv['secs']:.0f} "
                  "samples/s", flush=True)
            return
        eps = r["epochs"]
        text = "  ".join(f"epoch{i} {e['secs']:.2f}s" for i, e in enumerate(eps))
        q = eps[0].get("quality")
        first = eps[0].get("first_from_setup", eps[0].get("first")) or 0
        print(f"[round {rnd + 1}] {name:16s} {text}  first {first:.2f}s"
              f"  quality {q if q is None else round(q, 2)}  peak cache {r.get('peak_cache', 0) / 1e6:.0f} MB",
              flush=True)

    with contextlib.ExitStack() as stack:
        if a.no_fuse:
            vsrc, vout = src, outroot
        else:
            vsrc = stack.enter_context(mount_slow_volume(src, "/Volumes/bench/shards/src", list_ms=50, **PROFILE))
            vout = stack.enter_context(mount_slow_volume(outroot, "/Volumes/bench/shards/out", list_ms=50, **PROFILE))
        bigbase = None
        if a.big_gib > 0:
            t_big = time.perf_counter()
            bigroot = make_big(os.path.join(a.workdir, "bigroot"), a.big_gib, size)
            print(f"[big] a packed {a.big_gib:g} GiB shard made in {time.perf_counter() - t_big:.0f} s", flush=True)
            bigbase = bigroot if a.no_fuse else stack.enter_context(
                mount_slow_volume(bigroot, "/Volumes/bench/shards/big", list_ms=50, **PROFILE))
        t_rounds = time.perf_counter()
        for rnd in range(a.rounds):
            now = time.perf_counter()
            if rnd and a.max_minutes and now - t_start + (now - t_rounds) / rnd > 60 * a.max_minutes:
                print(f"[round {rnd + 1}] not started: {(now - t_start) / 60:.1f} min so far, one more round "
                      f"({(now - t_rounds) / rnd / 60:.1f} min) would pass --max-minutes {a.max_minutes:g}", flush=True)
                break
            done_rounds[0] = rnd + 1
            if bigbase is not None:
                cache = cache_dir("big")
                r = run_child(sys.executable, ["--vol", os.path.join(bigbase, "big"), "--foreign",
                                               os.path.join(bigbase, "foreign")], "big", cache, a.timeout)
                shutil.rmtree(cache, ignore_errors=True)
                big_results.append(r)
                print(f"[round {rnd + 1}] big shard        " + (f"failed: {r['error']}" if "error" in r else
                      f"first sample {r['first']:.2f}s  foreign index {r['index_foreign']:.2f}s"), flush=True)
            k = rnd % max(1, len(converts))
            for c in converts[k:] + converts[:k]:
                cache = cache_dir(c)
                r = run_child(py(c), ["--src", vsrc, "--out", os.path.join(outroot, c), "--shard-size",
                                      str(shard_size), "--lit-workers", str(a.lit_workers)], c, cache, a.timeout)
                shutil.rmtree(cache, ignore_errors=True)
                results[c].append(r)
                show(rnd, c, r)
            k = rnd % max(1, len(readers))
            for budget in (False, True)[:1 if a.no_budget else 2]:
                for c in readers[k:] + readers[:k]:
                    if budget and c in ("ranged", "files"):  # the budget case is the shard readers'
                        continue
                    vol = vsrc if c == "files" else os.path.join(vout, OUT_OF[c])
                    if c != "files" and not os.path.isdir(os.path.join(outroot, OUT_OF[c])):
                        continue  # its converter did not run or failed
                    args = ["--vol", vol, "--limit", str(2 * shard_size if budget else 0),
                            "--epochs", "1" if budget else "2"]
                    jobs = [(c + ("@budget" if budget else ""), args)]
                    if budget and c == "ucmagic":  # and with a window the budget holds (docs/shards.md)
                        jobs.append(("ucmagic@fit", [*args, "--window", str(fit), "--read-ahead", "0"]))
                    for name, job_args in jobs:
                        cache = cache_dir(c)
                        r = run_child(py(c), job_args, c, cache, a.timeout)
                        shutil.rmtree(cache, ignore_errors=True)
                        results[name].append(r)
                        show(rnd, name, r)
            print(f"[round {rnd + 1}] done at {(time.perf_counter() - t_start) / 60:.1f} min", flush=True)
    report(results, big_results, a, done_rounds[0], shard_size)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": results, "big": big_results}, f, indent=1)


def _med(vals: list[float | None]) -> float:
    v = [x for x in vals if x is not None]
    return statistics.median(v) if v else float("nan")


def report(results: dict[str, list[dict]], big: list[dict], a: argparse.Namespace, rounds: int,
           shard_size: int) -> None:
    from ucmagic.shards.samples import DEFAULT_READ_AHEAD

    where = "plain local directories (--no-fuse: smoke, not figures)" if a.no_fuse else (
        f"P100 FUSE ({PROFILE['open_ms']} ms per open, {PROFILE['mbps']} MB/s per stream)")
    print(f"\n== {a.images:,} images of {a.size}, shards of {a.shard_size}, {WORKERS} loader workers, on {where}; "
          f"medians of {rounds} rounds ==")
    n = a.images

    def ok(name: str, key: str) -> list[dict]:
        return [r for r in results.get(name, []) if key in r]

    def cell(v: float, fmt: str, width: int) -> str:
        return f"{v:{width}{fmt}}" if v == v else f"{'-':>{width}s}"  # NaN: not run / failed

    rows = [("ucmagic", "pack", "ucmagic (pack + TarShards)"), ("mosaic", "mds", "mosaic (MDSWriter + py1e)"),
            ("litdata", "litopt", "litdata (optimize)"), ("files", None, "small files (UCVolumeDataset)"),
            ("ranged", None, "ranged raw copy of shards")]
    print(f"{'':30s} {'convert':>8s} {'cold':>8s} {'warm':>8s} {'first':>7s} {'quality':>8s} "
          f"{'peak cache MB':>14s} {'budget':>7s}")
    print(f"{'':30s} {'s':>8s} {'smp/s':>8s} {'smp/s':>8s} {'s':>7s} {'of 32':>8s} {'@budget':>14s} {'MB':>7s}")
    med: dict[str, dict[str, float]] = {}
    notes = []
    for reader, conv, label in rows:
        if reader not in results and (conv is None or conv not in results):
            continue
        cv = _med([r["convert"]["secs"] for r in ok(conv, "convert")]) if conv else float("nan")
        eps = ok(reader, "epochs")
        cold = _med([r["epochs"][0]["secs"] for r in eps])
        warm = _med([r["epochs"][1]["secs"] for r in eps if len(r["epochs"]) > 1])
        first = _med([r["epochs"][0].get("first_from_setup", r["epochs"][0].get("first")) for r in eps])
        qual = _med([r["epochs"][0].get("quality") for r in eps])
        bud = ok(reader + "@budget", "epochs")
        peak = _med([r.get("peak_cache") for r in bud])
        limit = _med([r.get("limit") for r in bud])
        med[reader] = {"cold": cold, "warm": warm, "convert": cv, "peak": peak}
        print(f"{label:30s} {cell(cv, '.1f', 8)} {cell(n / cold, '.0f', 8)} {cell(n / warm, '.0f', 8)} "
              f"{cell(first, '.2f', 7)} {cell(qual, '.2f', 8)} {cell(peak / 1e6, '.0f', 14)} "
              f"{cell(limit / 1e6, '.0f', 7)}")
        for name in (conv, reader, reader + "@budget"):
            bad = [r for r in results.get(name or "", []) if "error" in r]
            if bad:
                notes.append(f"  {name}: {len(bad)} of {len(results[name or ''])} runs failed: {bad[0]['error']}")
    fit = fit_window(2 * shard_size, min(CHUNK, shard_size))
    eps = ok("ucmagic@fit", "epochs")
    if eps:  # the budget run again, its window sized to the budget: cold column = that run's epoch
        cold = _med([r["epochs"][0]["secs"] for r in eps])
        first = _med([r["epochs"][0].get("first_from_setup") for r in eps])
        med["fit"] = {"peak": _med([r.get("peak_cache") for r in eps])}
        print(f"{f'ucmagic @budget, window {fit}':30s} {cell(float('nan'), '', 8)} {cell(n / cold, '.0f', 8)} "
              f"{cell(float('nan'), '', 8)} {cell(first, '.2f', 7)} "
              f"{cell(_med([r['epochs'][0].get('quality') for r in eps]), '.2f', 8)} "
              f"{cell(med['fit']['peak'] / 1e6, '.0f', 14)} {cell(2 * shard_size / 1e6, '.0f', 7)}")
    elif results.get("ucmagic@fit"):
        notes.append(f"  ucmagic@fit: every run failed: {results['ucmagic@fit'][0].get('error')}")
    print("cold/warm: one shuffled epoch on an empty cache, then one more in the same process; first: dataset "
          "construction to the first batch (workers started); quality: distinct shards among 32 consecutive "
          "samples; peak cache: the cache directory's blocks during a cold epoch under a two-shard budget "
          "(Mosaic's raised to its minimum, four shards)")
    for note in notes:
        print(note)
    print("targets (measured [target]):")

    def line(text: str, value: str, target: str) -> None:
        print(f"  {text:58s} {value:>7s}  [{target}]")

    def ratio(text: str, num: float, den: float, target: str) -> None:
        line(text, cell(num / den, '.2f', 7), target)

    if "ucmagic" in med:
        u = med["ucmagic"]
        for peer, label in (("mosaic", "MDSWriter"), ("litdata", "litdata.optimize")):
            if peer in med:
                ratio(f"{label} conversion / pack", med[peer]["convert"], u["convert"], ">= 2")
        peers = [med[p]["cold"] for p in ("mosaic", "litdata") if p in med and med[p]["cold"] == med[p]["cold"]]
        if peers:
            ratio("faster peer's cold epoch / ucmagic's", min(peers), u["cold"], ">= 1.2")
        if "ranged" in med:
            ratio("ucmagic cold epoch / ranged raw copy of its shards", u["cold"], med["ranged"]["cold"], "<= 1.1")
        if "files" in med:
            ratio("small files' warm epoch / ucmagic's", med["files"]["warm"], u["warm"], ">= 1.5")
        chunk = min(CHUNK, shard_size)  # a shard smaller than a chunk is one chunk
        line("ucmagic peak cache MB under the budget (docs/shards.md)", cell(u["peak"] / 1e6, ".0f", 7),
             f"<= {peak_bound(2 * shard_size, chunk, 8, DEFAULT_READ_AHEAD) / 1e6:.0f}")  # the stream's defaults
        if "fit" in med:
            line(f"the same, window {fit} and no read-ahead", cell(med["fit"]["peak"] / 1e6, ".0f", 7),
                 f"<= {peak_bound(2 * shard_size, chunk, fit, 0) / 1e6:.0f}")
    good = [r for r in big if "first" in r]
    if good:
        line(f"first sample s from a packed {a.big_gib:g} GiB shard", cell(_med([r["first"] for r in good]), ".2f", 7),
             "<= 0.5")
        line("index s of the same tar without index.json", cell(_med([r["index_foreign"] for r in good]), ".2f", 7),
             "reported")
    elif big:
        print(f"  big shard: every run failed: {big[0].get('error')}")


if __name__ == "__main__":
    main()
