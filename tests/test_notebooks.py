"""The example notebooks are committed clean and self-contained.

They are executed by nbval, from the repository root::

    python -m pytest --nbval-lax --nbval-current-env notebooks/

(``UCMAGIC_RUN_NOTEBOOKS=1 python -m pytest tests/test_notebooks.py`` runs that command too.)
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))
EXPECTED = {"01_quickstart", "02_tables_parquet", "03_checkpoints", "04_staging_and_distributed"}


def _code_cells(path: Path) -> list[dict]:
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def test_every_example_notebook_is_there():
    assert {p.stem for p in NOTEBOOKS} >= EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    for cell in _code_cells(path):
        assert cell.get("outputs") == [] and cell.get("execution_count") is None, f"{path.name}: clear outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_self_contained_and_strict(path):
    cells = ["".join(c["source"]) for c in _code_cells(path)]
    first = cells[0]
    assert 'os.environ["UCMAGIC_RAISE"] = "1"' in first, "the first code cell must set UCMAGIC_RAISE=1"
    assert "tempfile.mkdtemp" in first and "UCMAGIC_CACHE_DIR" in first, "work in a temp dir with a private cache"
    text = "\n".join(cells)
    assert "%load_ext ucmagic" in text
    assert "assert " in text, "each notebook checks its own results"
    assert "/work/" not in text and "~/" not in text, "no machine-specific paths"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_last_cell_removes_the_work_directory(path):
    last = "".join(_code_cells(path)[-1]["source"])
    assert "shutil.rmtree(work)" in last and "assert not os.path.exists(work)" in last


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_a_run_leaves_nothing_in_the_temp_dir(path, tmp_path, monkeypatch):
    """Run the notebook as a user would (a fresh kernel, the library's default staging), with the temp dir
    pointed at an empty directory: afterwards no ucmagic-* entry is left there."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the kernel's temp dir (its tempfile.gettempdir())
    monkeypatch.delenv("UCMAGIC_STAGING_DIR", raising=False)  # as by hand: <tmp>/ucmagic-ckpt-<uid>
    for name in ("UCMAGIC_CACHE_DIR", "UCMAGIC_PROGRESS"):  # the test session's settings, not a user's
        monkeypatch.delenv(name, raising=False)
    nb = nbformat.read(str(path), as_version=4)
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent.parent)}}).execute()
    left = sorted(n for n in os.listdir(temp) if n.startswith("ucmagic"))
    assert left == [], f"{path.name} left {left} in the temp dir"
