"""A damaged or compressed shard is refused with the real problem: which file, which member, at which byte,
and for compressed tars how to decompress them. One property over generated tars cut at every kind of offset."""
from __future__ import annotations

import bz2
import gzip
import io
import lzma
import os
import shutil
import tarfile
import tempfile

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucmagic.errors import ShardFormatError
from ucmagic.shards import TarShards
from ucmagic.shards.index import scan_tar

EXAMPLES = 600 if os.environ.get("UCMAGIC_MATRIX") == "full" else 60

KINDS = ["{k}.jpg", "{k}.cls", "{k}.seg.png", "{long}/{k}.txt", "dé☃/{k}.json"]  # long and non-ASCII: pax/GNU


def member_name(kind: int, k: int) -> str:
    return KINDS[kind].format(k=f"{k:06d}", long="d" * (90 + k % 40))


def build(members: list[tuple[str, int]], fmt: int) -> tuple[bytes, list[tuple[str, int, int, int]]]:
    """A tar of ``members`` (name, size) and each member's (name, header offset, data offset, size)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, size in members:
            ti = tarfile.TarInfo(name)
            ti.size = size
            tf.addfile(ti, io.BytesIO(bytes(range(256)) * (size // 256 + 1)))
    raw = buf.getvalue()
    with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tf:
        layout = [(m.name, m.offset, m.offset_data, m.size) for m in tf.getmembers()]
    return raw, layout


@st.composite
def cut_tars(draw: st.DrawFn) -> tuple[list, int, int, int]:
    """Members (name, size), a tar format, and where to cut: a random byte, or just inside / at the edge of one
    member's header or data (the tar is built in the test: a failing example prints short)."""
    sizes = st.sampled_from([0, 1, 511, 512, 513, 3000])
    members = [(member_name(draw(st.integers(0, len(KINDS) - 1)), k), draw(sizes))
               for k in range(draw(st.integers(1, 4)))]
    fmt = draw(st.sampled_from([tarfile.PAX_FORMAT, tarfile.GNU_FORMAT]))
    return members, fmt, draw(st.integers(0, len(members) - 1)), draw(st.integers(-1, 7))


def cut_at(raw: bytes, layout: list, which: int, how: int) -> int:
    _, h, d, n = layout[which]
    cut = [h, h + 1, h + 511, d, d + 1, d + n - 1, d + n, d + n + 1][how] if how >= 0 else len(raw) * 7 // 13
    return max(1, min(cut, len(raw)))


@pytest.mark.timeout(300)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cut_tars())
def test_a_cut_tar_gives_its_complete_members_or_an_error_naming_the_cut(case):
    members, fmt, which, how = case
    raw, layout = build(members, fmt)
    cut = cut_at(raw, layout, which, how)
    root = tempfile.mkdtemp(prefix="ucm-tar-")
    try:
        path = os.path.join(root, "shard.tar")
        with open(path, "wb") as f:
            f.write(raw[:cut])
        inside = [(name, h, d, n) for name, h, d, n in layout if h < cut < d + n]  # a header or data cut through
        try:
            got = scan_tar(path)
        except ShardFormatError as exc:
            msg = str(exc)
            assert path in msg and "truncated" in msg and str(cut) in msg, msg
            if inside and inside[0][2] < cut:  # cut inside its data: the member and its data offset are named
                assert repr(inside[0][0]) in msg and f"from byte {inside[0][2]}" in msg, msg
            return
        assert not inside, f"cut at {cut} inside {inside[0]} went unnoticed"
        complete = [(d, n) for _, _, d, n in layout if d + n <= cut]
        assert [(m.offset, m.size) for m in got] == complete
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_a_truncated_shard_names_the_file_the_member_and_the_bytes_missing(tmp_path):
    raw, layout = build([("000001.jpg", 5000), ("000002.jpg", 5000)], tarfile.PAX_FORMAT)
    (tmp_path / "s").mkdir()
    name, _, data, size = layout[1]
    (tmp_path / "s" / "a.tar").write_bytes(raw[:data + 100])
    with pytest.raises(ShardFormatError) as err:
        TarShards(tmp_path / "s", cache_dir=str(tmp_path / "c"))
    msg = str(err.value)
    assert str(tmp_path / "s" / "a.tar") in msg and "is truncated: member '000002.jpg'" in msg
    assert f"{size} bytes of data from byte {data}" in msg and f"({size - 100} bytes missing)" in msg
    assert "decompress" not in msg


@pytest.mark.parametrize("compress, tool", [(gzip.compress, "gzip -dc"), (bz2.compress, "bzip2 -dc"),
                                            (lzma.compress, "xz -dc")])
def test_a_compressed_tar_named_tar_says_which_compression_and_the_command(tmp_path, compress, tool):
    raw, _ = build([("000001.jpg", 100)], tarfile.PAX_FORMAT)
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.tar").write_bytes(compress(raw))
    with pytest.raises(ShardFormatError) as err:
        TarShards(tmp_path / "s", cache_dir=str(tmp_path / "c"))
    msg = str(err.value)
    assert "compressed tars are refused" in msg and f"{tool} {tmp_path / 's' / 'a.tar'} > " in msg


def test_a_folder_of_only_compressed_tars_names_them_and_how_to_decompress(tmp_path):
    raw, _ = build([("000001.jpg", 100)], tarfile.PAX_FORMAT)
    (tmp_path / "s").mkdir()
    for i in range(3):
        (tmp_path / "s" / f"shard-{i}.tar.gz").write_bytes(gzip.compress(raw))
    with pytest.raises(ShardFormatError) as err:
        TarShards(tmp_path / "s", cache_dir=str(tmp_path / "c"))
    msg = str(err.value)
    assert "only compressed tars (shard-0.tar.gz and 2 more)" in msg and "compressed tars are refused" in msg
    assert f"gzip -dc {tmp_path / 's' / 'shard-0.tar.gz'} > {tmp_path / 's' / 'shard-0.tar'}" in msg
    with pytest.raises(ShardFormatError, match="is a gzip-compressed tar"):  # picked by pattern=: the same refusal
        TarShards(tmp_path / "s", pattern="*.tar.gz", cache_dir=str(tmp_path / "c"))


def test_a_folder_without_tars_says_how_to_make_shards(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "a.jpg").write_bytes(b"x")
    with pytest.raises(ShardFormatError, match=r"no tar shards \(\*\*/\*\.tar\) under .*ucmagic\.pack"):
        TarShards(tmp_path / "s", cache_dir=str(tmp_path / "c"))


def test_a_damaged_header_names_its_byte_and_the_member_before(tmp_path):
    raw, layout = build([("000001.jpg", 600), ("000002.jpg", 10)], tarfile.USTAR_FORMAT)
    bad = bytearray(raw)
    h = layout[1][1]
    bad[h + 148:h + 156] = b"9999999\0"  # the second header's checksum
    path = tmp_path / "a.tar"
    path.write_bytes(bytes(bad))
    with pytest.raises(ShardFormatError, match=rf"damaged: no valid tar header at byte {h} \(after member '000001"):
        scan_tar(path)
