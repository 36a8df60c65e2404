"""Per-key fill locks across threads and processes (ucmagic.files.locks)."""
import multiprocessing as mp
import os
import threading
import time

import pytest

from waits import PATIENCE, wait_until

from ucmagic.files.cache_layout import cache_key
from ucmagic.files.locks import KeyLocks


def _hold_key(root: str, key: str, held) -> None:
    with KeyLocks(os.path.join(root, "fill.lock")).hold(key):
        held.set()
        time.sleep(600)  # killed before


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
        assert other.wait(PATIENCE)  # another key is not blocked
        t = threading.Thread(target=take, args=(key, got), daemon=True)
        t.start()
        assert not got.wait(0.3)  # the child holds this key
        child.kill()  # SIGKILL: the kernel drops the child's lock with its descriptor
        assert got.wait(PATIENCE)
    finally:
        child.kill()
        child.join(10)


def test_a_process_that_exited_but_was_not_reaped_is_not_alive():
    # a zombie: a killed DataLoader worker whose parent has not waited for it yet (in a container
    # without an init, never); its protection records and temp files must not count as a live process's
    import subprocess
    import sys

    from ucmagic.files.locks import process_tag, tag_alive

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        tag = process_tag(child.pid)
        assert tag_alive(tag)
        child.stdin.close()  # it exits; not waited for, it stays a zombie
        wait_until(lambda: _state(child.pid) == "Z", "the child a zombie")
        assert not tag_alive(tag)
    finally:
        child.wait(PATIENCE)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


# ---------------------------------------------------------------- private places

def _st(mode: int, uid: int):
    """A stand-in ``lstat`` result: only st_mode and st_uid are read."""
    return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))


def test_a_folder_is_private_only_when_a_real_directory_of_the_user_that_no_one_else_may_write():
    import stat

    from hypothesis import given
    from hypothesis import strategies as st

    from ucmagic.files.locks import dir_problem

    kinds = st.sampled_from([stat.S_IFDIR, stat.S_IFLNK, stat.S_IFREG])

    @given(kinds, st.integers(0, 0o7777), st.sampled_from([1000, 1001, 0]), st.booleans())
    def check(kind, bits, owner, sticky_ok):
        problem = dir_problem(_st(kind | bits, owner), 1000, sticky_ok=sticky_ok)
        sticky_shared = sticky_ok and bits & stat.S_ISVTX and owner in (1000, 0)
        ok = kind == stat.S_IFDIR and (sticky_shared or (owner == 1000 and not bits & 0o022))
        assert (problem is None) == bool(ok), (oct(kind | bits), owner, sticky_ok, problem)

    check()


def test_private_dir_makes_0700_folders_whatever_the_umask_and_refuses_links_and_loose_ones(tmp_path):
    from ucmagic.errors import UnsafeDirectoryError
    from ucmagic.files.locks import open_private, private_dir

    old = os.umask(0)
    try:
        made = private_dir(str(tmp_path / "a" / "b" / "c"))
    finally:
        os.umask(old)
    for p in (tmp_path / "a", tmp_path / "a" / "b", made):
        assert os.stat(p).st_mode & 0o777 == 0o700
    os.symlink(made, tmp_path / "link")
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        private_dir(str(tmp_path / "link"))
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    with pytest.raises(UnsafeDirectoryError, match="others may write"):
        private_dir(str(loose))
    assert private_dir(str(loose), tighten=True) and os.stat(loose).st_mode & 0o777 == 0o700
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    os.symlink(target, tmp_path / "a.lock")
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        open_private(str(tmp_path / "a.lock"))
    assert target.read_bytes() == b"keep"


@pytest.mark.skipif(not hasattr(__import__("fcntl"), "F_OFD_SETLK"), reason="Linux open-file-description locks")
def test_threads_taking_a_new_process_s_first_key_locks_at_once_leave_none_held(tmp_path, monkeypatch):
    """Two fill threads of a fresh process (a forked DataLoader worker) whose first locks race: before, each
    opened the lock file, one's lock was taken on its own descriptor and given back on the other's, and stayed
    held: another worker's fill of a key on that byte waited for good (a budget test hung 1 run in 5)."""
    import fcntl
    import struct

    import ucmagic.files.locks as locks_mod

    path = str(tmp_path / "fill.lock")
    open(path, "wb").close()
    locks = KeyLocks(path)
    both_inside = threading.Barrier(2)
    real_open = locks_mod.open_private

    def opening_together(*a, **kw):
        try:  # before the fix both threads got here; now the second waits its turn
            late = both_inside.wait(timeout=1) == 0
        except threading.BrokenBarrierError:
            late = False
        fd = real_open(*a, **kw)
        if late:  # one thread's descriptor replaces the other's while that one holds its lock
            time.sleep(0.3)
        return fd

    monkeypatch.setattr(locks_mod, "open_private", opening_together)
    keys = [cache_key("u", f"f{i}", 1, 1.0) for i in range(2)]

    def fill(key):
        held = locks.acquire(key)
        time.sleep(0.6)  # a copy: the other thread's descriptor arrives meanwhile
        locks.release(key, held)

    threads = [threading.Thread(target=fill, args=(k,)) for k in keys]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    other = os.open(path, os.O_RDWR)  # another process's description (OFD locks conflict across descriptions)
    try:
        for k in keys:
            fcntl.fcntl(other, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET,
                                                              locks_mod.key_offset(k), 1, 0))  # raises if held
    finally:
        os.close(other)
