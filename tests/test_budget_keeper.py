"""Budget, eviction, accounting and the disk floor of the file cache (ucmagic.files.budget)."""
import os
import sys
import threading
import time

import pytest

import ucmagic.files.budget as budget_mod
from ucmagic.errors import CacheFullError
from ucmagic.files.budget import choose_victims
from ucmagic.files.cache import FileCache
from ucmagic.files.cache_layout import cache_key
from ucmagic.files.locks import process_tag

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cache_helpers, whatever pytest's import mode
from cache_helpers import record_name, used_at, writer
from waits import PATIENCE, module_with, wait_until


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
        used_at(p, i)  # file 0 is the least recently used
        paths.append(p)
    c.records.write_record(c.records.record_path(process_tag(), 0), [record_name(paths[0])])
    used_at(paths[1], time.time())  # file 1 becomes most recently used
    c.fill(cache_key("v", "new", 200, 0), "", 200, writer(bytes(200)))
    assert os.path.exists(paths[0])  # protected: kept despite being oldest
    assert not os.path.exists(paths[2])  # oldest unprotected goes first
    assert os.path.exists(paths[1])
    assert c.usage().total_bytes <= 1000


def test_fill_waits_for_room_then_proceeds_when_a_consumer_frees_it(tmp_path):
    c = FileCache(str(tmp_path / "c"), limit=500)
    p, _ = c.fill(cache_key("v", "held", 400, 0), "", 400, writer(bytes(400)))
    rec = c.records.record_path(process_tag(), 0)
    c.records.write_record(rec, [record_name(p)])
    done = threading.Event()
    waits = []
    t = threading.Thread(target=lambda: (c.fill(cache_key("v", "next", 300, 0), "", 300, writer(bytes(300)),
                                                on_wait=lambda: waits.append(1)), done.set()))
    t.start()
    wait_until(lambda: waits, "the fill waiting for room")  # no room: it waits instead of overshooting
    assert not done.is_set() and c.usage().total_bytes <= 500
    c.records.drop_record(rec)  # the consumer is done with the held file
    assert done.wait(PATIENCE)
    t.join()
    assert c.usage().total_bytes <= 500 and not os.path.exists(p)


def test_head_of_line_fill_may_exceed_the_budget(tmp_path):
    c = FileCache(str(tmp_path / "c"), limit=500)
    p, _ = c.fill(cache_key("v", "held", 400, 0), "", 400, writer(bytes(400)))
    c.records.write_record(c.records.record_path(process_tag(), 0), [record_name(p)])
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


def test_a_fill_no_loop_waits_on_gives_up_with_an_error_when_no_room_is_ever_freed(tmp_path, monkeypatch):
    monkeypatch.setattr(budget_mod, "STALL_S", 0.3)
    c = FileCache(str(tmp_path / "c"), limit=10_000)
    # another live fill holds 9 kB (its temp file's name carries its final size): nothing to evict
    open(os.path.join(c.root, "tmp", f"{'ab' * 20}.{process_tag()}.0.9000.part"), "wb").close()
    with pytest.raises(CacheFullError, match=r"no room for a 5\.0 KB file in cache_limit=10\.0 KB"):
        c.budget_keeper.reserve(5000, os.path.join(c.root, "tmp", "mine.part"))


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


def test_usage_accounts_every_byte_under_the_cache_dir(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    c.fill(cache_key("v", "x", 300, 0), "", 300, writer(bytes(300)))
    c.records.write_record(c.records.record_path(process_tag(), 0), ["a" * 40])
    with open(os.path.join(c.root, "tmp", "k.1-1.0.50.part"), "wb") as f:
        f.write(bytes(10))  # a fill in progress counts at its final size (in its name)
    with open(os.path.join(c.root, "stray"), "wb") as f:
        f.write(bytes(7))
    u = c.usage()
    on_disk = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(c.root) for f in fs)
    assert (u.bytes, u.records_bytes, u.tmp_bytes) == (300, 41, 50)  # a record: its names, each ending in \n
    assert u.total_bytes == on_disk + 40  # the temp file counts 50 bytes, 10 written so far


def test_a_fill_waiting_behind_a_big_file_still_copying_does_not_give_up(tmp_path, monkeypatch):
    """Files of 10 GiB copy for minutes: a worker's next fill waits for room all that time while the loop
    waits on another worker's copy. A copy that writes is progress, not the deadlock the stall error is
    for (before, the waiting fill failed after LOOP_STALL_S with "no room ... while the loop waits").

    The budget's clock is its own waits (each pause adds its length), and the other fill's copy writes a
    block at each of them until three stall periods went by: the same on any machine."""
    monkeypatch.setattr(budget_mod, "LOOP_STALL_S", 0.5)
    now = [0.0]

    def pause(s: float) -> None:
        now[0] += s
        time.sleep(0.001)

    monkeypatch.setattr(budget_mod, "time", module_with(monotonic=lambda: now[0], sleep=pause, time=time.time))
    c = FileCache(str(tmp_path / "c"), limit=10_000)
    copying = os.path.join(c.root, "tmp", f"{'ab' * 20}.{process_tag()}.0.9000.part")  # another fill's copy
    with open(copying, "wb"):
        pass
    copies = []

    def copy_on() -> None:  # called at each wait of the reserving fill
        if now[0] < 3 * budget_mod.LOOP_STALL_S:
            with open(copying, "ab") as f:
                f.write(bytes(4096))  # a block: what the budget sees growing is the space allocated
            copies.append(now[0])
        elif os.path.exists(copying):
            os.unlink(copying)  # it went to its entry, which the loop then consumed

    c.budget_keeper.reserve(5000, os.path.join(c.root, "tmp", "mine.part"), may_exceed=lambda: False, on_wait=copy_on)
    assert copies and copies[-1] > 2 * budget_mod.LOOP_STALL_S  # it waited past the stall time, the copy going on
    assert os.path.exists(os.path.join(c.root, "tmp", "mine.part"))
