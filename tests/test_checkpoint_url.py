"""Checkpoint roots that are fsspec URLs (``s3://bucket/run/ckpts``), on a real S3-compatible server on
loopback (moto's standalone server): save, list, load, torch's own FsspecReader, interrupted saves and
damaged shards keep the guarantees they have on a disk."""
from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ucmagic.checkpoints import format as fmt
from ucmagic._util import is_remote_url
from ucmagic.checkpoints import transfer as xfer
from ucmagic.checkpoints.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotCommittedError,
    NoCheckpointError,
    UCVolumeReader,
    UCVolumeWriter,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from ucmagic.checkpoints.commit import clean_checkpoints
from ucmagic.errors import CheckpointAbandonedError, SourceNotFoundError
from ucmagic.files.volume import FsspecVolume

from test_checkpoint import make_model, same_model, trained  # the checkpoint tests' model and comparison

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.timeout(300)]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def opts(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return {"client_kwargs": {"endpoint_url": s3_endpoint}, "key": "testing", "secret": "testing"}


@pytest.fixture
def s3fs_(opts: dict[str, Any]) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**opts)


@pytest.fixture
def root(s3fs_: Any) -> Iterator[str]:
    """A fresh bucket (each test its own: volumes are kept per bucket) and a checkpoint root in it."""
    bucket = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3fs_.mkdir(bucket)
    yield f"s3://{bucket}/run1/ckpts"
    s3fs_.rm(bucket, recursive=True)


def keys_under(fs: Any, url: str) -> list[str]:
    return sorted(p.rsplit("/", 1)[-1] for p in fs.find(url.removeprefix("s3://")))


def save(root: str, model: torch.nn.Module, opt: Any, step: int, mode: str, **kw: Any) -> str:
    fut_or_path = save_checkpoint(root, model=model, optimizer=opt, step=step, extra={"seen": step * 10},
                                  async_=mode == "async", single_file=mode == "single_file", **kw)
    return fut_or_path if isinstance(fut_or_path, str) else fut_or_path.result(timeout=120)


@pytest.mark.parametrize("mode", ["sync", "async", "single_file"])
def test_s3_root_round_trip_save_list_load_and_retention(root: str, opts: dict[str, Any], s3fs_: Any,
                                                         mode: str) -> None:
    model1, opt1 = trained(1)
    path1 = save(root, model1, opt1, 1, mode, storage_options=opts)
    assert path1 == f"{root}/step_1"
    model2, opt2 = trained(2)
    save(root, model2, opt2, 2, mode, storage_options=opts)

    infos = list_checkpoints(root, storage_options=opts)
    assert [(i.step, i.path) for i in infos] == [(1, f"{root}/step_1"), (2, f"{root}/step_2")]
    assert all(i.size > 0 and i.kind.startswith("ucmagic") for i in infos)
    kept = keys_under(s3fs_, f"{root}/step_2")
    assert fmt.COMMIT_NAME in kept and fmt.SAVING_NAME not in kept  # committed, no record left behind

    fresh = make_model(9)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    assert load_checkpoint(root, model=fresh, optimizer=fresh_opt, storage_options=opts) == (2, {"seen": 20})
    assert same_model(fresh, model2)
    assert load_checkpoint(root, 1, model=fresh, storage_options=opts) == (1, {"seen": 10})
    assert same_model(fresh, model1)

    save(root, model2, opt2, 3, mode, storage_options=opts, keep=1)  # retention deletes steps 1 and 2
    assert [i.step for i in list_checkpoints(root, storage_options=opts)] == [3]
    assert keys_under(s3fs_, f"{root}/step_1") == []


def test_s3_root_from_fsspec_config_and_torch_fsspec_reader_loads_it(root: str, opts: dict[str, Any],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Without storage_options the store's fsspec configuration applies, as for torch's FsspecReader,
    which reads a DCP checkpoint ucmagic wrote (its layout is plain DCP plus ucmagic's two markers)."""
    import fsspec.config

    monkeypatch.setitem(fsspec.config.conf, "s3", dict(opts))
    model, opt = trained(3)
    path = save_checkpoint(root, model=model, optimizer=opt, step=7)
    assert [i.step for i in list_checkpoints(root)] == [7]

    from torch.distributed.checkpoint import _fsspec_filesystem  # torch 2.4 has it there, not in dcp

    reader_cls = getattr(dcp, "FsspecReader", None) or _fsspec_filesystem.FsspecReader
    fresh = make_model(8)
    state = {"model": fresh.state_dict()}
    dcp.load(state, storage_reader=reader_cls(path))
    fresh.load_state_dict(state["model"])
    assert same_model(fresh, model)


def test_dcp_save_and_load_through_the_storage_classes_on_s3(root: str, opts: dict[str, Any]) -> None:
    model = make_model(4)
    url = f"{root}/by-hand"
    dcp.save({"model": model.state_dict()}, storage_writer=UCVolumeWriter(url, storage_options=opts))
    fresh = make_model(5)
    state = {"model": fresh.state_dict()}
    dcp.load(state, storage_reader=UCVolumeReader(url, storage_options=opts))
    fresh.load_state_dict(state["model"])
    assert same_model(fresh, model)
    assert [(i.step, i.path) for i in list_checkpoints(root, storage_options=opts)] == [(None, url)]


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("target", ["new step", "overwrite"])
def test_s3_save_that_fails_mid_upload_is_never_listed_nor_loaded(root: str, opts: dict[str, Any], s3fs_: Any,
                                                                  monkeypatch: pytest.MonkeyPatch, mode: str,
                                                                  target: str) -> None:
    """A new step that fails is skipped, step 1 stays latest; a failed re-save of step 1 has withdrawn it
    (never the old state, never a mixture)."""
    model1, opt1 = trained(1)
    save(root, model1, opt1, 1, mode, storage_options=opts)
    step = 2 if target == "new step" else 1
    real_upload = FsspecVolume.upload
    calls = []

    def failing_upload(self: FsspecVolume, local_path: str, rel: str) -> None:
        calls.append(rel)
        if len(calls) > 1:  # the first shard arrives, every later one fails
            raise OSError("connection reset by the store")
        real_upload(self, local_path, rel)

    monkeypatch.setattr(FsspecVolume, "upload", failing_upload)
    model2, opt2 = trained(2)
    with pytest.raises(CheckpointError, match=f"step_{step}|connection reset"):
        save(root, model2, opt2, step, mode, storage_options=opts, files_per_rank=4)
    monkeypatch.setattr(FsspecVolume, "upload", real_upload)

    assert fmt.COMMIT_NAME not in keys_under(s3fs_, f"{root}/step_{step}")
    fresh = make_model(9)
    with pytest.raises(CheckpointError, match="failed|in progress"):  # refused, never half-loaded
        load_checkpoint(root, step, model=fresh, storage_options=opts)
    if target == "new step":
        assert [i.step for i in list_checkpoints(root, storage_options=opts)] == [1]
        assert load_checkpoint(root, model=fresh, storage_options=opts)[0] == 1
        assert same_model(fresh, model1)
    else:
        assert list_checkpoints(root, storage_options=opts) == []
        with pytest.raises(NoCheckpointError):
            load_checkpoint(root, model=fresh, storage_options=opts)


_KILLED_SAVE = r"""
import os, sys, time
import torch
from ucmagic.checkpoints.api import save_checkpoint
from ucmagic.files.volume import FsspecVolume

real = FsspecVolume.upload
def slow_upload(self, local_path, rel):
    real(self, local_path, rel)
    print("uploaded", rel, flush=True)
    time.sleep(60)  # killed here, one shard in
FsspecVolume.upload = slow_upload
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
opts = {"client_kwargs": {"endpoint_url": sys.argv[2]}, "key": "testing", "secret": "testing"}
save_checkpoint(sys.argv[1], model=model, step=5, storage_options=opts)
"""


def test_s3_save_killed_mid_upload_leaves_nothing_committed(root: str, opts: dict[str, Any], s3fs_: Any,
                                                           s3_endpoint: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, root, s3_endpoint], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": REPO})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        assert line.startswith("uploaded"), line
    finally:
        proc.kill()
        proc.wait(30)
    names = keys_under(s3fs_, f"{root}/step_5")
    assert fmt.SAVING_NAME in names and fmt.COMMIT_NAME not in names
    assert list_checkpoints(root, storage_options=opts) == []
    with pytest.raises(NoCheckpointError):
        load_checkpoint(root, model=make_model(), storage_options=opts)
    with pytest.raises(CheckpointAbandonedError, match="was killed"):  # its saver here is gone: said at once
        UCVolumeReader(f"{root}/step_5", storage_options=opts, wait=3600)
    assert clean_checkpoints(root, storage_options=opts) == [f"{root}/step_5"]  # through the store's API
    assert keys_under(s3fs_, f"{root}/step_5") == []


@pytest.mark.parametrize("mode", ["sync", "single_file"])
def test_s3_damaged_shard_is_caught_by_its_crc_on_load(root: str, opts: dict[str, Any], s3fs_: Any,
                                                       mode: str) -> None:
    model, opt = trained(1)
    save(root, model, opt, 1, mode, storage_options=opts)
    shard = next(k for k in keys_under(s3fs_, f"{root}/step_1") if k.endswith((".distcp", ".pt")))
    key = f"{root}/step_1/{shard}".removeprefix("s3://")
    data = bytearray(s3fs_.cat_file(key))
    data[len(data) // 2] ^= 0xFF  # same size, one byte flipped
    s3fs_.pipe_file(key, bytes(data))
    with pytest.raises(CheckpointCorruptError, match=shard):
        load_checkpoint(root, model=make_model(9), storage_options=opts)


def test_s3_root_with_nothing_there_says_so(root: str, opts: dict[str, Any]) -> None:
    with pytest.raises(SourceNotFoundError, match="nothing is stored there"):
        list_checkpoints(root, storage_options=opts)
    with pytest.raises(SourceNotFoundError):
        load_checkpoint(root, model=make_model(), storage_options=opts)


def test_s3_directory_without_commit_nor_metadata_is_refused(root: str, opts: dict[str, Any]) -> None:
    save_checkpoint(root, model=make_model(), step=1, storage_options=opts)
    for name in (fmt.COMMIT_NAME, fmt.METADATA_NAME):  # shards only: what a save killed early leaves
        xfer.remove_quietly(f"{root}/step_1/{name}")
    with pytest.raises(CheckpointNotCommittedError):
        UCVolumeReader(f"{root}/step_1", storage_options=opts)
    assert list_checkpoints(root, storage_options=opts) == []


def test_checkpoint_url_splits_into_store_and_key() -> None:
    assert is_remote_url("s3://b/run") and not is_remote_url("/Volumes/c/s/v") and not is_remote_url("file:///tmp/x")
    assert xfer.url_path("s3://b/run/ckpts/") == "s3://b/run/ckpts"


@pytest.fixture
def memory_root() -> Iterator[str]:
    import fsspec

    prefix = f"ckpt-{uuid.uuid4().hex[:12]}"
    yield f"memory://{prefix}/run"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/{prefix}"):
        fs.rm(f"/{prefix}", recursive=True)


@pytest.mark.parametrize("mode", ["sync", "async", "single_file"])
def test_memory_root_round_trip_needs_no_server(memory_root: str, mode: str) -> None:
    """Any fsspec store serves as a root (here memory://, which needs no S3 package or server)."""
    model, opt = trained(1)
    assert save(memory_root, model, opt, 3, mode) == f"{memory_root}/step_3"
    assert [(i.step, i.path) for i in list_checkpoints(memory_root)] == [(3, f"{memory_root}/step_3")]
    fresh = make_model(9)
    assert load_checkpoint(memory_root, model=fresh) == (3, {"seen": 30})
    assert same_model(fresh, model)


def test_unknown_url_protocol_is_one_checkpoint_error() -> None:
    with pytest.raises(CheckpointError, match="nosuchproto://x/y.*whose protocol is installed"):
        list_checkpoints("nosuchproto://x/y")


_TWO_RANKS = r"""
import datetime, os, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed as dist
from ucmagic.checkpoints.api import load_checkpoint, save_checkpoint
root, endpoint = os.environ["CKPT_ROOT"], os.environ["S3_ENDPOINT"]
opts = {"client_kwargs": {"endpoint_url": endpoint}, "key": "testing", "secret": "testing"}
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=os.environ["PG_INIT"], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=90))
print("READY", flush=True)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
save_checkpoint(root, model=model, step=1, storage_options=opts)
save_checkpoint(root, model=model, step=2, async_=True, keep=1, storage_options=opts).result(timeout=120)
torch.manual_seed(1)
fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
assert load_checkpoint(root, model=fresh, storage_options=opts)[0] == 2
assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values()))
dist.barrier()
dist.destroy_process_group()
print("OK", rank)
"""


def test_two_gloo_ranks_save_and_load_on_s3(root: str, opts: dict[str, Any], s3_endpoint: str, tmp_path: Any) -> None:
    import json

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from ranks import PRELUDE, run_ranks

    script = tmp_path / "two.py"
    script.write_text(PRELUDE + _TWO_RANKS)
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(tmp_path / "staging"),
               OMP_NUM_THREADS="1", CKPT_ROOT=root, S3_ENDPOINT=s3_endpoint)
    outs = run_ranks(str(script), env=env)
    assert all("OK" in o for o in outs)
    assert [i.step for i in list_checkpoints(root, storage_options=opts)] == [2]
    commit = json.loads(xfer.read_bytes(f"{root}/step_2/{fmt.COMMIT_NAME}"))
    assert any(n.startswith("__1_") for n in commit["files"]), "rank 1's shards are in the manifest"


def test_s3_save_to_a_missing_bucket_says_what_failed(opts: dict[str, Any]) -> None:
    with pytest.raises(CheckpointError, match=r"s3://no-such-bucket-[0-9a-f]+/ckpts/step_1.*check the URL"):
        save_checkpoint(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/ckpts", model=make_model(), step=1,
                        storage_options=opts)


def test_s3_root_lists_and_loads_what_torch_fsspec_writer_and_torch_save_wrote(
        root: str, opts: dict[str, Any], s3fs_: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Foreign checkpoints in a URL root: a DCP directory torch's FsspecWriter made (kind "dcp", no
    checksums) and a torch.save file (kind "torch.save"), listed and loaded as on a disk."""
    import fsspec.config
    from torch.distributed.checkpoint import _fsspec_filesystem  # torch 2.4 has it there, not in dcp

    monkeypatch.setitem(fsspec.config.conf, "s3", dict(opts))
    writer_cls = getattr(dcp, "FsspecWriter", None) or _fsspec_filesystem.FsspecWriter
    dcp_model, file_model = make_model(1), make_model(2)
    # sync_files=False: torch 2.4's FsspecWriter fsyncs its streams, which an S3 stream cannot do (no fileno)
    dcp.save({"model": dcp_model.state_dict()},
             storage_writer=writer_cls(f"{root}/checkpoint-300", sync_files=False))
    with s3fs_.open(f"{root}/ckpt_400.pt".removeprefix("s3://"), "wb") as f:
        torch.save({"model": file_model.state_dict()}, f)

    infos = list_checkpoints(root, storage_options=opts)
    assert [(i.step, i.kind, i.path) for i in infos] == [
        (300, "dcp", f"{root}/checkpoint-300"), (400, "torch.save", f"{root}/ckpt_400.pt")]
    fresh = make_model(9)
    assert load_checkpoint(root, model=fresh, storage_options=opts) == (400, None)
    assert same_model(fresh, file_model)
    assert load_checkpoint(root, 300, model=fresh, storage_options=opts) == (300, None)
    assert same_model(fresh, dcp_model)


def test_memory_root_killed_saves_are_reclaimed_by_the_next_save_and_by_clean(memory_root: str) -> None:
    """A killed save's step directory on a URL root (its record's owner is a process of this host that is
    gone) is refused at once, never listed, and removed through the store by the next save and by clean."""
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()
    for step in (1, 2):
        d = f"{memory_root}/step_{step}"
        xfer.write_bytes(f"{d}/{fmt.SAVING_NAME}", fmt.make_saving_record(
            save_id="killed", host=socket.gethostname(), pid=int(dead), owner=f"{dead}-1"))
        xfer.write_bytes(f"{d}/__0_0-abc.distcp", b"partial")
    with pytest.raises(CheckpointAbandonedError):
        UCVolumeReader(f"{memory_root}/step_1", wait=3600)
    assert list_checkpoints(memory_root) == []
    save_checkpoint(memory_root, model=make_model(), step=3)
    assert [i.step for i in list_checkpoints(memory_root)] == [3]
    assert not xfer.exists(f"{memory_root}/step_1") and not xfer.exists(f"{memory_root}/step_2")
    xfer.write_bytes(f"{memory_root}/step_4/{fmt.SAVING_NAME}", fmt.make_saving_record(
        save_id="killed", host=socket.gethostname(), pid=int(dead), owner=f"{dead}-1"))
    assert clean_checkpoints(memory_root) == [f"{memory_root}/step_4"]
    assert [i.step for i in list_checkpoints(memory_root)] == [3]
