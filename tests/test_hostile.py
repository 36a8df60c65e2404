"""Hostile and bad input (issue 8, SPEC E1-E3): odd file names, keys with ``..``, symlinks out of the
volume, an untrusted cache directory, table names carrying SQL, ``%ucckpt -m`` naming something
that is not a model, and checkpoints carrying a code-running pickle."""
from __future__ import annotations

import glob
import hashlib
import os
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic import UCVolumeDataset, stage
from ucmagic.files.cache import FileCache
from ucmagic.files.cache_layout import cache_key, entry_file, map_relpath, other_version_file, space_of
from ucmagic.errors import UnsafeCacheError, UnsafeSourceError
from ucmagic.files.volume import is_safe_rel

HOSTILE = ["..a", "a..b", "...", "..b/..c/d..", "new\nline.bin", "tab\tand space .bin", "ünïcødé-日本語.bin",
           "x" * 251 + ".bin", "-rf", "$(touch pwned)", "quote'\"`.bin"]


def sha_bytes(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return sha_bytes(f.read())


def inside(path: str, root: str) -> bool:
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(root)]) == os.path.realpath(root)


def write_tree(root: str, names: list[str]) -> dict[str, str]:
    sums = {}
    for i, rel in enumerate(names):
        full = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(full), exist_ok=True)
        data = f"{i}:{rel}".encode() * 50
        with open(full, "wb") as f:
            f.write(data)
        sums[rel] = sha_bytes(data)
    return sums


def all_files(root: str) -> set[str]:
    out = set()
    for d, _, fs in os.walk(root):
        out.update(os.path.join(d, f) for f in fs)
    return out


# ------------------------------------------------------------------ odd names

@pytest.mark.parametrize("scheme", ["", "slow://"])
def test_hostile_names_are_cached_and_staged_inside_their_directories(tmp_path, scheme):
    vol, cache, dest = str(tmp_path / "vol"), str(tmp_path / "cache"), str(tmp_path / "dest")
    assert len(("x" * 251 + ".bin").encode()) == 255
    sums = write_tree(vol, HOSTILE)
    before = all_files(str(tmp_path))
    src = scheme + vol
    ds = UCVolumeDataset(src, cache_dir=cache,
                         storage_options={"open_ms": 0, "mbps": 0, "list_ms": 0} if scheme else None)
    assert sorted(e.path for e in ds.listing.iter_entries()) == sorted(HOSTILE)
    served = sorted(sha(p) for p in ds)
    assert served == sorted(sums.values())
    res = stage(src, dest, progress=False, storage_options={"open_ms": 0, "mbps": 0, "list_ms": 0} if scheme else None)
    assert res.ok and res.files == len(HOSTILE)
    for rel, digest in sums.items():
        assert sha(os.path.join(dest, *rel.split("/"))) == digest
    new = all_files(str(tmp_path)) - before
    assert all(inside(p, cache) or inside(p, dest) for p in new), new - {p for p in new if inside(p, cache)}


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=300))
def test_cache_paths_never_leave_the_cache_directory(rel):
    root = "/c"
    key = cache_key("memory://vol", rel, 10, 1.0)
    space = space_of("memory://vol")
    name = entry_file(key, "", 10, rel, space)
    for at in (name, other_version_file(key, name)):  # its place, and another version's
        path = os.path.normpath(os.path.join(root, "files", at))
        assert path.startswith(f"/c/files/{at.split('/')[0]}/")  # files/<space>/<the mapped relative path>
        assert path.count("/") == 3 + len(map_relpath(rel).split("/"))  # no component collapsed or escaping


def test_object_store_keys_with_dotdot_cannot_write_outside_cache_or_destination(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    base = f"/hostile-{os.getpid()}/vol"
    try:
        fs.pipe(base + "/ok.bin", b"fine" * 10)
        for key in ("/../../escaped.bin", "/a/../../../escaped2.bin", "/./dot.bin"):
            fs.store[base + key] = fs.store[base + "/ok.bin"]  # memory:// keeps such keys verbatim
        cache, dest = str(tmp_path / "work" / "cache"), str(tmp_path / "work" / "dest")
        with pytest.warns(UserWarning, match=r"ignoring .*\.\..*outside"):
            ds = UCVolumeDataset("memory://" + base, cache_dir=cache)
        assert [e.path for e in ds.listing.iter_entries()] == ["ok.bin"]
        assert [sha(p) for p in ds] == [sha_bytes(b"fine" * 10)]
        with pytest.warns(UserWarning, match="ignoring"):
            res = stage("memory://" + base, dest, progress=False)
        assert res.ok and res.files == 1
        assert all(inside(p, cache) or inside(p, dest) for p in all_files(str(tmp_path)))
        assert not glob.glob(str(tmp_path / "**" / "escaped*"), recursive=True)
    finally:
        fs.rm(f"/hostile-{os.getpid()}", recursive=True)
    for rel, ok in [("a/b", True), ("..a", True), ("a..b", True), ("../x", False), ("a/../b", False),
                    ("/abs", False), ("./a", False), ("a//b", False)]:
        assert is_safe_rel(rel) is ok, rel


# ------------------------------------------------------------------ symlinks

def test_symlinks_out_of_the_volume_are_refused_or_left_out_never_written_and_linked_dirs_not_followed(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.bin").write_bytes(b"outside data")
    (outside / "deep").mkdir()
    (outside / "deep" / "x.bin").write_bytes(b"x")
    vol = tmp_path / "vol"
    sums = write_tree(str(vol), ["a.bin", "sub/b.bin"])
    os.symlink(outside / "secret.bin", vol / "link.bin")   # a file link pointing out of the volume
    os.symlink(vol / "a.bin", vol / "sub" / "in.bin")      # one pointing inside it
    os.symlink(outside, vol / "linkdir")          # a directory link pointing out of the volume
    os.symlink(vol, vol / "sub" / "loop")          # and a loop
    before = {p: sha(p) for p in all_files(str(outside))}
    cache, dest = str(tmp_path / "cache"), str(tmp_path / "dest")

    with pytest.raises(UnsafeSourceError, match=r"link\.bin.*follow_symlinks='all'"):  # on_error="raise"
        UCVolumeDataset(str(vol), cache_dir=cache)
    with pytest.warns(UserWarning, match=r"1 symlink.*link\.bin"):
        ds = UCVolumeDataset(str(vol), cache_dir=cache, on_error="skip")
    # linked dirs are not walked; the link inside is read, the one outside left out
    assert [e.path for e in ds.listing.iter_entries()] == ["a.bin", "sub/b.bin", "sub/in.bin"]
    for p in ds:
        assert not os.path.islink(p) and inside(p, cache)
    trusted = UCVolumeDataset(str(vol), cache_dir=cache, follow_symlinks="all")
    assert [e.path for e in trusted.listing.iter_entries()] == ["a.bin", "link.bin", "sub/b.bin", "sub/in.bin"]
    none = UCVolumeDataset(str(vol), cache_dir=cache, follow_symlinks="none")
    assert [e.path for e in none.listing.iter_entries()] == ["a.bin", "sub/b.bin"]
    with pytest.warns(UserWarning, match="link.bin"):
        res = stage(str(vol), dest, progress=False)
    assert res.ok and sorted(os.listdir(dest)) == ["a.bin", "sub"]
    assert sorted(os.listdir(os.path.join(dest, "sub"))) == ["b.bin", "in.bin"]
    assert not os.path.islink(os.path.join(dest, "sub", "in.bin"))
    assert sha(os.path.join(dest, "sub", "b.bin")) == sums["sub/b.bin"]
    assert {p: sha(p) for p in all_files(str(outside))} == before  # nothing written through the links


# ------------------------------------------------------------------ the cache directory's owner and mode

def _need_root():
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root")


def test_cache_directory_owned_by_another_user_is_refused(tmp_path):
    _need_root()
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 65534, 65534)
    with pytest.raises(UnsafeCacheError, match=r"belongs to another user.*cache_dir="):
        FileCache(str(d))
    vol = tmp_path / "vol"
    write_tree(str(vol), ["a.bin"])
    with pytest.raises(UnsafeCacheError):
        UCVolumeDataset(str(vol), cache_dir=str(d))


def test_world_writable_cache_directory_is_made_private(tmp_path):
    d = tmp_path / "open"
    d.mkdir()
    os.chmod(d, 0o777)
    fc = FileCache(str(d))
    assert os.stat(fc.root).st_mode & 0o777 == 0o700
    for sub in ("files", "tmp", "locks", "prot"):
        assert os.stat(os.path.join(fc.root, sub)).st_mode & 0o077 == 0


def test_a_planted_entry_not_owned_by_the_user_is_not_served(tmp_path):
    _need_root()
    vol = tmp_path / "vol"
    sums = write_tree(str(vol), ["a.bin"])
    ds = UCVolumeDataset(str(vol), cache_dir=str(tmp_path / "c"))
    e = ds.listing.entry(0)
    planted = ds.cache.data_path(*ds.files.key(e), e.size, e.path, ds.space)
    os.makedirs(os.path.dirname(planted), exist_ok=True)
    with open(planted, "wb") as f:
        f.write(b"E" * e.size)  # right size, wrong bytes, someone else's file
    os.chown(planted, 65534, 65534)
    assert [sha(p) for p in ds] == [sums["a.bin"]] and ds.stats()["misses"] == 1


# ------------------------------------------------------------------ table names carrying SQL

SQL_NAMES = ["a.b.c; DROP TABLE x", "main.default.x; DROP TABLE main.default.x", "main.default.`x`",
             "main.default.x --", "main.default.x'); DROP TABLE x; --", "main.default.x\nDROP TABLE x"]


@pytest.mark.parametrize("name", SQL_NAMES)
def test_table_names_carrying_sql_are_refused(tmp_path, monkeypatch, name):
    import pandas as pd

    from ucmagic import export_parquet, load_table, register_table
    from ucmagic.tables import InvalidTableNameError

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("UCMAGIC_CATALOG_ROOT", str(tmp_path / "catalog"))
    register_table("main.default.x", pd.DataFrame({"v": [1, 2, 3]}))
    with pytest.raises(InvalidTableNameError, match="catalog.schema.table"):
        load_table(name)
    with pytest.raises((InvalidTableNameError, FileNotFoundError)):
        export_parquet(name, str(tmp_path / "out"))
    with pytest.raises(InvalidTableNameError):
        register_table(name, pd.DataFrame({"v": [0]}))
    assert load_table("main.default.x")["v"].tolist() == [1, 2, 3]  # nothing was dropped
    assert not os.path.exists(tmp_path / "out")


# ------------------------------------------------------------------ magics: names, never code

@pytest.fixture
def ip(tmp_path, monkeypatch, magic_shell):
    monkeypatch.setenv("UCMAGIC_RAISE", "1")
    monkeypatch.chdir(tmp_path)
    return magic_shell


@pytest.mark.parametrize("model_arg, match", [
    ("notmodel", "expected a torch.nn.Module, got int"),
    ("os", "expected a torch.nn.Module, got module"),
    ("undefined_thing", "no variable named"),
    ("__import__('os').system('touch\\ PWNED')", "takes the name of a variable"),
    ("model.__class__", "takes the name of a variable"),
])
def test_ucckpt_model_must_name_a_module_variable_never_code(ip, tmp_path, model_arg, match):
    import os as os_module

    from ucmagic.notebook.magics import MagicUsageError

    ip.user_ns.update(notmodel=5, os=os_module)
    root = tmp_path / "ckpt"
    root.mkdir()
    for action in ("save", "load"):
        step = " --step 1" if action == "save" else ""
        with pytest.raises(MagicUsageError, match=match):
            ip.run_line_magic("ucckpt", f"{action} {root} -m {model_arg}{step}")
    assert os.listdir(root) == [] and not (tmp_path / "PWNED").exists()


def test_ucload_and_ucstage_refuse_a_table_name_carrying_sql(ip, tmp_path):
    import pandas as pd

    from ucmagic import load_table, register_table
    from ucmagic.errors import UCMagicError

    register_table("main.default.x", pd.DataFrame({"v": [1]}))
    with pytest.raises(UCMagicError):
        ip.run_line_magic("ucload", '"a.b.c; DROP TABLE x"')
    with pytest.raises(UCMagicError):
        ip.run_line_magic("ucstage", f'--export "a.b.c; DROP TABLE x" {tmp_path / "out"}')
    assert load_table("main.default.x")["v"].tolist() == [1]


# ------------------------------------------------------------------ checkpoints carrying a pickle payload

class Payload:
    """Unpickling this runs code: it creates the file named at pickling time."""

    def __init__(self, target: str) -> None:
        self.target = target

    def __reduce__(self):
        return (exec, (f"open({self.target!r}, 'w').write('pwned')",))


def _commit(path: str, kind: str, files: dict[str, bytes], step: int) -> None:
    from ucmagic.checkpoints.format import COMMIT_NAME, FileRecord, make_commit

    recs = {}
    for name, data in files.items():
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
        recs[name] = FileRecord(len(data), zlib.crc32(data))
    with open(os.path.join(path, COMMIT_NAME), "wb") as f:
        f.write(make_commit(kind=kind, save_id="evil", files=recs, info={"step": step, "extra": None}))


def _plant_single_file_payload(tmp_path, step: int):
    """A committed single-file checkpoint whose pickle would create ``tmp_path/PWNED`` if run."""
    import io

    import torch

    from ucmagic.checkpoints.format import FORMAT_SINGLE, SINGLE_FILE_NAME

    sentinel = tmp_path / "PWNED"
    buf = io.BytesIO()
    torch.save({"model": Payload(str(sentinel))}, buf)
    step_dir = tmp_path / "ckpt" / f"step_{step}"
    step_dir.mkdir(parents=True)
    _commit(str(step_dir), FORMAT_SINGLE, {SINGLE_FILE_NAME: buf.getvalue()}, step)
    return sentinel


def test_single_file_checkpoint_with_a_code_running_pickle_is_refused(tmp_path):
    import torch

    from ucmagic import load_checkpoint
    from ucmagic.checkpoints.format import UnsafeCheckpointError

    sentinel = _plant_single_file_payload(tmp_path, 1)
    with pytest.raises(UnsafeCheckpointError, match=r"not plain tensors"):
        load_checkpoint(str(tmp_path / "ckpt"), model=torch.nn.Linear(2, 2))
    assert not sentinel.exists()


def test_dcp_checkpoint_with_a_code_running_metadata_pickle_is_refused(tmp_path):
    import pickle

    import torch

    from ucmagic import UCVolumeReader, load_checkpoint, save_checkpoint
    from ucmagic.checkpoints.format import FORMAT_DCP, METADATA_NAME, UnsafeCheckpointError

    root = tmp_path / "ckpt"
    save_checkpoint(str(root), model=torch.nn.Linear(2, 2), step=1)
    sentinel = tmp_path / "PWNED"
    step_dir = root / "step_1"
    shards = {n: (step_dir / n).read_bytes() for n in os.listdir(step_dir) if n.endswith(".distcp")}
    _commit(str(step_dir), FORMAT_DCP, {**shards, METADATA_NAME: pickle.dumps(Payload(str(sentinel)))}, 1)
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle"):
        load_checkpoint(str(root), model=torch.nn.Linear(2, 2))
    with pytest.raises(UnsafeCheckpointError):
        UCVolumeReader(str(step_dir)).read_metadata()
    assert not sentinel.exists()


def test_ucckpt_load_of_a_pickle_payload_does_not_run_it(ip, tmp_path):
    import torch

    from ucmagic.checkpoints.format import UnsafeCheckpointError

    sentinel = _plant_single_file_payload(tmp_path, 3)
    ip.user_ns["model"] = torch.nn.Linear(2, 2)
    with pytest.raises(UnsafeCheckpointError):
        ip.run_line_magic("ucckpt", f"load {tmp_path / 'ckpt'} latest -m model")
    assert not sentinel.exists()
