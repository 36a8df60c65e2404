"""fsspec backend against a real S3-compatible server on loopback (moto's standalone server)."""
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3_server():
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


@pytest.fixture
def s3_opts(s3_server, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return {"endpoint_url": s3_server, "key": "testing", "secret": "testing"}


def test_dataset_reads_s3_through_the_cache(s3_opts):
    import s3fs

    from ucmagic import UCVolumeDataset

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": s3_opts["endpoint_url"]}, key="testing", secret="testing")
    fs.mkdir("train-bucket")
    for i in range(12):
        fs.pipe(f"train-bucket/ds/sub{i % 2}/img{i:02d}.jpg", f"image {i}".encode())
    fs.pipe("train-bucket/ds/readme.txt", b"not an image")
    opts = {"client_kwargs": {"endpoint_url": s3_opts["endpoint_url"]}, "key": "testing", "secret": "testing"}
    ds = UCVolumeDataset("s3://train-bucket/ds", pattern="*.jpg", storage_options=opts)
    got = sorted(open(p, "rb").read() for p in ds)
    assert got == sorted(f"image {i}".encode() for i in range(12))
    assert ds.stats()["misses"] == 12
    again = UCVolumeDataset("s3://train-bucket/ds", pattern="*.jpg", storage_options=opts)
    list(again)
    assert again.stats()["misses"] == 0
    # an object rewritten with new content gets a new cache entry
    fs.pipe("train-bucket/ds/sub0/img00.jpg", b"image 0, version 2")
    third = UCVolumeDataset("s3://train-bucket/ds", pattern="*.jpg", storage_options=opts)
    assert b"image 0, version 2" in [open(p, "rb").read() for p in third]
    assert third.stats()["misses"] == 1
