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


@pytest.fixture
def magic_shell(tmp_path, monkeypatch):
    """A real IPython shell with ``%load_ext ucmagic``, a local catalog in tmp, and whatever the test
    binds removed afterwards. Tests choose UCMAGIC_RAISE themselves (UsageError lines or exceptions)."""
    pytest.importorskip("IPython")
    from IPython.core.interactiveshell import InteractiveShell

    monkeypatch.setenv("UCMAGIC_CATALOG_ROOT", str(tmp_path / "catalog"))
    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "ucmagic")
    before = set(shell.user_ns)
    yield shell
    for name in set(shell.user_ns) - before:
        shell.user_ns.pop(name, None)
    shell.run_line_magic("unload_ext", "ucmagic")
