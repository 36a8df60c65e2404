"""fsspec backend against a real S3-compatible server on loopback (moto's standalone server)."""
import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture
def s3_opts(s3_endpoint, s3_env):
    """The session's S3 server (tests/conftest.py), credentials in the environment."""
    return {"endpoint_url": s3_endpoint, "key": "testing", "secret": "testing"}


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


def test_export_to_s3_replaces_appends_and_refuses_through_the_volume(s3_env, tmp_path):
    """export_parquet to an s3:// bucket that does not exist yet: overwrite, append and mode='error'
    (the destination's Volume uploads each file, then the manifest commits); ucmagic reads it back."""
    import uuid

    import pyarrow as pa
    import s3fs

    from ucmagic import export_parquet
    from ucmagic.tables import load_table

    bucket = f"export-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(**s3_env)
    url = f"s3://{bucket}/runs/out"  # neither the bucket nor the prefix exist yet: the export creates them
    first = export_parquet(pa.table({"i": list(range(500)), "tag": [1] * 500}), url, storage_options=s3_env)
    assert first.rows == 500 and all(f.startswith(url + "/part-") for f in first.files)
    assert sorted(load_table(url, storage_options=s3_env)["i"]) == list(range(500))
    export_parquet(pa.table({"i": list(range(500, 520)), "tag": [2] * 20}), url, mode="append",
                   storage_options=s3_env)
    df = load_table(url, storage_options=s3_env)
    assert sorted(df["i"]) == list(range(520)) and set(df["tag"]) == {1, 2}
    with pytest.raises(FileExistsError):
        export_parquet(pa.table({"i": [0]}), url, mode="error", storage_options=s3_env)
    export_parquet(pa.table({"i": [7, 8], "tag": [3, 3]}), url, storage_options=s3_env)  # overwrite
    assert sorted(load_table(url, storage_options=s3_env)["i"]) == [7, 8]
    fs.invalidate_cache()
    names = [p.rsplit("/", 1)[-1] for p in fs.find(f"{bucket}/runs/out")]
    assert len([n for n in names if n.endswith(".parquet")]) == 1  # the stale files are gone
    fs.rm(bucket, recursive=True)
