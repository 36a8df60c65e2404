"""A full scan of local Parquet files (issue 51 item 6): the decoder reads the very files ucmagic checked, through
native pyarrow files (no interpreter lock per read), and the decode ahead of the consumer keeps every batch's
rows, order and values equal to pyarrow's own read, at any read-ahead depth, resumed mid-epoch too."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ucmagic.errors import UnsafeSourceError
from ucmagic.tables import ParquetDataset
from ucmagic.tables.table_io import TableFiles


def _table(tmp_path, files=3, rows=1000, group=300):
    root = tmp_path / "t"
    root.mkdir()
    rng = np.random.default_rng(7)
    for k in range(files):
        ids = np.arange(k * rows, (k + 1) * rows, dtype=np.int64)
        t = pa.table({"id": ids, "x": rng.random(rows), "f": rng.random(rows, dtype=np.float32),
                      "i": rng.integers(-5, 5, rows, dtype=np.int32)})
        pq.write_table(t, root / f"part-{k}.parquet", row_group_size=group)
    return root


def test_a_local_table_file_is_decoded_from_the_file_that_was_checked(tmp_path):
    root = _table(tmp_path, files=1)
    path = str(root / "part-0.parquet")
    want = pq.read_table(path)
    io = TableFiles(str(root))
    f = io.open_arrow(path)
    try:
        if os.path.isdir("/proc/self/fd"):
            assert isinstance(f, pa.OSFile)  # native reads: no interpreter lock per read
        other = tmp_path / "other.parquet"
        pq.write_table(pa.table({"id": pa.array([1], pa.int64())}), other)
        os.replace(other, path)  # the path now names another file: the one opened is read
        assert pq.ParquetFile(f).read().equals(want)
    finally:
        f.close()


def test_a_table_file_swapped_for_a_link_out_of_the_table_is_refused_by_the_native_open(tmp_path):
    root = _table(tmp_path, files=1)
    outside = tmp_path / "outside.parquet"
    pq.write_table(pa.table({"secret": [1]}), outside)
    path = root / "part-0.parquet"
    io = TableFiles(str(root))
    os.remove(path)
    os.symlink(outside, path)
    with pytest.raises(UnsafeSourceError):
        io.open_arrow(str(path))


@pytest.mark.parametrize("prefetch", [1, 2, 5])
def test_the_decode_ahead_keeps_every_batch_equal_to_pyarrows_read(tmp_path, prefetch):
    root = _table(tmp_path)
    want = pa.concat_tables([pq.read_table(root / f"part-{k}.parquet") for k in range(3)])
    ds = ParquetDataset(str(root), batch_size=256, prefetch=prefetch)  # batches cross row groups and files
    batches = list(ds)
    assert [len(b["id"]) for b in batches] == [256] * 11 + [3000 - 11 * 256]
    for c in ("id", "x", "f", "i"):
        got = np.concatenate([b[c].numpy() for b in batches])
        np.testing.assert_array_equal(got, want.column(c).to_numpy())
        assert got.dtype == want.column(c).to_numpy().dtype


def test_a_scan_resumed_mid_epoch_delivers_exactly_the_rest(tmp_path):
    root = _table(tmp_path)
    ds = ParquetDataset(str(root), batch_size=256, prefetch=3)
    it = iter(ds)
    seen = [next(it)["id"].numpy().copy() for _ in range(5)]
    state = ds.state_dict()
    it.close()
    again = ParquetDataset(str(root), batch_size=256, prefetch=3)
    again.load_state_dict(state)
    rest = [b["id"].numpy() for b in again]
    np.testing.assert_array_equal(np.concatenate(seen + rest), np.arange(3000))


def _read_aheads(monkeypatch):
    """Spy on the dataset's read-ahead: each call's (depth, max_bytes, cost, items), the real one runs."""
    import ucmagic.tables.parquet_dataset as pds

    calls: list[tuple] = []
    real = pds.read_ahead

    def spy(fn, items, **kw):
        items = list(items)
        calls.append((kw["depth"], kw.get("max_bytes"), kw.get("cost"), items))
        return real(fn, items, **kw)
    monkeypatch.setattr(pds, "read_ahead", spy)
    return calls


def test_a_table_read_in_place_from_a_mount_decodes_more_windows_ahead_within_a_byte_bound(tmp_path, monkeypatch):
    """Each read of a table on a mount waits on it (7.9 s at two windows against 3.0-3.3 s at eight, the scanner
    2.3 s): in place, up to IN_PLACE_PREFETCH windows are decoded ahead; on this machine's disk, or decoded from
    whole files cached ahead, PREFETCH; either way holding at most PREFETCH_BYTES (estimated from the footers).
    A prefetch given wins, unbounded. Every batch stays pyarrow's rows."""
    from ucmagic.files.volume_local import LocalVolume
    from ucmagic.tables.parquet_dataset import IN_PLACE_PREFETCH, PREFETCH, PREFETCH_BYTES

    root = _table(tmp_path, files=3, rows=1000, group=100)
    want = pa.concat_tables([pq.read_table(root / f"part-{k}.parquet") for k in range(3)]).column("id").to_numpy()
    footers = sum(pq.ParquetFile(root / f"part-{k}.parquet").metadata.row_group(j).total_byte_size
                  for k in range(3) for j in range(10))
    calls = _read_aheads(monkeypatch)

    def ids(ds):
        return np.concatenate([b["id"].numpy() for b in ds])

    def bounded(depth):
        got, max_bytes, cost, segs = calls[-1]
        assert (got, max_bytes) == (depth, PREFETCH_BYTES)
        assert abs(sum(cost(s) for s in segs) - footers) <= len(segs)  # the windows' decoded bytes, as estimated

    np.testing.assert_array_equal(ids(ParquetDataset(str(root), batch_size=256)), want)
    bounded(PREFETCH)  # this machine's disk

    monkeypatch.setattr(LocalVolume, "local_disk", property(lambda self: False))  # as on a FUSE mount
    ds = ParquetDataset(str(root), batch_size=256)
    assert ds.cache is None  # not a /Volumes path: read in place
    np.testing.assert_array_equal(ids(ds), want)
    bounded(IN_PLACE_PREFETCH)

    np.testing.assert_array_equal(ids(ParquetDataset(str(root), batch_size=256, prefetch=3)), want)
    assert calls[-1][:3] == (3, None, None)  # given: it wins

    cached = ParquetDataset(str(root), batch_size=256, cache=True, cache_dir=str(tmp_path / "c"))
    np.testing.assert_array_equal(ids(cached), want)
    bounded(PREFETCH)  # whole files filled ahead, decoded from the cache

    ranged = ParquetDataset(str(root), batch_size=64, cache=True, cache_dir=str(tmp_path / "c2"),
                            filter="id % 7 = 0")
    np.testing.assert_array_equal(ids(ranged), want[want % 7 == 0])
    assert calls[-1][:2] == (IN_PLACE_PREFETCH, PREFETCH_BYTES)  # a filter's byte ranges come from the mount

    monkeypatch.setattr("ucmagic.tables.parquet_dataset.PREFETCH_BYTES", 1)  # every window over the bound
    shuffled = ids(ParquetDataset(str(root), batch_size=256, shuffle=True, seed=3))
    np.testing.assert_array_equal(np.sort(shuffled), want)  # one window at a time, every row once
    assert calls[-1][1] == 1


class _Reader:
    """What FillAhead uses of a TableReader: the cache's budget, the files' sizes and the whole-file fill."""

    def __init__(self, sizes, budget=None):
        import threading
        from types import SimpleNamespace

        self.cache = SimpleNamespace(budget=lambda: budget)
        self.files = [SimpleNamespace(size=s) for s in sizes]
        self.filled: list[int] = []
        self.gate = threading.Event()
        self._mu = threading.Lock()

    def local(self, fi):
        self.gate.wait(30)
        with self._mu:
            self.filled.append(fi)
        return f"/cache/{fi}"


def test_the_next_files_fill_ahead_of_the_decode_a_bounded_number_at_a_time():
    from ucmagic.tables.table_reader import FillAhead

    r = _Reader([10] * 7)
    ahead = FillAhead(r, [0, 1, 2, 3, 4, 5, 6], depth=2)
    ahead.reached(0)
    assert ahead.started == 3  # file 0 is the decode's own fill; 1 and 2 fill ahead
    ahead.reached(0)
    assert ahead.started == 3
    ahead.reached(1)
    assert ahead.started == 4
    ahead.reached(99)  # not a file of this stream: nothing
    assert ahead.started == 4
    r.gate.set()
    ahead.close()
    ahead.reached(4)  # closed: nothing more starts
    assert ahead.started == 4
    assert set(r.filled) <= {1, 2, 3}


def test_files_filled_ahead_hold_at_most_half_the_cache_budget():
    from ucmagic.tables.table_reader import FillAhead

    r = _Reader([40, 30, 30, 30], budget=100)
    ahead = FillAhead(r, [0, 1, 2, 3], depth=3)
    r.gate.set()
    ahead.reached(0)
    assert ahead.started == 2  # file 1 (30 bytes) fits in half of 100; file 2 would hold 60
    ahead.close()


def test_a_cached_scan_equals_pyarrows_read_and_fills_every_file(tmp_path):
    root = _table(tmp_path, files=6, rows=500, group=200)
    want = pa.concat_tables([pq.read_table(root / f"part-{k}.parquet") for k in range(6)])
    cache = tmp_path / "cache"
    ds = ParquetDataset(str(root), batch_size=128, cache=True, cache_dir=str(cache))
    got = list(ds)
    for c in ("id", "x", "f", "i"):
        np.testing.assert_array_equal(np.concatenate([b[c].numpy() for b in got]), want.column(c).to_numpy())
    filled = [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".parquet")]
    assert len(filled) == 6


def test_a_cached_scan_left_after_one_batch_leaves_a_cache_the_next_scan_reads_whole(tmp_path):
    root = _table(tmp_path, files=12, rows=300, group=300)
    want = pa.concat_tables([pq.read_table(root / f) for f in sorted(os.listdir(root))])  # part-10 before part-2
    cache = tmp_path / "cache"
    ds = ParquetDataset(str(root), batch_size=100, cache=True, cache_dir=str(cache), prefetch=1)
    it = iter(ds)
    next(it)
    it.close()  # fills ahead still running complete into the cache; those not started never start
    again = ParquetDataset(str(root), batch_size=100, cache=True, cache_dir=str(cache))
    np.testing.assert_array_equal(np.concatenate([b["x"].numpy() for b in again]), want.column("x").to_numpy())


@pytest.mark.parametrize("native", [True, False], ids=["native", "python-file"])
def test_a_stream_opens_each_file_once_whatever_the_threads_decoding_it_and_closes_them_all(tmp_path, monkeypatch,
                                                                                           native):
    """Every open on a mount waits (20 ms on the benchmark's FUSE mount): a stream opens each file once and its
    decode threads read that one native file at offsets (30 files took 233 opens, one per row group, when each
    thread opened its own). A file read through Python (a remote volume) serves one read at a time: each thread
    has its own there. Either way every row is pyarrow's and nothing stays open after the epoch."""
    root = _table(tmp_path, files=3, rows=1200, group=100)
    want = pa.concat_tables([pq.read_table(root / f"part-{k}.parquet") for k in range(3)]).column("id").to_numpy()
    opened: list = []
    real = TableFiles.open_arrow

    def spy(self, path, size=None):
        f = real(self, path, size) if native else self.open(path, size)
        opened.append((path, f))
        return f
    monkeypatch.setattr(TableFiles, "open_arrow", spy)
    got = np.concatenate([b["id"].numpy() for b in ParquetDataset(str(root), batch_size=64, prefetch=8)])
    np.testing.assert_array_equal(got, want)
    paths = [p for p, _ in opened]
    if native:
        assert sorted(paths) == sorted(str(root / f"part-{k}.parquet") for k in range(3))
        assert all(isinstance(f, pa.OSFile) for _, f in opened) or not os.path.isdir("/proc/self/fd")
    else:
        assert set(paths) == {str(root / f"part-{k}.parquet") for k in range(3)}
    assert all(f.closed for _, f in opened)


def test_a_dataset_received_pickled_reads_each_footer_from_the_file_it_opens(tmp_path, monkeypatch):
    """A DataLoader worker gets the dataset pickled, without the footers: it reads each from the one file it
    opens for decoding, not through a second open (each open on a mount waits)."""
    import pickle

    root = _table(tmp_path, files=3, rows=600, group=100)
    want = pa.concat_tables([pq.read_table(root / f"part-{k}.parquet") for k in range(3)]).column("id").to_numpy()
    ds = pickle.loads(pickle.dumps(ParquetDataset(str(root), batch_size=64)))
    opens: list[str] = []
    checked: list[str] = []
    real, real_checked = TableFiles.open_arrow, TableFiles.open

    def spy(self, path, size=None):
        opens.append(path)
        return real(self, path, size)

    def spy_checked(self, path, size=None):
        checked.append(path)
        return real_checked(self, path, size)
    monkeypatch.setattr(TableFiles, "open_arrow", spy)
    monkeypatch.setattr(TableFiles, "open", spy_checked)
    np.testing.assert_array_equal(np.concatenate([b["id"].numpy() for b in ds]), want)
    assert sorted(opens) == sorted(str(root / f"part-{k}.parquet") for k in range(3))
    if os.path.isdir("/proc/self/fd"):  # the native open by name is the checked file: no second open
        assert checked == []


def test_a_native_open_by_name_is_kept_only_where_a_checked_open_gives_the_same_file(tmp_path):
    """The decoder opens a table file once, by name, and keeps that descriptor only where ucmagic's checked
    open would have opened the same file under the volume's ``follow_symlinks``: a link inside the table
    under "inside", no link at all under "none"; anything else is reopened the checked way (and refused)."""
    from ucmagic.files.local_files import opened_beneath

    root = os.path.realpath(_table(tmp_path, files=1))
    os.symlink("part-0.parquet", os.path.join(root, "inside-link.parquet"))
    outside = tmp_path / "outside.parquet"
    pq.write_table(pa.table({"secret": [1]}), outside)
    os.symlink(outside, os.path.join(root, "outside-link.parquet"))
    cases = {"part-0.parquet": {"none": True, "inside": True, "all": True},
             "inside-link.parquet": {"none": False, "inside": True, "all": True},
             "outside-link.parquet": {"none": False, "inside": False, "all": True}}
    for rel, want in cases.items():
        fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        try:
            got = {policy: opened_beneath(fd, root, rel, policy) for policy in want}
        finally:
            os.close(fd)
        if os.path.isdir("/proc/self/fd"):
            assert got == want, rel
        else:  # no descriptor paths: only "all" keeps a native open
            assert got == {"none": False, "inside": False, "all": True}, rel


def test_a_link_inside_the_table_is_read_natively_and_a_link_out_is_refused_under_every_policy(tmp_path):
    root = _table(tmp_path, files=1)
    os.symlink("part-0.parquet", root / "inside-link.parquet")
    want = pq.read_table(root / "part-0.parquet")
    io = TableFiles(str(root))
    f = io.open_arrow(str(root / "inside-link.parquet"))
    try:
        if os.path.isdir("/proc/self/fd"):
            assert isinstance(f, pa.OSFile)
        assert pq.ParquetFile(f).read().equals(want)
    finally:
        f.close()
    io._volume(str(root)).follow_symlinks = "none"
    with pytest.raises(UnsafeSourceError):
        io.open_arrow(str(root / "inside-link.parquet"))


def test_a_volume_that_opens_its_own_way_is_read_through_its_own_open(tmp_path):
    """A ``LocalVolume`` subclass with its own ``open_local`` (faults, auditing) is not bypassed by the native
    open by name: the decoder reads what its ``open_local`` opened."""
    from ucmagic.files.volume_local import LocalVolume

    class Audited(LocalVolume):
        opened: list[str] = []

        def open_local(self, rel):
            Audited.opened.append(rel)
            return super().open_local(rel)

    root = _table(tmp_path, files=1)
    io = TableFiles(str(root))
    io._vols[str(root)] = Audited(str(root))
    assert not io._vols[str(root)].checks_native_opens
    f = io.open_arrow(str(root / "part-0.parquet"))
    try:
        assert pq.ParquetFile(f).read().equals(pq.read_table(root / "part-0.parquet"))
    finally:
        f.close()
    assert Audited.opened == ["part-0.parquet"]
