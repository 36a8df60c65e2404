"""The node-wide memory-mapped listing: same entries as volume.list, listed once, reused while valid."""
import multiprocessing as mp
import os
import pickle
import subprocess
import sys
import time

import numpy as np
import pytest

from ucmagic import EmptyListingError, ListingChangedError
from ucmagic.files.cache_layout import cache_key
from ucmagic.files.listing import RACY_S, Listing, forget_listing, listings_dir, open_listing
from ucmagic.testing import make_files
from ucmagic.files.volume import DirScan, FileEntry, LocalVolume, Volume, listing_fingerprint, open_volume
from waits import module_with


class CountingVolume(LocalVolume):
    """A local volume that records each listing it does (as a file, so other processes' count too)."""

    def __init__(self, root, tally, delay=0.0):
        super().__init__(root)
        self.tally, self.delay = tally, delay

    def __reduce__(self):
        return (CountingVolume, (self.root, self.tally, self.delay))

    def scan(self, pattern=None):
        with open(os.path.join(self.tally, f"scan-{os.getpid()}-{time.monotonic_ns()}"), "w"):
            pass
        time.sleep(self.delay)
        yield from super().scan(pattern)

    def scans(self):
        return len(os.listdir(self.tally))


class SyntheticVolume(Volume):
    """``n`` files that exist only as listing entries (an object store without directory mtimes)."""

    def __init__(self, n, per_dir=100, size=1000, mtime=1e9, delay=0.0):
        self.uri = f"synthetic://{n}-{per_dir}-{size}"
        self.n, self.per_dir, self.size, self.mtime, self.delay = n, per_dir, size, mtime, delay
        self.scans = 0

    def _listing_only(self, *args, **kwargs):
        raise NotImplementedError("SyntheticVolume only lists")

    list = copy_to = stat = range_reader = _listing_only
    write_bytes = upload = read_bytes = exists = makedirs = remove = remove_tree = rename = list_names = _listing_only

    def scan(self, pattern=None):
        self.scans += 1
        for a in range(0, self.n, self.per_dir):
            time.sleep(self.delay)
            d = f"shard{a // 10000:03d}/dir{a // self.per_dir:05d}"
            yield DirScan(d, -1, [FileEntry(f"{d}/img_{i:08d}.jpg", self.size + i % 7, self.mtime)
                                  for i in range(a, min(a + self.per_dir, self.n))])


def age(root, seconds=3600):
    """Move every mtime under ``root`` into the past, as for a data set written a while ago."""
    t = time.time() - seconds
    for dirpath, _, files in os.walk(root):
        for name in files + [""]:
            os.utime(os.path.join(dirpath, name) if name else dirpath, (t, t))


@pytest.fixture
def vol(tmp_path):
    root = tmp_path / "volume"
    make_files(str(root), 150, 300, per_dir=20)
    age(str(root))
    tally = tmp_path / "tally"
    tally.mkdir()
    return CountingVolume(str(root), str(tally))


def cache_root(tmp_path):
    return str(tmp_path / "cache")


def test_listing_has_the_entries_and_fingerprint_of_volume_list(vol, tmp_path):
    ref = open_volume(vol.root).list("*.bin")
    listing = open_listing(vol, "*.bin", cache_root(tmp_path))
    assert len(listing) == len(ref) == 150
    assert listing.entries(np.arange(len(listing))) == ref
    assert list(listing.iter_entries(chunk=7)) == ref
    assert listing.entry(3) == ref[3] and listing.entry(-1) == ref[-1]
    assert listing.paths([5, 0]) == [ref[5].path, ref[0].path]
    assert listing.sizes.tolist() == [e.size for e in ref]
    assert listing.total_bytes == sum(e.size for e in ref)
    assert listing.fingerprint == listing_fingerprint(ref)
    assert listing.keys([7, 2]) == [cache_key(vol.uri, e.path, e.size, e.mtime) for e in (ref[7], ref[2])]
    with pytest.raises(IndexError):
        listing.entry(150)


def test_paths_sort_as_volume_list_sorts_them(tmp_path):
    root = tmp_path / "v"
    for rel in ["a0", "a/b.txt", "a-b/c", "a/b0", "a/b/c", "é/x", "z"]:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(rel)
    vol = open_volume(str(root))
    assert [e.path for e in open_listing(vol, None, cache_root(tmp_path)).iter_entries()] == \
        [e.path for e in vol.list()]


def test_a_second_open_maps_the_same_file_without_listing(vol, tmp_path):
    first = open_listing(vol, None, cache_root(tmp_path))
    again = open_listing(vol, None, cache_root(tmp_path))
    other_pattern = open_listing(vol, "f00000*", cache_root(tmp_path))
    assert again.path == first.path and vol.scans() == 2  # the second pattern is a listing of its own
    assert len(other_pattern) == 10
    assert open_listing(vol, None, cache_root(tmp_path), validate="dirs").path == first.path
    assert vol.scans() == 2


@pytest.mark.parametrize("change", ["added", "removed", "resized", "touched", "renamed", "new_subdir"])
def test_a_changed_tree_is_listed_again(vol, tmp_path, change):
    before = open_listing(vol, None, cache_root(tmp_path))
    victim = os.path.join(vol.root, before.entry(7).path)
    t = time.time() - 600  # clearly different, and not "racy"
    if change == "added":
        open(os.path.join(os.path.dirname(victim), "new.bin"), "wb").close()
    elif change == "removed":
        os.unlink(victim)
    elif change == "resized":  # rewritten in place: the directory's mtime does not change
        st = os.stat(victim)
        with open(victim, "ab") as f:
            f.write(b"more")
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns))
    elif change == "touched":  # same size, new mtime
        os.utime(victim, (t, t))
    elif change == "renamed":
        os.rename(victim, victim + ".moved")
    else:
        os.makedirs(os.path.join(vol.root, "part0", "fresh"))
    after = open_listing(vol, None, cache_root(tmp_path))
    assert vol.scans() == 2 and after.path != before.path
    assert after.entries(np.arange(len(after))) == open_volume(vol.root).list()


def test_dirs_validation_catches_added_removed_and_replaced_files(vol, tmp_path):
    before = open_listing(vol, None, cache_root(tmp_path), validate="dirs")
    victim = os.path.join(vol.root, before.entry(3).path)
    with open(victim + ".tmp", "wb") as f:  # how most tools update a file: write aside, rename over it
        f.write(b"new content")
    os.replace(victim + ".tmp", victim)
    after = open_listing(vol, None, cache_root(tmp_path), validate="dirs")
    assert after.path != before.path and after.entry(3).size == len(b"new content")


def test_relist_forces_a_new_listing(vol, tmp_path):
    first = open_listing(vol, None, cache_root(tmp_path))
    second = open_listing(vol, None, cache_root(tmp_path), relist=True)
    assert vol.scans() == 2 and second.path != first.path
    assert second.entries(range(len(second))) == first.entries(range(len(first)))


def test_a_listing_taken_right_after_a_change_is_checked_again(tmp_path, monkeypatch):
    """The listing's clock is set by the test: the first listing half a second after the files' writes, the
    next ones well past RACY_S (however long the machine took in between)."""
    from ucmagic.files import listing as listing_mod

    root = tmp_path / "v"
    make_files(str(root), 10, 100)
    age(str(root), 100)
    written = os.stat(root).st_mtime
    now = [written + RACY_S / 2]

    def clock() -> float:
        now[0] += 1e-3  # each look a moment later
        return now[0]

    monkeypatch.setattr(listing_mod, "time", module_with(time=clock, monotonic=time.monotonic))
    tally = tmp_path / "tally"
    tally.mkdir()
    vol = CountingVolume(str(root), str(tally))
    first = open_listing(vol, None, cache_root(tmp_path))
    assert first.meta["racy"]  # files written just now could change again within the same clock tick
    now[0] = written + 10 * RACY_S
    second = open_listing(vol, None, cache_root(tmp_path))
    third = open_listing(vol, None, cache_root(tmp_path))
    assert second.path != first.path and not second.meta["racy"] and third.path == second.path
    assert vol.scans() == 2


def test_a_forgotten_listing_is_listed_again_whatever_validate_says(vol, tmp_path):
    first = open_listing(vol, None, cache_root(tmp_path))
    assert forget_listing(first)
    second = open_listing(vol, None, cache_root(tmp_path), validate="none")
    assert second.path != first.path and vol.scans() == 2
    assert not forget_listing(first)  # a newer build is current: it stays
    assert open_listing(vol, None, cache_root(tmp_path), validate="none").path == second.path


def test_validate_none_reuses_without_looking(vol, tmp_path):
    first = open_listing(vol, None, cache_root(tmp_path))
    os.unlink(os.path.join(vol.root, first.entry(0).path))
    assert open_listing(vol, None, cache_root(tmp_path), validate="none").path == first.path
    with pytest.raises(ValueError, match="validate"):
        open_listing(vol, None, cache_root(tmp_path), validate="sometimes")


def test_volume_without_directory_mtimes_is_relisted_and_compared(tmp_path):
    vol = SyntheticVolume(500)
    first = open_listing(vol, None, cache_root(tmp_path))
    assert open_listing(vol, None, cache_root(tmp_path)).path == first.path and vol.scans == 2
    vol.mtime = 2e9  # every object rewritten: same names and sizes, new times
    changed = open_listing(vol, None, cache_root(tmp_path))
    assert changed.path != first.path and changed.entry(0).mtime == 2e9


def test_empty_listing_raises_and_writes_nothing(vol, tmp_path):
    with pytest.raises(EmptyListingError, match="no files matching"):
        open_listing(vol, "*.nothing", cache_root(tmp_path))
    assert not [f for f in os.listdir(listings_dir(cache_root(tmp_path))) if f.endswith(".arrow")]


def test_progress_reports_files_so_far_after_a_second(tmp_path):
    seen = []
    open_listing(SyntheticVolume(3000, per_dir=100, delay=0.05), None, cache_root(tmp_path), progress=seen.append)
    assert seen and seen == sorted(seen) and seen[-1] == 3000
    quiet = []
    open_listing(SyntheticVolume(300), None, cache_root(tmp_path), progress=quiet.append)
    assert quiet == []  # a listing faster than a second shows nothing


def test_pickled_listing_is_small_at_200k_files(tmp_path):
    listing = open_listing(SyntheticVolume(200_000, per_dir=500), None, cache_root(tmp_path))
    blob = pickle.dumps(listing)
    assert len(blob) < 100_000
    back = pickle.loads(blob)
    assert len(back) == 200_000 and back.entries([0, 199_999]) == listing.entries([0, 199_999])
    assert back.fingerprint == listing.fingerprint


def test_unpickling_a_removed_listing_says_what_to_do(vol, tmp_path):
    blob = pickle.dumps(open_listing(vol, None, cache_root(tmp_path)))
    path = pickle.loads(blob).path
    os.unlink(path)
    with pytest.raises(ListingChangedError, match="create the dataset again"):
        pickle.loads(blob)
    assert isinstance(Listing, type)


def test_file_names_that_are_not_utf8_round_trip(tmp_path):
    root = tmp_path / "v"
    root.mkdir()
    name = os.fsdecode(b"caf\xe9.bin")
    try:
        open(os.path.join(str(root), name), "wb").close()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this filesystem refuses non-UTF-8 names")
    (root / "plain.bin").write_bytes(b"x")
    vol = open_volume(str(root))
    listing = open_listing(vol, None, cache_root(tmp_path))
    assert listing.entries([0, 1]) == vol.list()
    assert listing.keys([0, 1]) == [cache_key(vol.uri, e.path, e.size, e.mtime) for e in vol.list()]


def _open_in_process(volume, root, q, barrier, relist=False):
    barrier.wait()
    listing = open_listing(volume, None, root, relist=relist)
    q.put((listing.path, len(listing), pickle.dumps(listing)))


def test_concurrent_processes_build_the_listing_once(vol, tmp_path):
    slow = CountingVolume(vol.root, vol.tally, delay=1.0)
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(3)
    procs = [ctx.Process(target=_open_in_process, args=(slow, cache_root(tmp_path), q, barrier)) for _ in range(3)]
    for p in procs:
        p.start()
    got = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert slow.scans() == 1  # one listing on the machine, the others waited and mapped it
    assert len({path for path, _, _ in got}) == 1 and {n for _, n, _ in got} == {150}
    back = pickle.loads(got[0][2])  # a listing pickled in another process maps the same file here
    assert back.entries(range(150)) == open_volume(vol.root).list()


def test_concurrent_relists_share_one_rebuild(vol, tmp_path):
    open_listing(vol, None, cache_root(tmp_path))
    slow = CountingVolume(vol.root, vol.tally, delay=1.0)
    ctx = mp.get_context("spawn")
    q, barrier = ctx.Queue(), ctx.Barrier(2)
    procs = [ctx.Process(target=_open_in_process, args=(slow, cache_root(tmp_path), q, barrier, True))
             for _ in range(2)]
    for p in procs:
        p.start()
    got = {q.get(timeout=120)[0] for _ in procs}
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert slow.scans() == 2 and len(got) == 1  # the first listing plus one shared rebuild



def test_building_and_reading_a_listing_loads_no_pandas(vol, tmp_path):
    # pandas would add ~1 s and tens of MB to every rank and worker that maps a listing
    code = ("import sys, numpy as np; from ucmagic.files.listing import open_listing; "
            "from ucmagic.files.volume import LocalVolume; "
            f"l = open_listing(LocalVolume({vol.root!r}), None, {cache_root(tmp_path)!r}); "
            "l.entries(np.arange(len(l))); l.dirs(); print('pandas' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_superseded_builds_are_removed_after_a_day_and_recent_ones_kept(vol, tmp_path):
    from ucmagic.files.listing import SUPERSEDED_GRACE_S

    old = open_listing(vol, None, cache_root(tmp_path))
    recent = open_listing(vol, None, cache_root(tmp_path), relist=True)
    t = time.time() - 2 * SUPERSEDED_GRACE_S
    os.utime(old.path, (t, t))
    leftover = recent.path + ".tmp-99999"  # a builder killed mid-write
    open(leftover, "w").close()
    os.utime(leftover, (t, t))
    current = open_listing(vol, None, cache_root(tmp_path), relist=True)
    assert not os.path.exists(old.path) and not os.path.exists(leftover)
    assert os.path.exists(recent.path) and os.path.exists(current.path)  # a worker may still unpickle it
