"""pack(): small files or a table into WebDataset tar shards that `webdataset` and `tar` read unchanged,
whole or absent, resumable after a kill; the CLI and the notebook command that run it."""
from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ucmagic
from ucmagic.errors import EmptyListingError, FetchError, PackError
from ucmagic.shards import read_index
from ucmagic.shards.pack import (RECORD, STATE_NAME, PlannedMember, group_files, header_size, plan_boundaries,
                                 plan_shards, tar_header, tar_size)
from ucmagic.files.volume import FileEntry
from waits import wait_until

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLASSES = ("cat", "dog", "eel")


def make_tree(root, per_class=20, size=700):
    """<class>/<n>.jpg + <n>.json per sample, of varied sizes, plus a README the pack leaves out."""
    files = {}
    for c in CLASSES:
        for i in range(per_class):
            files[f"{c}/{i:04d}.jpg"] = bytes([(i * 7 + len(c)) % 256]) * (size + 13 * i)
            files[f"{c}/{i:04d}.json"] = json.dumps({"i": i, "c": c}).encode()
    files["README"] = b"not a sample"
    for rel, data in files.items():
        p = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
    return files


def snapshot(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            st_ = os.stat(p)
            out[os.path.relpath(p, root)] = (open(p, "rb").read(), st_.st_mtime_ns)
    return out


def shard_paths(dest):
    return [os.path.join(dest, s.name) for s in read_index(dest)]


def shard_bytes(dest):
    return {os.path.basename(p): open(p, "rb").read() for p in shard_paths(dest)}


def webdataset_samples(dest):
    wds = pytest.importorskip("webdataset")
    ds = wds.WebDataset(shard_paths(dest), shardshuffle=False)
    return [{k: v for k, v in s.items() if not k.startswith("__") or k == "__key__"} for s in ds]


@pytest.fixture
def src(tmp_path):
    root = str(tmp_path / "src")
    files = make_tree(root)
    return root, files


# ---------------------------------------------------------------- the plan (pure)

@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 5000).map(lambda n: n * 512), max_size=60), st.integers(RECORD, 40_000))
def test_plan_cuts_samples_in_order_into_shards_within_the_size_unless_one_sample_is_bigger(spans, target):
    cuts = plan_boundaries(spans, target)
    assert [i for a, b in cuts for i in range(a, b)] == list(range(len(spans)))  # all, in order, once
    assert all(b > a for a, b in cuts)
    for a, b in cuts:
        assert tar_size(spans[a:b]) <= target or b - a == 1  # only a lone oversized sample exceeds it
        if b < len(spans):
            assert tar_size(spans[a:b + 1]) > target  # greedy: the next sample did not fit
    assert plan_boundaries(spans, target) == cuts


@settings(max_examples=100, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0/"), min_size=1, max_size=150),
       st.integers(0, 20 * 2**30))
def test_header_size_is_the_size_of_the_header_tarfile_writes(stem, size):
    name = f"d/{stem}.bin"
    assert header_size(name, size) == len(tar_header(name, size)) and header_size(name, size) % 512 == 0


def test_samples_are_grouped_by_key_sorted_and_labelled_by_top_folder():
    entries = [FileEntry(p, 10, 1.0) for p in
               ("dog/b/0001.jpg", "cat/0002.json", "cat/0002.jpg", "dog/b/0001.seg.png", "cat/.hidden.jpg", "LICENSE")]
    tree = group_files(entries, label_from_folder=True)
    assert tree.classes == ["cat", "dog"]
    assert [[m.name for m in s] for s in tree.samples] == [
        ["cat/0002.jpg", "cat/0002.json", "cat/0002.cls"], ["dog/b/0001.jpg", "dog/b/0001.seg.png", "dog/b/0001.cls"]]
    assert [s[-1].data for s in tree.samples] == [b"0", b"1"]
    assert tree.skipped == ["LICENSE", "cat/.hidden.jpg"]
    with pytest.raises(PackError, match="no class folder"):
        group_files([FileEntry("0001.jpg", 1, 0.0)], label_from_folder=True)


def test_plan_shards_gives_the_same_plan_for_the_same_listing():
    samples = [[PlannedMember.make(f"k{i:03d}.bin", 100 + i, src=f"k{i:03d}.bin", mtime=5.0)] for i in range(50)]
    a, b = plan_shards(samples, 4 * RECORD), plan_shards(list(samples), 4 * RECORD)
    assert [(s.name, s.size, s.digest) for s in a] == [(s.name, s.size, s.digest) for s in b]
    assert len(a) > 1 and all(s.size % RECORD == 0 for s in a)


# ---------------------------------------------------------------- packing a tree of files

def test_packed_tree_reads_back_exactly_with_webdataset_tar_and_the_index(src, tmp_path):
    root, files = src
    before = snapshot(root)
    dest = str(tmp_path / "shards")
    res = ucmagic.pack(root, dest, shard_size="20KB", label_from_folder=True, progress=False)
    assert snapshot(root) == before  # the source is never written
    assert res.samples == 60 and res.files == 180 and res.shards == len(read_index(dest)) > 2
    assert res.skipped == ["README"] and res.classes == list(CLASSES) and res.kept == 0
    assert "60 samples" in str(res) and "MB/s" in str(res)
    got = webdataset_samples(dest)
    assert [s["__key__"] for s in got] == sorted({r.rsplit(".", 1)[0] for r in files if r != "README"})
    for s in got:
        assert s["jpg"] == files[s["__key__"] + ".jpg"] and s["json"] == files[s["__key__"] + ".json"]
        assert int(s["cls"]) == CLASSES.index(s["__key__"].split("/")[0])
    listed = []
    for p in shard_paths(dest):
        out = subprocess.run(["tar", "-tf", p], capture_output=True, text=True, timeout=30, check=True)
        assert not out.stderr
        listed += out.stdout.split()
    assert listed == [f"{s['__key__']}.{e}" for s in got for e in ("jpg", "json", "cls")]
    doc = json.load(open(os.path.join(dest, "index.json")))
    assert doc["classes"] == list(CLASSES)
    ds = ucmagic.TarShards(dest, cache_dir=str(tmp_path / "cache"))  # the read side: the index, no header scan
    assert [{k: v for k, v in ds[i].items() if k != "__url__"} for i in range(len(ds))] == got
    for info in read_index(dest):  # every member's data offset is exact
        data = open(os.path.join(dest, info.name), "rb").read()
        assert len(data) == info.size and info.size <= 20_000
        with tarfile.open(fileobj=io.BytesIO(data)) as tf:
            assert [(m.name, m.offset_data, m.size) for m in tf.getmembers()] == [
                (f"{m.key}.{m.ext}", m.offset, m.size) for m in info.members]


def test_a_sample_bigger_than_the_shard_size_gets_a_shard_of_its_own(tmp_path):
    root = tmp_path / "src"
    root.mkdir()
    (root / "a.bin").write_bytes(b"a" * 100)
    (root / "b.bin").write_bytes(b"b" * 50_000)
    (root / "c.bin").write_bytes(b"c" * 100)
    dest = str(tmp_path / "d")
    ucmagic.pack(str(root), dest, shard_size=RECORD, progress=False)
    assert [[m.key for m in s.members] for s in read_index(dest)] == [["a"], ["b"], ["c"]]
    assert [s["bin"] for s in webdataset_samples(dest)] == [b"a" * 100, b"b" * 50_000, b"c" * 100]


def test_long_and_unicode_names_and_members_bigger_than_a_read_chunk_read_back_exactly(tmp_path):
    from ucmagic.shards.pack import READ_CHUNK

    root = tmp_path / "src"
    deep = root / ("d" * 60) / ("e" * 60)
    deep.mkdir(parents=True)
    (root / "名前").mkdir()
    files = {f"{'d' * 60}/{'e' * 60}/{'x' * 40}.bin": os.urandom(3000),   # > 100 bytes: a pax header
             "名前/画像.bin": b"unicode",
             "big.bin": os.urandom(2 * READ_CHUNK + 123)}                  # copied in three reads
    for rel, data in files.items():
        (root / rel).write_bytes(data)
    dest = str(tmp_path / "d")
    ucmagic.pack(str(root), dest, shard_size="1MB", workers=3, progress=False)
    got = {s["__key__"] + ".bin": s["bin"] for s in webdataset_samples(dest)}
    assert got == files
    listed = []
    for p in shard_paths(dest):
        listed += subprocess.run(["tar", "-tf", p], capture_output=True, timeout=30, check=True).stdout.decode().split()
    assert sorted(listed) == sorted(files)


class _AppendOnly:
    """A file that accepts only writes at its end (as a /Volumes FUSE mount does): no seek, no truncate."""

    def __init__(self, f):
        self.f = f

    def write(self, data):
        return self.f.write(data)

    def flush(self):
        self.f.flush()

    def fileno(self):
        return self.f.fileno()

    def close(self):
        self.f.close()

    def seek(self, *a):
        raise OSError("random writes are not supported here")

    truncate = seek


def test_shards_are_written_front_to_back_for_volumes_that_take_only_sequential_writes(src, tmp_path, monkeypatch):
    import builtins

    import ucmagic.shards.pack_state as P  # noqa: N812 - where shard files are opened

    root, _ = src
    ref = str(tmp_path / "ref")
    ucmagic.pack(root, ref, shard_size="20KB", progress=False)
    ucmagic.pack(_frame(), str(tmp_path / "tref"), shard_size="12KB", progress=False)
    opened = []

    def append_only(path, mode="r", *a, **kw):
        f = builtins.open(path, mode, *a, **kw)
        if "w" in mode or "a" in mode or "+" in mode:
            opened.append(path)
            return _AppendOnly(f)
        return f

    monkeypatch.setattr(P, "open", append_only, raising=False)
    monkeypatch.setattr(P.os, "pwrite", None)
    monkeypatch.setattr(P.os, "pwritev", None)
    monkeypatch.setattr(P.os, "ftruncate", None)
    dest = str(tmp_path / "dest")
    ucmagic.pack(root, dest, shard_size="20KB", workers=8, progress=False)
    ucmagic.pack(_frame(), str(tmp_path / "t"), shard_size="12KB", progress=False)
    monkeypatch.undo()
    assert len(opened) >= len(read_index(dest)) + len(read_index(str(tmp_path / "t")))
    assert shard_bytes(dest) == shard_bytes(ref)
    assert shard_bytes(str(tmp_path / "t")) == shard_bytes(str(tmp_path / "tref"))


@pytest.mark.parametrize("table", [False, True])
def test_a_full_disk_stops_the_pack_with_what_to_do_and_a_rerun_completes_it(src, tmp_path, monkeypatch, table):
    import builtins
    import errno

    import ucmagic.shards.pack_state as P  # noqa: N812 - where shard files are opened

    root, _ = src
    source, size = (_frame(), "12KB") if table else (root, "20KB")
    ref = str(tmp_path / "ref")
    ucmagic.pack(source, ref, shard_size=size, progress=False)
    budget = [3 * 20_000]  # bytes the "disk" takes before it is full

    class Full(_AppendOnly):
        def write(self, data):
            budget[0] -= len(data)
            if budget[0] < 0:
                raise OSError(errno.ENOSPC, "No space left on device")
            return self.f.write(data)

    monkeypatch.setattr(P, "open", lambda path, mode="r", *a, **kw: Full(builtins.open(path, mode, *a, **kw)),
                        raising=False)
    dest = str(tmp_path / "dest")
    with pytest.raises(OSError, match="no space left on the destination .*run pack again") as e:
        ucmagic.pack(source, dest, shard_size=size, workers=2, progress=False)
    assert e.value.errno == errno.ENOSPC
    monkeypatch.undo()
    names = os.listdir(dest)
    assert "index.json" not in names and not [n for n in names if n.endswith(".tmp")]
    res = ucmagic.pack(source, dest, shard_size=size, progress=False)
    assert res.kept >= 1 and shard_bytes(dest) == shard_bytes(ref)


def test_slow_volume_and_volumes_paths_pack_like_a_local_directory(src, tmp_path, monkeypatch):
    root, _ = src
    local = str(tmp_path / "local")
    ucmagic.pack(root, local, shard_size="30KB", progress=False)
    slow = str(tmp_path / "slow")
    ucmagic.pack("slow://" + root, slow, shard_size="30KB", workers=8, progress=False,
                 storage_options={"open_ms": 1, "mbps": 0, "list_ms": 0})
    assert shard_bytes(slow) == shard_bytes(local)
    vol = tmp_path / "catalog" / "main" / "default" / "volumes" / "imgs"
    vol.parent.mkdir(parents=True)
    os.symlink(root, vol)
    monkeypatch.setenv("UCMAGIC_CATALOG_ROOT", str(tmp_path / "catalog"))
    out = str(tmp_path / "catalog" / "main" / "default" / "volumes" / "shards")
    res = ucmagic.pack("/Volumes/main/default/imgs", "/Volumes/main/default/shards", shard_size="30KB",
                       progress=False)
    assert res.dest == out and shard_bytes(out) == shard_bytes(local)


@pytest.mark.timeout(300)
def test_a_volume_failing_every_7th_open_packs_every_file_with_default_retries_counted(tmp_path):
    from ucmagic.testing import make_files

    root = str(tmp_path / "src")
    rels = make_files(root, 700, 2048, ext=".jpg")
    dest = str(tmp_path / "dest")
    res = ucmagic.pack("slow://" + root, dest, shard_size="256KB", progress=False,  # default retries, 256 reads
                       storage_options={"fail_every": 7, "open_ms": 0, "mbps": 0, "list_ms": 0})
    assert res.samples == len(rels) and res.retries >= len(rels) // 7 - 1 and "reads retried" in str(res)
    got = {}
    for path in shard_paths(dest):
        with tarfile.open(path) as tf:
            got.update({m.name: tf.extractfile(m).read() for m in tf if m.isfile()})
    assert got == {r: open(os.path.join(root, r), "rb").read() for r in rels}


def test_pack_progress_counts_source_files_not_tar_members(src, tmp_path, monkeypatch):
    import ucmagic.shards.pack as pack_mod

    seen = []

    class Recorded(pack_mod.Progress):
        def close(self, *a, **kw):
            seen.append((self.total, self.done))
            return super().close(*a, **kw)

    monkeypatch.setattr(pack_mod, "Progress", Recorded)
    root, files = src
    res = ucmagic.pack(root, str(tmp_path / "d"), shard_size="20KB", label_from_folder=True, progress=False)
    sources = len(files) - 1  # every file but the README; the cls labels are tar members, not source files
    assert res.files == sources + res.samples and seen == [(sources, sources)]


def test_bad_input_is_refused_with_what_to_do(src, tmp_path):
    root, _ = src
    with pytest.raises(PackError, match="inside the source"):
        ucmagic.pack(root, os.path.join(root, "shards"), progress=False)
    with pytest.raises(PackError, match="inside the source"):
        ucmagic.pack(root, root, progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(EmptyListingError):
        ucmagic.pack(str(empty), str(tmp_path / "d1"), progress=False)
    (empty / "LICENSE").write_text("x")
    with pytest.raises(PackError, match="lacks an extension"):
        ucmagic.pack(str(empty), str(tmp_path / "d2"), progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(PackError, match="not empty"):
        ucmagic.pack(root, str(other), progress=False)
    assert os.listdir(other) == ["notes.txt"]
    with pytest.raises(PackError, match="shard_size"):
        ucmagic.pack(root, str(tmp_path / "d3"), shard_size=100, progress=False)
    with pytest.raises(PackError, match="URL"):
        ucmagic.pack(root, "s3://bucket/shards", progress=False)
    with pytest.raises(PackError, match="table"):
        ucmagic.pack(root, str(tmp_path / "d4"), columns=["image"], progress=False)


# ---------------------------------------------------------------- whole or absent; resume

@pytest.mark.parametrize("workers", [1, 8])
def test_a_failing_read_stops_the_pack_leaving_only_whole_shards_and_a_rerun_completes_it(src, tmp_path, workers,
                                                                                          monkeypatch):
    import errno

    from ucmagic.files.volume import LocalVolume

    root, _ = src
    ref = str(tmp_path / "ref")
    ucmagic.pack(root, ref, shard_size="20KB", progress=False)
    dest = str(tmp_path / "dest")
    real = LocalVolume.range_reader

    def failing(self, rel):
        if rel == "eel/0019.jpg":  # in the last shard: the earlier ones are complete when it is read
            raise OSError(errno.EIO, "injected I/O error")
        return real(self, rel)

    monkeypatch.setattr(LocalVolume, "range_reader", failing)
    with pytest.raises(FetchError, match="eel/0019.jpg.*injected"):
        ucmagic.pack(root, dest, shard_size="20KB", workers=workers, retries=1, progress=False)
    monkeypatch.undo()
    names = os.listdir(dest)
    assert "index.json" not in names and not [n for n in names if n.endswith(".tmp")]
    whole = [n for n in names if n.endswith(".tar")]
    assert whole, "shards finished before the failure are kept"
    for n in whole:
        assert open(os.path.join(dest, n), "rb").read() == open(os.path.join(ref, n), "rb").read()
    res = ucmagic.pack(root, dest, shard_size="20KB", progress=False)
    assert res.kept == len(whole) and res.written == res.shards - len(whole)
    assert shard_bytes(dest) == shard_bytes(ref)


# A pack that stops half-way on any machine: the last class's files wait in their open for Ctrl-C (or
# forever: the kill), so the shards of the first two complete and the pack never ends by itself.
_KILLED_PACK = """
import signal, sys, threading, ucmagic
from ucmagic.testing import SlowFileSystem
interrupted = threading.Event()
def on_int(sig, frame):
    interrupted.set()
    raise KeyboardInterrupt
signal.signal(signal.SIGINT, on_int)
opened = SlowFileSystem._open
def held_open(self, path, *args, **kw):
    if "/eel/" in path:
        interrupted.wait(600)
    return opened(self, path, *args, **kw)
SlowFileSystem._open = held_open
ucmagic.pack("slow://" + sys.argv[1], sys.argv[2], shard_size="20KB", workers=2, progress=False,
             storage_options={"open_ms": 15, "mbps": 0, "list_ms": 0})
"""


def test_a_killed_pack_resumes_where_it_stopped_and_ends_as_a_fresh_pack_would(src, tmp_path):
    root, _ = src
    ref = str(tmp_path / "ref")
    ucmagic.pack(root, ref, shard_size="20KB", progress=False)
    dest = str(tmp_path / "dest")
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_PACK, root, dest], env=env)
    try:
        _wait_for_shards(dest, 2, proc)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    names = os.listdir(dest)
    assert "index.json" not in names, "killed before the end: no index yet"
    done = [n for n in names if n.endswith(".tar")]
    assert len(done) >= 2
    res = ucmagic.pack(root, dest, shard_size="20KB", progress=False)
    assert res.kept >= 2 and res.kept + res.written == res.shards
    assert shard_bytes(dest) == shard_bytes(ref)
    assert not [n for n in os.listdir(dest) if n.endswith(".tmp")]  # the killed run's temp file is gone
    again = ucmagic.pack(root, dest, shard_size="20KB", progress=False)
    assert again.written == 0 and again.kept == again.shards


_PACK_ONCE = """
import json, sys, ucmagic
r = ucmagic.pack("slow://" + sys.argv[1], sys.argv[2], shard_size="20KB", workers=4, progress=False,
                 storage_options={"open_ms": 3, "mbps": 0, "list_ms": 0})
print(json.dumps({"written": r.written, "kept": r.kept, "shards": r.shards}))
"""


def test_two_processes_packing_into_one_destination_write_each_shard_once(src, tmp_path):
    root, _ = src
    ref = str(tmp_path / "ref")
    ucmagic.pack(root, ref, shard_size="20KB", progress=False)
    dest = str(tmp_path / "dest")
    env = {**os.environ, "PYTHONPATH": ROOT}
    procs = [subprocess.Popen([sys.executable, "-c", _PACK_ONCE, root, dest], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    shards = outs[0]["shards"]
    assert sorted(o["written"] for o in outs) == [0, shards]  # the second waited, then found them all
    assert shard_bytes(dest) == shard_bytes(ref)


def test_temp_files_of_dead_runs_are_swept_and_those_of_a_running_one_kept(src, tmp_path):
    root, _ = src
    dest = tmp_path / "dest"
    dest.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          timeout=30).stdout.strip()
    stale = [f".ucpack-{dead}-shard-000001.tar.tmp", f"index.json.tmp-{dead}-0", f"{STATE_NAME}.tmp-{dead}-3"]
    live = f".ucpack-{os.getppid()}-shard-000002.tar.tmp"
    for n in [*stale, live]:
        (dest / n).write_bytes(b"partial")
    ucmagic.pack(root, str(dest), shard_size="20KB", progress=False)
    left = set(os.listdir(dest))
    assert not left & set(stale) and live in left


def _wait_for_shards(dest, n, proc):
    def done() -> bool:
        try:
            with open(os.path.join(dest, STATE_NAME)) as f:
                return len(json.load(f)["shards"]) >= n
        except (OSError, ValueError, KeyError):
            return False

    wait_until(done, f"{n} shards complete", alive=lambda: proc.poll() is None)


def test_ctrl_c_stops_a_pack_promptly_removing_its_temp_files(src, tmp_path):
    root, _ = src
    dest = str(tmp_path / "dest")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_PACK, root, dest], env={**os.environ, "PYTHONPATH": ROOT},
                            stderr=subprocess.PIPE, text=True)
    _wait_for_shards(dest, 1, proc)
    proc.send_signal(signal.SIGINT)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    names = os.listdir(dest)
    assert not [n for n in names if n.endswith(".tmp")] and "index.json" not in names
    res = ucmagic.pack(root, dest, shard_size="20KB", progress=False)
    assert res.kept >= 1 and len(webdataset_samples(dest)) == 60


def test_a_changed_source_rewrites_the_shards_it_touches_and_drops_extra_ones(src, tmp_path):
    root, _ = src
    dest = str(tmp_path / "dest")
    first = ucmagic.pack(root, dest, shard_size="20KB", progress=False)
    with open(os.path.join(root, "dog", "0005.jpg"), "wb") as f:
        f.write(b"changed")
    os.unlink(os.path.join(root, "eel", "0019.jpg"))
    os.unlink(os.path.join(root, "eel", "0019.json"))
    res = ucmagic.pack(root, dest, shard_size="20KB", progress=False)
    assert 0 < res.kept < first.shards and res.written > 0
    ref = str(tmp_path / "ref")
    ucmagic.pack(root, ref, shard_size="20KB", progress=False)
    assert shard_bytes(dest) == shard_bytes(ref)
    assert sorted(n for n in os.listdir(dest) if n.endswith(".tar")) == sorted(shard_bytes(ref))


# ---------------------------------------------------------------- tables

def _frame(n=40, changed=None):
    pd = pytest.importorskip("pandas")
    rows = [{"image": bytes([i % 256]) * (300 + 11 * i), "label": i % 4, "caption": f"row {i}"} for i in range(n)]
    if changed is not None:
        rows[changed]["image"] = b"changed"
    return pd.DataFrame(rows)


def test_a_table_packs_a_member_per_column_readable_by_webdataset(tmp_path):
    df = _frame()
    dest = str(tmp_path / "t")
    res = ucmagic.pack(df, dest, shard_size="12KB", columns={"image": "jpg", "label": "cls", "caption": "txt"},
                       progress=False)
    assert res.samples == 40 and res.shards > 2
    got = webdataset_samples(dest)
    assert [s["__key__"] for s in got] == [f"{i:09d}" for i in range(40)]
    for i, s in enumerate(got):
        assert s["jpg"] == df["image"][i] and int(s["cls"]) == i % 4 and s["txt"] == f"row {i}".encode()
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    path = str(tmp_path / "table.parquet")
    df2 = df.assign(id=[f"id{i:03d}" for i in range(40)])
    pq.write_table(pa.Table.from_pandas(df2, preserve_index=False), path, row_group_size=7)
    dest2 = str(tmp_path / "t2")
    ucmagic.pack(path, dest2, shard_size="12KB", columns=["image", "label"], key_column="id", progress=False)
    got2 = webdataset_samples(dest2)
    assert [s["__key__"] for s in got2] == list(df2["id"])
    assert all(set(s) == {"__key__", "image", "label"} for s in got2)
    with pytest.raises(PackError, match="twice"):
        ucmagic.pack(df2.assign(id="same"), str(tmp_path / "t3"), key_column="id", progress=False)
    with pytest.raises(PackError, match="WebDataset key"):
        ucmagic.pack(df2.assign(id=[f"a/b.{i}" for i in range(40)]), str(tmp_path / "t4"), key_column="id",
                     progress=False)
    with pytest.raises(PackError, match="one extension"):
        ucmagic.pack(df, str(tmp_path / "t5"), columns={"image": "bin", "caption": "bin"}, progress=False)


def test_a_delta_table_and_a_pyarrow_table_pack_like_the_dataframe(tmp_path):
    deltalake = pytest.importorskip("deltalake")
    import pyarrow as pa

    df = _frame()
    ref = str(tmp_path / "ref")
    ucmagic.pack(df, ref, shard_size="12KB", progress=False)
    delta = str(tmp_path / "delta")
    deltalake.write_deltalake(delta, pa.Table.from_pandas(df, preserve_index=False))
    out = str(tmp_path / "from_delta")
    ucmagic.pack(delta, out, shard_size="12KB", progress=False)
    assert shard_bytes(out) == shard_bytes(ref)
    out2 = str(tmp_path / "from_arrow")
    ucmagic.pack(pa.Table.from_pandas(df, preserve_index=False), out2, shard_size="12KB", progress=False)
    assert shard_bytes(out2) == shard_bytes(ref)


def test_a_table_pack_resumes_and_a_changed_row_rewrites_from_its_shard(tmp_path):
    dest = str(tmp_path / "t")
    first = ucmagic.pack(_frame(), dest, shard_size="12KB", progress=False)
    last = sorted(n for n in os.listdir(dest) if n.endswith(".tar"))[-1]
    os.unlink(os.path.join(dest, last))
    res = ucmagic.pack(_frame(), dest, shard_size="12KB", progress=False)
    assert res.kept == first.shards - 1 and res.written == 1
    changed = ucmagic.pack(_frame(changed=30), dest, shard_size="12KB", progress=False)
    ref = str(tmp_path / "ref")
    ucmagic.pack(_frame(changed=30), ref, shard_size="12KB", progress=False)
    assert shard_bytes(dest) == shard_bytes(ref)
    assert 0 < changed.kept < changed.shards


# ---------------------------------------------------------------- command line and notebook

def test_cli_pack_writes_shards_and_prints_the_summary(src, tmp_path, capsys):
    from ucmagic.__main__ import main

    root, _ = src
    dest = str(tmp_path / "cli")
    assert main(["pack", root, dest, "--shard-size", "20KB", "--label-from-folder", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "packed 60 samples" in out and "3 classes" in out
    assert [s["cls"] for s in webdataset_samples(dest)][:1] == [b"0"]
    assert main(["pack", root, os.path.join(root, "x"), "--no-progress"]) == 1
    assert "inside the source" in capsys.readouterr().err


def test_ucstage_pack_packs_from_a_notebook(magic_shell, src, tmp_path):
    root, _ = src
    dest = str(tmp_path / "nb")
    res = magic_shell.run_line_magic("ucstage", f"{root} {dest} --pack --shard-size 20KB --label-from-folder")
    assert res.samples == 60 and res.classes == list(CLASSES)
    assert len(webdataset_samples(dest)) == 60
    magic_shell.user_ns["frame"] = _frame()
    table = str(tmp_path / "nb_table")
    magic_shell.run_line_magic("ucstage", f"--pack frame {table} --columns image=jpg,label=cls --shard-size 12KB")
    assert [int(s["cls"]) for s in webdataset_samples(table)] == [i % 4 for i in range(40)]
    del magic_shell.user_ns["frame"]
    from ucmagic.errors import MagicUsageError

    with pytest.raises(MagicUsageError, match="--export"):
        magic_shell.run_line_magic("ucstage", f"{root} {dest} --pack --export")
