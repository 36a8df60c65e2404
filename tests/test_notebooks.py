"""The example notebooks are committed clean and self-contained.

They are executed by nbval, from the repository root::

    python -m pytest --nbval-lax --nbval-current-env notebooks/

``notebooks/conftest.py`` fails a notebook that leaves a ``ucmagic-*`` entry in the temp dir once
its kernel is stopped; the tests here check how they are committed.
"""
from __future__ import annotations

import json
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
