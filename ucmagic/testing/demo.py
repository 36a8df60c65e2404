"""``python -m ucmagic demo``: ucmagic vs a plain torch DataLoader on a simulated slow volume."""
from __future__ import annotations

import os
import shutil
import tempfile
import time
import warnings
from typing import Any

from ..units import format_size


class _PlainFiles:
    """What a user writes without ucmagic: a map-style dataset reading each file from the volume."""

    def __init__(self, url: str, rels: list[str], storage_options: dict[str, Any]) -> None:
        self.url, self.rels, self.opts = url, rels, storage_options

    def __len__(self) -> int:
        return len(self.rels)

    def __getitem__(self, i: int) -> int:
        import fsspec

        fs = fsspec.filesystem("slow", **self.opts)
        with fs.open(self.url + "/" + self.rels[i], "rb") as f:
            return len(f.read())


def _read_len(path: str) -> int:
    with open(path, "rb") as f:
        return len(f.read())


def _lengths(paths: list[str]) -> list[int]:
    """The demo's "decode" step: read each cached file."""
    return [_read_len(p) for p in paths]


def _epoch(loader: Any) -> tuple[float, float, int]:
    t0 = time.perf_counter()
    first = None
    n = 0
    for batch in loader:
        if first is None:
            first = time.perf_counter() - t0
        n += len(batch)
    return time.perf_counter() - t0, first or 0.0, n


def run_demo(*, files: int = 2000, size: int = 150 * 1024, open_ms: float = 20.0, mbps: float = 200.0,
             batch_size: int = 32, workdir: str | None = None, baseline: bool = True) -> dict[str, float]:
    """Generate files, read them through the ``slow://`` simulator, print a comparison; return timings."""
    import torch.utils.data as tud

    from ..files.dataset import UCVolumeDataset
    from ..loading.loader import DataLoader
    from . import make_files

    own = workdir is None
    root = workdir or tempfile.mkdtemp(prefix="ucmagic-demo-")
    data, cache = os.path.join(root, "volume"), os.path.join(root, "cache")
    try:
        print(f"Generating {files} files of {format_size(size)} in {data} ...", flush=True)
        rels = make_files(data, files, size)
        opts = {"open_ms": open_ms, "mbps": mbps, "list_ms": 50}
        url = "slow://" + data
        print(f"Simulated volume: {open_ms:g} ms per open, {mbps:g} MB/s per stream.\n", flush=True)
        out: dict[str, float] = {}

        ds = UCVolumeDataset(url, cache_dir=cache, storage_options=opts, prefetch=None)
        # ucmagic defaults (6 workers, fewer on small machines)
        loader = DataLoader(ds, batch_size=batch_size, collate_fn=_lengths)
        for name in ("cold", "warm"):
            secs, first, n = _epoch(loader)
            if n != files:
                raise RuntimeError(f"demo: the {name} epoch delivered {n} of {files} files")
            out[f"ucmagic_{name}"], out[f"ucmagic_{name}_first"] = secs, first
            print(f"ucmagic            {name} epoch: {secs:6.2f} s   first batch after {first:.2f} s", flush=True)
        st = ds.stats()
        print(f"  cache: {st['files_cached']}/{st['files']} files, {format_size(st['bytes_cached'])} "
              f"in {st['cache_dir']}; "
              f"hits {st['hits']}, misses {st['misses']}, fetch p50 {st['fetch_p50_s'] * 1e3:.0f} ms, "
              f"p99 {st['fetch_p99_s'] * 1e3:.0f} ms", flush=True)

        if baseline:
            with warnings.catch_warnings():  # torch warns about 6 workers on small machines: it is the baseline
                warnings.simplefilter("ignore", UserWarning)
                files_ds: Any = _PlainFiles(url, rels, opts)  # map-style: __len__ and __getitem__, no Dataset base
                plain = tud.DataLoader(files_ds, batch_size=batch_size, num_workers=6)
                secs, first, n = _epoch(plain)
            if n != files:
                raise RuntimeError(f"demo: the torch DataLoader delivered {n} of {files} files")
            out["torch_epoch"] = secs
            print(f"torch DataLoader   any epoch:  {secs:6.2f} s   first batch after {first:.2f} s "
                  "(6 workers, no cache)", flush=True)
            print(f"\nSpeed-up: cold {secs / out['ucmagic_cold']:.1f}x, warm {secs / out['ucmagic_warm']:.1f}x "
                  "over the plain DataLoader.", flush=True)
        return out
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)
