"""Checkpoints on volumes: DCP writer/reader, commit marker and manifest, save/load/list helpers."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import assume, given, settings
from torch.distributed.checkpoint import CheckpointException
from hypothesis import strategies as st

from ucmagic.checkpoints import format as fmt
from ucmagic.checkpoints import transfer as xfer
from ucmagic.checkpoints.api import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotCommittedError,
    CheckpointUploadError,
    NoCheckpointError,
    UnsafeCheckpointError,
    UCVolumeReader,
    UCVolumeWriter,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from ucmagic.files.locks import process_tag
from ucmagic.errors import SourceNotFoundError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ranks, whatever pytest's import mode
from ranks import PRELUDE, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


def trained(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make_model(seed)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(8, 16)).pow(2).mean().backward()
        opt.step()
    return model, opt


def same_model(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    if sa["param_groups"] != sb["param_groups"] or sa["state"].keys() != sb["state"].keys():
        return False
    return all(torch.equal(torch.as_tensor(sa["state"][i][k]), torch.as_tensor(sb["state"][i][k]))
               for i in sa["state"] for k in sa["state"][i])


@pytest.fixture()
def staging(tmp_path, monkeypatch):
    d = tmp_path / "staging"
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(d))
    return d


# ---------------------------------------------------------------- pure logic

@given(st.integers(min_value=0, max_value=10**12))
def test_step_dirname_round_trips(step):
    assert fmt.parse_step_dirname(fmt.step_dirname(step)) == step


def test_step_dirname_rejects_bad_steps_and_names():
    for bad in (-1, 1.5, "3", True):
        with pytest.raises(ValueError):
            fmt.step_dirname(bad)
    assert fmt.parse_step_dirname("step_x") is None and fmt.parse_step_dirname("tmp") is None


@given(st.sets(st.integers(0, 50), max_size=20), st.integers(1, 6), st.integers(0, 50))
def test_retention_keeps_the_highest_and_never_the_new_one(steps, keep, newest):
    steps = steps | {newest}
    gone = fmt.to_delete(steps, keep, newest)
    kept = steps - set(gone)
    assert newest in kept
    assert set(sorted(steps, reverse=True)[:keep]) <= kept
    assert len(kept) <= keep + 1


def test_retention_none_deletes_nothing_and_bad_keep_is_refused():
    assert fmt.to_delete([1, 2, 3], None, 3) == []
    with pytest.raises(ValueError):
        fmt.to_delete([1], 0, 1)


def test_commit_marker_round_trip():
    files = {"a.distcp": fmt.FileRecord(10, 123), ".metadata": fmt.FileRecord(3, 9)}
    data = fmt.make_commit(kind=fmt.FORMAT_DCP, save_id="s1", files=files, info={"step": 7, "extra": {"k": [1]}})
    body = fmt.parse_commit(data, "/x")
    assert body["files"] == files and body["step"] == 7 and body["extra"] == {"k": [1]} and body["bytes"] == 13


@settings(max_examples=40)
@given(st.data())
def test_a_torn_commit_marker_means_not_committed(data):
    raw = fmt.make_commit(kind=fmt.FORMAT_DCP, save_id="s", files={"f": fmt.FileRecord(1, 2)}, info={"step": 1},
                          now=1.0)
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CheckpointNotCommittedError):
        fmt.parse_commit(raw[:cut], "/ckpt/step_1")


def test_non_json_extra_is_refused():
    with pytest.raises(CheckpointError, match="JSON"):
        fmt.make_commit(kind=fmt.FORMAT_DCP, save_id="s", files={}, info={"extra": {"t": object()}})


def test_stale_files_only_lists_old_shards():
    assert fmt.stale_files(["__0_0.distcp", "__0_5.distcp", ".metadata", "notes.txt"],
                           {"__0_0.distcp": 1}) == ["__0_5.distcp"]


def test_staging_left_by_a_killed_process_is_swept(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    dead = tmp_path / f"save-abc-0-{p.pid}"  # older ucmagic's name (a bare pid): swept once untouched 10 min
    (dead / "sub").mkdir(parents=True)
    live = tmp_path / f"save-def-0-{os.getpid()}"
    live.mkdir()
    old = time.time() - 3600
    os.utime(dead, (old, old))
    os.utime(live, (old, old))
    made = xfer.make_staging_dir(str(tmp_path), "load-x")
    assert os.path.basename(made).startswith(f"load-x@{process_tag()}.")  # + random: no one can make it first
    assert not dead.exists() and live.exists()


def test_staging_of_an_exited_process_is_swept_at_once_and_a_reused_pid_does_not_protect_it(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    fresh_dead = tmp_path / f"save-abc-0@{p.pid}-1"  # just written: no age needed once the owner is gone
    (fresh_dead / "sub").mkdir(parents=True)
    reused = tmp_path / f"save-def-0@{os.getpid()}-1"  # this pid, but another start time: not this process
    reused.mkdir()
    mine = xfer.make_staging_dir(str(tmp_path), "save-mine-0")
    assert not fresh_dead.exists() and not reused.exists() and os.path.isdir(mine)
    xfer.release_staging_dir(mine)
    assert not os.path.exists(mine) and tmp_path.exists()  # a root the caller chose is not removed


def test_the_shared_staging_root_is_removed_only_when_empty(tmp_path, monkeypatch):
    monkeypatch.delenv("UCMAGIC_STAGING_DIR", raising=False)
    root = xfer.shared_staging_root()  # <cache root>/staging (conftest: a cache root of the test's own)
    assert root == os.path.join(os.environ["UCMAGIC_CACHE_DIR"], "staging")
    a = xfer.make_staging_dir(None, "save-a-0")
    b = xfer.make_staging_dir(None, "save-b-0")
    xfer.release_staging_dir(a)
    assert os.path.isdir(b)  # another saver's staging is untouched, so is the root holding it
    xfer.release_staging_dir(b)
    assert not os.path.exists(root)


def test_free_space_check_names_the_fix(tmp_path):
    with pytest.raises(CheckpointError, match="staging_dir"):
        xfer.check_free_space(str(tmp_path), 1, 10**18)


# ---------------------------------------------------------------- helpers, one process

def test_round_trip_model_and_adam_with_extra(tmp_path, staging):
    model, opt = trained()
    extra = {"loader": {"epoch": 2, "delivered": [[0, 5], [1, 7]]}, "lr": 0.01}
    path = save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=10, extra=extra)
    assert path.endswith("step_10") and os.path.exists(os.path.join(path, fmt.COMMIT_NAME))
    assert not any(os.scandir(staging)), "staged files are deleted after upload"

    model2 = make_model(seed=1)
    opt2 = torch.optim.Adam(model2.parameters(), lr=0.5)
    step, got = load_checkpoint(tmp_path / "ck", model=model2, optimizer=opt2)
    assert (step, got) == (10, extra)
    assert same_model(model, model2) and same_optim(opt, opt2)


def test_async_save_then_load(tmp_path, staging):
    model, opt = trained()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fut = save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=1, async_=True)
    with torch.no_grad():  # the training loop goes on; the checkpoint keeps the state at call time
        for p in model.parameters():
            p.add_(1.0)
    assert fut.result(timeout=60).endswith("step_1")
    model2 = make_model(3)
    load_checkpoint(tmp_path / "ck", model=model2)
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items())


def test_async_upload_errors_surface_in_the_future(tmp_path, staging, monkeypatch):
    def broken(*a, **k):
        raise PermissionError("volume is read-only")

    monkeypatch.setattr(xfer, "_copy", broken)
    model, opt = trained()
    fut = save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=1, async_=True)
    with pytest.raises(CheckpointUploadError, match="read-only"):
        fut.result(timeout=60)
    assert list_checkpoints(tmp_path / "ck") == []


def test_retention_and_latest_skip_incomplete(tmp_path, staging):
    model, opt = trained()
    root = tmp_path / "ck"
    for s in (1, 2, 3, 4):
        save_checkpoint(root, model=model, optimizer=opt, step=s, keep=2)
    (root / "step_9").mkdir()  # an unfinished save: no marker
    assert [i.step for i in list_checkpoints(root)] == [3, 4]
    assert all(i.size > 0 and i.time > 0 for i in list_checkpoints(root))
    assert sorted(os.listdir(root)) == ["step_3", "step_4", "step_9"]
    assert load_checkpoint(root, model=make_model(), optimizer=None)[0] == 4
    with pytest.raises(CheckpointNotCommittedError, match="step_9"):
        load_checkpoint(root, 9, model=make_model())


def test_corrupted_shard_byte_is_detected(tmp_path, staging):
    model, opt = trained()
    path = save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=1)
    shard = max((e for e in os.scandir(path) if e.name.endswith(".distcp")), key=lambda e: e.stat().st_size)
    with open(shard.path, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x40]))
    m2 = make_model()
    with pytest.raises(CheckpointCorruptError, match=shard.name):
        load_checkpoint(tmp_path / "ck", model=m2, optimizer=torch.optim.Adam(m2.parameters()))


def test_truncated_metadata_is_detected(tmp_path, staging):
    model, _ = trained()
    path = save_checkpoint(tmp_path / "ck", model=model, step=1)
    md = os.path.join(path, ".metadata")
    os.truncate(md, os.path.getsize(md) - 1)
    with pytest.raises(CheckpointCorruptError, match=".metadata"):
        load_checkpoint(tmp_path / "ck", model=make_model())


def test_loadable_by_torch_filesystem_reader(tmp_path, staging):
    model, _ = trained()
    path = save_checkpoint(tmp_path / "ck", model=model, step=1, files_per_rank=3)
    target = {"model": make_model(5).state_dict()}
    dcp.load(target, storage_reader=dcp.FileSystemReader(path))
    assert all(torch.equal(target["model"][k], v) for k, v in model.state_dict().items())


def test_errors_missing_root_empty_root_missing_step_and_key_mismatch(tmp_path, staging):
    with pytest.raises(SourceNotFoundError, match="nope"):
        load_checkpoint(tmp_path / "nope", model=make_model())
    with pytest.raises(SourceNotFoundError, match="nope"):
        list_checkpoints(tmp_path / "nope")
    with pytest.raises(SourceNotFoundError):
        save_checkpoint(tmp_path / "a" / "b" / "c", model=make_model(), step=1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(NoCheckpointError, match="no committed checkpoint"):
        load_checkpoint(tmp_path / "empty", model=make_model())
    save_checkpoint(tmp_path / "ck", model=make_model(), step=1)
    with pytest.raises(NoCheckpointError, match=r"committed steps: \[1\]"):
        load_checkpoint(tmp_path / "ck", 2, model=make_model())
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4), torch.nn.Linear(4, 2))
    with pytest.raises(CheckpointMismatchError, match=r"missing in the checkpoint: 3\.bias, 3\.weight"):
        load_checkpoint(tmp_path / "ck", model=other)
    m2 = make_model()
    with pytest.raises(CheckpointMismatchError, match="optimizer"):
        load_checkpoint(tmp_path / "ck", model=m2, optimizer=torch.optim.Adam(m2.parameters()))


def test_single_file_mode_round_trip_and_corruption(tmp_path, staging):
    model, opt = trained()
    fut = save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=5, extra={"e": 1}, single_file=True,
                          async_=True)
    path = fut.result(timeout=60)
    assert sorted(os.listdir(path)) == [fmt.COMMIT_NAME, fmt.SINGLE_FILE_NAME]
    model2 = make_model(9)
    opt2 = torch.optim.Adam(model2.parameters())
    assert load_checkpoint(tmp_path / "ck", model=model2, optimizer=opt2, map_location="cpu") == (5, {"e": 1})
    assert same_model(model, model2) and same_optim(opt, opt2)
    with open(os.path.join(path, fmt.SINGLE_FILE_NAME), "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        load_checkpoint(tmp_path / "ck", model=model2)


# ---------------------------------------------------------------- the DCP storage classes directly

def test_reader_loads_a_torch_filesystemwriter_checkpoint_with_defaults(tmp_path, caplog):
    sd = {"model": make_model().state_dict(), "step": 3}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain")))
    target = {"model": make_model(2).state_dict(), "step": 0}
    with caplog.at_level("INFO", logger="ucmagic"):
        dcp.load(target, storage_reader=UCVolumeReader(tmp_path / "plain"))
        dcp.load(target, storage_reader=UCVolumeReader(tmp_path / "plain"))
    assert all(torch.equal(target["model"][k], v) for k, v in sd["model"].items()) and target["step"] == 3
    assert sum("no ucmagic commit marker" in r.getMessage() for r in caplog.records) == 1, "logged once"
    with pytest.raises(CheckpointNotCommittedError, match="plain"):
        UCVolumeReader(tmp_path / "plain", require_commit=True)


def test_reader_refuses_an_incomplete_foreign_checkpoint(tmp_path):
    sd = {"a": torch.ones(1000), "b": torch.zeros(1000)}
    dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(tmp_path / "plain"), single_file_per_rank=False))
    shards = sorted(p for p in (tmp_path / "plain").iterdir() if p.suffix == ".distcp")
    os.truncate(shards[0], shards[0].stat().st_size // 2)
    with pytest.raises(CheckpointCorruptError, match="not a complete checkpoint"):
        UCVolumeReader(tmp_path / "plain")
    shards[0].unlink()
    with pytest.raises(CheckpointCorruptError, match="missing"):
        UCVolumeReader(tmp_path / "plain")
    (tmp_path / "plain" / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(CheckpointCorruptError, match="cannot be read"):
        UCVolumeReader(tmp_path / "plain")


def test_reader_refuses_unsafe_pickles(tmp_path, staging):
    from fractions import Fraction

    dcp.save({"x": torch.ones(3), "obj": Fraction(1, 3)}, storage_writer=UCVolumeWriter(tmp_path / "c"))
    with pytest.raises(BaseException, match="weights_only"):
        dcp.load({"x": torch.zeros(3), "obj": None}, storage_reader=UCVolumeReader(tmp_path / "c"))
    target = {"x": torch.zeros(3), "obj": None}
    dcp.load(target, storage_reader=UCVolumeReader(tmp_path / "c", allow_unsafe_pickle=True))
    assert target["obj"] == Fraction(1, 3) and torch.equal(target["x"], torch.ones(3))


def test_overwrite_replaces_files_and_drops_stale_shards(tmp_path, staging):
    path = tmp_path / "c"
    dcp.save({"m": make_model().state_dict()}, storage_writer=UCVolumeWriter(path, files_per_rank=4))
    new = make_model(7).state_dict()
    dcp.save({"m": new}, storage_writer=UCVolumeWriter(path, files_per_rank=2))
    shards = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))  # __0_<n>-<this save's tag>.distcp
    assert [n.split("-")[0] for n in shards] == ["__0_0", "__0_1"] and len({n.split("-")[1] for n in shards}) == 1
    target = {"m": make_model(1).state_dict()}
    dcp.load(target, storage_reader=UCVolumeReader(path))
    assert all(torch.equal(target["m"][k], v) for k, v in new.items())
    with pytest.raises(CheckpointException, match="Checkpoint already exists.*overwrite=True"):
        dcp.save({"m": new}, storage_writer=UCVolumeWriter(path, overwrite=False))


def test_dcp_async_save_future_completes_only_when_committed(tmp_path, staging):
    sd = {"m": make_model().state_dict()}
    fut = dcp.async_save(sd, storage_writer=UCVolumeWriter(tmp_path / "c", verify="full", upload_threads=2))
    fut.result(timeout=60)
    assert os.path.exists(tmp_path / "c" / fmt.COMMIT_NAME)
    target = {"m": make_model(1).state_dict()}
    dcp.load(target, storage_reader=UCVolumeReader(tmp_path / "c", download_threads=1))
    assert all(torch.equal(target["m"][k], v) for k, v in sd["m"].items())


def test_reader_downloads_only_needed_files(tmp_path, staging, monkeypatch):
    path = tmp_path / "c"
    dcp.save({"a": torch.ones(1000), "b": torch.zeros(1000)}, storage_writer=UCVolumeWriter(path, files_per_rank=2))
    got = []
    for fn in ("download_file", "download_bytes"):  # to disk / into memory
        real = getattr(xfer, fn)
        monkeypatch.setattr(xfer, fn,
                            lambda r, *a, real=real, **k: (got.append(os.path.basename(r)), real(r, *a, **k))[1])
    for budget in ("1GB", 0):
        target = {"a": torch.zeros(1000)}
        dcp.load(target, storage_reader=UCVolumeReader(path, memory_budget=budget))
        assert torch.equal(target["a"], torch.ones(1000))
    assert len(got) == 2 and got[0] == got[1]


# ---------------------------------------------------------------- processes: two ranks, a killed save

_COMMON = PRELUDE + """
import sys, warnings
warnings.simplefilter("ignore")
import torch
sys.path.insert(0, {tests!r})
from test_checkpoint import trained, make_model, same_model, same_optim
from ucmagic.checkpoints.api import save_checkpoint, load_checkpoint
"""


def test_ranks_making_one_checkpoint_root_at_once_all_get_it(tmp_path):
    """Every rank of a first save makes the root at once: none may see it half-made and call it a file (CI, torch
    2.4.1: rank 1 looked between rank 0's makedirs and its own second check)."""
    import threading

    from ucmagic.checkpoints.steps import checkpoint_root

    errors: list[BaseException] = []
    for i in range(200):
        root = str(tmp_path / f"ck{i}")
        go = threading.Barrier(4)

        def save() -> None:
            go.wait()
            try:
                checkpoint_root(root, create=True)
            except Exception as e:  # noqa: BLE001 - collected and asserted below
                errors.append(e)
        threads = [threading.Thread(target=save) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert all(os.path.isdir(tmp_path / f"ck{i}") for i in range(200))


def test_two_ranks_gloo_sync_and_async_round_trip(tmp_path):
    root = tmp_path / "ck"
    script = _COMMON.format(tests=os.path.dirname(__file__)) + f"""
import datetime
import torch.distributed as dist
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=os.environ["PG_INIT"], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=90))
print("READY", flush=True)
model, opt = trained()
save_checkpoint({str(root)!r}, model=model, optimizer=opt, step=1, extra={{"rank0": True}})
save_checkpoint({str(root)!r}, model=model, optimizer=opt, step=2, async_=True, keep=1).result(timeout=120)
m2 = make_model(4); o2 = torch.optim.Adam(m2.parameters())
step, extra = load_checkpoint({str(root)!r}, model=m2, optimizer=o2)
assert step == 2 and same_model(model, m2) and same_optim(opt, o2), "mismatch"
dist.barrier()
dist.destroy_process_group()
print("OK", rank)
"""
    f = tmp_path / "two.py"
    f.write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(tmp_path / "staging"), OMP_NUM_THREADS="1")
    run_ranks(str(f), env=env)
    assert [i.step for i in list_checkpoints(root)] == [2]
    commit = json.loads((root / "step_2" / fmt.COMMIT_NAME).read_text())
    assert any(n.startswith("__1_") for n in commit["files"]), "rank 1's shards are in the manifest"
    model, opt = trained()  # the same deterministic training, loaded in one process (different world size)
    m2 = make_model(4)
    o2 = torch.optim.Adam(m2.parameters())
    assert load_checkpoint(root, model=m2, optimizer=o2)[0] == 2
    assert same_model(model, m2) and same_optim(opt, o2)


def test_ranks_gathering_then_barrier_then_destroy_never_hang(tmp_path):
    """A user's ``barrier(); destroy_process_group()`` right after a ucmagic gather (load_checkpoint's verdicts, a
    loader's state) returns: on torch 2.4.1 the gather's tensors were freed on gloo's thread, which needs the GIL
    that destroy holds while joining that thread (CI's test: 1 run in 40-120; this loop of 30 hung 3 runs of 3).
    The lists differ in length between ranks and come back whole, in rank order."""
    script = PRELUDE + """
import datetime
import torch.distributed as dist
from ucmagic.dist import all_gather_ints
rank = int(os.environ["RANK"])
for i in range(30):
    dist.init_process_group("gloo", init_method=os.environ["PG_INIT"] + f"-{i}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=90))
    print("READY", flush=True)
    got = all_gather_ints([i] * (rank + 1), 2)
    assert got == [i, i, i], got
    dist.barrier()
    dist.destroy_process_group()
print("OK", rank)
"""
    f = tmp_path / "gather.py"
    f.write_text(script)
    outs = run_ranks(str(f), env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"), hang_s=90)
    assert all(o.rstrip().endswith(f"OK {r}") for r, o in enumerate(outs)), outs


_GLOO_PAIR = PRELUDE + """
import datetime, time
import torch.distributed as dist
from ucmagic.dist import all_gather_ints
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=os.environ["PG_INIT"], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=90))
print("READY", flush=True)
"""


def _printed_per_rank(tmp_path, script: str, key: str, **kw) -> list[int]:
    """Run ``script`` on two gloo ranks; the integer each printed after ``key``, in rank order."""
    f = tmp_path / "ranks_script.py"
    f.write_text(script)
    outs = run_ranks(str(f), env=dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1"), **{"hang_s": 90, **kw})
    return [int(o.rsplit(key, 1)[1].split()[0]) for o in outs]


_FRESH_STATE_ID = """
import ctypes, threading
ctypes.pythonapi.PyThreadState_Get.restype = ctypes.c_void_p
ctypes.pythonapi.PyThreadState_GetID.argtypes = [ctypes.c_void_p]
ctypes.pythonapi.PyThreadState_GetID.restype = ctypes.c_uint64
def fresh_state_id():  # the id of a new Python thread state: ids count every state the interpreter made
    got = []
    t = threading.Thread(target=lambda: got.append(
        ctypes.pythonapi.PyThreadState_GetID(ctypes.pythonapi.PyThreadState_Get())))
    t.start(); t.join()
    return got[0]
"""


@pytest.mark.skipif(sys.implementation.name != "cpython", reason="counts CPython's thread states")
def test_ucmagic_gathers_leave_gloo_threads_nothing_to_free_in_python(tmp_path):
    """After ucmagic's gathers (a loader's seed and state, load_checkpoint's verdicts) no thread of gloo's makes a
    Python thread state to free their tensors: Python frees them on the thread that gathered. A thread state made
    by gloo's thread while the loop forks its DataLoader workers deadlocked a worker before it ran any Python
    (Python 3.11 before CPython's fix of gh-112275: the matrix's seed gather then fork, 1 cell in ~100 under
    load); on torch < 2.8 it also hung destroy_process_group. The old code let gloo make 30 and 42 here."""
    script = _GLOO_PAIR + _FRESH_STATE_ID + """
all_gather_ints([0], 2)
before = fresh_state_id()
for i in range(40):
    assert all_gather_ints([i] * (rank + 1), 2) == [i, i, i]
time.sleep(0.5)  # gloo's threads free what they hold right after each gather
made = fresh_state_id() - before - 1
dist.barrier()
dist.destroy_process_group()
print("MADE", made)
"""
    made = _printed_per_rank(tmp_path, script, "MADE")
    assert made == [0, 0], f"thread states made by other threads during 40 gathers, per rank: {made}"


@pytest.mark.full
@pytest.mark.skipif(not hasattr(os, "fork"), reason="forks")
def test_workers_forked_right_after_gathers_start_under_load(tmp_path):
    """The hang itself, beside two busy processes: each rank gathers, then forks a child that must exit at once,
    1,000 times. With the old code 1 and 4 children of 1,000 never started (deadlocked in Python's fork handling
    on 3.11.7) in two runs; after the change none did."""
    script = _GLOO_PAIR + """
stuck = 0
for i in range(1000):
    all_gather_ints([i], 2)
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + 10
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() > deadline:
            stuck += 1
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            break
        time.sleep(0.002)
dist.barrier()
dist.destroy_process_group()
print("STUCK", stuck)
"""
    busy = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range(2)]
    try:
        stuck = _printed_per_rank(tmp_path, script, "STUCK", timeout=600, hang_s=560)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert stuck == [0, 0], f"children that never started, per rank (of 1,000): {stuck}"


def test_save_killed_during_upload_leaves_previous_checkpoint_latest(tmp_path):
    """SIGKILL while overwriting step 2 (step 1 committed): step 2 is refused, never a mixture; 1 is latest."""
    root = tmp_path / "ck"
    signal_file = tmp_path / "uploading"
    script = _COMMON.format(tests=os.path.dirname(__file__)) + f"""
import time
from ucmagic.checkpoints import transfer as xfer
model, opt = trained()
save_checkpoint({str(root)!r}, model=model, optimizer=opt, step=1)
save_checkpoint({str(root)!r}, model=model, optimizer=opt, step=2)
real = xfer._copy
def slow(src, dst, **kw):
    out = real(src, dst, **kw)
    open({str(signal_file)!r}, "w").close()
    time.sleep(120)
    return out
xfer._copy = slow
model2, opt2 = trained(seed=5)
save_checkpoint({str(root)!r}, model=model2, optimizer=opt2, step=2)
"""
    f = tmp_path / "kill.py"
    f.write_text(textwrap.dedent(script))
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(tmp_path / "staging"), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, str(f)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while not signal_file.exists():
        assert p.poll() is None, p.stdout.read().decode()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    with pytest.raises(CheckpointNotCommittedError, match="step_2"):
        load_checkpoint(root, 2, model=make_model())
    with pytest.raises(CheckpointNotCommittedError, match="step_2"):
        UCVolumeReader(root / "step_2")
    assert [i.step for i in list_checkpoints(root)] == [1]
    model, opt = trained()
    m2 = make_model(4)
    assert load_checkpoint(root, model=m2)[0] == 1 and same_model(model, m2)


# ---------------------------------------------------------------- checkpoints other tools wrote

@pytest.mark.parametrize("name,step", [("step_100", 100), ("epoch=3-step=1000.ckpt", 1000), ("checkpoint-500", 500),
                                       ("ckpt_20.pt", 20), ("ckpt-3", 3), ("step-7", 7), ("global_step200", 200),
                                       ("final.pt", None), ("model", None), ("model_20240601.pt", None),
                                       ("resnet50.pth", None), ("model_fp16.pt", None), ("run-a-5.pth", None),
                                       ("20240601", None), ("mystep_5", None), ("checkpoints-4", None)])
def test_a_foreign_checkpoints_step_is_the_number_after_a_step_word(name, step):
    assert fmt.foreign_step(name) == step


def test_a_dated_or_numbered_file_in_the_root_is_listed_without_a_step_and_never_loaded_as_latest(tmp_path, staging):
    root = tmp_path / "root"
    m20, m30 = make_model(20), make_model(30)
    save_checkpoint(root, model=m20, step=20)
    save_checkpoint(root, model=m30, step=30)
    for name in ("model_20240601.pt", "resnet50.pth", "model_fp16.pt"):
        torch.save(make_model(99).state_dict(), root / name)
    assert [(i.step, os.path.basename(i.path)) for i in list_checkpoints(root)] == [
        (20, "step_20"), (30, "step_30"), (None, "model_20240601.pt"), (None, "model_fp16.pt"), (None, "resnet50.pth")]
    target = make_model(1)
    assert load_checkpoint(root, model=target) == (30, None) and same_model(target, m30)
    with pytest.raises(NoCheckpointError, match="committed steps: \\[20, 30\\]"):
        load_checkpoint(root, 20240601, model=target)


def test_two_foreign_files_named_for_one_step_resolve_to_the_newest_written(tmp_path):
    """``checkpoint-103.pt`` then ``epoch=0-step=103.ckpt`` in one root: "latest" and step 103 both load the one
    written last (before, the first by name: the checkpoint model's hypothesis run found it on torch 2.4.1)."""
    root = tmp_path / "ck"
    root.mkdir()
    for i, name in enumerate(["checkpoint-103.pt", "epoch=0-step=103.ckpt"]):  # the newest is last by name
        torch.save(make_model(i).state_dict(), root / name)
        os.utime(root / name, (1_000_000 + i, 1_000_000 + i))
    for step in ("latest", 103):
        target = make_model(7)
        assert load_checkpoint(root, step, model=target)[0] == 103 and same_model(target, make_model(1))


def test_latest_never_picks_an_entry_without_a_step_and_prefers_ucmagic_on_a_tie():
    infos = [fmt.CheckpointInfo(None, "/r/final.pt", 9e9, 1, fmt.KIND_TORCH_SAVE),
             fmt.CheckpointInfo(5, "/r/ckpt-5", 0, 1, fmt.KIND_DCP), fmt.CheckpointInfo(5, "/r/step_5", 0, 1)]
    assert fmt.pick_latest(infos).path == "/r/step_5"
    assert fmt.pick_latest(infos[:1]) is None
    assert [i.path for i in fmt.sort_infos(infos)] == ["/r/step_5", "/r/ckpt-5", "/r/final.pt"]


@pytest.mark.timeout(300)
def test_foreign_dcp_and_torch_save_checkpoints_are_listed_marked_and_loaded(tmp_path, staging):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    root = tmp_path / "root"
    model, opt = trained()
    save_checkpoint(root, model=model, optimizer=opt, step=1)
    m5, o5 = trained(seed=5)
    msd, osd = get_state_dict(m5, o5)
    with pytest.warns(UserWarning, match="torch.distributed"):
        dcp.save({"model": msd, "optim": osd, "step": 5},  # the seed's layout (databricks.air.data)
                 storage_writer=dcp.FileSystemWriter(str(root / "torch-dcp-step-5")))
    m9 = make_model(9)
    torch.save(m9.state_dict(), root / "ckpt_9.pt")
    m7, o7 = trained(seed=7)
    torch.save({"model": m7.state_dict(), "opt": o7.state_dict()}, root / "final.pt")
    (root / "unfinished-8").mkdir()  # a DCP save still running: shards, no .metadata yet
    (root / "unfinished-8" / "__0_0.distcp").write_bytes(b"x" * 10)
    (root / "notes.txt").write_text("not a checkpoint")
    (root / "notes.pt").write_text("not a torch.save file either")

    infos = list_checkpoints(root)
    assert [(i.step, os.path.basename(i.path), i.kind) for i in infos] == [
        (1, "step_1", "ucmagic.dcp"), (5, "torch-dcp-step-5", "dcp"), (9, "ckpt_9.pt", "torch.save"),
        (None, "final.pt", "torch.save")]
    target = make_model(1)
    assert load_checkpoint(root, model=target) == (9, None) and same_model(target, m9)  # latest: the highest step
    target, topt = make_model(1), torch.optim.Adam(make_model(1).parameters(), lr=0.01)
    topt = torch.optim.Adam(target.parameters(), lr=0.01)
    assert load_checkpoint(root, 5, model=target, optimizer=topt) == (5, None)
    assert same_model(target, m5) and same_optim(topt, o5)
    r = subprocess.run([sys.executable, "-m", "ucmagic", "ckpt", "list", str(root)], capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=REPO), check=False)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].split()[-1] == "KIND" and len(lines) == 5, r.stdout
    assert lines[2].split()[0] == "5" and lines[2].split()[-1] == "dcp", r.stdout
    assert lines[4].split()[0] == "-" and lines[4].split()[-1] == "torch.save", r.stdout
    (root / "torch-dcp-step-5" / fmt.SAVING_NAME).write_text("{}")  # an in-progress record: no longer complete
    assert 5 not in [i.step for i in list_checkpoints(root)]


def test_wrong_shapes_are_a_checkpoint_mismatch_naming_the_keys(tmp_path, staging):
    model, opt = trained()
    save_checkpoint(tmp_path / "dcp", model=model, step=1)
    save_checkpoint(tmp_path / "single", model=model, step=1, single_file=True)
    (tmp_path / "pt").mkdir()
    torch.save(model.state_dict(), tmp_path / "pt" / "ckpt_1.pt")
    other = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    for root in ("dcp", "single", "pt"):
        with pytest.raises(CheckpointMismatchError,
                           match=r"shapes \(.*0.weight: checkpoint \(32, 16\), model \(64, 16\)"):
            load_checkpoint(tmp_path / root, model=other)


def test_a_load_racing_an_overwrite_names_the_overwrite_not_corruption(tmp_path, staging):
    from ucmagic.errors import CheckpointOverwrittenError

    path = tmp_path / "c"
    dcp.save({"a": torch.zeros(1000)}, storage_writer=UCVolumeWriter(path))
    reader = UCVolumeReader(path)  # checked the commit; now a new save replaces the files under it
    dcp.save({"a": torch.ones(1000)}, storage_writer=UCVolumeWriter(path, warn_overwrite=False))
    with pytest.raises(CheckpointOverwrittenError, match="overwritten while it was being loaded"):
        reader.read_metadata()
    with pytest.raises(CheckpointException) as info:  # torch's wrapper around the same error
        dcp.load({"a": torch.empty(1000)}, storage_reader=reader)
    assert "overwritten while it was being loaded" in str(info.value) and "corrupted" not in str(info.value)


_NAME_CHARS = st.sampled_from("abcdefghijklmnopqrstuvwxyz0123456789_-=.")


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 10**12), st.sampled_from(["step_{}", "step-{}", "checkpoint-{}", "epoch=3-step={}.ckpt",
                                                "ckpt_{}.pt", "ckpt-{}.pth", "global_step{}", "run-a_step={}.pt"]),
       st.text(st.sampled_from("_-=."), max_size=3))
def test_a_number_after_a_step_word_is_the_step(n, form, tail):
    assert fmt.foreign_step(form.format(n) + tail) == n


@settings(max_examples=300, deadline=None)
@given(st.text(_NAME_CHARS, max_size=24), st.sampled_from(["", ".pt", ".pth", ".ckpt"]))
def test_a_name_without_a_step_word_has_no_step(stem, suffix):
    words = ("step", "checkpoint-", "ckpt_", "ckpt-")
    assume(not any(w in stem.lower() for w in words))  # dates, bare numbers, resnet50, fp16, run-a-<N>
    assert fmt.foreign_step(stem + suffix) is None


@given(st.lists(st.tuples(st.one_of(st.none(), st.integers(0, 50)), st.sampled_from(["ucmagic.dcp", "dcp"])),
                max_size=8))
def test_latest_is_the_highest_numbered_entry_and_never_one_without_a_step(entries):
    infos = [fmt.CheckpointInfo(s, f"/r/{i}", 0.0, 0, k) for i, (s, k) in enumerate(entries)]
    latest = fmt.pick_latest(infos)
    steps = [s for s, _ in entries if s is not None]
    assert (latest is None) == (not steps)
    if latest is not None:
        assert latest.step == max(steps)
    assert [i.step is None for i in fmt.sort_infos(infos)] == sorted(i.step is None for i in infos)


# ---------------------------------------------------------------- a refused load changes nothing

def _snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> list[torch.Tensor]:
    tensors = [t.detach().clone() for t in model.state_dict().values()]
    if opt is not None:
        sd = opt.state_dict()
        tensors += [torch.as_tensor(v).clone() for i in sorted(sd["state"]) for _, v in sorted(sd["state"][i].items())]
    return tensors


def _unchanged(before: list[torch.Tensor], model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> bool:
    after = _snapshot(model, opt)
    return len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))


def _eight_layers() -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(8)])


def _flip_byte(path, at: int = 100) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def _damage(step_dir, how: str) -> None:
    shards = sorted(p for p in step_dir.iterdir() if p.name.endswith(".distcp"))
    assert len(shards) == 4
    if how.startswith("flip-"):
        _flip_byte(shards[int(how[-1])], at=shards[int(how[-1])].stat().st_size // 2)
    elif how == "missing-shard":
        shards[2].unlink()
    elif how == "truncated-metadata":
        md = step_dir / ".metadata"
        md.write_bytes(md.read_bytes()[: md.stat().st_size // 2])


@pytest.mark.parametrize("how", ["flip-0", "flip-1", "flip-2", "flip-3", "missing-shard", "truncated-metadata"])
@pytest.mark.parametrize("with_optimizer", [False, True])
def test_a_refused_load_changes_nothing_in_the_model_or_optimizer(tmp_path, staging, how, with_optimizer):
    model = _eight_layers()
    opt = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, model=model, optimizer=opt, step=1, files_per_rank=4)
    _damage(tmp_path / "step_1", how)
    target = _eight_layers()
    for p in target.parameters():
        torch.nn.init.zeros_(p)
    topt = torch.optim.Adam(target.parameters()) if with_optimizer else None
    before = _snapshot(target, topt)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path, model=target, optimizer=topt)
    assert _unchanged(before, target, topt)
    if topt is not None:
        assert not topt.state  # the optimizer had no state before the refused load, and has none after


def test_a_refused_load_with_wrong_shapes_or_a_damaged_single_file_changes_nothing(tmp_path, staging):
    model, opt = trained()
    save_checkpoint(tmp_path / "dcp", model=model, optimizer=opt, step=1)
    save_checkpoint(tmp_path / "single", model=model, optimizer=opt, step=1, single_file=True)
    other = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 5))
    for root in ("dcp", "single"):
        before = _snapshot(other)
        with pytest.raises(CheckpointMismatchError):
            load_checkpoint(tmp_path / root, model=other)
        assert _unchanged(before, other)
    _flip_byte(tmp_path / "single" / "step_1" / fmt.SINGLE_FILE_NAME, at=200)
    target, topt = trained(seed=3)
    before = _snapshot(target, topt)
    with pytest.raises(CheckpointCorruptError):
        load_checkpoint(tmp_path / "single", model=target, optimizer=topt)
    assert _unchanged(before, target, topt)
    plain = tmp_path / "plain"
    plain.mkdir()
    torch.save(model.state_dict(), plain / "ckpt_1.pt")  # a model only: asking for the optimizer changes nothing
    before = _snapshot(target, topt)
    with pytest.raises(CheckpointMismatchError, match="holds no optimizer state"):
        load_checkpoint(plain, model=target, optimizer=topt)
    assert _unchanged(before, target, topt)


class _TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head1 = torch.nn.Linear(4, 4)
        self.head2 = torch.nn.Linear(4, 4)  # never used in forward: never gets a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head1(x)


@pytest.mark.parametrize("single_file", [False, True])
def test_optimizer_state_loads_when_a_parameter_never_got_a_gradient(tmp_path, staging, single_file):
    model = _TwoHeads()
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    save_checkpoint(tmp_path, model=model, optimizer=opt, step=1, single_file=single_file)
    target = _TwoHeads()
    topt = torch.optim.Adam(target.parameters())
    assert load_checkpoint(tmp_path, model=target, optimizer=topt)[0] == 1
    assert same_model(model, target) and same_optim(opt, topt)
    assert len(topt.state) == 2  # head1's weight and bias; head2 has none, as when it was saved


# ---------------------------------------------------------------- messages: one line each, named

def test_a_missing_store_credential_is_named_with_how_to_set_it(tmp_path, monkeypatch):
    from ucmagic.checkpoints.steps import credentials_error as _credentials_error
    from ucmagic.errors import CheckpointCredentialsError

    class NoCredentialsError(Exception):  # botocore's class, by name: botocore need not be installed
        pass

    wrapped = CheckpointException("save", {0: (NoCredentialsError("Unable to locate credentials"), None)})
    err = _credentials_error(wrapped, "s3://bucket/run")
    assert isinstance(err, CheckpointCredentialsError) and "\n" not in str(err)
    assert "AWS_ACCESS_KEY_ID" in str(err) and "storage_options" in str(err) and str(err).startswith("s3://bucket/run")
    assert _credentials_error(OSError("disk full"), "x") is None
    pytest.importorskip("s3fs")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(tmp_path / "staging"))
    opts = {"skip_instance_cache": True, "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}}  # never reached
    with pytest.raises(CheckpointCredentialsError, match="AWS_ACCESS_KEY_ID"):
        list_checkpoints("s3://ucmagic-no-such-bucket/run", storage_options=opts)


def test_an_unsafe_checkpoint_error_is_one_line_naming_the_refused_global_without_terminal_codes(tmp_path):
    import pickle

    from ucmagic.checkpoints.unpickle import unsafe_reason

    exc = pickle.UnpicklingError("Weights only load failed. Re-run with \x1b[1mweights_only=False\x1b[0m ...\n\n"
                                 "\x1b[1mWeightsUnpickler error: Unsupported global: GLOBAL posix.system\x1b[0m\n\n"
                                 "Docs")
    assert unsafe_reason(exc) == "WeightsUnpickler error: Unsupported global: GLOBAL posix.system"
    torch.save({"model": _Evil()}, tmp_path / "ckpt_1.pt")
    with pytest.raises(UnsafeCheckpointError) as info:
        load_checkpoint(tmp_path, model=make_model())
    assert "\x1b" not in str(info.value) and "\n" not in str(info.value) and "getcwd" in str(info.value)


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())


def test_ucckpt_names_urls_as_roots_and_says_only_what_is_wrong_with_step_or_keep(magic_shell, monkeypatch):
    from IPython.core.error import UsageError

    monkeypatch.delenv("UCMAGIC_RAISE", raising=False)
    magic_shell.user_ns["m"] = make_model()
    help_text = magic_shell.find_line_magic("ucckpt").__doc__
    assert "not a URL" not in help_text and "URL" in help_text
    with pytest.raises(UsageError) as info:
        magic_shell.run_line_magic("ucckpt", "save /tmp -m m --step -5")
    assert "--step -5" in str(info.value) and "keep" not in str(info.value)
    with pytest.raises(UsageError) as info:
        magic_shell.run_line_magic("ucckpt", "save /tmp -m m --step 5 --keep 0")
    assert "--keep 0" in str(info.value) and "--step" not in str(info.value)
