"""The seed's ImageDataset on a P100 volume: cold epoch vs warm epoch vs the one-process decode floor
(issue 23 "Targets": cold <= 1.2x warm, i.e. the volume's I/O hidden behind decoding).

    python bench/imagedataset.py [--files 2000] [--size 167KiB] [--rounds 3] [--workdir /tmp/ucmagic-bench-img]

Needs Pillow (``pip install Pillow``; matplotlib, in the notebook extra, installs it too).

The dataset is the pattern of seeds/003 ("Charger des données non structurées avec UCVolumeDataset"):
a user ``IterableDataset`` wrapping ``UCVolumeDataset`` that opens each cached path with PIL,
converts it to RGB and yields a float tensor (torchvision's ``to_tensor``: CHW, scaled to [0, 1];
written here with numpy so torchvision is not needed). It runs under ``ucmagic.DataLoader`` with
batch size 32 and every other setting at its default, over the ``slow://`` simulator with the P100
profile (100 ms per open, 100 MB/s per stream, 50 ms per listing; as bench/soak.py and the
``slow://`` fallback of bench/stage.py). The images are ``--files`` JPEGs of one size (default 2,000 of
about 167 KiB: noise over a gradient, quality 90), written once with Pillow and kept in the workdir.

Contenders, each in a fresh process, in rotating order over ``--rounds`` rounds (medians printed):

- ``ucmagic``: a cold epoch (empty cache) then a warm epoch with the same loader;
- ``floor``: the one-process decode floor, a plain loop decoding the same files from local disk
  (no loader, no cache, no volume): what decoding alone costs on one core.

Client CPU is user + system seconds of the contender's process tree (loader workers included);
memory the peak summed PSS of that tree, sampled every 100 ms (bench/coldwarm.py's helpers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from _child import RemovedAtExit, run_sampled, tree_memory  # bench/ is on sys.path when a benchmark runs as a script
from coldwarm import client_cpu
from torch.utils.data import IterableDataset

try:  # imported before anything is timed, as a training script does
    from PIL import Image
except ModuleNotFoundError:
    Image = None

HERE = os.path.dirname(os.path.abspath(__file__))
P100 = {"open_ms": 100, "mbps": 100, "list_ms": 50}
BATCH = 32
CONTENDERS = ("ucmagic", "floor")


# ---------------------------------------------------------------- the seed's dataset (child side)

def decode(path: str):
    """PIL decode -> float tensor, as ``TF.to_tensor(Image.open(path).convert("RGB"))``."""
    with Image.open(path) as im:
        arr = np.asarray(im.convert("RGB"), dtype=np.uint8)
    return torch.from_numpy(arr).permute(2, 0, 1).float().div_(255.0)


class ImageDataset(IterableDataset):
    """Decodes each cached file path from UCVolumeDataset into a tensor (the seed's class)."""

    def __init__(self, path_dataset) -> None:
        self._path_dataset = path_dataset

    def __iter__(self):
        for local_path in self._path_dataset:
            yield decode(local_path)


def _epoch(loader) -> dict:
    c0, t0 = client_cpu(), time.perf_counter()
    first, n = None, 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        n += len(batch)
    return {"secs": time.perf_counter() - t0, "first": first, "files": n, "cpu": client_cpu() - c0}


def child(mode: str, src: str, cache: str) -> dict:
    if mode == "ucmagic":
        from ucmagic import DataLoader, UCVolumeDataset

        t0 = time.perf_counter()
        path_dataset = UCVolumeDataset(f"slow://{src}", cache_dir=cache, storage_options=P100)
        loader = DataLoader(ImageDataset(path_dataset), batch_size=BATCH)
        setup = time.perf_counter() - t0
        epochs = [_epoch(loader), _epoch(loader)]
        return {"setup": setup, "workers": loader.num_workers, "epochs": epochs}
    if mode == "floor":
        paths = sorted(os.path.join(src, f) for f in os.listdir(src) if f.endswith(".jpg"))
        c0, t0 = client_cpu(), time.perf_counter()
        n = sum(1 for p in paths if decode(p).numel())
        return {"epochs": [{"secs": time.perf_counter() - t0, "first": None, "files": n, "cpu": client_cpu() - c0}]}
    raise SystemExit(f"unknown mode {mode}")


# ---------------------------------------------------------------- data and orchestration (parent side)

def make_jpegs(root: str, n: int, target: int) -> tuple[int, int]:
    """``n`` JPEGs of one pixel size chosen so each is about ``target`` bytes; returns (side, mean bytes)."""
    import io

    def encode(side: int, seed: int) -> bytes:
        rng = np.random.default_rng(seed)
        grad = np.linspace(0, 160, side, dtype=np.float32)[None, :, None]
        noise = rng.normal(0, 40, (side, side, 3)).astype(np.float32)
        img = np.clip(grad + noise + 48, 0, 255).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img, "RGB").save(buf, "JPEG", quality=90)
        return buf.getvalue()

    lo, hi = 32, 2048  # bytes grow with the side: bisect on one image
    while hi - lo > 4:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if len(encode(mid, 0)) < target else (lo, mid)
    side = hi
    os.makedirs(root + ".part", exist_ok=True)
    total = 0
    for i in range(n):
        data = encode(side, i)
        total += len(data)
        with open(os.path.join(root + ".part", f"img{i:05d}.jpg"), "wb") as f:
            f.write(data)
    os.replace(root + ".part", root)
    return side, total // max(1, n)


def run_child(mode: str, src: str, cache: str, timeout: float = 1800) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", mode, "--src", src, "--cache", cache]
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), UCMAGIC_PROGRESS="off")
    t0 = time.perf_counter()
    res, (peak, _uss) = run_sampled(cmd, env, mode, tree_memory, 0.1, timeout)
    if "error" not in res:
        res["wall"] = time.perf_counter() - t0
        res["peak_mb"] = peak / 1e6
    return res


def _med(runs: list[dict], key: str = "secs", epoch: int = 0) -> float:
    vals = [r["epochs"][epoch][key] for r in runs if "epochs" in r and len(r["epochs"]) > epoch
            and r["epochs"][epoch].get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def report(res: dict[str, list[dict]], files: int, mean_kib: float) -> None:
    uc = [r for r in res["ucmagic"] if "epochs" in r]
    fl = [r for r in res["floor"] if "epochs" in r]
    for c, runs in res.items():
        for r in runs:
            if "error" in r:
                print(f"  {c} failed: {r['error']}")
    cold, warm, floor = _med(uc), _med(uc, epoch=1), _med(fl)
    workers = uc[0].get("workers") if uc else "?"
    print(f"\n== seed ImageDataset, P100 slow://, {files} JPEGs of {mean_kib:.0f} KiB, batch {BATCH}, "
          f"ucmagic.DataLoader defaults ({workers} workers), medians of {len(uc)} ==")
    print(f"  cold epoch        {cold:7.2f} s  ({files / cold:6.0f} img/s, {_med(uc, 'cpu'):.1f} cpu-s, "
          f"first batch {_med(uc, 'first'):.2f} s)")
    print(f"  warm epoch        {warm:7.2f} s  ({files / warm:6.0f} img/s, {_med(uc, 'cpu', 1):.1f} cpu-s)")
    print(f"  decode floor      {floor:7.2f} s  ({files / floor:6.0f} img/s, one process, local files)")
    peaks = [r["peak_mb"] for r in uc if "peak_mb" in r]
    if peaks:
        print(f"  peak memory       {statistics.median(peaks):7.0f} MB (ucmagic process tree)")
    print("ratios (target in brackets):")
    print(f"  cold / warm                {cold / warm:5.2f}  [<= 1.2]")
    print(f"  warm / one-process floor   {warm / floor:5.2f}")
    print(f"  cold / one-process floor   {cold / floor:5.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--size", default="167KiB", help="target size of each JPEG")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/ucmagic-bench-img")
    ap.add_argument("--json", default=None, help="also write all results here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--src", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    sys.path.insert(0, os.path.dirname(HERE))
    if Image is None:
        raise SystemExit("needs Pillow: pip install Pillow")
    if a.child:
        print(json.dumps(child(a.child, a.src, a.cache)), flush=True)
        return

    from ucmagic.units import parse_size

    target = parse_size(a.size)
    src = os.path.join(a.workdir, f"jpegs-{a.files}-{target}")
    if not os.path.isdir(src):
        t0 = time.perf_counter()
        side, mean = make_jpegs(src, a.files, target)
        print(f"wrote {a.files} JPEGs of {side}x{side} ({mean / 1024:.0f} KiB each) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
    sizes = [os.path.getsize(os.path.join(src, f)) for f in os.listdir(src)]
    mean_kib = sum(sizes) / len(sizes) / 1024
    res: dict[str, list[dict]] = {c: [] for c in CONTENDERS}
    with RemovedAtExit() as kept:  # outputs go when the run ends (see RemovedAtExit)
        for rnd in range(a.rounds):
            k = rnd % len(CONTENDERS)
            for c in CONTENDERS[k:] + CONTENDERS[:k]:
                cache = kept.add(tempfile.mkdtemp(prefix="imgcache-", dir=a.workdir))
                r = run_child(c, src, cache)
                res[c].append(r)
                status = r.get("error") or " ".join(f"{e['secs']:.2f}s ({e['cpu']:.1f} cpu-s)" for e in r["epochs"])
                print(f"[round {rnd + 1}] {c:8s} {status}  peak {r.get('peak_mb', 0):.0f} MB", flush=True)
    report(res, a.files, mean_kib)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
