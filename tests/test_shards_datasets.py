"""Sample datasets over shards: what real writers produce reads back exactly, through a bounded chunk cache."""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tarfile
import threading
import time

import numpy as np
import pytest
import torch

import ucmagic
from ucmagic.errors import ShardFormatError, SourceChangedError
from ucmagic.shards import TarShards, TokenWindows, distinct_files
from ucmagic.shards.chunks import ChunkReader
from ucmagic.shards.index import write_index, scan_tar, shard_info

wds = pytest.importorskip("webdataset")

CHUNK = 64 << 10


def write_shards(root, shards: int = 4, per: int = 40, seed: int = 0) -> list[dict]:
    """WebDataset shards written by webdataset's TarWriter; returns the samples in order."""
    os.makedirs(root, exist_ok=True)
    rng = random.Random(seed)
    out = []
    for s in range(shards):
        with wds.TarWriter(os.path.join(root, f"shard-{s:06d}.tar")) as w:
            for i in range(per):
                smp = {"__key__": f"{s:02d}{i:04d}", "jpg": rng.randbytes(rng.randint(0, 9000)),
                       "cls": str(i % 5).encode()}
                w.write(smp)
                out.append(smp)
    return out


def same(got: dict, want: dict) -> bool:
    return all(got[k] == want[k] for k in ("__key__", "jpg", "cls"))


@pytest.fixture
def shards(tmp_path):
    src = tmp_path / "shards"
    return str(src), write_shards(src), str(tmp_path / "cache")


# ------------------------------------------------------------ reading back exactly

def test_webdataset_shards_read_back_exactly_by_index(shards):
    src, want, cache = shards
    ds = TarShards(src, cache_dir=cache, chunk_size=CHUNK)
    assert len(ds) == len(want)
    for i in random.Random(1).sample(range(len(want)), len(want)):  # random access
        assert same(ds[i], want[i])
    ref = list(wds.WebDataset(os.path.join(src, "shard-{000000..000003}.tar"), shardshuffle=False))
    assert [r["__key__"] for r in ref] == [ds[i]["__key__"] for i in range(len(ds))]
    assert all(ds[i]["jpg"] == r["jpg"] for i, r in enumerate(ref))


def test_shards_written_by_tar_read_back_exactly(tmp_path):
    src = tmp_path / "files"
    src.mkdir()
    want = {}
    for i in range(30):
        for ext in ("jpg", "json"):
            data = os.urandom(i * 311)
            (src / f"{i:05d}.{ext}").write_bytes(data)
            want[(f"{i:05d}", ext)] = data
    (tmp_path / "tars").mkdir()
    names = sorted(p.name for p in src.iterdir())
    subprocess.run(["tar", "-cf", str(tmp_path / "tars" / "a.tar"), "-C", str(src), *names], check=True, timeout=30)
    ds = TarShards(tmp_path / "tars", cache_dir=str(tmp_path / "cache"), chunk_size=CHUNK)
    assert len(ds) == 30
    for i in range(30):
        s = ds[i]
        assert s["jpg"] == want[(s["__key__"], "jpg")] and s["json"] == want[(s["__key__"], "json")]


def test_a_packed_index_is_used_instead_of_reading_headers(shards, tmp_path):
    src, want, cache = shards
    infos = [shard_info(n, os.path.getsize(os.path.join(src, n)), scan_tar(os.path.join(src, n)))
             for n in sorted(os.listdir(src))]
    write_index(src, infos)
    ds = TarShards(src, cache_dir=cache, chunk_size=CHUNK)
    assert not os.path.exists(os.path.join(cache, "shard-index"))  # no tar headers were read
    assert all(same(ds[i], want[i]) for i in range(len(want)))


def test_a_foreign_shard_is_indexed_once_per_node(shards):
    src, want, cache = shards
    TarShards(src, cache_dir=cache, chunk_size=CHUNK)
    kept = sorted(os.listdir(os.path.join(cache, "shard-index")))
    assert len([n for n in kept if n.endswith(".json")]) == 4
    stamps = [os.stat(os.path.join(cache, "shard-index", n)).st_mtime_ns for n in kept]
    ds = TarShards(src, cache_dir=cache, chunk_size=CHUNK)  # a second dataset reuses them
    assert [os.stat(os.path.join(cache, "shard-index", n)).st_mtime_ns for n in kept] == stamps
    assert same(ds[5], want[5])


def test_a_compressed_tar_is_refused_with_a_hint(tmp_path):
    (tmp_path / "s").mkdir()
    with tarfile.open(tmp_path / "s" / "a.tar", "w:gz") as tf:
        tf.add(__file__, arcname="x.py")
    with pytest.raises(ShardFormatError, match="gzip-compressed tar: compressed tars are refused.*gzip -dc"):
        TarShards(tmp_path / "s", cache_dir=str(tmp_path / "c"))


# ------------------------------------------------------------ token windows

@pytest.fixture
def tokens(tmp_path):
    src = tmp_path / "tok"
    src.mkdir()
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 2**16, n, dtype=np.uint16) for n in (1000, 37, 1, 5003)]
    parts[0].tofile(src / "a.bin")
    np.save(src / "b.npy", parts[1])
    parts[2].tofile(src / "c.bin")
    parts[3].tofile(src / "d.bin")
    return src, np.concatenate(parts).astype(np.int64), str(tmp_path / "cache")


@pytest.mark.parametrize("target", [True, False])
def test_token_windows_exact_across_file_boundaries(tokens, target):
    src, allt, cache = tokens
    block = 64
    ds = TokenWindows(src, block_size=block, target=target, cache_dir=cache, chunk_size=1024)
    extra = 1 if target else 0
    assert len(ds) == (len(allt) - extra) // block
    crossing = []
    for i in range(len(ds)):
        a = i * block
        w = ds[i]
        assert w.dtype == torch.int64 and len(w) == block + extra
        assert torch.equal(w, torch.from_numpy(allt[a:a + block + extra]))
        crossing.append(len(ds.spans(i)))
    assert sorted(crossing)[-2:] == [2, 3]  # windows over a.bin|b.npy and b.npy|c.bin|d.bin were read


def test_uint32_tokens_and_a_dtype_mismatch(tmp_path):
    (tmp_path / "t").mkdir()
    arr = np.arange(1000, dtype=np.uint32) * 70_000
    np.save(tmp_path / "t" / "x.npy", arr)
    with pytest.raises(ShardFormatError, match="uint32"):
        TokenWindows(tmp_path / "t", block_size=10, cache_dir=str(tmp_path / "c"))
    ds = TokenWindows(tmp_path / "t", block_size=10, dtype="uint32", cache_dir=str(tmp_path / "c"))
    assert ds[3].tolist() == (arr[30:41].astype(np.int64)).tolist()


# ------------------------------------------------------------ streams: partition, shuffle, epochs

@pytest.mark.parametrize("shuffle", [False, True])
def test_stream_delivers_every_sample_once_under_a_torch_dataloader_with_2_workers(shards, shuffle):
    src, want, cache = shards
    stream = TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream(shuffle=shuffle, seed=3, shuffle_window=4)
    dl = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=2)
    got = list(dl)
    assert sorted(s["__key__"] for s in got) == sorted(w["__key__"] for w in want)
    by_key = {w["__key__"]: w for w in want}
    assert all(same(s, by_key[s["__key__"]]) for s in got)


def _frozen_in_worker(batch: list) -> list:
    import gc

    from ucmagic._util import settle_worker

    # once per batch: gc.get_freeze_count() walks every frozen object (in a worker forked from the test
    # process, the whole suite's heap: 0.1 s a call, 20 s of the test when called per sample)
    frozen = gc.get_freeze_count()
    kept = settle_worker()
    return [(s["__key__"], frozen, kept) for s in batch]


def test_loader_workers_are_tuned_for_big_batches_and_the_main_process_is_left_alone(shards):
    """A worker freezes the objects it inherited (no copy-on-write full collections) and keeps freed
    heap for the next batch (_util.settle_worker); the user's own process is never changed."""
    import gc
    import platform

    src, want, cache = shards
    before = gc.get_freeze_count()
    stream = TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream(shuffle=True)
    dl = torch.utils.data.DataLoader(stream, batch_size=8, num_workers=1, collate_fn=_frozen_in_worker)
    got = [x for b in dl for x in b]
    assert sorted(k for k, _, _ in got) == sorted(w["__key__"] for w in want)
    assert all(frozen > 0 for _, frozen, _ in got)
    if platform.libc_ver()[0] == "glibc":
        assert all(heap_kept for _, _, heap_kept in got)
    assert gc.get_freeze_count() == before
    assert len(list(stream)) == len(want) and gc.get_freeze_count() == before  # iterating in this process


def test_ranks_and_workers_get_equal_disjoint_parts(shards):
    src, want, cache = shards
    stream = TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream(shuffle=True, seed=1)
    parts = [stream.stream_samples(0, rank=r, world=3, worker=w, num_workers=2) for r in range(3) for w in range(2)]
    per_rank = [sum(len(p) for p in parts[r * 2:(r + 1) * 2]) for r in range(3)]
    assert len(set(per_rank)) == 1 and per_rank[0] * 3 >= len(want)
    allp = np.concatenate(parts)
    assert set(allp.tolist()) == set(range(len(want)))  # padding repeats a few, nothing is missing


def test_epochs_are_seeded_and_differ(shards):
    src, _, cache = shards
    ds = TarShards(src, cache_dir=cache, chunk_size=CHUNK)
    a, b = ds.stream(shuffle=True, seed=7), ds.stream(shuffle=True, seed=7)
    assert np.array_equal(a.stream_samples(0), b.stream_samples(0))
    assert not np.array_equal(a.stream_samples(0), a.stream_samples(1))
    assert sorted(a.stream_samples(1).tolist()) == list(range(len(ds)))


def test_shuffle_mixes_shards_with_a_quality_floor(tmp_path):
    src = tmp_path / "s"
    write_shards(src, shards=16, per=60)
    ds = TarShards(src, cache_dir=str(tmp_path / "c"), chunk_size=CHUNK)
    plain = ds.shard_of(ds.stream(shuffle=False).stream_samples(0))
    mixed = ds.shard_of(ds.stream(shuffle=True, seed=0, shuffle_window=8).stream_samples(0))
    assert distinct_files(plain, 8) <= 1.2
    assert distinct_files(mixed, 8) >= 3.5  # 8 runs of about one chunk each mixed at a time


def test_node_shuffle_keeps_each_node_on_its_slice_across_epochs(shards, monkeypatch):
    src, want, cache = shards
    ds = TarShards(src, cache_dir=cache, chunk_size=CHUNK)
    stream = ds.stream(shuffle="node", seed=2)
    import ucmagic.files.epochs as epochs  # the resume order's home (EpochTracking._order_params)

    monkeypatch.setattr(epochs, "local_world_size", lambda world: 2)
    got = []
    for epoch in (0, 1):
        lay = stream.layout(epoch, world=4)
        node0 = lay.rows_of(stream.stream_ranges(epoch, 0, 4, 0, 1) + stream.stream_ranges(epoch, 1, 4, 0, 1))
        got.append(set(node0.tolist()))
    assert got[0] == got[1] and len(got[0]) == len(want) // 2


# ------------------------------------------------------------ budget, changed source

@pytest.mark.parametrize("window", [1, 2])
def test_chunk_budget_held_while_iterating(tmp_path, window):
    src = tmp_path / "s"
    write_shards(src, shards=3, per=60)
    total = sum(os.path.getsize(src / n) for n in os.listdir(src))
    limit = 4 * CHUNK
    assert total > 3 * limit  # the budget is far smaller than the data (and than one shard)
    ds = TarShards(src, cache_dir=str(tmp_path / "c"), cache_limit=limit, chunk_size=CHUNK)
    stream = ds.stream(shuffle=True, seed=0, shuffle_window=window, read_ahead=2)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], ds.cache.usage().total_bytes)
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        got = [s["__key__"] for s in stream]
    finally:
        stop.set()
        t.join()
    assert len(got) == len(ds) and len(set(got)) == len(ds)
    # the budget plus the chunks a blocked read fills over it: two when a sample straddles a chunk edge
    assert peak[0] <= limit + 2 * CHUNK + (16 << 10), peak[0]
    assert ds.counters.totals()["misses"] > total // CHUNK  # chunks were evicted and filled again


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("fits", [True, False], ids=["windows-fit", "windows-exceed"])
def test_peak_cache_under_a_budget_smaller_than_one_shard(tmp_path, workers, fits):
    """The documented bound (docs/shards.md, "Sizing a budget"): the budget plus two chunks per stream
    when it holds every stream's working set (shuffle_window + read_ahead + 2 chunks) and a chunk of
    headroom; under that, the budget plus shuffle_window + 2 chunks per stream (a blocked read goes
    over, and its chunk stays until the last sample of the stream's window that needs it)."""
    src = tmp_path / "s"
    write_shards(src, shards=3, per=200)
    sizes = [os.path.getsize(src / n) for n in os.listdir(src)]
    streams = max(1, workers)
    window, read_ahead = (2, 1) if fits else (8, 4)
    limit = (streams * (window + read_ahead + 3) if fits else 4) * CHUNK
    assert min(sizes) > limit and sum(sizes) > 2 * limit  # the budget is smaller than one shard
    bound = limit + streams * (2 if fits else window + 2) * CHUNK
    ds = TarShards(src, cache_dir=str(tmp_path / "c"), cache_limit=limit, chunk_size=CHUNK)
    stream = ds.stream(shuffle=True, seed=1, shuffle_window=window, read_ahead=read_ahead)
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            u = ds.cache.usage()  # chunks cached and fills in progress (at their full size)
            peak[0] = max(peak[0], u.bytes + u.tmp_bytes)
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    try:
        loader = ucmagic.DataLoader(stream, batch_size=8, num_workers=workers, collate_fn=_keys)
        got = [k for batch in loader for k in batch]
    finally:
        stop.set()
        t.join()
    print(f"peak {peak[0] / CHUNK:.2f} chunks, budget {limit // CHUNK}, bound {bound // CHUNK}")
    assert sorted(got) == sorted(ds.keys)
    assert limit * 3 // 4 < peak[0] <= bound, (peak[0], bound)  # the budget binds; never past the bound
    assert ds.counters.totals()["misses"] > sum(sizes) // CHUNK  # chunks were evicted and filled again


def test_a_source_changed_after_listing_raises_and_never_mixes(shards):
    src, want, cache = shards
    ds = TarShards(src, cache_dir=cache, chunk_size=CHUNK)
    assert same(ds[0], want[0])  # chunk 0 of shard 0 cached from the listed version
    path = os.path.join(src, "shard-000001.tar")
    raw = bytearray(open(path, "rb").read())
    raw[-2000:-1000] = os.urandom(1000)
    with open(path, "wb") as f:
        f.write(raw)
    os.utime(path, (time.time() + 5, time.time() + 5))
    first_of_1 = next(i for i, w in enumerate(want) if w["__key__"].startswith("01"))
    with pytest.raises(SourceChangedError, match="changed after it was listed"):
        ds[first_of_1]
    assert same(ds[0], want[0])
    fresh = TarShards(src, cache_dir=cache, chunk_size=CHUNK)  # a new dataset reads the new version
    assert fresh[first_of_1]["__key__"] == want[first_of_1]["__key__"]


def test_one_fill_per_chunk_when_threads_ask_at_once(shards):
    src, _, cache = shards
    ds = TarShards(src, cache_dir=cache, chunk_size=CHUNK)
    f = ds.files[0]
    readers = [ChunkReader(ds.cache, ds.files, counters=ds.counters) for _ in range(6)]
    data = open(os.path.join(src, f.entry.path), "rb").read()
    out: list[bytes] = []
    ts = [threading.Thread(target=lambda r=r: out.append(r.read(0, 0, len(data)))) for r in readers]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert out == [data] * 6
    assert sum(r.fills for r in readers) == f.chunks
    for r in readers:
        r.close()


# ------------------------------------------------------------ resume

def test_plain_iteration_resumes_exactly_mid_epoch(shards):
    src, want, cache = shards
    stream = TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream(shuffle=True, seed=5, shuffle_window=3)
    full = [s["__key__"] for s in stream]
    stream2 = TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream(shuffle=True, seed=5, shuffle_window=3)
    it = iter(stream2)
    first = [next(it)["__key__"] for _ in range(57)]
    state = json.loads(json.dumps(stream2.state_dict()))
    it.close()
    stream3 = TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream()
    stream3.load_state_dict(state)
    rest = [s["__key__"] for s in stream3]
    assert first + rest == full


RESUME_CHILD = r"""
import json, sys, ucmagic
src, cache, state, workers = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
stream = ucmagic.TarShards(src, cache_dir=cache, chunk_size=65536).stream(shuffle=True, seed=9)
dl = ucmagic.DataLoader(stream, batch_size=4, num_workers=workers, collate_fn=lambda b: [s["__key__"] for s in b])
dl.load_state_dict(state)
print(json.dumps([k for batch in dl for k in batch]))
"""


def test_resume_in_a_new_process_with_other_workers_is_exact(shards):
    src, want, cache = shards
    stream = TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream(shuffle=True, seed=9)
    dl = ucmagic.DataLoader(stream, batch_size=4, num_workers=2, collate_fn=lambda b: [s["__key__"] for s in b])
    seen = []
    for n, batch in enumerate(dl):
        seen += batch
        if n == 9:
            break
    state = dl.state_dict()
    out = subprocess.run([sys.executable, "-c", RESUME_CHILD, src, cache, json.dumps(state), "3"],
                         capture_output=True, text=True, timeout=150)
    assert out.returncode == 0, out.stderr[-2000:]
    rest = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted(seen + rest) == sorted(w["__key__"] for w in want)


# ------------------------------------------------------------ more consumers and sources

def test_map_style_and_stream_under_spawned_workers(shards):
    src, want, cache = shards
    ds = TarShards(src, cache_dir=cache, chunk_size=CHUNK)
    dl = torch.utils.data.DataLoader(ds, batch_size=8, num_workers=2, multiprocessing_context="spawn",
                                     collate_fn=_keys)
    assert [k for b in dl for k in b] == [w["__key__"] for w in want]  # map-style: the sampler's order
    sdl = torch.utils.data.DataLoader(ds.stream(shuffle=True), batch_size=8, num_workers=2,
                                      multiprocessing_context="spawn", collate_fn=_keys)
    assert sorted(k for b in sdl for k in b) == sorted(w["__key__"] for w in want)


def _keys(batch):
    return [s["__key__"] for s in batch]


def test_remote_shards_over_fsspec_read_headers_and_chunks_by_ranges(shards):
    src, want, cache = shards
    ds = TarShards(f"slow://{src}", storage_options={"open_ms": 0, "mbps": 0, "list_ms": 0}, cache_dir=cache,
                   chunk_size=CHUNK)
    assert len(ds) == len(want)
    assert all(same(ds[i], want[i]) for i in (0, 17, len(want) - 1))


def test_loader_telemetry_names_shard_chunks(shards):
    src, want, cache = shards
    stream = TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream()
    loader = ucmagic.DataLoader(stream, batch_size=10, num_workers=0, collate_fn=_keys, log_to_mlflow=False)
    assert sum(len(b) for b in loader) == len(want)
    rows = loader.stats.batch_files(0)
    assert rows and all("shard-000000.tar#chunk" in r["file"] for r in rows)
    assert stream.counters.totals()["misses"] >= 1  # chunk fills, as the live panel shows them


def test_token_stream_resume_with_other_workers_is_exact(tokens):
    src, allt, cache = tokens
    make = lambda: TokenWindows(src, block_size=16, cache_dir=cache, chunk_size=1024).stream(shuffle=True, seed=4)  # noqa: E731
    dl = ucmagic.DataLoader(make(), batch_size=8, num_workers=2, log_to_mlflow=False)
    seen = []
    for n, batch in enumerate(dl):
        seen += [tuple(w.tolist()) for w in batch]
        if n == 6:
            break
    state = json.loads(json.dumps(dl.state_dict()))
    dl2 = ucmagic.DataLoader(make(), batch_size=8, num_workers=0, log_to_mlflow=False)
    dl2.load_state_dict(state)
    rest = [tuple(w.tolist()) for b in dl2 for w in b]
    ds = make().dataset
    assert sorted(seen + rest) == sorted(tuple(ds[i].tolist()) for i in range(len(ds)))


def test_break_mid_epoch_releases_every_chunk(shards):
    src, _, cache = shards
    ds = TarShards(src, cache_dir=cache, cache_limit=6 * CHUNK, chunk_size=CHUNK)
    for n, _ in enumerate(ds.stream(shuffle=True, shuffle_window=3, read_ahead=3)):
        if n == 25:
            break
    assert ds.cache.usage().protected_bytes == 0
    assert not [n for n in os.listdir(os.path.join(cache, "prot")) if "chunks-s" in n]


KILLED_CHILD = r"""
import sys, time, ucmagic
ds = ucmagic.TarShards(sys.argv[1], cache_dir=sys.argv[2], cache_limit=6 * 65536, chunk_size=65536)
for n, s in enumerate(ds.stream(shuffle=True, read_ahead=3)):
    if n == 5:
        print("reading", flush=True)
    time.sleep(0.01)
"""


def test_a_killed_reader_leaves_nothing_protected_and_the_cache_consistent(shards):
    import signal

    src, want, cache = shards
    p = subprocess.Popen([sys.executable, "-c", KILLED_CHILD, src, cache], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "reading"
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    ds = TarShards(src, cache_dir=cache, cache_limit=6 * CHUNK, chunk_size=CHUNK)
    assert ds.cache.usage().protected_bytes == 0  # the dead reader's record protects nothing
    assert all(same(ds[i], want[i]) for i in range(len(want)))


@pytest.mark.parametrize("shuffle", [False, True, "node"])
def test_resume_is_elastic_across_ranks_and_workers(shards, shuffle, monkeypatch):
    src, want, cache = shards
    import ucmagic.files.epochs as epochs

    monkeypatch.setattr(epochs, "local_world_size", lambda world: 1)  # one rank per node: node mode applies
    make = lambda: TarShards(src, cache_dir=cache, chunk_size=CHUNK).stream(shuffle=shuffle, seed=3, partition="drop")  # noqa: E731
    a = make()
    world, workers = 2, 2
    streams = [a.stream_samples(0, rank=r, world=world, worker=w, num_workers=workers)
               for r in range(world) for w in range(workers)]
    delivered = [3, 11, 0, 7]
    done = np.concatenate([s[:d] for s, d in zip(streams, delivered)])
    state = json.loads(json.dumps(a.make_state(0, delivered, world=world, num_workers=workers)))
    b = make()
    b.load_state_dict(state)
    rest = np.concatenate([b.stream_samples(0, rank=r, world=3, worker=0, num_workers=1) for r in range(3)])
    everything = set(np.concatenate(streams).tolist())  # the epoch under 2 ranks ("drop": no repeats)
    left = len(everything) - len(done)
    assert len(rest) == left - left % 3  # 3 ranks now, equal lengths: "drop" leaves out the remainder
    assert set(rest.tolist()) <= everything - set(done.tolist())  # nothing twice, nothing from outside
