"""The attacks of issue 50, played by a real second local user: a process forked from the test that drops to
uid 12345 (``os.setuid``) renames, links and swaps what that user may touch, while the victim (the test, root)
runs ucmagic. Skipped, saying why, where the tests do not run as root (CI runs as root). Each test checks that
nothing of the victim's changed and nothing landed in the attacker's folders (docs/reliability.md, "Threat
model", lists the outcomes).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import tempfile
import time
import traceback
from typing import Callable

import pytest

from ucmagic.errors import UCMagicError, UnsafeCacheError, UnsafeSourceError

ATTACKER = 12345


@pytest.fixture
def area():
    """A folder the attacker can reach (``/tmp/uc50-*``, 0755, the victim's): ``area/shared`` is writable by
    everyone without the sticky bit (the folder the issue names), ``area/theirs`` is the attacker's own."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("playing another local user needs root (fork, then setuid to uid 12345); CI runs as root")
    base = tempfile.mkdtemp(prefix="uc50-", dir="/tmp")
    os.chmod(base, 0o755)
    shared = os.path.join(base, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    theirs = os.path.join(base, "theirs")
    os.mkdir(theirs)
    os.chown(theirs, ATTACKER, ATTACKER)
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


class Attacker:
    """A process of uid 12345 forked from the test: runs ``fn()`` once (:meth:`run`) or over and over until
    stopped (:meth:`start` / :meth:`stop`). Its failures are printed and make it exit 1."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self.fn = fn
        self.pid = 0

    def _child(self, loop: bool) -> None:
        code = 0
        try:
            os.setgroups([])
            os.setgid(ATTACKER)
            os.setuid(ATTACKER)
            os.umask(0)
            while True:
                self.fn()
                if not loop:
                    break
                time.sleep(0.0005)
        except BaseException:  # noqa: BLE001 - reported by the exit status
            traceback.print_exc()
            code = 1
        os._exit(code)

    def _fork(self, loop: bool) -> None:
        pid = os.fork()
        if pid == 0:
            self._child(loop)
        self.pid = pid

    def run(self) -> None:
        self._fork(loop=False)
        _, status = os.waitpid(self.pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the attacker's process failed (see its output)"

    def start(self) -> "Attacker":
        self._fork(loop=True)
        return self

    def stop(self) -> None:
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)


def digest_tree(root) -> dict[str, str]:
    out = {}
    for dirpath, dirs, names in os.walk(root):
        for n in names + [d for d in dirs if os.path.islink(os.path.join(dirpath, d))]:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                out[os.path.relpath(p, root)] = "-> " + os.readlink(p)
            else:
                with open(p, "rb") as f:
                    out[os.path.relpath(p, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


def files_under(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)


def victim_home(home) -> None:
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    (home / ".bashrc").write_bytes(b"alias ls='ls --color'\n")
    (home / ".ssh" / "id_rsa").write_bytes(b"-----BEGIN PRIVATE KEY-----\nsecret\n" * 4)
    os.chmod(home / ".ssh" / "id_rsa", 0o600)


# ---------------------------------------------------------------- the cache's parents

@pytest.mark.parametrize("target", ["theirs", "victim home"])
def test_a_cache_below_a_folder_others_may_write_is_refused_and_a_swapped_root_receives_nothing(area, tmp_path,
                                                                                                target):
    """UCMAGIC_CACHE_DIR in a 0777 folder without the sticky bit: after the dataset is made, the other user
    renames the cache folder and puts a link in its place (to a folder of theirs with the usual subfolders,
    or into the victim's home). Nothing of the victim's may be written there."""
    from ucmagic import UCVolumeDataset

    home = tmp_path / "home"
    victim_home(home)
    before = digest_tree(home)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(6):
        (src / f"{i}.bin").write_bytes(bytes([i]) * 1000)
    cache = os.path.join(area, "shared", "cache")
    theirs = os.path.join(area, "theirs", "cache")
    dest = theirs if target == "theirs" else str(home)

    def swap() -> None:
        if target == "theirs":
            for sub in ("", "files", "tmp", "locks", "prot"):
                os.makedirs(os.path.join(theirs, sub), mode=0o777, exist_ok=True)
        os.rename(cache, cache + ".old")
        os.symlink(dest, cache)

    try:
        ds = UCVolumeDataset(str(src), cache_dir=cache)
    except UnsafeCacheError as exc:  # refused at once: the folder above the cache is not safe
        assert os.path.join(area, "shared") in str(exc) and "others may write" in str(exc)
        return
    Attacker(swap).run()
    with contextlib.suppress(UCMagicError):
        list(ds)
    if target == "theirs":
        assert [f for f in files_under(theirs)] == [], "the victim's cache files landed in the other user's folder"
    assert digest_tree(home) == before
    pytest.fail("a cache below a folder others may write to was accepted")


# ---------------------------------------------------------------- checkpoint roots

def _model():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])  # 1 MB: several shards


def test_a_checkpoint_root_another_user_owns_and_anyone_may_write_is_refused_by_name(area):
    pytest.importorskip("torch")
    from ucmagic import save_checkpoint

    root = os.path.join(area, "theirs", "ckpts")
    Attacker(lambda: (os.mkdir(root), os.chmod(root, 0o777))).run()
    for single_file in (False, True):
        with pytest.raises(UnsafeCacheError, match="checkpoint root") as got:
            save_checkpoint(root, model=_model(), step=1, single_file=single_file)
        assert root in str(got.value) and "allow_shared_dest" in str(got.value)
    assert files_under(root) == []


@pytest.mark.parametrize("swap_to_link", [False, True], ids=["their folder", "a link"])
@pytest.mark.parametrize("single_file", [False, True], ids=["dcp", "single file"])
def test_step_folders_swapped_during_async_saves_never_receive_a_file_elsewhere(area, single_file, swap_to_link):
    """A loop of the other user's swaps each new ``step_N`` (once its save began) for a folder of theirs, or a
    link to one, while async saves run (on the code before issue 50 every single-file save landed in theirs).
    Such a root is refused up front (the test above); with allow_shared_dest=True (the user trusts the folder)
    every file still goes into the folder the save opened, never through the link, and a save that meets a
    link fails with a named error."""
    pytest.importorskip("torch")
    from ucmagic import save_checkpoint

    root = os.path.join(area, "shared", "ckpts")
    os.mkdir(root)
    os.chmod(root, 0o777)
    drop = os.path.join(area, "theirs", "drop")
    os.mkdir(drop)
    os.chown(drop, ATTACKER, ATTACKER)
    def swap() -> None:  # once a save has begun in step_N (its record is there), past the checks before it
        for name in os.listdir(root):
            p = os.path.join(root, name)
            try:
                begun = name.startswith("step_") and not os.path.islink(p) and ".ucmagic_saving.json" in os.listdir(p)
            except OSError:
                continue
            if begun:
                try:
                    os.rename(p, os.path.join(root, f".moved-{name}-{time.monotonic_ns()}"))
                    os.symlink(drop, p) if swap_to_link else os.mkdir(p, 0o777)
                except OSError:
                    pass

    attacker = Attacker(swap).start()
    errors = []
    try:
        for step in range(1, 6):
            try:
                fut = save_checkpoint(root, model=_model(), step=step, async_=True, single_file=single_file,
                                      allow_shared_dest=True)
                fut.result(timeout=120)
            except UCMagicError as exc:
                errors.append(exc)
            except OSError as exc:  # a bare OSError is a defect of its own (the issue saw Errno 22)
                pytest.fail(f"a save failed with a bare {exc!r}")
    finally:
        attacker.stop()
    theirs = [d for d, _, _ in os.walk(root) if os.lstat(d).st_uid == ATTACKER] + [drop]
    assert [n for d in theirs for n in os.listdir(d)] == [], "a checkpoint file landed in the other user's folder"
    assert [n for n in os.listdir(root) if n.startswith(".moved-")], "the other user never swapped a step folder"


# ---------------------------------------------------------------- sources checked when opened

def test_a_listed_file_swapped_for_a_link_to_the_victims_key_after_the_listing_is_not_served(area, tmp_path):
    from ucmagic import UCVolumeDataset, stage

    home = tmp_path / "home"
    victim_home(home)
    key = home / ".ssh" / "id_rsa"
    secret = key.read_bytes()
    data = os.path.join(area, "theirs", "data")
    os.makedirs(os.path.join(data, "cls"))
    for i in range(4):
        with open(os.path.join(data, "cls", f"{i}.jpg"), "wb") as f:
            f.write(b"j" * len(secret))
    st = os.stat(os.path.join(data, "cls", "2.jpg"))
    os.utime(key, ns=(st.st_atime_ns, st.st_mtime_ns))  # equal size and mtime: the listing check cannot tell
    for dirpath, dirs, names in os.walk(data):
        for n in dirs + names:
            os.chown(os.path.join(dirpath, n), ATTACKER, ATTACKER)
    os.chown(data, ATTACKER, ATTACKER)
    ds = UCVolumeDataset(data, cache_dir=str(tmp_path / "cache"))
    victim = os.path.join(data, "cls", "2.jpg")
    Attacker(lambda: (os.unlink(victim), os.symlink(str(key), victim))).run()
    served = []
    with pytest.raises(UCMagicError, match="2.jpg"):
        for p in ds:
            with open(p, "rb") as f:
                served.append(f.read())
    assert secret not in served
    res = stage(data, str(tmp_path / "staged"), progress=False, processes=1)  # listed now: left out, warned
    assert not (tmp_path / "staged" / "cls" / "2.jpg").exists() or \
        (tmp_path / "staged" / "cls" / "2.jpg").read_bytes() != secret
    assert res.files <= 3


def test_a_delta_data_file_that_is_a_link_to_a_parquet_file_outside_the_table_is_refused(area, tmp_path):
    deltalake = pytest.importorskip("deltalake")
    import pyarrow as pa
    import pyarrow.parquet as pq

    from ucmagic import ParquetDataset, load_table

    private = tmp_path / "home" / "salaries.parquet"
    private.parent.mkdir(parents=True)
    pq.write_table(pa.table({"id": pa.array([7, 8], pa.int64())}), private)
    table = os.path.join(area, "theirs", "table")
    deltalake.write_deltalake(table, pa.table({"id": pa.array([1, 2], pa.int64())}))
    part = next(n for n in os.listdir(table) if n.endswith(".parquet"))
    for dirpath, dirs, names in os.walk(table):
        for n in dirs + names:
            os.chown(os.path.join(dirpath, n), ATTACKER, ATTACKER)
    os.chown(table, ATTACKER, ATTACKER)
    target = os.path.join(table, part)
    Attacker(lambda: (os.unlink(target), os.symlink(str(private), target))).run()
    with pytest.raises(UnsafeSourceError, match="outside"):
        load_table(table)
    with pytest.raises(UCMagicError, match="outside"):
        list(ParquetDataset(table, batch_size=4, cache_dir=str(tmp_path / "cache")))


# ---------------------------------------------------------------- a checkpoint written by the other user

def test_a_checkpoint_the_other_user_wrote_cannot_overwrite_the_victims_files(area, tmp_path):
    """The high break, played for real: the other user writes a torch-format checkpoint into the shared
    folder whose .metadata names the victim's ~/.bashrc (absolute); the victim loads it."""
    torch = pytest.importorskip("torch")
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from ucmagic import load_checkpoint

    home = tmp_path / "home"
    victim_home(home)
    before = digest_tree(home)
    step = os.path.join(area, "shared", "ck", "step_1")
    model = torch.nn.Linear(3, 2)
    dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(step))
    with open(os.path.join(step, ".metadata"), "rb") as f:
        md = pickle.loads(f.read())
    index = next(k for k in md.storage_data if k.fqn == "model.bias")
    md.storage_data[index] = _StorageInfo(str(home / ".bashrc"), 0, 16)
    raw = pickle.dumps(md)
    for dirpath, dirs, names in os.walk(os.path.dirname(step)):
        for n in dirs + names:
            os.chown(os.path.join(dirpath, n), ATTACKER, ATTACKER)

    def write_metadata() -> None:
        with open(os.path.join(step, ".metadata"), "wb") as f:
            f.write(raw)

    Attacker(write_metadata).run()
    with pytest.raises(UCMagicError, match="outside"):
        load_checkpoint(os.path.dirname(step), 1, model=torch.nn.Linear(3, 2))
    assert digest_tree(home) == before
