"""Issue 13 item 3: the whole cache_dir stays within cache_limit plus about one batch per worker while
an epoch runs (fills wait for room, freed as the loop consumes), and a tiny budget slows, never fails."""
from __future__ import annotations

import contextlib
import os
import threading

import pytest

from ucmagic import DataLoader, UCVolumeDataset
from ucmagic.errors import FetchError
from ucmagic.testing import make_files


def dir_bytes(root: str) -> int:
    total = 0
    for d, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.path.getsize(os.path.join(d, f))
    return total


class Sampler:
    """The size of the whole cache directory, sampled every ~10 ms in a thread."""

    def __init__(self, root: str) -> None:
        self.root, self.peak, self.samples = root, 0, 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            self.peak = max(self.peak, dir_bytes(self.root))
            self.samples += 1

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


def run_epochs(root, cache, limit, *, batch, workers, files_expected, epochs=1):
    ds = UCVolumeDataset(root, shuffle=True, cache_dir=cache, cache_limit=limit)
    loader = DataLoader(ds, batch_size=batch, num_workers=workers, persistent_workers=True, prefetch_factor=4,
                        collate_fn=list)
    with Sampler(cache) as s:
        for _ in range(epochs):
            n = 0
            for b in loader:
                for p in b:
                    with open(p, "rb") as f:  # every path handed out is complete and readable
                        n += len(f.read()) > 0
            assert n == files_expected
    return s


def test_small_files_peak_stays_within_budget_plus_a_batch_per_worker(tmp_path):
    root = str(tmp_path / "vol")
    make_files(root, 240, 150 * 1024, per_dir=60)  # 35 MiB through a 4 MiB budget
    s = run_epochs(root, str(tmp_path / "c"), 4 << 20, batch=16, workers=2, files_expected=240, epochs=2)
    assert s.samples > 10
    assert s.peak <= 10 << 20, s.peak  # 4 MiB + 2 x 2.4 MiB batches, with some slack for temp files


def test_big_files_never_all_on_disk_with_a_smaller_budget(tmp_path):
    root = str(tmp_path / "vol")
    make_files(root, 4, 20 << 20, depth=0)
    limit = 50 << 20
    s = run_epochs(root, str(tmp_path / "c"), limit, batch=1, workers=2, files_expected=4)
    assert s.peak <= limit + 2 * (20 << 20) and s.peak < 4 * (20 << 20) + 1


def test_a_file_larger_than_the_budget_names_both_sizes(tmp_path):
    root = str(tmp_path / "vol")
    make_files(root, 2, 300_000, depth=0)
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), cache_limit="100KB")
    with pytest.raises(FetchError, match=r"300\.0 KB file does not fit in cache_limit=100\.0 KB"):
        list(ds)


def test_budget_smaller_than_the_prefetch_window_slows_but_delivers_everything(tmp_path):
    root = str(tmp_path / "vol")
    make_files(root, 60, 20_000, depth=0)
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), cache_limit=50_000)  # 2 files fit
    loader = DataLoader(ds, batch_size=4, num_workers=2, prefetch_factor=4, collate_fn=list)
    got = [p for b in loader for p in b]
    assert len(got) == 60
