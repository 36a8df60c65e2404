"""Yielded paths keep the source's relative path: folder-name labels, extensions, a way back to the source."""
import os
import tempfile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic.cache import (
    NAME_MAX,
    entry_file,
    entry_files,
    entry_name,
    map_relpath,
    parse_entry_name,
    unmap_relpath,
)

# components users and object stores produce, plus every kind of hostile one
_parts = st.one_of(
    st.sampled_from(["", ".", "..", "%~", "%~#", "%", "#", "a%20b.jpg", "img.jpg", "\udcff", "x" * 255,
                     "y" * 256 + ".png", "é" * 128, "a\nb", "\x7f", "%~..", "class3"]),
    st.text(max_size=12),
    st.text(alphabet=st.characters(codec=None), max_size=80),
    st.text(alphabet="ab.%~#/\x00\n", max_size=8),
)
_rels = st.lists(_parts, min_size=1, max_size=6).map("/".join)


def _valid_name_parts(mapped: str) -> bool:
    parts = mapped.split("/")
    return all(p not in ("", ".", "..") and "\0" not in p and
               len(p.encode("utf-8", "surrogateescape")) <= NAME_MAX for p in parts)


@given(_rels)
@settings(max_examples=300)
def test_a_mapped_path_is_valid_stays_inside_its_entry_and_inverts(rel):
    mapped = map_relpath(rel)
    assert _valid_name_parts(mapped)
    entry = "/c/files/k-1"
    assert os.path.normpath(os.path.join(entry, mapped)).startswith(entry + "/")
    back = unmap_relpath(mapped)
    assert back is None or back == rel  # hashed components aside, the mapping is inverted exactly
    assert map_relpath(rel) == mapped  # deterministic
    assert entry_files(["k"], [1], [rel]) == [entry_file("k", ".x", 1, rel)] == [f"k-1/{mapped}"]


@given(_rels, _rels)
def test_distinct_relative_paths_map_to_distinct_paths(a, b):
    if a != b:
        assert map_relpath(a) != map_relpath(b)


@given(st.lists(_rels, min_size=1, max_size=4, unique=True))
@settings(max_examples=60, deadline=None)
def test_mapped_paths_are_file_names_linux_accepts(rels):
    with tempfile.TemporaryDirectory() as root:
        for i, rel in enumerate(rels):
            path = os.path.join(root, f"k{i}-1", map_relpath(rel))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(b"x")
            assert os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


@pytest.mark.parametrize("rel", ["train/class3/img.jpg", "a b/ü.png", "x.tar.gz", ".hidden/f", "a%20b.jpg",
                                 "\udcffraw/bytes.bin", "d/" + "n" * 255])
def test_plain_relative_paths_are_kept_as_they_are(rel):
    assert map_relpath(rel) == rel


def test_a_long_name_keeps_its_extension():
    mapped = map_relpath("train/" + "n" * 300 + ".jpg")
    assert mapped.startswith("train/%~#") and mapped.endswith(".jpg")
    assert len(mapped.rsplit("/", 1)[1]) <= NAME_MAX


def test_entry_names_carry_key_and_size():
    assert parse_entry_name(entry_name("ab12", 7)) == ("ab12", 7)
    assert parse_entry_name("ab12") is None and parse_entry_name("ab-x") is None and parse_entry_name("-3") is None
