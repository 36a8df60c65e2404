import os

import pytest

os.environ.setdefault("UCMAGIC_RAISE", "1")
os.environ.setdefault("UCMAGIC_PROGRESS", "off")
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own cache directory; nothing touches ~/.cache."""
    monkeypatch.setenv("UCMAGIC_CACHE_DIR", str(tmp_path / "ucmagic-cache"))


@pytest.fixture
def tree(tmp_path):
    """A nested tree of 120 files of 3000 bytes; returns (root, relative paths)."""
    from ucmagic.testing import make_files

    root = tmp_path / "volume"
    rels = make_files(str(root), 120, 3000, per_dir=25)
    return str(root), rels
