import os

import pytest


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    """Every test gets its own cache directory (nothing touches ~/.cache), magics raise real
    exceptions, no live display. Set per test, so the notebooks (run by nbval in the same
    session) see the environment a user has."""
    monkeypatch.setenv("UCMAGIC_CACHE_DIR", str(tmp_path / "ucmagic-cache"))
    monkeypatch.setenv("UCMAGIC_RAISE", os.environ.get("UCMAGIC_RAISE", "1"))
    monkeypatch.setenv("UCMAGIC_PROGRESS", os.environ.get("UCMAGIC_PROGRESS", "off"))
    monkeypatch.setenv("MPLBACKEND", "Agg")


@pytest.fixture
def tree(tmp_path):
    """A nested tree of 120 files of 3000 bytes; returns (root, relative paths)."""
    from ucmagic.testing import make_files

    root = tmp_path / "volume"
    rels = make_files(str(root), 120, 3000, per_dir=25)
    return str(root), rels
