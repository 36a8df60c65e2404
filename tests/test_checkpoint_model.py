"""Never stale, never mixed: random sequences of checkpoint operations checked against a pure model of
"latest committed".

Operations: saves (sync, async, two async in flight into one step or two, on 1 or 2 ranks), a saving
process killed with SIGKILL at a random moment, a foreign file dropped into the root (with and without a
step word in its name), a flipped byte in a committed shard, ``keep=N``, load latest and load by step.
The model (:class:`Committed`) knows which step holds which value; every load must return the value the
model names for it, filled in every tensor (never an older value, never a mixture), or raise a named
ucmagic error while the target model stays exactly as it was. After every finished save, no step
directory is left that is not a committed checkpoint (a killed save's is reclaimed).

A few examples run in the default suite (~1 minute); ``UCMAGIC_CKPT_MODEL_EXAMPLES=N`` runs N per test.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ucmagic
from ucmagic.checkpoints.api import UCVolumeReader, UCVolumeWriter, list_checkpoints, load_checkpoint, save_checkpoint
from ucmagic.checkpoints.commit import EMPTY_AFTER_S, abandoned_dirs
from ucmagic.checkpoints.format import SAVING_NAME, parse_step_dirname
from ucmagic.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotCommittedError,
    NoCheckpointError,
)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # ranks, whatever pytest's import mode
from ranks import PRELUDE, run_ranks

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(ucmagic.__file__)))  # the code under test, also for children
EXAMPLES = int(os.environ.get("UCMAGIC_CKPT_MODEL_EXAMPLES", "0"))
_SETTINGS = {"deadline": None, "suppress_health_check": list(HealthCheck), "database": None,  # shrinking re-runs
             "phases": [Phase.generate, Phase.shrink] if os.environ.get("UCMAGIC_CKPT_MODEL_SHRINK") else
             [Phase.generate]}  # saves and kills: on request only


class Net(torch.nn.Module):
    """Three layers: a load that mixes two saves shows as tensors holding different values."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(128, 128) for _ in range(3))


def filled(value: float) -> Net:
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.fill_(value)
    return net


def values(net: torch.nn.Module) -> set[float]:
    """Every value the model's tensors hold (one value: a whole save; several: a mixture)."""
    return {float(v) for p in net.state_dict().values() for v in p.unique()}


# ---------------------------------------------------------------- the model of "latest committed"

@dataclasses.dataclass
class Committed:
    """What a load must return: committed ucmagic steps, foreign files named with a step word, damaged steps."""

    ours: dict[int, float] = dataclasses.field(default_factory=dict)
    foreign: dict[int, float] = dataclasses.field(default_factory=dict)
    corrupt: set[int] = dataclasses.field(default_factory=set)

    def saved(self, step: int, value: float, keep: int | None = None) -> None:
        self.ours[step] = value
        self.corrupt.discard(step)
        if keep is not None:  # the keep highest committed steps stay, and the one just saved
            for s in sorted(self.ours, reverse=True)[keep:]:
                if s != step:
                    del self.ours[s]
                    self.corrupt.discard(s)

    def latest(self) -> int | None:
        steps = set(self.ours) | set(self.foreign)
        return max(steps) if steps else None

    def expect(self, step: int | None) -> float | type[CheckpointError]:
        """The value a load of ``step`` (None: latest) returns, or the error class it raises."""
        step = self.latest() if step is None else step
        if step is None:
            return NoCheckpointError
        if step in self.ours:  # ucmagic's own step wins a tie with a foreign name
            return CheckpointCorruptError if step in self.corrupt else self.ours[step]
        if step in self.foreign:
            return self.foreign[step]
        return CheckpointError  # NoCheckpointError, or CheckpointNotCommittedError for a killed step


# ---------------------------------------------------------------- operations on a real root

FOREIGN_NAMES = ["model_20240601.pt", "resnet50.pth", "model_fp16.pt", "final.pt", "20240601.pt"]
FOREIGN_STEP_FORMS = ["epoch=0-step={}.ckpt", "checkpoint-{}.pt", "ckpt_{}.pth"]

_KILLED_SAVE = """
import os, sys, warnings
warnings.simplefilter("ignore")
import torch
import torch.distributed.checkpoint  # imported before GO: the delay counts from the save itself
from torch.distributed.checkpoint.state_dict import get_state_dict
from ucmagic.checkpoints.api import save_checkpoint
from ucmagic.checkpoints import writer
net = torch.nn.Module()
for name in "abc":
    layer = torch.nn.Linear(128, 128)
    torch.nn.init.constant_(layer.weight, float(sys.argv[3])); torch.nn.init.constant_(layer.bias, float(sys.argv[3]))
    setattr(net, name, layer)
import time
from ucmagic.checkpoints import transfer
upload = transfer.upload_file
def slow_upload(*args, **kwargs):  # a slow volume: the kill lands before, during or after the upload
    time.sleep(0.15)
    return upload(*args, **kwargs)
transfer.upload_file = slow_upload
print("GO", flush=True)
save_checkpoint(sys.argv[1], model=net, step=int(sys.argv[2]), files_per_rank=8, upload_threads=1)
print("SAVED", flush=True)
"""


class Run:
    """One root and its model; each method does one operation and checks it."""

    def __init__(self, tmp: str) -> None:
        self.root = os.path.join(tmp, "root")
        self.tmp = tmp
        self.model = Committed()
        self.value = 0.0
        self.kills = 0
        self.log: list[str] = []  # what was done, for the failure message

    def next_value(self) -> float:
        self.value += 1.0
        return self.value

    def _check_no_leftovers(self) -> None:
        """Every step directory is a committed checkpoint: a killed or superseded save's is reclaimed. One kind
        may stay a minute (EMPTY_AFTER_S): a save killed as it began, between making its folder and writing its
        record (an empty folder, or an empty record), cannot yet be told from a save beginning in another
        process; the next save or ``ckpt clean`` a minute later removes it."""
        if not os.path.isdir(self.root):
            return
        listed = {os.path.basename(i.path) for i in list_checkpoints(self.root)}
        stray = sorted(n for n in os.listdir(self.root) if n.startswith("step_") and n not in listed)
        later = set(abandoned_dirs(self.root, now=time.time() + EMPTY_AFTER_S + 1))
        for name in stray:
            d = os.path.join(self.root, name)
            inside = {n: os.path.getsize(os.path.join(d, n)) for n in os.listdir(d)}
            begun = (parse_step_dirname(name) or 0) > 10 and inside in ({}, {SAVING_NAME: 0})  # killed as it began
            assert begun, f"{name} ({inside}) left in the root after a save finished (not committed); ops: {self.log}"
            assert d in later, f"{name} ({inside}), a save killed as it began, is not reclaimed a minute later"

    def save(self, step: int, mode: str, keep: int | None) -> None:
        v = self.next_value()
        self.log.append(f"save({step}, {mode}, keep={keep}) = {v}")
        if mode == "sync":
            save_checkpoint(self.root, model=filled(v), step=step, keep=keep, files_per_rank=3)
        else:
            save_checkpoint(self.root, model=filled(v), step=step, keep=keep, async_=True,
                            files_per_rank=3).result(timeout=120)
        self.model.saved(step, v, keep)
        self._check_no_leftovers()

    def overlap(self, first: int, second: int) -> None:
        """Two async saves in flight: the newest started one is what a load of its step returns."""
        v1, v2 = self.next_value(), self.next_value()
        self.log.append(f"overlap(step {first} = {v1}, step {second} = {v2})")
        f1 = save_checkpoint(self.root, model=filled(v1), step=first, async_=True, files_per_rank=8, upload_threads=1)
        f2 = save_checkpoint(self.root, model=filled(v2), step=second, async_=True, files_per_rank=3)
        assert f2.result(timeout=120)
        try:
            f1.result(timeout=120)
        except CheckpointError:
            assert first == second, f"only a save superseded by a newer one into its step may fail; ops: {self.log}"
        self.model.saved(first, v1)
        self.model.saved(second, v2)
        self._check_no_leftovers()

    def kill(self, delay: float) -> None:
        """A process saving a new step is SIGKILLed ``delay`` seconds after it starts the save."""
        self.kills += 1
        step = 10 + self.kills  # a step no save used: it either committed or is not there
        v = self.next_value()
        self.log.append(f"kill(save({step}) = {v} after {delay:.2f} s)")
        os.makedirs(self.root, exist_ok=True)
        env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, self.root, str(step), str(v)],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "GO"
            time.sleep(delay)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=60)
        if step in {i.step for i in list_checkpoints(self.root)}:
            self.model.saved(step, v)  # it committed before the kill
        else:
            self.model.ours.pop(step, None)

    def foreign(self, name: str, step: int | None) -> None:
        v = self.next_value()
        self.log.append(f"foreign({name}) = {v}")
        os.makedirs(self.root, exist_ok=True)
        torch.save(filled(v).state_dict(), os.path.join(self.root, name))
        if step is not None:
            self.model.foreign[step] = v

    def corrupt(self, pick: int) -> None:
        steps = sorted(set(self.model.ours) - self.model.corrupt)  # a second flip of the same byte would undo it
        if not steps:
            return
        step = steps[pick % len(steps)]
        self.log.append(f"corrupt(step {step})")
        d = os.path.join(self.root, f"step_{step}")
        shard = os.path.join(d, max(n for n in os.listdir(d) if n.endswith(".distcp")))  # the last one torch reads
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0xFF]))
        self.model.corrupt.add(step)

    def load(self, step: int | None) -> None:
        """Load latest (None) or ``step`` into a fresh model and compare with what the model says."""
        expect = self.model.expect(step)
        self.log.append(f"load({'latest' if step is None else step}) -> {expect}")
        target = filled(-1.0)
        if not os.path.isdir(self.root):
            return
        try:
            got = load_checkpoint(self.root, "latest" if step is None else step, model=target)
        except CheckpointError as e:
            assert isinstance(expect, type), f"load raised {type(e).__name__}: {e}; expected {expect}; ops: {self.log}"
            assert isinstance(e, expect) or (expect is CheckpointError and isinstance(
                e, (NoCheckpointError, CheckpointNotCommittedError))), f"{type(e).__name__}: {e}; ops: {self.log}"
            assert values(target) == {-1.0}, f"a refused load changed the model ({values(target)}); ops: {self.log}"
            return
        assert not isinstance(expect, type), f"load returned {got}, expected {expect.__name__}; ops: {self.log}"
        assert values(target) == {expect}, f"loaded {sorted(values(target))}, expected {expect}; ops: {self.log}"
        if step is None:
            assert got[0] == self.model.latest(), f"loaded step {got[0]}, latest is {self.model.latest()}: {self.log}"


STEPS = st.integers(1, 6)
OPS = st.lists(st.one_of(
    st.tuples(st.just("save"), STEPS, st.sampled_from(["sync", "async"]), st.one_of(st.none(), st.integers(1, 3))),
    st.tuples(st.just("overlap"), STEPS, STEPS),
    st.tuples(st.just("kill"), st.floats(0.0, 1.5)),
    st.tuples(st.just("foreign"), st.sampled_from(FOREIGN_NAMES), st.none()),
    st.tuples(st.just("foreign"), st.sampled_from(FOREIGN_STEP_FORMS), st.integers(1, 8)),
    st.tuples(st.just("corrupt"), st.integers(0, 5)),
    st.tuples(st.just("load"), st.one_of(st.none(), STEPS)),
), min_size=2, max_size=9)


def _apply(run: Run, op: tuple) -> None:
    kind = op[0]
    if kind == "save":
        run.save(op[1], op[2], op[3])
    elif kind == "overlap":
        run.overlap(op[1], op[2])
    elif kind == "kill":
        run.kill(op[1])
    elif kind == "foreign":
        run.foreign(op[1], op[2])
    elif kind == "corrupt":
        run.corrupt(op[1])
    else:
        run.load(op[1])


def _stepped(ops: list[tuple]) -> list[tuple]:
    """Foreign names with a step word get steps 101-108 (apart from ucmagic's 1-6 and killed saves' 11-),
    formatted into the name."""
    out = []
    for op in ops:
        if op[0] == "foreign" and op[2] is not None:
            out.append(("foreign", op[1].format(op[2] + 100), op[2] + 100))
        else:
            out.append(op)
    return out


@pytest.mark.timeout(600)
@settings(max_examples=EXAMPLES or 4, **_SETTINGS)
@given(OPS)
def test_a_load_returns_the_newest_committed_state_or_a_named_error(tmp_path_factory, ops):
    run = Run(str(tmp_path_factory.mktemp("model")))
    for op in _stepped(ops):
        _apply(run, op)
    run.load(None)  # every sequence ends with a load of latest, and of each step the model knows
    for step in sorted(set(run.model.ours) | {1}):
        run.load(step)
    run.save(1, "sync", None)  # and a last save: nothing a killed save left may outlive it
    run.load(None)


def test_the_issues_sequences_hold(tmp_path, monkeypatch):
    """The sequences issue 41 reported, as explicit examples of the model: a dated file in the root, a damaged
    shard, a killed save, then load latest."""
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(tmp_path / "staging"))
    run = Run(str(tmp_path))
    run.save(2, "sync", None)
    run.save(3, "sync", None)
    run.foreign("model_20240601.pt", None)
    run.foreign("resnet50.pth", None)
    run.load(None)  # step 3, not 20240601 nor 50
    run.corrupt(1)
    run.load(None)  # step 3 is damaged: CheckpointCorruptError, the target untouched
    run.kill(0.8)
    run.save(5, "sync", 1)  # keep=1; the killed step_11, if it did not commit, is reclaimed
    run.load(None)
    run.load(11)


def test_overlapping_raw_dcp_async_saves_into_one_directory_the_newest_started_wins(tmp_path, monkeypatch):
    """The issue's sequence with UCVolumeWriter: a big save, then a small one into the same directory."""
    monkeypatch.setenv("UCMAGIC_STAGING_DIR", str(tmp_path / "staging"))
    path = str(tmp_path / "raw")
    f1 = dcp.async_save({"w": torch.full((3_000_000,), 1.0), "step": 1}, storage_writer=UCVolumeWriter(path))
    f2 = dcp.async_save({"w": torch.full((10,), 2.0), "step": 2}, storage_writer=UCVolumeWriter(path))
    f2.result()
    try:
        f1.result()
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException: the older save may fail, naming the newer
        assert "newer" in str(e) or "superseded" in str(e).lower(), e
    state = {"w": torch.zeros(10), "step": 0}
    dcp.load(state, storage_reader=UCVolumeReader(path))
    assert state["step"] == 2 and torch.equal(state["w"], torch.full((10,), 2.0))


# ---------------------------------------------------------------- two ranks

_RANKS = PRELUDE + """
import datetime, json, os, sys, warnings
warnings.simplefilter("ignore")
import torch, torch.distributed as dist
from ucmagic.checkpoints.api import save_checkpoint
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", init_method=os.environ["PG_INIT"], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
print("READY", flush=True)
def filled(v):
    net = torch.nn.Module()
    for name in "abc":
        layer = torch.nn.Linear(128, 128)
        torch.nn.init.constant_(layer.weight, v); torch.nn.init.constant_(layer.bias, v)
        setattr(net, name, layer)
    return net
root, ops = sys.argv[1], json.loads(sys.argv[2])
for op in ops:
    if op[0] == "sync":
        save_checkpoint(root, model=filled(op[2]), step=op[1])
    elif op[0] == "async":
        save_checkpoint(root, model=filled(op[2]), step=op[1], async_=True).result(timeout=60)
    else:  # two async saves in flight on both ranks
        f1 = save_checkpoint(root, model=filled(op[2]), step=op[1], async_=True)
        f2 = save_checkpoint(root, model=filled(op[4]), step=op[3], async_=True)
        f2.result(timeout=60)
        try:
            f1.result(timeout=60)
        except Exception as e:
            assert op[1] == op[3], f"rank {rank}: {type(e).__name__}: {e}"
    print("DONE", op, flush=True)
dist.barrier()
dist.destroy_process_group()
print("OK", rank, flush=True)
"""

RANK_OPS = st.lists(st.one_of(st.tuples(st.sampled_from(["sync", "async"]), st.integers(1, 3)),
                              st.tuples(st.just("overlap"), st.integers(1, 3), st.integers(1, 3))),
                    min_size=1, max_size=4).filter(lambda ops: any(o[0] == "overlap" for o in ops))


@pytest.mark.timeout(600)
@settings(max_examples=EXAMPLES or 1, **_SETTINGS)
@given(RANK_OPS)
def test_two_ranks_saving_in_any_order_leave_the_newest_started_state(tmp_path_factory, ops):
    tmp = tmp_path_factory.mktemp("ranks")
    model, value, concrete = Committed(), 0.0, []
    for op in ops:  # values in call order, as every rank calls them
        if op[0] == "overlap":
            concrete.append(["overlap", op[1], value + 1, op[2], value + 2])
            model.saved(op[1], value + 1)
            model.saved(op[2], value + 2)
            value += 2
        else:
            concrete.append([op[0], op[1], value + 1])
            model.saved(op[1], value + 1)
            value += 1
    script = tmp / "ranks.py"
    script.write_text(textwrap.dedent(_RANKS))
    import json

    root = str(tmp / "root")
    env = dict(os.environ, PYTHONPATH=REPO, UCMAGIC_STAGING_DIR=str(tmp / "staging"), OMP_NUM_THREADS="1")
    argv_script = str(script)
    # run_ranks runs "python script": pass the arguments through the environment-free argv by a wrapper
    wrapper = tmp / "wrapper.py"
    wrapper.write_text(f"import sys, runpy\nsys.argv = [{argv_script!r}, {root!r}, {json.dumps(concrete)!r}]\n"
                       f"runpy.run_path({argv_script!r}, run_name='__main__')\n")
    run_ranks(str(wrapper), env=env, timeout=150, hang_s=120)
    for step in sorted(model.ours):
        target = filled(-1.0)
        assert load_checkpoint(root, step, model=target)[0] == step
        assert values(target) == {model.ours[step]}, f"step {step}: {values(target)} != {model.ours[step]}: {concrete}"
    target = filled(-1.0)
    assert load_checkpoint(root, model=target)[0] == model.latest() and values(target) == {model.ours[model.latest()]}
