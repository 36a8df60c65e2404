import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic.files.cache import TOUCH_EVERY_S, FileCache, SeenEntries
from ucmagic.files.cache_layout import cache_key, entry_file, other_version_file, space_of, version_stamp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cache_helpers, whatever pytest's import mode
from cache_helpers import used_at, writer

SPACE = space_of("file:///src")  # the folder of a dataset root's entries


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
    names, stamps = [entry_file(k, ".bin", 5) for k in keys], [version_stamp(k) for k in keys]
    got = c.lookup_run(names, [5] * 6, stamps)
    assert got == [c.lookup(k, ".bin", 5) for k in keys[:2]]  # stops at the missing third entry
    assert c.lookup_run(names[3:], [5, 4, 5], stamps[3:]) == [c.lookup(keys[3], ".bin", 5)]  # a size mismatch ends it
    assert c.lookup_run(names[3:], [5, 5], stamps[4:]) == []  # so does another version's stamp
    assert c.lookup_run([], [], []) == []


def test_a_run_lookup_trusts_what_it_found_until_the_cache_removes_something(tmp_path, monkeypatch):
    c = FileCache(str(tmp_path / "c"))
    keys = [cache_key("v", f"f{i}", 5, 0) for i in range(4)]
    for k in keys:
        c.fill(k, ".bin", 5, writer(b"hello"))
    names, idx = [entry_file(k, ".bin", 5) for k in keys], np.arange(4)
    stamps = [version_stamp(k) for k in keys]
    seen = c.seen_entries(4)
    paths = [c.data_path(k, ".bin", 5) for k in keys]
    assert c.lookup_run(names, [5] * 4, stamps, idx, seen) == paths
    assert seen.known(idx).all()
    calls = []
    monkeypatch.setattr(os, "stat", lambda *a, **k: calls.append(a))
    assert c.lookup_run(names, [5] * 4, stamps, idx, seen) == paths and not calls  # found before: no system call
    monkeypatch.undo()
    other = FileCache(c.root)  # another process's view of the same cache: its removals count too
    other.remove(paths[1:2])
    assert c.lookup_run(names, [5] * 4, stamps, idx, seen) == paths[:1]  # never a removed entry
    other.evict(keep_below=0)  # evictions count too
    assert c.lookup_run(names, [5] * 4, stamps, idx, seen) == []


def test_a_run_lookup_touches_found_entries_again_once_the_touch_window_ends(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "f", 5, 0)
    path, _ = c.fill(key, ".bin", 5, writer(b"hello"))
    seen = c.seen_entries(1)
    seen.filled(0)
    old = time.time() - 3600
    used_at(path, old)
    run = ([entry_file(key, ".bin", 5)], [5], [version_stamp(key)], np.arange(1), seen)
    assert c.lookup_run(*run) == [path]
    assert abs(os.stat(path).st_atime - old) < 1e-3  # within the window: trusted as found, not touched
    seen.sync(c.removals(), time.time() + TOUCH_EVERY_S + 1)  # the window ends
    assert not seen.known(np.arange(1)).any()
    assert c.lookup_run(*run) == [path]
    assert os.stat(path).st_atime > old + 3000  # looked up again and touched: its last use (LRU)
    assert os.stat(path).st_mtime_ns == version_stamp(key)  # its version stamp stays


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
    assert os.listdir(os.path.dirname(stale)) == [os.path.basename(stale)]


@pytest.mark.parametrize("limit", [None, "1MB"])
def test_a_writer_killed_before_its_file_was_placed_leaves_a_folder_the_next_fill_reuses(tmp_path, limit):
    c = FileCache(str(tmp_path / "c"), limit=limit)
    key = cache_key("v", "train/cat/1.jpg", 5, 0)
    path = c.data_path(key, "", 5, rel="train/cat/1.jpg", space=SPACE)
    os.makedirs(os.path.dirname(path))  # the folders made, the file never linked in
    assert c.lookup(key, "", 5, rel="train/cat/1.jpg", space=SPACE) is None
    got, fetched = c.fill(key, "", 5, writer(b"hello"), rel="train/cat/1.jpg", space=SPACE)
    assert fetched and got == path and open(got, "rb").read() == b"hello"
    assert os.listdir(tmp_path / "c" / "tmp") == []


def test_an_entry_whose_place_is_blocked_by_another_file_goes_beside_it(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    space = space_of("file:///src")
    key = cache_key("file:///src", "a/b.txt", 3, 0)
    path = c.data_path(key, "", 3, rel="a/b.txt", space=space)
    os.makedirs(os.path.dirname(os.path.dirname(path)))
    with open(os.path.dirname(path), "wb") as f:  # files/<space>/a is a file (an earlier tree's), not a folder
        f.write(b"zz")
    got, fetched = c.fill(key, "", 3, writer(b"abc"), rel="a/b.txt", space=space)
    assert fetched and open(got, "rb").read() == b"abc" and got.endswith(os.sep + os.path.join("a", "b.txt"))
    assert got == os.path.join(c.root, "files", other_version_file(key, f"{space}/a/b.txt"))
    assert open(os.path.dirname(path), "rb").read() == b"zz"  # the other file is left alone
    assert c.lookup(key, "", 3, rel="a/b.txt", space=space) == got


@pytest.mark.parametrize("limit", [None, "1MB"])
def test_an_entry_evicted_while_its_file_is_placed_is_made_again(tmp_path, monkeypatch, limit):
    import ucmagic.files.cache as cache_mod

    c = FileCache(str(tmp_path / "c"), limit=limit)
    key = cache_key("v", "d/x.bin", 4, 0)
    real = cache_mod._make_dirs
    evicted: list[str] = []

    def then_evicted(root: int, rel: str) -> None:  # rel: files/<space>/d/x.bin under the root's descriptor
        real(root, rel)
        if not evicted:  # another process evicts the folder's last file and removes the empty folders now
            evicted.append(rel)
            shutil.rmtree(os.path.join(c.root, *rel.split("/")[:2]))

    monkeypatch.setattr(cache_mod, "_make_dirs", then_evicted)
    got, fetched = c.fill(key, "", 4, writer(b"data"), rel="d/x.bin", space=SPACE)
    assert evicted and fetched and open(got, "rb").read() == b"data"
    assert c.lookup(key, "", 4, rel="d/x.bin", space=SPACE) == got and os.listdir(tmp_path / "c" / "tmp") == []


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


def _fill_version(c: FileCache, rel: str, version: int, space: str = SPACE) -> tuple[str, bytes]:
    data = f"{rel}@{version}".encode()
    key = cache_key("file:///src", rel, len(data), float(version))
    path, _ = c.fill(key, "", len(data), writer(data), rel=rel, space=space)
    return path, data


def test_another_version_of_a_cached_file_goes_beside_it_and_each_is_found(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    old, old_data = _fill_version(c, "train/cat/1.jpg", 1)
    new, new_data = _fill_version(c, "train/cat/1.jpg", 2)  # the source was rewritten: same size, new mtime
    assert old != new and old.endswith("/train/cat/1.jpg") and new.endswith("/train/cat/1.jpg")
    assert open(old, "rb").read() == old_data and open(new, "rb").read() == new_data  # never replaced in place
    assert _fill_version(c, "train/cat/1.jpg", 1)[0] == old and _fill_version(c, "train/cat/1.jpg", 2)[0] == new
    assert c.entry_name(old) == c.entry_name(new) == f"{SPACE}/train/cat/1.jpg"  # one name protects every version
    c.remove([old])
    assert _fill_version(c, "train/cat/1.jpg", 2)[0] == new  # still found where it went
    assert _fill_version(c, "train/cat/1.jpg", 3)[0] == old  # the first place is free again


@given(st.lists(st.tuples(st.sampled_from(["a", "a/b", "a/b/c", "b", "a/c"]), st.integers(0, 2),
                          st.booleans()), max_size=12))
@settings(max_examples=40, deadline=None)
def test_any_sequence_of_fills_and_removals_finds_each_version_with_its_own_bytes(steps):
    # a path that is a file in one version of the tree and a folder in another, rewritten files, removals
    with tempfile.TemporaryDirectory() as root:
        c = FileCache(os.path.join(root, "c"))
        held: dict[tuple[str, int], str] = {}
        for rel, version, remove in steps:
            path, data = _fill_version(c, rel, version)
            assert open(path, "rb").read() == data and path.endswith("/" + rel)
            held[(rel, version)] = path
            if remove:
                c.remove([path])
                del held[(rel, version)]
        for (rel, version), path in held.items():
            data = f"{rel}@{version}".encode()
            key = cache_key("file:///src", rel, len(data), float(version))
            assert c.lookup(key, "", len(data), rel=rel, space=SPACE) == path
            assert open(path, "rb").read() == data
        assert c.usage().files == len(held)  # every entry counted (and evictable), wherever it went
        c.evict(keep_below=0)
        assert c.usage().files == 0 and os.listdir(os.path.join(c.root, "files")) == []  # empty folders go too


def test_versions_are_told_apart_where_the_file_system_keeps_whole_seconds_only(tmp_path, monkeypatch):
    import ucmagic.files.cache as cache_mod

    c = FileCache(str(tmp_path / "c"))
    assert cache_mod._mtime_quantum(c.layout) == 1  # this disk keeps nanoseconds
    c.__dict__["_quantum"] = 10**9  # as a file system that keeps seconds would report
    path, data = _fill_version(c, "x.bin", 1)
    st_ = os.stat(path)
    os.utime(path, ns=(st_.st_atime_ns, st_.st_mtime_ns // 10**9 * 10**9))  # what such a disk keeps
    key = cache_key("file:///src", "x.bin", len(data), 1.0)
    assert c.lookup(key, "", len(data), rel="x.bin", space=SPACE) == path
    other = cache_key("file:///src", "x.bin", len(data), 2.0)  # another version, same size
    assert c.lookup(other, "", len(data), rel="x.bin", space=SPACE) is None


def test_a_folder_removed_after_a_fill_made_it_is_made_again_by_the_next_fill_there(tmp_path):
    """The cache remembers the folders it made (one mkdir less per fill) and forgets them when one is gone."""
    c = FileCache(str(tmp_path / "c"))
    first, _ = c.fill(cache_key("v", "d/x.bin", 4, 0), "", 4, writer(b"data"), rel="d/x.bin", space=SPACE)
    shutil.rmtree(os.path.dirname(first))  # an eviction of the folder's last file, or a user, removed it
    key = cache_key("v", "d/y.bin", 4, 0)
    got, fetched = c.fill(key, "", 4, writer(b"more"), rel="d/y.bin", space=SPACE)
    assert fetched and open(got, "rb").read() == b"more" and os.path.dirname(got) == os.path.dirname(first)
    shutil.rmtree(c.root)  # the whole cache directory, by hand
    again, fetched = c.fill(key, "", 4, writer(b"more"), rel="d/y.bin", space=SPACE)
    assert fetched and open(again, "rb").read() == b"more"


def test_the_folders_a_cache_remembers_stay_bounded_in_a_tree_of_many_folders(tmp_path, monkeypatch):
    import ucmagic.files.cache as cache_mod

    monkeypatch.setattr(cache_mod, "FOLDERS_KEPT", 3)
    c = FileCache(str(tmp_path / "c"))
    for i in range(10):
        rel = f"d{i}/x.bin"
        got, fetched = c.fill(cache_key("v", rel, 4, 0), "", 4, writer(b"data"), rel=rel, space=SPACE)
        assert fetched and open(got, "rb").read() == b"data"
        assert len(c._folders) <= 3


def test_a_fill_writes_into_its_own_descriptor_where_the_writer_can_else_through_the_path(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    paths: list[str] = []

    def by_path(tmp: str) -> int:
        paths.append(tmp)
        return writer(b"path")(tmp)

    def into(fd: int) -> int:
        assert os.fstat(fd).st_size == 0 and os.lseek(fd, 0, os.SEEK_CUR) == 0  # empty, at its start
        return os.write(fd, b"desc")

    got, fetched = c.fill(cache_key("v", "a", 4, 0), "", 4, by_path, write_fd=into)
    assert fetched and open(got, "rb").read() == b"desc" and paths == []
    got, fetched = c.fill(cache_key("v", "b", 4, 0), "", 4, by_path, write_fd=lambda fd: None)
    assert fetched and open(got, "rb").read() == b"path" and len(paths) == 1
    with pytest.raises(OSError, match="copied 3 bytes"):  # a short copy into the descriptor is refused too
        c.fill(cache_key("v", "c", 4, 0), "", 4, by_path, write_fd=lambda fd: os.write(fd, b"abc"))
    assert c.lookup(cache_key("v", "c", 4, 0), "", 4) is None
