"""ucmagic.load and describe_load: one call from a source to a loader or a DataFrame, as %ucload builds."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import ucmagic
from ucmagic.api import LoadPlan, describe_load
from ucmagic.errors import LoadUsageError, SourceNotFoundError
from ucmagic.testing import make_files


@pytest.fixture
def tables_dir(tmp_path):
    d = tmp_path / "pq"
    d.mkdir()
    for i, n in enumerate((30, 20)):
        pq.write_table(pa.table({"x": list(range(n)), "y": [float(v) for v in range(n)]}), str(d / f"p{i}.parquet"))
    return d


def test_load_a_directory_of_files_gives_a_loader_over_every_file(tmp_path):
    make_files(str(tmp_path / "f"), 10, 64)
    loader = ucmagic.load(tmp_path / "f", batch_size=4, num_workers=0, cache_dir=str(tmp_path / "c"),
                          log_to_mlflow=False)
    assert isinstance(loader, ucmagic.DataLoader)
    assert sum(len(b) for b in loader) == 10


def test_load_a_table_gives_a_dataframe_and_stream_gives_a_loader(tables_dir, tmp_path):
    df = ucmagic.load(str(tables_dir), rows=5, columns=["x"])
    assert list(df.columns) == ["x"] and len(df) == 5
    loader = ucmagic.load(str(tables_dir), stream=True, batch_size=16, num_workers=0,
                          cache_dir=str(tmp_path / "c"), log_to_mlflow=False)
    assert sum(len(b["x"]) for b in loader) == 50


def test_load_refuses_options_that_do_not_fit_the_source(tables_dir, tmp_path):
    make_files(str(tmp_path / "f"), 3, 10)
    with pytest.raises(LoadUsageError, match="rows=/--rows applies to tables"):
        ucmagic.load(str(tmp_path / "f"), rows=3)
    with pytest.raises(LoadUsageError, match="add --stream"):
        ucmagic.load(str(tables_dir), batch_size=8)
    with pytest.raises(LoadUsageError, match="the glob with -p"):
        ucmagic.load(str(tmp_path / "f" / "*.bin"))
    with pytest.raises(SourceNotFoundError, match="does not exist"):
        ucmagic.load(str(tmp_path / "missing"))


def test_on_start_is_called_once_with_the_kind_before_a_loader_is_built(tmp_path):
    make_files(str(tmp_path / "f"), 3, 10)
    kinds = []
    ucmagic.load(str(tmp_path / "f"), num_workers=0, cache_dir=str(tmp_path / "c"), on_start=kinds.append,
                 log_to_mlflow=False)
    assert kinds == ["files"]


def test_describe_load_counts_without_loading(tables_dir, tmp_path):
    make_files(str(tmp_path / "f"), 4, 100)
    plan = describe_load(str(tmp_path / "f"), pattern="*")
    assert (plan.kind, plan.files, plan.bytes, plan.rows) == ("files", 4, 400, None)
    plan = describe_load(str(tables_dir))
    assert (plan.kind, plan.files, plan.rows) == ("table", 2, 50)
    assert describe_load(str(tables_dir), files=True).kind == "files"
    assert "rows: 50" in plan.describe() and isinstance(plan, LoadPlan)
