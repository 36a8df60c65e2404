"""The package layout's promises to users: old module paths keep working for one release (same
module, a DeprecationWarning naming the new path), the public names and new paths never warn, and
``slow://`` reaches fsspec through the entry point, or the fallback when the metadata lacks it."""
from __future__ import annotations

import importlib
import importlib.util
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from unittest import mock

import pytest

from ucmagic._moved import MOVED

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, env_path: str) -> str:
    env = {**os.environ, "PYTHONPATH": env_path}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_every_deprecated_path_the_release_notes_promise_is_mapped():
    promised = {"magics", "widget", "plots", "explorer", "parquet", "parquet_export", "parquet_dataset",
                "parquet_rows", "sources", "checkpoint", "checkpoint_storage", "checkpoint_format",
                "checkpoint_transfer", "demo"}
    assert set(MOVED) == {f"ucmagic.{m}" for m in promised}
    for new in MOVED.values():
        assert importlib.util.find_spec(new) is not None, new


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_old_module_path_gives_the_new_module_and_warns(old, new, monkeypatch):
    new_mod = importlib.import_module(new)
    monkeypatch.delitem(sys.modules, old, raising=False)
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} moved to {new}")) as rec:
        old_mod = importlib.import_module(old)
    assert old_mod is new_mod
    assert new_mod.__spec__.name == new            # the module keeps its own spec
    assert [w.filename for w in rec if issubclass(w.category, DeprecationWarning)] == [__file__]


def test_from_old_path_import_name_gives_the_same_object(monkeypatch):
    monkeypatch.delitem(sys.modules, "ucmagic.checkpoint", raising=False)
    with pytest.warns(DeprecationWarning, match="ucmagic.checkpoints.api"):
        from ucmagic.checkpoint import save_checkpoint
    from ucmagic.checkpoints import save_checkpoint as new
    assert save_checkpoint is new


def test_patching_through_an_old_path_patches_the_module_in_use(monkeypatch):
    from ucmagic.notebook import panel

    monkeypatch.delitem(sys.modules, "ucmagic.widget", raising=False)
    with pytest.warns(DeprecationWarning, match="ucmagic.notebook.panel"), \
            mock.patch("ucmagic.widget.format_size", return_value="patched"):
        assert panel.format_size(1) == "patched"
    assert panel.format_size(1) != "patched"


def test_object_pickled_under_an_old_module_path_unpickles(monkeypatch):
    from ucmagic.checkpoints.format import FileRecord

    monkeypatch.delitem(sys.modules, "ucmagic.checkpoint_format", raising=False)
    rec = FileRecord(size=345, crc32=12)
    data = pickle.dumps(rec, protocol=2)           # protocol 2 names classes as text: module\nname
    assert b"ucmagic.checkpoints.format\n" in data
    old = data.replace(b"ucmagic.checkpoints.format\n", b"ucmagic.checkpoint_format\n")
    with pytest.warns(DeprecationWarning, match="ucmagic.checkpoints.format"):
        back = pickle.loads(old)  # noqa: S301 - bytes made above
    assert type(back) is FileRecord and back == rec


def test_public_names_and_new_paths_import_without_deprecation_warnings():
    out = _run("""
        import pkgutil, warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as rec:
            warnings.simplefilter("always")
            import ucmagic
            for name in ucmagic.__all__:
                getattr(ucmagic, name)
            for m in pkgutil.walk_packages(ucmagic.__path__, "ucmagic."):
                if m.name not in ("ucmagic.__main__", "ucmagic.testing.slowfuse"):  # a CLI and a FUSE server
                    __import__(m.name)
            from IPython.core.interactiveshell import InteractiveShell
            InteractiveShell.instance().run_line_magic("load_ext", "ucmagic")
        moved = [str(w.message) for w in rec if "moved to" in str(w.message)]
        assert not moved, moved
        import sys
        from ucmagic._moved import MOVED
        print(sorted(m for m in sys.modules if m in MOVED))
    """, str(ROOT))
    assert out.strip() == "[]"   # no old path was imported by the package itself


def test_import_ucmagic_stays_light():
    out = _run("""
        import sys, ucmagic
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fsspec", "IPython", "pyarrow")
                     or m.startswith("ucmagic.")))
    """, str(ROOT))
    assert out.strip() == "['ucmagic._moved']"


def _entry_points_from_pyproject() -> dict[str, str]:
    tomllib = pytest.importorskip("tomllib")
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return meta["project"]["entry-points"]["fsspec.specs"]


def test_slow_protocol_comes_from_the_fsspec_entry_point(tmp_path):
    specs = _entry_points_from_pyproject()
    assert specs == {"slow": "ucmagic.testing:SlowFileSystem"}
    # what `pip install` writes: a dist-info with entry_points.txt, found on sys.path
    dist = tmp_path / "ucmagic_entry_point_check-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ucmagic-entry-point-check\nVersion: 0\n")
    (dist / "entry_points.txt").write_text("[fsspec.specs]\n" + "".join(f"{k} = {v}\n" for k, v in specs.items()))
    out = _run("""
        import sys, fsspec
        assert "slow" in fsspec.available_protocols()
        assert not [m for m in sys.modules if m.startswith("ucmagic")], "fsspec needed no ucmagic import"
        cls = fsspec.get_filesystem_class("slow")
        print(f"{cls.__module__}.{cls.__qualname__}")
    """, f"{tmp_path}{os.pathsep}{ROOT}")
    assert out.strip() == "ucmagic.testing.SlowFileSystem"


def test_slow_protocol_falls_back_when_the_entry_point_is_missing():
    out = _run("""
        from fsspec.registry import known_implementations
        import fsspec
        known_implementations.pop("slow", None)     # as in a source tree or an install made before the entry point
        assert "slow" not in fsspec.available_protocols()
        import ucmagic.volume
        cls = fsspec.get_filesystem_class("slow")
        print(f"{cls.__module__}.{cls.__qualname__}")
    """, str(ROOT))
    assert out.strip() == "ucmagic.testing.SlowFileSystem"


@pytest.mark.parametrize("package", ["ucmagic.tables", "ucmagic.checkpoints"])
def test_subpackage_names_resolve_to_their_modules(package):
    pkg = importlib.import_module(package)
    for name in pkg.__all__:
        value = getattr(pkg, name)
        home = importlib.import_module(f"{package}.{pkg._EXPORTS[name]}")
        assert value is getattr(home, name), name
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        getattr(pkg, "nope")
