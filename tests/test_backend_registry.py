"""A backend added with ``register_volume`` serves every path ucmagic reads or writes itself (issue 43 item 3):
datasets, ``stage()``, ``pack()`` and checkpoints. The toy backend (tests/toy_backend.py) is neither a
``LocalVolume`` nor an ``FsspecVolume`` and counts the calls it serves, so a path that bypasses the registry
fails here (tables and exports: tests/test_tables*.py)."""
from __future__ import annotations

import tarfile

import pytest
from toy_backend import ToyVolume, toy_backend_fixture  # noqa: F401  (the toy_backend fixture)


def _files(root, n=6, size=300):
    data = {}
    for i in range(n):
        rel = f"c{i % 2}/s{i:02d}.bin"
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        data[rel] = bytes([i]) * (size + i)
        (root / rel).write_bytes(data[rel])
    return data


def test_the_toy_backend_is_what_open_volume_builds(toy_backend):
    from ucmagic.files.volume import open_volume

    assert type(open_volume(toy_backend.url())) is ToyVolume
    assert toy_backend.served("from_path") == 1


def test_unregister_gives_the_scheme_back_to_the_built_ins():
    from ucmagic.files.volume import FsspecVolume, register_volume, unregister_volume, volume_class

    register_volume("toyz", ToyVolume)
    assert volume_class("toyz:///x") is ToyVolume
    assert unregister_volume("toyz://") is True
    assert volume_class("toyz:///x") is FsspecVolume  # any other URL: the fsspec built-in
    assert unregister_volume("toyz") is False


def test_ucvolumedataset_reads_through_a_registered_backend(toy_backend, tmp_path):
    from ucmagic import UCVolumeDataset

    data = _files(toy_backend.root)
    ds = UCVolumeDataset(toy_backend.url(), cache_dir=str(tmp_path / "cache"))
    assert isinstance(ds.volume, ToyVolume)
    got = sorted(open(p, "rb").read() for p in ds)
    assert got == sorted(data.values())
    assert toy_backend.served("list") >= 1 and toy_backend.served("copy_to") == len(data)


def test_stage_copies_through_a_registered_backend(toy_backend, tmp_path):
    import ucmagic

    data = _files(toy_backend.root)
    res = ucmagic.stage(toy_backend.url(), tmp_path / "staged", progress=False, processes=1)
    assert res.ok and res.files == len(data)
    for rel, body in data.items():
        assert (tmp_path / "staged" / rel).read_bytes() == body
    assert toy_backend.served("copy_to") == len(data)


def test_pack_reads_its_source_through_a_registered_backend(toy_backend, tmp_path):
    from ucmagic.shards.pack import pack

    data = _files(toy_backend.root)
    summary = pack(toy_backend.url(), tmp_path / "shards", "1MB", progress=False, workers=1)
    assert summary.samples == len(data)
    members = {}
    for shard in sorted((tmp_path / "shards").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                f = tar.extractfile(m)
                assert f is not None
                members[m.name] = f.read()
    assert sorted(members.values()) == sorted(data.values())
    assert toy_backend.served("copy_to", "range_reader", "read_bytes") >= 1


def test_checkpoints_save_list_and_load_through_a_registered_backend(toy_backend):
    torch = pytest.importorskip("torch")
    from ucmagic.checkpoints.api import list_checkpoints, load_checkpoint, save_checkpoint

    root = toy_backend.url("run")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    assert save_checkpoint(root, model=model, step=2, extra={"seen": 20}) == f"{root}/step_2"
    assert [i.step for i in list_checkpoints(root)] == [2]
    fresh = torch.nn.Linear(4, 3)
    assert load_checkpoint(root, model=fresh) == (2, {"seen": 20})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
    assert (toy_backend.root / "run" / "step_2").is_dir()  # written where the backend keeps its files
    assert toy_backend.served("upload", "write_bytes") >= 1 and toy_backend.served("read_bytes", "copy_to") >= 1


def test_tar_shards_read_through_a_registered_backend(toy_backend, tmp_path):
    import ucmagic
    from ucmagic.shards.pack import pack

    src = tmp_path / "src"
    data = _files(src)
    pack(str(src), toy_backend.root / "shards", "1MB", progress=False, workers=1)
    got = list(ucmagic.TarShards(toy_backend.url("shards"), cache_dir=str(tmp_path / "cache")))
    assert sorted(s["bin"] for s in got) == sorted(data.values())
    assert toy_backend.served("list") >= 1 and toy_backend.served("range_reader", "copy_to") >= 1


def test_a_checkpoint_store_a_registered_backend_refuses_is_not_opened_by_fsspec_instead():
    from ucmagic.errors import SourceNotFoundError
    from ucmagic.checkpoints.api import list_checkpoints
    from toy_backend import registered

    class Refusing(ToyVolume):
        @classmethod
        def from_path(cls, path, storage_options=None):
            raise SourceNotFoundError(f"{path}: this store is closed (the backend's own answer)")

    with registered("toyno", Refusing), pytest.raises(Exception) as got:
        list_checkpoints("toyno://shelf/run")
    assert "the backend's own answer" in str(got.value), got.value  # not fsspec's "no file system handles toyno://"


def test_token_windows_read_through_a_registered_backend(toy_backend, tmp_path):
    np = pytest.importorskip("numpy")
    from ucmagic.shards import TokenWindows

    np.save(toy_backend.root / "tokens.npy", np.arange(1000, dtype="<u2"))
    ds = TokenWindows(toy_backend.url(), block_size=8, dtype="uint16", cache_dir=str(tmp_path / "cache"))
    assert ds[3].tolist() == list(range(24, 33))  # a window and its target token
    assert toy_backend.served("list") >= 1 and toy_backend.served("range_reader", "copy_to", "read_bytes") >= 1


def test_loader_workers_read_through_a_registered_backend(toy_backend, tmp_path):
    import ucmagic

    data = _files(toy_backend.root)
    ds = ucmagic.UCVolumeDataset(toy_backend.url(), cache_dir=str(tmp_path / "cache"))
    loader = ucmagic.DataLoader(ds, batch_size=2, num_workers=2)  # each worker gets the pickled ToyVolume
    got = sorted(open(p, "rb").read() for batch in loader for p in batch)
    assert got == sorted(data.values())
