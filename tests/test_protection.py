"""Issue 13: handed-out paths stay readable, protection belongs to the consuming process, nothing leaks."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest

from ucmagic import DataLoader, UCVolumeDataset
from ucmagic.files.cache import FileCache
from ucmagic.testing import make_files


def rel_of(path: str) -> str:
    with open(path, "rb") as f:
        return f.readline().decode().strip()


@pytest.fixture
def vol(tmp_path):
    root = str(tmp_path / "vol")
    return root, make_files(root, 96, 2000, per_dir=32)


@pytest.mark.parametrize("workers", [2, 3])
def test_paths_collected_across_batches_open_after_break_and_after_the_loader_is_gone(vol, tmp_path, workers):
    root, rels = vol
    ds = UCVolumeDataset(root, shuffle=True, cache_dir=str(tmp_path / "c"))
    loader = DataLoader(ds, batch_size=4, num_workers=workers, collate_fn=list)
    kept = []
    for i, batch in enumerate(loader):
        kept.extend(batch)
        if i == 9:
            break
    assert len(kept) == 40 and all(rel_of(p) in rels for p in kept)  # after break
    again = [p for batch in loader for p in batch]  # the next epoch hands out the same stable paths
    assert set(kept) <= set(again)
    del loader
    gc.collect()
    assert sorted(rel_of(p) for p in again) == sorted(rels)  # after the loader and its workers are gone
    entries = os.path.join(ds.cache.root, "files") + os.sep  # files/<version id>/<the source's relative path>
    assert all(p.startswith(entries) and p.endswith(os.sep + rel_of(p)) for p in again)


def test_paths_of_a_torch_loader_stay_after_the_epoch(vol, tmp_path):
    from torch.utils.data import DataLoader as TorchLoader

    root, rels = vol
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"))
    paths = [p for b in TorchLoader(ds, batch_size=8, num_workers=2, collate_fn=list) for p in b]
    assert sorted(rel_of(p) for p in paths) == sorted(rels)


CHILD = r"""
import sys, time
from ucmagic import DataLoader, UCVolumeDataset
ds = UCVolumeDataset(sys.argv[1], cache_dir=sys.argv[2], cache_limit="150KB")
loader = DataLoader(ds, batch_size=4, num_workers=2, collate_fn=list)
for i, batch in enumerate(loader):
    if i == 3:
        print("READY", flush=True)
        time.sleep(600)
"""


def test_a_killed_process_leaves_nothing_a_new_process_does_not_clean(vol, tmp_path):
    root, _ = vol
    cache = str(tmp_path / "c")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, root, cache], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert proc.stdout.readline().strip() == "READY"
        assert os.listdir(os.path.join(cache, "prot"))  # the live loop protects what it has not consumed
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        proc.stdout.close()
    deadline = time.monotonic() + 120  # a bound for a hang: each look starts an interpreter
    while time.monotonic() < deadline:  # the workers notice their parent is gone and exit
        code = ("import sys; from ucmagic import UCVolumeDataset; "
                "ds = UCVolumeDataset(sys.argv[1], cache_dir=sys.argv[2]); print(ds.stats()['cache_records_bytes'], "
                "ds.stats()['cache_tmp_bytes'])")
        out = subprocess.run([sys.executable, "-c", code, root, cache], capture_output=True, text=True, check=True)
        if out.stdout.split() == ["0", "0"]:
            break
        time.sleep(0.5)
    assert out.stdout.split() == ["0", "0"]
    assert os.listdir(os.path.join(cache, "prot")) == [] and os.listdir(os.path.join(cache, "tmp")) == []


def test_stats_and_clear_cache_account_for_every_byte(vol, tmp_path):
    root, rels = vol
    cache = str(tmp_path / "c")
    other = str(tmp_path / "other")
    make_files(other, 5, 1000, depth=0)
    list(UCVolumeDataset(other, cache_dir=cache))
    ds = UCVolumeDataset(root, cache_dir=cache)
    list(ds)
    with open(os.path.join(cache, "tmp", "k.999999999-1.0.10.part"), "wb") as f:
        f.write(b"1")  # left by a killed fill
    st = ds.stats()
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(cache) for f in fs)
    parts = (st["bytes_cached"], st["cache_other_entries_bytes"], st["cache_records_bytes"], st["cache_tmp_bytes"],
             st["cache_misc_bytes"])
    assert st["bytes_cached"] == 2000 * len(rels) and st["cache_other_entries_bytes"] == 5000
    assert sum(parts) == st["cache_total_bytes"] == on_disk + 9  # the temp file counts at its final 10 bytes
    assert ds.clear_cache() == len(rels)
    assert os.listdir(os.path.join(cache, "tmp")) == []
    assert FileCache(cache).usage().bytes == 5000  # the other dataset's entries stay


def test_clear_cache_leaves_what_another_process_loop_has_not_consumed(vol, tmp_path):
    """A notebook's clear_cache() while a training process runs on the same cache: the batch that
    loop holds (and the ones prefetched for it) stay; the rest goes, and everything once it ended."""
    root, rels = vol
    cache = str(tmp_path / "c")
    ds = UCVolumeDataset(root, cache_dir=cache)
    ds.warm(background=False)  # every file cached: the other process's loop holds a few of them
    code = (f"import sys\nfrom ucmagic import DataLoader, UCVolumeDataset\n"
            f"ds = UCVolumeDataset({root!r}, cache_dir={cache!r}, prefetch=16)\n"
            "it = iter(DataLoader(ds, batch_size=8, num_workers=0, collate_fn=list))\n"
            "print('\\n'.join(next(it)), flush=True)\nprint('HELD', flush=True)\nsys.stdin.readline()\n"
            "print('\\n'.join(next(it)), flush=True)\n")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdin is not None
    held = []
    for line in p.stdout:
        if line.strip() == "HELD":
            break
        held.append(line.strip())
    try:
        assert len(held) == 8
        removed = ds.clear_cache()
        assert all(os.path.exists(h) for h in held), "a batch the other process's loop holds was removed"
        p.stdin.write("\n")
        p.stdin.flush()
        nxt = [line.strip() for line in p.stdout if line.strip()]
        assert len(nxt) == 8 and all(rel_of(n) in rels for n in nxt)  # its next batch is served and readable
    finally:
        p.kill()
        p.wait()
    assert removed > 0
    assert ds.clear_cache() + removed >= len(held)  # once that process is gone, its files go too
    assert not any(os.path.exists(h) for h in held)
