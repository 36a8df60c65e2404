"""The bounded-cache shuffle: every sample once per epoch, and a stream holds only a few chunks."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic.shards import TarShards
from ucmagic.shards import samples as samples_mod
from ucmagic.shards.chunks import ChunkReader
from ucmagic.shards.shuffle import distinct_files, file_spread, sample_layout


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=30), window=st.integers(1, 6),
       shuffle=st.sampled_from([False, "global", "node"]), seed=st.integers(0, 9), epoch=st.integers(0, 3))
def test_every_sample_once_per_epoch_in_every_mode(sizes, window, shuffle, seed, epoch):
    lay = sample_layout(sizes, shuffle=shuffle, seed=seed, epoch=epoch, window=window, world=4, local_world=2)
    n = sum(sizes)
    assert sorted(lay.rows_of([(0, n)]).tolist()) == list(range(n))


def test_quality_figures_on_known_sequences():
    assert distinct_files([0] * 32, 8) == 1.0
    assert distinct_files(list(range(8)) * 4, 8) == 8.0
    assert file_spread([0, 1] * 50, [50, 50], block=10) == 1.0
    assert file_spread([0] * 50 + [1] * 50, [50, 50], block=10) == 0.5


@pytest.mark.parametrize("window", [1, 4])
def test_a_shuffled_stream_holds_about_window_chunks(tmp_path, monkeypatch, window):
    wds = pytest.importorskip("webdataset")
    src = tmp_path / "s"
    src.mkdir()
    rng = np.random.default_rng(0)
    for s in range(6):
        with wds.TarWriter(str(src / f"shard-{s:06d}.tar")) as w:
            for i in range(80):
                w.write({"__key__": f"{s}{i:04d}", "bin": rng.bytes(3000)})
    chunk = 32 << 10
    ds = TarShards(src, cache_dir=str(tmp_path / "c"), chunk_size=chunk)

    class Watched(ChunkReader):
        peak = 0

        def read(self, file: int, offset: int, size: int) -> bytes:
            out = super().read(file, offset, size)
            Watched.peak = max(Watched.peak, len(self.held()) + self.inflight())
            return out

    monkeypatch.setattr(samples_mod, "ChunkReader", Watched)
    read_ahead = 2
    got = list(ds.stream(shuffle=True, seed=1, shuffle_window=window, read_ahead=read_ahead))
    assert len(got) == len(ds)
    total_chunks = sum(f.chunks for f in ds.files)
    assert total_chunks > 4 * (window + read_ahead)
    assert Watched.peak <= window + read_ahead + 2, Watched.peak  # the window's runs, read-ahead, straddling
    shards = ds.shard_of(ds.stream(shuffle=True, seed=1, shuffle_window=window).stream_samples(0))
    assert distinct_files(shards, 8) >= (1.0 if window == 1 else 2.5)
