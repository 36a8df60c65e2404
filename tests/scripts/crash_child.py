"""Run by tests/test_faults.py in a child process that the test kills with SIGKILL mid-operation.

``python crash_child.py MODE ARGS...`` starts one operation and prints ``READY`` (flushed) at the
moment the parent should kill it; the operation then stalls so the kill lands exactly there:

- ``fill CACHE SRC REL [LIMIT]``: a cache fill of ``SRC/REL`` (budget LIMIT bytes, 0: none) has written
  half its bytes to the temp file;
- ``stage SRC DEST``: a staging copy has written half of one file (other copies run normally);
- ``export TABLE_DIR DEST POINT``: ``export_parquet`` overwriting DEST, POINT ``before_swap`` (all new
  files written, not yet published) or ``writing`` (READY as soon as the export starts: the parent
  kills once the staging directory appears, i.e. while DuckDB writes);
- ``ckpt ROOT STEP FORMAT``: ``save_checkpoint`` has uploaded one file of step STEP (``dcp`` or
  ``single``) and not committed it;
- ``hammer CACHE SRC LOG SEED GO``: not killed; one of four processes filling one cache with the
  same files in different orders (each copy from the source appends a line to LOG).
"""
from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def ready() -> None:
    print("READY", flush=True)
    time.sleep(120)  # the parent kills us here


def half_then_stall(src: str, dest: str) -> int:
    with open(src, "rb") as f:
        data = f.read()
    with open(dest, "wb") as f:
        f.write(data[: len(data) // 2])
        f.flush()
        os.fsync(f.fileno())
        ready()
    return len(data)  # pragma: no cover - killed before


def fill(cache: str, src: str, rel: str, limit: str = "0") -> None:
    from ucmagic.files.cache import FileCache
    from ucmagic.files.cache_layout import cache_key, safe_suffix
    from ucmagic.files.volume import open_volume

    vol = open_volume(src)
    e = next(e for e in vol.list() if e.path == rel)
    fc = FileCache(cache, int(limit) or None)
    fc.fill(cache_key(vol.uri, e.path, e.size, e.mtime), safe_suffix(e.path), e.size,
            lambda tmp: half_then_stall(os.path.join(src, rel), tmp))


def stage(src: str, dest: str) -> None:
    from ucmagic import staging

    real = staging.fetch_to
    victim = sorted(os.listdir(src))[len(os.listdir(src)) // 2]

    def fetch_to(vol, rel, tmp):
        if rel == victim:
            return half_then_stall(os.path.join(src, rel), tmp)
        return real(vol, rel, tmp)

    staging.fetch_to = fetch_to
    staging.stage(src, dest, processes=1, concurrency=4, progress=False)


def export(table_dir: str, dest: str, point: str) -> None:
    from ucmagic.tables import export as parquet_export

    if point == "before_swap":
        parquet_export.swap_in = lambda staging, dest: ready()
    else:
        print("READY", flush=True)
    parquet_export.export_parquet(table_dir, dest, target_file_size="256KB")
    time.sleep(120)


def ckpt(root: str, step: int, fmt: str) -> None:
    import torch

    from ucmagic.checkpoints import transfer as xfer
    from ucmagic.checkpoints.api import save_checkpoint

    real = xfer.upload_file

    def upload_file(local, remote, **kw):
        rec = real(local, remote, **kw)
        ready()
        return rec

    xfer.upload_file = upload_file
    torch.manual_seed(step)
    model = torch.nn.Linear(64, 64)
    save_checkpoint(root, model=model, step=step, single_file=(fmt == "single"))


def hammer(cache: str, src: str, log: str, seed: str, go: str) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from ucmagic.files.cache import FileCache
    from ucmagic.files.cache_layout import cache_key, safe_suffix
    from ucmagic.files.volume import open_volume

    vol = open_volume(src)
    entries = vol.list()
    random.Random(int(seed)).shuffle(entries)
    fc = FileCache(cache, limit=None)

    def get(e):
        def write(tmp: str) -> int:
            n = vol.copy_to(e.path, tmp)
            fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (e.path + "\n").encode())
            finally:
                os.close(fd)
            return n

        path, _ = fc.fill(cache_key(vol.uri, e.path, e.size, e.mtime), safe_suffix(e.path), e.size, write)
        with open(path, "rb") as f:
            got = hashlib.sha256(f.read()).hexdigest()
        with open(os.path.join(src, e.path), "rb") as f:
            return e.path, got == hashlib.sha256(f.read()).hexdigest()

    open(f"{go}.ready.{seed}", "w").close()  # the parent starts all four at once, when all are here
    deadline = time.monotonic() + 120
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.005)
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(get, entries))
    print(json.dumps({"read": len(results), "bad": [p for p, ok in results if not ok]}), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "ckpt":
        ckpt(args[0], int(args[1]), args[2])
    else:
        {"fill": fill, "stage": stage, "export": export, "hammer": hammer}[mode](*args)
