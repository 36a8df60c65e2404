"""Issue 23 item 4: each failure a user can meet raises a UCMagicError subclass catchable as itself,
naming what failed and what to change."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import ucmagic
from ucmagic import UCVolumeDataset
from ucmagic.files.cache import FileCache
from ucmagic.errors import (CacheDirError, CacheFullError, CacheFullFetchError, FetchError, InvalidArgumentError,
                            SourceChangedError, UCMagicError, UnreadableDirectoryError)
from ucmagic.files.fetch import with_retries
from ucmagic.testing import make_files


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "vol"
    make_files(str(r), 20, 1000, per_dir=10)
    return str(r)


@pytest.mark.parametrize("seed", ["x", 1.5, True, None, "3"])
def test_a_seed_that_is_not_an_integer_is_an_error_naming_seed(root, tmp_path, seed):
    with pytest.raises(InvalidArgumentError, match=r"seed must be an integer, got"):
        UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), seed=seed)


def test_integer_seeds_of_any_integer_type_are_accepted(root, tmp_path):
    assert UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), seed=np.int64(7)).seed == 7


def test_new_errors_are_exported_and_catchable_as_their_families():
    for name in ("BudgetTooSmallError", "CacheFullFetchError", "CacheDirError", "UnreadableDirectoryError",
                 "InvalidArgumentError"):
        assert issubclass(getattr(ucmagic, name), UCMagicError)
    assert issubclass(CacheFullFetchError, CacheFullError) and issubclass(CacheFullFetchError, FetchError)
    assert issubclass(InvalidArgumentError, ValueError) and issubclass(UnreadableDirectoryError, PermissionError)


def _unreadable(monkeypatch, bad: str) -> None:
    """Make directory ``bad`` unreadable to listing (tests run as root, which chmod does not stop)."""
    real = os.scandir

    def scandir(path=".", *a, **kw):
        if os.fspath(path) == bad:
            raise PermissionError(13, "Permission denied", bad)
        return real(path, *a, **kw)

    monkeypatch.setattr(os, "scandir", scandir)


def test_an_unreadable_directory_at_listing_is_an_error_naming_it(root, tmp_path, monkeypatch):
    bad = os.path.join(root, sorted(d for d in os.listdir(root))[0])
    _unreadable(monkeypatch, bad)
    with pytest.raises(UnreadableDirectoryError, match=rf"cannot read directory {bad} .*on_error='skip'"):
        UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), relist=True)


def test_on_error_skip_leaves_an_unreadable_directory_out_with_a_warning(root, tmp_path, monkeypatch):
    bad = os.path.join(root, sorted(d for d in os.listdir(root))[0])
    _unreadable(monkeypatch, bad)
    with pytest.warns(UserWarning, match=rf"skipped directory {bad}"):
        ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"), relist=True, on_error="skip")
    assert len(ds.listing) == 10  # the other directory's files


def test_a_cache_dir_that_is_a_file_names_the_path_and_the_setting(tmp_path, root):
    f = tmp_path / "not-a-dir"
    f.write_text("x")
    with pytest.raises(CacheDirError, match=rf"{f} as the cache directory: it is a file.*cache_dir=.*UCMAGIC_CACHE"):
        UCVolumeDataset(root, cache_dir=str(f))


def test_a_read_only_cache_dir_names_the_path_and_the_setting(tmp_path):
    mnt = tmp_path / "ro"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(mnt)], capture_output=True,
                         text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a read-only tmpfs here ({res.stderr.strip()}): needs root")
    try:
        with pytest.raises(CacheDirError, match=rf"cannot use {mnt}/c as the cache directory.*cache_dir="):
            FileCache(str(mnt / "c"))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_a_source_changed_during_its_copy_is_not_retried():
    calls = []

    def copy(_):
        calls.append(1)
        raise SourceChangedError("changed while being copied")

    with pytest.raises(SourceChangedError):
        with_retries(copy, None, 14)
    assert len(calls) == 1  # deterministic: another try would copy the same changed file


def test_the_cli_piped_into_head_exits_quietly(tmp_path):
    env = {**os.environ, "UCMAGIC_CACHE_DIR": str(tmp_path / "c")}
    for _ in range(3):
        cli = subprocess.Popen([sys.executable, "-m", "ucmagic", "cache", "info"], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, env=env)
        assert cli.stdout is not None
        head = subprocess.run(["head", "-1"], stdin=cli.stdout, capture_output=True, text=True, timeout=60)
        cli.stdout.close()  # only head reads the pipe: once it exits, the CLI's writes fail with EPIPE
        _, err = cli.communicate(timeout=60)
        assert head.stdout.startswith(str(tmp_path / "c")) and err == b"", err


@pytest.mark.parametrize("over", ["dataset", "loader0", "loader2", "wrapper2"])
def test_a_partly_consumed_iterator_alive_at_exit_prints_nothing(root, tmp_path, over):
    script = textwrap.dedent(f"""
        from torch.utils.data import IterableDataset
        import ucmagic  # a module global of the script: the order of the teardown at exit depends on it
        from ucmagic import DataLoader, UCVolumeDataset
        class Wrap(IterableDataset):
            def __init__(self, ds):
                self.ds = ds
            def __iter__(self):
                yield from self.ds
        over = {over!r}
        limit = "1MB" if over == "dataset" else None
        ds = UCVolumeDataset({root!r}, cache_dir={str(tmp_path / 'c')!r}, cache_limit=limit)
        src = Wrap(ds) if over == "wrapper2" else ds
        it = iter(ds if over == "dataset" else DataLoader(src, batch_size=2, num_workers=int(over[-1]),
                                                           collate_fn=list))
        next(it)
        next(it)
    """)
    (tmp_path / "child.py").write_text(script)  # a script file, as a user runs one (its globals go at exit)
    res = subprocess.run([sys.executable, str(tmp_path / "child.py")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and "Exception ignored" not in res.stderr and "Error" not in res.stderr, res.stderr


def _hold_budget(cache: str, limit: int) -> subprocess.Popen:
    code = ("import sys, time\nfrom ucmagic.files.cache import FileCache\n"
            "c = FileCache(sys.argv[1], limit=int(sys.argv[2]))\nprint('READY', flush=True)\ntime.sleep(120)\n")
    p = subprocess.Popen([sys.executable, "-c", code, cache, str(limit)], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    return p


def test_the_smallest_cache_limit_of_live_processes_bounds_every_process(tmp_path):
    cache = str(tmp_path / "c")
    p = _hold_budget(cache, 5_000_000)
    try:
        mine = FileCache(cache)  # no limit of its own
        assert mine.budget() == 5_000_000
        root = tmp_path / "big"
        make_files(str(root), 400, 30_000, per_dir=100)  # 12 MB of files
        ds = UCVolumeDataset(str(root), cache_dir=cache)
        n = sum(1 for _ in ds)
        assert n == 400 and ds.cache.usage().total_bytes <= 5_000_000 + 2 * 30_000
    finally:
        p.kill()
        p.communicate()
    later = FileCache(cache)
    assert later.budget() is None  # the holder is gone: its record is reaped on the next look
    assert not [n for n in os.listdir(os.path.join(cache, "locks")) if n.startswith("limit.")]


@pytest.mark.parametrize("kwargs, named", [
    ({"path": None}, "path must be"), ({"path": 5}, "path must be"), ({"pattern": 5}, "pattern must be"),
    ({"shuffle": "yes"}, "shuffle must be"), ({"partition": "x"}, "partition must be"),
    ({"on_error": "ignore"}, "on_error must be"), ({"validate": "never"}, "validate must be"),
])
def test_a_bad_dataset_argument_is_an_error_naming_it(root, tmp_path, kwargs, named):
    kw = {"path": root, "cache_dir": str(tmp_path / "c"), **kwargs}
    with pytest.raises(InvalidArgumentError, match=named):
        UCVolumeDataset(kw.pop("path"), **kw)


@pytest.mark.parametrize("epoch", ["a", -1, 1.7, True, None])
def test_set_epoch_takes_a_non_negative_int_only(root, tmp_path, epoch):
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"))
    with pytest.raises(InvalidArgumentError, match="set_epoch takes the epoch's number"):
        ds.set_epoch(epoch)
    ds.set_epoch(np.int64(3))  # numpy integers are integers
    assert ds.epoch == 3


@pytest.mark.parametrize("batch_size", [0, -1, "x", 1.5, True])
def test_a_bad_loader_batch_size_is_an_error_naming_it(root, tmp_path, batch_size):
    ds = UCVolumeDataset(root, cache_dir=str(tmp_path / "c"))
    with pytest.raises(InvalidArgumentError, match="batch_size must be a positive int"):
        ucmagic.DataLoader(ds, batch_size=batch_size, num_workers=0)


@pytest.mark.parametrize("state, said", [({"foo": 1}, "got a dict with keys \\['foo'\\]"), ([1], "got list"),
                                         ({"version": 99, "kind": "UCVolumeDataset"}, "version 99")])
def test_a_state_that_is_not_a_loader_state_says_what_load_state_dict_takes(root, tmp_path, state, said):
    loader = ucmagic.DataLoader(UCVolumeDataset(root, cache_dir=str(tmp_path / "c")), num_workers=0)
    with pytest.raises(InvalidArgumentError, match=said):
        loader.load_state_dict(state)


@pytest.mark.parametrize("path", ["", "   "])
def test_an_empty_path_is_refused_not_read_as_the_current_directory(tmp_path, monkeypatch, path):
    make_files(str(tmp_path / "cwd"), 3, 100)
    monkeypatch.chdir(tmp_path / "cwd")  # "" used to list (and copy) the whole current directory
    with pytest.raises(InvalidArgumentError, match=r"path is empty .*for the current directory, say '\.'"):
        UCVolumeDataset(path, cache_dir=str(tmp_path / "c"))
    assert not (tmp_path / "c").exists()


def test_an_unknown_url_scheme_is_an_invalid_argument_naming_it(tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"no file system handles foo://.*register_volume"):
        UCVolumeDataset("foo://bucket/prefix", cache_dir=str(tmp_path / "c"))


@pytest.mark.parametrize("scheme", ["", "slow://"])
def test_a_cache_dir_inside_the_dataset_root_is_not_listed_as_data(tmp_path, scheme):
    """The cache's copies, listings and records are not the user's data: the first dataset used to
    serve one of its own listing files, and the next one failed on it (SourceChangedError)."""
    root = tmp_path / "vol"
    rels = make_files(str(root), 12, 500, per_dir=4)
    kw = {"storage_options": {"open_ms": 0, "mbps": 0, "list_ms": 0}} if scheme else {}
    for _ in range(2):  # the second dataset lists a root whose cache now holds copies and a listing
        ds = UCVolumeDataset(scheme + str(root), cache_dir=str(root / "cache"), **kw)
        got = sorted(ds.source_of(p).rel for p in ds)
        assert got == sorted(rels)


def test_a_cache_dir_that_is_the_dataset_root_itself_is_refused(tmp_path):
    root = tmp_path / "vol"
    make_files(str(root), 3, 100)
    with pytest.raises(InvalidArgumentError, match=r"is the dataset's own directory: set cache_dir="):
        UCVolumeDataset(str(root), cache_dir=str(root))
    assert not (root / "files").exists()  # refused before the cache made its folders in the data


@pytest.mark.parametrize("consumer", ["plain", "uc2", "torch2"])
def test_a_cache_directory_removed_by_hand_between_epochs_is_made_again(root, tmp_path, consumer):
    import shutil

    import torch.utils.data as tud

    cache = str(tmp_path / "c")
    ds = UCVolumeDataset(root, cache_dir=cache)
    if consumer == "plain":
        loop = ds
    else:
        make = ucmagic.DataLoader if consumer == "uc2" else tud.DataLoader
        loop = make(ds, batch_size=4, num_workers=2, collate_fn=list)
    for epoch in range(2):
        got = [p for x in loop for p in ([x] if consumer == "plain" else x)]
        assert len(set(got)) == 20 and all(os.path.exists(p) for p in got), epoch
        shutil.rmtree(cache)  # `rm -rf ~/.cache/ucmagic` in a terminal while the notebook keeps the dataset


def test_threads_that_find_the_cache_directory_removed_share_one_new_one(tmp_path):
    """Every fill thread that finds the root removed retries on one new descriptor; none is closed under
    another thread (its number reused by another file gave 'Not a directory: tmp' in CI)."""
    import shutil
    import threading

    from ucmagic.files.cache_layout import CacheLayout

    layout = CacheLayout(str(tmp_path / "c"))
    old = layout.anchor()
    shutil.rmtree(layout.root)
    start = threading.Barrier(8)
    got: list[int] = []

    def retry() -> None:
        start.wait()
        got.append(layout.at_root(lambda root: os.open("tmp", os.O_RDONLY | os.O_DIRECTORY, dir_fd=root)))

    threads = [threading.Thread(target=retry) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        assert len(got) == 8 and os.path.isdir(os.path.join(layout.root, "tmp"))
        assert len({os.fstat(fd).st_ino for fd in got}) == 1  # all on the new tmp/
        assert os.fstat(old).st_nlink == 0  # the stale descriptor is still the removed root's, not reused
    finally:
        for fd in got:
            os.close(fd)
