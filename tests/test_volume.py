import os

import pytest

from ucmagic.errors import EmptyListingError, NotADirectoryErrorUC, SourceNotFoundError
from ucmagic.volume import (FileEntry, FsspecVolume, LocalVolume, compile_pattern, filter_entries,
                            listing_fingerprint, open_volume, resolve_local_path)


@pytest.mark.parametrize("pattern,path,ok", [
    ("**/*.jpg", "a/b/c.jpg", True), ("**/*.jpg", "c.jpg", True), ("*.jpg", "deep/er/x.jpg", True),
    ("*.jpg", "x.png", False), ("train/*.txt", "train/a.txt", True), ("train/*.txt", "train/sub/a.txt", False),
    ("train/**", "train/sub/a.txt", True), ("img_??.png", "img_01.png", True), ("img_??.png", "img_1.png", False),
    ("[ab]*.bin", "a1.bin", True), ("[!ab]*.bin", "a1.bin", False), ("/top.txt", "top.txt", True),
    ("a+b.txt", "a+b.txt", True), ("a+b.txt", "aab.txt", False),
])
def test_glob_patterns(pattern, path, ok):
    assert bool(compile_pattern(pattern).match(path)) is ok


def test_listing_is_recursive_sorted_with_size_and_mtime(tree):
    root, rels = tree
    entries = LocalVolume(root).list()
    assert [e.path for e in entries] == sorted(rels)
    assert all(e.size == 3000 for e in entries)
    st = os.stat(os.path.join(root, entries[0].path))
    assert entries[0].mtime == st.st_mtime


def test_listing_with_pattern_and_symlinked_file(tree, tmp_path):
    root, rels = tree
    (tmp_path / "outside.txt").write_text("x")
    os.symlink(tmp_path / "outside.txt", os.path.join(root, "link.txt"))
    os.symlink(tmp_path / "missing", os.path.join(root, "dangling.txt"))
    got = LocalVolume(root).list("*.txt")
    assert [e.path for e in got] == ["link.txt"]


def test_empty_match_names_path_and_pattern(tree):
    root, _ = tree
    with pytest.raises(EmptyListingError) as e:
        LocalVolume(root).list("*.jpeg")
    assert root in str(e.value) and "*.jpeg" in str(e.value)


def test_open_volume_errors(tmp_path):
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        open_volume(str(tmp_path / "nope"))
    f = tmp_path / "file.bin"
    f.write_bytes(b"1")
    with pytest.raises(NotADirectoryErrorUC, match="is a file"):
        open_volume(str(f))
    with pytest.raises(SourceNotFoundError):
        open_volume("memory://no/such/dir")


def test_volumes_path_maps_to_catalog_root(tmp_path, monkeypatch):
    monkeypatch.setenv("UCMAGIC_CATALOG_ROOT", str(tmp_path))
    real = tmp_path / "main" / "ml" / "volumes" / "imgs" / "train"
    real.mkdir(parents=True)
    (real / "a.bin").write_bytes(b"abc")
    assert resolve_local_path("/Volumes/main/ml/imgs/train") == str(real)
    vol = open_volume("/Volumes/main/ml/imgs/train")
    assert [e.path for e in vol.list()] == ["a.bin"]


def test_volumes_path_without_catalog_root_explains(monkeypatch):
    monkeypatch.delenv("UCMAGIC_CATALOG_ROOT", raising=False)
    with pytest.raises(SourceNotFoundError, match="UCMAGIC_CATALOG_ROOT"):
        open_volume("/Volumes/nocat/noschema/novol")


def test_file_url_and_fsspec_memory(tmp_path, tree):
    root, rels = tree
    assert isinstance(open_volume("file://" + root), LocalVolume)
    import fsspec

    fs = fsspec.filesystem("memory")
    fs.pipe({"/bucket/ds/a/x.bin": b"12345", "/bucket/ds/y.bin": b"1"})
    vol = open_volume("memory://bucket/ds")
    assert isinstance(vol, FsspecVolume)
    entries = vol.list()
    assert [(e.path, e.size) for e in entries] == [("a/x.bin", 5), ("y.bin", 1)]
    dest = tmp_path / "copy"
    assert vol.copy_to("a/x.bin", str(dest)) == 5
    assert dest.read_bytes() == b"12345"


def test_copy_to_local(tree, tmp_path):
    root, rels = tree
    dest = tmp_path / "c.bin"
    assert LocalVolume(root).copy_to(rels[3], str(dest)) == 3000
    assert dest.read_bytes().startswith(rels[3].encode())


def test_fingerprint_changes_with_listing():
    a = [FileEntry("a", 1, 0.0), FileEntry("b", 2, 0.0)]
    assert listing_fingerprint(a) == listing_fingerprint(list(a))
    assert listing_fingerprint(a) != listing_fingerprint(a[:1])
    assert listing_fingerprint(a) != listing_fingerprint([FileEntry("a", 1, 0.0), FileEntry("b", 3, 0.0)])
    assert [e.path for e in filter_entries(reversed(a), None)] == ["a", "b"]
