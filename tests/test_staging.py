"""stage(): parallel staging of a file tree, plus the progress display it uses."""
from __future__ import annotations

import io
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucmagic import StageResult, stage
from ucmagic.errors import EmptyListingError, FetchError
from ucmagic.progress import Progress, format_duration, format_progress, resolve_mode
from ucmagic.staging import (StagingError, check_not_nested, is_unchanged, plan_workers, split_balanced)
from ucmagic.testing import make_files
import ucmagic.staging as S  # noqa: N812 - short alias for the module under test
from ucmagic.files.volume import FileEntry

TREE = {
    "a/b/c/deep.bin": b"deep" * 100,
    "a/b/sibling.txt": b"sibling",
    "unicodé/名前 with space.txt": "héllo wörld".encode(),
    "empty.bin": b"",
    "top.dat": os.urandom(70_000),
}


def write_tree(root, files=TREE):
    for rel, data in files.items():
        p = os.path.join(root, *rel.split("/"))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)


def read_tree(root):
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root).replace(os.sep, "/")] = open(p, "rb").read()
    return out


@pytest.fixture
def src(tmp_path):
    root = tmp_path / "src"
    write_tree(str(root))
    return str(root)


# ---------------------------------------------------------------- correctness

@pytest.mark.parametrize("processes", [1, 2])
def test_stages_nested_unicode_and_empty_files_with_source_mtimes(src, tmp_path, processes):
    dest = str(tmp_path / "dest")
    res = stage(src, dest, processes=processes, progress=False)
    assert isinstance(res, StageResult) and res.ok
    assert read_tree(dest) == TREE
    assert res.files == len(TREE) and res.total == len(TREE) and res.skipped == 0
    assert res.bytes == sum(len(v) for v in TREE.values())
    for rel in TREE:
        s, d = os.stat(os.path.join(src, rel)), os.stat(os.path.join(dest, rel))
        assert abs(s.st_mtime - d.st_mtime) < 1e-3


def test_second_run_skips_unchanged_and_recopies_changed(src, tmp_path):
    dest = str(tmp_path / "dest")
    stage(src, dest, progress=False)
    again = stage(src, dest, progress=False)
    assert again.files == 0 and again.skipped == len(TREE) and again.ok
    p = os.path.join(src, "a", "b", "sibling.txt")
    with open(p, "wb") as f:
        f.write(b"changed!")  # new size and mtime
    third = stage(src, dest, progress=False)
    assert third.files == 1 and third.skipped == len(TREE) - 1
    assert open(os.path.join(dest, "a", "b", "sibling.txt"), "rb").read() == b"changed!"


def test_same_size_but_different_mtime_is_recopied(src, tmp_path):
    dest = str(tmp_path / "dest")
    stage(src, dest, progress=False)
    p = os.path.join(src, "top.dat")
    data = os.urandom(70_000)
    with open(p, "wb") as f:
        f.write(data)
    os.utime(p, (1_000_000_000, 1_000_000_000))
    res = stage(src, dest, progress=False)
    assert res.files == 1 and open(os.path.join(dest, "top.dat"), "rb").read() == data


def test_pattern_selects_files(src, tmp_path):
    dest = str(tmp_path / "dest")
    res = stage(src, dest, pattern="*.txt", progress=False)
    assert sorted(read_tree(dest)) == ["a/b/sibling.txt", "unicodé/名前 with space.txt"]
    assert res.total == 2


def test_failing_file_is_reported_and_the_rest_staged(src, tmp_path, monkeypatch):
    real = S.fetch_to

    def copy_to(self, rel, dest):
        if rel == "a/b/sibling.txt":
            raise PermissionError(13, "Permission denied", rel)
        return real(self, rel, dest)

    monkeypatch.setattr(S, "fetch_to", copy_to)
    dest = str(tmp_path / "dest")
    res = stage(src, dest, processes=1, progress=False)
    assert not res.ok and [f.path for f in res.failed] == ["a/b/sibling.txt"]
    assert "permission denied" in res.failed[0].reason
    assert res.files == len(TREE) - 1
    staged = read_tree(dest)
    assert "a/b/sibling.txt" not in staged and len(staged) == len(TREE) - 1
    assert "sibling.txt" in str(res)
    with pytest.raises(FetchError, match="sibling.txt"):
        res.raise_for_failures()


def test_transient_errors_are_retried_and_permanent_ones_reported_over_processes(tmp_path):
    root = str(tmp_path / "src")
    make_files(root, 60, 500)
    dest = str(tmp_path / "dest")
    opts = {"open_ms": 0, "mbps": 0, "list_ms": 0, "fail_every": 4}
    ok = stage("slow://" + root, dest, processes=2, retries=5, progress=False, storage_options=opts)
    assert ok.ok and ok.files == 60
    dest2 = str(tmp_path / "dest2")
    bad = stage("slow://" + root, dest2, processes=2, retries=0, progress=False, storage_options=opts)
    assert bad.failed and bad.files + len(bad.failed) == 60
    assert all("injected I/O error" in f.reason for f in bad.failed)
    staged = read_tree(dest2)
    assert len(staged) == bad.files
    assert not {f.path for f in bad.failed} & set(staged)
    assert not [n for n in staged if ".ucstage-" in n]  # no temp file left behind


def test_a_copy_dying_midway_leaves_no_partial_file_and_keeps_the_old_copy(src, tmp_path, monkeypatch):
    dest = str(tmp_path / "dest")
    stage(src, dest, progress=False)
    old = open(os.path.join(dest, "top.dat"), "rb").read()
    with open(os.path.join(src, "top.dat"), "wb") as f:
        f.write(b"new content, longer than before" * 10_000)

    def crash(self, rel, tmp):
        with open(tmp, "wb") as f:
            f.write(b"half")
        raise OSError(5, "connection reset")

    monkeypatch.setattr(S, "fetch_to", crash)
    res = stage(src, dest, processes=1, retries=1, progress=False)
    assert [f.path for f in res.failed] == ["top.dat"]
    assert open(os.path.join(dest, "top.dat"), "rb").read() == old
    assert not [n for n in read_tree(dest) if ".ucstage-" in n]


def test_size_check_reports_a_source_that_changed(src, tmp_path, monkeypatch):
    real = S.fetch_to

    def short(self, rel, dest):
        n = real(self, rel, dest)
        return n - 1 if rel == "top.dat" else n

    monkeypatch.setattr(S, "fetch_to", short)
    res = stage(src, str(tmp_path / "dest"), processes=1, retries=0, progress=False)
    assert [f.path for f in res.failed] == ["top.dat"] and "changed" in res.failed[0].reason
    res2 = stage(src, str(tmp_path / "dest2"), processes=1, retries=0, progress=False, verify=None)
    assert res2.ok


def test_refuses_nested_source_and_destination(src, tmp_path):
    with pytest.raises(StagingError, match="inside the source"):
        stage(src, os.path.join(src, "staged"), progress=False)
    with pytest.raises(StagingError, match="inside the destination"):
        stage(os.path.join(src, "a"), src, progress=False)
    with pytest.raises(StagingError, match="same directory"):
        stage(src, src, progress=False)
    with pytest.raises(StagingError, match="verify"):
        stage(src, str(tmp_path / "d"), verify="md5", progress=False)


@pytest.mark.parametrize("kw", [{"concurrency": 0}, {"concurrency": -5}, {"concurrency": 2.5}, {"concurrency": True},
                                {"processes": 0}, {"retries": -1}])
def test_refuses_counts_below_their_minimum_before_copying(src, tmp_path, kw):
    (name, value), = kw.items()
    with pytest.raises(StagingError, match=f"{name} must be an integer >= "):
        stage(src, str(tmp_path / "d"), progress=False, **kw)
    assert not (tmp_path / "d").exists()


def test_empty_listing_raises_clear_error(src, tmp_path):
    with pytest.raises(EmptyListingError, match="no files"):
        stage(src, str(tmp_path / "dest"), pattern="*.nothing", progress=False)


def test_text_progress_reaches_the_stream(src, tmp_path, capsys):
    stage(src, str(tmp_path / "dest"), progress="text")
    err = capsys.readouterr().err
    assert "stage" in err and "staged 5 files" in err


# ---------------------------------------------------------------- pure helpers

def test_check_not_nested_allows_siblings_with_common_prefix(tmp_path):
    (tmp_path / "data").mkdir()
    check_not_nested(str(tmp_path / "data"), str(tmp_path / "data-staged"))


def test_is_unchanged():
    e = FileEntry("x", 10, 1000.0)
    st = os.stat_result((0o100644, 0, 0, 1, 0, 0, 10, 1000.0, 1000.0, 1000.0))
    assert is_unchanged(e, st)
    assert not is_unchanged(FileEntry("x", 11, 1000.0), st)
    assert not is_unchanged(FileEntry("x", 10, 1001.0), st)
    assert not is_unchanged(e, None)


def test_plan_workers():
    assert plan_workers(10, 256, None, cpus=8) == (1, 256)  # small job: no extra process
    procs, threads = plan_workers(100_000, 256, None, cpus=8)
    assert procs == 4 and procs * threads >= 256
    assert plan_workers(100_000, 256, None, cpus=2) == (1, 256)
    assert plan_workers(100_000, 256, 2) == (2, 128)
    assert plan_workers(3, 256, 8)[0] == 3


sizes = st.lists(st.integers(0, 5_000_000), max_size=200)


@given(sizes, st.integers(1, 8))
@settings(max_examples=80, deadline=None)
def test_split_balanced_covers_everything_once_and_balances(sz, parts):
    entries = [FileEntry(f"f{i:04d}", s, 0.0) for i, s in enumerate(sz)]
    out = split_balanced(entries, parts, open_cost=1000)
    flat = [e for p in out for e in p]
    assert sorted(flat) == sorted(entries)
    assert len(out) <= max(1, parts)
    for p in out:
        assert [e.path for e in p] == sorted(e.path for e in p)  # listing order kept inside a part
    if entries:
        loads = [sum(1000 + e.size for e in p) for p in out]
        assert max(loads) - min(loads) <= 1000 + max(sz)


# ---------------------------------------------------------------- progress

def test_format_progress_line():
    line = format_progress(500, 2000, 75_000_000, 2.0, desc="stage", failed=3)
    assert line.startswith("stage: 500/2,000 files (25%)")
    assert "75.0 MB" in line and "37.5 MB/s" in line and "3 failed" in line and "eta 6.0 s" in line
    assert format_duration(125) == "2m05s" and format_duration(3725) == "1h02m"


def test_resolve_mode(monkeypatch):
    monkeypatch.delenv("UCMAGIC_PROGRESS", raising=False)
    assert resolve_mode(False) is None and resolve_mode(None) is None
    assert resolve_mode(True) == "text"  # not in a notebook
    assert resolve_mode("text") == "text"
    monkeypatch.setenv("UCMAGIC_PROGRESS", "off")
    assert resolve_mode(True) is None and resolve_mode("text") == "text"
    with pytest.raises(ValueError, match="progress must be"):
        resolve_mode("fancy")


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_text_progress_rewrites_one_line_on_a_tty_and_prints_lines_otherwise():
    tty = FakeTTY()
    p = Progress(total=3, mode="text", stream=tty, interval=0)
    for _ in range(3):
        p.update(1, 100)
    p.close()
    out = tty.getvalue()
    assert out.count("\r") == 4 and out.endswith("\n") and out.count("\n") == 1
    log = io.StringIO()
    p = Progress(total=3, mode="text", stream=log, interval=3600)
    for _ in range(3):
        p.update(1, 100)
    p.close("done")
    assert log.getvalue().splitlines()[-1] == "done"
    assert len(log.getvalue().splitlines()) == 2  # the first update, then the final line only
    log = io.StringIO()
    p = Progress(total=3, mode="text", stream=log, interval=3600)
    p.set(3, 300)
    p.close()
    assert len(log.getvalue().splitlines()) == 1  # the final state was the line just logged: not twice


def test_silent_progress_still_counts():
    p = Progress(total=2, mode=False, stream=io.StringIO())
    p.update(1, 10)
    p.update(1, 5, failed=1)
    p.close()
    assert (p.done, p.nbytes, p.failed) == (2, 15, 1)


def test_local_copy_and_atomic_write_helpers(tmp_path):
    import zlib

    from ucmagic._util import atomic_write, copy_local

    src = tmp_path / "src.bin"
    data = os.urandom(3 * (1 << 20) + 123)
    src.write_bytes(data)
    n, crc = copy_local(str(src), str(tmp_path / "dst.bin"), crc=True, sync=True, buffer_size=1 << 16)
    assert (n, crc) == (len(data), zlib.crc32(data)) and (tmp_path / "dst.bin").read_bytes() == data
    assert copy_local(str(src), str(tmp_path / "d2.bin")) == (len(data), 0)
    target = tmp_path / "rec"
    atomic_write(str(target), b"old")
    atomic_write(str(target), b"new", sync=True)
    assert target.read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d2.bin", "dst.bin", "rec", "src.bin"]  # no temp left


# ---------------------------------------------------------------- modes and destinations (issue 42)

@given(st.integers(0, 0o7777))
def test_a_staged_copy_never_gets_a_wider_mode_than_its_source(bits):
    mode = S.staged_mode(0o100000 | bits)
    assert mode & ~0o644 == 0  # at most rw-r--r--
    assert mode & ~(bits | 0o600) == 0 or mode == 0o600  # nothing the source did not have (but the owner's rw)
    assert mode == 0o600 if not bits & 0o004 else mode == bits & 0o644
    assert S.staged_mode(None) == 0o644


def test_a_destination_folder_is_refused_as_a_link_always_and_shared_unless_allowed():
    import stat

    def st_(mode, uid):
        return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    assert S.dest_problem(st_(stat.S_IFLNK | 0o777, 1000), 1000, True) is not None
    assert S.dest_problem(st_(stat.S_IFDIR | 0o755, 1000), 1000, False) is None
    assert S.dest_problem(st_(stat.S_IFDIR | 0o777, 1000), 1000, False) is not None
    assert S.dest_problem(st_(stat.S_IFDIR | 0o755, 12345), 1000, False) is not None
    assert S.dest_problem(st_(stat.S_IFDIR | 0o777, 12345), 1000, True) is None


def test_a_symlinked_subfolder_of_the_destination_fails_its_files_only(src, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(elsewhere, dest / "a")
    res = stage(src, str(dest), processes=1, progress=False)
    bad = {f.path for f in res.failed}
    assert bad and all(p.startswith("a/") for p in bad) and all("symbolic link" in f.reason for f in res.failed)
    assert os.listdir(elsewhere) == [] and res.files == res.total - len(bad)
