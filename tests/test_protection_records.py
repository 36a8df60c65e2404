"""Protection records: written, read, reaped with their owner, counted per stream (ucmagic.files.protection)."""
import contextlib
import multiprocessing as mp
import os
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic.files.cache import FileCache
from ucmagic.files.cache_layout import cache_key, entry_record_names
from ucmagic.files.locks import process_tag
from ucmagic.files.protection import parse_record_name

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # cache_helpers, whatever pytest's import mode
from cache_helpers import record_name, used_at, writer


@pytest.mark.parametrize("name,parsed", [("a-1@b-2.0.rec", ("a-1", "b-2")), ("x.rec", None), ("a@b.0.txt", None)])
def test_record_names_parse(name, parsed):
    assert parse_record_name(name) == parsed


def test_protection_record_rewritten_in_place_holds_exactly_the_new_names(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    rec = c.records.record_path(process_tag(), 0)
    c.records.write_record(rec, ["a" * 40 + ".bin", "b" * 40 + ".bin"])
    c.records.write_record(rec, ["c" * 40])
    assert c.records.protected_names() == {"c" * 40}
    c.records.drop_record(rec)
    assert c.records.protected_names() == set() and os.listdir(tmp_path / "c" / "prot") == []
    c.records.write_record(rec, ["d" * 40])  # written again after a drop: a new file
    assert c.records.protected_names() == {"d" * 40}
    os.unlink(rec)  # removed behind the writer's back (clear_cache of a process it thought gone)
    c.records.write_record(rec, ["e" * 40])
    assert c.records.protected_names() == {"e" * 40}
    c.records.drop_record(rec)


def test_a_record_is_written_while_another_process_is_still_making_a_removed_cache_directory_anew(tmp_path):
    """The cache directory removed by hand between epochs: one DataLoader worker made it anew up to locks/ when
    another wrote its first record (prot/ not there yet): a raw FileNotFoundError in the worker before."""
    import shutil

    c = FileCache(str(tmp_path / "c"))
    shutil.rmtree(tmp_path / "c" / "prot")
    rec = c.records.record_path(process_tag(), 0)
    c.records.write_record(rec, ["a" * 40])
    assert c.records.protected_names() == {"a" * 40}
    c.records.drop_record(rec)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.text(alphabet="abcdef/._", min_size=1, max_size=300), max_size=40), min_size=1, max_size=8))
def test_a_record_rewritten_smaller_or_larger_protects_exactly_its_latest_names(tmp_path_factory, writes):
    c = FileCache(str(tmp_path_factory.mktemp("rec") / "c"))
    rec = c.records.record_path(process_tag(), 0)
    for names in writes:
        c.records.write_record(rec, names)
        assert c.records.protected_names() == set(names) - {""}
    c.records.drop_record(rec)


def test_a_record_that_shrinks_a_little_keeps_its_size_and_one_that_shrinks_a_lot_gives_room_back(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    rec = c.records.record_path(process_tag(), 0)
    many = [f"{i:06d}" + "x" * 100 for i in range(2000)]  # ~210 KB
    c.records.write_record(rec, many)
    size = os.path.getsize(rec)
    c.records.write_record(rec, many[1:])  # one name fewer: padded, no ftruncate (it cost ~80 us a call)
    assert os.path.getsize(rec) == size and c.records.protected_names() == set(many[1:])
    c.records.write_record(rec, many[:3])  # under half: truncated
    assert os.path.getsize(rec) < 1000 and c.records.protected_names() == set(many[:3])
    c.records.drop_record(rec)


def test_protection_of_a_dead_owner_is_released_at_once(tmp_path):
    c = FileCache(str(tmp_path / "c"), limit=400)
    p, _ = c.fill(cache_key("v", "x", 200, 0), "", 200, writer(bytes(200)))
    used_at(p, 1)
    dead = os.path.join(c.root, "prot", f"999999999-1@{process_tag()}.0.rec")
    with open(dead, "w") as f:
        f.write(record_name(p))
    assert record_name(p) not in c.records.protected_names(reap=True) and not os.path.exists(dead)
    for i in range(2):  # the budget now evicts the formerly protected entry
        c.fill(cache_key("v", f"n{i}", 200, 0), "", 200, writer(bytes(200)))
    assert not os.path.exists(p)


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


def test_live_streams_counts_the_records_of_live_owners_in_every_process(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    assert c.records.live_streams() == 0
    mine = [c.records.record_path(process_tag(), slot) for slot in (0, 1)]
    for p in mine:
        c.records.write_record(p, ["a-1"])
    ctx = mp.get_context("spawn")
    other = ctx.Process(target=time.sleep, args=(30,))
    other.start()
    try:
        other_tag = process_tag(other.pid)
        with open(os.path.join(c.root, "prot", f"{other_tag}@{other_tag}.0.rec"), "w") as f:
            f.write("b-1")  # a stream of another live process on this cache
        with open(os.path.join(c.root, "prot", f"999999999-1@{process_tag()}.0.rec"), "w") as f:
            f.write("c-1")  # a dead owner's
        assert c.records.live_streams() == 3
        c.records.drop_record(mine[0])
        assert c.records.live_streams() == 2
    finally:
        other.kill()
        other.join(10)
    assert c.records.live_streams() == 1


def test_a_record_naming_an_entry_by_its_record_names_protects_it(tmp_path):
    c = FileCache(str(tmp_path / "c"))
    key = cache_key("v", "x", 5, 0)
    p, _ = c.fill(key, ".chunk", 5, writer(b"12345"))
    names = entry_record_names(key, ".chunk", 5)
    assert names == [record_name(p)]
    c.records.write_record(c.records.record_path(process_tag(), 0), names)
    assert c.evict(10**9) == 0 and os.path.exists(p)


def test_a_record_that_grows_on_a_full_disk_keeps_every_old_name_and_says_so(tmp_path):
    """A record rewritten longer on a full cache disk must not be cut short silently (a short write
    lost the names past the point where the disk ran out, and eviction then removed files a loop was
    about to open): the old record stays whole and the write raises ENOSPC."""
    import errno
    import subprocess

    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True,
                       text=True, timeout=20)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")
    try:
        c = FileCache(str(mnt / "c"))
        rec = c.records.record_path(process_tag(), 0)
        old = [f"{i:04d}" + "o" * 60 for i in range(50)]  # ~3 kB: one page
        c.records.write_record(rec, old)
        fd = os.open(mnt / "ballast", os.O_WRONLY | os.O_CREAT, 0o600)
        with contextlib.suppress(OSError):  # the disk is full now, to the last byte
            while os.write(fd, b"\0" * 4096):
                pass
        os.close(fd)
        grown = old + [f"{i:04d}" + "n" * 60 for i in range(200)]  # ~16 kB: needs pages the disk lacks
        with pytest.raises(OSError) as info:  # before: no error, and the record named 64 of the 250
            c.records.write_record(rec, grown)
        assert info.value.errno in (errno.ENOSPC, errno.EDQUOT)
        assert c.records.protected_names() == set(old)
        os.unlink(mnt / "ballast")
        c.records.write_record(rec, grown)
        assert c.records.protected_names() == set(grown)
        c.records.drop_record(rec)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=20)
