"""``ucmagic.load`` of a shard directory picks the shard dataset; ``kind=`` overrides."""
from __future__ import annotations

import os

import numpy as np
import pytest

import ucmagic
from ucmagic.errors import LoadUsageError
from ucmagic.shards import SampleStream
from ucmagic.shards.detect import shard_kind
from ucmagic.shards.index import scan_tar, shard_info, write_index

wds = pytest.importorskip("webdataset")


@pytest.fixture
def tars(tmp_path):
    src = tmp_path / "tars"
    src.mkdir()
    for s in range(2):
        with wds.TarWriter(str(src / f"shard-{s:06d}.tar")) as w:
            for i in range(10):
                w.write({"__key__": f"{s}{i:03d}", "txt": f"sample {s}/{i}".encode(), "cls": str(i).encode()})
    return src


def test_load_of_a_tar_directory_streams_samples(tars, tmp_path):
    dl = ucmagic.load(tars, batch_size=4, num_workers=0, cache_dir=str(tmp_path / "c"))
    assert isinstance(dl.dataset, SampleStream)
    keys = [k for batch in dl for k in batch["__key__"]]
    assert sorted(keys) == sorted(f"{s}{i:03d}" for s in range(2) for i in range(10))


def test_a_packed_index_is_detected_and_kind_files_overrides(tars, tmp_path):
    write_index(tars, [shard_info(n, os.path.getsize(tars / n), scan_tar(str(tars / n)))
                       for n in sorted(os.listdir(tars))])
    assert shard_kind(str(tars)) == "shards"
    dl = ucmagic.load(tars, kind="files", batch_size=2, num_workers=0, cache_dir=str(tmp_path / "c"))
    assert type(dl.dataset).__name__ == "UCVolumeDataset"
    assert len(dl.dataset) == 3  # two tars and the index, as files


def test_kind_tokens_needs_a_block_size(tmp_path):
    (tmp_path / "t").mkdir()
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "t" / "x.bin")
    assert shard_kind(str(tmp_path / "t")) is None  # token files are not guessed
    with pytest.raises(LoadUsageError, match="block_size"):
        ucmagic.load(tmp_path / "t", kind="tokens", cache_dir=str(tmp_path / "c"))
    dl = ucmagic.load(tmp_path / "t", kind="tokens", block_size=99, batch_size=5, num_workers=0,
                      cache_dir=str(tmp_path / "c"))
    first = next(iter(dl))
    assert first.shape == (5, 100) and first[0, :3].tolist() == [0, 1, 2]


def test_unknown_kind_is_refused(tars):
    with pytest.raises(LoadUsageError, match="--kind"):
        ucmagic.load(tars, kind="images")


def test_ucload_magic_of_a_tar_directory_and_kind_override(tars, tmp_path, magic_shell, monkeypatch):
    pytest.importorskip("IPython")
    monkeypatch.setenv("UCMAGIC_PROGRESS", "off")
    cache = tmp_path / "c"
    dl = magic_shell.run_line_magic("ucload", f"{tars} -b 5 -w 0 --no-widget --cache-dir {cache}")
    assert isinstance(dl.dataset, SampleStream)
    assert sum(len(b["__key__"]) for b in dl) == 20
    dl = magic_shell.run_line_magic("ucload", f"{tars} --kind files -b 5 -w 0 --no-widget --cache-dir {cache}")
    assert type(dl.dataset).__name__ == "UCVolumeDataset"


def test_the_live_panel_shows_chunk_fills(tars, tmp_path, monkeypatch):
    monkeypatch.setenv("UCMAGIC_PROGRESS", "text")
    dl = ucmagic.load(tars, batch_size=5, num_workers=0, cache_dir=str(tmp_path / "c"))
    mon = dl.monitor(mode="text", show=False)
    before = dl.dataset.stats()
    assert before["files"] == before["chunks"] >= 2 and before["files_cached"] == 0
    for _ in dl:
        pass
    snap = mon.snapshot()
    assert snap.files == before["chunks"] and snap.files_cached == snap.files  # every chunk filled
    assert dl.dataset.stats()["misses"] == before["chunks"]
    mon.detach()


def test_describe_load_names_a_shard_directory(tars):
    plan = ucmagic.describe_load(tars)
    assert plan.kind == "shards" and plan.files == 2
    (tars / ".ucpack-state.json").write_text("{}")  # what pack leaves beside its shards: no shard
    assert ucmagic.describe_load(tars).files == 2
    assert ucmagic.describe_load(tars, files=True).kind == "files"


def test_the_explorer_names_the_slow_shard_and_its_chunk(tmp_path):
    pytest.importorskip("ipywidgets")
    src = tmp_path / "tars"
    src.mkdir()
    for s in range(3):
        with wds.TarWriter(str(src / f"shard-{s:06d}.tar")) as w:
            for i in range(12):
                w.write({"__key__": f"{s}{i:03d}", "bin": os.urandom(1500), "cls": str(i).encode()})
    ds = ucmagic.TarShards(f"slow://{src}", cache_dir=str(tmp_path / "c"), chunk_size=8192, storage_options={
        "open_ms": 1, "mbps": 0, "list_ms": 0, "slow_files": {"shard-000001.tar": 600}})
    loader = ucmagic.DataLoader(ds.stream(read_ahead=0), batch_size=4, num_workers=0, log_to_mlflow=False,
                                collate_fn=lambda b: [x["__key__"] for x in b])
    assert sum(len(b) for b in loader) == 36
    stats = loader.stats
    slow = stats.slowest_batches(1)[0]
    top = stats.batch_files(slow)[0]  # the batch's slowest item names its shard and chunk
    assert "shard-000001.tar#chunk" in top["file"] and not top["hit"] and top["fetch_s"] >= 0.6
    fills = [r for i in range(len(stats.batches()["step"])) for r in stats.batch_files(i) if not r["hit"]]
    slow_fills = {r["file"] for r in fills if r["fetch_s"] >= 0.6}  # the slow shard's opens, no other shard's
    assert slow_fills and all("shard-000001.tar#chunk" in f for f in slow_fills)
    ex = stats.explore()
    ex.batch.value = int(slow)
    assert "shard-000001.tar#chunk" in ex.files.value.split("</tr>")[1]  # first (slowest) row of its files
    assert "shard-000001.tar#chunk" in ex.table.value  # and the slowest-batches table names it
