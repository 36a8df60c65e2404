"""Overlapping and killed saves (issue 41): saves in flight together never deadlock on any number of
ranks; into one directory the newest save started is the one a load returns once it commits (an older
one that finishes later does not commit and raises ``CheckpointSupersededError``); a killed save's
directory is reclaimed by the next save, ``keep`` or ``ucmagic ckpt clean``, and a reader says at once
that its owner is dead.

The one-directory promise has one oracle, :class:`LatestModel` (a pure model of what a load must see),
checked against real saves over generated interleavings of starts and completions
(``UCMAGIC_OVERLAP_EXAMPLES``, default 20, more for a longer run).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from typing import Any, Iterator

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint import CheckpointException

from ucmagic import (
    CheckpointAbandonedError,
    CheckpointInProgressError,
    CheckpointSupersededError,
    UCVolumeReader,
    UCVolumeWriter,
    distributed,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from ucmagic.checkpoints import commit
from ucmagic.checkpoints import format as fmt
from ucmagic.files.locks import process_tag

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
EXAMPLES = int(os.environ.get("UCMAGIC_OVERLAP_EXAMPLES", "20"))


@pytest.fixture()
def staging(tmp_path, monkeypatch):
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(tmp_path / "staging"))
    return tmp_path / "staging"


# ---------------------------------------------------------------- many ranks: no deadlock

@pytest.mark.timeout(400)
def test_two_ranks_with_two_async_saves_in_flight_both_commit(tmp_path, staging):
    """The issue's script: two save_checkpoint(async_=True) in flight on two gloo ranks, then raw
    dcp.async_save twice in flight with UCVolumeWriter, then a sync save while one is in flight."""
    root = str(tmp_path / "ck")

    @distributed(num_processes=2, timeout=240)
    def train(root: str) -> list[Any]:
        import torch
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp

        from ucmagic import UCVolumeWriter, save_checkpoint

        torch.manual_seed(0)
        m = torch.nn.Linear(64, 64)
        opt = torch.optim.Adam(m.parameters())
        futs = [save_checkpoint(root, model=m, optimizer=opt, step=s, async_=True) for s in (1, 2)]
        out = [f.result(timeout=180) for f in futs]
        rank = dist.get_rank()
        raw = [dcp.async_save({f"r{rank}": torch.full((1000,), float(k)), "k": k},
                              storage_writer=UCVolumeWriter(f"{root}/raw_{k}")) for k in (1, 2)]
        out += [str(f.result(timeout=180) is not None) for f in raw]
        fut = save_checkpoint(root, model=m, step=3, async_=True)
        out.append(save_checkpoint(root, model=m, step=4, keep=2))  # sync, while step 3 may be in flight
        out.append(fut.result(timeout=180))
        return out

    out = train.distributed(root)
    assert out[:2] == [f"{root}/step_1", f"{root}/step_2"] and out[2:4] == ["True", "True"]
    assert sorted(out[4:]) == [f"{root}/step_3", f"{root}/step_4"]
    assert [i.step for i in list_checkpoints(root) if i.path.rsplit("/", 1)[-1].startswith("step_")] == [3, 4]
    m = torch.nn.Linear(64, 64)
    assert load_checkpoint(root, model=m)[0] == 4
    torch.manual_seed(0)
    assert torch.equal(m.weight, torch.nn.Linear(64, 64).weight)
    for k in (1, 2):
        target = {"r0": torch.zeros(1000), "r1": torch.zeros(1000), "k": 0}
        dcp.load(target, storage_reader=UCVolumeReader(f"{root}/raw_{k}"))
        assert target["k"] == k and torch.equal(target["r1"], torch.full((1000,), float(k)))


# ---------------------------------------------------------------- one directory: the oracle

class LatestModel:
    """What a load of one directory must return while saves into it start and finish: the newest
    save started, once it commits; while a newer one is in flight, nothing (in progress); never an
    older state after a newer one committed. A save that finishes while a newer one has started is
    superseded: it commits nothing."""

    def __init__(self) -> None:
        self.latest: int | None = None  # newest save started
        self.committed: int | None = None
        self.loadable = False

    def start(self, i: int) -> None:
        self.latest, self.loadable = i, False

    def finish(self, i: int) -> str:
        if i != self.latest:
            return "superseded"
        self.committed, self.loadable = i, True
        return "committed"

    def load(self) -> int | str:
        return self.committed if self.loadable and self.committed is not None else "in progress"


def test_latest_model_never_returns_an_older_state_after_a_newer_commit():
    m = LatestModel()
    m.start(0)
    m.start(1)
    assert m.finish(1) == "committed" and m.load() == 1
    assert m.finish(0) == "superseded" and m.load() == 1


@st.composite
def schedules(draw: Any) -> list[tuple[str, int]]:
    """Starts in order 0..n-1 and each save's completion at any moment after its start."""
    n = draw(st.integers(2, 4))
    started, running, events = 0, [], []
    while started < n or running:
        if started < n and (not running or draw(st.booleans())):
            events.append(("start", started))
            running.append(started)
            started += 1
        else:
            i = running.pop(draw(st.integers(0, len(running) - 1)))
            events.append(("finish", i))
    return events


def _inner(exc: BaseException) -> BaseException:
    for pair in getattr(exc, "failures", {}).values():
        return pair[0] if isinstance(pair, tuple) else pair
    return exc


@pytest.mark.timeout(600)
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
@given(schedule=schedules(), last_sync=st.booleans())
def test_overlapping_saves_into_one_directory_follow_the_latest_model(tmp_path_factory, schedule, last_sync):
    """Real dcp.async_save saves (the last one sometimes a sync dcp.save) held before they write and let
    go in the generated order: after every event a load returns exactly what the model says."""
    path = str(tmp_path_factory.mktemp("overlap") / "ck")
    gates: dict[int, threading.Event] = defaultdict(threading.Event)
    entered: dict[int, threading.Event] = defaultdict(threading.Event)
    mu = threading.Lock()
    real = UCVolumeWriter.write_data

    def held(self: UCVolumeWriter, plan: Any, planner: Any) -> Any:
        with mu:
            gate, came = gates[id(self)], entered[id(self)]
        came.set()  # the save has begun (its record is written) and is about to write its shards
        assert gate.wait(120), "a save was never let go"
        return real(self, plan, planner)

    n = max(i for _, i in schedule) + 1
    model = LatestModel()
    futures: dict[int, Any] = {}
    writers: dict[int, UCVolumeWriter] = {}
    UCVolumeWriter.write_data = held  # type: ignore[method-assign]
    try:
        for event, i in schedule:
            state = {"w": torch.full((64,), float(i)), "i": i}
            if event == "start":
                writers[i] = UCVolumeWriter(path, warn_overwrite=False)
                if last_sync and i == n - 1:  # a sync save runs in a thread of its own; it starts when begun
                    res: dict[str, Any] = {}
                    t = threading.Thread(target=lambda s=state, w=writers[i], r=res: _sync_save(s, w, r))
                    t.start()
                    futures[i] = (t, res)
                    with mu:
                        came = entered[id(writers[i])]
                    _wait_until(lambda c=came, r=res: c.is_set() or bool(r))
                else:
                    futures[i] = dcp.async_save(state, storage_writer=writers[i])
                model.start(i)
            else:
                with mu:
                    gates[id(writers[i])].set()
                outcome = _outcome(futures[i])
                assert outcome == model.finish(i), (schedule, i, outcome)
            expected = model.load()
            target = {"w": torch.zeros(64), "i": -1}
            try:
                dcp.load(target, storage_reader=UCVolumeReader(path))
                got: int | str = target["i"]
                assert torch.equal(target["w"], torch.full((64,), float(got)))  # never mixed
            except CheckpointInProgressError:
                got = "in progress"
            assert got == expected, (schedule, event, i)
    finally:
        UCVolumeWriter.write_data = real  # type: ignore[method-assign]
        for g in list(gates.values()):
            g.set()
    names = os.listdir(path)
    assert fmt.SAVING_NAME not in names
    live = {n for n in names if fmt.is_shard_name(n)}
    assert live == set(fmt.parse_commit((open(os.path.join(path, fmt.COMMIT_NAME), "rb").read()), path)["files"]) \
        - {fmt.METADATA_NAME}, "superseded saves leave no shards behind"


def _sync_save(state: dict[str, Any], writer: UCVolumeWriter, res: dict[str, Any]) -> None:
    try:
        dcp.save(state, storage_writer=writer)
        res["ok"] = True
    except BaseException as e:  # noqa: BLE001 - the outcome is checked by the test
        res["error"] = e


def _wait_until(cond: Any, limit: float = 120) -> None:
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "the save never began"
        time.sleep(0.01)


def _outcome(fut: Any) -> str:
    if isinstance(fut, tuple):
        t, res = fut
        t.join(120)
        err = res.get("error")
    else:
        try:
            fut.result(timeout=120)
            err = None
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException
            err = e
    if err is None:
        return "committed"
    assert isinstance(err, CheckpointException), err
    inner = _inner(err)
    assert isinstance(inner, CheckpointSupersededError), inner
    assert "newer save into the same directory" in str(inner)
    return "superseded"


@contextlib.contextmanager
def _first_write_held(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Inside the block, the first ``UCVolumeWriter.write_data`` (the first save's shards) waits until the event
    yielded is set; the event is set on leaving, so a failed assertion never leaves the save waiting."""
    real = UCVolumeWriter.write_data
    release = threading.Event()
    held = threading.Lock()

    def first_waits(self: UCVolumeWriter, plan: Any, planner: Any) -> Any:
        if held.acquire(blocking=False):  # the first caller only
            assert release.wait(120), "the save held first was never let go"
        return real(self, plan, planner)

    with monkeypatch.context() as m:
        m.setattr(UCVolumeWriter, "write_data", first_waits)
        try:
            yield release
        finally:
            release.set()


def test_the_issues_two_async_saves_into_one_path_load_the_newer(tmp_path, staging, monkeypatch):
    """f1 (big, so slower) and f2 into one path: f2 commits, f1's future raises CheckpointSupersededError
    inside torch's CheckpointException, a load finds step 2; save_checkpoint raises the error itself. The first
    save of each pair is held before it writes its shards until the second has committed: "slower" whatever the
    machine's load (a loaded machine let the big save commit before the second began)."""
    p = str(tmp_path / "ck")
    with _first_write_held(monkeypatch) as second_committed:
        f1 = dcp.async_save({"w": torch.full((3_000_000,), 1.0), "step": 1}, storage_writer=UCVolumeWriter(p))
        f2 = dcp.async_save({"w": torch.full((10,), 2.0), "step": 2}, storage_writer=UCVolumeWriter(p))
        assert f2.result(timeout=120) is not None
        second_committed.set()
    with pytest.raises(CheckpointException) as info:
        f1.result(timeout=120)
    assert isinstance(_inner(info.value), CheckpointSupersededError)
    target = {"w": torch.zeros(10), "step": 0}
    dcp.load(target, storage_reader=UCVolumeReader(p))
    assert target["step"] == 2 and torch.equal(target["w"], torch.full((10,), 2.0))

    root = tmp_path / "root"
    big = torch.nn.Linear(1000, 1000)
    small = torch.nn.Linear(1000, 1000)
    with _first_write_held(monkeypatch) as second_committed:
        g1 = save_checkpoint(root, model=big, step=5, async_=True)
        g2 = save_checkpoint(root, model=small, step=5, async_=True, extra={"which": "newer"})
        assert g2.result(timeout=120) == str(root / "step_5")
        second_committed.set()
    with pytest.raises(CheckpointSupersededError):
        g1.result(timeout=120)
    m = torch.nn.Linear(1000, 1000)
    assert load_checkpoint(root, model=m) == (5, {"which": "newer"})
    assert torch.equal(m.weight, small.weight)


def test_a_superseded_save_still_running_at_exit_is_not_reported_lost(tmp_path, staging):
    path = str(tmp_path / "ck")
    script = tmp_path / "exit.py"
    script.write_text(f"""
import warnings; warnings.simplefilter("ignore")
import torch, torch.distributed.checkpoint as dcp
from ucmagic import UCVolumeWriter
dcp.async_save({{"w": torch.full((3_000_000,), 1.0), "step": 1}}, storage_writer=UCVolumeWriter({path!r}))
dcp.async_save({{"w": torch.full((10,), 2.0), "step": 2}}, storage_writer=UCVolumeWriter({path!r}))
print("script ends")
""")
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(staging), OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=240,
                       check=False)
    assert p.returncode == 0 and "NOT saved" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    target = {"w": torch.zeros(10), "step": 0}
    dcp.load(target, storage_reader=UCVolumeReader(path))
    assert target["step"] == 2


# ---------------------------------------------------------------- killed saves

_KILLED = """
import os, sys, time, warnings
warnings.simplefilter("ignore")
import torch
from ucmagic import save_checkpoint
from ucmagic.checkpoints import transfer as xfer
real = xfer._copy
def slow(src, dst, **kw):  # a volume that stalls after the first shards
    n = len([x for x in os.listdir(os.path.dirname(dst)) if x.endswith(".distcp")])
    if n >= 2:
        open(sys.argv[2], "w").close()
        time.sleep(600)
    return real(src, dst, **kw)
xfer._copy = slow
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(8)])  # 8 MB: several shards
save_checkpoint(sys.argv[1], model=model, step=2, files_per_rank=8)
"""


def _killed_save(tmp_path) -> str:
    """A save of step 2 into ``<tmp>/root`` killed (SIGKILL) mid-upload; the step directory's path."""
    root = tmp_path / "root"
    flag = tmp_path / "stalled"
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(tmp_path / "staging"), OMP_NUM_THREADS="1")
    p = subprocess.Popen([sys.executable, "-c", _KILLED, str(root), str(flag)], env=env)
    try:
        end = time.monotonic() + 180
        while not flag.exists():
            assert p.poll() is None and time.monotonic() < end, "the save never reached its upload"
            time.sleep(0.05)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(60)
    step = root / "step_2"
    names = os.listdir(step)
    assert fmt.SAVING_NAME in names and any(n.endswith(".distcp") for n in names), names
    return str(step)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("reclaimer", ["next save with keep", "ckpt clean"])
def test_a_killed_saves_directory_is_reclaimed_and_a_reader_says_its_owner_is_dead(tmp_path, staging, reclaimer):
    step2 = _killed_save(tmp_path)
    root = os.path.dirname(step2)
    rec = json.loads(open(os.path.join(step2, fmt.SAVING_NAME)).read())
    assert rec["host"] and rec["pid"] and rec["owner"].startswith(f"{rec['pid']}-")  # host, pid, start time
    with pytest.raises(CheckpointAbandonedError, match="was killed") as info:
        UCVolumeReader(step2, wait=3600)  # not a wait: its saver is gone (a wait would run out the test's timeout)
    assert "waited" not in str(info.value)
    assert list_checkpoints(root) == []
    model = torch.nn.Linear(8, 8)
    if reclaimer == "next save with keep":
        save_checkpoint(root, model=model, step=3, keep=1)
    else:
        p = subprocess.run([sys.executable, "-m", "ucmagic", "ckpt", "clean", root], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=REPO), timeout=120, check=False)
        assert p.returncode == 0 and f"removed {step2}" in p.stdout, p.stdout + p.stderr
    assert not os.path.exists(step2)
    assert [i.step for i in list_checkpoints(root)] == ([3] if reclaimer != "ckpt clean" else [])


def _record(path: str, **fields: Any) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, fmt.SAVING_NAME), "w") as f:
        json.dump({"save_id": "s", "since": time.time(), "pid": 1, **fields}, f)
    with open(os.path.join(path, "__0_0.distcp"), "wb") as f:
        f.write(b"partial")


def _dead_tag() -> str:
    p = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                       check=True)
    return f"{int(p.stdout)}-1"  # a pid that has exited (and a start time no later process has)


def test_clean_removes_only_dead_owners_unless_forced_and_never_a_running_save(tmp_path, staging):
    import socket

    root = tmp_path / "root"
    here = socket.gethostname()
    save_checkpoint(root, model=torch.nn.Linear(4, 4), step=1)
    _record(str(root / "step_2"), host=here, owner=_dead_tag())
    _record(str(root / "step_3"), host="another-host", owner=_dead_tag())
    _record(str(root / "step_4"), host=here)  # an older ucmagic's record: no start time
    _record(str(root / "step_5"), host=here, owner=process_tag())  # a save running in this very process
    _record(str(root / "step_6"), host="another-host", owner="1-1", since=time.time() - 2 * 86400)  # old
    gone = commit.clean_checkpoints(root)
    assert gone == [str(root / "step_2"), str(root / "step_6")]
    with pytest.raises(CheckpointInProgressError) as info:
        UCVolumeReader(root / "step_3")
    assert not isinstance(info.value, CheckpointAbandonedError), "another host's save cannot be judged"
    assert commit.clean_checkpoints(root, force=True) == [str(root / "step_3"), str(root / "step_4")]
    assert sorted(os.listdir(root)) == ["step_1", "step_5"]
    assert [i.step for i in list_checkpoints(root)] == [1]


@given(state=st.sampled_from(["running", "dead", "unknown"]), age=st.floats(0, 10 * 86400), force=st.booleans())
def test_reclaimable_never_a_running_save_always_a_dead_one(state, age, force):
    got = commit.reclaimable({}, state=state, age_s=age, force=force)
    assert got == {"running": False, "dead": True, "unknown": force or age >= commit.ABANDONED_AFTER_S}[state]


@given(record=st.dictionaries(st.sampled_from(["host", "owner", "pid", "since", "save_id"]),
                              st.one_of(st.text(max_size=8), st.integers(), st.none()), max_size=5),
       alive=st.booleans())
def test_owner_state_judges_only_this_hosts_records_with_a_start_time(record, alive):
    state = commit.owner_state(record, host="h", alive=lambda tag: alive)
    checkable = record.get("host") == "h" and isinstance(record.get("owner"), str) and record.get("owner")
    assert state == ("unknown" if not checkable else "running" if alive else "dead")
