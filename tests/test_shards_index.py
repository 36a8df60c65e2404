"""The shard index: tar members found from headers only, for tars that real writers produce."""
from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucmagic.files.ranged import RangedFile
from ucmagic.shards.index import (INDEX_NAME, Member, MemberColumns, loads_index, dumps_index,
                                  read_index, sample_starts, scan_tar, shard_info, split_key, write_index)
from ucmagic.files.volume import LocalVolume


def _check_offsets(path: str, members: list[Member], payload: dict[tuple[str, str], bytes]) -> None:
    raw = open(path, "rb").read()
    assert {(m.key, m.ext) for m in members} == set(payload)
    for m in members:
        assert raw[m.offset:m.offset + m.size] == payload[(m.key, m.ext)]


def _payload(n: int, prefix: str = "") -> dict[tuple[str, str], bytes]:
    return {(f"{prefix}{i:06d}", ext): (f"{i}-{ext}-".encode() * (i * 97 % 300)) for i in range(n)
            for ext in ("jpg", "cls")}


def test_webdataset_tarwriter_shard_members_found_by_headers(tmp_path):
    wds = pytest.importorskip("webdataset")
    path = str(tmp_path / "s.tar")
    payload = _payload(20)
    with wds.TarWriter(path) as w:
        for i in range(20):
            w.write({"__key__": f"{i:06d}", "jpg": payload[(f"{i:06d}", "jpg")], "cls": payload[(f"{i:06d}", "cls")]})
    members = scan_tar(path)
    _check_offsets(path, members, payload)
    assert len(sample_starts(members)) == 20


@pytest.mark.skipif(shutil.which("tar") is None, reason="no tar command")
@pytest.mark.parametrize("fmt", ["gnu", "posix"])
def test_tar_command_shards_with_long_names(tmp_path, fmt):
    src = tmp_path / "src"
    deep = "d" * 60 + "/" + "e" * 70  # member paths over 100 characters: GNU long names / pax headers
    (src / deep).mkdir(parents=True)
    payload = _payload(6, prefix=deep + "/")
    for (key, ext), data in payload.items():
        (src / f"{key}.{ext}").write_bytes(data)
    path = str(tmp_path / "s.tar")
    names = sorted(f"{k}.{e}" for k, e in payload)
    subprocess.run(["tar", f"--format={fmt}", "-cf", path, "-C", str(src), *names], check=True, timeout=30)
    members = scan_tar(path)
    _check_offsets(path, members, payload)
    assert len(sample_starts(members)) == 6


def test_ranged_reads_of_a_remote_shard_give_the_same_members(tmp_path):
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tf:
        for i in range(30):
            data = os.urandom(i * 1000)
            ti = tarfile.TarInfo(f"x/{i:04d}.bin")
            ti.size = len(data)
            tf.addfile(ti, io.BytesIO(data))
    vol = LocalVolume(str(tmp_path))
    with RangedFile(vol.range_reader("s.tar"), path.stat().st_size) as f:
        assert scan_tar(f) == scan_tar(str(path))


def test_directories_meta_files_and_dotless_names_are_not_members(tmp_path):
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tf:
        d = tarfile.TarInfo("dir")
        d.type = tarfile.DIRTYPE
        tf.addfile(d)
        for name in ("dir/__meta__", "README", "dir/0001.txt"):
            ti = tarfile.TarInfo(name)
            ti.size = 1
            tf.addfile(ti, io.BytesIO(b"x"))
    assert [(m.key, m.ext) for m in scan_tar(str(path))] == [("dir/0001", "txt")]


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["jpg", "cls", "json"])), max_size=30))
def test_samples_are_runs_of_one_key_without_a_repeated_extension(pairs):
    members = [Member(k, e, i * 512, 1) for i, (k, e) in enumerate(pairs)]
    starts = sample_starts(members) + [len(members)]
    assert starts[0] == 0 or not members
    for a, b in zip(starts, starts[1:]):
        run = members[a:b]
        assert len({m.key for m in run}) == 1
        assert len({m.ext for m in run}) == len(run)
    assert sum(b - a for a, b in zip(starts, starts[1:])) == len(members)


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.sampled_from(["jpg", "cls", "json"])), max_size=30))
def test_an_index_read_as_columns_gives_the_same_members_and_samples(pairs):
    members = [Member(k, e, i * 512, i) for i, (k, e) in enumerate(pairs)]
    info = shard_info("s.tar", 512 * (len(members) + 2), members)
    back = loads_index(dumps_index([info]))[0]
    assert isinstance(back.members, MemberColumns)
    assert list(back.members) == members and back.members == members and back == info
    assert [back.members[i] for i in range(len(members))] == members
    assert back.members.sample_starts().tolist() == sample_starts(members) == sample_starts(back.members)
    assert back.samples == len(sample_starts(members))


def test_key_is_the_path_up_to_the_first_dot_of_the_base_name():
    assert split_key("a.b/000123.seg.png") == ("a.b/000123", "seg.png")
    assert split_key("000123.jpg") == ("000123", "jpg")
    assert split_key("noext") is None
    assert split_key("__meta__") is None and split_key("d/__info__") is None


def test_index_written_atomically_reads_back(tmp_path):
    info = shard_info("shard-000000.tar", 4096, [Member("a", "jpg", 512, 10), Member("a", "cls", 1536, 1),
                                                  Member("b", "jpg", 2560, 3)])
    path = write_index(tmp_path, [info])
    assert os.path.basename(path) == INDEX_NAME
    doc = json.loads(open(path).read())
    assert doc["format"] == "ucmagic.shards" and doc["version"] == 1
    assert doc["shards"][0]["members"][0] == ["a", "jpg", 512, 10]
    assert read_index(tmp_path) == [info]
    assert info.samples == 2
    assert [n for n in os.listdir(tmp_path)] == [INDEX_NAME]  # no temp file left


def test_a_foreign_index_file_is_refused(tmp_path):
    (tmp_path / INDEX_NAME).write_text('{"format": "litdata"}')
    with pytest.raises(ValueError, match="not a ucmagic shard index"):
        read_index(tmp_path)
