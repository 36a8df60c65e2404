"""The trainers table (issue 49, docs/trainers.md "Resume, recipe by recipe"): every trainer's documented resume
recipe x every way the data is passed (the ucmagic dataset itself, the seeds' wrapper, a map-style dataset), on two
CPU ranks over gloo, 43 items (one padded repeat per epoch), batches of 4, 2 workers per rank. Each cell runs the
trainer to ``STOP`` steps into epoch 1 and checkpoints there, then a new run resumes the trainer's way to the end of
epoch 2 (tests/scripts/trainer_table.py). Each cell is one of:

- ``exact``: epoch 0 whole, epoch 1 before + after the resume whole, epoch 2 whole: every item exactly once per
  epoch across the ranks, but for the one repeat that evens the ranks out (and one more where the resume re-pads);
- ``refused``: the first batch of the recipe that cannot be exact raises ``ucmagic.ResumeRecipeError``, naming the
  recipe that is (before: items lost or repeated silently);
- ``restart``: the recipe restarts the saved epoch by design (Accelerate without a registered loader and without
  ``skip_first_batches``): each epoch of the new run is whole.

Marker ``trainers``; one cell per trainer runs in the default suite, the whole table with ``pytest --full``. A
phase that hangs dumps every thread's stack (faulthandler in the child; py-spy of every process of the phase when
it has to be killed), so a hang names where it stopped.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
from collections import Counter
from typing import Any

import pytest

from run_size import FULL

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "scripts", "trainer_table.py")
sys.path.insert(0, os.path.join(HERE, "scripts"))
N, STOP, BATCH = 43, 2, 4
PHASE_TIMEOUT = 420  # seconds before a phase is killed (the child dumps its stacks at TRAINER_TABLE_HANG first)

EXACT, REFUSED, RESTART = "exact", "refused", "restart"
ALL3 = ("files", "wrapper", "map")
TABLE: dict[tuple[str, str], dict[str, str]] = {
    ("lightning", "fit"): dict.fromkeys(ALL3, EXACT),
    ("accelerate", "register"): dict.fromkeys(ALL3, EXACT),
    ("accelerate", "register_skip"): dict.fromkeys(ALL3, REFUSED),
    ("accelerate", "skip_set_epoch"): {"files": EXACT, "wrapper": EXACT, "map": REFUSED},
    ("accelerate", "skip"): dict.fromkeys(ALL3, REFUSED),
    ("accelerate", "restart"): dict.fromkeys(ALL3, RESTART),
    ("hf", "max_steps"): dict.fromkeys(ALL3, EXACT),
    ("hf", "epochs"): dict.fromkeys(ALL3, EXACT),
    ("stateful", "stateful"): dict.fromkeys(ALL3, EXACT),
    ("stateful", "stateless"): {"wrapper": REFUSED},
    ("plain", "loop"): dict.fromkeys(ALL3, EXACT),
}
# the default suite's cell of each trainer: the cases 1, 2, 6, 4 and the loop that counts its own epochs
DEFAULT = {("lightning", "fit", "files"), ("accelerate", "register_skip", "files"), ("hf", "epochs", "wrapper"),
           ("stateful", "stateful", "wrapper"), ("plain", "loop", "files")}
NEEDS = {"lightning": ["lightning"], "accelerate": ["accelerate"], "hf": ["transformers", "accelerate"],
         "stateful": ["torchdata"], "plain": []}

CELLS = [(t, r, d, want) for (t, r), row in TABLE.items() for d, want in row.items()]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[int]:
    rows = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split("\n")
    kids: dict[int, list[int]] = {}
    for row in rows:
        if row.strip():
            p, pp = map(int, row.split())
            kids.setdefault(pp, []).append(p)
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += kids.get(p, [])
    return out


def _stacks(pid: int) -> str:
    """py-spy dumps of ``pid`` and every process under it (where py-spy is installed)."""
    out = []
    for p in _descendants(pid):
        try:
            got = subprocess.run(["py-spy", "dump", "--pid", str(p)], capture_output=True, text=True, timeout=30)
            out.append(f"--- pid {p}\n{got.stdout or got.stderr}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            out.append(f"--- pid {p}: no dump ({exc})")
    return "\n".join(out)


def run_phase(trainer: str, phase: str, cells: list[tuple[str, str]], data: str, tmp: str) -> None:
    port = _port()
    env = {**os.environ, "PYTHONPATH": os.path.join(HERE, "scripts") + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1", "TRAINER_TABLE_HANG": str(PHASE_TIMEOUT - 60),
           "UCMAGIC_CACHE_DIR": os.path.join(tmp, "cache")}
    args = [SCRIPT, trainer, phase, data, os.path.join(tmp, "out"), os.path.join(tmp, "ckpt"), json.dumps(cells)]
    launch = ["-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(port)]
    cmd = [sys.executable] + (args if trainer == "lightning" else launch + args)
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=PHASE_TIMEOUT)
    except subprocess.TimeoutExpired:
        stacks = _stacks(proc.pid)
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{trainer} {phase} {cells} hung past {PHASE_TIMEOUT}s; stacks:\n{stacks}\n"
                    f"--- output\n{out[-6000:]}")
    assert proc.returncode == 0, f"{trainer} {phase} {cells}: exit {proc.returncode}\n{out[-6000:]}"


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    """Runs the selected cells, a trainer's cells in one save run and one resume run (Lightning: one pair per cell);
    returns a function giving a cell's two phases' records (every rank's)."""
    from ucmagic.testing import make_files

    root = tmp_path_factory.mktemp("table")
    data = str(root / "vol")
    make_files(data, N, 64, per_dir=20)
    done: dict[str, str] = {}
    failed: dict[str, str] = {}

    def records(trainer: str, recipe: str, kind: str) -> dict[str, list[dict[str, Any]]]:
        for mod in NEEDS[trainer]:
            pytest.importorskip(mod)
        selected = [(r, d) for t, r, d, _ in CELLS if t == trainer and (FULL or (t, r, d) in DEFAULT)]
        groups = [[c] for c in selected] if trainer == "lightning" else [selected]
        group = next(g for g in groups if (recipe, kind) in g)
        key = f"{trainer}:{json.dumps(group)}"
        if key in failed:  # one run serves the group's cells: its failure is each cell's, said once in full
            pytest.fail(f"{trainer} {recipe} {kind}: the run of its group failed (see that cell):\n{failed[key]}")
        if key not in done:
            tmp = tempfile.mkdtemp(prefix="run", dir=root)
            try:
                for phase in ("save", "resume"):
                    run_phase(trainer, phase, [list(c) for c in group], data, tmp)
            except (AssertionError, pytest.fail.Exception) as e:
                failed[key] = str(e)[-2000:]
                raise
            done[key] = tmp
        out = os.path.join(done[key], "out")
        got = {}
        for phase in ("save", "resume"):
            got[phase] = []
            for r in (0, 1):
                path = os.path.join(out, f"{trainer}-{recipe}-{kind}-{phase}-rank{r}.json")
                got[phase].append(json.load(open(path)) if os.path.exists(path) else {"seen": {}, "error": None})
        return got

    return records


def _epoch(ranks: list[dict[str, Any]], e: int) -> list[int]:
    return [i for r in ranks for i in r["seen"].get(str(e), [])]


def _problems(what: str, got: list[int], pad: int) -> list[str]:
    c = Counter(got)
    missing = sorted(set(range(N)) - set(c))
    repeats = sum(n - 1 for n in c.values())
    out = []
    if missing:
        out.append(f"{what}: {len(missing)} of {N} missing (e.g. {missing[:4]})")
    if repeats > pad:
        out.append(f"{what}: {repeats} repeats (padding allows {pad}; e.g. {[k for k, n in c.items() if n > 1][:4]})")
    if any(not 0 <= i < N for i in c):
        out.append(f"{what}: items outside the data")
    return out


def _errors(got: dict[str, list[dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(phase, r["error"]) for phase, ranks in got.items() for r in ranks if r["error"]]


def judge(want: str, got: dict[str, list[dict[str, Any]]]) -> list[str]:
    errors = _errors(got)
    save, resume = got["save"], got["resume"]
    if want == REFUSED:
        if not errors:
            return ["expected ResumeRecipeError at the first batch, the recipe ran (data lost or repeated silently: "
                    f"resumed epoch 1 {len(_epoch(resume, 1))} items after {len(_epoch(save, 1))})"]
        phase, err = errors[0]
        if "ResumeRecipeError" not in err["mro"]:
            return [f"expected ResumeRecipeError, got {err['type']}: {err['msg'][:600]}\n{err['tb'][-1500:]}"]
        # at the first batch: nothing delivered in the phase that refused (the save run's pass, or the resumed one)
        delivered = sum(len(ids) for r in got[phase] for ids in r["seen"].values())
        return [] if delivered == 0 else [f"refused in the {phase} run after {delivered} items: not at the first batch"]
    if errors:
        phase, err = errors[0]
        return [f"{phase}: {err['type']}: {err['msg'][:800]}\n{err['tb'][-2000:]}"]
    out = _problems("epoch 0", _epoch(save, 0), 1)
    before = _epoch(save, 1)
    if len(before) != 2 * STOP * BATCH:
        out.append(f"epoch 1 before the checkpoint: {len(before)} items, expected {2 * STOP * BATCH}")
    if want == EXACT:
        out += _problems(f"epoch 1 (before {len(before)} + after {len(_epoch(resume, 1))})",
                         before + _epoch(resume, 1), 2)
    else:  # RESTART: the saved epoch runs again, whole
        out += _problems("epoch 1, run again", _epoch(resume, 1), 1)
    out += _problems("epoch 2", _epoch(resume, 2), 1)
    return out


def _param(t: str, r: str, d: str, want: str) -> Any:
    marks = [] if (t, r, d) in DEFAULT else [pytest.mark.full]
    return pytest.param(t, r, d, want, marks=marks, id=f"{t}-{r}-{d}")


@pytest.mark.trainers
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("trainer,recipe,data,want", [_param(*c) for c in CELLS])
def test_trainer_recipe_resumes_exactly_or_is_refused_by_name(trainer, recipe, data, want, table):
    """One cell of the table: exact per epoch and across the mid-epoch resume (later epochs too), refused by name
    at the first batch, or (Accelerate without registering or skipping) the saved epoch restarted whole."""
    problems = judge(want, table(trainer, recipe, data))
    assert not problems, f"{trainer} / {recipe} / {data} (expected {want}):\n" + "\n".join(problems)


HANG_REPEATS = int(os.environ.get("UCMAGIC_HANG_REPEATS", "20"))


@pytest.mark.trainers
@pytest.mark.full
@pytest.mark.timeout(3600)
@pytest.mark.parametrize("run", range(HANG_REPEATS))
def test_lightning_map_style_resume_never_hangs(run, tmp_path):
    """Round 4's full run hung once in Lightning's map-style resume: the cell again, HANG_REPEATS times (20;
    $UCMAGIC_HANG_REPEATS), each exact; a hang fails with every process's stacks (run_phase)."""
    pytest.importorskip("lightning")
    from ucmagic.testing import make_files

    data, tmp = str(tmp_path / "vol"), str(tmp_path / "run")
    make_files(data, N, 64, per_dir=20)
    os.makedirs(tmp)
    for phase in ("save", "resume"):
        run_phase("lightning", phase, [["fit", "map"]], data, tmp)
    got = {}
    for phase in ("save", "resume"):
        got[phase] = [json.load(open(os.path.join(tmp, "out", f"lightning-fit-map-{phase}-rank{r}.json")))
                      for r in (0, 1)]
    problems = judge(EXACT, got)
    assert not problems, f"run {run}:\n" + "\n".join(problems)
