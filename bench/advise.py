"""Is the advice right or silent? ``loader.stats.advise()`` followed as written, on eight workloads
(issue 52 item 5; SPEC W4).

    python bench/advise.py [--only cold-pass,epochs,...] [--runs 3] [--quick] [--json out.json]

Each workload runs on the ``slow://`` simulator from an empty cache with the loader a user would write
(settings below), for a run of a few epochs; the loop does ``--step-ms`` of CPU work per batch (a
training step). Its advice is then followed as written, each sure advice in turn (``num_workers``,
``prefetch_factor``, ``cache_limit``, ``ds.warm()`` before the loop, packing the files into tar shards of
the size named and reading them as a ``TarShards`` stream through the same decode), and the same run
measured again. Run totals include the change's own time (warming; packing, done once and added to each
run). The baseline and each followed advice run ``--runs`` times (interleaved); medians are compared.

Workloads (``--quick``: a quarter of the files):

- ``cold-pass``: one cold pass over 3,000 small files (8 KiB, 300 ms per open: issue 52's), 2 workers, 1 epoch;
- ``epochs``: the same files, 3 epochs;
- ``decode-big``: PIL decode of 512x512 JPEGs resized to 224x224 float tensors (19 MB batches of 32),
  1 worker, 20 ms per open, 2 epochs;
- ``cache-small``: 64 KiB files, ``cache_limit`` at 40% of the data, 20 ms per open, 3 epochs;
- ``shards``: the small files packed beforehand (not timed) into tar shards of 256 KiB, read as a
  ``TarShards`` stream under a user's wrapper that decodes each sample (0.2 ms of CPU per sample), 100 ms per
  open, 2 workers, 2 epochs;
- ``fast``: a warm cache and a 30 ms training step the workers keep up with, 2 epochs;
- ``no-workers``: the small files with 0 workers, each item 0.5 ms of CPU decode, 20 ms per open, 2 epochs;
- ``tiny``: the README's quick start: 200 small files on a fast volume, default loader, 3 epochs.

Targets (issue 52): following the top advice never makes the run slower; each followed knob's predicted
run within 25% of the measured one; ``fast`` and ``tiny`` get no change. Run it alone on a quiet machine:
the figures are wall times.
"""
from __future__ import annotations

import argparse
import gc
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import torch
from torch.utils.data import IterableDataset

from ucmagic import DataLoader, TarShards, UCVolumeDataset
from ucmagic import pack as pack_files
from ucmagic.testing import make_files

BATCH = 32
FIELD = {"list_ms": 20}


def busy(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


# ---------------------------------------------------------------- the users' decodes (wrappers)

class Lengths(IterableDataset):
    """A trivial decode: each cached file's size (``cpu_s`` of CPU work per item)."""

    def __init__(self, inner: Any, cpu_s: float = 0.0) -> None:
        self.inner, self.cpu_s = inner, cpu_s

    def __iter__(self):
        for item in self.inner:
            if self.cpu_s:
                busy(self.cpu_s)
            yield os.path.getsize(item) if isinstance(item, str) else sum(
                len(v) for v in item.values() if isinstance(v, bytes))


def _image(data: Any) -> torch.Tensor:
    from PIL import Image

    with Image.open(data) as im:
        arr = np.asarray(im.convert("RGB").resize((224, 224)), dtype=np.uint8)
    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0)


class Images(IterableDataset):
    """PIL decode of each item (a cached path, or a packed sample's ``jpg`` bytes) to a 224x224 float tensor."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __iter__(self):
        for item in self.inner:
            yield _image(item if isinstance(item, str) else io.BytesIO(item["jpg"]))


# ---------------------------------------------------------------- the workloads

def make_jpegs(root: str, n: int, side: int = 512) -> None:
    from PIL import Image

    os.makedirs(root + ".part", exist_ok=True)
    for i in range(n):
        rng = np.random.default_rng(i)
        img = np.clip(np.linspace(0, 160, side, dtype=np.float32)[None, :, None]
                      + rng.normal(0, 40, (side, side, 3)) + 48, 0, 255).astype(np.uint8)
        Image.fromarray(img, "RGB").save(os.path.join(root + ".part", f"img{i:05d}.jpg"), "JPEG", quality=90)
    os.replace(root + ".part", root)


def workloads(work: str, quick: bool) -> dict[str, dict[str, Any]]:
    scale = 4 if quick else 1
    n = 3000 // scale
    small = os.path.join(work, f"small-{n}")
    if not os.path.isdir(small):
        make_files(small, n, 8 * 1024, per_dir=200)
    jpegs = os.path.join(work, f"jpeg512-{400 // scale}")
    if not os.path.isdir(jpegs):
        make_jpegs(jpegs, 400 // scale)
    mid = os.path.join(work, f"mid-{1200 // scale}")
    if not os.path.isdir(mid):
        make_files(mid, 1200 // scale, 64 * 1024, per_dir=200)
    tiny = os.path.join(work, "tiny-200")
    if not os.path.isdir(tiny):
        make_files(tiny, 200, 4 * 1024, per_dir=100)
    shards = os.path.join(work, f"shards-{n}-256k")
    if not os.path.isdir(shards):
        pack_files(small, shards + ".part", shard_size=256 << 10, progress=False)
        os.replace(shards + ".part", shards)
    p300 = {"open_ms": 300, "mbps": 200, **FIELD}
    p20 = {"open_ms": 20, "mbps": 200, **FIELD}
    p100 = {"open_ms": 100, "mbps": 100, **FIELD}
    return {
        "cold-pass": {"src": small, "profile": p300, "decode": "lengths", "workers": 2, "epochs": 1},
        "epochs": {"src": small, "profile": p300, "decode": "lengths", "workers": 2, "epochs": 3},
        "decode-big": {"src": jpegs, "profile": p20, "decode": "images", "workers": 1, "epochs": 2},
        "cache-small": {"src": mid, "profile": p20, "decode": "lengths", "workers": 2, "epochs": 3,
                        "limit": int(0.4 * (1200 // scale) * 64 * 1024)},
        "shards": {"src": shards, "profile": p100, "decode": "lengths", "cpu_s": 0.2e-3, "workers": 2, "epochs": 2,
                   "kind": "shards"},
        "fast": {"src": mid, "profile": p20, "decode": "lengths", "cpu_s": 0.5e-3, "workers": 2, "epochs": 2,
                 "warm": True, "step_ms": 30.0},
        "no-workers": {"src": small, "profile": p20, "decode": "lengths", "cpu_s": 0.5e-3, "workers": 0,
                       "epochs": 2},
        "tiny": {"src": tiny, "profile": {"open_ms": 2, "mbps": 500, **FIELD}, "decode": "lengths", "workers": None,
                 "epochs": 3, "batch": 64},
    }


# ---------------------------------------------------------------- one run

_PACKED: dict[tuple[str, int], tuple[str, float]] = {}  # packed once per workload and shard size


def packed(w: dict[str, Any], shard_size: int) -> tuple[str, float]:
    """The workload's files packed into tar shards of ``shard_size`` (read through the slow volume, as a user's
    pack from a volume would): ``(shards dir, seconds)``."""
    key = (w["src"], shard_size)
    if key not in _PACKED:
        dest = f"{w['src'].rstrip('/')}-packed-{shard_size}"
        shutil.rmtree(dest, ignore_errors=True)
        t0 = time.perf_counter()
        pack_files(f"slow://{w['src']}", dest, shard_size=shard_size, storage_options=w["profile"], progress=False)
        _PACKED[key] = (dest, time.perf_counter() - t0)
    return _PACKED[key]


def wrap(w: dict[str, Any], inner: Any) -> Any:
    return Images(inner) if w["decode"] == "images" else Lengths(inner, w.get("cpu_s", 0.0))


def run(w: dict[str, Any], caches: str, step_s: float, *, workers: Any = "default", prefetch: int | None = None,
        limit: Any = "default", warm: bool = False, pack: int = 0, advise: bool = False) -> dict[str, Any]:
    """One run of the workload from an empty cache: its epochs' seconds, its own cost (warming, packing) and,
    with ``advise``, the advice."""
    cache = tempfile.mkdtemp(prefix="cache-", dir=caches)
    budget = w.get("limit") if limit == "default" else limit
    cost = 0.0
    if pack:
        shards, cost = packed(w, pack)
        ds: Any = TarShards(f"slow://{shards}", cache_dir=cache, storage_options=w["profile"], cache_limit=budget)
        data: Any = wrap(w, ds.stream())
    elif w.get("kind") == "shards":
        ds = TarShards(f"slow://{w['src']}", cache_dir=cache, storage_options=w["profile"], cache_limit=budget)
        data = wrap(w, ds.stream())
    else:
        ds = UCVolumeDataset(f"slow://{w['src']}", cache_dir=cache, storage_options=w["profile"], cache_limit=budget)
        data = wrap(w, ds)
    if w.get("warm"):  # part of the workload: not timed
        ds.warm(background=False)
    if warm:  # following the advice: its time is the run's
        t0 = time.perf_counter()
        ds.warm(background=False)
        cost = time.perf_counter() - t0
    kw: dict[str, Any] = {"batch_size": w.get("batch", BATCH), "log_to_mlflow": False}
    nw = w["workers"] if workers == "default" else workers
    if nw is not None:
        kw["num_workers"] = nw
    if prefetch is not None and nw:
        kw["prefetch_factor"] = prefetch
    loader = DataLoader(data, **kw)
    secs = []
    for _ in range(w["epochs"]):
        t0 = time.perf_counter()
        for _ in loader:
            busy(step_s)
        secs.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"epochs": secs, "cost": cost, "total": sum(secs) + cost, "workers": loader.num_workers,
                           "prefetch": loader.prefetch_factor}
    print(f"  run workers={loader.num_workers} prefetch={loader.prefetch_factor} limit={budget} warm={warm} "
          f"pack={pack}: {out['total']:.2f} s = cost {cost:.2f} + epochs {' '.join('%.2f' % x for x in secs)}",
          file=sys.stderr, flush=True)
    if advise:
        out["advice"] = loader.stats.advise()
        out["breakdown"] = loader.stats.breakdown(per_epoch=True)
    del loader, ds, data  # persistent workers stop before the next run starts
    gc.collect()
    shutil.rmtree(cache, ignore_errors=True)
    return out


def follow(a: Any, w: dict[str, Any]) -> dict[str, Any] | None:
    """The run arguments that follow advice ``a`` as written (None: not a change this bench can make)."""
    s = a.settings
    if a.kind == "workers":
        return {"workers": int(s["num_workers"])}
    if a.kind == "prefetch":
        return {"prefetch": int(s["prefetch_factor"])}
    if a.kind == "cache_limit":
        return {"limit": int(s["cache_limit"])}
    if a.kind == "warm":
        return {"warm": True}
    if a.kind == "pack" and w.get("kind") != "shards":
        return {"pack": int(s.get("shard_size") or 1 << 30)}
    return None  # "limit": a machine change


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def measure(name: str, w: dict[str, Any], caches: str, step_s: float, runs: int) -> dict[str, Any]:
    step = w.get("step_ms", step_s * 1e3) / 1e3
    first = run(w, caches, step, advise=True)
    advice = first["advice"]
    print(f"{name}: baseline {first['total']:.2f} s {['%.2f' % x for x in first['epochs']]}", file=sys.stderr)
    for a in advice:
        print(f"  advice: {a}", file=sys.stderr)
    sure = [a for a in advice if a.sure and a.kind != "none"]
    followed = [(a, follow(a, w)) for a in sure]
    base = [first["total"]]
    after: dict[int, list[float]] = {i: [] for i, (_, kw) in enumerate(followed) if kw is not None}
    for r in range(runs):  # interleaved: a baseline, then each followed advice
        if r:
            base.append(run(w, caches, step)["total"])
        for i in after:
            after[i].append(run(w, caches, step, **followed[i][1])["total"])  # type: ignore[arg-type]
    row: dict[str, Any] = {"workload": name, "baseline_s": median(base), "baseline_runs": base,
                           "advice": [str(a) for a in advice], "followed": []}
    for i, (a, kw) in enumerate(followed):
        got = median(after[i]) if i in after else None
        row["followed"].append({"kind": a.kind, "change": a.change, "predicted_s": a.predicted_s, "measured_s": got,
                                "runs": after.get(i), "error": (a.predicted_s - got) / got if got else None,
                                "top": i == 0, "applied": kw is not None})
    return row


def verdicts(row: dict[str, Any], expect_none: bool) -> list[str]:
    out = []
    top = next((f for f in row["followed"] if f["top"]), None)
    if expect_none:
        out.append("quiet: met" if top is None else f"quiet: MISSED ({top['change']})")
    if top is not None and top["measured_s"] is not None:
        slower = top["measured_s"] > row["baseline_s"]
        out.append(f"never slower: {'MISSED' if slower else 'met'}")
    for f in row["followed"]:
        if f["error"] is not None:
            out.append(f"{f['kind']} within 25%: {'met' if abs(f['error']) <= 0.25 else 'MISSED'}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a quarter of the files (a smoke run)")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ucmagic-bench-advise"))
    ap.add_argument("--step-ms", type=float, default=5.0, help="CPU work of the loop per batch")
    ap.add_argument("--only", default=None, help="comma-separated workloads (default: all)")
    ap.add_argument("--runs", type=int, default=3, help="runs of the baseline and of each followed advice")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    caches = os.path.join(args.workdir, "caches")
    os.makedirs(caches, exist_ok=True)
    t_all = time.perf_counter()
    all_w = workloads(args.workdir, args.quick)
    names = args.only.split(",") if args.only else list(all_w)
    unknown = [n for n in names if n not in all_w]
    if unknown:
        ap.error(f"unknown workload(s) {', '.join(unknown)}; choose from {', '.join(all_w)}")
    rows = []
    for name in names:
        row = measure(name, all_w[name], caches, args.step_ms / 1e3, max(1, args.runs))
        row["verdicts"] = verdicts(row, name in ("fast", "tiny"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{'workload':12s} {'baseline s':>10s}  {'advice followed':44s} {'predicted':>9s} {'measured':>9s} "
          f"{'error':>6s}  verdicts")
    for r in rows:
        fs = r["followed"] or [None]
        for j, f in enumerate(fs):
            head = f"{r['workload']:12s} {r['baseline_s']:10.2f}" if j == 0 else " " * 23
            if f is None:
                print(f"{head}  {'(no change advised)':44s} {'-':>9s} {'-':>9s} {'-':>6s}  {'; '.join(r['verdicts'])}")
                continue
            meas = f"{f['measured_s']:9.2f}" if f["measured_s"] is not None else f"{'-':>9s}"
            err = f"{f['error']:+6.0%}" if f["error"] is not None else f"{'-':>6s}"
            mark = "* " if f["top"] else "  "
            print(f"{head}  {mark + f['change'][:42]:44s} {f['predicted_s']:9.2f} {meas} {err}  "
                  f"{'; '.join(r['verdicts']) if j == 0 else ''}")
    print(f"\n* the top advice. {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, "
          f"total {time.perf_counter() - t_all:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    shutil.rmtree(caches, ignore_errors=True)


if __name__ == "__main__":
    main()
