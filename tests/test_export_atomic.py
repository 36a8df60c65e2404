"""export_parquet's commit side under kills and Ctrl-C: appends are all or nothing for ucmagic's readers,
a killed append is rolled back by the next ucmagic call and its rerun adds the rows once, outside readers
never see staged files, and Ctrl-C stops an export promptly with nothing partial visible.

The child processes below count the renames into the destination (``os.rename`` wrapped) and act at one:
SIGKILL themselves, raise Ctrl-C (SIGINT) or pause until the test lets them go.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytest.importorskip("duckdb")

from ucmagic.tables import journal  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OLD_ROWS, NEW_ROWS = 5_000, 20_000

CHILD = r"""
import glob, json, os, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
from ucmagic.tables import export_parquet

src, dest, action, point, flags = sys.argv[1:6]
real_rename = os.rename
moved = 0
total = None

def act():
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif action == "int":
        os.kill(os.getpid(), signal.SIGINT)  # KeyboardInterrupt here, in the main thread, as with Ctrl-C
    elif action == "pause":
        open(os.path.join(flags, "ready"), "w").close()
        while not os.path.exists(os.path.join(flags, "go")):
            time.sleep(0.02)

def rename(a, b, *args, **kw):
    global moved, total
    if not os.fspath(b).startswith(dest + os.sep):
        return real_rename(a, b, *args, **kw)
    if total is None:  # the journal is written before the first rename: it names every file
        (path,) = glob.glob(os.path.join(dest, "_ucmagic_append-*.json"))
        total = len(json.load(open(path))["files"])
        print("files", total, flush=True)
    moved += 1
    at = {"first": 1, "second": 2, "last": total}.get(point)
    if moved == at:
        act()
    out = real_rename(a, b, *args, **kw)
    if point == "commit" and moved == total:  # every file renamed, the journal not yet removed
        act()
    return out

os.rename = rename
export_parquet(src, dest, mode="append", target_file_size="40KB", threads=1)
print("done", flush=True)
"""


def _table(rows: int, tag: int, start: int = 0):
    return pa.table({"id": pa.array(range(start, start + rows), pa.int64()), "tag": pa.array([tag] * rows, pa.int32()),
                     "x": pa.array([float(i) for i in range(rows)])})


@pytest.fixture
def setup(tmp_path):
    """``(src, dest)``: dest holds an export of OLD_ROWS rows (tag 1); src a Parquet file of NEW_ROWS (tag 2)."""
    from ucmagic import export_parquet

    src = tmp_path / "new.parquet"
    pq.write_table(_table(NEW_ROWS, 2, start=OLD_ROWS), str(src))
    old = tmp_path / "old.parquet"
    pq.write_table(_table(OLD_ROWS, 1), str(old))
    dest = str(tmp_path / "out" / "table")
    export_parquet(str(old), dest, target_file_size="40KB")
    return str(src), dest


def _child(src: str, dest: str, action: str, point: str, flags: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.Popen([sys.executable, "-c", CHILD, src, dest, action, point, flags], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _files(dest: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), dest) for d, _, fs in os.walk(dest) for f in fs)


def _outside_view(dest: str) -> tuple[int, list[str]]:
    """What pyarrow (an outside reader: it skips ``_``/``.`` names) sees: rows, and the files it reads."""
    import pyarrow.dataset as pads

    ds = pads.dataset(dest, format="parquet")
    return ds.count_rows(), [os.path.relpath(f, dest) for f in ds.files]


def _read(reader: str, dest: str) -> tuple[int, int]:
    """Rows and distinct ids that one of ucmagic's readers sees in ``dest``."""
    if reader == "load_table":
        from ucmagic.tables import load_table

        df = load_table(dest)
        return len(df), df["id"].nunique()
    if reader == "ParquetDataset":
        from ucmagic.tables import ParquetDataset

        ids = [int(i) for b in ParquetDataset(dest, batch_size=4096, columns=["id"]) for i in b["id"]]
        return len(ids), len(set(ids))
    if reader == "ucmagic.load":
        import ucmagic

        df = ucmagic.load(dest)
        return len(df), df["id"].nunique()
    raise AssertionError(reader)


def _sidecars(dest: str) -> list[str]:
    """Journals in dest and staging directories beside it."""
    parent, base = os.path.dirname(dest), os.path.basename(dest)
    return (glob.glob(os.path.join(dest, journal.JOURNAL_PREFIX + "*"))
            + glob.glob(os.path.join(parent, f".{base}.ucmagic-*")))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("point, first_call", [("first", "load_table"), ("second", "ParquetDataset"),
                                               ("last", "ucmagic.load"), ("commit", "export")])
def test_append_killed_at_a_rename_is_rolled_back_by_the_next_call_and_a_rerun_adds_rows_once(setup, tmp_path,
                                                                                             point, first_call):
    from ucmagic import export_parquet

    src, dest = setup
    old_files = _files(dest)
    p = _child(src, dest, "kill", point, str(tmp_path))
    out, err = p.communicate(timeout=240)
    assert p.returncode == -signal.SIGKILL, (out, err)
    assert int(out.split()[1]) >= 3  # several files: first, second and last are different renames
    # outside readers: never a staged file; only the window of the final renames (complete files) shows
    rows, seen = _outside_view(dest)
    assert not [f for f in seen if os.path.basename(f).startswith(("_", "."))]
    assert OLD_ROWS <= rows <= OLD_ROWS + NEW_ROWS
    assert _sidecars(dest)  # the journal (and the staging) of the killed append are still there
    if first_call == "export":  # the rerun itself is the next call: it rolls back, then appends once
        export_parquet(src, dest, mode="append", target_file_size="40KB", threads=1)
        assert _read("load_table", dest) == (OLD_ROWS + NEW_ROWS, OLD_ROWS + NEW_ROWS)
    else:
        assert _read(first_call, dest) == (OLD_ROWS, OLD_ROWS)  # all or nothing: nothing, then rolled back
        assert _files(dest) == old_files and not _sidecars(dest)
        assert _outside_view(dest)[0] == OLD_ROWS
        export_parquet(src, dest, mode="append", target_file_size="40KB", threads=1)
        assert _read(first_call, dest) == (OLD_ROWS + NEW_ROWS, OLD_ROWS + NEW_ROWS)  # no duplicated row
    assert not _sidecars(dest)
    assert _outside_view(dest)[0] == OLD_ROWS + NEW_ROWS


@pytest.mark.timeout(300)
def test_readers_see_a_running_append_whole_or_not_at_all(setup, tmp_path):
    src, dest = setup
    p = _child(src, dest, "pause", "second", str(tmp_path))
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "ready").exists():  # paused after one file was renamed in
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for reader in ("load_table", "ParquetDataset", "ucmagic.load"):
            assert _read(reader, dest) == (OLD_ROWS, OLD_ROWS), reader
        assert glob.glob(os.path.join(dest, journal.JOURNAL_PREFIX + "*"))  # a live append is not rolled back
        rows, seen = _outside_view(dest)
        assert OLD_ROWS < rows < OLD_ROWS + NEW_ROWS  # outside readers: the window of the final renames
        assert not [f for f in seen if os.path.basename(f).startswith(("_", "."))]
        (tmp_path / "go").touch()
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0 and "done" in out, err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    for reader in ("load_table", "ParquetDataset", "ucmagic.load"):
        assert _read(reader, dest) == (OLD_ROWS + NEW_ROWS, OLD_ROWS + NEW_ROWS), reader
    assert not _sidecars(dest)


@pytest.mark.timeout(300)
def test_ctrl_c_during_the_renames_of_an_append_leaves_nothing_of_it(setup, tmp_path):
    src, dest = setup
    old_files = _files(dest)
    p = _child(src, dest, "int", "second", str(tmp_path))
    out, err = p.communicate(timeout=240)
    assert p.returncode != 0 and "KeyboardInterrupt" in err, (out, err)
    assert _files(dest) == old_files and not _sidecars(dest)  # removed by the interrupted process itself
    assert _outside_view(dest)[0] == OLD_ROWS


WRITER = r"""
import signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)
from ucmagic.tables import export_parquet

try:
    export_parquet("SELECT range AS id, md5(range::VARCHAR) AS s FROM range(400000000)", sys.argv[1],
                   mode=sys.argv[2], target_file_size="16MB", threads=int(sys.argv[3]) or None)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    sys.exit(130)
print("finished", flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, threads", [("overwrite", 1), ("append", 0)])  # 0: DuckDB's default (all cores)
def test_ctrl_c_while_an_export_writes_stops_it_and_leaves_the_destination_as_it_was(setup, mode, threads):
    src, dest = setup
    old_files = _files(dest)
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", WRITER, dest, mode, str(threads)], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        staging = os.path.join(os.path.dirname(dest), f".{os.path.basename(dest)}.ucmagic-staging-{p.pid}-*")
        deadline = time.monotonic() + 240
        while not glob.glob(os.path.join(staging, "*.parquet")):  # DuckDB is writing its first files
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(p.pid, signal.SIGINT)
        out, err = p.communicate(timeout=120)  # promptly: DuckDB stops within a second; the timeout is a guard
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 130 and "interrupted" in out, (out, err)
    assert _files(dest) == old_files and not _sidecars(dest)
    assert _read("load_table", dest) == (OLD_ROWS, OLD_ROWS)


# ------------------------------------------------------------------ the journal's rules, without processes

def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _fake_append(dest, name: str, doc: dict) -> str:
    """A journal and the one data file it names, as an append that renamed one file left them."""
    pq.write_table(_table(10, 9, start=10_000), os.path.join(dest, name))
    path = journal.journal_path(dest, "fake")
    with open(path, "w") as f:
        json.dump({"files": [name], **doc}, f)
    return path


def test_a_dead_owners_append_is_rolled_back_and_a_live_or_foreign_one_only_hidden(tmp_path):
    from ucmagic.tables.sources import resolve_path_source

    dest = str(tmp_path / "d")
    os.makedirs(dest)
    pq.write_table(_table(5, 1), os.path.join(dest, "old.parquet"))
    cases = [({"owner": f"{os.getpid()}-0", "host": socket.gethostname()}, "kept"),       # this process: live
             ({"owner": f"{_dead_pid()}-0", "host": socket.gethostname()}, "rolled back"),  # gone
             ({"owner": "1-0", "host": "another-host"}, "kept"),                           # another machine
             ({"owner": "1-0", "host": "another-host"}, "rolled back, stale")]              # ... a day old
    for doc, expected in cases:
        path = _fake_append(dest, "part-new.parquet", doc)
        if expected.endswith("stale"):
            old = time.time() - journal.FOREIGN_JOURNAL_TTL_S - 60
            os.utime(path, (old, old))
        src = resolve_path_source(dest)
        assert [os.path.basename(f) for f in src.paths] == ["old.parquet"], doc  # never the append's file
        assert os.path.exists(path) == (expected == "kept"), doc
        assert os.path.exists(os.path.join(dest, "part-new.parquet")) == (expected == "kept"), doc
        journal.roll_back(dest, path, json.load(open(path)) if os.path.exists(path) else None)
    assert os.listdir(dest) == ["old.parquet"]


def _committed(dest: str, during: dict | None = None) -> tuple[list[str], int]:
    """``committed_listing`` of ``dest`` (names) and how many listings it took; ``during[k]`` runs inside the
    k-th listing, after the folder was read: an append's steps taken while a listing runs."""
    taken = []

    def list_files(root: str) -> list[str]:
        names = sorted(os.path.join(root, n) for n in os.listdir(root) if not n.startswith(("_", ".")))
        taken.append(names)
        (during or {}).get(len(taken), lambda: None)()
        return names

    return [os.path.basename(f) for f in journal.committed_listing(dest, list_files)], len(taken)


def _live_journal(dest: str, rels: list[str]) -> str:
    return journal.write_journal(dest, "live", os.path.join(os.path.dirname(dest), ".staging"), rels)


def test_a_file_renamed_in_by_a_running_append_while_the_folder_is_listed_is_left_out(tmp_path):
    dest = str(tmp_path / "d")
    os.makedirs(dest)
    (tmp_path / "d" / "old.parquet").write_bytes(b"x")
    _live_journal(dest, ["new.parquet"])
    (tmp_path / "d" / "new.parquet").write_bytes(b"x")  # renamed in after its journal, before the listing
    assert _committed(dest) == (["old.parquet"], 1)


def test_an_append_that_starts_and_commits_during_one_listing_is_seen_whole(tmp_path):
    dest = str(tmp_path / "d")
    os.makedirs(dest)
    (tmp_path / "d" / "a-old.parquet").write_bytes(b"x")

    def whole_append() -> None:  # the listing read the folder before it began: the append ends meanwhile
        path = _live_journal(dest, ["b-new.parquet", "c-new.parquet"])
        (tmp_path / "d" / "b-new.parquet").write_bytes(b"x")
        (tmp_path / "d" / "c-new.parquet").write_bytes(b"x")
        journal.remove_journal(path)

    def half_seen() -> None:  # the folder was read with one of the two files in; the other comes, then the commit
        (tmp_path / "d" / "c-new.parquet").write_bytes(b"x")
        journal.remove_journal(journal.journal_path(dest, "live"))

    assert _committed(dest, {1: whole_append}) == (["a-old.parquet", "b-new.parquet", "c-new.parquet"], 2)
    for f in ("b-new.parquet", "c-new.parquet"):
        os.remove(os.path.join(dest, f))
    _live_journal(dest, ["b-new.parquet", "c-new.parquet"])
    (tmp_path / "d" / "b-new.parquet").write_bytes(b"x")
    assert _committed(dest, {1: half_seen}) == (["a-old.parquet", "b-new.parquet", "c-new.parquet"], 2)


def test_an_append_running_before_the_listing_stays_hidden_where_the_folders_mtime_never_moves(tmp_path,
                                                                                                monkeypatch):
    """A mount may report a folder's mtime from a cache, or keep none (an object store): the journals read before
    the listing still hide an append that was running then and commits right after the listing read the folder
    (one journal read, after the listing only, would list its first file alone)."""
    dest = str(tmp_path / "d")
    os.makedirs(dest)
    (tmp_path / "d" / "a-old.parquet").write_bytes(b"x")
    _live_journal(dest, ["b-new.parquet", "c-new.parquet"])
    (tmp_path / "d" / "b-new.parquet").write_bytes(b"x")
    monkeypatch.setattr(journal, "_mtime_ns", lambda path: 1)

    def commit() -> None:  # the folder was read with one of the two files in; the other comes, then the commit
        (tmp_path / "d" / "c-new.parquet").write_bytes(b"x")
        journal.remove_journal(journal.journal_path(dest, "live"))

    assert _committed(dest, {1: commit}) == (["a-old.parquet"], 1)  # not at all (whole from the next listing)
    assert _committed(dest)[0] == ["a-old.parquet", "b-new.parquet", "c-new.parquet"]


def test_roll_back_removes_only_what_the_journal_names_inside_the_destination(tmp_path):
    dest = tmp_path / "d"
    (dest / "k=1").mkdir(parents=True)
    (dest / "k=1" / "new.parquet").write_bytes(b"x")
    (dest / "keep.parquet").write_bytes(b"x")
    outside = tmp_path / "outside.parquet"
    outside.write_bytes(b"x")
    not_staging = tmp_path / "precious"
    not_staging.mkdir()
    path = journal.journal_path(str(dest), "x")
    doc = {"files": ["k=1/new.parquet", "../outside.parquet", str(outside)], "staging": str(not_staging)}
    journal.roll_back(str(dest), path, doc)
    assert sorted(os.listdir(dest)) == ["keep.parquet"]  # the emptied partition folder went too
    assert outside.exists() and not_staging.exists()


def test_a_url_append_lists_the_committed_files_not_a_killed_appends_uploads(tmp_path):
    import fsspec

    from ucmagic import export_parquet
    from ucmagic.tables import load_table

    fs = fsspec.filesystem("memory")
    root = f"/ucmagic-atomic-{os.getpid()}"
    url = f"memory://{root}/out"
    try:
        export_parquet(_table(OLD_ROWS, 1), url, target_file_size="40KB")
        with fs.open(f"{root}/out/part-00000-killedappend.parquet", "wb") as f:  # uploaded, never committed
            pq.write_table(_table(7, 3, start=90_000), f)
        assert len(load_table(url)) == OLD_ROWS  # readers follow the manifest
        export_parquet(_table(NEW_ROWS, 2, start=OLD_ROWS), url, mode="append", target_file_size="40KB")
        df = load_table(url)
        assert len(df) == OLD_ROWS + NEW_ROWS and set(df["tag"]) == {1, 2}
        assert not fs.exists(f"{root}/out/part-00000-killedappend.parquet")  # not listed: removed as stale
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)


def test_the_spill_directory_of_a_killed_process_is_swept_by_the_next_connection():
    import tempfile

    from ucmagic.tables.sources import connect

    tmp = tempfile.gettempdir()
    dead = os.path.join(tmp, f"ucmagic-duckdb-{_dead_pid()}")
    live = os.path.join(tmp, f"ucmagic-duckdb-{os.getppid()}")  # a running process's (the test runner's parent)
    for d in (dead, live):
        os.makedirs(os.path.join(d, "spill"), exist_ok=True)
    try:
        connect().close()
        assert not os.path.exists(dead) and os.path.isdir(live)
    finally:
        import shutil

        for d in (dead, live):
            shutil.rmtree(d, ignore_errors=True)


def test_mode_error_after_a_killed_first_append_sees_an_empty_destination(tmp_path):
    from ucmagic import export_parquet
    from ucmagic.tables import load_table

    dest = str(tmp_path / "fresh")
    os.makedirs(dest)  # what a first append into a new directory, killed after one rename, leaves
    _fake_append(dest, "part-00000-killed.parquet", {"owner": f"{_dead_pid()}-0", "host": socket.gethostname()})
    res = export_parquet(_table(30, 1), dest, mode="error")
    assert res.rows == 30 and len(load_table(dest)) == 30
    assert not [n for n in os.listdir(dest) if n.startswith("_") or "killed" in n]


# ------------------------------------------------------------------ exports never read themselves

def test_an_export_into_its_own_source_or_around_it_is_refused(tmp_path):
    from ucmagic import ExportOverlapError, export_parquet
    from ucmagic.tables import load_table

    d = tmp_path / "d"
    d.mkdir()
    pq.write_table(_table(2000, 0), d / "a.parquet")
    for dest, src in ((d / "sub", d), (d, d), (tmp_path, d), (d, d / "a.parquet")):
        with pytest.raises(ExportOverlapError, match="its own source"):
            export_parquet(str(src), str(dest), mode="append")
    assert len(load_table(str(d))) == 2000 and not (d / "sub").exists()
    export_parquet(str(d), str(tmp_path / "sibling"))  # beside it: fine
    assert len(load_table(str(tmp_path / "sibling"))) == 2000
    url = f"memory://overlap-{os.getpid()}-{tmp_path.name}"  # URLs: the same rule, by prefix
    export_parquet(str(d), url + "/src")
    with pytest.raises(ExportOverlapError, match="inside its own source"):
        export_parquet(url + "/src", url + "/src/sub", mode="append")
    assert export_parquet(url + "/src", url + "/src2").rows == 2000  # a longer name is not inside


KILLED_EXPORT = r"""
import os, signal, sys
from ucmagic.tables import export as ex
real = ex._finish_staging
def finish(staging, *a, **kw):  # the files are written: die before they are swapped in
    out = real(staging, *a, **kw)
    print(os.path.basename(staging), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
ex._finish_staging = finish
ex.export_parquet(sys.argv[1], sys.argv[2], mode=sys.argv[3], threads=1)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode, next_call", [("overwrite", "ParquetDataset"), ("append", "load_table"),
                                             ("overwrite", "ucmagic.load"), ("append", "export")])
def test_a_killed_exports_staging_names_its_owner_and_goes_with_the_next_call(setup, tmp_path, mode, next_call):
    src, dest = setup
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, "-c", KILLED_EXPORT, src, dest, mode], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=240)
    assert p.returncode == -signal.SIGKILL, (out, err)
    name = out.split()[-1]
    pid, start, host, _ = name.split(".ucmagic-staging-", 1)[1].split("-")
    assert int(pid) == p.pid and start.isdigit() and host == journal.host_id()
    staging = os.path.join(os.path.dirname(dest), name)
    assert glob.glob(os.path.join(staging, "*.parquet"))  # its files are there, hidden
    if next_call == "export":
        from ucmagic import export_parquet

        export_parquet(src, tmp_path / "elsewhere")  # another destination leaves it
        assert os.path.isdir(staging)
        export_parquet(src, dest, mode="append", threads=1)
        assert _read("load_table", dest)[0] == OLD_ROWS + NEW_ROWS
    else:
        assert _read(next_call, dest) == (OLD_ROWS, OLD_ROWS)
    assert not os.path.exists(staging)


def test_staging_of_a_live_process_or_another_host_stays_and_a_read_only_parent_is_no_error(tmp_path):
    dest = str(tmp_path / "out")
    os.makedirs(dest)
    live = journal.staging_path(dest, "staging", "live")  # this process: running
    other = os.path.join(str(tmp_path), ".out.ucmagic-staging-1-1-ffffffff-x")  # another host, fresh
    dead = os.path.join(str(tmp_path), f".out.ucmagic-staging-{_dead_pid()}-1-{journal.host_id()}-y")
    legacy = os.path.join(str(tmp_path), f".out.ucmagic-old-{_dead_pid()}-z")  # an older release's name
    for d in (live, other, dead, legacy):
        os.makedirs(d)
    os.chmod(str(tmp_path), 0o555)
    try:
        if not os.access(str(tmp_path), os.W_OK):  # (root ignores the mode)
            assert journal.sweep_staging(dest) == 0  # read-only: left, silently, no error
    finally:
        os.chmod(str(tmp_path), 0o755)
    assert journal.sweep_staging(dest) == 2
    assert os.path.isdir(live) and os.path.isdir(other) and not os.path.exists(dead) and not os.path.exists(legacy)
    old = time.time() - journal.FOREIGN_JOURNAL_TTL_S - 60
    os.utime(other, (old, old))
    assert journal.sweep_staging(dest) == 1 and not os.path.exists(other)


def test_staging_names_carry_their_owner_for_any_destination_name(tmp_path):
    """Pure naming: whatever the destination is called (dashes, dots), its staging name parses back to this
    process (alive) and the same name with a dead pid or another start time reads as gone."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    dead = _dead_pid()

    @given(st.text("abz-_.0", min_size=1, max_size=12).filter(lambda n: n not in (".", "..")),
           st.sampled_from(journal.STAGING_KINDS), st.text("0123456789abcdef", min_size=1, max_size=12))
    @settings(max_examples=200, deadline=None)
    def check(base, kind, export_id):
        name = os.path.basename(journal.staging_path(os.path.join(str(tmp_path), base), kind, export_id))
        prefix = f".{base}.ucmagic-{kind}-"
        assert name.startswith(prefix)
        suffix = name[len(prefix):]
        assert journal.staging_owner_alive(suffix, time.time())
        pid, start, host, eid = suffix.split("-")
        assert eid == export_id and host == journal.host_id()
        assert not journal.staging_owner_alive(f"{dead}-{start}-{host}-{eid}", time.time())
        assert not journal.staging_owner_alive(f"{pid}-{int(start) + 1}-{host}-{eid}", time.time())

    check()
