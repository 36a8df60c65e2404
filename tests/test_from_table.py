"""Labels from a table, files from a volume (issue 44 item 6): ``ucmagic.files_from_table``.

Every item is ``{"path": <cached copy>, <field>: value}``; each generated file starts with its own
relative path, so a test checks that the fields delivered with a path are that file's row.
"""
from __future__ import annotations

import os

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ucmagic
from ucmagic.errors import (DuplicatePathError, FetchError, InvalidArgumentError, ListingChangedError,
                            NotAnEntryError, SourceChangedError, SourceNotFoundError, UnsafeSourceError)
from ucmagic.tables.volume_table import duplicate_rows, relative_paths

N = 24


def head(path: str) -> str:
    with open(path, "rb") as f:
        return f.read().split(b"\n", 1)[0].decode()


@pytest.fixture
def files(tmp_path):
    """N files under ``root/c<k>/``, each starting with its relative path; and the rows of a label table."""
    root = tmp_path / "vol"
    rels = [f"c{i % 3}/img{i:03d}.bin" for i in range(N)]
    for i, rel in enumerate(rels):
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rel.encode() + b"\n" + bytes(100 + i))
    rows = {"path": rels, "label": [i % 3 for i in range(N)], "id": list(range(N)),
            "split": ["val" if i % 4 == 0 else "train" for i in range(N)]}
    return str(root), rels, rows


def check_items(items, rels, rows):
    """Each item's fields are its own file's row; returns the relative paths delivered."""
    got = []
    for it in items:
        rel = head(it["path"])
        i = rels.index(rel)
        assert it["id"] == rows["id"][i] and it["label"] == rows["label"][i], it
        got.append(rel)
    return got


def test_a_pandas_dataframe_of_relative_paths_yields_each_file_once_with_its_row(files):
    import pandas as pd

    root, rels, rows = files
    ds = ucmagic.files_from_table(pd.DataFrame(rows), root=root, columns=["label", "id"])
    assert isinstance(ds, ucmagic.TableFilesDataset) and isinstance(ds, ucmagic.UCVolumeDataset)
    items = list(ds)
    assert sorted(check_items(items, rels, rows)) == sorted(rels)
    assert set(items[0]) == {"path", "label", "id"}
    assert [head(it["path"]) for it in items] == sorted(rels)  # unshuffled: the sorted listing's order
    assert ds.stats()["misses"] == N
    assert ds.source_of(items[0]["path"]).rel == head(items[0]["path"])
    assert ds.row_of(items[0]["path"]) == items[0]
    with pytest.raises(NotAnEntryError):
        ds.row_of(os.path.join(root, rels[0]))  # the source file itself is no cached entry
    again = list(ucmagic.files_from_table(pd.DataFrame(rows), root=root, columns=["label", "id"]))
    assert [it["path"] for it in again] == [it["path"] for it in items]  # the cache serves a second dataset


def test_a_parquet_directory_of_absolute_paths_finds_its_root(files, tmp_path):
    root, rels, rows = files
    table = tmp_path / "labels"
    table.mkdir()
    absolute = {**rows, "path": [os.path.join(root, r) for r in rels]}
    pq.write_table(pa.table(absolute).slice(0, 10), str(table / "part-0.parquet"))
    pq.write_table(pa.table(absolute).slice(10), str(table / "part-1.parquet"))
    ds = ucmagic.files_from_table(str(table), columns=["id", "label"])  # root: the files' common folder
    assert ds.volume.display() == root
    assert sorted(check_items(ds, rels, rows)) == sorted(rels)
    val = ucmagic.files_from_table(str(table), columns=["id", "label"], filter=pc.field("split") == "val")
    assert sorted(check_items(val, rels, rows)) == sorted(r for i, r in enumerate(rels) if rows["split"][i] == "val")
    mixed = {**rows, "path": [os.path.join(root, r) if i % 2 else r for i, r in enumerate(rels)]}
    assert sorted(check_items(ucmagic.files_from_table(pa.table(mixed), root=root), rels, rows)) == sorted(rels)
    with pytest.raises(InvalidArgumentError, match="relative path 'c0/img000.bin' and root= is not set"):
        ucmagic.files_from_table(pa.table(mixed))


def test_a_delta_table_with_sizes_and_mtimes_is_not_stated_and_a_stale_row_is_refused(files, tmp_path, monkeypatch):
    deltalake = pytest.importorskip("deltalake")
    from ucmagic.files.volume import LocalVolume

    root, rels, rows = files
    sts = [os.stat(os.path.join(root, r)) for r in rels]
    table = pa.table({**rows, "size": [s.st_size for s in sts],
                      "modified": pa.array([s.st_mtime_ns // 1000 for s in sts], pa.timestamp("us"))})
    deltalake.write_deltalake(str(tmp_path / "delta"), table)
    calls = []
    real = LocalVolume.stat
    monkeypatch.setattr(LocalVolume, "stat", lambda self, rel: (calls.append(rel), real(self, rel))[1])
    ds = ucmagic.files_from_table(str(tmp_path / "delta"), root=root, columns=["label", "id"],
                                  size_column="size", mtime_column="modified")
    assert calls == []  # the listing came from the table
    assert sorted(check_items(ds, rels, rows)) == sorted(rels)
    # a table whose size is not the file's: refused at the copy, naming the columns
    wrong = table.set_column(table.column_names.index("size"), "size", pa.array([s.st_size + 1 for s in sts]))
    bad = ucmagic.files_from_table(wrong, root=root, size_column="size", mtime_column="modified",
                                   cache_dir=str(tmp_path / "other-cache"))
    with pytest.raises(SourceChangedError, match="size and mtime columns"):
        next(iter(bad))
    with pytest.raises(InvalidArgumentError, match="go together"):
        ucmagic.files_from_table(table, root=root, size_column="size")


def test_a_url_root_stat_or_sized_from_the_table(files):
    root, rels, rows = files
    url = "slow://" + root
    so = {"open_ms": 1, "list_ms": 1, "mbps": 0}
    absolute = pa.table({**rows, "path": [f"{url}/{r}" for r in rels]})
    with pytest.raises(InvalidArgumentError, match="pass root="):
        ucmagic.files_from_table(absolute, storage_options=so)
    stated = ucmagic.files_from_table(absolute, root=url, storage_options=so)
    assert sorted(check_items(stated, rels, rows)) == sorted(rels)
    sts = [os.stat(os.path.join(root, r)) for r in rels]
    sized = pa.table({**rows, "size": [st.st_size for st in sts], "mtime": [st.st_mtime for st in sts]})
    got = ucmagic.files_from_table(sized, root=url, size_column="size", mtime_column="mtime", storage_options=so,
                                   cache_dir=os.path.join(os.path.dirname(root), "c2"))
    assert sorted(check_items(got, rels, rows)) == sorted(rels) and got.stats()["misses"] == N


def test_filter_as_sql_and_as_a_pyarrow_expression_keep_the_same_rows(files):
    root, rels, rows = files
    table = pa.table(rows)
    by_sql = ucmagic.files_from_table(table, root=root, filter="split = 'train' AND label <> 2")
    by_expr = ucmagic.files_from_table(table, root=root,
                                       filter=(pc.field("split") == "train") & (pc.field("label") != 2))
    want = sorted(r for i, r in enumerate(rels) if rows["split"][i] == "train" and rows["label"][i] != 2)
    assert sorted(check_items(by_sql, rels, rows)) == want == sorted(check_items(by_expr, rels, rows))
    assert len(by_sql) == len(want)
    assert by_sql.volume.uri != ucmagic.files_from_table(table, root=root).volume.uri  # its own listing
    with pytest.raises(InvalidArgumentError, match="SQL predicate string"):
        ucmagic.files_from_table(table, root=root, filter=3)


def test_shuffled_resume_in_a_plain_loop_and_under_ucmagic_dataloader_delivers_the_rest(files):
    root, rels, rows = files
    table = pa.table(rows)

    def make():
        return ucmagic.files_from_table(table, root=root, shuffle=True, seed=5)

    ds = make()
    it = iter(ds)
    first = [head(next(it)["path"]) for _ in range(7)]
    state = ds.state_dict()
    del it
    ds2 = make()
    ds2.load_state_dict(state)
    rest = check_items(ds2, rels, rows)
    assert sorted(first + rest) == sorted(rels)
    assert first != sorted(rels)[:7]
    # ucmagic.DataLoader, 2 workers, dict batches (paths a list, labels a tensor); resumed on 1 worker
    loader = ucmagic.DataLoader(make(), batch_size=4, num_workers=2)
    got = []
    for n, batch in enumerate(loader, 1):
        assert isinstance(batch["path"], list) and batch["label"].dtype.is_floating_point is False
        got += [head(p) for p in batch["path"]]
        if n == 2:
            state = loader.state_dict()
            break
    del loader
    resumed = ucmagic.DataLoader(make(), batch_size=4, num_workers=1)
    resumed.load_state_dict(state)
    after = [head(p) for b in resumed for p in b["path"]]
    assert sorted(got + after) == sorted(rels)


def test_a_cache_budget_smaller_than_the_files_delivers_every_file_once(tmp_path):
    root = tmp_path / "big"
    rels = [f"c{i % 3}/f{i:02d}.bin" for i in range(24)]
    for r in rels:
        (root / r).parent.mkdir(parents=True, exist_ok=True)
        (root / r).write_bytes(r.encode() + b"\n" + bytes(20_000))
    ds = ucmagic.files_from_table(pa.table({"path": rels, "label": [i % 3 for i in range(24)]}), root=str(root),
                                  cache_limit=100_000)  # a fifth of the files
    seen, peak = [], 0
    for batch in ucmagic.DataLoader(ds, batch_size=2):
        seen += [head(p) for p in batch["path"]]
        peak = max(peak, ds.stats()["bytes_cached"])
    assert sorted(seen) == sorted(rels)
    assert peak < 24 * 20_000 // 2  # entries were evicted on the way


def test_a_wrapper_in_the_seeds_pattern_resumes_through_ucmagic_dataloader(files):
    import torch.utils.data as tud

    root, rels, rows = files

    class Decode(tud.IterableDataset):
        def __init__(self, ds):
            self.ds = ds

        def __iter__(self):
            for item in self.ds:
                yield {"name": head(item["path"]), "label": item["label"]}

    def make():
        return Decode(ucmagic.files_from_table(pa.table(rows), root=root, shuffle=True, seed=2))

    loader = ucmagic.DataLoader(make(), batch_size=4)
    it = iter(loader)
    got = [n for _ in range(3) for n in next(it)["name"]]
    state = loader.state_dict()
    del it
    resumed = ucmagic.DataLoader(make(), batch_size=4, num_workers=2)
    resumed.load_state_dict(state)
    assert sorted(got + [n for b in resumed for n in b["name"]]) == sorted(rels)


def test_a_state_of_another_table_version_is_refused(files):
    root, rels, rows = files
    ds = ucmagic.files_from_table(pa.table(rows), root=root)
    next(iter(ds))
    state = ds.state_dict()
    list(ds)  # every file cached by this version
    relabelled = ucmagic.files_from_table(pa.table({**rows, "label": [9] * N}), root=root)
    with pytest.raises(ListingChangedError):
        relabelled.load_state_dict(state)
    assert {it["label"] for it in relabelled} == {9}  # the new version's fields ...
    assert relabelled.stats()["misses"] == 0  # ... over the same files, cached by the first version
    ucmagic.files_from_table(pa.table(rows), root=root).load_state_dict(state)  # the same rows: fine
    # two DataFrames over one root share an identity: the second's listing is its own rows, even with
    # validate="none" (a listing reused unchecked would give one table's files with the other's rows)
    half = ucmagic.files_from_table(pa.table(rows).slice(0, N // 2), root=root, validate="none")
    assert sorted(check_items(half, rels, rows)) == sorted(rels[:N // 2])


def test_a_missing_file_raises_naming_it_or_is_skipped(files):
    root, rels, rows = files
    os.remove(os.path.join(root, rels[3]))
    with pytest.raises(SourceNotFoundError, match="img003.bin"):
        ucmagic.files_from_table(pa.table(rows), root=root)
    with pytest.warns(UserWarning, match="left out 1 file"):
        ds = ucmagic.files_from_table(pa.table(rows), root=root, on_missing="skip")
    assert sorted(check_items(ds, rels, rows)) == sorted(set(rels) - {rels[3]})
    # sizes from the table: the file is found missing at its fetch (UCVolumeDataset's on_missing)
    sized = pa.table({**rows, "size": [1] * N, "mtime": [0.0] * N}).filter(pc.field("id") == 3)
    with pytest.raises(FetchError, match="img003.bin"):
        list(ucmagic.files_from_table(sized, root=root, size_column="size", mtime_column="mtime"))
    skipped = ucmagic.files_from_table(sized, root=root, size_column="size", mtime_column="mtime",
                                       on_missing="skip")
    with pytest.warns(UserWarning, match="skipped 1 file"):
        assert list(skipped) == []
    assert skipped.stats()["errors"] == 1


def test_duplicate_rows_outside_paths_and_a_path_field_are_named_errors(files):
    root, rels, rows = files
    dup = {k: v + [v[0]] for k, v in rows.items()}
    dup["path"][-1] = os.path.join(root, rels[0])  # the same file, absolute
    with pytest.raises(DuplicatePathError, match="'c0/img000.bin': 2 rows"):
        ucmagic.files_from_table(pa.table(dup), root=root)
    with pytest.raises(InvalidArgumentError, match="is not under root"):
        ucmagic.files_from_table(pa.table({"path": ["/elsewhere/x.bin"]}), root=root)
    with pytest.raises(InvalidArgumentError, match="leaves root"):
        ucmagic.files_from_table(pa.table({"path": ["../x.bin"]}), root=root)
    with pytest.raises(InvalidArgumentError, match="field named 'path'"):
        ucmagic.files_from_table(pa.table({"file": rels, "path": rels}), path_column="file", root=root)
    with pytest.raises(InvalidArgumentError, match="no column 'nope'"):
        ucmagic.files_from_table(pa.table(rows), root=root, columns=["nope"])


def test_a_link_out_of_the_root_is_refused_or_left_out(files, tmp_path):
    root, rels, rows = files
    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"secret\n")
    os.symlink(secret, os.path.join(root, "c0", "link.bin"))
    table = pa.table({"path": [*rels, "c0/link.bin"], "id": [*rows["id"], 99], "label": [*rows["label"], 0]})
    with pytest.raises(UnsafeSourceError, match="link.bin"):
        ucmagic.files_from_table(table, root=root)
    with pytest.warns(UserWarning, match="left out 1 linked file"):
        ds = ucmagic.files_from_table(table, root=root, on_error="skip")
    assert sorted(check_items(ds, rels, rows)) == sorted(rels)
    trusted = ucmagic.files_from_table(table, root=root, follow_symlinks="all", filter="id = 99")
    assert [head(it["path"]) for it in trusted] == ["secret"]


SEG = st.text(alphabet="abc._-", min_size=1, max_size=4).filter(lambda s: s not in (".", ".."))


@settings(max_examples=60)
@given(st.lists(st.lists(SEG, min_size=1, max_size=3).map("/".join), min_size=1, max_size=6),
       st.lists(st.booleans(), min_size=6, max_size=6))
def test_relative_paths_model(rels, absolute):
    root = "/Volumes/c/s/v/data"
    given_paths = [root + "/" + r if a else "./" + r for r, a in zip(rels, absolute)]
    got_root, got = relative_paths(given_paths, root)
    assert got_root == root and got == rels
    if all(absolute[:len(rels)]):  # no root: the deepest common folder, the same files
        base, again = relative_paths(given_paths, None)
        assert [base + "/" + r for r in again] == [root + "/" + r for r in rels]
    srt = sorted(rels)
    assert duplicate_rows(srt) == {r: srt.count(r) for r in set(srt) if srt.count(r) > 1}


def test_the_listing_holds_the_tables_files_with_their_stat_sizes(files):
    root, rels, rows = files
    ds = ucmagic.files_from_table(pa.table(rows), root=root)
    assert [e.path for e in ds.listing.iter_entries()] == sorted(rels)
    assert [e.size for e in ds.listing.iter_entries()] == [os.path.getsize(os.path.join(root, r))
                                                           for r in sorted(rels)]
