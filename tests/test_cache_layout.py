"""Keys, suffixes and the cache directory (ucmagic.files.cache_layout)."""
import os
import stat

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from ucmagic.files.cache import FileCache
from ucmagic.files.cache_layout import cache_key, cache_keys, safe_suffix, version_stamp, version_stamps


def test_cache_dir_is_private(tmp_path):
    root = tmp_path / "c"
    root.mkdir(mode=0o777)
    os.chmod(root, 0o777)
    FileCache(str(root))
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o700


def test_key_depends_on_volume_path_size_and_mtime():
    k = cache_key("file:///v", "a/b.jpg", 10, 1.5)
    assert k == cache_key("file:///v", "a/b.jpg", 10, 1.5)
    assert len({k, cache_key("file:///w", "a/b.jpg", 10, 1.5), cache_key("file:///v", "a/c.jpg", 10, 1.5),
                cache_key("file:///v", "a/b.jpg", 11, 1.5), cache_key("file:///v", "a/b.jpg", 10, 1.6)}) == 5


@pytest.mark.parametrize("name,suffix", [("a/b.jpg", ".jpg"), ("x.tar.gz", ".gz"), ("noext", ""),
                                         ("../../etc/passwd", ""), ("evil.$(rm)", ""), ("dir.d/file", "")])
def test_suffix_is_sanitised(name, suffix):
    assert safe_suffix(name) == suffix


@given(st.lists(st.tuples(st.text(alphabet="ab./-_ $é\udcff", max_size=12), st.integers(0, 10**12),
                          st.floats(allow_nan=False, allow_infinity=False)), max_size=20))
def test_keys_of_a_chunk_are_the_keys_of_each_file(files):
    assert cache_keys("file:///v", files) == [(cache_key("file:///v", r, s, m), safe_suffix(r)) for r, s, m in files]


@given(st.lists(st.binary(min_size=20, max_size=20), max_size=40))
def test_stamps_of_a_chunk_are_the_stamps_of_each_key(digests):
    """A warm run's stamps, from the listing's key bytes at once, are each key's own version stamp."""
    rows = np.frombuffer(b"".join(digests), dtype=np.uint8).reshape(-1, 20)
    assert version_stamps(rows) == [version_stamp(d.hex()) for d in digests]
