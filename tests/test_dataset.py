import gc
import json
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader as TorchLoader

from ucmagic import UCVolumeDataset
from ucmagic.files.cache import FileCache
from ucmagic.errors import (EmptyListingError, FetchError, ListingChangedError, SizeParseError,
                            SourceNotADirectoryError, SourceNotFoundError)
from ucmagic.files.volume import LocalVolume


def rel_of(path: str) -> str:
    with open(path, "rb") as f:
        return f.readline().decode().strip()


def read_all(path: str) -> tuple[str, int]:
    with open(path, "rb") as f:
        data = f.read()
    return data.split(b"\n", 1)[0].decode(), len(data)


def test_yields_every_file_once_with_its_own_bytes(tree):
    root, rels = tree
    ds = UCVolumeDataset(root)
    got = [rel_of(p) for p in ds]
    assert got == sorted(rels)
    assert len(ds) == len(rels)


def test_databricks_call_shape_works(tree):
    root, rels = tree
    assert len(list(UCVolumeDataset(root))) == len(rels)


def test_cache_persists_across_dataset_objects_and_processes(tree, tmp_path):
    root, rels = tree
    cache = str(tmp_path / "shared-cache")
    first = UCVolumeDataset(root, cache_dir=cache)
    list(first)
    assert first.stats()["misses"] == len(rels)
    second = UCVolumeDataset(root, cache_dir=cache)
    list(second)
    s = second.stats()
    assert s["misses"] == 0 and s["hits"] == len(rels) and s["bytes_fetched"] == 0
    code = (f"from ucmagic import UCVolumeDataset; ds=UCVolumeDataset({root!r}, cache_dir={cache!r}); "
            "list(ds); print(ds.stats()['misses'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "0"  # a "kernel restart" keeps the cache


def test_a_warm_epoch_with_evicted_entries_delivers_everything_in_order_and_refetches_only_those(tree, tmp_path):
    """Runs of hits are served at once; a missing entry in the middle (evicted, cleared) goes back to
    the read-ahead and the epoch carries on in order."""
    root, rels = tree
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"))
    first = list(ds)
    other = FileCache(ds.cache.root)  # another process's view of the cache (a budget, clear_cache)
    other.remove(first[10:13] + first[90:91])
    again = list(ds)
    assert [rel_of(p) for p in again] == sorted(rels) and again == first  # the same paths, every file once
    s = ds.stats()
    assert s["misses"] == len(rels) + 4 and s["hits"] == len(rels) - 4
    other.remove(first[50:51])  # found by the last warm run: looked up again, never handed out dead
    assert list(ds) == first and ds.stats()["misses"] == len(rels) + 5


def test_a_second_epoch_in_the_same_process_looks_up_no_entry_it_filled(tree, tmp_path, monkeypatch):
    """Entries this process filled are served again with no stat while nothing was removed."""
    root, rels = tree
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"))
    first = list(ds)
    looked = []
    real = os.stat
    monkeypatch.setattr(os, "stat", lambda p, *a, **k: (looked.append(p), real(p, *a, **k))[1])
    assert list(ds) == first
    assert not [p for p in looked if str(p).startswith(ds.cache.root)]
    monkeypatch.undo()


def test_state_dict_is_exact_part_way_through_a_warm_epoch(tree, tmp_path):
    root, rels = tree
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), shuffle=True, seed=3)
    list(ds)
    it = iter(ds)
    got = [rel_of(next(it)) for _ in range(45)]
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()
    rest = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), shuffle=True, seed=3)
    rest.load_state_dict(state)
    after = [rel_of(p) for p in rest]
    assert len(after) == len(rels) - 45 and sorted(got + after) == sorted(rels)


def test_changed_source_file_is_fetched_again(tree):
    root, rels = tree
    ds = UCVolumeDataset(root)
    list(ds)
    target = os.path.join(root, rels[0])
    with open(target, "wb") as f:
        f.write(rels[0].encode() + b"\nnew content, other size")
    ds2 = UCVolumeDataset(root)
    paths = list(ds2)
    assert ds2.stats()["misses"] == 1
    assert open(paths[0], "rb").read().endswith(b"new content, other size")


def test_nothing_is_written_to_the_source(tree):
    root, rels = tree
    before = sorted(os.listdir(root))
    mtime = os.stat(root).st_mtime
    list(UCVolumeDataset(root))
    assert sorted(os.listdir(root)) == before and os.stat(root).st_mtime == mtime


def test_cache_dir_is_private_by_default(tree, tmp_path, monkeypatch):
    monkeypatch.setenv("UCMAGIC_CACHE_DIR", str(tmp_path / "fresh"))
    root, _ = tree
    ds = UCVolumeDataset(root)
    assert ds.cache.root == str(tmp_path / "fresh")
    assert os.stat(ds.cache.root).st_mode & 0o777 == 0o700


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_dataloader_workers_split_files_without_overlap_or_gap(tree, method):
    root, rels = tree
    ds = UCVolumeDataset(root)
    loader = TorchLoader(ds, batch_size=8, num_workers=2, multiprocessing_context=method, collate_fn=list)
    got = [rel_of(p) for batch in loader for p in batch]
    assert sorted(got) == sorted(rels) and len(got) == len(rels)
    assert ds.stats()["misses"] == len(rels)  # worker counters reach the main process


def test_distributed_ranks_get_equal_disjoint_shares(tree, monkeypatch):
    root, rels = tree[0], tree[1][:103]
    for r in tree[1][103:]:
        os.remove(os.path.join(root, r))
    seen = []
    for rank in range(4):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "4")
        ds = UCVolumeDataset(root)
        assert len(ds) == 26
        seen.append([rel_of(p) for p in ds])
    assert all(len(s) == 26 for s in seen)  # equal: 103 files padded to 104
    flat = [x for s in seen for x in s]
    assert set(flat) == set(rels) and len(flat) - len(set(flat)) == 1
    monkeypatch.setenv("RANK", "3")
    dropped = UCVolumeDataset(root, partition="drop")
    assert len(list(dropped)) == 25


def test_shuffle_is_seeded_per_epoch_and_identical_on_every_rank(tree, monkeypatch):
    root, rels = tree
    a = UCVolumeDataset(root, shuffle=True, seed=7)
    e0 = [rel_of(p) for p in a]
    e1 = [rel_of(p) for p in a]  # without set_epoch, epochs count up by themselves
    assert sorted(e0) == sorted(rels) and e0 != sorted(rels) and e0 != e1
    b = UCVolumeDataset(root, shuffle=True, seed=7)
    b.set_epoch(1)
    assert [rel_of(p) for p in b] == e1
    b.set_epoch(1)
    assert [rel_of(p) for p in b] == e1  # explicit epochs stay put
    orders = []
    for rank in range(2):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", "2")
        d = UCVolumeDataset(root, shuffle=True, seed=7)
        d.set_epoch(3)
        orders.append([rel_of(p) for p in d])
    assert not set(orders[0]) & set(orders[1]) and sorted(orders[0] + orders[1]) == sorted(rels)


def test_set_epoch_reaches_persistent_workers(tree):
    root, rels = tree
    ds = UCVolumeDataset(root, shuffle=True, seed=3)
    loader = TorchLoader(ds, batch_size=10, num_workers=2, persistent_workers=True, collate_fn=list)
    orders = []
    for epoch in range(2):
        ds.set_epoch(epoch)
        orders.append([rel_of(p) for b in loader for p in b])
    ref = UCVolumeDataset(root, shuffle=True, seed=3)
    ref.set_epoch(1)
    expected = [rel_of(p) for b in TorchLoader(ref, batch_size=10, num_workers=2, collate_fn=list) for p in b]
    assert orders[1] == expected and orders[0] != orders[1]


def _consume_slowly(root, cache, q):
    from ucmagic.errors import BudgetTooSmallError

    # torch's loader reports no consumption: each worker protects up to 64 files, here all 60 of its stream:
    try:  # 2 x 60 x 3 kB do not fit
        next(iter(TorchLoader(UCVolumeDataset(root, cache_dir=cache, cache_limit=20_000), num_workers=2)))
    except BudgetTooSmallError as e:
        assert "cannot hold 60 files" in str(e) and "at least 360.0 KB" in str(e), e
    else:
        raise AssertionError("a budget below one protection window per worker must fail at the first item")
    gc.collect()  # the failed loader's dataset (held by the traceback's cycle) and its 20 kB budget are gone
    ds = UCVolumeDataset(root, cache_dir=cache, cache_limit=384_000)  # more than the error named
    loader = TorchLoader(ds, batch_size=4, num_workers=2, prefetch_factor=4, collate_fn=list)
    bad = 0
    n = 0
    for batch in loader:
        time.sleep(0.002)
        for p in batch:
            rel, size = read_all(p)
            bad += size != 3000
            n += 1
    q.put((n, bad))


def test_tiny_cache_limit_never_breaks_a_consumer(tree, tmp_path):
    root, rels = tree  # 360 kB of files through a 20 kB cache, with workers prefetching
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_consume_slowly, args=(root, str(tmp_path / "tiny"), q))
    p.start()
    p.join(120)
    assert p.exitcode == 0
    n, bad = q.get()
    assert n == len(rels) and bad == 0


def _share(root, cache, q):
    ds = UCVolumeDataset(f"slow://{root}", cache_dir=cache, storage_options={"open_ms": 5, "mbps": 0, "list_ms": 0})
    ok = all(read_all(p)[1] == 3000 for p in ds)
    q.put((ok, ds.stats()["misses"]))


def test_concurrent_processes_share_one_cache_and_fetch_each_file_once(tree, tmp_path):
    root, rels = tree
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_share, args=(root, str(tmp_path / "c"), q)) for _ in range(3)]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(30)
    assert all(ok for ok, _ in results)
    assert sum(m for _, m in results) == len(rels)


def test_faulty_volume_is_retried_transparently(tree):
    root, rels = tree
    ds = UCVolumeDataset(f"slow://{root}", storage_options={"open_ms": 0, "mbps": 0, "list_ms": 0, "fail_every": 7})
    got = [rel_of(p) for p in ds]
    assert got == sorted(rels)
    assert ds.stats()["retries"] >= len(rels) // 7 - 1


class Unreadable(LocalVolume):
    def copy_to(self, rel, dest, **kw):
        if rel.endswith("f000005.bin"):
            raise PermissionError(13, "Permission denied", rel)
        return super().copy_to(rel, dest, **kw)


def test_unreadable_file_raises_naming_it_or_is_skipped(tree):
    root, rels = tree
    ds = UCVolumeDataset(Unreadable(root))
    with pytest.raises(FetchError, match=r"f000005\.bin.*permission"):
        list(ds)
    skipping = UCVolumeDataset(Unreadable(root), on_error="skip")
    with pytest.warns(UserWarning, match="f000005"):
        got = list(skipping)
    assert len(got) == len(rels) - 1 and skipping.stats()["errors"] == 1


def test_clear_errors_for_bad_input(tree, tmp_path):
    root, rels = tree
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        UCVolumeDataset(str(tmp_path / "missing"))
    with pytest.raises(SourceNotADirectoryError):
        UCVolumeDataset(os.path.join(root, rels[0]))
    with pytest.raises(EmptyListingError, match=r"\*\.png"):
        UCVolumeDataset(root, pattern="*.png")
    with pytest.raises(SizeParseError, match="50 gigs"):
        UCVolumeDataset(root, cache_limit="50 gigs")
    with pytest.raises(ValueError, match="partition"):
        UCVolumeDataset(root, partition="even")


def test_pattern_selects_files(tree):
    root, rels = tree
    ds = UCVolumeDataset(root, pattern="**/g0001/*.bin")
    assert [rel_of(p) for p in ds] == sorted(r for r in rels if "/g0001/" in r)


def test_pickles_and_iterates_after_unpickling(tree):
    root, rels = tree
    ds = UCVolumeDataset(root, shuffle=True)
    clone = pickle.loads(pickle.dumps(ds))
    assert len(list(clone)) == len(rels)


def test_warm_prefills_and_clear_cache_empties(tree):
    root, rels = tree
    ds = UCVolumeDataset(root)
    fut = ds.warm(background=True)
    assert fut.result(timeout=60) == len(rels)
    s = ds.stats()
    assert s["files_cached"] == len(rels) and s["bytes_cached"] == 3000 * len(rels)
    list(ds)
    assert ds.stats()["hits"] == len(rels)
    assert ds.clear_cache() == len(rels)
    assert ds.stats()["files_cached"] == 0
    assert ds.warm(background=False).result() == len(rels)


def test_stats_report_latency_percentiles(tree):
    root, _ = tree
    ds = UCVolumeDataset(f"slow://{root}", storage_options={"open_ms": 10, "mbps": 0, "list_ms": 0})
    list(ds)
    s = ds.stats()
    assert 0.009 < s["fetch_p50_s"] <= s["fetch_p90_s"] <= s["fetch_p99_s"]
    json.dumps(s)


def test_single_process_resume_delivers_exactly_the_rest(tree):
    root, rels = tree
    ds = UCVolumeDataset(root, shuffle=True, seed=5)
    it = iter(ds)
    before = [rel_of(next(it)) for _ in range(37)]
    state = json.loads(json.dumps(ds.state_dict()))
    it.close()
    fresh = UCVolumeDataset(root, shuffle=True, seed=5)
    fresh.load_state_dict(state)
    assert len(fresh) == len(rels)  # len() is a whole epoch's, also when resumed (as torchdata's StatefulDataLoader)
    after = [rel_of(p) for p in fresh]
    assert len(after) == len(rels) - 37
    assert sorted(before + after) == sorted(rels)
    nxt = [rel_of(p) for p in fresh]  # then the next epoch is whole again
    assert sorted(nxt) == sorted(rels)


def test_resume_refuses_a_changed_listing(tree):
    root, rels = tree
    ds = UCVolumeDataset(root)
    it = iter(ds)
    next(it)
    state = ds.state_dict()
    os.remove(os.path.join(root, rels[-1]))
    with pytest.raises(ListingChangedError, match="changed"):
        UCVolumeDataset(root).load_state_dict(state)


def test_import_is_light():
    code = "import sys, ucmagic; assert 'torch' not in sys.modules and 'pyarrow' not in sys.modules; print('ok')"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "ok"


def _ranks(root, monkeypatch, world, local, **kw):
    out = []
    for rank in range(world):
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setenv("WORLD_SIZE", str(world))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local))
        out.append(UCVolumeDataset(root, **kw))
    return out


@pytest.mark.parametrize("shuffle", [True, "node", "global"])
def test_elastic_resume_onto_a_different_number_of_nodes(tree, monkeypatch, shuffle):
    root, rels = tree  # 120 files; saved on 2 nodes x 2 ranks, resumed on 3 nodes x 1 rank
    before = []
    datasets = _ranks(root, monkeypatch, 4, 2, shuffle=shuffle, seed=9)
    delivered = [7, 30, 0, 12]
    for rank, (ds, k) in enumerate(zip(datasets, delivered)):
        monkeypatch.setenv("RANK", str(rank))
        ds.set_epoch(2)
        it = iter(ds)
        before += [rel_of(next(it)) for _ in range(k)]
        it.close()
    monkeypatch.setenv("RANK", "0")
    state = json.loads(json.dumps(datasets[0].make_state(2, delivered, world=4, num_workers=1)))
    after = []
    for rank, ds in enumerate(_ranks(root, monkeypatch, 3, 1, shuffle=shuffle, seed=9)):
        monkeypatch.setenv("RANK", str(rank))
        ds.load_state_dict(state)
        after += [rel_of(p) for p in ds]
    assert len(after) - (len(rels) - sum(delivered)) < 3  # only padding repeats, at most world-1 items
    assert sorted(set(before + after)) == sorted(rels) and not set(before) & set(after)


def _age_tree(root: str, seconds: float = 3600) -> None:
    """Move every mtime ``seconds`` back, so a listing taken now is not "racy" (it is reused)."""
    t = time.time() - seconds
    for dirpath, _, files in os.walk(root):
        for f in files:
            os.utime(os.path.join(dirpath, f), (t, t))
        os.utime(dirpath, (t, t))


def _rewrite_in_place(path: str, data: bytes) -> None:
    """Rewrite ``path``'s bytes (same size) and give it another old mtime: its directory's mtime stays."""
    st = os.stat(path)
    assert len(data) == st.st_size
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, (st.st_mtime - 60, st.st_mtime - 60))


def test_default_restart_never_serves_the_old_copy_of_a_file_rewritten_in_place(tree, tmp_path):
    from ucmagic.errors import SourceChangedError

    root, rels = tree
    _age_tree(root)
    cache = str(tmp_path / "cache")
    first = UCVolumeDataset(root, cache_dir=cache)
    list(first)  # every file cached
    target = os.path.join(root, rels[5])
    new = rels[5].encode() + b"\n" + b"N" * (os.path.getsize(target) - len(rels[5]) - 1)
    _rewrite_in_place(target, new)
    again = UCVolumeDataset(root, cache_dir=cache)  # a restart: the directories are unchanged
    assert again.listing.path == first.listing.path  # reused, not listed again
    served = []
    with pytest.raises(SourceChangedError, match=rels[5]):
        for p in again:
            served.append(read_all(p)[0])
    assert rels[5] not in served
    fresh = UCVolumeDataset(root, cache_dir=cache)  # the stale listing was dropped: listed again
    assert fresh.listing.path != again.listing.path
    got = {read_all(p)[0]: p for p in fresh}
    with open(got[rels[5]], "rb") as f:
        assert f.read() == new


def _listed_then_counting_stats(tree, tmp_path, monkeypatch):
    """A tree listed and cached once (listing reusable), then every ``LocalVolume.stat`` recorded."""
    root, rels = tree
    _age_tree(root)
    cache = str(tmp_path / "cache")
    list(UCVolumeDataset(root, cache_dir=cache))
    stats: list[str] = []
    real = LocalVolume.stat
    monkeypatch.setattr(LocalVolume, "stat", lambda self, rel: stats.append(rel) or real(self, rel))
    return root, rels, cache, stats


@pytest.mark.parametrize("fast_s, pooled", [(1.0, False), (0.0, True)])
def test_restart_checks_run_on_the_loop_thread_when_a_check_is_fast_else_on_threads(tree, tmp_path, monkeypatch,
                                                                                  fast_s, pooled):
    import threading

    root, rels, cache, stats = _listed_then_counting_stats(tree, tmp_path, monkeypatch)
    monkeypatch.setattr("ucmagic.files.filler.FAST_CHECK_S", fast_s)  # 1 s: every check "fast"; 0: none
    threads: set[int] = set()
    counting = LocalVolume.stat

    def noting(self, rel):
        threads.add(threading.get_ident())
        return counting(self, rel)

    monkeypatch.setattr(LocalVolume, "stat", noting)
    assert sorted(rel_of(p) for p in UCVolumeDataset(root, cache_dir=cache)) == sorted(rels)
    assert sorted(stats) == sorted(rels)  # each file checked once either way
    assert (threads != {threading.get_ident()}) == (pooled and len(rels) > 16)


def test_default_restart_checks_each_file_once_per_dataset_not_per_epoch(tree, tmp_path, monkeypatch):
    root, rels, cache, stats = _listed_then_counting_stats(tree, tmp_path, monkeypatch)
    ds = UCVolumeDataset(root, cache_dir=cache)  # reused listing: no per-file stat up front
    assert stats == []
    for epoch in range(2):
        ds.set_epoch(epoch)
        assert sorted(rel_of(p) for p in ds) == sorted(rels)
    assert sorted(stats) == sorted(rels)  # first use only
    assert ds.stats()["hits"] == 2 * len(rels)


def test_validate_files_checks_up_front_and_not_while_iterating(tree, tmp_path, monkeypatch):
    root, rels, cache, stats = _listed_then_counting_stats(tree, tmp_path, monkeypatch)
    ds = UCVolumeDataset(root, cache_dir=cache, validate="files")
    assert len(list(ds)) == len(rels) and stats == []
    with pytest.raises(ValueError, match="validate"):
        UCVolumeDataset(root, cache_dir=cache, validate="sometimes")


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3000).flatmap(lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1)))))
def test_checked_files_remember_exactly_what_was_added_and_a_plain_pickle_forgets(case):
    from ucmagic.files.dataset import CheckedFiles

    n, added = case
    c = CheckedFiles(n)
    for i in added:
        c.add(i)
    assert {i for i in range(n) if i in c} == added
    some = sorted(added)[:5] + list(range(n))[::-97]  # checked ones first, then any
    want = next((k for k, i in enumerate(some) if i not in c), len(some))
    assert c.checked_prefix(some) == want and c.checked_prefix([]) == 0
    copy = pickle.loads(pickle.dumps(c))
    assert copy.n == n and not any(i in copy for i in range(n))


@pytest.mark.parametrize("evicted", [(10, 80, 81), (5, 70, 71, 72, 100), (0, 66, 67, 130, 190)])
def test_stats_count_each_item_once_when_fills_left_ahead_are_handed_out_by_a_warm_run(tmp_path, evicted):
    """A read-ahead lane that hands back to warm runs (a streak of hits) leaves fills in flight for
    entries further on; the warm run that hands those positions out must not count them again."""
    from ucmagic.testing import make_files

    rels = make_files(str(tmp_path / "src"), 200, 512, depth=1)
    ds = UCVolumeDataset(str(tmp_path / "src"), cache_dir=str(tmp_path / "c"), prefetch=64)
    first = list(ds)
    assert ds.stats()["misses"] == len(rels)
    for epoch in range(1, 4):
        FileCache(ds.cache.root).remove([first[i] for i in evicted])
        assert list(ds) == first
        s = ds.stats()
        assert s["misses"] == len(rels) + epoch * len(evicted)
        assert s["hits"] == epoch * (len(rels) - len(evicted))
