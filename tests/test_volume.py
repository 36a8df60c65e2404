import errno
import contextlib
import os
import pickle
import threading
from typing import Any

import pytest
from waits import wait_until

from ucmagic._util import LOCAL_DISK_FS, copy_file_to_fd, mount_fs_type
from ucmagic.errors import EmptyListingError, SourceNotADirectoryError, SourceChangedError, SourceNotFoundError
from ucmagic.files.volume import (FileEntry, FsspecVolume, LocalVolume, compile_pattern, filter_entries,
                            listing_fingerprint, open_volume, resolve_local_path)


@pytest.mark.parametrize("pattern,path,ok", [
    ("**/*.jpg", "a/b/c.jpg", True), ("**/*.jpg", "c.jpg", True), ("*.jpg", "deep/er/x.jpg", True),
    ("*.jpg", "x.png", False), ("train/*.txt", "train/a.txt", True), ("train/*.txt", "train/sub/a.txt", False),
    ("train/**", "train/sub/a.txt", True), ("img_??.png", "img_01.png", True), ("img_??.png", "img_1.png", False),
    ("[ab]*.bin", "a1.bin", True), ("[!ab]*.bin", "a1.bin", False), ("/top.txt", "top.txt", True),
    ("a+b.txt", "a+b.txt", True), ("a+b.txt", "aab.txt", False),
])
def test_glob_patterns(pattern, path, ok):
    assert bool(compile_pattern(pattern).match(path)) is ok


def test_listing_is_recursive_sorted_with_size_and_mtime(tree):
    root, rels = tree
    entries = LocalVolume(root).list()
    assert [e.path for e in entries] == sorted(rels)
    assert all(e.size == 3000 for e in entries)
    st = os.stat(os.path.join(root, entries[0].path))
    assert entries[0].mtime == st.st_mtime


def test_listing_with_pattern_and_symlinked_file(tree, tmp_path):
    root, rels = tree
    (tmp_path / "outside.txt").write_text("x")
    os.symlink(tmp_path / "outside.txt", os.path.join(root, "link.txt"))
    os.symlink(tmp_path / "missing", os.path.join(root, "dangling.txt"))
    vol = LocalVolume(root)
    vol.follow_symlinks = "all"  # the default, "inside", leaves out a link pointing outside the root
    got = vol.list("*.txt")
    assert [e.path for e in got] == ["link.txt"]


def test_empty_match_names_path_and_pattern(tree):
    root, _ = tree
    with pytest.raises(EmptyListingError) as e:
        LocalVolume(root).list("*.jpeg")
    assert root in str(e.value) and "*.jpeg" in str(e.value)


def test_open_volume_errors(tmp_path):
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        open_volume(str(tmp_path / "nope"))
    f = tmp_path / "file.bin"
    f.write_bytes(b"1")
    with pytest.raises(SourceNotADirectoryError, match="is a file"):
        open_volume(str(f))
    with pytest.raises(SourceNotFoundError):
        open_volume("memory://no/such/dir")


def test_an_fsspec_url_is_looked_at_once_and_named_missing_or_a_file(monkeypatch):
    """One request to the store says whether the URL is there and what it is: two (exists, then isdir) cost two
    round trips and, with a prefix replaced between them, called a folder a file."""
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe("/umlook/ds/a.bin", b"abc")
    looks: list[str] = []
    def counted(name: str) -> Any:
        orig = getattr(type(fs), name)

        def look(self: Any, p: str, *a: Any, **k: Any) -> Any:
            looks.append(name)
            return orig(self, p, *a, **k)
        return look
    for name in ("info", "exists", "isdir", "isfile"):
        monkeypatch.setattr(type(fs), name, counted(name))
    assert isinstance(open_volume("memory://umlook/ds"), FsspecVolume)
    assert looks == ["info"]
    with pytest.raises(SourceNotADirectoryError, match="is a file"):
        open_volume("memory://umlook/ds/a.bin")
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        open_volume("memory://umlook/none")
    fs.rm("/umlook", recursive=True)


def test_volumes_path_maps_to_catalog_root(tmp_path, monkeypatch):
    monkeypatch.setenv("UCMAGIC_CATALOG_ROOT", str(tmp_path))
    real = tmp_path / "main" / "ml" / "volumes" / "imgs" / "train"
    real.mkdir(parents=True)
    (real / "a.bin").write_bytes(b"abc")
    assert resolve_local_path("/Volumes/main/ml/imgs/train") == str(real)
    vol = open_volume("/Volumes/main/ml/imgs/train")
    assert [e.path for e in vol.list()] == ["a.bin"]


def test_volumes_path_without_catalog_root_explains(monkeypatch):
    monkeypatch.delenv("UCMAGIC_CATALOG_ROOT", raising=False)
    with pytest.raises(SourceNotFoundError, match="UCMAGIC_CATALOG_ROOT"):
        open_volume("/Volumes/nocat/noschema/novol")


def test_file_url_and_fsspec_memory(tmp_path, tree):
    root, rels = tree
    assert isinstance(open_volume("file://" + root), LocalVolume)
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe({"/bucket/ds/a/x.bin": b"12345", "/bucket/ds/y.bin": b"1"})
    vol = open_volume("memory://bucket/ds")
    assert isinstance(vol, FsspecVolume)
    entries = vol.list()
    assert [(e.path, e.size) for e in entries] == [("a/x.bin", 5), ("y.bin", 1)]
    dest = tmp_path / "copy"
    assert vol.copy_to("a/x.bin", str(dest)) == 5
    assert dest.read_bytes() == b"12345"


def test_copy_to_local(tree, tmp_path):
    root, rels = tree
    dest = tmp_path / "c.bin"
    assert LocalVolume(root).copy_to(rels[3], str(dest)) == 3000
    assert dest.read_bytes().startswith(rels[3].encode())


def test_local_copy_is_exact_and_refuses_a_source_that_grew(tmp_path):
    root = tmp_path / "v"
    root.mkdir()
    data = os.urandom(3 * 1024 * 1024 + 17)  # many reads of the fill's buffer, the last one short
    (root / "f.bin").write_bytes(data)
    vol = LocalVolume(str(root))
    [e] = vol.list()
    dest = tmp_path / "copy.bin"
    assert vol.copy_to(e.path, str(dest), expect=e) == len(data) and dest.read_bytes() == data
    assert vol.copy_to(e.path, str(tmp_path / "plain.bin")) == len(data)  # no listing entry: to the end
    with open(root / "f.bin", "ab") as f:
        f.write(b"more")  # grew after the listing: the copy stops at the listed size and is refused
    with pytest.raises(SourceChangedError, match="f.bin"):
        vol.copy_to(e.path, str(tmp_path / "grown.bin"), expect=e)


def test_fingerprint_changes_with_listing():
    a = [FileEntry("a", 1, 0.0), FileEntry("b", 2, 0.0)]
    assert listing_fingerprint(a) == listing_fingerprint(list(a))
    assert listing_fingerprint(a) != listing_fingerprint(a[:1])
    assert listing_fingerprint(a) != listing_fingerprint([FileEntry("a", 1, 0.0), FileEntry("b", 3, 0.0)])
    assert [e.path for e in filter_entries(reversed(a), None)] == ["a", "b"]


# ------------------------------------------------------------------ big files: parallel ranged fills

BIG = 24_000_000 + 12_345  # about 24 MB, not a multiple of the range size


@pytest.fixture
def big_file(tmp_path):
    """A volume holding one ~24 MB file of random bytes; returns (root, bytes)."""
    root = tmp_path / "bigvol"
    root.mkdir()
    data = os.urandom(BIG)
    (root / "big.bin").write_bytes(data)
    return str(root), data


def ranges_from_1mib(vol, range_size=1 << 20):
    vol.range_threshold, vol.range_size, vol.range_chunk = 1 << 20, range_size, 1 << 20
    return vol


@pytest.mark.parametrize("kind", ["mounted", "fsspec"])
def test_a_big_file_is_copied_by_parallel_ranges_and_equals_the_source(big_file, tmp_path, kind, monkeypatch):
    root, data = big_file
    vol = LocalVolume(root) if kind == "mounted" else FsspecVolume(f"slow://{root}", {"open_ms": 0, "mbps": 0})
    ranges_from_1mib(vol)
    streams = []
    inner = vol.range_reader

    class FirstWaits:
        """The first stream's first read waits for a second stream to open (on a loaded machine the first
        could otherwise take every range before another pool thread runs)."""

        def __init__(self, reader, first):
            self.reader, self.first = reader, first

        def readinto_at(self, offset, buf):
            if self.first:
                self.first = False
                wait_until(lambda: len(streams) > 1, "a second range stream opening while the first reads")
            return self.reader.readinto_at(offset, buf)

        def close(self):
            self.reader.close()

    def opened(rel):
        streams.append(rel)
        return FirstWaits(inner(rel), len(streams) == 1)

    monkeypatch.setattr(vol, "range_reader", opened)
    [e] = vol.list()
    dest = tmp_path / "copy.bin"
    assert vol.copy_to(e.path, str(dest), expect=e) == len(data)
    assert dest.read_bytes() == data
    assert len(streams) > 1  # several streams read it at once


def test_small_files_and_copies_without_a_listing_entry_use_one_stream(big_file, tmp_path, monkeypatch):
    root, data = big_file
    vol = LocalVolume(root)  # default threshold: 64 MiB
    monkeypatch.setattr(vol, "range_reader", lambda rel: pytest.fail("ranged copy of a file below the threshold"))
    [e] = vol.list()
    assert vol.copy_to(e.path, str(tmp_path / "a"), expect=e) == len(data)
    ranges_from_1mib(vol)
    assert vol.copy_to(e.path, str(tmp_path / "b")) == len(data)  # no expect: a plain copy


class FlakyRanges(LocalVolume):
    """Reads covering one of ``fail_at`` (byte offsets) fail once with EIO: a flaky network read."""

    def __init__(self, root, fail_at):
        super().__init__(root)
        self.fail_at, self.failures, self.mu = set(fail_at), 0, threading.Lock()

    def range_reader(self, rel):
        inner, vol = super().range_reader(rel), self

        class Reader:
            def readinto_at(self, offset, buf):
                with vol.mu:
                    hit = next((b for b in vol.fail_at if offset <= b < offset + len(buf)), None)
                    if hit is not None:
                        vol.fail_at.discard(hit)
                        vol.failures += 1
                if hit is not None:
                    raise OSError(errno.EIO, "injected I/O error")
                return inner.readinto_at(offset, buf)

            def close(self):
                inner.close()

        return Reader()


def test_a_read_failing_in_the_middle_of_a_range_is_retried_for_that_range_only(big_file):
    from ucmagic.files.dataset import UCVolumeDataset

    root, data = big_file
    middle_of_range_2 = 2 * (4 << 20) + (2 << 20) + 5  # third 1 MiB read of the third 4 MiB range
    vol = ranges_from_1mib(FlakyRanges(root, {middle_of_range_2}), range_size=4 << 20)
    ds = UCVolumeDataset(vol)
    [path] = list(ds)
    with open(path, "rb") as f:
        assert f.read() == data
    assert vol.failures == 1
    assert ds.stats()["retries"] == 0  # the range was retried, not the whole file


class ChangesWhileCopied(LocalVolume):
    """The source file is rewritten in place (same size, new content and mtime) during the copy."""

    def __init__(self, root):
        super().__init__(root)
        self.changed = threading.Event()

    def range_reader(self, rel):
        full = os.path.join(self.root, rel)
        if not self.changed.is_set():
            self.changed.set()
            with open(full, "r+b") as f:
                f.write(b"new version\n")
            st = os.stat(full)
            os.utime(full, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
        return super().range_reader(rel)


def test_a_source_changed_during_the_copy_is_refused_naming_it_and_a_new_dataset_gets_the_new_version(big_file):
    from ucmagic import SourceChangedError
    from ucmagic.files.dataset import UCVolumeDataset

    root, data = big_file
    ds = UCVolumeDataset(ranges_from_1mib(ChangesWhileCopied(root)))
    with pytest.raises(SourceChangedError, match=r"big\.bin.*new dataset object"):
        list(ds)
    fresh = UCVolumeDataset(ranges_from_1mib(LocalVolume(root)))
    [path] = list(fresh)
    with open(path, "rb") as f:
        got = f.read()
    assert got == b"new version\n" + data[12:]
    assert fresh.stats()["misses"] == 1


@pytest.mark.parametrize("kind", ["mounted", "fsspec"])
def test_a_small_file_changed_since_the_listing_is_refused_naming_it(tree, tmp_path, kind):
    from ucmagic import SourceChangedError

    root, rels = tree
    vol = LocalVolume(root) if kind == "mounted" else FsspecVolume(f"slow://{root}", {"open_ms": 0, "mbps": 0})
    e = next(x for x in vol.list() if x.path == rels[7])
    with open(os.path.join(root, rels[7]), "ab") as f:
        f.write(b"appended")
    with pytest.raises(SourceChangedError, match=os.path.basename(rels[7]) + ".*new dataset object"):
        vol.copy_to(e.path, str(tmp_path / "c"), expect=e)


def test_range_settings_travel_with_a_pickled_volume(tree):
    import pickle

    root, _ = tree
    for vol in (LocalVolume(root), FsspecVolume(f"slow://{root}", {"open_ms": 0})):
        vol.range_threshold = 5 << 20
        got = pickle.loads(pickle.dumps(vol))
        assert (got.range_threshold, got.range_size) == (5 << 20, vol.range_size)
        assert [e.path for e in got.list()] == [e.path for e in vol.list()]


def test_a_missing_fsspec_implementation_names_the_extra_to_install(monkeypatch):
    import fsspec.core

    def missing(url, **kw):
        raise ImportError("Install s3fs to access S3")

    monkeypatch.setattr(fsspec.core, "url_to_fs", missing)
    with pytest.raises(ImportError, match=r"s3://bucket/train.*pip install 'ucmagic\[s3\]'"):
        open_volume("s3://bucket/train")


def test_mounting_the_fuse_simulator_without_mfusepy_says_how_to_install_it(monkeypatch, tmp_path):
    import sys

    from ucmagic.testing import mount_slow_volume

    monkeypatch.setitem(sys.modules, "mfusepy", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'ucmagic\[fuse\]'"), \
            mount_slow_volume(str(tmp_path), str(tmp_path / "mnt")):
        pass
    assert not (tmp_path / "mnt").exists()  # nothing was made


class _ThreadNoting(LocalVolume):
    """A local volume noting which thread read each directory, each read taking ``delay`` seconds."""

    def __init__(self, root, delay):
        super().__init__(root)
        self.delay, self.readers = delay, set()

    def _scan_dir(self, rel, rx=None):
        import time

        time.sleep(self.delay)
        self.readers.add(threading.get_ident())
        return super()._scan_dir(rel, rx)


# the threshold is the test's: no hiccup of a loaded machine reaches 60 s, and a 0.15 s sleep always exceeds 0.1 s
@pytest.mark.parametrize("delay, fast_s, pooled", [(0.0, 60.0, False), (0.15, 0.1, True)])
def test_fast_directories_are_read_on_the_calling_thread_and_slow_ones_concurrently(tmp_path, monkeypatch, delay,
                                                                                   fast_s, pooled):
    monkeypatch.setattr("ucmagic.files.volume_local.FAST_DIR_S", fast_s)
    for d in range(12):
        (tmp_path / f"d{d}").mkdir()
        (tmp_path / f"d{d}" / "f.bin").write_bytes(b"x")
    vol = _ThreadNoting(str(tmp_path), delay)
    assert sorted(e.path for e in vol.list()) == [f"d{d}/f.bin" for d in sorted(range(12), key=str)]
    assert (vol.readers != {threading.get_ident()}) == pooled


def test_the_fuse_simulator_unmounts_with_a_file_left_open_and_mounts_there_again(tmp_path):
    from ucmagic.testing import fuse_available, mount_slow_volume

    if not fuse_available():
        pytest.skip("needs FUSE (/dev/fuse, fusermount3, mfusepy)")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.bin").write_bytes(b"x" * 1000)
    mnt = str(tmp_path / "mnt")
    with mount_slow_volume(str(tmp_path / "src"), mnt, open_ms=0, list_ms=0):
        leaked = os.open(os.path.join(mnt, "a.bin"), os.O_RDONLY)  # a descriptor nobody closes in time
    try:
        assert not os.path.ismount(mnt)
        with mount_slow_volume(str(tmp_path / "src"), mnt, open_ms=0, list_ms=0) as again, \
                open(os.path.join(again, "a.bin"), "rb") as f:
            assert f.read() == b"x" * 1000
    finally:
        with contextlib.suppress(OSError):  # its server is gone: the close reports ENOTCONN
            os.close(leaked)


def test_a_pattern_listing_never_stats_the_files_it_leaves_out(tmp_path, monkeypatch):
    """On a network mount each stat is a round trip: only files the pattern matches are stat-ed."""
    for d in ("train/cat", "train/dog", "notes"):
        (tmp_path / d).mkdir(parents=True)
    for i in range(3):
        (tmp_path / "train" / "cat" / f"{i}.jpg").write_bytes(b"c" * (i + 1))
        (tmp_path / "train" / "dog" / f"{i}.txt").write_bytes(b"d")
        (tmp_path / "notes" / f"{i}.jpg.bak").write_bytes(b"n")
    stated: list[str] = []
    real = os.scandir

    class Counting:
        def __init__(self, de):
            self._de = de

        def __getattr__(self, name):
            return getattr(self._de, name)

        def stat(self, **kw):
            stated.append(self._de.name)
            return self._de.stat(**kw)

    @contextlib.contextmanager
    def scandir(path):
        with real(path) as it:
            yield (Counting(de) for de in it)

    monkeypatch.setattr(os, "scandir", scandir)
    vol = LocalVolume(str(tmp_path))
    got = vol.list("**/*.jpg")
    assert [(e.path, e.size) for e in got] == [(f"train/cat/{i}.jpg", i + 1) for i in range(3)]
    assert sorted(stated) == ["0.jpg", "1.jpg", "2.jpg"]
    stated.clear()
    scanned = sorted(e.path for d in vol.scan("train/*/*.txt") for e in d.files)
    assert scanned == [f"train/dog/{i}.txt" for i in range(3)]
    assert sorted(stated) == ["0.txt", "1.txt", "2.txt"]


MOUNTINFO = """22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
30 22 0:50 / /Volumes/main/raw rw,nosuid - fuse.slowvol slowvol rw,user_id=0
31 22 0:51 / /mnt rw - nfs4 srv:/export rw
32 31 0:52 / /mnt/scratch\\040space rw - tmpfs tmpfs rw
"""


@pytest.mark.parametrize("path, fs", [("/home/me/data", "ext4"), ("/Volumes/main/raw/train", "fuse.slowvol"),
                                      ("/Volumes/main/rawer", "ext4"), ("/mnt/a/b", "nfs4"),
                                      ("/mnt/scratch space/x", "tmpfs"), ("/mnt", "nfs4")])
def test_the_file_system_of_a_path_is_its_longest_mount_point(path, fs):
    assert mount_fs_type(path, MOUNTINFO) == fs


def test_only_disk_file_systems_of_this_machine_count_as_local_disks(tmp_path):
    assert {"ext4", "xfs", "tmpfs", "overlay"} <= LOCAL_DISK_FS
    assert not {"fuse", "fuse.slowvol", "nfs", "nfs4", "cifs", "smb3", "9p"} & LOCAL_DISK_FS
    vol = LocalVolume(str(tmp_path))
    assert vol.local_disk == (mount_fs_type(str(tmp_path)) in LOCAL_DISK_FS)
    assert pickle.loads(pickle.dumps(vol)).local_disk == vol.local_disk


def test_a_local_volume_subclass_that_copies_its_own_way_is_not_a_local_disk(tmp_path):
    class Remote(LocalVolume):  # e.g. a copy that waits on a server: it may hang, so never inline
        def copy_to(self, rel, dest, **kw):
            return super().copy_to(rel, dest, **kw)

    class Counted(LocalVolume):  # reads are LocalVolume's own
        pass

    assert not Remote(str(tmp_path)).local_disk
    assert Counted(str(tmp_path)).local_disk == LocalVolume(str(tmp_path)).local_disk


@pytest.mark.parametrize("has_readinto", [True, False])
def test_a_file_object_is_copied_whole_through_a_small_buffer(tmp_path, has_readinto):
    # FsspecVolume fills: a file object (readinto where it has one, else read) to a raw descriptor
    data = os.urandom(10_000)

    class Reader:
        def __init__(self):
            self.pos = 0

        def read(self, n):
            got = data[self.pos:self.pos + min(n, 3000)]  # short reads, as a network stream gives
            self.pos += len(got)
            return got

    if has_readinto:
        def readinto(self, b):
            got = self.read(len(b))
            b[:len(got)] = got
            return len(got)
        Reader.readinto = readinto
    fd = os.open(tmp_path / "out", os.O_WRONLY | os.O_CREAT)
    try:
        assert copy_file_to_fd(Reader(), fd, buffer_size=4096) == len(data)
    finally:
        os.close(fd)
    assert (tmp_path / "out").read_bytes() == data
