"""The backend seam: the Volume write side on local directories, local files behind fsspec (the simulator),
memory:// and a real S3 server (moto on loopback), its atomicity, and the registry of backends."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from ucmagic.files import volume as volume_mod
from ucmagic.files.volume import FsspecVolume, LocalVolume, Volume


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_endpoint():
    """A moto S3 server on loopback (skipped where s3fs or moto are not installed)."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("moto server did not start")
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


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


@pytest.mark.timeout(60)
def test_written_bytes_read_back_whole_and_replace_the_old_content(wvol):
    wvol.makedirs("step-1")
    wvol.write_bytes("step-1/shard.bin", b"first")
    wvol.write_bytes("step-1/shard.bin", b"second version")
    assert wvol.read_bytes("step-1/shard.bin") == b"second version"
    assert wvol.exists("step-1/shard.bin") and wvol.exists("step-1")
    assert not wvol.exists("step-1/other.bin")
    assert wvol.list_names("step-1") == ["shard.bin"]  # no temp file left beside it
    assert wvol.stat("step-1/shard.bin").size == len(b"second version")


@pytest.mark.timeout(60)
def test_an_uploaded_local_file_arrives_byte_for_byte(wvol, tmp_path):
    src = tmp_path / "model.pt"
    data = os.urandom(3 << 20) + b"tail"
    src.write_bytes(data)
    wvol.upload(str(src), "run/model.pt")
    assert wvol.read_bytes("run/model.pt") == data
    assert src.read_bytes() == data  # the source stays


@pytest.mark.timeout(60)
def test_list_names_gives_files_and_folders_directly_under_and_nothing_for_a_missing_one(wvol):
    for rel in ("a/x.bin", "a/y.bin", "a/sub/z.bin", "b.bin"):
        wvol.write_bytes(rel, rel.encode())
    assert wvol.list_names("a") == ["sub", "x.bin", "y.bin"]
    assert wvol.list_names("") == ["a", "b.bin"]
    assert wvol.list_names("missing") == []
    assert wvol.list_names("b.bin") == []  # a file has nothing under it


@pytest.mark.timeout(60)
def test_remove_deletes_a_file_and_refuses_a_missing_one_only_when_asked(wvol):
    wvol.write_bytes("f.bin", b"x")
    wvol.remove("f.bin")
    assert not wvol.exists("f.bin")
    wvol.remove("f.bin")  # missing_ok by default
    with pytest.raises(FileNotFoundError):
        wvol.remove("f.bin", missing_ok=False)


@pytest.mark.timeout(60)
def test_remove_tree_deletes_everything_under_a_folder_and_accepts_a_missing_one(wvol):
    for rel in ("old/a.bin", "old/deep/b.bin", "keep.bin"):
        wvol.write_bytes(rel, b"data")
    wvol.remove_tree("old")
    assert not wvol.exists("old/a.bin") and not wvol.exists("old/deep/b.bin")
    assert wvol.list_names("") == ["keep.bin"]
    wvol.remove_tree("old")  # nothing there: fine


@pytest.mark.timeout(60)
def test_rename_moves_a_file_over_an_existing_one(wvol):
    wvol.write_bytes("tmp/commit.json", b"new")
    wvol.write_bytes("commit.json", b"old")
    wvol.rename("tmp/commit.json", "commit.json")
    assert wvol.read_bytes("commit.json") == b"new"
    assert not wvol.exists("tmp/commit.json")
    assert type(wvol).atomic_rename in (True, False)
    assert wvol.atomic_rename is (wvol.local_root is not None)  # local files: os.replace; object stores: copy+delete


@pytest.mark.timeout(60)
def test_write_paths_outside_the_root_are_refused(wvol):
    for bad in ("", "../x", "a/../../x", "/abs", "a//b"):
        with pytest.raises(ValueError, match="relative path"):
            wvol.write_bytes(bad, b"x")
    with pytest.raises(ValueError):
        wvol.remove_tree("")  # never the whole root


@pytest.mark.timeout(60)
def test_a_url_rooted_volume_writes_under_its_root(tmp_path):
    root = tmp_path / "bucket"
    root.mkdir()
    vol = FsspecVolume(f"slow://{root}/ckpts", {"open_ms": 0, "list_ms": 0})
    vol.write_bytes("step/x.bin", b"abc")
    assert (root / "ckpts" / "step" / "x.bin").read_bytes() == b"abc"


class _CopyInterruptedError(Exception):
    pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["local", "slow"])
def test_a_failed_upload_leaves_nothing_at_the_destination_nor_beside_it(tmp_path, monkeypatch, kind):
    root = tmp_path / "root"
    root.mkdir()
    vol: Volume = LocalVolume(str(root)) if kind == "local" else FsspecVolume(f"slow://{root}", {"open_ms": 0})
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(1 << 20))
    real_copy = volume_mod.copy_local

    def copy_half_then_fail(a: str, b: str, **kw: object) -> tuple[int, int]:
        with open(a, "rb") as f, open(b, "wb") as g:
            g.write(f.read(1 << 19))  # half the bytes are on disk under the temp name
        raise _CopyInterruptedError("disk full")

    monkeypatch.setattr(volume_mod, "copy_local", copy_half_then_fail)
    with pytest.raises(_CopyInterruptedError):
        vol.upload(str(src), "ckpt/model.bin")
    assert not vol.exists("ckpt/model.bin")
    assert vol.list_names("ckpt") == []
    # an existing version stays whole when its replacement fails
    monkeypatch.setattr(volume_mod, "copy_local", real_copy)
    vol.upload(str(src), "ckpt/model.bin")
    monkeypatch.setattr(volume_mod, "copy_local", copy_half_then_fail)
    with pytest.raises(_CopyInterruptedError):
        vol.upload(str(tmp_path / "big.bin"), "ckpt/model.bin")
    assert vol.read_bytes("ckpt/model.bin") == src.read_bytes()
    assert vol.list_names("ckpt") == ["model.bin"]


@pytest.mark.timeout(60)
def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    vol = LocalVolume(str(tmp_path))

    def fsync_fails(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", fsync_fails)
    with pytest.raises(OSError, match="No space"):
        vol.write_bytes("commit.json", b"{}")
    monkeypatch.undo()
    assert vol.list_names("") == []


@pytest.mark.timeout(60)
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
