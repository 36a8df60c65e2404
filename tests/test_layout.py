"""The package layout's promises to users: every public name and module imports without a
DeprecationWarning from ucmagic's own code, ``import ucmagic`` loads no ucmagic module, the module
paths of before the subpackages are gone (no shim), and ``slow://`` reaches fsspec through the
entry point, or the fallback when the metadata lacks it."""
from __future__ import annotations

import importlib
import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, env_path: str) -> str:
    env = {**os.environ, "PYTHONPATH": env_path}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_public_names_and_modules_import_without_deprecation_warnings_from_ucmagic():
    out = _run("""
        import os, pkgutil, warnings
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
        home = os.path.dirname(ucmagic.__file__) + os.sep
        print([str(w.message) for w in rec if issubclass(w.category, DeprecationWarning)
               and w.filename.startswith(home)])
    """, str(ROOT))
    assert out.strip() == "[]"


@pytest.mark.parametrize("old", ["ucmagic.magics", "ucmagic.widget", "ucmagic.checkpoint", "ucmagic.parquet",
                                 "ucmagic.demo"])
def test_module_paths_of_before_the_subpackages_are_gone(old):
    assert importlib.util.find_spec(old) is None


def test_import_ucmagic_stays_light():
    out = _run("""
        import sys, ucmagic
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "fsspec", "IPython", "pyarrow")
                     or m.startswith("ucmagic.")))
    """, str(ROOT))
    assert out.strip() == "[]"


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
        import ucmagic.files.volume
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
