import multiprocessing as mp
import os
import shutil
import sys
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucmagic.files.cache import TOUCH_EVERY_S, FileCache, SeenEntries
from ucmagic.files.cache_layout import cache_key, entry_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cache_helpers, whatever pytest's import mode
from cache_helpers import entry_of, writer


def test_fill_then_hit_and_no_partial_file_visible(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "f", 5, 0)
    assert c.lookup(key, ".bin", 5) is None

    def failing(tmp):
        with open(tmp, "wb") as f:
            f.write(b"12")
        raise OSError("network went away")

    with pytest.raises(OSError):
        c.fill(key, ".bin", 5, failing)
    assert c.lookup(key, ".bin", 5) is None
    assert os.listdir(tmp_path / "c" / "tmp") == []
    path, fetched = c.fill(key, ".bin", 5, writer(b"hello"))
    assert fetched and open(path, "rb").read() == b"hello"
    path2, fetched2 = c.fill(key, ".bin", 5, writer(b"XXXXX"))
    assert not fetched2 and path2 == path and open(path, "rb").read() == b"hello"


def test_a_run_lookup_returns_the_leading_hits_as_single_lookups_would(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    keys = [cache_key("v", f"f{i}", 5, 0) for i in range(6)]
    for k in keys[:2] + keys[3:]:
        c.fill(k, ".bin", 5, writer(b"hello"))
    names = [entry_file(k, ".bin", 5) for k in keys]
    got = c.lookup_run(names, [5] * 6)
    assert got == [c.lookup(k, ".bin", 5) for k in keys[:2]]  # stops at the missing third entry
    assert c.lookup_run(names[3:], [5, 4, 5]) == [c.lookup(keys[3], ".bin", 5)]  # a size mismatch ends the run
    assert c.lookup_run([], []) == []


def test_a_run_lookup_trusts_what_it_found_until_the_cache_removes_something(tmp_path, monkeypatch):
    c = FileCache(str(tmp_path / "c"))
    keys = [cache_key("v", f"f{i}", 5, 0) for i in range(4)]
    for k in keys:
        c.fill(k, ".bin", 5, writer(b"hello"))
    names, idx = [entry_file(k, ".bin", 5) for k in keys], np.arange(4)
    seen = c.seen_entries(4)
    paths = [c.data_path(k, ".bin", 5) for k in keys]
    assert c.lookup_run(names, [5] * 4, idx, seen) == paths
    assert seen.known(idx).all()
    calls = []
    monkeypatch.setattr(os, "stat", lambda *a, **k: calls.append(a))
    assert c.lookup_run(names, [5] * 4, idx, seen) == paths and not calls  # found before: no system call
    monkeypatch.undo()
    other = FileCache(c.root)  # another process's view of the same cache: its removals count too
    other.remove(paths[1:2])
    assert c.lookup_run(names, [5] * 4, idx, seen) == paths[:1]  # never a removed entry
    other.evict(keep_below=0)  # evictions count too
    assert c.lookup_run(names, [5] * 4, idx, seen) == []


def test_a_run_lookup_touches_found_entries_again_once_the_touch_window_ends(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "f", 5, 0)
    path, _ = c.fill(key, ".bin", 5, writer(b"hello"))
    seen = c.seen_entries(1)
    seen.filled(0)
    old = time.time() - 3600
    os.utime(path, (old, old))
    assert c.lookup_run([entry_file(key, ".bin", 5)], [5], np.arange(1), seen) == [path]
    assert os.stat(path).st_mtime == old  # within the window: trusted as found, not touched
    seen.sync(c.removals(), time.time() + TOUCH_EVERY_S + 1)  # the window ends
    assert not seen.known(np.arange(1)).any()
    assert c.lookup_run([entry_file(key, ".bin", 5)], [5], np.arange(1), seen) == [path]
    assert os.stat(path).st_mtime > old + 3000  # looked up again and touched (LRU)
    assert os.stat(entry_of(path)).st_mtime > old + 3000  # its entry too: scans read the entry's last use


@given(st.sets(st.integers(0, 999), max_size=60), st.sets(st.integers(0, 999), max_size=60))
def test_seen_entries_know_exactly_what_was_added_or_filled(added, filled):
    seen = SeenEntries(1000, b"t")
    seen.add(np.array(sorted(added), dtype=np.int64))
    for i in filled:
        seen.filled(i)
    assert set(np.flatnonzero(seen.known(np.arange(1000)))) == added | filled
    seen.sync(b"other", time.time())
    assert not seen.known(np.arange(1000)).any()


def test_the_removal_token_changes_with_every_removal_and_with_a_new_cache_dir(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    t = c.removals()
    assert c.removals() == t and FileCache(c.root).removals() == t
    c.remove([])
    assert c.removals() != t
    t = c.removals()
    shutil.rmtree(c.root)
    assert c.removals() != t


def test_short_copy_is_refused(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    with pytest.raises(OSError, match="changed while being read"):
        c.fill(cache_key("v", "f", 10, 0), "", 10, writer(b"short"))
    assert c.usage().files == 0


def test_single_flight_across_threads(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    calls: list = []
    key = cache_key("v", "f", 4, 0)
    results = []
    threads = [threading.Thread(target=lambda: results.append(c.fill(key, "", 4, writer(b"data", 0.05, calls))))
               for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert len({p for p, _ in results}) == 1 and sum(f for _, f in results) == 1


def _proc_fill(root, n, q):
    c = FileCache(root)
    fetched = 0
    for i in range(n):
        data = (f"file-{i}-" * 200).encode()
        path, f = c.fill(cache_key("v", str(i), len(data), 0), ".txt", len(data), writer(data, 0.002))
        assert open(path, "rb").read() == data
        fetched += f
    q.put(fetched)


def test_single_flight_across_processes(tmp_path):
    root = str(tmp_path / "c")
    FileCache(root)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_proc_fill, args=(root, 40, q)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert sum(q.get() for _ in procs) == 40  # each file copied exactly once machine-wide


def test_stable_path_is_the_entry_itself(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "x", 3, 0)
    p, _ = c.fill(key, ".bin", 3, writer(b"abc"))
    assert p == c.data_path(key, ".bin", 3) and c.fill(key, ".bin", 3, writer(b"zzz"))[0] == p
    assert FileCache(str(tmp_path / "c")).lookup(key, ".bin", 3) == p  # same path in any process


def test_entry_owned_by_someone_else_is_not_trusted(tmp_path):
    if os.getuid() != 0:
        pytest.skip("needs root to chown")
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "f", 3, 0)
    p, _ = c.fill(key, "", 3, writer(b"bad"))
    os.chown(p, 12345, 12345)
    assert c.lookup(key, "", 3) is None
    p2, fetched = c.fill(key, "", 3, writer(b"god"))
    assert fetched and open(p2, "rb").read() == b"god" and os.stat(p2).st_uid == 0


def test_cache_pickles_as_settings(tmp_path):
    import pickle

    c = FileCache(str(tmp_path / "c"), limit="1MB")
    c2 = pickle.loads(pickle.dumps(c))
    assert (c2.root, c2.limit, c2.min_free) == (c.root, 10**6, c.min_free)


def test_unbudgeted_fill_leaves_no_temp_file_and_replaces_an_untrusted_entry(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "f", 5, 0)
    stale = c.data_path(key, ".bin", 5)
    os.makedirs(os.path.dirname(stale))
    with open(stale, "wb") as f:
        f.write(b"torn")  # a wrong size is never trusted
    seen: list[int] = []

    def write(tmp: str) -> int:
        assert not tmp.startswith(os.path.join(c.root, "files"))  # copied aside, linked in whole
        seen.append(len(os.listdir(tmp_path / "c" / "tmp")))  # an unnamed file: nothing a kill leaves
        return writer(b"hello")(tmp)

    path, fetched = c.fill(key, ".bin", 5, write)
    assert fetched and path == stale and open(path, "rb").read() == b"hello"
    assert seen == [0] and os.listdir(tmp_path / "c" / "tmp") == []
    assert os.listdir(os.path.dirname(stale)) == [key + ".bin"]


@pytest.mark.parametrize("limit", [None, "1MB"])
def test_a_writer_killed_before_its_file_was_placed_leaves_a_folder_the_next_fill_reuses(tmp_path, limit):
    c = FileCache(str(tmp_path / "c"), limit=limit)
    key = cache_key("v", "train/cat/1.jpg", 5, 0)
    path = c.data_path(key, "", 5, rel="train/cat/1.jpg")
    os.makedirs(os.path.dirname(path))  # the folders made, the file never linked in
    assert c.lookup(key, "", 5, rel="train/cat/1.jpg") is None
    got, fetched = c.fill(key, "", 5, writer(b"hello"), rel="train/cat/1.jpg")
    assert fetched and got == path and open(got, "rb").read() == b"hello"
    assert os.listdir(tmp_path / "c" / "tmp") == []


def test_a_file_where_the_entry_needs_a_folder_is_replaced(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "a/b.txt", 3, 0)
    path = c.data_path(key, "", 3, rel="a/b.txt")
    os.makedirs(os.path.dirname(os.path.dirname(path)))
    with open(os.path.dirname(path), "wb") as f:  # files/<key>-3/a is a file, not a folder
        f.write(b"zz")
    got, fetched = c.fill(key, "", 3, writer(b"abc"), rel="a/b.txt")
    assert fetched and got == path and open(got, "rb").read() == b"abc"


@pytest.mark.parametrize("limit", [None, "1MB"])
def test_an_entry_evicted_while_its_file_is_placed_is_made_again(tmp_path, monkeypatch, limit):
    import ucmagic.files.cache as cache_mod

    c = FileCache(str(tmp_path / "c"), limit=limit)
    key = cache_key("v", "d/x.bin", 4, 0)
    real = cache_mod._make_dirs
    evicted: list[str] = []

    def then_evicted(final: str, inner: str) -> None:
        real(final, inner)
        if not evicted:  # another process evicts the fresh, still empty directory right now
            evicted.append(final)
            c.layout.drop_entry(final)

    monkeypatch.setattr(cache_mod, "_make_dirs", then_evicted)
    got, fetched = c.fill(key, "", 4, writer(b"data"), rel="d/x.bin")
    assert evicted and fetched and open(got, "rb").read() == b"data"
    assert c.lookup(key, "", 4, rel="d/x.bin") == got and os.listdir(tmp_path / "c" / "tmp") == []


def test_a_copy_target_is_emptied_once_and_an_empty_one_is_not_truncated(tmp_path):
    """A fill reopens an empty unnamed file: truncating it would make ext4 start its writeback at close."""
    from ucmagic._util import open_emptied
    from ucmagic.files.volume import LocalVolume

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"fresh")
    longer = tmp_path / "longer"
    longer.write_bytes(b"an older, longer copy")
    assert LocalVolume(str(tmp_path / "src")).copy_to("a.bin", str(longer)) == 5
    assert longer.read_bytes() == b"fresh"
    empty = tmp_path / "empty"
    empty.touch()
    os.utime(empty, ns=(10**9, 10**9))
    os.close(open_emptied(str(empty)))
    assert os.stat(empty).st_mtime_ns == 10**9  # a truncate would have set the mtime to now
    fd = open_emptied(str(tmp_path / "new"))
    os.write(fd, b"x")
    os.close(fd)
    assert (tmp_path / "new").read_bytes() == b"x"
