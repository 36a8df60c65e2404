"""The backend seam: the Volume write side on local directories, local files behind fsspec (the simulator),
memory:// and a real S3 server (moto on loopback), its atomicity, and the registry of backends."""
from __future__ import annotations

import os
import time

import pytest

from ucmagic.files import local_files
from ucmagic.files import volume as volume_mod
from ucmagic.files.volume import FsspecVolume, LocalVolume, Volume


# s3_endpoint: the session's moto S3 server on loopback (tests/conftest.py; skipped without s3fs or moto).
_bucket_n = iter(range(10**6))


def _s3_volume(endpoint: str) -> FsspecVolume:
    import s3fs

    opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
    bucket = f"ckpt-bucket-{os.getpid()}-{next(_bucket_n)}"
    s3fs.S3FileSystem(**opts).mkdir(bucket)
    return FsspecVolume(f"s3://{bucket}/ckpts", opts)


@pytest.fixture(params=["local", "slow", "memory", "s3"])
def wvol(request, tmp_path, monkeypatch):
    """An empty writable volume of each kind; its root need not exist yet on object stores."""
    if request.param in ("local", "slow"):
        (tmp_path / "root").mkdir()
        yield (LocalVolume(str(tmp_path / "root")) if request.param == "local" else
               FsspecVolume(f"slow://{tmp_path / 'root'}", {"open_ms": 0, "list_ms": 0, "mbps": 1e6}))
    elif request.param == "memory":
        vol = FsspecVolume(f"memory://ucmagic-backends-{os.getpid()}-{next(_bucket_n)}")
        yield vol
        if vol.fs.exists(vol.root):
            vol.fs.rm(vol.root, recursive=True)
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
        yield _s3_volume(endpoint)


def test_written_bytes_read_back_whole_and_replace_the_old_content(wvol):
    wvol.makedirs("step-1")
    wvol.write_bytes("step-1/shard.bin", b"first")
    wvol.write_bytes("step-1/shard.bin", b"second version")
    assert wvol.read_bytes("step-1/shard.bin") == b"second version"
    assert wvol.exists("step-1/shard.bin") and wvol.exists("step-1")
    assert not wvol.exists("step-1/other.bin")
    assert wvol.list_names("step-1") == ["shard.bin"]  # no temp file left beside it
    assert wvol.stat("step-1/shard.bin").size == len(b"second version")


def test_an_uploaded_local_file_arrives_byte_for_byte(wvol, tmp_path):
    src = tmp_path / "model.pt"
    data = os.urandom(3 << 20) + b"tail"
    src.write_bytes(data)
    wvol.upload(str(src), "run/model.pt")
    assert wvol.read_bytes("run/model.pt") == data
    assert src.read_bytes() == data  # the source stays


def test_list_names_gives_files_and_folders_directly_under_and_nothing_for_a_missing_one(wvol):
    for rel in ("a/x.bin", "a/y.bin", "a/sub/z.bin", "b.bin"):
        wvol.write_bytes(rel, rel.encode())
    assert wvol.list_names("a") == ["sub", "x.bin", "y.bin"]
    assert wvol.list_names("") == ["a", "b.bin"]
    assert wvol.list_names("missing") == []
    assert wvol.list_names("b.bin") == []  # a file has nothing under it


def test_remove_deletes_a_file_and_refuses_a_missing_one_only_when_asked(wvol):
    wvol.write_bytes("f.bin", b"x")
    wvol.remove("f.bin")
    assert not wvol.exists("f.bin")
    wvol.remove("f.bin")  # missing_ok by default
    with pytest.raises(FileNotFoundError):
        wvol.remove("f.bin", missing_ok=False)


def test_remove_tree_deletes_everything_under_a_folder_and_accepts_a_missing_one(wvol):
    for rel in ("old/a.bin", "old/deep/b.bin", "keep.bin"):
        wvol.write_bytes(rel, b"data")
    wvol.remove_tree("old")
    assert not wvol.exists("old/a.bin") and not wvol.exists("old/deep/b.bin")
    assert wvol.list_names("") == ["keep.bin"]
    wvol.remove_tree("old")  # nothing there: fine


def test_rename_moves_a_file_over_an_existing_one(wvol):
    wvol.write_bytes("tmp/commit.json", b"new")
    wvol.write_bytes("commit.json", b"old")
    wvol.rename("tmp/commit.json", "commit.json")
    assert wvol.read_bytes("commit.json") == b"new"
    assert not wvol.exists("tmp/commit.json")
    assert type(wvol).atomic_rename in (True, False)
    assert wvol.atomic_rename is (wvol.local_root is not None)  # local files: os.replace; object stores: copy+delete


def test_write_paths_outside_the_root_are_refused(wvol):
    for bad in ("", "../x", "a/../../x", "/abs", "a//b"):
        with pytest.raises(ValueError, match="relative path"):
            wvol.write_bytes(bad, b"x")
    with pytest.raises(ValueError):
        wvol.remove_tree("")  # never the whole root


def test_a_url_rooted_volume_writes_under_its_root(tmp_path):
    root = tmp_path / "bucket"
    root.mkdir()
    vol = FsspecVolume(f"slow://{root}/ckpts", {"open_ms": 0, "list_ms": 0})
    vol.write_bytes("step/x.bin", b"abc")
    assert (root / "ckpts" / "step" / "x.bin").read_bytes() == b"abc"


class _CopyInterruptedError(Exception):
    pass


@pytest.mark.parametrize("kind", ["local", "slow"])
def test_a_failed_upload_leaves_nothing_at_the_destination_nor_beside_it(tmp_path, monkeypatch, kind):
    root = tmp_path / "root"
    root.mkdir()
    vol: Volume = LocalVolume(str(root)) if kind == "local" else FsspecVolume(f"slow://{root}", {"open_ms": 0})
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(1 << 20))
    real_copy = local_files.copy_local

    def copy_half_then_fail(a: str, b: str, **kw: object) -> tuple[int, int]:
        with open(a, "rb") as f, open(b, "wb") as g:
            g.write(f.read(1 << 19))  # half the bytes are on disk under the temp name
        raise _CopyInterruptedError("disk full")

    monkeypatch.setattr(local_files, "copy_local", copy_half_then_fail)
    with pytest.raises(_CopyInterruptedError):
        vol.upload(str(src), "ckpt/model.bin")
    assert not vol.exists("ckpt/model.bin")
    assert vol.list_names("ckpt") == []
    # an existing version stays whole when its replacement fails
    monkeypatch.setattr(local_files, "copy_local", real_copy)
    vol.upload(str(src), "ckpt/model.bin")
    monkeypatch.setattr(local_files, "copy_local", copy_half_then_fail)
    with pytest.raises(_CopyInterruptedError):
        vol.upload(str(tmp_path / "big.bin"), "ckpt/model.bin")
    assert vol.read_bytes("ckpt/model.bin") == src.read_bytes()
    assert vol.list_names("ckpt") == ["model.bin"]


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    vol = LocalVolume(str(tmp_path))

    def fsync_fails(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError, match="No space"):
        vol.write_bytes("commit.json", b"{}")
    monkeypatch.undo()
    assert vol.list_names("") == []


def test_a_failed_s3_upload_leaves_no_object(s3_endpoint, tmp_path, monkeypatch):
    import s3fs

    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    vol = _s3_volume(s3_endpoint)
    src = tmp_path / "shard.bin"
    src.write_bytes(os.urandom(1 << 20))
    real_open = open

    class _FailingRead:
        def __init__(self, path: str, mode: str = "r", *a: object, **kw: object) -> None:
            self.f = real_open(path, mode, *a, **kw)  # type: ignore[call-overload]

        def __getattr__(self, name: str) -> object:
            return getattr(self.f, name)

        def __enter__(self) -> "_FailingRead":
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

        def read(self, n: int = -1) -> bytes:
            self.f.read(1024)
            raise _CopyInterruptedError("connection reset while reading the source")

    monkeypatch.setattr(s3fs.core, "open", _FailingRead, raising=False)
    with pytest.raises(_CopyInterruptedError):
        vol.upload(str(src), "run/shard.bin")
    monkeypatch.undo()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    assert not vol.exists("run/shard.bin")
    assert vol.list_names("run") == []


# ---------------------------------------------------------------- the registry: a backend is one class

class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self.data = data

    def readinto_at(self, offset: int, buf: memoryview) -> int:
        got = self.data[offset:offset + len(buf)]
        buf[:len(got)] = got
        return len(got)

    def close(self) -> None:
        pass


_TOY_STORES: dict[str, dict[str, tuple[bytes, float]]] = {}


class ToyVolume(Volume):
    """A complete backend in one class: ``toy://<store>`` names a dict of ``rel -> (bytes, mtime)``."""

    def __init__(self, url: str, storage_options: dict | None = None) -> None:
        self.url = url
        self.name = url.split("://", 1)[1].strip("/")
        self.uri = f"toy://{self.name}"
        self.opened = 0

    @classmethod
    def from_path(cls, path: str, storage_options: dict | None = None) -> Volume:
        from ucmagic.errors import SourceNotFoundError

        vol = cls(path, storage_options)
        if vol.name not in _TOY_STORES:
            raise SourceNotFoundError(f"{path} does not exist")
        return vol

    @property
    def store(self) -> dict[str, tuple[bytes, float]]:
        return _TOY_STORES.setdefault(self.name, {})

    def list(self, pattern: str | None = None) -> list[volume_mod.FileEntry]:
        entries = [volume_mod.FileEntry(rel, len(data), mtime) for rel, (data, mtime) in self.store.items()]
        return self._check_listing(volume_mod.filter_entries(entries, pattern), pattern)

    def stat(self, rel: str) -> volume_mod.FileEntry:
        if rel not in self.store:
            raise FileNotFoundError(rel)
        data, mtime = self.store[rel]
        return volume_mod.FileEntry(rel, len(data), mtime)

    def copy_to(self, rel: str, dest: str, *, expect: volume_mod.FileEntry | None = None) -> int:
        self.opened += 1
        data = self.read_bytes(rel)
        with open(dest, "wb") as f:
            f.write(data)
        if expect is not None:
            volume_mod.check_unchanged(self, expect, self.stat(rel))
        return len(data)

    def range_reader(self, rel: str) -> _BytesReader:
        return _BytesReader(self.read_bytes(rel))

    def write_bytes(self, rel: str, data: bytes) -> None:
        self.store[rel] = (bytes(data), time.time())

    def upload(self, local_path: str, rel: str) -> None:
        with open(local_path, "rb") as f:
            self.write_bytes(rel, f.read())

    def read_bytes(self, rel: str) -> bytes:
        if rel not in self.store:
            raise FileNotFoundError(rel)
        return self.store[rel][0]

    def exists(self, rel: str) -> bool:
        return rel in self.store or any(k.startswith(rel + "/") for k in self.store)

    def makedirs(self, rel: str) -> None:
        pass

    def remove(self, rel: str, *, missing_ok: bool = True) -> None:
        if self.store.pop(rel, None) is None and not missing_ok:
            raise FileNotFoundError(rel)

    def remove_tree(self, rel: str) -> None:
        for k in [k for k in self.store if k == rel or k.startswith(rel + "/")]:
            del self.store[k]

    def rename(self, src_rel: str, dst_rel: str) -> None:
        self.store[dst_rel] = self.store.pop(src_rel)

    def list_names(self, rel: str) -> list[str]:
        prefix = rel + "/" if rel else ""
        return sorted({k[len(prefix):].split("/", 1)[0] for k in self.store if k.startswith(prefix)})


@pytest.fixture
def toy_store():
    """A registered toy:// backend holding 20 files; the registry is restored afterwards."""
    saved = list(volume_mod._backends)
    volume_mod.register_volume("toy", ToyVolume)
    name = f"store-{os.getpid()}-{next(_bucket_n)}"
    _TOY_STORES[name] = {f"d{i % 3}/f{i:02d}.bin": (f"toy file {i}".encode() * 50, 1e9 + i) for i in range(20)}
    yield name
    _TOY_STORES.pop(name, None)
    volume_mod._backends[:] = saved


def test_open_volume_builds_the_registered_backend_and_leaves_other_paths_to_the_built_ins(toy_store, tmp_path):
    from ucmagic.files.volume import open_volume

    assert type(open_volume(f"toy://{toy_store}")) is ToyVolume
    assert type(open_volume(str(tmp_path))) is LocalVolume
    assert type(open_volume("memory://")) is FsspecVolume


def test_a_registered_backend_feeds_ucvolumedataset_without_other_edits(toy_store):
    from ucmagic import UCVolumeDataset

    ds = UCVolumeDataset(f"toy://{toy_store}", pattern="d1/*.bin")
    assert isinstance(ds.volume, ToyVolume)
    got = sorted(open(p, "rb").read() for p in ds)
    assert got == sorted(f"toy file {i}".encode() * 50 for i in range(20) if i % 3 == 1)
    again = sorted(open(p, "rb").read() for p in ds)  # second epoch: from the local cache
    assert again == got


def test_a_registered_backend_is_staged_without_other_edits(toy_store, tmp_path):
    import ucmagic

    res = ucmagic.stage(f"toy://{toy_store}", tmp_path / "staged", progress=False, processes=1)
    assert res.ok and res.files == 20
    assert (tmp_path / "staged" / "d2" / "f05.bin").read_bytes() == b"toy file 5" * 50
    res = ucmagic.stage(f"toy://{toy_store}", tmp_path / "staged", progress=False, processes=1)
    assert res.skipped == 20 and res.files == 0  # staged copies carry the source's mtime


def test_a_later_registration_of_a_scheme_replaces_the_earlier_one(toy_store):
    class OtherToy(ToyVolume):
        pass

    volume_mod.register_volume("toy", OtherToy)
    assert volume_mod.volume_class(f"toy://{toy_store}") is OtherToy
    assert sum(1 for key, _, _ in volume_mod._backends if key == "toy") == 1


def test_a_predicate_routes_paths_to_a_backend(toy_store):
    saved = list(volume_mod._backends)
    try:
        volume_mod.register_volume(lambda p: p.startswith("toy-alias:"), ToyVolume)
        assert volume_mod.volume_class("toy-alias:x") is ToyVolume
        assert volume_mod.volume_class("/data/train") is LocalVolume
    finally:
        volume_mod._backends[:] = saved


def test_register_volume_refuses_what_is_not_a_backend_or_a_scheme():
    with pytest.raises(TypeError, match="Volume subclass"):
        volume_mod.register_volume("toy", dict)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not a URL scheme"):
        volume_mod.register_volume("no spaces", ToyVolume)
    with pytest.raises(TypeError, match="scheme or a predicate"):
        volume_mod.register_volume(42, ToyVolume)  # type: ignore[arg-type]


def test_a_backend_missing_a_method_cannot_be_built():
    class Incomplete(Volume):
        def list(self, pattern=None):
            return []

    with pytest.raises(TypeError, match="abstract"):
        Incomplete()


def test_the_simulator_is_a_registered_backend_and_its_reads_keep_their_latency(tmp_path):
    from ucmagic.files.volume import open_volume
    from ucmagic.testing import SlowVolume, make_files

    make_files(str(tmp_path / "src"), 3, 100)
    vol = open_volume(f"slow://{tmp_path / 'src'}", {"open_ms": 0, "list_ms": 0})
    assert type(vol) is SlowVolume
    assert vol.local_root == str(tmp_path / "src")  # staging refuses a destination inside it
    assert vol.local_file(vol.list()[0].path) is None  # copies go through the simulator, not around it
    assert LocalVolume(str(tmp_path)).local_file("a/b.bin") == os.path.join(str(tmp_path), "a", "b.bin")


def test_url_table_sources_are_listed_through_the_volume_backend(tmp_path):
    import fsspec

    from ucmagic.tables.sources import resolve_source

    fs = fsspec.filesystem("memory")
    root = f"/ucmagic-sources-{os.getpid()}"
    try:
        for rel in ("a.parquet", "b.parquet", "sub/c.parquet", "_SUCCESS", "notes.txt", "_tmp/d.parquet"):
            fs.pipe(f"{root}/{rel}", b"x")
        src = resolve_source(f"memory://{root}")
        assert src.kind == "parquet" and src.remote
        assert src.paths == [f"memory://{root}/{r}" for r in ("a.parquet", "b.parquet", "sub/c.parquet")]
        top = resolve_source(f"memory://{root}/*.parquet")  # a glob matches from its folder, as a shell's
        assert top.paths == [f"memory://{root}/a.parquet", f"memory://{root}/b.parquet"]
        deep = resolve_source(f"memory://{root}/**/*.parquet")
        assert f"memory://{root}/sub/c.parquet" in deep.paths
        one = resolve_source(f"memory://{root}/b.parquet")
        assert one.paths == [f"memory://{root}/b.parquet"]
    finally:
        fs.rm(root, recursive=True)


def test_url_table_sources_of_a_registered_backend_are_listed_through_it(toy_store):
    from ucmagic.tables.sources import resolve_source

    _TOY_STORES[toy_store] = {"part-0.parquet": (b"x", 1.0), "part-1.parquet": (b"y", 2.0), "_SUCCESS": (b"", 3.0)}
    src = resolve_source(f"toy://{toy_store}")
    assert src.paths == [f"toy://{toy_store}/part-0.parquet", f"toy://{toy_store}/part-1.parquet"]
