"""Yielded paths keep the source's relative path: folder-name labels, extensions, a way back to the source."""
import dataclasses
import os
import tempfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic import NotAnEntryError, UCVolumeDataset
from ucmagic.files.cache import FileCache
from ucmagic.files.cache_layout import (NAME_MAX, entry_file, entry_files, map_relpath, old_entry_name, parse_old_entry,
                                       protection_name, space_of,
                                        unmap_relpath)
from ucmagic.files.cache_report import cache_command
from ucmagic.files.locks import process_tag
from ucmagic.files.dataset import SourceFile

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
    assert entry_files("v1", [rel]) == [entry_file("k", ".x", 1, rel, "v1")] == [f"v1/{mapped}"]


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


def test_old_layout_entry_names_are_recognised_for_reaping():
    key = "ab" * 20
    assert parse_old_entry(old_entry_name(key, 7)) == (key, 7)
    assert parse_old_entry("ab12-7") is None and parse_old_entry(key + "-x") is None and parse_old_entry("-3") is None


def test_every_version_of_a_file_is_protected_by_one_name():
    space = space_of("file:///data")
    assert protection_name(f"{space}/train/cat/1.jpg") == protection_name(f"{space}~0123456789abcdef/train/cat/1.jpg")
    assert protection_name("k/abc-5.chunk") == "k/abc-5.chunk"


# ---------------------------------------------------------------- through a dataset

CLASSES = ["cat", "dog", "zebra crossing"]


def _image_tree(root: str, per_class: int = 6) -> dict[str, bytes]:
    """train/<class>/<image>.jpg, torchvision ImageFolder's layout; returns rel -> bytes."""
    out = {}
    for c in CLASSES:
        for i in range(per_class):
            rel = f"train/{c}/img{i}.jpg"
            data = f"{rel}\n".encode() * (i + 1)
            os.makedirs(os.path.join(root, "train", c), exist_ok=True)
            with open(os.path.join(root, rel), "wb") as f:
                f.write(data)
            out[rel] = data
    return out


def _read(p: str) -> bytes:
    with open(p, "rb") as f:
        return f.read()


class LabelledImages(torch.utils.data.IterableDataset):
    """The seed's wrapper pattern (docs 003: a second IterableDataset over UCVolumeDataset's paths),
    labelling each file by its folder name as torchvision's ImageFolder does."""

    def __init__(self, path_dataset: UCVolumeDataset) -> None:
        self._path_dataset = path_dataset

    def __iter__(self):
        for local_path in self._path_dataset:
            label = CLASSES.index(os.path.basename(os.path.dirname(local_path)))
            yield label, _read(local_path)


def test_yielded_paths_end_with_the_source_path_in_every_epoch_and_process(tmp_path):
    src, cache = str(tmp_path / "src"), str(tmp_path / "cache")
    tree = _image_tree(src)
    ds = UCVolumeDataset(src, cache_dir=cache)
    first = list(ds)
    assert sorted(p.split(os.sep + "files" + os.sep, 1)[1].split(os.sep, 1)[1] for p in first) == sorted(tree)
    for p in first:
        rel = ds.source_of(p).rel
        assert p.endswith(os.sep + rel) and _read(p) == tree[rel]
        assert os.path.splitext(p)[1] == ".jpg"
    assert list(ds) == first  # the same paths next epoch
    again = UCVolumeDataset(src, cache_dir=cache)  # another dataset object, as in another process
    assert list(again) == first and again.stats()["misses"] == 0
    del ds, again
    assert all(_read(p) for p in first)  # readable after the loop and the dataset are gone


def test_source_of_maps_a_yielded_path_back_and_refuses_other_paths(tmp_path):
    src = str(tmp_path / "src")
    tree = _image_tree(src, per_class=2)
    ds = UCVolumeDataset(src, cache_dir=str(tmp_path / "cache"))
    for p in ds:
        s = ds.source_of(p)
        st = os.stat(os.path.join(src, s.rel))
        assert s == SourceFile(os.path.join(src, s.rel), s.rel, st.st_size, st.st_mtime) and s.rel in tree
        with pytest.raises(dataclasses.FrozenInstanceError):
            s.rel = "x"  # type: ignore[misc]
    other_src = str(tmp_path / "other")
    _image_tree(other_src, per_class=1)
    other = UCVolumeDataset(other_src, cache_dir=str(tmp_path / "cache"))
    foreign = next(iter(other))
    entry = os.path.dirname(os.path.dirname(os.path.dirname(foreign)))
    for bad in [foreign, "/etc/passwd", entry, foreign + ".x", foreign.replace(str(tmp_path / "cache"), "/x")]:
        with pytest.raises(NotAnEntryError, match="is not a cached file of"):
            ds.source_of(bad)


@pytest.mark.parametrize("loader", ["torch-0-fork", "torch-2-fork", "torch-2-spawn", "ucmagic-0-fork",
                                    "ucmagic-2-fork"])
def test_folder_name_labels_in_the_seed_wrapper_pattern_under_a_loader(tmp_path, loader):
    import ucmagic

    src = str(tmp_path / "src")
    tree = _image_tree(src)
    wrapped = LabelledImages(UCVolumeDataset(src, cache_dir=str(tmp_path / "cache")))
    kind, workers, start = loader.split("-")
    make = torch.utils.data.DataLoader if kind == "torch" else ucmagic.DataLoader
    kw = {"multiprocessing_context": start} if int(workers) else {}
    got = [item for batch in make(wrapped, batch_size=4, num_workers=int(workers), collate_fn=list, **kw)
           for item in batch]
    want = sorted((CLASSES.index(rel.split("/")[1]), data) for rel, data in tree.items())
    assert sorted(got) == want  # every file once, with the label of its folder


def test_a_rewritten_source_file_gets_a_fresh_copy_at_a_new_path(tmp_path):
    src, cache = str(tmp_path / "src"), str(tmp_path / "cache")
    _image_tree(src, per_class=1)
    rel = "train/cat/img0.jpg"
    old = {UCVolumeDataset(src, cache_dir=cache).source_of(p).rel: p for p in UCVolumeDataset(src, cache_dir=cache)}
    with open(os.path.join(src, rel), "wb") as f:
        f.write(b"new bytes, another size")
    os.utime(os.path.join(src, rel), (1, 1))
    ds = UCVolumeDataset(src, cache_dir=cache)
    new = {ds.source_of(p).rel: p for p in ds}
    assert new[rel] != old[rel] and new[rel].endswith(rel) and _read(new[rel]) == b"new bytes, another size"
    assert _read(old[rel]) == f"{rel}\n".encode()  # a reader of the old version still sees its own bytes
    assert all(new[r] == old[r] for r in new if r != rel)
    with pytest.raises(NotAnEntryError):
        ds.source_of(old[rel])  # no longer a file of the current listing


@pytest.mark.parametrize("change", ["rewritten", "file-became-folder"])
def test_a_file_that_went_beside_another_version_is_served_with_its_own_bytes_every_epoch(tmp_path, change):
    src, cache = str(tmp_path / "src"), str(tmp_path / "cache")
    _image_tree(src, per_class=1)
    old_ds = UCVolumeDataset(src, cache_dir=cache)
    old = {old_ds.source_of(p).rel: p for p in old_ds}  # cached; this process keeps the old listing
    rel = "train/cat/img0.jpg"
    if change == "rewritten":
        with open(os.path.join(src, rel), "wb") as f:
            f.write(b"rewritten")
        os.utime(os.path.join(src, rel), (1, 1))
    else:  # the file is gone and a folder of that name holds a file now
        os.unlink(os.path.join(src, rel))
        os.makedirs(os.path.join(src, rel))
        rel += "/inner.jpg"
        with open(os.path.join(src, rel), "wb") as f:
            f.write(b"rewritten")
    ds = UCVolumeDataset(src, cache_dir=cache)
    for epoch in range(3):  # the second and third epochs take the warm path
        got = {ds.source_of(p).rel: _read(p) for p in ds}
        assert got[rel] == b"rewritten" and len(got) == 3
    assert _read(old["train/cat/img0.jpg"]) == b"train/cat/img0.jpg\n"  # the old copy keeps its bytes


def test_hostile_names_stay_inside_the_cache_and_map_back(tmp_path):
    src = str(tmp_path / "src")
    names = ["%~a/b.jpg", "line\nbreak/x.png", "tab\there.txt", "..dots/...", "%~#x", "ok/%20name.bin", "\x7fdel"]
    for i, rel in enumerate(names):
        os.makedirs(os.path.dirname(os.path.join(src, rel)), exist_ok=True)
        with open(os.path.join(src, rel), "wb") as f:
            f.write(bytes([i]) * (i + 1))
    ds = UCVolumeDataset(src, cache_dir=str(tmp_path / "cache"))
    files = os.path.realpath(os.path.join(ds.cache.root, "files")) + os.sep
    seen = {}
    for p in ds:
        assert os.path.realpath(p).startswith(files)
        seen[ds.source_of(p).rel] = _read(p)
    assert seen == {rel: bytes([i]) * (i + 1) for i, rel in enumerate(names)}


def _old_entry(cache: FileCache, name: str) -> str:
    bucket = os.path.join(cache.root, "data", name[:2])
    os.makedirs(bucket, exist_ok=True)
    with open(os.path.join(bucket, name), "wb") as f:
        f.write(b"old layout")
    return os.path.join(bucket, name)


def test_entries_of_the_old_layout_are_reaped_unless_a_live_process_protects_them(tmp_path):
    src, root = str(tmp_path / "src"), str(tmp_path / "cache")
    _image_tree(src, per_class=1)
    cache = FileCache(root)
    gone = _old_entry(cache, "ab" + "0" * 38 + ".jpg")
    held = _old_entry(cache, "cd" + "1" * 38 + ".jpg")  # named by a record of a live (older) process
    # the layout of the last release: files/<key>-<size>/<relative path>, a folder per file version
    gone_dir, held_dir = (os.path.join(root, "files", old_entry_name(c * 40, 10)) for c in "ef")
    for d in (gone_dir, held_dir):
        os.makedirs(os.path.join(d, "train", "cat"))
        with open(os.path.join(d, "train", "cat", "img0.jpg"), "wb") as f:
            f.write(b"x" * 10)
    rec = cache.records.record_path(process_tag(), 0)
    cache.records.write_record(rec, [os.path.basename(held), os.path.basename(held_dir)])
    assert "other" in cache_command("info", root)
    ds = UCVolumeDataset(src, cache_dir=root)  # a new dataset reaps what no live process protects
    assert not os.path.exists(gone) and not os.path.exists(os.path.dirname(gone)) and os.path.exists(held)
    assert not os.path.exists(gone_dir) and os.path.exists(held_dir)
    assert all(os.sep + "files" + os.sep + ds.space + os.sep in p for p in ds)  # never served from the old layouts
    assert cache.usage().files == len(list(ds))  # the old layouts' bytes count as other, not as entries
    cache.records.drop_record(rec)
    assert "2 old-layout" in cache_command("prune", root)
    assert not os.path.exists(os.path.join(root, "data")) and not os.path.exists(held_dir)


def test_budget_eviction_and_clear_remove_whole_entries(tmp_path):
    src, root = str(tmp_path / "src"), str(tmp_path / "cache")
    tree = _image_tree(src, per_class=40)  # 120 files
    ds = UCVolumeDataset(src, cache_dir=root)
    list(ds)
    cache = FileCache(root)
    cache.records.drop_records(process_tag(), dead_writers_only=False)  # the loop's last items are released
    u = cache.usage()
    assert u.files == len(tree) and u.bytes == sum(map(len, tree.values()))
    files = os.path.join(root, "files")
    freed = cache.evict(keep_below=u.total_bytes - u.bytes // 2)
    left = {os.path.relpath(os.path.join(d, f), src_dir) for src_dir in [os.path.join(files, ds.space)]
            for d, _, fs in os.walk(src_dir) for f in fs}
    assert freed >= u.bytes // 2 - 1000 and 0 < len(left) < len(tree)
    for rel in left:  # what stays is whole: each file at its relative path, with its bytes
        with open(os.path.join(files, ds.space, rel), "rb") as f:
            assert f.read() == tree[rel]
    assert os.listdir(os.path.join(root, "tmp")) == []  # nothing half-removed left behind
    assert "removed" in cache_command("clear", root)
    assert os.listdir(files) == [] and cache.usage().files == 0  # the folders left empty went too
    assert sorted(ds.source_of(p).rel for p in ds) == sorted(tree)  # filled again, at the same paths
