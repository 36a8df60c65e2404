import multiprocessing as mp
import os
import shutil
import stat
import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucmagic.files.budget import choose_victims
from ucmagic.files.cache import TOUCH_EVERY_S, FileCache, SeenEntries
from ucmagic.files.cache_layout import cache_key, cache_keys, entry_file, entry_record_names, safe_suffix
from ucmagic.files.locks import KeyLocks, process_tag
from ucmagic.files.protection import parse_record_name
from ucmagic.errors import CacheFullError
import ucmagic.files.budget as budget_mod


def writer(data: bytes, delay: float = 0.0, calls: list | None = None):
    def write(tmp: str) -> int:
        if calls is not None:
            calls.append(1)
        time.sleep(delay)
        with open(tmp, "wb") as f:
            f.write(data)
        return len(data)
    return write


def entry_of(p: str) -> str:
    """The entry directory of a cached file of an opaque key (``files/<key>-<size>/<key><ext>``): its
    name is what protection records hold, its mtime the entry's last use."""
    return os.path.dirname(p)


def test_cache_dir_is_private(tmp_path):
    root = tmp_path / "c"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    FileCache(str(root))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


def test_key_depends_on_volume_path_size_and_mtime():
    k = cache_key("file:///v", "a/b.jpg", 10, 1.5)
    assert k == cache_key("file:///v", "a/b.jpg", 10, 1.5)
    assert len({k, cache_key("file:///w", "a/b.jpg", 10, 1.5), cache_key("file:///v", "a/c.jpg", 10, 1.5),
                cache_key("file:///v", "a/b.jpg", 11, 1.5), cache_key("file:///v", "a/b.jpg", 10, 1.6)}) == 5


@pytest.mark.parametrize("name,suffix", [("a/b.jpg", ".jpg"), ("x.tar.gz", ".gz"), ("noext", ""),
                                         ("../../etc/passwd", ""), ("evil.$(rm)", ""), ("dir.d/file", "")])
def test_suffix_is_sanitised(name, suffix):
    assert safe_suffix(name) == suffix


@given(st.lists(st.tuples(st.text(alphabet="ab./-_ $é\udcff", max_size=12), st.integers(0, 10**12),
                          st.floats(allow_nan=False, allow_infinity=False)), max_size=20))
def test_keys_of_a_chunk_are_the_keys_of_each_file(files):
    assert cache_keys("file:///v", files) == [(cache_key("file:///v", r, s, m), safe_suffix(r)) for r, s, m in files]


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


def test_choose_victims_is_lru():
    entries = [("a", 10, 3.0), ("b", 10, 1.0), ("c", 10, 2.0)]
    assert choose_victims(entries, 15) == ["b", "c"]
    assert choose_victims(entries, 0) == []
    assert choose_victims(entries, 100) == ["b", "c", "a"]


def test_budget_evicts_least_recently_used_but_not_protected(tmp_path):
    c = FileCache(str(tmp_path / "c"), limit=1000)
    paths = []
    for i in range(5):
        p, _ = c.fill(cache_key("v", str(i), 200, 0), "", 200, writer(bytes(200)))
        os.utime(entry_of(p), (i, i))  # file 0 is the least recently used
        paths.append(p)
    c.write_record(c.record_path(process_tag(), 0), [os.path.basename(entry_of(paths[0]))])
    os.utime(entry_of(paths[1]))  # file 1 becomes most recently used
    c.fill(cache_key("v", "new", 200, 0), "", 200, writer(bytes(200)))
    assert os.path.exists(paths[0])  # protected: kept despite being oldest
    assert not os.path.exists(paths[2])  # oldest unprotected goes first
    assert os.path.exists(paths[1])
    assert c.usage().total_bytes <= 1000


def test_protection_of_a_dead_owner_is_released_at_once(tmp_path):
    c = FileCache(str(tmp_path / "c"), limit=400)
    p, _ = c.fill(cache_key("v", "x", 200, 0), "", 200, writer(bytes(200)))
    os.utime(entry_of(p), (1, 1))
    dead = os.path.join(c.root, "prot", f"999999999-1@{process_tag()}.0.rec")
    with open(dead, "w") as f:
        f.write(os.path.basename(entry_of(p)))
    assert os.path.basename(entry_of(p)) not in c.protected_names(reap=True) and not os.path.exists(dead)
    for i in range(2):  # the budget now evicts the formerly protected entry
        c.fill(cache_key("v", f"n{i}", 200, 0), "", 200, writer(bytes(200)))
    assert not os.path.exists(p)


def test_stable_path_is_the_entry_itself(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "x", 3, 0)
    p, _ = c.fill(key, ".bin", 3, writer(b"abc"))
    assert p == c.data_path(key, ".bin", 3) and c.fill(key, ".bin", 3, writer(b"zzz"))[0] == p
    assert FileCache(str(tmp_path / "c")).lookup(key, ".bin", 3) == p  # same path in any process


def test_usage_accounts_every_byte_under_the_cache_dir(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    c.fill(cache_key("v", "x", 300, 0), "", 300, writer(bytes(300)))
    c.write_record(c.record_path(process_tag(), 0), ["a" * 40])
    with open(os.path.join(c.root, "tmp", "k.1-1.0.50.part"), "wb") as f:
        f.write(bytes(10))  # a fill in progress counts at its final size (in its name)
    with open(os.path.join(c.root, "stray"), "wb") as f:
        f.write(bytes(7))
    u = c.usage()
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(c.root) for f in fs)
    assert (u.bytes, u.records_bytes, u.tmp_bytes) == (300, 40, 50)
    assert u.total_bytes == on_disk + 40  # the temp file counts 50 bytes, 10 written so far


@pytest.mark.parametrize("name,parsed", [("a-1@b-2.0.rec", ("a-1", "b-2")), ("x.rec", None), ("a@b.0.txt", None)])
def test_record_names_parse(name, parsed):
    assert parse_record_name(name) == parsed


def test_fill_waits_for_room_then_proceeds_when_a_consumer_frees_it(tmp_path):
    c = FileCache(str(tmp_path / "c"), limit=500)
    p, _ = c.fill(cache_key("v", "held", 400, 0), "", 400, writer(bytes(400)))
    rec = c.record_path(process_tag(), 0)
    c.write_record(rec, [os.path.basename(entry_of(p))])
    done = threading.Event()
    waits = []
    t = threading.Thread(target=lambda: (c.fill(cache_key("v", "next", 300, 0), "", 300, writer(bytes(300)),
                                                on_wait=lambda: waits.append(1)), done.set()))
    t.start()
    assert not done.wait(0.3) and waits  # no room: it waits instead of overshooting
    assert c.usage().total_bytes <= 500
    c.drop_record(rec)  # the consumer is done with the held file
    assert done.wait(10)
    t.join()
    assert c.usage().total_bytes <= 500 and not os.path.exists(p)


def test_head_of_line_fill_may_exceed_the_budget(tmp_path):
    c = FileCache(str(tmp_path / "c"), limit=500)
    p, _ = c.fill(cache_key("v", "held", 400, 0), "", 400, writer(bytes(400)))
    c.write_record(c.record_path(process_tag(), 0), [os.path.basename(entry_of(p))])
    q, fetched = c.fill(cache_key("v", "next", 300, 0), "", 300, writer(bytes(300)), may_exceed=lambda: True)
    assert fetched and os.path.exists(p) and os.path.exists(q)


def test_file_larger_than_budget_is_a_clear_error(tmp_path):
    c = FileCache(str(tmp_path / "c"), limit="1KB")
    with pytest.raises(CacheFullError, match=r"5\.0 KB file does not fit in cache_limit=1\.0 KB"):
        c.fill(cache_key("v", "big", 5000, 0), "", 5000, writer(bytes(5000)))


def test_full_disk_is_a_clear_error(tmp_path):
    c = FileCache(str(tmp_path / "c"), min_free=0.9999)  # the floor is above what is free
    with pytest.raises(CacheFullError, match="full"):
        c.fill(cache_key("v", "f", 10, 0), "", 10, writer(bytes(10)))
    assert c.usage().files == 0


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


def test_dead_process_records_and_temp_files_are_reaped(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    dead = tmp_path / "c" / "prot" / "999999999-1@999999999-1.0.rec"
    dead.write_text("x")
    live = tmp_path / "c" / "prot" / f"{process_tag()}@999999999-1.0.rec"
    live.write_text("y")
    stale = tmp_path / "c" / "tmp" / "k.999999999-1.0.1.part"
    stale.write_bytes(b"1")
    assert c.reap() == {"records": 1, "tmp": 1, "old": 0}
    assert not dead.exists() and not stale.exists()
    assert live.exists()  # its owner (this process) may still hold the batch a dead worker made


def test_cache_pickles_as_settings(tmp_path):
    import pickle

    c = FileCache(str(tmp_path / "c"), limit="1MB")
    c2 = pickle.loads(pickle.dumps(c))
    assert (c2.root, c2.limit, c2.min_free) == (c.root, 10**6, c.min_free)


def _hold_key(root: str, key: str, held) -> None:
    with KeyLocks(os.path.join(root, "fill.lock")).hold(key):
        held.set()
        time.sleep(60)  # killed before


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_key_lock_excludes_other_processes_and_a_killed_holder_releases_it(tmp_path, method):
    root = str(tmp_path)
    locks = KeyLocks(os.path.join(root, "fill.lock"))
    key = cache_key("v", "f", 1, 0)
    with locks.hold(key):  # opened here first: a forked child must not share this descriptor's locks
        pass
    ctx = mp.get_context(method)
    held = ctx.Event()
    child = ctx.Process(target=_hold_key, args=(root, key, held))
    child.start()
    try:
        assert held.wait(60)
        got = threading.Event()
        other = threading.Event()

        def take(k: str, flag: threading.Event) -> None:
            with locks.hold(k):
                flag.set()

        threading.Thread(target=take, args=(cache_key("v", "g", 1, 0), other), daemon=True).start()
        assert other.wait(10)  # another key is not blocked
        t = threading.Thread(target=take, args=(key, got), daemon=True)
        t.start()
        assert not got.wait(0.3)  # the child holds this key
        child.kill()  # SIGKILL: the kernel drops the child's lock with its descriptor
        t.join(10)
        assert got.is_set()
    finally:
        child.kill()
        child.join(10)


def test_unbudgeted_fill_leaves_no_temp_file_and_replaces_an_untrusted_entry(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "f", 5, 0)
    stale = c.data_path(key, ".bin", 5)
    os.makedirs(os.path.dirname(stale))
    with open(stale, "wb") as f:
        f.write(b"torn")  # a wrong size is never trusted
    seen: list[int] = []

    def write(tmp: str) -> int:
        assert not tmp.startswith(os.path.join(c.root, "files"))  # built aside, renamed in whole
        seen.append(len(os.listdir(tmp_path / "c" / "tmp")))  # an unnamed file: nothing a kill leaves
        return writer(b"hello")(tmp)

    path, fetched = c.fill(key, ".bin", 5, write)
    assert fetched and path == stale and open(path, "rb").read() == b"hello"
    assert seen == [0] and os.listdir(tmp_path / "c" / "tmp") == []
    assert os.listdir(os.path.dirname(stale)) == [key + ".bin"]


def test_protection_record_rewritten_in_place_holds_exactly_the_new_names(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    rec = c.record_path(process_tag(), 0)
    c.write_record(rec, ["a" * 40 + ".bin", "b" * 40 + ".bin"])
    c.write_record(rec, ["c" * 40])
    assert c.protected_names() == {"c" * 40}
    c.drop_record(rec)
    assert c.protected_names() == set() and os.listdir(tmp_path / "c" / "prot") == []
    c.write_record(rec, ["d" * 40])  # written again after a drop: a new file
    assert c.protected_names() == {"d" * 40}
    os.unlink(rec)  # removed behind the writer's back (clear_cache of a process it thought gone)
    c.write_record(rec, ["e" * 40])
    assert c.protected_names() == {"e" * 40}
    c.drop_record(rec)


@pytest.mark.timeout(60)
def test_a_fill_no_loop_waits_on_gives_up_with_an_error_when_no_room_is_ever_freed(tmp_path, monkeypatch):
    monkeypatch.setattr(budget_mod, "STALL_S", 0.3)
    c = FileCache(str(tmp_path / "c"), limit=10_000)
    # another live fill holds 9 kB (its temp file's name carries its final size): nothing to evict
    open(os.path.join(c.root, "tmp", f"{'ab' * 20}.{process_tag()}.0.9000.part"), "wb").close()
    with pytest.raises(CacheFullError, match=r"no room for a 5\.0 KB file in cache_limit=10\.0 KB"):
        c.reserve(5000, os.path.join(c.root, "tmp", "mine.part"))


def test_budget_is_the_smallest_cache_limit_of_live_objects_and_ignores_dead_processes(tmp_path):
    root = str(tmp_path / "c")
    big, none = FileCache(root, limit=50_000), FileCache(root)
    locks = os.path.join(root, "locks")
    open(os.path.join(locks, "limit.999999999-1.0.1000"), "wb").close()  # a process that is gone
    small = FileCache(root, limit=20_000)
    assert small.budget() == 20_000 and none.budget() == 20_000 and big.budget() == 20_000
    assert "limit.999999999-1.0.1000" not in os.listdir(locks)  # reaped on the way
    del small
    import gc

    gc.collect()
    assert FileCache(root).budget() == 50_000  # the smaller record went with its object


def test_live_streams_counts_the_records_of_live_owners_in_every_process(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    assert c.live_streams() == 0
    mine = [c.record_path(process_tag(), slot) for slot in (0, 1)]
    for p in mine:
        c.write_record(p, ["a-1"])
    ctx = mp.get_context("spawn")
    other = ctx.Process(target=time.sleep, args=(30,))
    other.start()
    try:
        other_tag = process_tag(other.pid)
        with open(os.path.join(c.root, "prot", f"{other_tag}@{other_tag}.0.rec"), "w") as f:
            f.write("b-1")  # a stream of another live process on this cache
        with open(os.path.join(c.root, "prot", f"999999999-1@{process_tag()}.0.rec"), "w") as f:
            f.write("c-1")  # a dead owner's
        assert c.live_streams() == 3
        c.drop_record(mine[0])
        assert c.live_streams() == 2
    finally:
        other.kill()
        other.join(10)
    assert c.live_streams() == 1


def test_a_record_naming_an_entry_by_its_record_names_protects_it(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "x", 5, 0)
    p, _ = c.fill(key, ".chunk", 5, writer(b"12345"))
    names = entry_record_names(key, ".chunk", 5)
    assert names == [key + ".chunk", os.path.basename(entry_of(p))]
    c.write_record(c.record_path(process_tag(), 0), names)
    assert c.evict(10**9) == 0 and os.path.exists(p)
