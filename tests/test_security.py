"""The attacks of issue 42, played by another local user (uid 12345, made by chown: the tests run as
root and skip otherwise) or by a malicious data source. Each test plants what the attacker would,
runs what the victim runs, and checks that nothing outside the intended place changed (the SHA-256
of every planted victim file before and after). docs/reliability.md ("Threat model") says what is
protected against whom.
"""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile

import pytest

from ucmagic import UCVolumeDataset, stage
from ucmagic.errors import UnsafeCacheError, UnsafeSourceError

ATTACKER = 12345


def need_root() -> None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("playing another user needs root (chown to another uid)")


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def victim_files(home) -> dict[str, str]:
    """The victim's precious files: ~/.bashrc, ~/.profile, ~/.ssh/{authorized_keys,id_rsa}; their hashes."""
    (home / ".ssh").mkdir(parents=True, exist_ok=True)
    for rel, data, mode in ((".bashrc", b"alias ls='ls --color'\n", 0o644), (".profile", b"PATH=$PATH\n", 0o644),
                            (".ssh/authorized_keys", b"ssh-ed25519 AAAA victim\n", 0o600),
                            (".ssh/id_rsa", b"-----BEGIN PRIVATE KEY-----\nsecret\n", 0o600)):
        (home / rel).write_bytes(data)
        os.chmod(home / rel, mode)
    return snapshot(home)


def snapshot(home) -> dict[str, str]:
    out = {}
    for dirpath, _, names in os.walk(home):
        for n in names:
            p = os.path.join(dirpath, n)
            if not os.path.islink(p):
                out[os.path.relpath(p, home)] = digest(p)
    return out


def chown_tree(path) -> None:
    """Hand ``path`` (and what is under it, links included) to the attacker."""
    os.lchown(path, ATTACKER, ATTACKER)
    for dirpath, dirs, names in os.walk(path):
        for n in dirs + names:
            os.lchown(os.path.join(dirpath, n), ATTACKER, ATTACKER)


def attacker_dir(path, mode: int = 0o777):
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, mode)
    os.chown(path, ATTACKER, ATTACKER)
    return path


# ---------------------------------------------------------------- checkpoint staging

def test_checkpoint_staging_prepared_by_another_user_is_never_used(tmp_path, monkeypatch):
    """Another user makes the staging root and the victim's next per-load folder, its checkpoint.pt a
    link to ~/.bashrc: the load's staging write must not reach ~/.bashrc."""
    need_root()
    from ucmagic._util import copy_local
    from ucmagic.checkpoints import transfer as xfer
    from ucmagic.files.locks import process_tag

    home = tmp_path / "home"
    before = victim_files(home)
    root = attacker_dir(tmp_path / "ucmagic-ckpt-0")
    trap = root / f"single-load-abc@{process_tag()}"
    trap.mkdir()
    os.chmod(trap, 0o777)
    os.symlink(home / ".bashrc", trap / "checkpoint.pt")
    chown_tree(root)
    payload = tmp_path / "downloaded.pt"
    payload.write_bytes(b"tensor bytes " * 100)
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(root))
    try:
        staging = xfer.make_staging_dir(None, "single-load-abc")
    except UnsafeCacheError:
        staging = None  # refused: the root is another user's
    else:
        assert staging != str(trap)
        copy_local(str(payload), os.path.join(staging, "checkpoint.pt"))
    assert staging is None
    assert snapshot(home) == before


def test_default_checkpoint_staging_is_private_and_not_a_guessable_tmp_name(monkeypatch):
    from ucmagic.checkpoints import transfer as xfer

    monkeypatch.delenv("UCMAGIC_STAGING_DIR", raising=False)
    root = xfer.shared_staging_root()
    assert not os.path.basename(root).startswith("ucmagic-ckpt-")
    made = xfer.make_staging_dir(None, "save-x-0")
    try:
        for p in (root, made):
            st = os.lstat(p)
            assert stat.S_ISDIR(st.st_mode) and st.st_mode & 0o077 == 0 and st.st_uid == os.getuid()
        again = xfer.make_staging_dir(None, "save-x-0")  # the same name again: a new folder, never reused
        assert again != made
        xfer.release_staging_dir(again)
    finally:
        xfer.release_staging_dir(made)


def test_a_sticky_shared_staging_root_gets_a_new_unguessable_folder(tmp_path):
    """``staging_dir="/tmp"``-like: others may write there but not rename; a folder they made in the
    victim's name (every guessable one) is never used."""
    need_root()
    from ucmagic.checkpoints import transfer as xfer
    from ucmagic.files.locks import process_tag

    shared = tmp_path / "sharedtmp"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    trap = attacker_dir(shared / f"save-s-0@{process_tag()}")
    made = xfer.make_staging_dir(str(shared), "save-s-0")
    try:
        assert made != str(trap) and os.lstat(made).st_uid == os.getuid()
        assert os.lstat(made).st_mode & 0o777 == 0o700
    finally:
        xfer.release_staging_dir(made)


# ---------------------------------------------------------------- stage() into a destination with links

def _src_tree(tmp_path, files: dict[str, bytes]):
    src = tmp_path / "src"
    for rel, data in files.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    return src


def test_stage_never_writes_through_a_directory_link_another_user_planted_in_the_destination(tmp_path):
    need_root()
    home = tmp_path / "home"
    before = victim_files(home)
    src = _src_tree(tmp_path, {"sub/authorized_keys": b"ssh-ed25519 AAAA attacker\n", "x.wav": b"audio"})
    dest = attacker_dir(tmp_path / "sec-audio")
    os.symlink(home / ".ssh", dest / "sub")
    chown_tree(dest)
    try:
        res = stage(str(src), str(dest), progress=False, processes=1)
    except UnsafeCacheError:
        res = None  # refused: a destination of another user's
    assert res is None
    assert snapshot(home) == before
    # trusting the shared destination explicitly: still never through the link
    res = stage(str(src), str(dest), progress=False, processes=1, allow_shared_dest=True)
    assert [f.path for f in res.failed] == ["sub/authorized_keys"] and "symbolic link" in res.failed[0].reason
    assert (dest / "x.wav").read_bytes() == b"audio"
    assert snapshot(home) == before


def test_stage_replaces_a_file_link_at_a_final_name_and_ignores_planted_temp_names(tmp_path):
    """A link at a staged file's own name, or at the temp name an old version would pick next
    (``.ucstage-<pid>-<n>.tmp``), is replaced or left alone, never written through."""
    home = tmp_path / "home"
    before = victim_files(home)
    src = _src_tree(tmp_path, {"a.txt": b"new a", "b.txt": b"new b"})
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(home / ".profile", dest / "a.txt")
    for n in range(4):
        os.symlink(home / ".bashrc", dest / f".ucstage-{os.getpid()}-{n}.tmp")
    res = stage(str(src), str(dest), progress=False, processes=1)
    assert res.ok
    assert not os.path.islink(dest / "a.txt") and (dest / "a.txt").read_bytes() == b"new a"
    assert snapshot(home) == before


def test_staged_copies_never_widen_the_source_mode(tmp_path):
    src = _src_tree(tmp_path, {"key": b"secret", "pub": b"public", "exe": b"#!/bin/sh\n"})
    os.chmod(src / "key", 0o600)
    os.chmod(src / "pub", 0o664)
    os.chmod(src / "exe", 0o755)
    dest = tmp_path / "dest"
    old = os.umask(0)
    try:
        assert stage(str(src), str(dest), progress=False, processes=1).ok
    finally:
        os.umask(old)
    modes = {n: stat.S_IMODE(os.stat(dest / n).st_mode) for n in ("key", "pub", "exe")}
    assert modes == {"key": 0o600, "pub": 0o644, "exe": 0o644}
    assert stat.S_IMODE(os.stat(dest).st_mode) & 0o022 == 0  # folders are not writable by others either


# ---------------------------------------------------------------- a malicious data source

def test_a_source_link_to_the_users_private_key_is_not_read_nor_staged(tmp_path):
    home = tmp_path / "home"
    before = victim_files(home)
    tree = tmp_path / "theirs"
    (tree / "cls").mkdir(parents=True)
    (tree / "cls" / "1.jpg").write_bytes(b"jpeg")
    os.symlink(home / ".ssh" / "id_rsa", tree / "cls" / "2.jpg")
    secret = (home / ".ssh" / "id_rsa").read_bytes()
    with pytest.raises(UnsafeSourceError, match="2.jpg"):
        UCVolumeDataset(str(tree), cache_dir=str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="2.jpg"):
        ds = UCVolumeDataset(str(tree), cache_dir=str(tmp_path / "cache"), on_error="skip")
    served = [open(p, "rb").read() for p in ds]
    assert secret not in served and len(served) == 1
    with pytest.warns(UserWarning, match="2.jpg"):
        res = stage(str(tree), str(tmp_path / "staged"), progress=False, processes=1)
    assert res.ok and not (tmp_path / "staged" / "cls" / "2.jpg").exists()
    assert snapshot(home) == before


# ---------------------------------------------------------------- the cache directory

def test_a_cache_root_once_world_writable_keeps_nothing_others_planted(tmp_path):
    """Attacker-made files/, tmp/, locks/ with locks/removals -> ~/.profile in a 0777 root of the victim's."""
    need_root()
    from ucmagic.files.cache import FileCache

    home = tmp_path / "home"
    before = victim_files(home)
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o777)
    for sub in ("files", "tmp", "locks"):
        attacker_dir(root / sub)
    os.symlink(home / ".profile", root / "locks" / "removals")
    chown_tree(root / "locks")
    try:
        fc = FileCache(str(root))
    except UnsafeCacheError:
        fc = None
    else:
        fc.remove([])  # changes the removal token
    assert fc is None
    assert snapshot(home) == before


def test_lock_and_token_files_are_never_opened_through_a_link(tmp_path):
    from ucmagic.files.cache import FileCache
    from ucmagic.files.locks import KeyLocks, file_lock

    home = tmp_path / "home"
    before = victim_files(home)
    fc = FileCache(str(tmp_path / "cache"))
    locks = os.path.join(fc.root, "locks")
    for name, target in (("evict.lock", ".bashrc"), ("removals", ".profile"), ("fill.lock", ".ssh/id_rsa")):
        p = os.path.join(locks, name)
        if os.path.lexists(p):
            os.unlink(p)
        os.symlink(home / target, p)
    with pytest.raises(OSError), file_lock(os.path.join(locks, "evict.lock")):
        pass
    with pytest.raises(OSError), KeyLocks(os.path.join(locks, "fill.lock")).hold("0" * 40):
        pass
    with pytest.raises(OSError):
        FileCache(str(tmp_path / "cache")).remove([])
    assert snapshot(home) == before


def test_a_cache_root_that_is_another_users_link_to_the_victims_folder_is_refused(tmp_path):
    need_root()
    from ucmagic.files.cache import FileCache

    mine = tmp_path / "victim-folder"
    mine.mkdir(mode=0o700)
    link = tmp_path / "cache-link"
    os.symlink(mine, link)
    os.lchown(link, ATTACKER, ATTACKER)
    with pytest.raises(UnsafeCacheError, match="symbolic link"):
        FileCache(str(link))
    assert os.listdir(mine) == []


def test_missing_parents_of_the_cache_are_private_under_umask_000(tmp_path, monkeypatch):
    from ucmagic.files.cache import FileCache

    root = tmp_path / "home" / ".cache" / "ucmagic"
    old = os.umask(0)
    try:
        FileCache(str(root))
    finally:
        os.umask(old)
    for p in (tmp_path / "home", tmp_path / "home" / ".cache", root, root / "files", root / "locks"):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o700, p


# ---------------------------------------------------------------- DuckDB

def test_the_duckdb_spill_folder_is_private_and_not_a_guessable_tmp_name():
    from ucmagic.tables.sources import connect

    con = connect()
    try:
        spill = con.execute("SELECT current_setting('temp_directory')").fetchone()[0]
    finally:
        con.close()
    assert spill != os.path.join(tempfile.gettempdir(), f"ucmagic-duckdb-{os.getpid()}")
    parent = os.path.dirname(spill)
    st = os.lstat(parent)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077 == 0


# ---------------------------------------------------------------- a Delta log naming files outside its table

@pytest.mark.parametrize("path", ["../outside.parquet", "part%2F..%2F..%2Foutside.parquet", "/etc/passwd",
                                  "file:///etc/passwd", "s3://other-bucket/x.parquet"])
def test_a_delta_log_path_outside_its_table_is_refused_unless_the_user_opts_in(tmp_path, path):
    from ucmagic.tables.delta import data_file_path

    root = str(tmp_path / "table")
    with pytest.raises(UnsafeSourceError, match="UCMAGIC_DELTA_OUTSIDE_PATHS"):
        data_file_path(root, path)
    assert data_file_path(root, path, allow_outside=True)  # the user trusts this log


def test_delta_log_paths_inside_the_table_are_read_as_before(tmp_path):
    from ucmagic.tables.delta import data_file_path

    root = str(tmp_path / "table")
    assert data_file_path(root, "part-0.parquet") == os.path.join(root, "part-0.parquet")
    assert data_file_path(root, "k%3D1/part-0.parquet") == os.path.join(root, "k=1/part-0.parquet")
    assert data_file_path(root, os.path.join(root, "a", "p.parquet")) == os.path.join(root, "a", "p.parquet")
    assert data_file_path("s3://b/t", "s3://b/t/x.parquet") == "s3://b/t/x.parquet"


# ---------------------------------------------------------------- the user's SQL and the user's files

def test_sql_reads_no_file_outside_the_catalog_and_exports_unless_the_user_allows_it(tmp_path, monkeypatch):
    from ucmagic import export_parquet, load_table
    from ucmagic.errors import SQLFileAccessError

    secret = tmp_path / "home" / "secrets.csv"
    secret.parent.mkdir()
    secret.write_text("user,password\nme,hunter2\n")
    monkeypatch.delenv("UCMAGIC_SQL_FILES", raising=False)
    query = f"SELECT * FROM read_csv('{secret}')"
    with pytest.raises(SQLFileAccessError, match="UCMAGIC_SQL_FILES"):
        load_table(query)
    with pytest.raises(SQLFileAccessError):
        export_parquet(query, tmp_path / "out")
    with pytest.raises(SQLFileAccessError):  # nor written: COPY to a file of the user's
        load_table(f"SELECT 1 AS x; COPY (SELECT 1) TO '{tmp_path}/x.csv'")
    assert not (tmp_path / "out").exists() and not (tmp_path / "x.csv").exists()
    # what ucmagic itself wrote in this process is readable; so is a folder the user names
    r = export_parquet("SELECT range AS id FROM range(10)", tmp_path / "exp")
    assert len(load_table(f"SELECT * FROM read_parquet('{r.dest}/*.parquet')")) == 10
    monkeypatch.setenv("UCMAGIC_SQL_FILES", str(secret.parent))
    assert list(load_table(query)["password"]) == ["hunter2"]


def test_sql_allowed_dirs_is_the_setting_plus_ucmagics_own_folders():
    from hypothesis import given
    from hypothesis import strategies as st

    from ucmagic.tables.sources import sql_allowed_dirs

    part = st.text(alphabet="abc", min_size=1, max_size=3)

    @given(st.lists(part, max_size=3), st.one_of(st.none(), part), st.lists(part, max_size=2))
    def check(user, catalog, exported):
        setting = os.pathsep.join("/u/" + u for u in user) if user else None
        got = sql_allowed_dirs(setting, "/c/" + catalog if catalog else None, ["/e/" + e for e in exported])
        want = {"/u/" + u + "/" for u in user} | ({"/c/" + catalog + "/"} if catalog else set()) \
            | {"/e/" + e + "/" for e in exported}
        assert got is not None and set(got) == want and all(d.endswith("/") for d in got)

    check()
    assert sql_allowed_dirs("any", "/c", ["/e"]) is None and sql_allowed_dirs(" ANY ", None, []) is None


# ---------------------------------------------------------------- pack and export destinations

def test_pack_and_export_refuse_another_users_destination_and_never_write_through_links(tmp_path):
    need_root()
    from ucmagic import export_parquet
    from ucmagic.shards.pack import pack

    home = tmp_path / "home"
    before = victim_files(home)
    src = _src_tree(tmp_path, {"a/0001.jpg": b"x" * 100, "a/0002.jpg": b"y" * 100})
    shards = attacker_dir(tmp_path / "shards")
    for n in range(3):  # every name a guess could give: links to the victim's files
        os.symlink(home / ".bashrc", shards / f"shard-{n:06d}.tar")
    chown_tree(shards)
    with pytest.raises(UnsafeCacheError, match="allow_shared_dest"):
        pack(str(src), str(shards), progress=False)
    out_parent = attacker_dir(tmp_path / "exports")
    with pytest.raises(UnsafeCacheError, match="allow_shared_dest"):
        export_parquet("SELECT range AS id FROM range(5)", out_parent / "t")
    assert snapshot(home) == before


def test_pack_never_writes_through_a_link_at_a_shard_name_in_its_own_destination(tmp_path):
    from ucmagic.shards.pack import pack

    home = tmp_path / "home"
    before = victim_files(home)
    src = _src_tree(tmp_path, {"a/0001.jpg": b"x" * 100, "a/0002.jpg": b"y" * 100})
    dest = tmp_path / "shards"
    dest.mkdir()
    res = pack(str(src), str(dest), progress=False)
    shard = sorted(p for p in os.listdir(dest) if p.endswith(".tar"))[0]
    os.unlink(dest / shard)
    os.symlink(home / ".profile", dest / shard)  # planted after a first pack: the resumed pack replaces it
    res = pack(str(src), str(dest), progress=False)
    assert res.shards >= 1 and not os.path.islink(dest / shard)
    assert snapshot(home) == before


# ---------------------------------------------------------------- checkpoint saves into a tree holding links

@pytest.mark.parametrize("single_file,async_", [(True, False), (False, False), (True, True), (False, True)])
def test_a_checkpoint_save_never_writes_through_a_step_folder_link_planted_in_its_root(tmp_path, single_file, async_):
    """root/step_1 is a link to ~/.ssh (whoever made it: ucmagic names step folders, so a link there was
    planted): save_checkpoint (the engine of %ucckpt and the CLI) refuses it, naming the link."""
    torch = pytest.importorskip("torch")
    from ucmagic import save_checkpoint
    from ucmagic.errors import UnsafeDirectoryError

    home = tmp_path / "home"
    before = victim_files(home)
    root = tmp_path / "ckpts"
    root.mkdir()
    os.symlink(home / ".ssh", root / "step_1")  # the next save's folder, made a link to ~/.ssh
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UnsafeDirectoryError, match="symbolic link") as got:  # refused before any write
        save_checkpoint(str(root), model=model, step=1, single_file=single_file, async_=async_)
    assert str(root / "step_1") in str(got.value)
    assert snapshot(home) == before and sorted(os.listdir(home / ".ssh")) == ["authorized_keys", "id_rsa"]
    os.unlink(root / "step_1")  # once the link is gone the same save works
    out = save_checkpoint(str(root), model=model, step=1, single_file=single_file, async_=async_)
    assert (out.result(timeout=120) if async_ else out) == str(root / "step_1")
    assert not os.path.islink(root / "step_1")


@pytest.mark.parametrize("single_file", [True, False])
def test_a_checkpoint_file_name_planted_as_a_link_in_the_step_folder_is_never_written_through(tmp_path, single_file):
    """A real step folder whose record or checkpoint.pt name is a link to the victim's files: the save
    fails with the named error and the files it points to are unchanged."""
    torch = pytest.importorskip("torch")
    from ucmagic import save_checkpoint
    from ucmagic.checkpoints.format import SAVING_NAME, SINGLE_FILE_NAME
    from ucmagic.errors import UnsafeDirectoryError

    home = tmp_path / "home"
    before = victim_files(home)
    step = tmp_path / "ckpts" / "step_1"
    step.mkdir(parents=True)
    os.symlink(home / ".bashrc", step / SAVING_NAME)
    if single_file:
        os.unlink(step / SAVING_NAME)
        os.symlink(home / ".profile", step / SINGLE_FILE_NAME)
    with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
        save_checkpoint(str(step.parent), model=torch.nn.Linear(2, 2), step=1, single_file=single_file)
    assert snapshot(home) == before


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_dcp_writer_folder_that_is_another_users_link_is_refused_one_of_the_users_own_is_followed(tmp_path):
    need_root()
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    from ucmagic import UCVolumeWriter
    from ucmagic.errors import UnsafeDirectoryError

    home = tmp_path / "home"
    before = victim_files(home)
    shared = attacker_dir(tmp_path / "shared")
    os.symlink(home / ".ssh", shared / "run1")
    chown_tree(shared)  # the link is the attacker's
    state = {"w": torch.zeros(4)}
    with pytest.raises(UnsafeDirectoryError, match="another user"):
        dcp.save(state, storage_writer=UCVolumeWriter(str(shared / "run1")))
    assert snapshot(home) == before
    mine = tmp_path / "big-disk" / "run1"
    mine.mkdir(parents=True)
    os.symlink(mine, tmp_path / "run1")  # the user's own link to a bigger disk: the folder they mean
    dcp.save(state, storage_writer=UCVolumeWriter(str(tmp_path / "run1")))
    assert ".metadata" in os.listdir(mine)


def test_makedirs_below_a_checkpoint_root_is_refused_exactly_when_a_link_is_on_the_way():
    """Model: ``makedirs(root/a/b/..., root=root)`` raises iff some folder below the root on the way to the
    target (the target included) is a symbolic link; a link's target never gains an entry."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from ucmagic.checkpoints import transfer as xfer
    from ucmagic.errors import UnsafeDirectoryError

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(depth=st.integers(1, 4), made=st.integers(0, 4), link_at=st.one_of(st.none(), st.integers(0, 4)),
           root_is_link=st.booleans())
    def check(depth, made, link_at, root_is_link):
        with tempfile.TemporaryDirectory() as tmp:
            victim = os.path.join(tmp, "victim")
            os.mkdir(victim)
            real_root = os.path.join(tmp, "real-root")
            os.mkdir(real_root)
            root = os.path.join(tmp, "root")
            if root_is_link:  # the root itself is the user's to name: a link there is followed
                os.symlink(real_root, root)
            else:
                root = real_root
            parts = [f"d{i}" for i in range(depth)]
            made_n = min(made, depth)
            cur = root
            for i, part in enumerate(parts):
                cur = os.path.join(cur, part)
                if link_at == i and i <= made_n:
                    os.symlink(victim, cur)
                    break
                if i < made_n:
                    os.mkdir(cur)
            target = os.path.join(root, *parts)
            on_the_way = link_at is not None and link_at < depth and link_at <= made_n
            if on_the_way:
                with pytest.raises(UnsafeDirectoryError, match="symbolic link"):
                    xfer.makedirs(target, root=root)
            else:
                xfer.makedirs(target, root=root)
                assert os.path.isdir(os.path.join(real_root, *parts))
            assert os.listdir(victim) == []

    check()


def test_a_load_never_reads_through_a_step_folder_link_out_of_its_root(tmp_path):
    """root/step_1 -> another run's checkpoint: load_checkpoint refuses it (UnsafeSourceError naming it),
    listing and "latest" leave it out; a link inside the root is read as before; clean never removes
    through a link."""
    torch = pytest.importorskip("torch")
    from ucmagic import list_checkpoints, load_checkpoint, save_checkpoint
    from ucmagic.checkpoints.commit import clean_checkpoints
    from ucmagic.checkpoints.format import SAVING_NAME, make_saving_record

    other = tmp_path / "other-run"
    other.mkdir()
    save_checkpoint(str(other), model=torch.nn.Linear(2, 2), step=1, single_file=True)
    root = tmp_path / "ckpts"
    root.mkdir()
    os.symlink(other / "step_1", root / "step_1")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(UnsafeSourceError, match="outside the checkpoint root") as got:
        load_checkpoint(str(root), 1, model=model)
    assert str(root / "step_1") in str(got.value)
    assert list_checkpoints(str(root)) == []
    save_checkpoint(str(root), model=model, step=2, single_file=True)
    os.symlink(root / "step_2", root / "step_3")  # inside the root: followed
    assert load_checkpoint(str(root), 3, model=model)[0] == 2
    assert load_checkpoint(str(root), model=model)[0] in (2, 3)
    # an abandoned save's folder reached through a link is not this root's to remove
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / SAVING_NAME).write_bytes(make_saving_record(save_id="x", host="another-host", pid=1, now=0))
    (elsewhere / "keep.txt").write_text("mine")
    os.symlink(elsewhere, root / "step_9")
    clean_checkpoints(str(root), force=True)
    assert sorted(os.listdir(elsewhere)) == [SAVING_NAME, "keep.txt"]


def test_ucckpt_save_refuses_a_step_folder_link_in_one_line(magic_shell, monkeypatch, tmp_path):
    torch = pytest.importorskip("torch")
    from IPython.core.error import UsageError

    monkeypatch.delenv("UCMAGIC_RAISE", raising=False)
    monkeypatch.setenv("UCMAGIC_PROGRESS", "off")
    home = tmp_path / "home"
    before = victim_files(home)
    root = tmp_path / "ckpts"
    root.mkdir()
    os.symlink(home / ".ssh", root / "step_1")
    magic_shell.user_ns["model"] = torch.nn.Linear(2, 2)
    with pytest.raises(UsageError, match="symbolic link") as got:
        magic_shell.run_line_magic("ucckpt", f"save {root} -m model --step 1")
    assert "\n" not in str(got.value) and str(root / "step_1") in str(got.value)
    assert snapshot(home) == before
