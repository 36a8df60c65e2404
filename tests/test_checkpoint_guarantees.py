"""The drop-in guarantees of checkpoints (issue 14): never stale or mixed, durable at exit, torch's
conventions (CheckpointException on overwrite, cleanup on failure), quiet, and ``/Volumes`` paths."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import CheckpointException

import ucmagic
from ucmagic.checkpoints import format as fmt
from ucmagic.checkpoints import transfer as xfer
from ucmagic.checkpoints.api import (
    CheckpointExistsError,
    CheckpointInProgressError,
    UCVolumeReader,
    UCVolumeWriter,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from ucmagic.errors import SourceNotFoundError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is:UserWarning")  # direct dcp calls in tests
TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)
from test_checkpoint import make_model, same_model, trained  # noqa: E402 - needs tests/ on sys.path
from ranks import PRELUDE, run_ranks  # noqa: E402
from run_size import pick  # noqa: E402


@pytest.fixture()
def staging(tmp_path, monkeypatch):
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(tmp_path / "staging"))
    return tmp_path / "staging"


def run_script(tmp_path, name: str, body: str, timeout: float = 240) -> subprocess.CompletedProcess:
    f = tmp_path / name
    f.write_text(f"import os, sys, time\nsys.path.insert(0, {TESTS!r})\n" + textwrap.dedent(body))
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(tmp_path / "staging"), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(f)], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)


# ---------------------------------------------------------------- never stale, never mixed

_SEED = """
import warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from test_checkpoint import trained, make_model, same_model, same_optim
from ucmagic import UCVolumeReader, UCVolumeWriter

checkpoint_path, delay, wait = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "wait"
model, optimizer = trained(seed=1)          # the new state; the directory holds trained(seed=0)
model_sd, optim_sd = get_state_dict(model, optimizer)
state_dict = {"model": model_sd, "optim": optim_sd, "step": 1000}
dcp.async_save(state_dict, storage_writer=UCVolumeWriter(checkpoint_path))
time.sleep(delay)
m2 = make_model(7); o2 = torch.optim.Adam(m2.parameters(), lr=0.01)
model_sd, optim_sd = get_state_dict(m2, o2)
state_dict = {"model": model_sd, "optim": optim_sd}
try:
    reader = UCVolumeReader(checkpoint_path, wait=60) if wait else UCVolumeReader(checkpoint_path)
    dcp.load(state_dict, storage_reader=reader)
    set_state_dict(m2, o2, model_state_dict=state_dict["model"], optim_state_dict=state_dict["optim"])
except BaseException as e:
    print("RESULT error", type(e).__name__)
    sys.exit(0)
old_m, old_o = trained(seed=0)
if same_model(m2, model) and same_optim(o2, optimizer):
    print("RESULT new")
elif same_model(m2, old_m) and same_optim(o2, old_o):
    print("RESULT old")
else:
    print("RESULT mixed")
"""


@pytest.mark.timeout(900)
def test_seed_async_save_then_load_is_never_old_or_mixed_in_fresh_processes(tmp_path, staging):
    """The seed's async_save-then-load over an older committed checkpoint, fresh processes (6; 10 under
    --full), the load starting at varied delays: it returns the new state or fails loudly, never the old or a mixture;
    with wait= it always returns the new state."""
    template = tmp_path / "template"
    model, opt = trained(seed=0)
    save_checkpoint(template, model=model, optimizer=opt, step=1)
    script = tmp_path / "seed.py"
    script.write_text(f"import os, sys, time\nsys.path.insert(0, {TESTS!r})\n" + _SEED)
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(staging), OMP_NUM_THREADS="1")
    # before, during and after the upload (the default suite: 6 of the 10)
    trials = [(d, "nowait") for d in pick((0, 0.01, 0.2, 2.0), (0, 0.001, 0.01, 0.05, 0.2, 0.5, 2.0))]
    trials += [(d, "wait") for d in pick((0, 0.5), (0, 0.05, 0.5))]

    def trial(k: int) -> tuple[str, subprocess.CompletedProcess]:
        path = tmp_path / f"t{k}" / "step_1"
        shutil.copytree(template / "step_1", path)
        delay, mode = trials[k]
        p = subprocess.run([sys.executable, str(script), str(path), str(delay), mode], env=env,
                           capture_output=True, text=True, timeout=600, check=False)
        return mode, p

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(trial, range(len(trials))))
    outcomes = []
    for mode, p in results:
        assert p.returncode == 0, p.stdout + p.stderr
        line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT")][-1]
        outcomes.append((mode, line))
        assert line not in ("RESULT old", "RESULT mixed"), outcomes
        if mode == "wait":
            assert line == "RESULT new", (line, p.stderr)
        elif line != "RESULT new":
            assert line in ("RESULT error CheckpointInProgressError", "RESULT error CheckpointException"), line
    print("seed outcomes:", sorted(Counter(outcomes).items()))  # shown with -s
    for k in range(len(trials)):  # every save committed, before its process exited
        assert fmt.COMMIT_NAME in os.listdir(tmp_path / f"t{k}" / "step_1")
        assert fmt.SAVING_NAME not in os.listdir(tmp_path / f"t{k}" / "step_1")


def test_a_reader_refuses_a_save_in_progress_and_wait_waits_for_its_commit(tmp_path, staging, monkeypatch):
    path = tmp_path / "c"
    dcp.save({"a": torch.zeros(4)}, storage_writer=UCVolumeWriter(path))
    gate = __import__("threading").Event()
    real = xfer.upload_file
    monkeypatch.setattr(xfer, "upload_file", lambda *a, **k: (gate.wait(60), real(*a, **k))[1])
    fut = dcp.async_save({"a": torch.ones(4)}, storage_writer=UCVolumeWriter(path))
    try:
        assert fmt.COMMIT_NAME not in os.listdir(path) and ".metadata" not in os.listdir(path), "old one withdrawn"
        with pytest.raises(CheckpointInProgressError, match="a save into this directory is in progress since"):
            UCVolumeReader(path)
        with pytest.raises(CheckpointInProgressError, match="waited"):
            UCVolumeReader(path, wait=0.2)
        with pytest.raises(CheckpointException, match=r"\.metadata"):  # torch's own reader refuses it too
            dcp.load({"a": torch.zeros(4)}, storage_reader=dcp.FileSystemReader(str(path)))
    finally:
        gate.set()
    target = {"a": torch.zeros(4)}
    dcp.load(target, storage_reader=UCVolumeReader(path, wait=60))
    assert torch.equal(target["a"], torch.ones(4))
    fut.result(timeout=60)


def test_a_failed_save_is_reported_by_readers_and_cleans_its_staging(tmp_path, staging, monkeypatch):
    path = tmp_path / "c"
    dcp.save({"a": torch.zeros(4)}, storage_writer=UCVolumeWriter(path))

    def broken(*a, **k):
        raise PermissionError("volume is read-only")

    monkeypatch.setattr(xfer, "_copy", broken)
    with pytest.raises(CheckpointException, match="read-only"):
        dcp.save({"a": torch.ones(4)}, storage_writer=UCVolumeWriter(path))
    assert not any(os.scandir(staging)), "staged shards are removed after a failure"
    with pytest.raises(CheckpointInProgressError, match="failed .*read-only.*save again"):
        UCVolumeReader(path)
    monkeypatch.undo()
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(staging))
    dcp.save({"a": torch.full((4,), 2.0)}, storage_writer=UCVolumeWriter(path))  # saving again recovers
    target = {"a": torch.zeros(4)}
    dcp.load(target, storage_reader=UCVolumeReader(path))
    assert torch.equal(target["a"], torch.full((4,), 2.0))


# ---------------------------------------------------------------- durable at exit

_AT_EXIT = """
import threading
import torch
import torch.distributed.checkpoint as dcp
from ucmagic import UCVolumeWriter
from ucmagic.checkpoints import transfer as xfer
at_exit = threading.Event()  # set when ucmagic says it waits for the save at exit
class Watched:
    def __init__(self, stream):
        self.stream = stream
    def write(self, text):
        if "waiting for" in text:
            at_exit.set()
        return self.stream.write(text)
    def __getattr__(self, name):
        return getattr(self.stream, name)
sys.stderr = Watched(sys.stderr)
real = xfer._copy
def slow(src, dst, **kw):  # the upload goes on only once the script has ended and ucmagic waits for it
    at_exit.wait(120)
    if {fail!r}:
        raise PermissionError("volume went read-only")
    return real(src, dst, **kw)
xfer._copy = slow
torch.manual_seed(0)
state = {{"w": torch.randn(256, 1024), "step": 7}}
dcp.async_save(state, storage_writer=UCVolumeWriter({path!r}, files_per_rank=2))
print("script done")
"""


def test_an_async_save_left_running_at_exit_is_committed(tmp_path):
    path = str(tmp_path / "ck")
    p = run_script(tmp_path, "exit.py", _AT_EXIT.format(path=path, fail=False))
    assert p.returncode == 0, p.stderr
    assert "waiting for 1 checkpoint save(s) to finish before exit" in p.stderr and path in p.stderr
    assert "cannot schedule new futures" not in p.stderr
    torch.manual_seed(0)
    expected = torch.randn(256, 1024)
    target = {"w": torch.zeros(256, 1024), "step": 0}
    dcp.load(target, storage_reader=UCVolumeReader(path))
    assert torch.equal(target["w"], expected) and target["step"] == 7


def test_an_async_save_that_cannot_complete_at_exit_is_reported_and_exits_non_zero(tmp_path):
    path = str(tmp_path / "ck")
    p = run_script(tmp_path, "exit_fail.py", _AT_EXIT.format(path=path, fail=True))
    assert p.returncode != 0, p.stderr
    assert f"checkpoint NOT saved: {path}" in p.stderr and "read-only" in p.stderr
    assert fmt.COMMIT_NAME not in os.listdir(path)


def test_save_checkpoint_async_at_exit_commits_and_applies_retention(tmp_path):
    root = str(tmp_path / "ck")
    p = run_script(tmp_path, "exit_helper.py", f"""
        from test_checkpoint import trained
        from ucmagic import save_checkpoint
        model, opt = trained()
        save_checkpoint({root!r}, model=model, optimizer=opt, step=1)
        save_checkpoint({root!r}, model=model, optimizer=opt, step=2, async_=True, keep=1)
        """)
    assert p.returncode == 0, p.stderr
    assert [i.step for i in list_checkpoints(root)] == [2] and sorted(os.listdir(root)) == ["step_2"]


# ---------------------------------------------------------------- torch's conventions

def test_overwrite_refusal_is_torchs_checkpoint_exception_sync_and_async(tmp_path, staging):
    path = tmp_path / "c"
    dcp.save({"a": torch.zeros(4)}, storage_writer=UCVolumeWriter(path))
    with pytest.raises(CheckpointException, match="Checkpoint already exists") as info:
        dcp.save({"a": torch.ones(4)}, storage_writer=UCVolumeWriter(path, overwrite=False))
    assert "overwrite=True" in str(info.value), "ucmagic's hint"
    fut = dcp.async_save({"a": torch.ones(4)}, storage_writer=UCVolumeWriter(path, overwrite=False))
    with pytest.raises(CheckpointException, match="Checkpoint already exists"):
        fut.result(timeout=60)
    target = {"a": torch.ones(4)}
    dcp.load(target, storage_reader=UCVolumeReader(path))  # the refused saves withdrew nothing
    assert torch.equal(target["a"], torch.zeros(4))
    dcp.save({"a": torch.ones(4)}, storage_writer=UCVolumeWriter(path, overwrite=True))
    dcp.load(target, storage_reader=UCVolumeReader(path))
    assert torch.equal(target["a"], torch.ones(4))
    dcp.save({"a": torch.ones(4)}, storage_writer=UCVolumeWriter(tmp_path / "fresh", overwrite=False))
    with pytest.raises(CheckpointExistsError, match="Checkpoint already exists"):
        save_checkpoint(tmp_path / "root", model=make_model(), step=1)
        save_checkpoint(tmp_path / "root", model=make_model(), step=1, overwrite=False)


def test_torchs_filesystem_writer_output_loads_through_load_checkpoint_style_reader(tmp_path):
    """A checkpoint written by torch's FileSystemWriter (so by databricks.air.data.UCVolumeWriter) with an
    optimizer loads with the seed's code and UCVolumeReader's defaults."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = trained(seed=3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=dcp.FileSystemWriter(str(tmp_path / "theirs")))
    m2 = make_model(9)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.01)
    msd, osd = get_state_dict(m2, o2)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=UCVolumeReader(tmp_path / "theirs"))
    set_state_dict(m2, o2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert same_model(model, m2)


# ---------------------------------------------------------------- quiet

def test_single_process_save_and_load_emit_no_warnings(tmp_path, staging):
    model, opt = trained()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=1)
        save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=2, async_=True).result(timeout=60)
        save_checkpoint(tmp_path / "ck", model=model, optimizer=opt, step=2)  # overwrite
        m2 = make_model(4)
        load_checkpoint(tmp_path / "ck", model=m2, optimizer=torch.optim.Adam(m2.parameters()))
    assert [str(w.message) for w in caught] == []
    with warnings.catch_warnings(record=True) as caught:  # the filter ends with our call
        warnings.simplefilter("always")
        dcp.save({"a": torch.ones(2)}, storage_writer=UCVolumeWriter(tmp_path / "plain"))
    assert any("torch.distributed is" in str(w.message) for w in caught)


# ---------------------------------------------------------------- /Volumes paths

def test_local_path_maps_volumes_under_the_catalog_root(tmp_path, monkeypatch):
    monkeypatch.setenv("UCMAGIC_CATALOG_ROOT", str(tmp_path / "cat"))
    vol = tmp_path / "cat" / "main" / "ml" / "volumes" / "ckpt"
    vol.mkdir(parents=True)
    target = ucmagic.local_path("/Volumes/main/ml/ckpt/sub-dir/ckpt.pt")
    assert target == str(vol / "sub-dir" / "ckpt.pt")
    os.makedirs(os.path.dirname(target))
    torch.save({"w": torch.ones(2)}, target)  # the seed's torch.save line, through local_path
    assert torch.equal(torch.load(ucmagic.local_path("/Volumes/main/ml/ckpt/sub-dir/ckpt.pt"),
                                  weights_only=True)["w"], torch.ones(2))
    assert ucmagic.local_path("/Volumes/main/ml/ckpt/data/*.parquet") == str(vol / "data" / "*.parquet")
    assert ucmagic.local_path(tmp_path / "x") == str(tmp_path / "x")
    with pytest.raises(SourceNotFoundError, match=r"volumes/nope does not exist: create it"):
        ucmagic.local_path("/Volumes/main/ml/nope/a.pt")
    with pytest.raises(SourceNotFoundError, match=r"volumes/nope does not exist"):
        save_checkpoint("/Volumes/main/ml/nope/run1", model=make_model(), step=1)


def test_local_path_without_catalog_root_says_what_to_set(monkeypatch):
    monkeypatch.delenv("UCMAGIC_CATALOG_ROOT", raising=False)
    with pytest.raises(SourceNotFoundError, match="not mounted here.*set UCMAGIC_CATALOG_ROOT"):
        ucmagic.local_path("/Volumes/no-such-catalog/s/v/ckpt.pt")
    assert ucmagic.local_path("relative/x.pt") == os.path.abspath("relative/x.pt")


# ---------------------------------------------------------------- pure pieces


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 10**6)), max_size=60), st.integers(1, 8))
def test_split_buckets_places_every_item_once_and_balances_tensor_bytes(items, n):
    tagged = [(k, is_blob, size) for k, (is_blob, size) in enumerate(items)]
    buckets = fmt.split_buckets(n, tagged, lambda i: i[2], is_bytes=lambda i: i[1])
    placed = [i for b in buckets for i in b]
    assert sorted(placed) == sorted(tagged) and all(buckets) and len(buckets) <= n
    loads = [sum(i[2] for i in b if not i[1]) for b in buckets]
    biggest = max((i[2] for i in tagged if not i[1]), default=0)
    if len(buckets) == n and loads:
        assert max(loads) - min(loads) <= biggest, "greedy largest-first keeps files within one item"


def test_missing_or_short_names_each_problem():
    assert fmt.missing_or_short({"a": 10, "b": 5, "c": 1}, {"a": 10, "b": 4, "c": None}) == [
        "b has 4 bytes but .metadata references 5", "c is missing"]
    assert fmt.missing_or_short({"a": 10}, {"a": 11}) == []


@given(st.binary(max_size=200))
def test_any_saving_record_means_in_progress_and_its_message_names_the_path(data):
    rec = fmt.parse_saving_record(data)
    assert isinstance(rec, dict)
    assert fmt.in_progress_message("/ck/step_1", rec).startswith("/ck/step_1: ")
    assert not fmt.is_committed_by("s1", {"save_id": "s2"}) and fmt.is_committed_by("s1", {"save_id": "s1"})


def test_a_missing_private_torch_hook_names_the_torch_version_needed():
    from ucmagic import _torch_compat as compat
    from ucmagic.errors import TorchVersionError

    with pytest.raises(TorchVersionError, match=r"needs torch >= \d+\.\d+.*pip install"):
        compat.storage_location({"i": object()}, "i")
    with pytest.raises(TorchVersionError, match="needs torch >="):
        compat.install_filesystem(object(), None)


def test_two_rank_gloo_save_reshards_rowwise_to_columnwise_and_to_one_process(tmp_path, staging):
    """As torch's file-system checkpoint tests: a row-sharded tensor saved by 2 ranks loads column-sharded
    on 2 ranks and whole in one process."""
    tensor_mod = pytest.importorskip("torch.distributed.tensor")
    if not hasattr(tensor_mod, "distribute_tensor"):
        pytest.skip("this torch has no public DTensor API")
    path = str(tmp_path / "ck")
    script = tmp_path / "reshard.py"
    script.write_text(PRELUDE + textwrap.dedent(f"""
        import datetime, warnings
        warnings.simplefilter("ignore")
        import torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        from ucmagic import UCVolumeReader, UCVolumeWriter
        rank = int(os.environ["RANK"])
        dist.init_process_group("gloo", init_method=os.environ["PG_INIT"], rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=90))
        print("READY", flush=True)
        mesh = init_device_mesh("cpu", (2,))
        full = torch.arange(96.0).reshape(8, 12)
        dcp.save({{"w": distribute_tensor(full, mesh, [Shard(0)]), "n": 5}}, storage_writer=UCVolumeWriter({path!r}))
        target = {{"w": distribute_tensor(torch.zeros(8, 12), mesh, [Shard(1)]), "n": 0}}
        dcp.load(target, storage_reader=UCVolumeReader({path!r}))
        assert torch.equal(target["w"].full_tensor(), full) and target["n"] == 5
        dist.barrier()
        dist.destroy_process_group()
        print("OK", rank)
        """))
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(staging), OMP_NUM_THREADS="1")
    run_ranks(str(script), env=env, timeout=240)
    names = os.listdir(path)
    assert any(n.startswith("__0_") for n in names) and any(n.startswith("__1_") for n in names)
    target = {"w": torch.zeros(8, 12), "n": 0}
    dcp.load(target, storage_reader=UCVolumeReader(path))
    assert torch.equal(target["w"], torch.arange(96.0).reshape(8, 12)) and target["n"] == 5


def test_a_forked_child_does_not_wait_for_or_report_its_parents_saves(tmp_path):
    p = run_script(tmp_path, "fork.py", f"""
        import multiprocessing as mp
        from concurrent.futures import Future
        from ucmagic.checkpoints.exit import track_pending_save
        track_pending_save({str(tmp_path / "ck")!r}, Future())   # a save the parent never finishes
        child = mp.get_context("fork").Process(target=print, args=("child ran",))
        child.start(); child.join()
        print("child exit", child.exitcode)
        os._exit(0)
        """, timeout=120)
    assert "child ran" in p.stdout and "child exit 0" in p.stdout, p.stdout + p.stderr


def _between_reads(monkeypatch, step):
    """Run ``step()`` once, right after the first file a reader reads (a writer acting between two reads)."""
    from ucmagic.checkpoints import commit

    real, done = xfer.read_bytes, []

    def read_bytes(remote):
        try:
            return real(remote)
        finally:
            if not done:
                done.append(True)
                step()

    monkeypatch.setattr(commit.xfer, "read_bytes", read_bytes)


def test_a_save_that_begins_between_a_readers_two_reads_is_seen_in_progress(tmp_path, monkeypatch):
    """A save withdraws the old marker only after writing its record: a reader that read the old
    marker and then finds a record refuses (never "not committed", never the old checkpoint)."""
    from ucmagic.checkpoints.commit import read_commit

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / fmt.COMMIT_NAME).write_bytes(fmt.make_commit(kind=fmt.FORMAT_DCP, save_id="old", files={}))

    def begin():  # the writer's first step: record, then withdraw the old marker
        (d / fmt.SAVING_NAME).write_bytes(fmt.make_saving_record(save_id="new", host="h", pid=1))
        (d / fmt.COMMIT_NAME).unlink()

    _between_reads(monkeypatch, begin)
    with pytest.raises(CheckpointInProgressError):
        read_commit(str(d))


def test_a_save_that_commits_between_a_readers_two_reads_is_read_as_committed(tmp_path, monkeypatch):
    from ucmagic.checkpoints.commit import read_commit

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / fmt.SAVING_NAME).write_bytes(fmt.make_saving_record(save_id="new", host="h", pid=1))

    def finish():  # the writer's last steps: the new marker, then the record goes
        (d / fmt.COMMIT_NAME).write_bytes(fmt.make_commit(kind=fmt.FORMAT_DCP, save_id="new", files={}))
        (d / fmt.SAVING_NAME).unlink()

    _between_reads(monkeypatch, finish)
    assert read_commit(str(d))["save_id"] == "new"
